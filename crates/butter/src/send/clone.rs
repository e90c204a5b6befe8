//! Clone sources: where the receiver already has the bytes of a data extent, so a CLONE
//! command can share them instead of a WRITE sending them again.
//!
//! The extent's back references (EXTENT_DATA_REF: tree, inode, file offset less the extent
//! offset; SHARED_DATA_REF: a leaf holding file extent items) name candidate files. A
//! reference may name the tree a snapshot was taken of rather than the snapshot itself, so
//! each candidate is checked in the snapshots the receiver has: the one being sent (only
//! where the stream already sent that file's range), the parent, and the clone sources. The
//! check reads the candidate file's extent item at that offset and wants the same extent
//! covering the whole range.

use crate::ctree::{self, TreeIter};
use crate::error::Result;
use crate::format::items::*;
use crate::format::*;
use crate::fs::Fs;
use crate::io::disk_io::Readahead;
use crate::send::tree::Snap;

/// At most this many back references of one extent are looked at.
const MAX_REFS: usize = 64;

/// A file of a snapshot holding the wanted bytes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CloneSource {
    /// Index into the snapshots given to [`find`].
    pub(crate) snap: usize,
    pub(crate) ino: u64,
    /// Offset in that file.
    pub(crate) offset: u64,
}

/// The range of one extent a file uses: `len` bytes from `extent_offset` of the extent at
/// `bytenr`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Wanted {
    pub(crate) bytenr: u64,
    pub(crate) extent_offset: u64,
    pub(crate) len: u64,
}

/// Candidate (inode, offset of the extent's start in the file) pairs from back references.
/// With `only_self`, an extent with one reference has none to offer.
fn candidates(fs: &Fs, w: &Wanted, only_self: bool) -> Result<Vec<(u64, u64)>> {
    let extent_root = fs.core().subvol_root(EXTENT_TREE_OBJECTID)?;
    let mut out = Vec::new();
    let mut shared_leaves = Vec::new();
    let mut it = TreeIter::range(
        fs.core().disk().clone(),
        extent_root,
        Key::new(w.bytenr, EXTENT_ITEM_KEY, 0),
        Key::new(w.bytenr, u8::MAX, u64::MAX),
        Readahead::None,
    )?;
    while let Some(item) = it.next_item()? {
        if out.len() + shared_leaves.len() >= MAX_REFS {
            break;
        }
        match item.key.ty {
            EXTENT_ITEM_KEY => {
                let e = ExtentItem::parse(item.data(), EXTENT_ITEM_KEY)
                    .map_err(|e| item.annotate(e))?;
                if only_self && e.refs <= 1 {
                    return Ok(Vec::new());
                }
                for r in e.inline_refs {
                    match r {
                        BackRef::ExtentData {
                            objectid, offset, ..
                        } => out.push((objectid, offset)),
                        BackRef::SharedData { parent, .. } => shared_leaves.push(parent),
                        _ => {}
                    }
                }
            }
            EXTENT_DATA_REF_KEY => {
                if let BackRef::ExtentData {
                    objectid, offset, ..
                } = parse_extent_data_ref(item.data()).map_err(|e| item.annotate(e))?
                {
                    out.push((objectid, offset));
                }
            }
            SHARED_DATA_REF_KEY => shared_leaves.push(item.key.offset),
            _ => {}
        }
    }
    for leaf in shared_leaves {
        let Ok(blk) = fs.core().disk().read_tree_block(leaf, &Default::default()) else {
            continue;
        };
        if blk.level() != 0 {
            continue;
        }
        for slot in 0..blk.nritems() {
            let k = blk.key(slot);
            if k.ty != EXTENT_DATA_KEY {
                continue;
            }
            let Ok(fe) = FileExtentItem::parse(blk.item_data(slot)) else {
                continue;
            };
            if let FileExtentBody::Extent {
                disk_bytenr,
                offset,
                ..
            } = fe.body
            {
                if disk_bytenr == w.bytenr {
                    out.push((k.objectid, k.offset.wrapping_sub(offset)));
                }
            }
        }
    }
    // The latest file first, as the kernel's walk finds them.
    out.sort_unstable_by(|a, b| b.cmp(a));
    out.dedup();
    Ok(out)
}

/// Whether file `ino` of `snap` has, at `offset`, an item of the same extent covering the
/// wanted range whole (and not preallocated).
fn holds(fs: &Fs, snap: &Snap, ino: u64, offset: u64, w: &Wanted) -> Result<bool> {
    let Some(it) = ctree::lookup_le(
        fs.core().disk(),
        &snap.root,
        &Key::new(ino, EXTENT_DATA_KEY, offset),
    )?
    else {
        return Ok(false);
    };
    if it.key.objectid != ino || it.key.ty != EXTENT_DATA_KEY {
        return Ok(false);
    }
    let Ok(fe) = FileExtentItem::parse(it.data()) else {
        return Ok(false);
    };
    if fe.ty != FILE_EXTENT_REG {
        return Ok(false);
    }
    let FileExtentBody::Extent {
        disk_bytenr,
        offset: eoff,
        num_bytes,
        ..
    } = fe.body
    else {
        return Ok(false);
    };
    // The item at it.key.offset maps file bytes to extent bytes from eoff.
    // Offsets from back references and items are not trusted: no sum may wrap.
    let start_in_extent = eoff.checked_add(offset - it.key.offset);
    Ok(disk_bytenr == w.bytenr
        && start_in_extent == Some(w.extent_offset)
        && offset.saturating_add(w.len) <= it.key.offset.saturating_add(num_bytes))
}

/// A place among `snaps` holding `w`'s bytes, where `usable(snap index, ino, offset)` says
/// the receiver has that file's range as the snapshot has it.
pub(crate) fn find(
    fs: &Fs,
    snaps: &[&Snap],
    w: &Wanted,
    only_self: bool,
    usable: &dyn Fn(usize, u64, u64) -> bool,
) -> Result<Option<CloneSource>> {
    for (ino, base) in candidates(fs, w, only_self)? {
        let offset = base.wrapping_add(w.extent_offset);
        for (i, snap) in snaps.iter().enumerate() {
            if usable(i, ino, offset) && holds(fs, snap, ino, offset, w)? {
                return Ok(Some(CloneSource {
                    snap: i,
                    ino,
                    offset,
                }));
            }
        }
    }
    Ok(None)
}
