//! What tests, benchmarks and the fuzz crate need and a library user does not, built with the
//! `internals` feature (and under `cfg(test)`): the RAM device with fault injection and power
//! cuts, and tools that damage an image on purpose (what btrfs-corrupt-block does for
//! btrfs-progs' tests). Nothing here is a stable interface.

use std::sync::Arc;

use crate::ctree::{open_disk, Root, TreeIter};
use crate::error::{Error, Result};
use crate::format::*;
use crate::ids::Key;
use crate::inspect::root_items;
use crate::io::device::BlockDevice;
use crate::io::disk_io::{Disk, Readahead};

pub use crate::io::ram::{Faults, RamDevice};

/// Rewrites tree block `bytenr` of the filesystem on `dev` in place, as a repair or a
/// test's deliberate damage does (what btrfs-corrupt-block does for progs): `edit` changes the
/// bytes of its first copy, then the checksum is recomputed and every copy written and
/// flushed. Nothing else is kept consistent; that is the caller's to do or to break. Returns
/// each copy's (physical offset, bytes before), to undo the change with.
pub fn rewrite_block(
    dev: Arc<dyn BlockDevice>,
    bytenr: u64,
    edit: impl FnOnce(&mut [u8]),
) -> Result<Vec<(u64, Vec<u8>)>> {
    let disk = open_disk(dev.clone())?;
    rewrite_on(&disk, dev.as_ref(), bytenr, edit)
}

/// [`rewrite_block`] on a disk already open.
fn rewrite_on(
    disk: &Disk,
    dev: &dyn BlockDevice,
    bytenr: u64,
    edit: impl FnOnce(&mut [u8]),
) -> Result<Vec<(u64, Vec<u8>)>> {
    let ns = disk.nodesize() as usize;
    let copies = disk.chunk_map().map(bytenr, ns as u64)?;
    let mut before = Vec::with_capacity(copies.len());
    for c in &copies {
        let mut orig = vec![0u8; ns];
        dev.read_at(&mut orig, c.physical)
            .map_err(|e| Error::io(format!("reading tree block {bytenr}"), c.physical, e))?;
        before.push((c.physical, orig));
    }
    let Some((_, first)) = before.first() else {
        return Err(Error::corrupt(
            crate::error::Location::what(format!("tree block {bytenr}")),
            "no copy of it is mapped",
        ));
    };
    let mut block = first.clone();
    edit(&mut block);
    let csum = disk
        .sb
        .csum_type
        .compute(&block[crate::format::csum::CSUM_SLOT..]);
    let n = disk.sb.csum_type.size();
    block[..n].copy_from_slice(&csum[..n]);
    for c in &copies {
        dev.write_at(&block, c.physical)
            .map_err(|e| Error::io(format!("writing tree block {bytenr}"), c.physical, e))?;
    }
    dev.flush()
        .map_err(|e| Error::io("flushing the rewritten block", 0, e))?;
    Ok(before)
}

/// Rewrites the first item (with `last`, the last) of tree `tree` for which `pick(key, data)`
/// holds: `edit(block, item_header_offset, item_data_offset)` changes the bytes of its block,
/// which [`rewrite_block`] then reseals and writes. Returns the item's key after the edit, its
/// block and its slot; an error when no item matches.
pub fn rewrite_item(
    dev: Arc<dyn BlockDevice>,
    tree: u64,
    last: bool,
    pick: impl Fn(&Key, &[u8]) -> bool,
    edit: impl FnOnce(&mut [u8], usize, usize),
) -> Result<(Key, u64, usize)> {
    let disk = open_disk(dev.clone())?;
    let sb = &disk.sb;
    let tree_root = Root::of_root_tree(sb);
    let root = if tree == ROOT_TREE_OBJECTID {
        tree_root
    } else if tree == CHUNK_TREE_OBJECTID {
        Root {
            id: tree,
            bytenr: sb.chunk_root,
            level: sb.chunk_root_level,
            generation: sb.chunk_root_generation,
        }
    } else {
        let found = root_items(&disk, tree_root)?
            .into_iter()
            .find(|(k, _)| k.objectid == tree);
        let Some((_, ri)) = found else {
            return Err(Error::NotFound(format!("tree {tree} in the root tree")));
        };
        let ri = ri?;
        Root {
            id: tree,
            bytenr: ri.bytenr,
            level: ri.level,
            generation: ri.generation,
        }
    };
    let mut it = TreeIter::new(disk.clone(), root, Key::MIN, Readahead::None)?;
    let mut found = None;
    while let Some(item) = it.next_item()? {
        if pick(&item.key, item.data()) {
            found = Some((
                item.block.bytenr,
                item.slot,
                item.block.item(item.slot).offset,
            ));
            if !last {
                break;
            }
        }
    }
    let Some((bytenr, slot, data_off)) = found else {
        return Err(Error::NotFound(format!("no item of tree {tree} matches")));
    };
    let hdr = HEADER_SIZE + slot * ITEM_SIZE;
    let data = HEADER_SIZE + data_off as usize;
    let mut key = None;
    rewrite_on(&disk, dev.as_ref(), bytenr, |block| {
        edit(block, hdr, data);
        key = Some(Key::from_bytes(&block[hdr..hdr + DISK_KEY_SIZE]));
    })?;
    let key = key.unwrap_or(Key::MIN);
    Ok((key, bytenr, slot))
}

/// Removes the first item of tree `tree` for which `pick(key, data)` holds from its leaf, in
/// place (the items after it close up; the block is resealed by [`rewrite_item`]). The
/// first item of a leaf is refused: its key is its parent's pointer key. Nothing else is
/// kept consistent. Returns the removed item's key.
pub fn remove_item(
    dev: Arc<dyn BlockDevice>,
    tree: u64,
    pick: impl Fn(&Key, &[u8]) -> bool,
) -> Result<Key> {
    let mut first = false;
    let (key, bytenr, _) = rewrite_item(dev, tree, false, pick, |blk, hdr, _| {
        let slot = (hdr - HEADER_SIZE) / ITEM_SIZE;
        if slot == 0 {
            first = true;
            return;
        }
        let u32_at =
            |b: &[u8], at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        // nritems: the header's u32 at 96; an item header is a key (17 bytes), then its
        // data's offset and size (u32 each, the offset from the end of the block header).
        let n = u32_at(blk, 96) as usize;
        let head = |i: usize| HEADER_SIZE + i * ITEM_SIZE;
        let (off, size) = (
            u32_at(blk, hdr + 17) as usize,
            u32_at(blk, hdr + 21) as usize,
        );
        let lowest = u32_at(blk, head(n - 1) + 17) as usize;
        // The data of the items after it lies below its own: moved up over it.
        blk.copy_within(
            HEADER_SIZE + lowest..HEADER_SIZE + off,
            HEADER_SIZE + lowest + size,
        );
        blk[HEADER_SIZE + lowest..HEADER_SIZE + lowest + size].fill(0);
        for i in slot + 1..n {
            let o = u32_at(blk, head(i) + 17) + size as u32;
            blk[head(i) + 17..head(i) + 21].copy_from_slice(&o.to_le_bytes());
        }
        blk.copy_within(head(slot + 1)..head(n), head(slot));
        blk[head(n - 1)..head(n)].fill(0);
        blk[96..100].copy_from_slice(&(n as u32 - 1).to_le_bytes());
    })?;
    if first {
        return Err(Error::Invalid(format!(
            "item {key} is the first of leaf {bytenr}: not removed"
        )));
    }
    Ok(key)
}

/// The tree blocks of the fsync log the superblock on `dev` names (the log root tree's and
/// every log tree's), in the order a walk from the log root meets them; empty when there is
/// no log.
pub fn log_blocks(dev: Arc<dyn BlockDevice>) -> Result<Vec<u64>> {
    let disk = open_disk(dev)?;
    Ok(crate::tree_log::replay::read_log(&disk)?
        .map(|log| log.blocks)
        .unwrap_or_default())
}
