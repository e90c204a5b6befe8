//! The fsync log's state inside the running transaction: the log trees kept in memory (laid
//! out in leaves that are rewritten only when their items change), what changed since each
//! inode was last logged, and the log's sequence numbers and blocks. crate::tree_log::write decides
//! what to log and writes it; the transaction owns this state and clears it at commit.

use crate::ctree::build;
use crate::ctree::ops::NewHeader;
use crate::error::Result;
use crate::extent_io::{ExtentBits, ExtentIoTree};
use crate::format::csum::CsumType;
use crate::format::*;
use crate::ids::Inode;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

/// One subvolume's log tree (or the log root tree) in memory, laid out in leaves that are
/// rewritten only when their items change.
#[derive(Debug, Default)]
pub(crate) struct LogTree {
    pub(crate) items: BTreeMap<Key, Vec<u8>>,
    /// First key of every leaf, ascending: leaf `i` holds the items in
    /// `[bounds[i], bounds[i + 1])` (leaf 0 also the keys below `bounds[0]`).
    pub(crate) bounds: Vec<Key>,
    /// Where each leaf was last written; `None` when its items changed since.
    pub(crate) written: Vec<Option<u64>>,
    /// Root (bytenr, level) of the last written tree; `None` when anything changed since.
    pub(crate) root: Option<(u64, u8)>,
    /// Upper nodes of the last written tree.
    pub(crate) nodes: Vec<u64>,
    /// Written blocks the next log commit replaces: free again once its superblock is
    /// durable.
    pub(crate) stale: Vec<u64>,
}

impl LogTree {
    pub(crate) fn leaf_of(&self, k: &Key) -> usize {
        self.bounds.partition_point(|b| b <= k).saturating_sub(1)
    }

    pub(crate) fn touch(&mut self, k: &Key) {
        self.root = None;
        if self.bounds.is_empty() {
            self.bounds.push(*k);
            self.written.push(None);
            return;
        }
        let i = self.leaf_of(k);
        if let Some(b) = self.written[i].take() {
            self.stale.push(b);
        }
    }

    pub(crate) fn insert(&mut self, k: Key, v: Vec<u8>) {
        if self.items.get(&k) == Some(&v) {
            return;
        }
        self.touch(&k);
        self.items.insert(k, v);
    }

    /// Removes every item in `[from, to]`.
    pub(crate) fn remove_range(&mut self, from: Key, to: Key) {
        if from > to {
            return;
        }
        let keys: Vec<Key> = self.items.range(from..=to).map(|(k, _)| *k).collect();
        for k in keys {
            self.touch(&k);
            self.items.remove(&k);
        }
    }

    /// Writes the changed leaves and every upper node into new blocks (appended to `out`).
    /// Returns the root, or `None` for an empty tree.
    pub(crate) fn write(
        &mut self,
        nodesize: usize,
        out: &mut Vec<(u64, Vec<u8>)>,
        new_block: &mut dyn FnMut() -> Result<(u64, NewHeader)>,
        csum_type: CsumType,
    ) -> Result<Option<(u64, u8)>> {
        if let Some(r) = self.root {
            return Ok(Some(r));
        }
        self.stale.append(&mut self.nodes);
        let mut i = self.bounds.len();
        while i > 0 {
            i -= 1;
            if self.written[i].is_some() {
                continue;
            }
            let lo = if i == 0 { Key::MIN } else { self.bounds[i] };
            let range: Vec<(Key, Vec<u8>)> = match self.bounds.get(i + 1) {
                Some(hi) => self.items.range(lo..*hi),
                None => self.items.range(lo..),
            }
            .map(|(k, v)| (*k, v.clone()))
            .collect();
            let groups = build::pack(range, nodesize)?;
            let mut bounds = Vec::with_capacity(groups.len());
            let mut written = Vec::with_capacity(groups.len());
            for g in groups {
                let (bytenr, h) = new_block()?;
                out.push((bytenr, build::leaf(nodesize, &h, &g, csum_type)?));
                bounds.push(g[0].0);
                written.push(Some(bytenr));
            }
            self.bounds.splice(i..=i, bounds);
            self.written.splice(i..=i, written);
        }
        let leaves: Vec<(Key, u64)> = self
            .bounds
            .iter()
            .zip(&self.written)
            .filter_map(|(k, w)| w.map(|b| (*k, b)))
            .collect();
        if leaves.is_empty() {
            return Ok(None);
        }
        let root =
            build::upper_levels(leaves, nodesize, csum_type, new_block, out, &mut self.nodes)?;
        self.root = Some(root);
        Ok(Some(root))
    }
}

/// The fsync log of the running transaction (part of the [`Writer`]).
#[derive(Debug, Default)]
pub(crate) struct LogState {
    /// Log trees by subvolume.
    pub(crate) trees: BTreeMap<u64, LogTree>,
    /// The log root tree: one ROOT_ITEM per log tree.
    pub(crate) root_tree: LogTree,
    /// Per inode: file ranges changed since it was last logged (the range-state tree,
    /// `DIRTY`).
    pub(crate) changed: HashMap<Inode, ExtentIoTree>,
    /// Inodes and directories whose fsync must commit (see the module documentation).
    pub(crate) needs_commit: HashSet<Inode>,
    /// Subvolumes created in the running transaction.
    pub(crate) new_trees: HashSet<u64>,
    /// Inodes logged in the running transaction.
    pub(crate) logged: HashSet<Inode>,
    /// Per directory: inodes whose name in it was removed in the running transaction.
    pub(crate) removed: HashMap<Inode, Vec<Inode>>,
    /// The names removed in the running transaction: (directory, name).
    pub(crate) removed_names: HashSet<(Inode, Vec<u8>)>,
    /// Non-directories renamed, linked or unlinked in the running transaction, with the
    /// directories where they lost a name: their fsync logs those directories too.
    pub(crate) names_changed: HashMap<Inode, BTreeSet<Inode>>,
    /// Names the log gives inodes: (subvolume, directory, name) -> inode.
    pub(crate) logged_names: HashMap<(u64, u64, Vec<u8>), u64>,
    /// Bumped by every change to the log's items.
    pub(crate) seq: u64,
    /// Every change up to this sequence number is durable.
    pub(crate) synced_seq: u64,
    /// Blocks written for this transaction's log, held until it commits (or until a later
    /// log commit that no longer needs them is durable).
    pub(crate) blocks: HashSet<u64>,
    /// A log commit failed part way: its trees may name blocks never written, so fsyncs
    /// commit until the transaction does.
    /// (Also set when a chunk is added: its extents and blocks would be in no chunk the log's
    /// replay knows.)
    pub(crate) broken: bool,
    /// Blocks of committed logs, released once no log write is in flight.
    pub(crate) retired: Vec<u64>,
    /// Log writes in flight (their blocks go out without the writer lock).
    pub(crate) inflight: u32,
    pub stats: LogStats,
}

/// Counters for tests and benchmarks.
#[derive(Debug, Default, Clone)]
pub struct LogStats {
    /// Fsyncs that logged their inode.
    pub logged: u64,
    /// Fsyncs that committed the transaction instead.
    pub fallbacks: u64,
    /// Log commits written (each may carry several fsyncs: group commit).
    pub log_commits: u64,
    /// Fsyncs that found their changes already durable.
    pub already_durable: u64,
    /// Pending ordered extents logged from memory, before their completion (fast fsync).
    pub ordered_logged: u64,
}

/// What an fsync has to do after its inode is logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LogTicket {
    /// The log holds the inode: make sequence number `seq` durable with [`Core::sync_log`].
    Logged(u64),
    /// Nothing changed since the last commit.
    Durable,
    /// The inode cannot be logged: commit the transaction.
    Commit,
}

impl LogState {
    /// A file range of `ino` changed (`end` exclusive).
    pub(crate) fn note_change(&mut self, ino: Inode, start: u64, end: u64) {
        if end > start {
            self.changed
                .entry(ino)
                .or_default()
                .set_bits(start, end - 1, ExtentBits::DIRTY);
        }
    }

    /// An operation made logging `ino` unsafe until the next commit.
    pub(crate) fn note_needs_commit(&mut self, ino: Inode) {
        self.needs_commit.insert(ino);
    }

    /// `target` lost its name `name` in `dir`.
    pub(crate) fn note_removed(&mut self, dir: Inode, target: Inode, name: &[u8]) {
        self.removed.entry(dir).or_default().push(target);
        self.removed_names.insert((dir, name.to_vec()));
    }

    /// Non-directory `ino` got `name` in `dir`. Where the name was removed in the transaction
    /// (from another inode: a rename over it, an exchange, a create or link after an unlink),
    /// `dir` is logged whole with `ino`, as a directory it lost a name in is: replay then drops
    /// the last commit's entry for the name before it adds the new one. A set lookup: every
    /// create passes here, and a directory may have lost many names.
    pub(crate) fn note_new_name(&mut self, ino: Inode, dir: Inode, name: &[u8]) {
        if !self.removed_names.is_empty() && self.removed_names.contains(&(dir, name.to_vec())) {
            self.note_name_change(ino, Some(dir));
        }
    }

    /// Non-directory `ino` got a new name (`lost_in` `None`) or lost its name in `lost_in`.
    pub(crate) fn note_name_change(&mut self, ino: Inode, lost_in: Option<Inode>) {
        let dirs = self.names_changed.entry(ino).or_default();
        dirs.extend(lost_in);
    }

    pub(crate) fn note_new_tree(&mut self, id: u64) {
        self.new_trees.insert(id);
    }

    /// After a transaction commit wrote its superblock (whose log pointer is clear).
    pub(crate) fn committed(&mut self, allocator: &crate::space::alloc::Allocator, nodesize: u64) {
        self.trees.clear();
        self.root_tree = LogTree::default();
        self.changed.clear();
        self.needs_commit.clear();
        self.new_trees.clear();
        self.logged.clear();
        self.logged_names.clear();
        self.removed.clear();
        self.removed_names.clear();
        self.names_changed.clear();
        self.synced_seq = self.seq;
        self.broken = false;
        self.retired.extend(self.blocks.drain());
        if self.inflight == 0 {
            for b in self.retired.drain(..) {
                allocator.release_held(b, nodesize);
            }
        }
    }

    /// Whether the log has anything a log commit has not written.
    pub(crate) fn pending(&self) -> bool {
        self.synced_seq < self.seq
    }
}
