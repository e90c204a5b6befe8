//! `butter check --repair`: the checker's [`Fix`]es applied in one copy-on-write transaction,
//! committed only when the checker, run again on the new trees (still in memory) before
//! anything is written, finds strictly fewer problems and none it did not find before.
//! Otherwise nothing is written: the image stays exactly as it was.

use super::{Finding, Fix, Report};
use crate::error::{Error, Result};
use crate::format::items::InodeItem;
use crate::format::*;
use crate::inode::core::Core;

/// The fixes `report` offers, each once, in the order found.
pub(crate) fn plan(report: &Report) -> Vec<Fix> {
    let mut out: Vec<Fix> = Vec::new();
    for f in report.findings.iter().filter_map(|f| f.fix.as_ref()) {
        if !out.contains(f) {
            out.push(f.clone());
        }
    }
    out
}

/// Applies `fixes` in the running transaction of `core` (open read-write, untouched since it
/// was opened). Block group counts go first, before any tree changes allocate.
pub(crate) fn apply(core: &Core, fixes: &[Fix]) -> Result<()> {
    core.op(false, |w| {
        let mut groups = false;
        for f in fixes {
            match f {
                Fix::BlockGroupUsed { start, used } => {
                    let mut found = false;
                    w.allocator.for_each(|g| {
                        if g.start == *start {
                            g.used = *used;
                            g.dirty = true;
                            found = true;
                        }
                    });
                    if !found {
                        return Err(Error::NotFound(format!("block group {start}")));
                    }
                    groups = true;
                }
                Fix::SuperBytesUsed => groups = true,
                _ => {}
            }
        }
        if groups {
            // The superblock's count follows the groups' (as the commit keeps it from here).
            let mut total = 0u64;
            w.allocator
                .for_each(|g| total = total.saturating_add(g.used));
            w.sb_bytes_used = total;
        }
        Ok(())
    })?;
    for f in fixes {
        match *f {
            Fix::InodeNlink { root, ino, nlink } => {
                set_inode(core, root, ino, |i| i.nlink = nlink)?
            }
            Fix::InodeSize { root, ino, size } => set_inode(core, root, ino, |i| i.size = size)?,
            Fix::InodeNbytes { root, ino, nbytes } => {
                set_inode(core, root, ino, |i| i.nbytes = nbytes)?
            }
            Fix::BlockGroupUsed { .. } | Fix::SuperBytesUsed => {}
        }
    }
    Ok(())
}

/// Changes one field of inode `ino`'s item in tree `root`, in the running transaction.
fn set_inode(core: &Core, root: u64, ino: u64, set: impl FnOnce(&mut InodeItem)) -> Result<()> {
    core.op(false, |w| {
        let key = Key::new(ino, INODE_ITEM_KEY, 0);
        let found = w.update_item(root, &key, |b| {
            let mut item = InodeItem::parse(b)?;
            set(&mut item);
            let body = item.to_bytes();
            if body.len() != b.len() {
                return Err(Error::Invalid(format!(
                    "inode {ino} of tree {root}: an item of {} bytes",
                    b.len()
                )));
            }
            b.copy_from_slice(&body);
            Ok(())
        })?;
        if !found {
            return Err(Error::NotFound(format!("inode {ino} of tree {root}")));
        }
        Ok(())
    })
}

/// The findings of `after` that `before` did not have (same kind, same place), and whether
/// `after` has strictly fewer findings: a repair's result is kept only with none new and
/// fewer in all.
pub(crate) fn judge<'a>(before: &Report, after: &'a Report) -> (Vec<&'a Finding>, bool) {
    let errors = |r: &Report| {
        r.findings
            .iter()
            .filter(|f| f.severity != super::Severity::Warning)
            .count()
    };
    let new: Vec<&Finding> = after
        .findings
        .iter()
        .filter(|f| f.severity != super::Severity::Warning)
        .filter(|f| {
            !before
                .findings
                .iter()
                .any(|b| b.kind == f.kind && same_place(&b.location, &f.location))
        })
        .collect();
    let fewer = errors(after) < errors(before);
    (new, fewer)
}

/// Two findings' places are the same item: the same tree and key (blocks move in a
/// copy-on-write transaction, so their addresses do not count), or the same description.
fn same_place(a: &crate::error::Location, b: &crate::error::Location) -> bool {
    if a.key.is_some() || b.key.is_some() {
        return a.tree == b.tree && a.key == b.key;
    }
    a.what == b.what && a.tree == b.tree
}
