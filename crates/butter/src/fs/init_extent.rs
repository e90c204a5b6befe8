//! `butter check --repair --init-extent-tree`: the extent tree made again from the other
//! trees. The extents every other tree uses (its blocks, the data its file extent items name)
//! are found with the back references those trees call for, the old extent tree is set aside
//! without reading it (it may be what is damaged), every block group's used bytes counted
//! again from nothing, and whatever space the old trees held that nothing uses now is freed
//! once the commit is on disk. One transaction, written only when the checker finds no
//! problem the filesystem did not have.

use super::Fs;
use crate::check::Fix;
use crate::error::Result;
use crate::format::*;
use crate::space::alloc::RangeSet;

impl Fs {
    /// Makes the extent tree again (see the module's description) on a filesystem open
    /// read-write with [`super::RwOptions::untouched`]. Returns the number of extents
    /// recorded. Refused before anything is written when another tree cannot be read or
    /// file extents disagree on an extent's length.
    pub fn init_extent_tree(&self, progress: &mut dyn FnMut(&str)) -> Result<u64> {
        let wanted = self.reading(None, |c| crate::check::expected_extents(c, progress))?;
        let mut extents: Vec<(u64, u64)> = wanted
            .iter()
            .filter_map(|f| match f {
                Fix::ExtentRefs { bytenr, len, .. } => Some((*bytenr, *len)),
                _ => None,
            })
            .collect();
        extents.sort_unstable();
        let n = extents.len() as u64;
        self.rescue_change("init_extent_tree", |c| {
            c.op(false, |w| {
                // Before anything is allocated: in each group, what is neither free nor used
                // by an extent found is the old extent tree's or held by nothing; it becomes
                // free once this commit is on disk. The used bytes start from nothing; each
                // extent item the commit makes counts its extent.
                let mut refused = None;
                w.allocator.for_each(|g| {
                    let mut gone = RangeSet::new();
                    let _ = gone.add(g.start, g.len);
                    for (s, l) in g.on_disk_free().iter() {
                        gone.remove(s, l);
                    }
                    let from = extents.partition_point(|e| e.0 < g.start);
                    for &(s, l) in extents[from..].iter().take_while(|e| e.0 < g.end()) {
                        gone.remove(s, l);
                    }
                    for (s, l) in gone.iter() {
                        if let Err(e) = g.pinned.add(s, l) {
                            refused.get_or_insert(e);
                        }
                    }
                    g.used = 0;
                    g.dirty = true;
                });
                if let Some(e) = refused {
                    return Err(crate::error::Error::Internal(format!(
                        "setting the old extent tree aside: {e}"
                    )));
                }
                w.sb_bytes_used = 0;
                // A new, empty extent tree (the old one's blocks were freed above, without
                // reading them).
                let leaf = w.new_block(EXTENT_TREE_OBJECTID, 0, Key::MIN)?;
                w.set_root(EXTENT_TREE_OBJECTID, leaf, 0)?;
                for f in &wanted {
                    if let Fix::ExtentRefs {
                        bytenr,
                        len,
                        level,
                        refs,
                    } = f
                    {
                        w.allocator.reserve(*bytenr, *len);
                        crate::check::repair::set_extent_refs(w, *bytenr, *len, *level, refs)?;
                    }
                }
                Ok(true)
            })
        })?;
        Ok(n)
    }
}
