//! Damaging an image on purpose, for checker tests: change one item of a tree in place,
//! reseal its block and write every copy.

use butter::format::Key;
use butter::io::device::FileDevice;
use std::path::Path;
use std::sync::Arc;

/// Finds the first item of tree `id` matching `pred` (the last one if `last`), lets `edit`
/// change the block (`edit(block, item_header_offset, item_data_offset)`), recomputes the
/// block checksum and writes every copy (butter::inspect::rewrite_item). Returns the item's
/// (key after edit, block, slot).
pub fn patch_item(
    img: &Path,
    id: u64,
    last: bool,
    pred: impl Fn(&Key, &[u8]) -> bool,
    edit: impl FnOnce(&mut [u8], usize, usize),
) -> (Key, u64, usize) {
    let dev = FileDevice::open(img, true).unwrap();
    butter::inspect::rewrite_item(Arc::new(dev), id, last, pred, edit)
        .unwrap_or_else(|e| panic!("damaging an item of tree {id} in {}: {e}", img.display()))
}
