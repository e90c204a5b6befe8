//! Damaging an image on purpose, for checker tests: change one item of a tree in place,
//! reseal its block and write every copy.

use butter::ctree::{Root, TreeIter};
use butter::format::csum::CSUM_SLOT;
use butter::format::*;
use butter::fs::Fs;
use butter::io::disk_io::Readahead;
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The current root of tree `id` (from its root item).
pub fn tree_root(fs: &Fs, id: u64) -> Root {
    let ri = fs.find_root_item(id).unwrap().unwrap();
    Root {
        id,
        bytenr: ri.bytenr,
        level: ri.level,
        generation: ri.generation,
    }
}

/// Finds the first item of tree `id` matching `pred` (the last one if `last`), lets `edit`
/// change the block (`edit(block, item_header_offset, item_data_offset)`), recomputes the
/// block checksum and writes every copy. Returns the item's (key after edit, block, slot).
pub fn patch_item(
    img: &Path,
    id: u64,
    last: bool,
    pred: impl Fn(&Key, &[u8]) -> bool,
    edit: impl FnOnce(&mut [u8], usize, usize),
) -> (Key, u64, usize) {
    let fs = Fs::open(img).unwrap();
    let root = if id == ROOT_TREE_OBJECTID {
        fs.tree_root()
    } else {
        tree_root(&fs, id)
    };
    let mut it = TreeIter::new(fs.disk().clone(), root, Key::MIN, Readahead::None).unwrap();
    let mut found = None;
    while let Some(item) = it.next_item().unwrap() {
        if pred(&item.key, item.data()) {
            found = Some(item);
            if !last {
                break;
            }
        }
    }
    let item = found.expect("item to damage not found");
    let mut block = item.block.data.to_vec();
    let hdr = HEADER_SIZE + item.slot * ITEM_SIZE;
    let data = HEADER_SIZE + item.block.item(item.slot).offset as usize;
    edit(&mut block, hdr, data);
    let c = fs.disk().sb.csum_type.compute(&block[CSUM_SLOT..]);
    let n = fs.disk().sb.csum_type.size();
    block[..n].copy_from_slice(&c[..n]);
    let copies = fs
        .disk()
        .chunk_map()
        .map(item.block.bytenr, fs.disk().nodesize() as u64)
        .unwrap();
    let f = fs::OpenOptions::new().write(true).open(img).unwrap();
    for c in copies {
        f.write_all_at(&block, c.physical).unwrap();
    }
    f.sync_all().unwrap();
    let key = Key::from_bytes(&block[hdr..hdr + DISK_KEY_SIZE]);
    (key, item.block.bytenr, item.slot)
}
