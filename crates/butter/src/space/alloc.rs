//! Block groups and free space in memory: the allocator of the write engine (seed 001).
//!
//! A shared component with its own locking, called with or without the writer lock:
//!
//! - every block group (one chunk) keeps its free extents behind a lock of its own; a search
//!   *tries* each candidate's lock and moves past a busy group, and blocks only when every
//!   candidate that could serve it was busy;
//! - the groups of each space kind are indexed by the order (log2) of their largest free
//!   extent and of their average free extent in ordered maps: after the goal's group, a
//!   search looks at groups whose average extent is big enough (most of their free space
//!   fits), then at those whose largest extent is, from the goal's group onward, wrapping
//!   around; a group with nothing free is in no index;
//! - goals: a file's next extent goes right after its previous one when that space is free
//!   (the file's nearby extent is the hint, as kernel btrfs uses it); otherwise the stream goal
//!   of the file's inode hash (as many goals as CPUs, rounded up to a power of two, updated
//!   without a lock). A file whose next place was taken by another stream moves to the middle
//!   of the largest free extent, so files appended at the same time spread out instead of
//!   interleaving;
//! - a file appended to (its extent went right after its previous one) gets a *window*: up
//!   to 1 MiB after its end, held for it, from which its next extents come without taking
//!   any group's lock (ext4's per-inode preallocation, in memory only: on disk the window is
//!   free). Windows go back when the file stops continuing, when the file's entry is
//!   evicted, and all at once when an allocation finds no room;
//! - free and pinned byte counts per kind are atomics; freed extents merge with their
//!   neighbours as they go in ([`RangeSet::add`]).
//!
//! Space freed in the running transaction is *pinned*: it stays unusable until the transaction
//! commits, because the last committed trees may still point at it. Space handed out but not
//! yet recorded in the trees (data being written, fsync log blocks) is *held*. The free space
//! tree and the block group items are derived from this state at commit: on-disk free = free +
//! pinned + held (+ the superblock copies). An allocation made without the writer lock is
//! always held (taken from free and held in one step under the group's lock), so it never
//! changes what a commit running meanwhile writes; only the writer turns held space into used
//! space ([`Allocator::claim_held`]) or frees space ([`Allocator::pin`]).
//!
//! The allocator as it was before seed 001 (one hint per kind, one next-fit cursor per group,
//! groups by free bytes, data allocated under the writer lock) stays selectable
//! ([`Allocator::new_legacy`], `RwOptions::legacy_allocator`) for the benchmarks.
//!
//! The superblock copies (64 KiB, 64 MiB, 256 GiB on the device) are carved out of the groups
//! whose stripes cover them, a whole 64 KiB stripe unit each, as the kernel does.

use crate::error::{Error, Location, Result};
use crate::format::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, TryLockError};

/// Unit that excluded superblock ranges are rounded to (the kernel's stripe length).
pub(crate) const STRIPE_LEN: u64 = 64 * 1024;

/// Offsets of the superblock copies on a device.
pub(crate) fn super_mirror_offsets() -> [u64; 3] {
    [64 * 1024, 64 << 20, 256 << 30]
}

/// A sorted set of disjoint, non-adjacent byte ranges (start -> length), which knows its
/// largest range.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RangeSet {
    map: BTreeMap<u64, u64>,
    total: u64,
    /// Range lengths and how many ranges have each.
    lens: BTreeMap<u64, u32>,
}

impl RangeSet {
    pub(crate) fn new() -> RangeSet {
        RangeSet::default()
    }
    pub(crate) fn total(&self) -> u64 {
        self.total
    }
    /// Number of ranges.
    pub(crate) fn count(&self) -> u64 {
        self.map.len() as u64
    }
    /// Length of the largest range (0 when empty).
    pub(crate) fn largest(&self) -> u64 {
        self.lens.keys().next_back().copied().unwrap_or(0)
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(s, l)| (*s, *l))
    }
    fn put(&mut self, s: u64, l: u64) {
        self.map.insert(s, l);
        self.total += l;
        *self.lens.entry(l).or_insert(0) += 1;
    }
    fn take(&mut self, s: u64) -> Option<u64> {
        let l = self.map.remove(&s)?;
        self.total -= l;
        if let Some(n) = self.lens.get_mut(&l) {
            *n -= 1;
            if *n == 0 {
                self.lens.remove(&l);
            }
        }
        Some(l)
    }
    /// Adds `[start, start + len)`, merging with neighbours. Overlap with what is there is an
    /// engine bug (double free) and is refused.
    pub(crate) fn add(&mut self, start: u64, len: u64) -> std::result::Result<(), String> {
        if len == 0 {
            return Ok(());
        }
        let end = start + len;
        let mut s = start;
        let mut e = end;
        if let Some((&ps, &pl)) = self.map.range(..=start).next_back() {
            if ps + pl > start {
                return Err(format!(
                    "range {start}+{len} overlaps free range {ps}+{pl} already present"
                ));
            }
        }
        if let Some((&ns, &nl)) = self.map.range(start..).next() {
            if ns < end {
                return Err(format!(
                    "range {start}+{len} overlaps free range {ns}+{nl} already present"
                ));
            }
        }
        if let Some((&ps, &pl)) = self.map.range(..=start).next_back() {
            if ps + pl == start {
                s = ps;
                self.take(ps);
            }
        }
        if let Some((&ns, &nl)) = self.map.range(start..).next() {
            if ns == end {
                e = ns + nl;
                self.take(ns);
            }
        }
        self.put(s, e - s);
        Ok(())
    }
    /// Removes `[start, start + len)` where present (parts not present are ignored).
    pub(crate) fn remove(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let end = start + len;
        let overlapping: Vec<(u64, u64)> = self
            .map
            .range(..end)
            .rev()
            .take_while(|(s, l)| *s + *l > start)
            .map(|(s, l)| (*s, *l))
            .collect();
        for (s, l) in overlapping {
            self.take(s);
            if s < start {
                self.put(s, start - s);
            }
            if s + l > end {
                self.put(end, s + l - end);
            }
        }
    }
    /// Whether all of `[start, start + len)` is in the set.
    pub(crate) fn contains(&self, start: u64, len: u64) -> bool {
        match self.map.range(..=start).next_back() {
            Some((s, l)) => s + l >= start + len,
            None => false,
        }
    }
    #[cfg(test)]
    /// Whether any byte of `[start, start + len)` is in the set.
    pub(crate) fn intersects(&self, start: u64, len: u64) -> bool {
        self.map
            .range(..start + len)
            .next_back()
            .is_some_and(|(s, l)| s + l > start)
    }
    /// First range of `len` bytes starting on a multiple of `align`, searching from `from`
    /// and wrapping around once.
    pub(crate) fn find(&self, len: u64, align: u64, from: u64) -> Option<u64> {
        let fit = |s: u64, l: u64| -> Option<u64> {
            let a = s.div_ceil(align) * align;
            (a + len <= s + l).then_some(a)
        };
        // A range that contains `from` counts from `from` on.
        if let Some((&s, &l)) = self.map.range(..=from).next_back() {
            if s + l > from {
                if let Some(a) = fit(from, s + l - from) {
                    return Some(a);
                }
            }
        }
        for (&s, &l) in self.map.range(from..) {
            if let Some(a) = fit(s, l) {
                return Some(a);
            }
        }
        for (&s, &l) in self.map.range(..from) {
            if let Some(a) = fit(s, l) {
                return Some(a);
            }
        }
        None
    }
    /// Ranges starting at or after `from`, in order.
    pub(crate) fn iter_from(&self, from: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.range(from..).map(|(s, l)| (*s, *l))
    }
    /// A largest range: (start, length).
    pub(crate) fn a_largest(&self) -> Option<(u64, u64)> {
        let want = self.largest();
        if want == 0 {
            return None;
        }
        self.map
            .iter()
            .find(|(_, l)| **l == want)
            .map(|(s, l)| (*s, *l))
    }
    /// The union of two sets.
    pub(crate) fn union(&self, other: &RangeSet) -> RangeSet {
        let mut v: Vec<(u64, u64)> = self.iter().chain(other.iter()).collect();
        v.sort_unstable();
        let mut out = RangeSet::new();
        let mut cur: Option<(u64, u64)> = None;
        for (s, l) in v {
            cur = match cur {
                Some((cs, ce)) if s <= ce => Some((cs, ce.max(s + l))),
                Some((cs, ce)) => {
                    out.put(cs, ce - cs);
                    Some((s, s + l))
                }
                None => Some((s, s + l)),
            };
        }
        if let Some((cs, ce)) = cur {
            out.put(cs, ce - cs);
        }
        out
    }
}

/// One block group: a chunk's logical range and what is free in it.
#[derive(Debug)]
pub(crate) struct BlockGroup {
    pub start: u64,
    pub len: u64,
    /// BLOCK_GROUP_* type and profile bits.
    pub flags: u64,
    /// Bytes covered by extent items (the BLOCK_GROUP_ITEM's `used`).
    pub used: u64,
    /// Allocatable now.
    pub free: RangeSet,
    /// Freed in the running transaction; allocatable after it commits.
    pub pinned: RangeSet,
    /// Carved out for superblock copies; never free, never used.
    pub excluded: RangeSet,
    /// Space taken but not recorded in the trees: blocks of the fsync log (crate::tree_log::write),
    /// and data extents being written (crate::inode::ordered) until their file extent items go in.
    /// Free as far as the trees say (no extent item, free in the free space tree), so a commit
    /// meanwhile leaves them free on disk, but not allocatable: log blocks until the
    /// transaction that wrote them has committed and no log write is in flight, data extents
    /// until [`Allocator::claim_held`] or [`Allocator::release_held`].
    pub held: RangeSet,
    /// Needs its BLOCK_GROUP_ITEM and free space tree entries rewritten at commit.
    pub dirty: bool,
    /// Created in the running transaction: its items do not exist on disk yet.
    pub new: bool,
    /// The free space tree describes this group with bitmaps.
    pub fst_bitmaps: bool,
    /// Being relocated (balance, shrink, device remove): nothing new is allocated in it,
    /// while its free space stays free on disk.
    pub readonly: bool,
    /// Next-fit cursor (the legacy allocator's).
    cursor: u64,
    /// The orders this group is indexed under: of its largest free extent, of its average
    /// free extent (None: nothing free, in no index).
    indexed: Option<(u8, u8)>,
}

impl BlockGroup {
    pub(crate) fn new(start: u64, len: u64, flags: u64) -> BlockGroup {
        let mut free = RangeSet::new();
        let _ = free.add(start, len);
        BlockGroup {
            start,
            len,
            flags,
            used: 0,
            free,
            pinned: RangeSet::new(),
            excluded: RangeSet::new(),
            held: RangeSet::new(),
            dirty: false,
            new: false,
            fst_bitmaps: false,
            readonly: false,
            cursor: start,
            indexed: None,
        }
    }
    pub(crate) fn end(&self) -> u64 {
        self.start + self.len
    }
    /// Marks a range as excluded (superblock copy).
    pub(crate) fn exclude(&mut self, start: u64, len: u64) {
        let s = start.max(self.start);
        let e = (start + len).min(self.end());
        if s < e {
            self.free.remove(s, e - s);
            // Ranges may overlap ones excluded already (a RAID5/6 parity unit excludes its
            // whole full stripe, a data unit of it may be excluded too): add the union.
            self.excluded.remove(s, e - s);
            let _ = self.excluded.add(s, e - s);
        }
    }
    /// What the free space tree must say is free: free plus pinned, plus the superblock
    /// ranges (the kernel describes a new group as wholly free and keeps supers out of its
    /// allocator in memory only).
    pub(crate) fn on_disk_free(&self) -> RangeSet {
        self.free
            .union(&self.pinned)
            .union(&self.excluded)
            .union(&self.held)
    }
    /// Takes `[at, at + len)` out of the free space.
    fn take(&mut self, at: u64, len: u64, held: bool) -> u64 {
        self.free.remove(at, len);
        if held {
            let _ = self.held.add(at, len);
        }
        at
    }
    /// The legacy allocator's next fit.
    fn alloc_next_fit(&mut self, len: u64, align: u64) -> Option<u64> {
        let at = self.free.find(len, align, self.cursor)?;
        self.cursor = at + len;
        Some(at)
    }
}

/// Which kind of space an allocation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum SpaceKind {
    Data,
    Metadata,
    System,
}

impl SpaceKind {
    pub(crate) fn flag(self) -> u64 {
        match self {
            SpaceKind::Data => BLOCK_GROUP_DATA,
            SpaceKind::Metadata => BLOCK_GROUP_METADATA,
            SpaceKind::System => BLOCK_GROUP_SYSTEM,
        }
    }
    pub(crate) fn of_flags(flags: u64) -> Option<SpaceKind> {
        if flags & BLOCK_GROUP_SYSTEM != 0 {
            Some(SpaceKind::System)
        } else if flags & BLOCK_GROUP_METADATA != 0 {
            Some(SpaceKind::Metadata)
        } else if flags & BLOCK_GROUP_DATA != 0 {
            Some(SpaceKind::Data)
        } else {
            None
        }
    }
    fn slot(self) -> usize {
        match self {
            SpaceKind::Data => 0,
            SpaceKind::Metadata => 1,
            SpaceKind::System => 2,
        }
    }
}

/// What the allocator did, for the benchmarks and the report at unmount.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AllocStats {
    /// Allocations served.
    pub allocations: u64,
    /// Times a group's lock was busy and the search moved on.
    pub trylock_misses: u64,
    /// Times a search blocked on a group's lock (every candidate was busy), or, with the
    /// legacy allocator, found a group's lock taken and waited for it.
    pub blocking_waits: u64,
    /// Groups whose free space a search looked at.
    pub groups_visited: u64,
    /// Allocations placed exactly at their goal (right after the file's previous extent, or
    /// at the stream goal).
    pub goal_hits: u64,
}

impl AllocStats {
    /// What happened since `earlier`.
    pub fn since(&self, earlier: &AllocStats) -> AllocStats {
        AllocStats {
            allocations: self.allocations - earlier.allocations,
            trylock_misses: self.trylock_misses - earlier.trylock_misses,
            blocking_waits: self.blocking_waits - earlier.blocking_waits,
            groups_visited: self.groups_visited - earlier.groups_visited,
            goal_hits: self.goal_hits - earlier.goal_hits,
        }
    }
}

#[derive(Debug, Default)]
struct Counters {
    allocations: AtomicU64,
    trylock_misses: AtomicU64,
    blocking_waits: AtomicU64,
    groups_visited: AtomicU64,
    goal_hits: AtomicU64,
}

/// A file an allocation is for: where the file's previous extent ended is remembered per
/// file, so its next extent can go right after it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ForFile {
    /// Subvolume and inode number.
    pub root: u64,
    pub ino: u64,
    /// File offset the extent starts at.
    pub offset: u64,
}

impl ForFile {
    fn hash(&self) -> u64 {
        crate::ids::spread(self.root, self.ino)
    }
}

/// One allocation request.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Want {
    pub kind: SpaceKind,
    pub len: u64,
    pub align: u64,
    pub file: Option<ForFile>,
    /// Hold what is handed out (see [`BlockGroup::held`]): required without the writer lock.
    pub held: bool,
}

const NO_GOAL: u64 = u64::MAX;
/// Shards of the per-file hints, and the files each remembers at most.
const FILE_SHARDS: usize = 64;
const FILE_SHARD_CAP: usize = 1024;
/// A file appended to (its extent went right after its previous one) gets a window: the
/// next bytes after its end, up to this many, held for it, so its next extents come from
/// there without any group's lock (as ext4's per-inode preallocation).
const WINDOW: u64 = 1 << 20;
/// Most files with a window at a time.
const MAX_WINDOWS: usize = 64;
/// Largest a window grows to with space given back into it ([`Allocator::release_to_file`]).
const WINDOW_MAX: u64 = 4 << 20;

/// Where a file's last extent ended, in the file and on disk, and its window: `[disk_end,
/// window_end)` held for it (empty when `window_end == disk_end`).
#[derive(Debug, Clone, Copy)]
struct FileEnd {
    file_end: u64,
    disk_end: u64,
    window_end: u64,
}

/// Some files' ends (per subvolume, inode), and the allocations served from their windows
/// (counted here, under the lock taken anyway, not on a cache line all CPUs write).
#[derive(Debug, Default)]
struct FileEnds {
    map: rustc_hash::FxHashMap<(u64, u64), FileEnd>,
    from_windows: u64,
}

/// A lock on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(64))]
struct Padded<T>(T);

/// A group in the allocator: its fixed range outside the lock, its state inside.
#[derive(Debug)]
struct Group {
    start: u64,
    end: u64,
    kind: SpaceKind,
    bg: Mutex<BlockGroup>,
}

/// Per space kind: the ordered index and the counts.
#[derive(Debug, Default)]
struct KindState {
    /// (order of the largest free extent, group start) of every group with free space.
    by_largest: Mutex<BTreeSet<(u8, u64)>>,
    /// (order of the average free extent, group start) of the same groups.
    by_average: Mutex<BTreeSet<(u8, u64)>>,
    free: AtomicU64,
    pinned: AtomicU64,
    /// End of the last allocation of this kind (the goal when nothing better is known).
    last: AtomicU64,
}

/// All block groups of the filesystem (see the module doc).
#[derive(Debug)]
pub(crate) struct Allocator {
    groups: RwLock<BTreeMap<u64, Arc<Group>>>,
    kinds: [KindState; 3],
    /// Stream goals of data allocations, by inode hash.
    streams: Box<[AtomicU64]>,
    /// Per file (by hash): (file offset its last extent ended at, where that extent ended).
    files: Box<[Padded<Mutex<FileEnds>>]>,
    /// The allocator as it was before seed 001, and its hint per kind.
    legacy: bool,
    legacy_hint: Mutex<[Option<u64>; 3]>,
    counters: Counters,
    /// Files with a window now.
    windows: std::sync::atomic::AtomicUsize,
}

impl Default for Allocator {
    fn default() -> Self {
        Allocator::with_streams(cpu_goals(), false)
    }
}

/// Order (floor log2) of a non-zero length.
fn order_of(len: u64) -> u8 {
    (63 - len.max(1).leading_zeros()) as u8
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Stream goals: as many as CPUs, rounded up to a power of two.
fn cpu_goals() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .next_power_of_two()
}

impl Allocator {
    pub(crate) fn new() -> Allocator {
        Allocator::default()
    }

    /// The allocator as it was before seed 001 (for the benchmarks' comparison).
    pub(crate) fn new_legacy() -> Allocator {
        Allocator::with_streams(cpu_goals(), true)
    }

    fn with_streams(n: usize, legacy: bool) -> Allocator {
        Allocator {
            groups: RwLock::default(),
            kinds: Default::default(),
            streams: (0..n.max(1)).map(|_| AtomicU64::new(NO_GOAL)).collect(),
            files: (0..FILE_SHARDS)
                .map(|_| {
                    // Sized up front: tables grown later could sit beside each other.
                    Padded(Mutex::new(FileEnds {
                        map: rustc_hash::FxHashMap::with_capacity_and_hasher(
                            16,
                            Default::default(),
                        ),
                        from_windows: 0,
                    }))
                })
                .collect(),
            legacy,
            legacy_hint: Mutex::default(),
            counters: Counters::default(),
            windows: Default::default(),
        }
    }

    /// Whether this is the allocator as it was before seed 001.
    pub(crate) fn is_legacy(&self) -> bool {
        self.legacy
    }

    /// What the allocator did so far.
    pub(crate) fn stats(&self) -> AllocStats {
        let c = &self.counters;
        let windowed: u64 = self.files.iter().map(|m| lock(&m.0).from_windows).sum();
        AllocStats {
            allocations: c.allocations.load(Relaxed) + windowed,
            trylock_misses: c.trylock_misses.load(Relaxed),
            blocking_waits: c.blocking_waits.load(Relaxed),
            groups_visited: c.groups_visited.load(Relaxed),
            goal_hits: c.goal_hits.load(Relaxed) + windowed,
        }
    }

    fn kind(&self, k: SpaceKind) -> &KindState {
        &self.kinds[k.slot()]
    }

    fn group_arc(&self, bytenr: u64) -> Option<Arc<Group>> {
        let groups = self.groups.read().unwrap_or_else(|e| e.into_inner());
        let (_, g) = groups.range(..=bytenr).next_back()?;
        (bytenr < g.end).then(|| g.clone())
    }

    pub(crate) fn add_group(&self, mut bg: BlockGroup) -> Result<()> {
        let kind = SpaceKind::of_flags(bg.flags).ok_or_else(|| {
            Error::Unsupported(format!(
                "block group at {} has type flags {:#x}",
                bg.start, bg.flags
            ))
        })?;
        let mut groups = self.groups.write().unwrap_or_else(|e| e.into_inner());
        let overlap = groups
            .range(..bg.end())
            .next_back()
            .filter(|(_, g)| g.end > bg.start);
        if let Some((prev, _)) = overlap {
            return Err(Error::corrupt(
                Location::what(format!("block group at {}", bg.start)),
                format!("overlaps the block group at {prev}"),
            ));
        }
        let ks = self.kind(kind);
        ks.free.fetch_add(bg.free.total(), Relaxed);
        ks.pinned.fetch_add(bg.pinned.total(), Relaxed);
        bg.indexed = None;
        let g = Arc::new(Group {
            start: bg.start,
            end: bg.end(),
            kind,
            bg: Mutex::new(bg),
        });
        {
            let mut b = lock(&g.bg);
            self.reindex(&g, &mut b);
        }
        groups.insert(g.start, g);
        Ok(())
    }

    /// Puts the group under the index entry its largest free extent calls for (caller holds
    /// the group's lock: the group's entry changes only under it).
    fn reindex(&self, g: &Group, b: &mut BlockGroup) {
        let want = (b.free.total() > 0 && !b.readonly).then(|| {
            (
                order_of(b.free.largest()),
                order_of(b.free.total() / b.free.count().max(1)),
            )
        });
        if want != b.indexed {
            let ks = self.kind(g.kind);
            let (old_l, old_a) = (b.indexed.map(|x| x.0), b.indexed.map(|x| x.1));
            let (new_l, new_a) = (want.map(|x| x.0), want.map(|x| x.1));
            for (ix, old, new) in [
                (&ks.by_largest, old_l, new_l),
                (&ks.by_average, old_a, new_a),
            ] {
                if old != new {
                    let mut ix = lock(ix);
                    if let Some(o) = old {
                        ix.remove(&(o, g.start));
                    }
                    if let Some(o) = new {
                        ix.insert((o, g.start));
                    }
                }
            }
            b.indexed = want;
        }
    }

    /// Takes the group at `start` out (a block group being removed): nothing is allocated
    /// from it from now on. Returns it as it was.
    pub(crate) fn remove_group(&self, start: u64) -> Option<BlockGroup> {
        let g = self.group_arc(start).filter(|g| g.start == start)?;
        let mut b = lock(&g.bg);
        let was = BlockGroup {
            start: b.start,
            len: b.len,
            flags: b.flags,
            used: b.used,
            free: b.free.clone(),
            pinned: b.pinned.clone(),
            excluded: b.excluded.clone(),
            held: b.held.clone(),
            dirty: b.dirty,
            new: b.new,
            fst_bitmaps: b.fst_bitmaps,
            readonly: b.readonly,
            cursor: b.cursor,
            indexed: None,
        };
        self.edit(&g, &mut b, |b| {
            b.free = RangeSet::new();
            b.pinned = RangeSet::new();
        });
        drop(b);
        self.groups
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&start);
        Some(was)
    }

    /// Marks the group at `start` read-only (or writable again): a group being relocated
    /// gets nothing new. File windows are given back first, so none hands out space in it.
    pub(crate) fn set_readonly(&self, start: u64, on: bool) -> bool {
        if on {
            self.release_windows();
        }
        self.with_group(start, |g| g.readonly = on).is_some()
    }

    /// Start of the group containing `bytenr`.
    pub(crate) fn group_containing(&self, bytenr: u64) -> Option<u64> {
        self.group_arc(bytenr).map(|g| g.start)
    }

    /// Runs `f` on a locked group, keeping the counts and the index in step.
    fn edit<R>(&self, g: &Group, b: &mut BlockGroup, f: impl FnOnce(&mut BlockGroup) -> R) -> R {
        let (free0, pinned0) = (b.free.total(), b.pinned.total());
        let r = f(b);
        let ks = self.kind(g.kind);
        let (free1, pinned1) = (b.free.total(), b.pinned.total());
        if free1 >= free0 {
            ks.free.fetch_add(free1 - free0, Relaxed);
        } else {
            ks.free.fetch_sub(free0 - free1, Relaxed);
        }
        if pinned1 >= pinned0 {
            ks.pinned.fetch_add(pinned1 - pinned0, Relaxed);
        } else {
            ks.pinned.fetch_sub(pinned0 - pinned1, Relaxed);
        }
        self.reindex(g, b);
        r
    }

    /// Runs `f` on the group containing `bytenr` (under its lock), keeping the index in step.
    pub(crate) fn with_group<R>(
        &self,
        bytenr: u64,
        f: impl FnOnce(&mut BlockGroup) -> R,
    ) -> Option<R> {
        let g = self.group_arc(bytenr)?;
        let mut b = lock(&g.bg);
        Some(self.edit(&g, &mut b, f))
    }

    /// Every group start, in order.
    pub(crate) fn starts(&self) -> Vec<u64> {
        let groups = self.groups.read().unwrap_or_else(|e| e.into_inner());
        groups.keys().copied().collect()
    }

    /// Allocates `len` bytes aligned to `align` from a group of `kind`. `None` when no group
    /// has room (the caller may add a chunk, or commit to release pinned space).
    pub(crate) fn alloc(&self, kind: SpaceKind, len: u64, align: u64) -> Option<u64> {
        self.alloc_for(&Want {
            kind,
            len,
            align,
            file: None,
            held: false,
        })
    }

    /// Allocates what `want` asks for (see the module doc for where it goes).
    pub(crate) fn alloc_for(&self, want: &Want) -> Option<u64> {
        if want.len == 0 {
            return None;
        }
        let at = if self.legacy {
            self.alloc_legacy(want)
        } else {
            let goal = match self.window_or_goal(want) {
                Ok(at) => return Some(at),
                Err(goal) => goal,
            };
            self.alloc_scalable(want, goal).or_else(|| {
                // Space held in windows is free for anyone once they are given back.
                (self.release_windows() > 0)
                    .then(|| self.alloc_scalable(want, goal))
                    .flatten()
            })
        }?;
        debug_assert_eq!(
            self.group_containing(at),
            self.group_containing(at + want.len - 1),
            "allocation {at}+{} crosses a block group's end",
            want.len
        );
        self.counters.allocations.fetch_add(1, Relaxed);
        Some(at)
    }

    /// With one look at the file's entry: its next extent from its window (no group lock:
    /// the window is held already), or else the goal of the request, (address, whether it
    /// is the file's own continuation): the file's previous end when the request continues
    /// it, the stream goal of its inode hash, the kind's last end. A window that cannot serve
    /// the request goes back (and the request takes the ordinary way, from the same place).
    fn window_or_goal(&self, want: &Want) -> std::result::Result<u64, Option<(u64, bool)>> {
        let last = || {
            let last = self.kind(want.kind).last.load(Relaxed);
            (last != NO_GOAL && last != 0).then_some((last, false))
        };
        let Some(f) = want.file else {
            return Err(last());
        };
        let h = f.hash();
        let stream = || {
            let s = self.streams[(h >> 32) as usize & (self.streams.len() - 1)].load(Relaxed);
            if s != NO_GOAL {
                Some((s, false))
            } else {
                last()
            }
        };
        let mut guard = lock(&self.files[h as usize % FILE_SHARDS].0);
        let shard = &mut *guard;
        let Some(e) = shard.map.get_mut(&(f.root, f.ino)) else {
            drop(guard);
            return Err(stream());
        };
        let own = (e.file_end == f.offset).then_some((e.disk_end, true));
        if e.window_end == e.disk_end {
            drop(guard);
            return Err(own.or_else(stream));
        }
        // Any extent of the file may come from its window (after its last one, where the
        // file's data is): a file rewritten from its start after a truncate reuses it.
        // The extent must lie in one block group (one chunk): a window that would hand out
        // one crossing into the next group (which no path should make, but a write across a
        // chunk's end is refused far later, after the data was accepted) goes back instead.
        if want.held
            && e.disk_end.is_multiple_of(want.align)
            && e.disk_end + want.len <= e.window_end
            && self.group_containing(e.disk_end) == self.group_containing(e.disk_end + want.len - 1)
        {
            let at = e.disk_end;
            e.file_end = f.offset + want.len;
            e.disk_end += want.len;
            if e.disk_end == e.window_end {
                self.windows.fetch_sub(1, Relaxed);
            }
            // An allocation and a goal hit (see `stats`).
            shard.from_windows += 1;
            return Ok(at);
        }
        let (s, l) = (e.disk_end, e.window_end - e.disk_end);
        e.window_end = e.disk_end;
        drop(guard);
        self.windows.fetch_sub(1, Relaxed);
        self.release_held(s, l);
        Err(own.or_else(stream))
    }

    /// Gives back held space `[start, +len)` of the file `(root, ino)` that never went into a
    /// tree (a truncated delayed preallocation): into the file's window when it ends where
    /// the window starts (and the window stays within [`WINDOW_MAX`]), else to the free space.
    /// Give the file's extents back last first, so they join one after the other.
    pub(crate) fn release_to_file(&self, root: u64, ino: u64, start: u64, len: u64) {
        let h = ForFile {
            root,
            ino,
            offset: 0,
        }
        .hash();
        let mut shard = lock(&self.files[h as usize % FILE_SHARDS].0);
        if let Some(e) = shard.map.get_mut(&(root, ino)) {
            let was_empty = e.window_end == e.disk_end;
            // A window stays inside one block group: an extent handed out from it must not
            // cross into the next group, even where the groups are adjacent.
            if e.disk_end == start + len
                && e.window_end - start <= WINDOW_MAX
                && (was_empty || self.group_containing(start) == self.group_containing(e.disk_end))
            {
                if !was_empty || self.windows.fetch_add(1, Relaxed) < MAX_WINDOWS {
                    e.disk_end = start;
                    return;
                }
                self.windows.fetch_sub(1, Relaxed);
            }
        }
        drop(shard);
        self.release_held(start, len);
    }

    /// Gives every file's window back; returns how many there were.
    pub(crate) fn release_windows(&self) -> usize {
        let mut back = Vec::new();
        for m in self.files.iter() {
            for e in lock(&m.0).map.values_mut() {
                if e.window_end > e.disk_end {
                    back.push((e.disk_end, e.window_end - e.disk_end));
                    e.window_end = e.disk_end;
                }
            }
        }
        self.windows.fetch_sub(back.len(), Relaxed);
        for &(s, l) in &back {
            self.release_held(s, l);
        }
        back.len()
    }

    /// Allocates up to `want.len` bytes (at least `min`, both multiples of `want.align`): all
    /// of it where a free extent that long exists, else the largest free extent there is.
    /// Returns (start, length).
    pub(crate) fn alloc_upto(&self, want: &Want, min: u64) -> Option<(u64, u64)> {
        if let Some(at) = self.alloc_for(want) {
            return Some((at, want.len));
        }
        // The largest extent of the group with the largest one.
        let (_, start) = {
            let ix = lock(&self.kind(want.kind).by_largest);
            *ix.iter().next_back()?
        };
        let g = self.group_arc(start)?;
        let mut b = lock(&g.bg);
        let (s, l) = b.free.a_largest()?;
        let a = s.div_ceil(want.align) * want.align;
        let avail = (s + l).saturating_sub(a) / want.align * want.align;
        let got = avail.min(want.len);
        if got < min.max(want.align) {
            return None;
        }
        self.edit(&g, &mut b, |b| b.take(a, got, want.held));
        drop(b);
        self.after_alloc(want, a, got);
        self.counters.allocations.fetch_add(1, Relaxed);
        Some((a, got))
    }

    /// Records where an allocation went: the file's hint, the stream goal, the kind's last.
    fn after_alloc(&self, want: &Want, at: u64, len: u64) {
        self.after_alloc_window(want, at, len, at + len);
    }

    /// [`Allocator::after_alloc`] for an allocation that left `[at + len, window_end)` held
    /// as the file's window.
    fn after_alloc_window(&self, want: &Want, at: u64, len: u64, window_end: u64) {
        let end = at + len;
        self.kind(want.kind).last.store(end, Relaxed);
        let Some(f) = want.file else {
            return;
        };
        let h = f.hash();
        self.streams[(h >> 32) as usize & (self.streams.len() - 1)].store(end, Relaxed);
        let mut back = Vec::new();
        let mut shard = lock(&self.files[h as usize % FILE_SHARDS].0);
        if shard.map.len() >= FILE_SHARD_CAP {
            for e in shard.map.values().filter(|e| e.window_end > e.disk_end) {
                back.push((e.disk_end, e.window_end - e.disk_end));
            }
            shard.map.clear();
        }
        let new = FileEnd {
            file_end: f.offset + len,
            disk_end: end,
            window_end,
        };
        if let Some(old) = shard.map.insert((f.root, f.ino), new) {
            if old.window_end > old.disk_end {
                back.push((old.disk_end, old.window_end - old.disk_end));
            }
        }
        drop(shard);
        self.windows.fetch_sub(back.len(), Relaxed);
        for (s, l) in back {
            self.release_held(s, l);
        }
    }

    /// Tries to place `want` in the locked group `b`, from `goal` on. Counts goal hits.
    fn place(&self, want: &Want, b: &mut BlockGroup, goal: Option<(u64, bool)>) -> Option<u64> {
        let in_group = goal.filter(|(a, _)| *a >= b.start && *a < b.end());
        let at = match in_group {
            Some((a, own)) => {
                let a_al = a.div_ceil(want.align) * want.align;
                if b.free.contains(a_al, want.len) {
                    self.counters.goal_hits.fetch_add(1, Relaxed);
                    a_al
                } else if own {
                    // The file's next place went to another stream: move to the middle of
                    // the largest free extent (room to grow for this file and for whoever
                    // is appending before it), unless that is no longer than the request.
                    match b.free.a_largest() {
                        Some((s, l)) if l >= want.len * 4 => {
                            let mid = (s + l / 2) / want.align * want.align;
                            let mid = mid.max(s.div_ceil(want.align) * want.align);
                            if mid + want.len <= s + l {
                                mid
                            } else {
                                b.free.find(want.len, want.align, a)?
                            }
                        }
                        _ => b.free.find(want.len, want.align, a)?,
                    }
                } else {
                    b.free.find(want.len, want.align, a)?
                }
            }
            None => b.free.find(want.len, want.align, b.start)?,
        };
        Some(b.take(at, want.len, want.held))
    }

    fn alloc_scalable(&self, want: &Want, goal: Option<(u64, bool)>) -> Option<u64> {
        let mut busy: Vec<u64> = Vec::new();
        // The goal's group first: most allocations end there.
        let goal_group = goal
            .and_then(|(a, _)| self.group_arc(a))
            .filter(|g| g.kind == want.kind);
        if let Some(g) = &goal_group {
            match self.try_place(want, g, goal) {
                Ok(Some(at)) => return Some(at),
                Ok(None) => {}
                Err(()) => busy.push(g.start),
            }
        }
        // Then the groups whose average free extent is big enough (most of their free
        // extents fit: the search finds room where it starts), then every group whose largest
        // free extent is big enough, by order, each order's groups from the goal onward,
        // wrapping around; then those whose largest extent may be big enough (the request's
        // own order).
        let from = goal.map_or(0, |(a, _)| a);
        let skip = goal_group.map(|g| g.start);
        let cands: Vec<u64> = {
            let need = order_of(want.len);
            let sure = if want.len.is_power_of_two() {
                need
            } else {
                need + 1
            };
            let mut c: Vec<u64> = {
                let avg = lock(&self.kind(want.kind).by_average);
                let mut a: Vec<(bool, u64)> = avg
                    .range((sure, 0)..)
                    .map(|&(_, s)| (s < from, s))
                    .collect();
                a.sort_unstable();
                a.into_iter().map(|(_, s)| s).collect()
            };
            let ix = lock(&self.kind(want.kind).by_largest);
            let mut by_order: Vec<(u8, bool, u64)> = ix
                .range((sure, 0)..)
                .filter(|(_, s)| !c.contains(s))
                .map(|&(o, s)| (o, s < from, s))
                .collect();
            by_order.sort_unstable();
            c.extend(by_order.into_iter().map(|(_, _, s)| s));
            if sure != need {
                let mut maybe: Vec<(bool, u64)> = ix
                    .range((need, 0)..(sure, 0))
                    .map(|&(_, s)| (s < from, s))
                    .collect();
                maybe.sort_unstable();
                c.extend(maybe.into_iter().map(|(_, s)| s));
            }
            c
        };
        for s in cands.into_iter().filter(|s| Some(*s) != skip) {
            let Some(g) = self.group_arc(s) else { continue };
            match self.try_place(want, &g, goal) {
                Ok(Some(at)) => return Some(at),
                Ok(None) => {}
                Err(()) => busy.push(s),
            }
        }
        // Every group that could have served was busy: wait for them in turn.
        for g in busy.into_iter().filter_map(|s| self.group_arc(s)) {
            self.counters.blocking_waits.fetch_add(1, Relaxed);
            let mut b = lock(&g.bg);
            if let Some(at) = self.place_locked(want, &g, &mut b, goal) {
                return Some(at);
            }
        }
        None
    }

    /// [`Allocator::place`] in `g` if its lock is free: Err(()) when it is busy.
    fn try_place(
        &self,
        want: &Want,
        g: &Group,
        goal: Option<(u64, bool)>,
    ) -> std::result::Result<Option<u64>, ()> {
        let mut b = match g.bg.try_lock() {
            Ok(b) => b,
            Err(TryLockError::Poisoned(e)) => e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                self.counters.trylock_misses.fetch_add(1, Relaxed);
                return Err(());
            }
        };
        Ok(self.place_locked(want, g, &mut b, goal))
    }

    fn place_locked(
        &self,
        want: &Want,
        g: &Group,
        b: &mut BlockGroup,
        goal: Option<(u64, bool)>,
    ) -> Option<u64> {
        self.counters.groups_visited.fetch_add(1, Relaxed);
        if b.readonly || b.free.largest() < want.len {
            return None;
        }
        let (at, window_end) = self.edit(g, b, |b| {
            let at = self.place(want, b, goal)?;
            // A file appended to (this extent right after its previous one) gets a window:
            // the free run after it, up to WINDOW.
            let from = at + want.len;
            let appended = want.held && goal.is_some_and(|(a, own)| own && a == at);
            let run = b.free.iter_from(from).next().filter(|(s, _)| *s == from);
            let window_end = match run {
                Some((_, l)) if appended && self.windows.fetch_add(1, Relaxed) < MAX_WINDOWS => {
                    let end = (from + l.min(WINDOW)).min(b.end());
                    b.take(from, end - from, true);
                    end
                }
                Some(_) if appended => {
                    self.windows.fetch_sub(1, Relaxed);
                    from
                }
                _ => from,
            };
            Some((at, window_end))
        })?;
        self.after_alloc_window(want, at, want.len, window_end);
        Some(at)
    }

    /// Before seed 001: the kind's hint group first, then groups by free bytes (most first),
    /// next fit from each group's cursor, every lock waited for.
    fn alloc_legacy(&self, want: &Want) -> Option<u64> {
        let slot = want.kind.slot();
        let hint = lock(&self.legacy_hint)[slot];
        let groups: Vec<Arc<Group>> = {
            let all = self.groups.read().unwrap_or_else(|e| e.into_inner());
            all.values()
                .filter(|g| g.kind == want.kind)
                .cloned()
                .collect()
        };
        let mut order: Vec<(u64, Arc<Group>)> = groups
            .into_iter()
            .map(|g| {
                let free = lock(&g.bg).free.total();
                (free, g)
            })
            .filter(|(f, g)| *f >= want.len || Some(g.start) == hint)
            .collect();
        order.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.start.cmp(&a.1.start)));
        if let Some(i) = order.iter().position(|(_, g)| Some(g.start) == hint) {
            let h = order.remove(i);
            order.insert(0, h);
        }
        for (_, g) in order {
            let mut b = match g.bg.try_lock() {
                Ok(b) => b,
                Err(TryLockError::Poisoned(e)) => e.into_inner(),
                Err(TryLockError::WouldBlock) => {
                    self.counters.blocking_waits.fetch_add(1, Relaxed);
                    lock(&g.bg)
                }
            };
            self.counters.groups_visited.fetch_add(1, Relaxed);
            let got = self.edit(&g, &mut b, |b| {
                if b.readonly {
                    return None;
                }
                let at = b.alloc_next_fit(want.len, want.align)?;
                Some(b.take(at, want.len, want.held))
            });
            if let Some(at) = got {
                lock(&self.legacy_hint)[slot] = Some(g.start);
                return Some(at);
            }
        }
        None
    }

    /// Removes a range from the free space of its group (it is in use).
    pub(crate) fn reserve(&self, start: u64, len: u64) {
        self.with_group(start, |g| g.free.remove(start, len));
    }

    /// Pins a range freed in the running transaction.
    pub(crate) fn pin(&self, start: u64, len: u64) -> Result<()> {
        match self.with_group(start, |g| {
            if start + len > g.end() {
                return Err(format!("it crosses its block group's end {}", g.end()));
            }
            g.dirty = true;
            g.pinned
                .add(start, len)
                .map_err(|e| format!("freed twice in one transaction: {e}"))
        }) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(Error::corrupt(
                Location::what(format!("freed extent {start}+{len}")),
                e,
            )),
            None => Err(Error::corrupt(
                Location::what("free space"),
                format!("freed extent {start}+{len} is in no block group"),
            )),
        }
    }

    /// Allocates a block for the fsync log: taken from the free space and held (see
    /// [`BlockGroup::held`]) without touching the group's used count or its on-disk items.
    pub(crate) fn alloc_held(&self, kind: SpaceKind, len: u64, align: u64) -> Option<u64> {
        self.alloc_for(&Want {
            kind,
            len,
            align,
            file: None,
            held: true,
        })
    }

    /// A held range becomes an ordinary allocation: the caller has just recorded it in the
    /// trees (its extent item and used count come with the commit's delayed references).
    pub(crate) fn claim_held(&self, start: u64, len: u64) {
        self.with_group(start, |g| g.held.remove(start, len));
    }

    /// Gives held space back to the free space.
    pub(crate) fn release_held(&self, start: u64, len: u64) {
        self.with_group(start, |g| {
            if g.held.contains(start, len) {
                g.held.remove(start, len);
                let _ = g.free.add(start, len);
            }
        });
    }

    /// After a commit: pinned space becomes allocatable (merged with its free neighbours).
    pub(crate) fn unpin_all(&self) {
        for s in self.starts() {
            self.with_group(s, |g| {
                let pinned = std::mem::take(&mut g.pinned);
                for (a, l) in pinned.iter() {
                    let _ = g.free.add(a, l);
                }
            });
        }
    }

    /// Pinned bytes of one kind (space a commit would release).
    pub(crate) fn pinned_bytes(&self, kind: SpaceKind) -> u64 {
        self.kind(kind).pinned.load(Relaxed)
    }

    /// Free bytes of one kind.
    pub(crate) fn free_bytes(&self, kind: SpaceKind) -> u64 {
        self.kind(kind).free.load(Relaxed)
    }

    /// Adds `delta` to the used count of the group holding `bytenr`.
    pub(crate) fn account_used(&self, bytenr: u64, len: u64, add: bool) -> Result<()> {
        let r = self.with_group(bytenr, |g| {
            if bytenr + len > g.end() {
                return Err(());
            }
            g.dirty = true;
            if add {
                g.used += len;
                Ok(())
            } else if g.used >= len {
                g.used -= len;
                Ok(())
            } else {
                Err(())
            }
        });
        match r {
            Some(Ok(())) => Ok(()),
            Some(Err(())) => Err(Error::corrupt(
                Location::what(format!("extent {bytenr}+{len}")),
                "it crosses its block group's end, or freeing it would take the group's used \
                 count below zero",
            )),
            None => Err(Error::corrupt(
                Location::what("free space"),
                format!("extent {bytenr}+{len} is in no block group"),
            )),
        }
    }

    /// Runs `f` on every group in address order.
    pub(crate) fn for_each(&self, mut f: impl FnMut(&mut BlockGroup)) {
        for s in self.starts() {
            self.with_group(s, &mut f);
        }
    }

    /// Highest end of any group (the next chunk's logical address goes at or above it).
    pub(crate) fn logical_end(&self) -> u64 {
        let groups = self.groups.read().unwrap_or_else(|e| e.into_inner());
        groups.values().map(|g| g.end).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rangeset_add_remove_find() {
        let mut r = RangeSet::new();
        r.add(0, 100).unwrap();
        r.add(200, 100).unwrap();
        assert_eq!(r.largest(), 100);
        r.add(100, 100).unwrap();
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(0, 300)]);
        assert_eq!((r.largest(), r.iter().count()), (300, 1));
        assert!(r.add(50, 10).is_err());
        r.remove(10, 20);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(0, 10), (30, 270)]);
        assert_eq!(r.total(), 280);
        assert_eq!(r.largest(), 270);
        assert_eq!(r.a_largest(), Some((30, 270)));
        assert_eq!(r.find(16, 16, 0), Some(32));
        assert_eq!(r.find(4, 1, 5), Some(5));
        assert_eq!(r.find(8, 1, 5), Some(30));
        assert_eq!(r.find(1000, 1, 0), None);
        assert!(r.contains(40, 10));
        assert!(!r.contains(5, 10));
        assert!(r.intersects(5, 10));
        let mut o = RangeSet::new();
        o.add(10, 20).unwrap();
        let u = r.union(&o);
        assert_eq!(u.iter().collect::<Vec<_>>(), vec![(0, 300)]);
        assert_eq!(u.largest(), 300);
        r.remove(0, 300);
        assert_eq!((r.total(), r.largest(), r.iter().count()), (0, 0, 0));
    }

    fn one_group(kind: u64, legacy: bool) -> Allocator {
        let a = if legacy {
            Allocator::new_legacy()
        } else {
            Allocator::new()
        };
        a.add_group(BlockGroup::new(1 << 20, 1 << 20, kind))
            .unwrap();
        a
    }

    #[test]
    fn allocator_pins_until_commit() {
        for legacy in [false, true] {
            let a = one_group(BLOCK_GROUP_METADATA, legacy);
            let x = a.alloc(SpaceKind::Metadata, 16384, 16384).unwrap();
            assert_eq!(x, 1 << 20);
            a.pin(x, 16384).unwrap();
            assert_eq!(a.free_bytes(SpaceKind::Metadata), (1 << 20) - 16384);
            assert_eq!(a.pinned_bytes(SpaceKind::Metadata), 16384);
            a.unpin_all();
            assert_eq!(a.free_bytes(SpaceKind::Metadata), 1 << 20);
            assert_eq!(a.pinned_bytes(SpaceKind::Metadata), 0);
            assert!(a.alloc(SpaceKind::Data, 4096, 4096).is_none());
        }
    }

    fn data(file: Option<(u64, u64)>, len: u64) -> Want {
        Want {
            kind: SpaceKind::Data,
            len,
            align: 4096,
            file: file.map(|(ino, offset)| ForFile {
                root: 5,
                ino,
                offset,
            }),
            held: true,
        }
    }

    /// Two files appended in turns: each stays in one piece after the first collision, and
    /// the legacy allocator interleaves them.
    #[test]
    fn files_appended_together_do_not_interleave() {
        let extents = |legacy: bool| {
            let a = one_group(BLOCK_GROUP_DATA, legacy);
            let mut runs = [0u32; 2];
            let mut last = [None::<u64>; 2];
            for i in 0..64u64 {
                for f in 0..2 {
                    let at = a
                        .alloc_for(&data(Some((257 + f as u64, i * 4096)), 4096))
                        .unwrap();
                    if last[f] != Some(at) {
                        runs[f] += 1;
                    }
                    last[f] = Some(at + 4096);
                }
            }
            runs
        };
        let new = extents(false);
        assert!(new.iter().all(|r| *r <= 2), "scalable: {new:?}");
        let old = extents(true);
        assert!(old.iter().all(|r| *r >= 32), "legacy: {old:?}");
    }

    #[test]
    fn upto_takes_the_largest_extent_when_none_is_long_enough() {
        let a = one_group(BLOCK_GROUP_DATA, false);
        // Free: 64 KiB pieces with 4 KiB taken between them, one 128 KiB piece.
        let base = 1u64 << 20;
        a.reserve(base + (64 << 10), 4096);
        a.reserve(base + (132 << 10), 4096);
        a.reserve(base + (264 << 10), (1 << 20) - (264 << 10));
        let w = data(None, 256 << 10);
        assert_eq!(a.alloc_for(&w), None);
        assert_eq!(
            a.alloc_upto(&w, 4096),
            Some((base + (136 << 10), 128 << 10))
        );
        assert_eq!(a.alloc_upto(&w, 128 << 10), None);
        assert_eq!(a.alloc_upto(&w, 4096).map(|x| x.1), Some(64 << 10));
    }

    #[test]
    fn index_follows_the_largest_free_extent() {
        let a = Allocator::new();
        a.add_group(BlockGroup::new(1 << 20, 1 << 20, BLOCK_GROUP_DATA))
            .unwrap();
        a.add_group(BlockGroup::new(2 << 20, 1 << 20, BLOCK_GROUP_DATA))
            .unwrap();
        // Fragment the first group: nothing longer than 4 KiB free.
        for i in 0..128u64 {
            a.reserve((1 << 20) + i * 8192, 4096);
        }
        let ix: Vec<(u8, u64)> = lock(&a.kinds[0].by_largest).iter().copied().collect();
        assert_eq!(ix, vec![(12, 1 << 20), (20, 2 << 20)]);
        let avg: Vec<(u8, u64)> = lock(&a.kinds[0].by_average).iter().copied().collect();
        assert_eq!(avg, vec![(12, 1 << 20), (20, 2 << 20)]);
        // A 64 KiB request goes to the second group without looking at the first.
        let before = a.stats();
        let at = a.alloc(SpaceKind::Data, 65536, 4096).unwrap();
        assert!(at >= 2 << 20);
        assert_eq!(a.stats().since(&before).groups_visited, 1);
        // A group with nothing free leaves the index.
        a.reserve(2 << 20, 1 << 20);
        let ix: Vec<(u8, u64)> = lock(&a.kinds[0].by_largest).iter().copied().collect();
        assert_eq!(ix, vec![(12, 1 << 20)]);
        let avg: Vec<(u8, u64)> = lock(&a.kinds[0].by_average).iter().copied().collect();
        assert_eq!(avg, vec![(12, 1 << 20)]);
        assert_eq!(a.free_bytes(SpaceKind::Data), 128 * 4096);
    }

    /// Space given back into a file's window joins it only inside the window's group: an
    /// extent handed out from a window never crosses into an adjacent group.
    #[test]
    fn windows_never_cross_a_group_boundary() {
        let a = Allocator::new();
        let (ga, gb) = (1u64 << 20, 2u64 << 20);
        a.add_group(BlockGroup::new(ga, 1 << 20, BLOCK_GROUP_DATA))
            .unwrap();
        a.add_group(BlockGroup::new(gb, 1 << 20, BLOCK_GROUP_DATA))
            .unwrap();
        // Only the last 8 KiB of the first group are free.
        a.reserve(ga, (1 << 20) - 8192);
        let first = a.alloc_for(&data(Some((300, 0)), 8192)).unwrap();
        assert_eq!(first, gb - 8192);
        // The file goes on in the next group and gets a window there.
        let second = a.alloc_for(&data(Some((300, 8192)), 8192)).unwrap();
        assert_eq!(second, gb);
        // Both given back, last first: the second joins the window, the first may not.
        a.release_to_file(5, 300, second, 8192);
        a.release_to_file(5, 300, first, 8192);
        assert!(a
            .with_group(first, |g| g.free.contains(first, 8192))
            .unwrap());
        let again = a.alloc_for(&data(Some((300, 0)), 16384)).unwrap();
        assert_eq!(again, gb, "from the window, inside the second group");
        a.release_windows();
        assert!(a.with_group(gb, |g| g.held.contains(gb, 16384)).unwrap());
    }

    /// A delayed preallocation whose next piece starts where the last ends, but in the next
    /// group, keeps two extents (one would cross the first chunk's end: it once reached the
    /// trees, and freeing it put bytes past the first group's end into its free space); and
    /// a range crossing a group's end is refused when freed.
    #[test]
    fn extents_never_span_adjacent_groups() {
        let a = Allocator::new();
        let (ga, gb) = (1u64 << 20, 2u64 << 20);
        for g in [ga, gb] {
            a.add_group(BlockGroup::new(g, 1 << 20, BLOCK_GROUP_DATA))
                .unwrap();
        }
        let mut p = crate::inode::ordered::Prealloc::new(0);
        p.append(0, gb - 8192, 8192, 1 << 27, &a);
        p.append(8192, gb, 8192, 1 << 27, &a);
        assert_eq!(
            p.extents().collect::<Vec<_>>(),
            vec![(0, gb - 8192, 8192), (8192, gb, 8192)]
        );
        p.append(16384, gb + 8192, 4096, 1 << 27, &a);
        assert_eq!(p.extents().last(), Some((8192, gb, 12288)));
        assert!(a.pin(gb - 8192, 16384).is_err());
        assert!(a.account_used(gb - 8192, 16384, true).is_err());
        assert!(a.pin(gb - 8192, 8192).is_ok());
    }

    /// A busy group is passed over when another can serve, and waited for when none can.
    #[test]
    fn busy_groups_are_skipped_then_waited_for() {
        let a = Arc::new(Allocator::new());
        a.add_group(BlockGroup::new(1 << 20, 1 << 20, BLOCK_GROUP_DATA))
            .unwrap();
        a.add_group(BlockGroup::new(2 << 20, 1 << 20, BLOCK_GROUP_DATA))
            .unwrap();
        let first = a.group_arc(1 << 20).unwrap();
        let held = lock(&first.bg);
        let at = a.alloc(SpaceKind::Data, 4096, 4096).unwrap();
        assert!(at >= 2 << 20);
        let s = a.stats();
        assert_eq!((s.trylock_misses, s.blocking_waits), (1, 0));
        // Fill the second group; the next allocation must wait for the first.
        a.reserve(2 << 20, 1 << 20);
        let a2 = a.clone();
        let t = std::thread::spawn(move || a2.alloc(SpaceKind::Data, 4096, 4096));
        std::thread::sleep(std::time::Duration::from_millis(50));
        drop(held);
        assert_eq!(t.join().unwrap(), Some(1 << 20));
        assert_eq!(a.stats().blocking_waits, 1);
    }
}
