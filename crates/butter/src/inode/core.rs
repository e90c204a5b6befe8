//! The parts the inode layer works on: the disk, the roots as the running transaction left
//! them, the transaction (the writer), the ordered extents of the writes in flight, the gate
//! and the latch. The facade (crate::fs) opens a filesystem into a `Core` and adds the
//! policies of concurrent callers, the commit scheduler and the close.

use crate::ctree::{self, Root, TreeIter};
use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::{Disk, Readahead};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::ids::Inode;

/// The parts of an open filesystem (see the module doc).
pub(crate) struct Core {
    pub(crate) disk: Arc<Disk>,
    /// Root tree as opened; [`Core::tree_root`] gives the current one.
    pub(crate) opened_tree_root: Root,
    pub(crate) csum_root: Option<Root>,
    /// Roots the write engine moved in the running transaction (shared with it).
    pub(crate) live: crate::transaction::LiveRoots,
    /// The write engine, when opened read-write.
    pub(crate) writer: Option<Mutex<crate::transaction::Writer>>,
    /// The write engine's allocator, shared: data space is allocated without the writer
    /// lock (crate::space::alloc), except with the legacy allocator.
    pub(crate) allocator: Option<Arc<crate::space::alloc::Allocator>>,
    /// The write engine's abort, readable without the writer lock.
    pub(crate) writer_aborted: Arc<std::sync::atomic::AtomicBool>,
    /// Opened to be made (`RwOptions::unfinished`): the superblocks carry the temporary
    /// magic until `Fs::close`.
    pub(crate) unfinished: std::sync::atomic::AtomicBool,
    /// Open handles per inode (an unlinked open file is kept as an orphan).
    pub(crate) open_files: Mutex<HashMap<Inode, u32>>,
    pub(crate) roots: Mutex<HashMap<u64, (Root, RootItem)>>,
    /// The subvolume mounted by default (DEFAULT_SUBVOL dir item, else 5).
    pub(crate) default_subvol: std::sync::atomic::AtomicU64,
    /// Held by log commits and transaction commits (crate::tree_log::write): one writes a
    /// superblock at a time.
    pub(crate) log_sync: Mutex<()>,
    /// fsync writes the log tree (else it commits the transaction).
    pub(crate) fsync_log: std::sync::atomic::AtomicBool,
    /// Range locks and ordered extents of the writes in progress (crate::inode::ordered).
    pub(crate) ordered: Arc<crate::inode::ordered::OrderedTrees>,
    /// Full delayed-allocation buffers written on a thread of their own (crate::inode::ordered).
    pub(crate) writeback: crate::inode::ordered::Writeback,
    /// Delayed preallocation: fallocates at files' ends kept in memory.
    pub(crate) prealloc: crate::inode::ordered::Preallocs,
    /// Extents longer than this are written without the writer lock (crate::inode::ordered);
    /// `u64::MAX` turns that off (for the benchmark's comparison).
    pub(crate) unlocked_writeback_above: std::sync::atomic::AtomicU64,
    /// fsync waits for the inode's writes in progress (off: the fsync rule that skips them;
    /// see [`Core::set_fsync_skips_writes_in_progress`]).
    pub(crate) fsync_waits_for_writes: std::sync::atomic::AtomicBool,
    /// The reader/writer gate and the abort latch for concurrent callers (crate::gate).
    pub(crate) gate: crate::gate::Gate,
    /// Compression of written data (`-o compress=`), and whether it is forced
    /// (`compress-force=`: every file, incompressible starts included).
    pub(crate) compress: Option<crate::format::compress::Compression>,
    pub(crate) compress_force: bool,
    /// Largest file stored inline, in bytes (the kernel's `max_inline=`, bounded by what one
    /// inline extent holds).
    pub(crate) max_inline: usize,
}

impl Core {
    /// The root tree's current root.
    pub(crate) fn tree_root(&self) -> Root {
        self.live_root(ROOT_TREE_OBJECTID)
            .unwrap_or(self.opened_tree_root)
    }

    /// The superblock as last committed: the writer's on a filesystem open read-write (which
    /// has moved on from the one it was opened with), else the one read at the open.
    pub(crate) fn committed_sb(&self) -> crate::format::superblock::Superblock {
        match &self.writer {
            Some(w) => w.lock().unwrap_or_else(|e| e.into_inner()).sb.clone(),
            None => self.disk.sb.clone(),
        }
    }

    /// A root the running transaction moved.
    pub(crate) fn live_root(&self, id: u64) -> Option<Root> {
        self.live
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
            .copied()
    }

    /// The checksum tree's current root.
    pub(crate) fn csum_root(&self) -> Option<Root> {
        self.live_root(CSUM_TREE_OBJECTID).or(self.csum_root)
    }

    /// Finds the ROOT_ITEM of a tree in the root tree.
    pub(crate) fn find_root_item(&self, id: u64) -> Result<Option<RootItem>> {
        let it = ctree::lookup_le(
            &self.disk,
            &self.tree_root(),
            &Key::new(id, ROOT_ITEM_KEY, u64::MAX),
        )?;
        match it {
            Some(it) if it.key.objectid == id && it.key.ty == ROOT_ITEM_KEY => Ok(Some(
                RootItem::parse(it.data()).map_err(|e| it.annotate(e))?,
            )),
            _ => Ok(None),
        }
    }

    /// The root of a subvolume tree (cached).
    pub(crate) fn subvol_root(&self, id: u64) -> Result<Root> {
        Ok(self.subvol(id)?.0)
    }

    /// The root item of a subvolume tree (cached; [`Core::forget_subvol`] drops it when the
    /// write engine changes it).
    pub(crate) fn subvol_item(&self, id: u64) -> Result<RootItem> {
        Ok(self.subvol(id)?.1)
    }

    pub(crate) fn subvol(&self, id: u64) -> Result<(Root, RootItem)> {
        if let Some(live) = self.live_root(id) {
            let cached = self
                .roots
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(&id)
                .map(|r| r.1.clone());
            // A tree the running transaction moved (or created): its ROOT_ITEM may still name
            // an older root block; the live root is the current one.
            let ri = match cached {
                Some(ri) => ri,
                None => {
                    let ri = self
                        .find_root_item(id)?
                        .ok_or_else(|| Error::NotFound(format!("subvolume {id}")))?;
                    // Cached with the live root: live roots are never dropped, so the cached
                    // root is never used for this tree again, only its item.
                    self.roots
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .insert(id, (live, ri.clone()));
                    ri
                }
            };
            return Ok((live, ri));
        }
        if let Some(r) = self
            .roots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&id)
        {
            return Ok(r.clone());
        }
        let ri = self
            .find_root_item(id)?
            .ok_or_else(|| Error::NotFound(format!("subvolume {id}")))?;
        let root = Root {
            id,
            bytenr: ri.bytenr,
            level: ri.level,
            generation: ri.generation,
        };
        self.roots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(id, (root, ri.clone()));
        Ok((root, ri))
    }

    /// Items of `ino` from its file extent item at or before `offset` (from its first one when
    /// there is none before): the start of every walk over a range of a file's extents.
    pub(crate) fn extent_items_from(&self, ino: Inode, offset: u64) -> Result<TreeIter> {
        let root = self.subvol_root(ino.root)?;
        let start_key = match ctree::lookup_le(
            &self.disk,
            &root,
            &Key::new(ino.ino, EXTENT_DATA_KEY, offset),
        )? {
            Some(i) if i.key.objectid == ino.ino && i.key.ty == EXTENT_DATA_KEY => i.key,
            _ => Key::new(ino.ino, EXTENT_DATA_KEY, 0),
        };
        TreeIter::new(self.disk.clone(), root, start_key, Readahead::None)
    }

    /// Drops the cached root item of subvolume `id` (after the write engine changed it).
    pub(crate) fn forget_subvol(&self, id: u64) {
        self.roots
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&id);
    }

    /// The default subvolume: the one a mount without `subvol=` shows (the root tree's
    /// "default" directory entry; 5, the top level, when there is none).
    pub(crate) fn default_subvolume(&self) -> u64 {
        self.default_subvol
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Root directory inode of the default subvolume.
    pub(crate) fn root_inode(&self) -> Inode {
        Inode {
            root: self.default_subvolume(),
            ino: FIRST_FREE_OBJECTID,
        }
    }

    /// Root directory of subvolume `id`.
    pub(crate) fn subvol_root_inode(&self, id: u64) -> Result<Inode> {
        let (_, ri) = self.subvol(id)?;
        Ok(Inode {
            root: id,
            ino: ri.root_dirid,
        })
    }

    /// Runs `io` (data I/O that touches no tree) out of the gate when the calling thread
    /// holds it as a data write ([`Core::write_gate`]); as it is otherwise. Changes that
    /// stopped meanwhile make it `Aborted` (the caller gives back what it allocated).
    pub(crate) fn outside_gate<R>(&self, io: impl FnOnce() -> Result<R>) -> Result<R> {
        let out = self.gate.step_out();
        let r = io();
        let was_out = out.was_out();
        drop(out);
        if was_out {
            if let Some(why) = self.gate.latched() {
                return Err(Error::Aborted(why));
            }
        }
        r
    }

    /// What the block allocator did so far (all zeros when read-only).
    pub(crate) fn alloc_stats(&self) -> crate::space::alloc::AllocStats {
        self.allocator
            .as_ref()
            .map(|a| a.stats())
            .unwrap_or_default()
    }

    /// Stops changes and commits for good (the latch); the first reason is kept.
    pub(crate) fn stop(&self, why: String) {
        self.gate.latch(why);
    }

    /// Whether changes stopped (as [`Core::stopped`], without taking the writer lock).
    pub(crate) fn has_stopped(&self) -> bool {
        self.gate.is_latched()
            || self
                .writer_aborted
                .load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Why changes stopped, if they did (the latch, or the write engine's abort).
    pub(crate) fn stopped(&self) -> Option<String> {
        if let Some(why) = self.gate.latched() {
            return Some(why);
        }
        let w = self.writer.as_ref()?;
        let w = w.lock().unwrap_or_else(|e| e.into_inner());
        w.check_writable().err().map(|e| e.to_string())
    }
}
