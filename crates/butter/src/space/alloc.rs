//! Block groups and free space in memory: the allocator of the write engine.
//!
//! Every block group (one chunk) keeps its own free-extent map behind its own lock, and the
//! allocator keeps an index of groups ordered by free bytes per type, so the scalable
//! allocator of seed 001 (try-lock busy groups, per-inode goals) can grow from here without
//! changing the callers. Today the write engine runs one transaction at a time, so the locks are
//! uncontended.
//!
//! Space freed in the running transaction is *pinned*: it stays unusable until the transaction
//! commits, because the last committed trees may still point at it. The free space tree and the
//! block group items are derived from this state at commit: on-disk free = free + pinned.
//!
//! The superblock copies (64 KiB, 64 MiB, 256 GiB on the device) are carved out of the groups
//! whose stripes cover them, a whole 64 KiB stripe unit each, as the kernel does.

use crate::error::{Error, Location, Result};
use crate::format::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// Unit that excluded superblock ranges are rounded to (the kernel's stripe length).
pub(crate) const STRIPE_LEN: u64 = 64 * 1024;

/// Offsets of the superblock copies on a device.
pub(crate) fn super_mirror_offsets() -> [u64; 3] {
    [64 * 1024, 64 << 20, 256 << 30]
}

/// A sorted set of disjoint, non-adjacent byte ranges (start -> length).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct RangeSet {
    map: BTreeMap<u64, u64>,
    total: u64,
}

impl RangeSet {
    pub(crate) fn new() -> RangeSet {
        RangeSet::default()
    }
    pub(crate) fn total(&self) -> u64 {
        self.total
    }
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.map.iter().map(|(s, l)| (*s, *l))
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
            if ps + pl == start {
                s = ps;
                self.map.remove(&ps);
                self.total -= pl;
            }
        }
        if let Some((&ns, &nl)) = self.map.range(start..).next() {
            if ns < end {
                return Err(format!(
                    "range {start}+{len} overlaps free range {ns}+{nl} already present"
                ));
            }
            if ns == end {
                e = ns + nl;
                self.map.remove(&ns);
                self.total -= nl;
            }
        }
        self.map.insert(s, e - s);
        self.total += e - s;
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
            self.map.remove(&s);
            self.total -= l;
            if s < start {
                self.map.insert(s, start - s);
                self.total += start - s;
            }
            if s + l > end {
                self.map.insert(end, s + l - end);
                self.total += s + l - end;
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
                    out.map.insert(cs, ce - cs);
                    out.total += ce - cs;
                    Some((s, s + l))
                }
                None => Some((s, s + l)),
            };
        }
        if let Some((cs, ce)) = cur {
            out.map.insert(cs, ce - cs);
            out.total += ce - cs;
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
    /// Next-fit cursor.
    cursor: u64,
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
            cursor: start,
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
    fn alloc(&mut self, len: u64, align: u64) -> Option<u64> {
        let at = self.free.find(len, align, self.cursor)?;
        self.free.remove(at, len);
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
}

/// All block groups of the filesystem.
#[derive(Debug, Default)]
pub(crate) struct Allocator {
    groups: BTreeMap<u64, Mutex<BlockGroup>>,
    /// (kind, free bytes, group start): groups ordered by free space per kind.
    index: BTreeSet<(SpaceKind, u64, u64)>,
    /// Last group that satisfied an allocation, per kind (locality).
    hint: [Option<u64>; 3],
}

fn kind_slot(k: SpaceKind) -> usize {
    match k {
        SpaceKind::Data => 0,
        SpaceKind::Metadata => 1,
        SpaceKind::System => 2,
    }
}

impl Allocator {
    pub(crate) fn new() -> Allocator {
        Allocator::default()
    }

    pub(crate) fn add_group(&mut self, bg: BlockGroup) -> Result<()> {
        let kind = SpaceKind::of_flags(bg.flags).ok_or_else(|| {
            Error::Unsupported(format!(
                "block group at {} has type flags {:#x}",
                bg.start, bg.flags
            ))
        })?;
        if let Some(prev) = self.group_containing(bg.start) {
            return Err(Error::corrupt(
                Location::what(format!("block group at {}", bg.start)),
                format!("overlaps the block group at {prev}"),
            ));
        }
        self.index.insert((kind, bg.free.total(), bg.start));
        self.groups.insert(bg.start, Mutex::new(bg));
        Ok(())
    }

    /// Start of the group containing `bytenr`.
    pub(crate) fn group_containing(&self, bytenr: u64) -> Option<u64> {
        let (s, g) = self.groups.range(..=bytenr).next_back()?;
        let g = g.lock().unwrap_or_else(|e| e.into_inner());
        (bytenr < g.end()).then_some(*s)
    }

    /// Runs `f` on the group containing `bytenr` (under its lock), keeping the index in step.
    pub(crate) fn with_group<R>(
        &mut self,
        bytenr: u64,
        f: impl FnOnce(&mut BlockGroup) -> R,
    ) -> Option<R> {
        let (s, m) = self.groups.range(..=bytenr).next_back()?;
        let mut g = m.lock().unwrap_or_else(|e| e.into_inner());
        if bytenr >= g.end() {
            return None;
        }
        let kind = SpaceKind::of_flags(g.flags)?;
        let before = g.free.total();
        let r = f(&mut g);
        let after = g.free.total();
        let start = *s;
        drop(g);
        if before != after {
            self.index.remove(&(kind, before, start));
            self.index.insert((kind, after, start));
        }
        Some(r)
    }

    /// Every group start, in order.
    pub(crate) fn starts(&self) -> Vec<u64> {
        self.groups.keys().copied().collect()
    }

    /// Allocates `len` bytes aligned to `align` from a group of `kind`. `None` when no group
    /// has room (the caller may add a chunk, or commit to release pinned space).
    pub(crate) fn alloc(&mut self, kind: SpaceKind, len: u64, align: u64) -> Option<u64> {
        // No address is a sentinel: a group may start at logical 0 (old mkfs put the system
        // chunk there), so "no hint yet" is None, and a hint is only taken for its own kind.
        let hint = self.hint[kind_slot(kind)];
        let mut order: Vec<u64> = Vec::new();
        if let Some(h) = hint.filter(|h| {
            self.groups.get(h).is_some_and(|g| {
                let flags = g.lock().unwrap_or_else(|e| e.into_inner()).flags;
                SpaceKind::of_flags(flags) == Some(kind)
            })
        }) {
            order.push(h);
        }
        // Then the groups with the most free space first.
        for (_, free, start) in self
            .index
            .range((kind, 0, 0)..=(kind, u64::MAX, u64::MAX))
            .rev()
        {
            if *free < len {
                break;
            }
            if Some(*start) != hint {
                order.push(*start);
            }
        }
        for start in order {
            if let Some(Some(at)) = self.with_group(start, |g| g.alloc(len, align)) {
                self.hint[kind_slot(kind)] = Some(start);
                return Some(at);
            }
        }
        None
    }

    /// Removes a range from the free space of its group (it is in use).
    pub(crate) fn reserve(&mut self, start: u64, len: u64) {
        self.with_group(start, |g| g.free.remove(start, len));
    }

    /// Pins a range freed in the running transaction.
    pub(crate) fn pin(&mut self, start: u64, len: u64) -> Result<()> {
        match self.with_group(start, |g| {
            g.dirty = true;
            g.pinned.add(start, len)
        }) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(Error::corrupt(
                Location::what(format!("freed extent {start}+{len}")),
                format!("freed twice in one transaction: {e}"),
            )),
            None => Err(Error::corrupt(
                Location::what("free space"),
                format!("freed extent {start}+{len} is in no block group"),
            )),
        }
    }

    /// Allocates a block for the fsync log: taken from the free space and held (see
    /// [`BlockGroup::held`]) without touching the group's used count or its on-disk items.
    pub(crate) fn alloc_held(&mut self, kind: SpaceKind, len: u64, align: u64) -> Option<u64> {
        let at = self.alloc(kind, len, align)?;
        match self.with_group(at, |g| g.held.add(at, len)) {
            Some(Ok(())) => Some(at),
            _ => None,
        }
    }

    /// Holds a range [`Allocator::alloc`] just returned (see [`BlockGroup::held`]).
    pub(crate) fn hold(&mut self, start: u64, len: u64) -> Result<()> {
        match self.with_group(start, |g| g.held.add(start, len)) {
            Some(Ok(())) => Ok(()),
            Some(Err(e)) => Err(Error::Internal(format!("holding {start}+{len}: {e}"))),
            None => Err(Error::Internal(format!(
                "held extent {start}+{len} is in no block group"
            ))),
        }
    }

    /// A held range becomes an ordinary allocation: the caller has just recorded it in the
    /// trees (its extent item and used count come with the commit's delayed references).
    pub(crate) fn claim_held(&mut self, start: u64, len: u64) {
        self.with_group(start, |g| g.held.remove(start, len));
    }

    /// Gives held log blocks back to the free space.
    pub(crate) fn release_held(&mut self, start: u64, len: u64) {
        self.with_group(start, |g| {
            if g.held.contains(start, len) {
                g.held.remove(start, len);
                let _ = g.free.add(start, len);
            }
        });
    }

    /// After a commit: pinned space becomes allocatable.
    pub(crate) fn unpin_all(&mut self) {
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
        self.groups
            .values()
            .map(|m| m.lock().unwrap_or_else(|e| e.into_inner()))
            .filter(|g| SpaceKind::of_flags(g.flags) == Some(kind))
            .map(|g| g.pinned.total())
            .sum()
    }

    /// Free bytes of one kind.
    pub(crate) fn free_bytes(&self, kind: SpaceKind) -> u64 {
        self.index
            .range((kind, 0, 0)..=(kind, u64::MAX, u64::MAX))
            .map(|(_, f, _)| *f)
            .sum()
    }

    /// Adds `delta` to the used count of the group holding `bytenr`.
    pub(crate) fn account_used(&mut self, bytenr: u64, len: u64, add: bool) -> Result<()> {
        let r = self.with_group(bytenr, |g| {
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
                "freeing it would take its block group's used count below zero",
            )),
            None => Err(Error::corrupt(
                Location::what("free space"),
                format!("extent {bytenr}+{len} is in no block group"),
            )),
        }
    }

    /// Runs `f` on every group in address order.
    pub(crate) fn for_each(&mut self, mut f: impl FnMut(&mut BlockGroup)) {
        for s in self.starts() {
            self.with_group(s, &mut f);
        }
    }

    /// Highest end of any group (the next chunk's logical address goes at or above it).
    pub(crate) fn logical_end(&self) -> u64 {
        self.groups
            .values()
            .map(|g| g.lock().unwrap_or_else(|e| e.into_inner()).end())
            .max()
            .unwrap_or(0)
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
        r.add(100, 100).unwrap();
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(0, 300)]);
        assert!(r.add(50, 10).is_err());
        r.remove(10, 20);
        assert_eq!(r.iter().collect::<Vec<_>>(), vec![(0, 10), (30, 270)]);
        assert_eq!(r.total(), 280);
        assert_eq!(r.find(16, 16, 0), Some(32));
        assert_eq!(r.find(4, 1, 5), Some(5));
        assert_eq!(r.find(8, 1, 5), Some(30));
        assert_eq!(r.find(1000, 1, 0), None);
        assert!(r.contains(40, 10));
        assert!(!r.contains(5, 10));
        assert!(r.intersects(5, 10));
        let mut o = RangeSet::new();
        o.add(10, 20).unwrap();
        assert_eq!(r.union(&o).iter().collect::<Vec<_>>(), vec![(0, 300)]);
    }

    #[test]
    fn allocator_pins_until_commit() {
        let mut a = Allocator::new();
        a.add_group(BlockGroup::new(1 << 20, 1 << 20, BLOCK_GROUP_METADATA))
            .unwrap();
        let x = a.alloc(SpaceKind::Metadata, 16384, 16384).unwrap();
        assert_eq!(x, 1 << 20);
        a.pin(x, 16384).unwrap();
        assert_eq!(a.free_bytes(SpaceKind::Metadata), (1 << 20) - 16384);
        a.unpin_all();
        assert_eq!(a.free_bytes(SpaceKind::Metadata), 1 << 20);
        assert!(a.alloc(SpaceKind::Data, 4096, 4096).is_none());
    }
}
