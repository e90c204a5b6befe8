//! What a copy-on-write edit works on: the part of the running transaction that changing a
//! tree needs, lent by the transaction (crate::transaction owns one [`CowCtx`] and lends it).
//!
//! It holds the disk (whose overlay keeps the blocks the transaction changed), the running
//! transaction's id, the state of every tree it touched (root, level, snapshot generation),
//! the delayed reference queue, the allocator, the roots readers see, the abort latch and the
//! descent counter. The B-tree edits (crate::ctree::cow) and the reference runner
//! (crate::transaction::extent_refs) are methods on it; the commit, chunk allocation and the fsync log
//! stay with the transaction above.

use crate::ctree::Root;
use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::Disk;
use crate::space::alloc::{Allocator, SpaceKind};
use crate::space::delayed_refs::{DelayedRefs, RefKey};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, RwLock};

/// What the write engine knows about one tree.
#[derive(Debug, Clone)]
pub(crate) struct TreeState {
    pub id: u64,
    pub bytenr: u64,
    pub level: u8,
    pub generation: u64,
    /// Subvolume trees: blocks can be shared with snapshots.
    pub shareable: bool,
    pub last_snapshot: u64,
    /// Key of its ROOT_ITEM in the root tree (None for the root and chunk trees).
    pub item_key: Option<Key>,
    /// Root moved or contents changed in the running transaction.
    pub dirty: bool,
}

/// Roots as the running transaction sees them, shared with readers.
pub(crate) type LiveRoots = Arc<RwLock<HashMap<u64, Root>>>;

pub(crate) fn is_fs_tree(id: u64) -> bool {
    id == FS_TREE_OBJECTID
        || id == DATA_RELOC_TREE_OBJECTID
        || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id)
}

/// The copy-on-write context of the running transaction (see the module doc).
pub(crate) struct CowCtx {
    pub(crate) disk: Arc<Disk>,
    /// Id of the running transaction (last committed generation + 1).
    pub(crate) transid: u64,
    pub(crate) trees: BTreeMap<u64, TreeState>,
    pub(crate) refs: DelayedRefs,
    /// Shared with the file layer, which allocates data space without the writer lock.
    pub(crate) allocator: Arc<Allocator>,
    pub(crate) chunk_tree_uuid: [u8; 16],
    /// The superblock's bytes_used as the running transaction has it.
    pub(crate) sb_bytes_used: u64,
    pub(crate) live: LiveRoots,
    /// B-tree descents made (search_mut calls and their restarts).
    pub(crate) descents: u64,
    /// Why the transaction aborted, once it has: nothing more may be changed or written.
    pub(crate) aborted: Option<String>,
    /// Set with `aborted`, for those who check without the writer lock.
    pub(crate) abort_flag: Arc<std::sync::atomic::AtomicBool>,
    /// A repair may copy a block whose generation is past the running transaction's (a
    /// damaged one): otherwise such a block is refused as stale or misdirected.
    pub(crate) copy_future_blocks: bool,
}

impl CowCtx {
    /// Records why the transaction aborted.
    pub(crate) fn set_aborted(&mut self, why: String) {
        self.aborted = Some(why);
        self.abort_flag
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        match &self.aborted {
            Some(r) => Err(Error::Aborted(r.clone())),
            None => Ok(()),
        }
    }

    /// The state of a tree, loading its root item on first use.
    pub(crate) fn tree_state(&mut self, id: u64) -> Result<&TreeState> {
        if !self.trees.contains_key(&id) {
            let root = self.current_root(ROOT_TREE_OBJECTID)?;
            let it =
                crate::ctree::lookup_le(&self.disk, &root, &Key::new(id, ROOT_ITEM_KEY, u64::MAX))?;
            let it = match it {
                Some(it) if it.key.objectid == id && it.key.ty == ROOT_ITEM_KEY => it,
                _ => {
                    return Err(Error::NotFound(format!(
                        "root item of tree {}",
                        tree_name(id)
                    )))
                }
            };
            let ri = RootItem::parse(it.data()).map_err(|e| it.annotate(e))?;
            self.trees.insert(
                id,
                TreeState {
                    id,
                    bytenr: ri.bytenr,
                    level: ri.level,
                    generation: ri.generation,
                    shareable: is_fs_tree(id),
                    last_snapshot: ri.last_snapshot,
                    item_key: Some(it.key),
                    dirty: false,
                },
            );
        }
        Ok(&self.trees[&id])
    }

    /// Root of a tree as the running transaction sees it.
    pub(crate) fn current_root(&mut self, id: u64) -> Result<Root> {
        let t = self.tree_state(id)?;
        Ok(Root {
            id,
            bytenr: t.bytenr,
            level: t.level,
            generation: t.generation,
        })
    }

    /// Points a tree at a new root block (after COW, growth or shrink).
    pub(crate) fn set_root(&mut self, id: u64, bytenr: u64, level: u8) -> Result<()> {
        self.replace_root(id, bytenr, level, self.transid)
    }

    /// Points a tree at a root block of `generation`: this transaction's for a COWed or new
    /// root ([`CowCtx::set_root`]), the original's for a copy relocation made. The root item
    /// and readers get that generation.
    pub(crate) fn replace_root(
        &mut self,
        id: u64,
        bytenr: u64,
        level: u8,
        generation: u64,
    ) -> Result<()> {
        self.tree_state(id)?;
        let t = self
            .trees
            .get_mut(&id)
            .ok_or_else(|| Error::Internal(format!("tree {id} vanished")))?;
        t.bytenr = bytenr;
        t.level = level;
        t.generation = generation;
        t.dirty = true;
        self.live.write().unwrap_or_else(|e| e.into_inner()).insert(
            id,
            Root {
                id,
                bytenr,
                level,
                generation,
            },
        );
        Ok(())
    }

    /// Lets readers see the tree's root as the running transaction has it.
    pub(crate) fn publish_root(&self, id: u64, bytenr: u64, level: u8) {
        self.live.write().unwrap_or_else(|e| e.into_inner()).insert(
            id,
            Root {
                id,
                bytenr,
                level,
                generation: self.transid,
            },
        );
    }

    /// Allocates a tree block for `tree`.
    pub(crate) fn alloc_tree_block(&mut self, tree: u64) -> Result<u64> {
        self.check_writable()?;
        let ns = self.disk.nodesize() as u64;
        let kind = if tree == CHUNK_TREE_OBJECTID {
            SpaceKind::System
        } else {
            SpaceKind::Metadata
        };
        match self.allocator.alloc(kind, ns, ns) {
            Some(b) => Ok(b),
            None => Err(Error::NoSpace(format!(
                "no free {kind:?} space for a tree block of {} ({} bytes free, {} pinned until \
                 the commit ends)",
                tree_name(tree),
                self.allocator.free_bytes(kind),
                self.allocator.pinned_bytes(kind)
            ))),
        }
    }

    /// Reference count and flags of a tree block, counting what is queued.
    pub(crate) fn extent_refs_and_flags(&mut self, bytenr: u64, _level: u8) -> Result<(u64, u64)> {
        let root = self.current_root(EXTENT_TREE_OBJECTID)?;
        crate::ctree::extent_record::tree_block_refs_and_flags(&self.disk, root, &self.refs, bytenr)
    }

    /// Whether the data extent at `bytenr` belongs to `owner` alone (see
    /// [`crate::ctree::extent_record::data_extent_exclusive`]).
    pub(crate) fn data_extent_exclusive(
        &mut self,
        bytenr: u64,
        owner: RefKey,
        last_snapshot: u64,
    ) -> Result<bool> {
        let root = self.current_root(EXTENT_TREE_OBJECTID)?;
        crate::ctree::extent_record::data_extent_exclusive(
            &self.disk,
            root,
            &self.refs,
            bytenr,
            owner,
            last_snapshot,
        )
    }
}
