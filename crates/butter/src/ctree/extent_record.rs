//! Reading the extent tree: an extent item with all its back references, and what the
//! running transaction's delayed references (crate::space::delayed_refs) add to it.
//!
//! Read-only, over a disk and the extent tree's root as the running transaction has it: the
//! copy-on-write code (crate::ctree::cow) asks whether a tree block is shared before it copies it,
//! and the reference runner (crate::transaction::extent_refs) reads the record it rewrites.

use crate::ctree::{Root, TreeIter};
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::{Disk, Readahead};
use crate::space::delayed_refs::{DelayedRefs, RefKey};
use std::collections::BTreeMap;
use std::sync::Arc;

/// An extent item with all its references (inline and keyed), as read from the extent tree.
#[derive(Debug, Clone)]
pub(crate) struct ExtentRecord {
    pub(crate) key: Key,
    pub(crate) generation: u64,
    pub(crate) flags: u64,
    pub(crate) tree_block_info: Option<(Key, u8)>,
    pub(crate) refs: BTreeMap<RefKey, u64>,
    /// Keyed reference items present now (their keys).
    pub(crate) keyed: Vec<Key>,
}

/// Finds an extent item (skinny or not) at `bytenr` in the extent tree at `root`.
fn find_extent_item(disk: &Arc<Disk>, root: Root, bytenr: u64) -> Result<Option<(Key, Vec<u8>)>> {
    let mut it = TreeIter::new(
        disk.clone(),
        root,
        Key::new(bytenr, EXTENT_ITEM_KEY, 0),
        Readahead::None,
    )?;
    while let Some(item) = it.next_item()? {
        if item.key.objectid != bytenr {
            break;
        }
        if item.key.ty == EXTENT_ITEM_KEY || item.key.ty == METADATA_ITEM_KEY {
            return Ok(Some((item.key, item.data().to_vec())));
        }
        if item.key.ty > METADATA_ITEM_KEY {
            break;
        }
    }
    Ok(None)
}

/// The extent at `bytenr` with its inline and keyed references, from the extent tree at
/// `root` (None if it has no extent item).
pub(crate) fn read_extent_record(
    disk: &Arc<Disk>,
    root: Root,
    bytenr: u64,
) -> Result<Option<ExtentRecord>> {
    let Some((rec, stored)) = read_extent_record_counted(disk, root, bytenr)? else {
        return Ok(None);
    };
    let total: u64 = rec.refs.values().sum();
    if total != stored {
        return Err(Error::corrupt(
            Location::what("extent item")
                .with_tree(EXTENT_TREE_OBJECTID)
                .with_key(rec.key),
            format!("extent item says {stored} references but {total} were found"),
        ));
    }
    Ok(Some(rec))
}

/// [`read_extent_record`] that does not hold the item's reference count against the back
/// references found, and returns it beside them (a repair mends the difference).
pub(crate) fn read_extent_record_counted(
    disk: &Arc<Disk>,
    root: Root,
    bytenr: u64,
) -> Result<Option<(ExtentRecord, u64)>> {
    let Some((key, body)) = find_extent_item(disk, root, bytenr)? else {
        return Ok(None);
    };
    let loc = || {
        Location::what("extent item")
            .with_tree(EXTENT_TREE_OBJECTID)
            .with_key(key)
    };
    let ei = ExtentItem::parse(&body, key.ty).map_err(|e| match e {
        Error::Corrupt { reason, .. } => Error::corrupt(loc(), reason),
        e => e,
    })?;
    let mut refs = BTreeMap::new();
    for r in &ei.inline_refs {
        if let Some((k, c)) = RefKey::from_backref(r) {
            *refs.entry(k).or_insert(0) += c;
        }
    }
    let mut keyed = Vec::new();
    let mut it = TreeIter::new(
        disk.clone(),
        root,
        Key::new(bytenr, TREE_BLOCK_REF_KEY, 0),
        Readahead::None,
    )?;
    while let Some(item) = it.next_item()? {
        if item.key.objectid != bytenr || item.key.ty > SHARED_DATA_REF_KEY {
            break;
        }
        let r = match item.key.ty {
            TREE_BLOCK_REF_KEY => Some((RefKey::TreeBlock(item.key.offset), 1)),
            SHARED_BLOCK_REF_KEY => Some((RefKey::SharedBlock(item.key.offset), 1)),
            EXTENT_DATA_REF_KEY => {
                let b = parse_extent_data_ref(item.data()).map_err(|e| item.annotate(e))?;
                RefKey::from_backref(&b)
            }
            SHARED_DATA_REF_KEY => {
                let d = item.data();
                if d.len() < 4 {
                    return Err(Error::corrupt(
                        item.loc(),
                        "shared data ref shorter than 4 bytes",
                    ));
                }
                Some((RefKey::SharedData(item.key.offset), le_u32(d, 0) as u64))
            }
            _ => None,
        };
        if let Some((k, c)) = r {
            *refs.entry(k).or_insert(0) += c;
            keyed.push(item.key);
        }
    }
    Ok(Some((
        ExtentRecord {
            key,
            generation: ei.generation,
            flags: ei.flags,
            tree_block_info: ei.tree_block_info,
            refs,
            keyed,
        },
        ei.refs,
    )))
}

/// Whether the data extent at `bytenr` belongs to `owner` (one file's reference) alone,
/// the kernel's test before a nodatacow write in place (btrfs_cross_ref_exist): every
/// reference, on disk and queued in `queue`, is `owner`'s, none is a keyed item, and the
/// extent was made after the subvolume's last snapshot (`last_snapshot`; an older extent may
/// be shared through the snapshot's tree blocks).
pub(crate) fn data_extent_exclusive(
    disk: &Arc<Disk>,
    root: Root,
    queue: &DelayedRefs,
    bytenr: u64,
    owner: RefKey,
    last_snapshot: u64,
) -> Result<bool> {
    let queued = match queue.map.get(&bytenr) {
        Some(p) => {
            if p.deltas.iter().any(|(k, d)| *d != 0 && *k != owner) {
                return Ok(false);
            }
            true
        }
        None => false,
    };
    let Some(rec) = read_extent_record(disk, root, bytenr)? else {
        // Made in this transaction: only the queued references exist.
        return Ok(queued);
    };
    if rec.generation <= last_snapshot || !rec.keyed.is_empty() {
        return Ok(false);
    }
    Ok(rec.refs.len() == 1 && rec.refs.contains_key(&owner))
}

/// Reference count and flags of the tree block at `bytenr`, counting what `queue` holds.
pub(crate) fn tree_block_refs_and_flags(
    disk: &Arc<Disk>,
    root: Root,
    queue: &DelayedRefs,
    bytenr: u64,
) -> Result<(u64, u64)> {
    let (delta, flags_set) = queue.pending(bytenr);
    let (refs, flags) = match read_extent_record(disk, root, bytenr)? {
        Some(r) => (r.refs.values().sum::<u64>(), r.flags),
        None if delta > 0 => (0, 0),
        None => {
            return Err(Error::corrupt(
                Location::what(format!("tree block {bytenr}")).with_tree(EXTENT_TREE_OBJECTID),
                "shared tree block has no extent item",
            ))
        }
    };
    let n = refs as i64 + delta;
    if n < 0 {
        return Err(Error::corrupt(
            Location::what(format!("tree block {bytenr}")).with_tree(EXTENT_TREE_OBJECTID),
            "reference count would drop below zero",
        ));
    }
    Ok((n as u64, flags | flags_set))
}
