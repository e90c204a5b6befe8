//! The extent io tree ("range-state tree", seed 000): an ordered set of byte ranges of a file,
//! each carrying a set of state bits ([`ExtentBits`]: dirty, delalloc, locked, writeback,
//! uptodate, ...). One tree per inode tracks which of its byte ranges are dirty, waiting for
//! allocation (delalloc), under writeback, or locked by an operation in flight.
//!
//! # Format
//!
//! A record is `[start, end]` with **`end` inclusive**: it covers `end - start + 1` bytes, so a
//! 4 KiB block at offset 0 is `[0, 4095]` and the last byte of the address space, `u64::MAX`,
//! can be covered. Every range argument in this module is inclusive in the same way, and every
//! offset and length is in bytes. Bytes outside all records have no bits set.
//!
//! # Invariants (checked by [`ExtentIoTree::check_invariants`])
//!
//! 1. Records are sorted by `start` and do not overlap: `prev.end < next.start`.
//! 2. `start <= end` and no record has an empty bit set (a record whose bits all clear is
//!    removed).
//! 3. Two records that touch (`prev.end + 1 == next.start`) and carry identical bits are merged
//!    into one, unless their bits contain a no-merge bit ([`ExtentBits::NO_MERGE`], i.e.
//!    `LOCKED`).
//!
//! # The lock-merge rule
//!
//! Records carrying `LOCKED` never merge with a neighbour, even an identical one. A range
//! locked by one [`SharedExtentIoTree::lock_range`] call therefore never shares a record with a
//! range locked by another holder: each locked record belongs to exactly one holder, and
//! releasing one holder's range never has to split a record that another holder owns. (A single
//! holder's range may span several records when other bits differ inside it.) Once `LOCKED` is
//! cleared the records merge normally again.
//!
//! # Trimming in place (the seed's optimization)
//!
//! When [`ExtentIoTree::clear_bits`] clears *every* bit of the first record, which starts before
//! the range, or of the last record, which ends after it, the plain algorithm splits that record
//! in two (inserting a new record), then deletes the half inside the range. Instead the record
//! is trimmed in place: its `end` (first record) or its `start` (last record) moves to the edge
//! of the range, and nothing is inserted or removed. Records are kept in a `BTreeMap` keyed by
//! `start`; the key is an atomic cell, so moving the start of the last record to `end + 1` is an
//! in-place store too: the new start stays strictly between the previous record's end and the
//! record's own end, so the key order never changes. [`ExtentIoStats`] counts splits performed
//! and avoided; [`ExtentIoTree::set_trim_in_place`] turns the optimization off for comparison.
//!
//! # Concurrency
//!
//! [`ExtentIoTree`] is a plain data structure mutated through `&mut self`.
//! [`SharedExtentIoTree`] wraps it in a mutex and adds range locking: a thread locking a range
//! that overlaps a locked byte waits (condition variable) until that byte is unlocked. Waiters
//! are counted so that unlocking wakes nobody when nobody waits.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Bound::Included;
#[cfg(test)]
use std::ops::Bound::{Excluded, Unbounded};
use std::ops::{BitAnd, BitAndAssign, BitOr, BitOrAssign, Not, Sub};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};

/// A set of state bits carried by a byte range (a hand-made bitflags type over `u32`).
///
/// Any `u32` value is accepted ([`ExtentBits::from_bits_retain`]); the named constants are the
/// bits butter gives a meaning to. [`ExtentBits::ALL`] has every bit set and is what "clear all
/// bits" passes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub(crate) struct ExtentBits(u32);

impl ExtentBits {
    /// Data in memory differs from data on disk.
    pub(crate) const DIRTY: Self = Self(1 << 0);
    /// Data in memory is valid (matches or supersedes the disk).
    pub(crate) const UPTODATE: Self = Self(1 << 1);
    /// The range is locked by an operation in flight; see [`SharedExtentIoTree::lock_range`].
    /// Records carrying it never merge (see the module doc's lock-merge rule).
    pub(crate) const LOCKED: Self = Self(1 << 2);
    /// Dirty data with no disk extent allocated yet (delayed allocation).
    pub(crate) const DELALLOC: Self = Self(1 << 3);
    /// Data is being written back to disk.
    pub(crate) const WRITEBACK: Self = Self(1 << 4);
    /// The range was written since the inode was created (no old extents to look up).
    pub(crate) const NEW: Self = Self(1 << 5);
    /// Marked for defragmentation.
    pub(crate) const DEFRAG: Self = Self(1 << 6);
    /// Data written without data checksums.
    pub(crate) const NODATASUM: Self = Self(1 << 7);
    /// An ordered extent covers the range (data written, not yet in the trees).
    pub(crate) const ORDERED: Self = Self(1 << 8);

    #[cfg(test)]
    /// No bits.
    pub(crate) const EMPTY: Self = Self(0);
    #[cfg(test)]
    /// Every bit, named or not: `clear_bits(s, e, ExtentBits::ALL)` empties the range.
    pub(crate) const ALL: Self = Self(u32::MAX);
    /// Bits that keep a record from merging with an identical neighbour.
    pub(crate) const NO_MERGE: Self = Self::LOCKED;

    const NAMES: [(Self, &'static str); 9] = [
        (Self::DIRTY, "DIRTY"),
        (Self::UPTODATE, "UPTODATE"),
        (Self::LOCKED, "LOCKED"),
        (Self::DELALLOC, "DELALLOC"),
        (Self::WRITEBACK, "WRITEBACK"),
        (Self::NEW, "NEW"),
        (Self::DEFRAG, "DEFRAG"),
        (Self::NODATASUM, "NODATASUM"),
        (Self::ORDERED, "ORDERED"),
    ];

    #[cfg(test)]
    /// The raw `u32`.
    pub(crate) const fn bits(self) -> u32 {
        self.0
    }
    #[cfg(test)]
    /// Wraps any `u32`, keeping bits that have no name.
    pub(crate) const fn from_bits_retain(bits: u32) -> Self {
        Self(bits)
    }
    /// No bit set.
    pub(crate) const fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// Every bit of `other` is set in `self`.
    pub(crate) const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }
    /// At least one bit of `other` is set in `self`.
    pub(crate) const fn intersects(self, other: Self) -> bool {
        self.0 & other.0 != 0
    }
    /// `self | other`.
    pub(crate) const fn union(self, other: Self) -> Self {
        Self(self.0 | other.0)
    }
    /// `self & other`.
    pub(crate) const fn intersection(self, other: Self) -> Self {
        Self(self.0 & other.0)
    }
    /// `self & !other`.
    pub(crate) const fn difference(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }
}

impl BitOr for ExtentBits {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        self.union(rhs)
    }
}
impl BitOrAssign for ExtentBits {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}
impl BitAnd for ExtentBits {
    type Output = Self;
    fn bitand(self, rhs: Self) -> Self {
        self.intersection(rhs)
    }
}
impl BitAndAssign for ExtentBits {
    fn bitand_assign(&mut self, rhs: Self) {
        self.0 &= rhs.0;
    }
}
impl Sub for ExtentBits {
    type Output = Self;
    fn sub(self, rhs: Self) -> Self {
        self.difference(rhs)
    }
}
impl Not for ExtentBits {
    type Output = Self;
    fn not(self) -> Self {
        Self(!self.0)
    }
}

impl fmt::Debug for ExtentBits {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("(empty)");
        }
        let mut rest = *self;
        let mut first = true;
        for (bit, name) in Self::NAMES {
            if rest.contains(bit) {
                if !first {
                    f.write_str("|")?;
                }
                f.write_str(name)?;
                rest = rest - bit;
                first = false;
            }
        }
        if !rest.is_empty() {
            if !first {
                f.write_str("|")?;
            }
            write!(f, "{:#x}", rest.0)?;
        }
        Ok(())
    }
}

/// One record: bytes `start..=end` (**inclusive** end) all carry `bits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ExtentRecord {
    /// First byte offset covered.
    pub start: u64,
    /// Last byte offset covered (inclusive).
    pub end: u64,
    /// The state bits of every byte in the record; never empty inside a tree.
    pub bits: ExtentBits,
}

impl ExtentRecord {
    #[cfg(test)]
    /// Number of bytes covered, `end - start + 1`; saturates at `u64::MAX` for the record
    /// `[0, u64::MAX]` (2^64 bytes).
    pub(crate) fn len(&self) -> u64 {
        (self.end - self.start).saturating_add(1)
    }
}

/// Work counters of one tree, for benchmarks and tests. All counts are of records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct ExtentIoStats {
    /// Records split in two at a range edge (each inserted one record).
    pub splits_performed: u64,
    /// Splits avoided by trimming, in place, a partly overlapping edge record whose bits all
    /// cleared (`trims_first + trims_last`).
    pub splits_avoided: u64,
    /// Of `splits_avoided`: first records (starting before the range) whose end moved.
    pub trims_first: u64,
    /// Of `splits_avoided`: last records (ending after the range) whose start moved.
    pub trims_last: u64,
    /// Records inserted (splits and gap fills).
    pub records_inserted: u64,
    /// Records removed (bits all cleared, or merged into the previous record).
    pub records_removed: u64,
    /// Pairs of touching identical records merged into one.
    pub merges: u64,
}

/// The map key: a record's start, movable in place as long as the key order is kept.
///
/// `BTreeMap` hands out only `&K`; an atomic (always accessed `Relaxed`, and only stored to
/// from `&mut ExtentIoTree` methods, so there is never a concurrent writer) lets the
/// trim-last-record path move a start without removing and re-inserting the entry, while the
/// tree stays `Send + Sync`.
#[derive(Debug)]
struct StartKey(AtomicU64);

impl StartKey {
    fn new(v: u64) -> Self {
        Self(AtomicU64::new(v))
    }
    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
    /// Only called with a value that keeps this key strictly between its neighbours.
    fn set(&self, v: u64) {
        self.0.store(v, Ordering::Relaxed)
    }
}
impl PartialEq for StartKey {
    fn eq(&self, other: &Self) -> bool {
        self.get() == other.get()
    }
}
impl Eq for StartKey {}
impl PartialOrd for StartKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for StartKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.get().cmp(&other.get())
    }
}

#[derive(Debug, Clone, Copy)]
struct Rec {
    end: u64,
    bits: ExtentBits,
}

/// Records whose bits are identical and mergeable, touching (`a_end + 1 == b_start`).
fn can_merge(a_end: u64, a_bits: ExtentBits, b_start: u64, b_bits: ExtentBits) -> bool {
    a_bits == b_bits
        && !a_bits.intersects(ExtentBits::NO_MERGE)
        && a_end.checked_add(1) == Some(b_start)
}

/// An ordered set of non-overlapping byte ranges with state bits; see the module doc.
///
/// Ranges are `[start, end]` with `end` **inclusive**, in bytes. A call with `start > end` is a
/// no-op (and reports nothing found / nothing cleared).
// Keys are mutated in place only in ways that keep their order (see `StartKey`).
#[allow(clippy::mutable_key_type)]
#[derive(Debug)]
pub(crate) struct ExtentIoTree {
    map: BTreeMap<StartKey, Rec>,
    trim_in_place: bool,
    stats: ExtentIoStats,
}

impl Default for ExtentIoTree {
    fn default() -> Self {
        Self::new()
    }
}

impl ExtentIoTree {
    /// An empty tree, with trimming in place on.
    pub(crate) fn new() -> Self {
        Self {
            map: BTreeMap::new(),
            trim_in_place: true,
            stats: ExtentIoStats::default(),
        }
    }

    #[cfg(test)]
    /// Turns the trim-in-place optimization of [`clear_bits`](Self::clear_bits) on (the
    /// default) or off. Off, the edge records are split and the inner half deleted, as before
    /// the optimization; the resulting records are identical either way. For benchmarks.
    pub(crate) fn set_trim_in_place(&mut self, on: bool) {
        self.trim_in_place = on;
    }

    #[cfg(test)]
    /// The work counters since creation or the last [`reset_stats`](Self::reset_stats).
    pub(crate) fn stats(&self) -> ExtentIoStats {
        self.stats
    }

    #[cfg(test)]
    /// Zeroes the work counters.
    pub(crate) fn reset_stats(&mut self) {
        self.stats = ExtentIoStats::default();
    }

    #[cfg(test)]
    /// Number of records.
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// No record: no byte has any bit.
    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// Removes every record (statistics are kept).
    pub(crate) fn clear(&mut self) {
        self.map.clear();
    }

    // ---- internal helpers -------------------------------------------------------------

    fn insert_rec(&mut self, start: u64, end: u64, bits: ExtentBits) {
        self.map.insert(StartKey::new(start), Rec { end, bits });
        self.stats.records_inserted += 1;
    }

    fn remove_rec(&mut self, start: u64) {
        self.map.remove(&StartKey::new(start));
        self.stats.records_removed += 1;
    }

    /// The record containing `x`, if any: `(start, end, bits)`.
    fn containing(&self, x: u64) -> Option<(u64, Rec)> {
        let (k, r) = self.map.range(..=StartKey::new(x)).next_back()?;
        (r.end >= x).then(|| (k.get(), *r))
    }

    /// The first record starting at or after `x`.
    fn first_from(&self, x: u64) -> Option<(u64, Rec)> {
        self.map
            .range(StartKey::new(x)..)
            .next()
            .map(|(k, r)| (k.get(), *r))
    }

    #[cfg(test)]
    /// The first record whose end is at or after `x` (it may start before `x`).
    fn first_ending_at_or_after(&self, x: u64) -> Option<(u64, Rec)> {
        self.containing(x).or_else(|| self.first_from(x))
    }

    /// The tail half `[at, rend]` of a record split at `at` (the caller already moved the
    /// head's end to `at - 1`): inserts it with the record's old bits and counts the split.
    fn insert_split_tail(&mut self, at: u64, rend: u64, bits: ExtentBits) {
        self.insert_rec(at, rend, bits);
        self.stats.splits_performed += 1;
    }

    /// Merges touching identical mergeable records from the record before `start` through the
    /// first record after `end`: every record whose bits changed lies inside `[start, end]`, so
    /// this restores invariant 3 after an operation on that range.
    fn merge_window(&mut self, start: u64, end: u64) {
        let first = match self.map.range(..StartKey::new(start)).next_back() {
            Some((k, _)) => Some(k.get()),
            None => self.first_from(start).map(|(k, _)| k),
        };
        let Some(mut cur) = first else { return };
        loop {
            // One descent yields the current record and its successor.
            let mut pair = self.map.range_mut(StartKey::new(cur)..);
            let (Some((_, c)), Some((nk, n))) = (pair.next(), pair.next()) else {
                return;
            };
            let next_start = nk.get();
            if can_merge(c.end, c.bits, next_start, n.bits) {
                c.end = n.end;
                self.remove_rec(next_start);
                self.stats.merges += 1;
            } else if next_start > end {
                return;
            } else {
                cur = next_start;
            }
        }
    }

    // ---- public operations ------------------------------------------------------------

    /// Sets `bits` on every byte of `[start, end]` (inclusive, bytes).
    ///
    /// Records straddling `start` or `end` are split at the range edge unless they already
    /// carry all of `bits`; records inside get `bits` ORed in; gaps get new records carrying
    /// exactly `bits`. Afterwards touching identical records are merged, except records with a
    /// [`ExtentBits::NO_MERGE`] bit (`LOCKED`). Empty `bits` or `start > end`: no-op.
    pub(crate) fn set_bits(&mut self, start: u64, end: u64, bits: ExtentBits) {
        if start > end || bits.is_empty() {
            return;
        }
        // Records starting at or after `cur` are still to be handled; bytes before are done.
        let mut cur = start;
        // A record starting before the range and reaching into it.
        if let Some((_, r)) = self.map.range_mut(..StartKey::new(start)).next_back() {
            if r.end >= start {
                if r.bits.contains(bits) {
                    // Already set there: nothing to change.
                    if r.end >= end {
                        return;
                    }
                    cur = r.end + 1;
                } else {
                    let (rend, rbits) = (r.end, r.bits);
                    r.end = start - 1;
                    // The loop below finds the tail at `start` and ORs the bits in.
                    self.insert_split_tail(start, rend, rbits);
                }
            }
        }
        loop {
            match self.map.range_mut(StartKey::new(cur)..).next() {
                Some((k, r)) if k.get() <= end => {
                    let (rs, rend, rbits) = (k.get(), r.end, r.bits);
                    if !rbits.contains(bits) {
                        if rend > end {
                            r.end = end;
                        }
                        r.bits |= bits;
                        if rend > end {
                            self.insert_split_tail(end + 1, rend, rbits);
                        }
                    }
                    if rs > cur {
                        self.insert_rec(cur, rs - 1, bits);
                    }
                    if rend >= end {
                        break;
                    }
                    cur = rend + 1;
                }
                _ => {
                    self.insert_rec(cur, end, bits);
                    break;
                }
            }
        }
        self.merge_window(start, end);
    }

    /// Clears `bits` from every byte of `[start, end]` (inclusive, bytes); returns whether any
    /// byte in the range had any of `bits` (so something was cleared).
    ///
    /// A record whose bits all clear is removed. Records straddling a range edge and keeping
    /// some bits are split at the edge. When a straddling edge record loses *all* its bits, it
    /// is trimmed in place instead of split (unless [`set_trim_in_place`](Self::set_trim_in_place)
    /// turned that off). Touching records that became identical are merged.
    /// `start > end` or empty `bits`: returns false.
    pub(crate) fn clear_bits(&mut self, start: u64, end: u64, bits: ExtentBits) -> bool {
        if start > end || bits.is_empty() {
            return false;
        }
        let mut cleared = false;
        let mut need_merge = false;
        // Records starting at or after `cur` are still to be handled.
        let mut cur = start;

        // The first record, if it starts before the range and reaches into it.
        if let Some((_, r)) = self.map.range_mut(..StartKey::new(start)).next_back() {
            if r.end >= start {
                let (rend, rbits) = (r.end, r.bits);
                if rbits.intersects(bits) {
                    cleared = true;
                    // Both branches keep the head [r.start, start - 1] with all its bits.
                    r.end = start - 1;
                    if (rbits - bits).is_empty() && self.trim_in_place {
                        // Trimmed in place: nothing inserted, nothing removed.
                        self.stats.splits_avoided += 1;
                        self.stats.trims_first += 1;
                        if rend > end {
                            // The range is a hole strictly inside the record: its tail must
                            // survive as a record of its own (one split, where splitting at
                            // both edges and deleting the middle would take two).
                            self.insert_split_tail(end + 1, rend, rbits);
                        }
                        if rend >= end {
                            return true;
                        }
                        cur = rend + 1;
                    } else {
                        // Split: the tail [start, rend] is handled by the loop below.
                        self.insert_split_tail(start, rend, rbits);
                    }
                } else if rend >= end {
                    return false;
                } else {
                    cur = rend + 1;
                }
            }
        }

        // Records starting inside the range.
        while let Some((k, r)) = self.map.range_mut(StartKey::new(cur)..).next() {
            let (rs, rend, rbits) = (k.get(), r.end, r.bits);
            if rs > end {
                break;
            }
            if rbits.intersects(bits) {
                cleared = true;
                let left = rbits - bits;
                if rend > end {
                    // The last record, ending after the range.
                    if left.is_empty() && self.trim_in_place {
                        // rs <= end < end + 1 <= rend < next record's start: key order kept.
                        k.set(end + 1);
                        self.stats.splits_avoided += 1;
                        self.stats.trims_last += 1;
                        break;
                    }
                    // Split: the head [rs, end] loses the bits, the tail keeps them.
                    r.end = end;
                    r.bits = left;
                    self.insert_split_tail(end + 1, rend, rbits);
                    if left.is_empty() {
                        self.remove_rec(rs);
                    } else {
                        need_merge = true;
                    }
                    break;
                }
                // Inside the range.
                if left.is_empty() {
                    self.remove_rec(rs);
                } else {
                    r.bits = left;
                    need_merge = true;
                }
            }
            if rend >= end {
                break;
            }
            cur = rend + 1;
        }
        if need_merge {
            self.merge_window(start, end);
        }
        cleared
    }

    /// Tests `bits` over `[start, end]` (inclusive, bytes).
    ///
    /// `all == true`: every byte of the range has every bit of `bits` (true for empty `bits`).
    /// `all == false`: at least one byte of the range has at least one bit of `bits` (false for
    /// empty `bits`). `start > end`: `all` (vacuously true for "all", false for "any").
    pub(crate) fn test_bits(&self, start: u64, end: u64, bits: ExtentBits, all: bool) -> bool {
        if start > end {
            return all;
        }
        if all {
            if bits.is_empty() {
                return true;
            }
            let mut cur = start;
            for rec in self.iter_range(start, end) {
                if rec.start != cur || !rec.bits.contains(bits) {
                    return false;
                }
                if rec.end >= end {
                    return true;
                }
                cur = rec.end + 1;
            }
            false
        } else {
            self.iter_range(start, end)
                .any(|rec| rec.bits.intersects(bits))
        }
    }

    #[cfg(test)]
    /// The first record with any of `bits` that ends at or after `from` (byte offset), as
    /// `(start, end)` (inclusive) with `start` clipped up to `from`. `None` if there is none.
    ///
    /// The end is the record's end, so the returned bytes all carry the same bits; neighbouring
    /// bytes may carry `bits` too (see [`find_contiguous`](Self::find_contiguous)).
    pub(crate) fn find_first_set(&self, from: u64, bits: ExtentBits) -> Option<(u64, u64)> {
        let (s, r) = self.first_ending_at_or_after(from)?;
        if r.bits.intersects(bits) {
            return Some((s.max(from), r.end));
        }
        self.map
            .range((Excluded(StartKey::new(s)), Unbounded))
            .find(|(_, r)| r.bits.intersects(bits))
            .map(|(k, r)| (k.get(), r.end))
    }

    #[cfg(test)]
    /// The first maximal run of contiguous bytes at or after `from` that each have at least
    /// one of `bits`, as `(start, end)` (inclusive, bytes; `start >= from`). The run may span
    /// several records with different bits; it ends at a gap or at a record without `bits`.
    pub(crate) fn find_contiguous(&self, from: u64, bits: ExtentBits) -> Option<(u64, u64)> {
        let (start, mut end) = self.find_first_set(from, bits)?;
        for (k, r) in self.map.range((Excluded(StartKey::new(end)), Unbounded)) {
            if end.checked_add(1) != Some(k.get()) || !r.bits.intersects(bits) {
                break;
            }
            end = r.end;
        }
        Some((start, end))
    }

    #[cfg(test)]
    /// Number of bytes in `[start, end]` (inclusive) that have at least one of `bits`.
    /// Saturates at `u64::MAX` (only reachable when all 2^64 bytes qualify).
    pub(crate) fn count_bits(&self, start: u64, end: u64, bits: ExtentBits) -> u64 {
        self.iter_range(start, end)
            .filter(|r| r.bits.intersects(bits))
            .fold(0u64, |acc, r| acc.saturating_add(r.len()))
    }

    /// The records overlapping `[start, end]` (inclusive), in order, each **clipped** to the
    /// range. Bytes of the range not covered by any yielded record have no bits.
    pub(crate) fn iter_range(
        &self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = ExtentRecord> + '_ {
        // Start at the record containing `start` when there is one, else the first after.
        let bounds = (start <= end).then(|| {
            let from = self.containing(start).map_or(start, |(s, _)| s);
            (Included(StartKey::new(from)), Included(StartKey::new(end)))
        });
        bounds.into_iter().flat_map(move |b| {
            self.map.range(b).map(move |(k, r)| ExtentRecord {
                start: k.get().max(start),
                end: r.end.min(end),
                bits: r.bits,
            })
        })
    }

    /// All records in order, unclipped.
    pub(crate) fn iter(&self) -> impl Iterator<Item = ExtentRecord> + '_ {
        self.map.iter().map(|(k, r)| ExtentRecord {
            start: k.get(),
            end: r.end,
            bits: r.bits,
        })
    }

    #[cfg(test)]
    /// Checks the invariants listed in the module doc; the error names the first offending
    /// record(s). For tests and debugging.
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        let mut prev: Option<ExtentRecord> = None;
        for rec in self.iter() {
            if rec.start > rec.end {
                return Err(format!("record {rec:?}: start after end"));
            }
            if rec.bits.is_empty() {
                return Err(format!("record {rec:?}: no bits"));
            }
            if let Some(p) = prev {
                if p.end >= rec.start {
                    return Err(format!(
                        "records {p:?} and {rec:?} overlap or are out of order"
                    ));
                }
                if can_merge(p.end, p.bits, rec.start, rec.bits) {
                    return Err(format!("records {p:?} and {rec:?} should have been merged"));
                }
            }
            prev = Some(rec);
        }
        Ok(())
    }
}

/// A thread-safe [`ExtentIoTree`] with range locking (mutex + condition variable).
///
/// Locks are the `LOCKED` bit: [`lock_range`](Self::lock_range) waits until no byte of the
/// range is locked, then sets `LOCKED` on it. A lock has no owner identity beyond its range:
/// the holder must unlock exactly the range it locked (unlocking a wider range would release
/// other holders' locks too), and a thread locking a range that overlaps one it holds itself
/// waits forever.
#[derive(Debug, Default)]
pub(crate) struct SharedExtentIoTree {
    inner: Mutex<SharedInner>,
    unlocked: Condvar,
}

#[derive(Debug, Default)]
struct SharedInner {
    tree: ExtentIoTree,
    /// Threads waiting in `lock_range`; unlocking notifies only when nonzero.
    waiters: usize,
    /// Wake-ups sent (`notify_all` calls), for tests.
    wakeups: u64,
}

impl SharedExtentIoTree {
    /// An empty tree.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    fn guard(&self) -> MutexGuard<'_, SharedInner> {
        // No operation panics while holding the lock; if one did, the tree is still
        // structurally valid (every mutation keeps the invariants step by step).
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake(&self, inner: &mut SharedInner) {
        if inner.waiters > 0 {
            inner.wakeups += 1;
            self.unlocked.notify_all();
        }
    }

    /// Runs `f` on the tree under the mutex (for queries and statistics not wrapped here).
    /// Clearing `LOCKED` inside `f` does not wake waiters: use
    /// [`unlock_range`](Self::unlock_range) or [`clear_bits`](Self::clear_bits) for that.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut ExtentIoTree) -> R) -> R {
        f(&mut self.guard().tree)
    }

    /// [`ExtentIoTree::set_bits`] under the mutex.
    pub(crate) fn set_bits(&self, start: u64, end: u64, bits: ExtentBits) {
        self.guard().tree.set_bits(start, end, bits)
    }

    /// [`ExtentIoTree::clear_bits`] under the mutex; wakes lock waiters if `LOCKED` was among
    /// `bits` and something was cleared.
    pub(crate) fn clear_bits(&self, start: u64, end: u64, bits: ExtentBits) -> bool {
        let mut g = self.guard();
        let cleared = g.tree.clear_bits(start, end, bits);
        if cleared && bits.intersects(ExtentBits::LOCKED) {
            self.wake(&mut g);
        }
        cleared
    }

    #[cfg(test)]
    /// [`ExtentIoTree::test_bits`] under the mutex.
    pub(crate) fn test_bits(&self, start: u64, end: u64, bits: ExtentBits, all: bool) -> bool {
        self.guard().tree.test_bits(start, end, bits, all)
    }

    #[cfg(test)]
    /// A snapshot of the records overlapping `[start, end]` (inclusive), clipped to it.
    pub(crate) fn records(&self, start: u64, end: u64) -> Vec<ExtentRecord> {
        self.guard().tree.iter_range(start, end).collect()
    }

    /// Locks `[start, end]` (inclusive, bytes): waits until no byte of it is locked, then sets
    /// `LOCKED` on all of it. `start > end`: returns at once, locking nothing.
    pub(crate) fn lock_range(&self, start: u64, end: u64) {
        if start > end {
            return;
        }
        let mut g = self.guard();
        while g.tree.test_bits(start, end, ExtentBits::LOCKED, false) {
            g.waiters += 1;
            g = self.unlocked.wait(g).unwrap_or_else(|e| e.into_inner());
            g.waiters -= 1;
        }
        g.tree.set_bits(start, end, ExtentBits::LOCKED);
    }

    /// Locks `[start, end]` (inclusive) if no byte of it is locked, without waiting; returns
    /// whether it did. `start > end`: true, locking nothing.
    pub(crate) fn try_lock_range(&self, start: u64, end: u64) -> bool {
        if start > end {
            return true;
        }
        let mut g = self.guard();
        if g.tree.test_bits(start, end, ExtentBits::LOCKED, false) {
            return false;
        }
        g.tree.set_bits(start, end, ExtentBits::LOCKED);
        true
    }

    /// Unlocks `[start, end]` (inclusive): clears `LOCKED` and wakes waiters, if any. Returns
    /// whether any byte of it was locked. Must be exactly a range this caller locked.
    pub(crate) fn unlock_range(&self, start: u64, end: u64) -> bool {
        self.clear_bits(start, end, ExtentBits::LOCKED)
    }

    #[cfg(test)]
    /// [`lock_range`](Self::lock_range), returning a guard that unlocks the range on drop.
    pub(crate) fn lock_range_guard(&self, start: u64, end: u64) -> RangeLockGuard<'_> {
        self.lock_range(start, end);
        RangeLockGuard {
            tree: self,
            start,
            end,
        }
    }

    #[cfg(test)]
    /// Number of wake-ups sent to lock waiters so far (unlocks with no waiter send none).
    pub(crate) fn wakeups(&self) -> u64 {
        self.guard().wakeups
    }
}

#[cfg(test)]
/// Holds a range locked in a [`SharedExtentIoTree`]; unlocks it on drop.
#[derive(Debug)]
pub(crate) struct RangeLockGuard<'a> {
    tree: &'a SharedExtentIoTree,
    start: u64,
    end: u64,
}

#[cfg(test)]
impl RangeLockGuard<'_> {
    #[cfg(test)]
    /// The locked range `(start, end)`, inclusive.
    pub(crate) fn range(&self) -> (u64, u64) {
        (self.start, self.end)
    }
}

#[cfg(test)]
impl Drop for RangeLockGuard<'_> {
    fn drop(&mut self) {
        self.tree.unlock_range(self.start, self.end);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recs(t: &ExtentIoTree) -> Vec<(u64, u64, u32)> {
        t.iter().map(|r| (r.start, r.end, r.bits.bits())).collect()
    }

    #[test]
    fn set_merges_and_splits() {
        let mut t = ExtentIoTree::new();
        let d = ExtentBits::DIRTY;
        t.set_bits(0, 4095, d);
        t.set_bits(8192, 12287, d);
        t.set_bits(4096, 8191, d);
        assert_eq!(recs(&t), vec![(0, 12287, d.bits())]);
        t.set_bits(100, 199, ExtentBits::UPTODATE);
        let du = (d | ExtentBits::UPTODATE).bits();
        assert_eq!(recs(&t), vec![(0, 99, 1), (100, 199, du), (200, 12287, 1)]);
        t.check_invariants().unwrap();
    }

    #[test]
    fn locked_records_do_not_merge() {
        let mut t = ExtentIoTree::new();
        t.set_bits(0, 99, ExtentBits::LOCKED);
        t.set_bits(100, 199, ExtentBits::LOCKED);
        assert_eq!(t.len(), 2);
        t.check_invariants().unwrap();
        t.clear_bits(0, 199, ExtentBits::LOCKED);
        assert!(t.is_empty());
    }

    #[test]
    fn edges_of_the_address_space() {
        let mut t = ExtentIoTree::new();
        t.set_bits(u64::MAX - 9, u64::MAX, ExtentBits::DIRTY);
        t.set_bits(0, u64::MAX, ExtentBits::UPTODATE);
        assert_eq!(t.count_bits(0, u64::MAX, ExtentBits::DIRTY), 10);
        assert_eq!(t.count_bits(0, u64::MAX, ExtentBits::UPTODATE), u64::MAX);
        assert!(t.clear_bits(u64::MAX, u64::MAX, ExtentBits::ALL));
        assert_eq!(
            t.find_first_set(0, ExtentBits::DIRTY),
            Some((u64::MAX - 9, u64::MAX - 1))
        );
        t.check_invariants().unwrap();
    }

    #[test]
    fn bits_debug_names() {
        let b = ExtentBits::DIRTY | ExtentBits::LOCKED | ExtentBits::from_bits_retain(1 << 31);
        assert_eq!(format!("{b:?}"), "DIRTY|LOCKED|0x80000000");
    }
}
