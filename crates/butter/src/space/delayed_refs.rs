//! Delayed references: the queue of reference changes a transaction makes to extents, kept
//! in memory until the commit applies them to the extent tree (crate::transaction::extent_refs).
//!
//! Data only: the queue knows extent addresses, sizes and per-reference deltas, nothing of
//! trees or disks, so the copy-on-write code (crate::ctree::cow) can queue into it from below the
//! code that runs it.

use crate::format::items::*;
use crate::format::*;
use std::collections::BTreeMap;

/// One back reference, without its count.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum RefKey {
    /// TREE_BLOCK_REF: tree `root` points at the block from one of its own blocks.
    TreeBlock(u64),
    /// SHARED_BLOCK_REF: the block at `parent` points at it (full back reference).
    SharedBlock(u64),
    /// EXTENT_DATA_REF: file extent items of `ino` in `root` at file offset - extent offset.
    Data { root: u64, ino: u64, offset: u64 },
    /// SHARED_DATA_REF: file extent items in the leaf at `parent`.
    SharedData(u64),
}

impl RefKey {
    pub(crate) fn to_backref(self, count: u64) -> BackRef {
        match self {
            RefKey::TreeBlock(root) => BackRef::TreeBlock { root },
            RefKey::SharedBlock(parent) => BackRef::SharedBlock { parent },
            RefKey::Data { root, ino, offset } => BackRef::ExtentData {
                root,
                objectid: ino,
                offset,
                count: count as u32,
            },
            RefKey::SharedData(parent) => BackRef::SharedData {
                parent,
                count: count as u32,
            },
        }
    }
    pub(crate) fn from_backref(b: &BackRef) -> Option<(RefKey, u64)> {
        Some(match b {
            BackRef::TreeBlock { root } => (RefKey::TreeBlock(*root), 1),
            BackRef::SharedBlock { parent } => (RefKey::SharedBlock(*parent), 1),
            BackRef::ExtentData {
                root,
                objectid,
                offset,
                count,
            } => (
                RefKey::Data {
                    root: *root,
                    ino: *objectid,
                    offset: *offset,
                },
                *count as u64,
            ),
            BackRef::SharedData { parent, count } => (RefKey::SharedData(*parent), *count as u64),
            BackRef::Owner { .. } => return None,
        })
    }
}

/// Queued changes to one extent.
#[derive(Debug, Clone)]
pub(crate) struct PendingExtent {
    pub(crate) num_bytes: u64,
    /// Tree blocks: level and first key (for non-skinny extent items).
    pub(crate) meta: Option<(u8, Key)>,
    /// Allocated in this transaction: the extent item does not exist yet.
    pub(crate) is_new: bool,
    /// Extent flags to set (FULL_BACKREF).
    pub(crate) flags_set: u64,
    pub(crate) deltas: BTreeMap<RefKey, i64>,
    /// The generation a new extent item gets, when not the running transaction's (a block
    /// or data extent copied by relocation keeps its original's).
    pub(crate) generation: Option<u64>,
}

/// Reference deltas waiting for the commit, by extent address.
#[derive(Debug, Default)]
pub(crate) struct DelayedRefs {
    pub(crate) map: BTreeMap<u64, PendingExtent>,
}

impl DelayedRefs {
    fn entry(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        meta: Option<(u8, Key)>,
    ) -> &mut PendingExtent {
        self.map.entry(bytenr).or_insert_with(|| PendingExtent {
            num_bytes,
            meta,
            is_new: false,
            flags_set: 0,
            deltas: BTreeMap::new(),
            generation: None,
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(crate) fn add_tree_ref(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        level: u8,
        key: Key,
        is_new: bool,
        r: RefKey,
        delta: i64,
    ) {
        let e = self.entry(bytenr, num_bytes, Some((level, key)));
        e.is_new |= is_new;
        *e.deltas.entry(r).or_insert(0) += delta;
    }

    pub(crate) fn add_data_ref(
        &mut self,
        bytenr: u64,
        num_bytes: u64,
        is_new: bool,
        r: RefKey,
        delta: i64,
    ) {
        let e = self.entry(bytenr, num_bytes, None);
        e.is_new |= is_new;
        *e.deltas.entry(r).or_insert(0) += delta;
    }

    pub(crate) fn set_flags(&mut self, bytenr: u64, num_bytes: u64, level: u8, flags: u64) {
        let e = self.entry(bytenr, num_bytes, Some((level, Key::MIN)));
        e.flags_set |= flags;
    }

    /// The generation the new extent item at `bytenr` gets (see [`PendingExtent::generation`]).
    pub(crate) fn set_generation(&mut self, bytenr: u64, generation: u64) {
        if let Some(e) = self.map.get_mut(&bytenr) {
            e.generation = Some(generation);
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Bytes of existing data extents whose references this transaction drops: space that
    /// may come free when it commits.
    pub(crate) fn data_bytes_dropped(&self) -> u64 {
        self.map
            .values()
            .filter(|e| e.meta.is_none() && !e.is_new && e.deltas.values().sum::<i64>() < 0)
            .map(|e| e.num_bytes)
            .fold(0, u64::saturating_add)
    }

    /// Net queued change of an extent's reference count, and flags queued to be set.
    pub(crate) fn pending(&self, bytenr: u64) -> (i64, u64) {
        match self.map.get(&bytenr) {
            Some(e) => (e.deltas.values().sum(), e.flags_set),
            None => (0, 0),
        }
    }
}
