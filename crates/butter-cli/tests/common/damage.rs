//! Damaging an image on purpose, for checker tests: change one item of a tree in place,
//! reseal its block and write every copy.

use butter::format::Key;
use butter::io::device::FileDevice;
use std::path::Path;
use std::sync::Arc;

/// Finds the first item of tree `id` matching `pred` (the last one if `last`), lets `edit`
/// change the block (`edit(block, item_header_offset, item_data_offset)`), recomputes the
/// block checksum and writes every copy (butter::internals::rewrite_item). Returns the item's
/// (key after edit, block, slot).
pub fn patch_item(
    img: &Path,
    id: u64,
    last: bool,
    pred: impl Fn(&Key, &[u8]) -> bool,
    edit: impl FnOnce(&mut [u8], usize, usize),
) -> (Key, u64, usize) {
    let dev = FileDevice::open(img, true).unwrap();
    butter::internals::rewrite_item(Arc::new(dev), id, last, pred, edit)
        .unwrap_or_else(|e| panic!("damaging an item of tree {id} in {}: {e}", img.display()))
}

/// On-disk numbers the damage tests aim at, written down from the format's definition (the
/// kernel's btrfs_tree.h) rather than taken from butter, so a wrong constant in the engine
/// cannot hide in the test that damages what it names.
pub mod ondisk {
    /// Tree ids (the objectid of a tree's root item).
    pub const EXTENT_TREE: u64 = 2;
    pub const CSUM_TREE: u64 = 7;
    pub const QUOTA_TREE: u64 = 8;
    /// Item types (the key's type byte).
    pub const EXTENT_CSUM: u8 = 128;
    pub const BLOCK_GROUP_ITEM: u8 = 192;
    pub const QGROUP_INFO: u8 = 242;
}

/// Removes the first item of tree `id` matching `pred` from its leaf (not a leaf's first
/// item), resealing the block (butter::internals::remove_item). Returns its key.
pub fn remove_item(img: &Path, id: u64, pred: impl Fn(&Key, &[u8]) -> bool) -> Key {
    let dev = FileDevice::open(img, true).unwrap();
    butter::internals::remove_item(Arc::new(dev), id, pred)
        .unwrap_or_else(|e| panic!("removing an item of tree {id} in {}: {e}", img.display()))
}
