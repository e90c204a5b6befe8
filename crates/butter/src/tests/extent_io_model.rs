//! The extent io tree against a per-byte bitmap model (proptest), the trim-in-place path of
//! `clear_bits` (seed 000) through its statistics, and range locking across threads.

use butter::extent_io::{ExtentBits, ExtentIoStats, ExtentIoTree, SharedExtentIoTree};
use proptest::prelude::*;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::Duration;

// ---- model test ---------------------------------------------------------------------------

/// Bytes in the window the operations touch.
const W: u64 = 64;

/// Bits the model test draws from: few, so identical neighbours (merges) are common; LOCKED
/// exercises the no-merge rule.
const PALETTE: [ExtentBits; 4] = [
    ExtentBits::DIRTY,
    ExtentBits::UPTODATE,
    ExtentBits::LOCKED,
    ExtentBits::DELALLOC,
];

#[derive(Debug, Clone)]
enum Op {
    Set(u64, u64, ExtentBits),
    Clear(u64, u64, ExtentBits),
    Test(u64, u64, ExtentBits, bool),
    FindFirst(u64, ExtentBits),
    FindContiguous(u64, ExtentBits),
    Count(u64, u64, ExtentBits),
    Iter(u64, u64),
}

fn bits_strategy() -> impl Strategy<Value = ExtentBits> {
    (0u32..16).prop_map(|m| {
        PALETTE
            .iter()
            .enumerate()
            .filter(|(i, _)| m & (1 << i) != 0)
            .fold(ExtentBits::EMPTY, |acc, (_, b)| acc | *b)
    })
}

/// Window-relative `(start, end)`: mostly ordered, sometimes reversed (a no-op).
fn range_strategy() -> impl Strategy<Value = (u64, u64)> {
    prop_oneof![
        9 => (0..W, 0..W).prop_map(|(a, b)| (a.min(b), a.max(b))),
        1 => (0..W, 0..W),
    ]
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let clear_bits = prop_oneof![3 => bits_strategy(), 1 => Just(ExtentBits::ALL)];
    prop_oneof![
        4 => (range_strategy(), bits_strategy()).prop_map(|((s, e), b)| Op::Set(s, e, b)),
        4 => (range_strategy(), clear_bits).prop_map(|((s, e), b)| Op::Clear(s, e, b)),
        1 => (range_strategy(), bits_strategy(), any::<bool>())
            .prop_map(|((s, e), b, all)| Op::Test(s, e, b, all)),
        1 => (0..W + 4, bits_strategy()).prop_map(|(f, b)| Op::FindFirst(f, b)),
        1 => (0..W + 4, bits_strategy()).prop_map(|(f, b)| Op::FindContiguous(f, b)),
        1 => (range_strategy(), bits_strategy()).prop_map(|((s, e), b)| Op::Count(s, e, b)),
        1 => range_strategy().prop_map(|(s, e)| Op::Iter(s, e)),
    ]
}

/// Per-byte state of the window; bytes outside it are never touched.
struct Model {
    base: u64,
    bytes: Vec<u32>,
}

impl Model {
    fn at(&self, rel: u64) -> u32 {
        self.bytes.get(rel as usize).copied().unwrap_or(0)
    }
    fn range(s: u64, e: u64) -> std::ops::RangeInclusive<u64> {
        s..=e
    }
    /// `from` is window-relative; past the end of the address space it means the last byte.
    fn first_set(&self, from: u64, bits: ExtentBits) -> Option<u64> {
        let from = self.base.saturating_add(from) - self.base;
        (from..W).find(|&i| self.at(i) & bits.bits() != 0)
    }
}

/// The per-byte state of the window as the tree reports it through `iter_range`.
fn tree_bytes(t: &ExtentIoTree, base: u64) -> Vec<u32> {
    let mut v = vec![0u32; W as usize];
    for r in t.iter_range(base, base + (W - 1)) {
        for a in r.start..=r.end {
            v[(a - base) as usize] = r.bits.bits();
        }
    }
    v
}

/// Applies `op` to the tree and the model, checking every answer the tree gives.
fn apply(t: &mut ExtentIoTree, m: &mut Model, op: &Op) -> Result<(), TestCaseError> {
    let b = m.base;
    match *op {
        Op::Set(s, e, bits) => {
            t.set_bits(b + s, b + e, bits);
            for i in Model::range(s, e) {
                m.bytes[i as usize] |= bits.bits();
            }
        }
        Op::Clear(s, e, bits) => {
            let got = t.clear_bits(b + s, b + e, bits);
            let mut want = false;
            for i in Model::range(s, e) {
                want |= m.bytes[i as usize] & bits.bits() != 0;
                m.bytes[i as usize] &= !bits.bits();
            }
            prop_assert_eq!(got, want, "clear_bits result");
        }
        Op::Test(s, e, bits, all) => {
            let got = t.test_bits(b + s, b + e, bits, all);
            let want = if all {
                Model::range(s, e).all(|i| m.at(i) & bits.bits() == bits.bits())
            } else {
                Model::range(s, e).any(|i| m.at(i) & bits.bits() != 0)
            };
            prop_assert_eq!(got, want, "test_bits all={}", all);
        }
        Op::FindFirst(from, bits) => {
            let got = t.find_first_set(b.saturating_add(from), bits);
            match m.first_set(from, bits) {
                None => prop_assert_eq!(got, None),
                Some(i) => {
                    let Some((gs, ge)) = got else {
                        return Err(TestCaseError::fail(format!(
                            "find_first_set: none, want {i}"
                        )));
                    };
                    prop_assert_eq!(gs, b + i, "find_first_set start");
                    prop_assert!(ge >= gs && ge - b < W, "find_first_set end {}", ge);
                    // One record: every byte carries the same bits.
                    let state = m.at(i);
                    prop_assert!(
                        ((gs - b)..=(ge - b)).all(|j| m.at(j) == state),
                        "find_first_set returned a range of mixed states"
                    );
                }
            }
        }
        Op::FindContiguous(from, bits) => {
            let got = t.find_contiguous(b.saturating_add(from), bits);
            let want = m.first_set(from, bits).map(|i| {
                let mut j = i;
                while j + 1 < W && m.at(j + 1) & bits.bits() != 0 {
                    j += 1;
                }
                (b + i, b + j)
            });
            prop_assert_eq!(got, want, "find_contiguous");
        }
        Op::Count(s, e, bits) => {
            let got = t.count_bits(b + s, b + e, bits);
            let want = Model::range(s, e)
                .filter(|&i| m.at(i) & bits.bits() != 0)
                .count() as u64;
            prop_assert_eq!(got, want, "count_bits");
        }
        Op::Iter(s, e) => {
            let recs: Vec<_> = t.iter_range(b + s, b + e).collect();
            let mut last_end: Option<u64> = None;
            let mut seen = vec![0u32; W as usize];
            for r in &recs {
                prop_assert!(r.start >= b + s && r.end <= b + e && r.start <= r.end);
                prop_assert!(last_end.is_none_or(|le| le < r.start), "iter_range order");
                last_end = Some(r.end);
                for a in r.start..=r.end {
                    seen[(a - b) as usize] = r.bits.bits();
                }
            }
            for i in 0..W {
                let want = if s <= i && i <= e { m.at(i) } else { 0 };
                prop_assert_eq!(seen[i as usize], want, "iter_range byte {}", i);
            }
        }
    }
    Ok(())
}

fn check(t: &ExtentIoTree, m: &Model) -> Result<(), TestCaseError> {
    if let Err(e) = t.check_invariants() {
        return Err(TestCaseError::fail(e));
    }
    prop_assert_eq!(tree_bytes(t, m.base), m.bytes.clone(), "window contents");
    prop_assert_eq!(t.iter().count(), t.len());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 400,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Random operation sequences on a 64-byte window, at offset 0, mid-range, and at the very
    /// end of the address space (inclusive ends must not overflow), run on two trees (trimming
    /// in place on and off) and a per-byte model. After every operation: the invariants hold,
    /// both trees show the model's bytes, and both hold exactly the same records.
    #[test]
    fn tree_matches_bitmap_model(
        base in prop_oneof![Just(0u64), Just(1_000_003u64), Just(u64::MAX - (W - 1))],
        ops in proptest::collection::vec(op_strategy(), 1..60),
    ) {
        let mut on = ExtentIoTree::new();
        let mut off = ExtentIoTree::new();
        off.set_trim_in_place(false);
        let mut m_on = Model { base, bytes: vec![0; W as usize] };
        let mut m_off = Model { base, bytes: vec![0; W as usize] };
        for op in &ops {
            apply(&mut on, &mut m_on, op)?;
            apply(&mut off, &mut m_off, op)?;
            check(&on, &m_on)?;
            check(&off, &m_off)?;
            prop_assert_eq!(on.iter().collect::<Vec<_>>(), off.iter().collect::<Vec<_>>());
        }
        // Trimming never splits more than splitting does.
        prop_assert!(on.stats().splits_performed <= off.stats().splits_performed);
        prop_assert_eq!(off.stats().splits_avoided, 0);
    }
}

// ---- the trim-in-place path -----------------------------------------------------------------

const D: ExtentBits = ExtentBits::DIRTY;
const K4: u64 = 4096;

fn records(t: &ExtentIoTree) -> Vec<(u64, u64)> {
    t.iter().map(|r| (r.start, r.end)).collect()
}

/// A tree holding `ranges` as DIRTY records, with its statistics reset.
fn dirty(ranges: &[(u64, u64)], trim: bool) -> ExtentIoTree {
    let mut t = ExtentIoTree::new();
    t.set_trim_in_place(trim);
    for &(s, e) in ranges {
        t.set_bits(s, e, D);
    }
    t.reset_stats();
    t
}

#[test]
fn trim_first_record_in_place() {
    let mut t = dirty(&[(0, 2 * K4 - 1)], true);
    assert!(t.clear_bits(K4, 3 * K4 - 1, ExtentBits::ALL));
    assert_eq!(records(&t), [(0, K4 - 1)]);
    let s = t.stats();
    assert_eq!(
        s,
        ExtentIoStats {
            splits_avoided: 1,
            trims_first: 1,
            ..ExtentIoStats::default()
        },
        "no split, no insert, no removal"
    );

    // Off: split (insert), then the inner half is removed.
    let mut t = dirty(&[(0, 2 * K4 - 1)], false);
    assert!(t.clear_bits(K4, 3 * K4 - 1, ExtentBits::ALL));
    assert_eq!(records(&t), [(0, K4 - 1)]);
    let s = t.stats();
    assert_eq!((s.splits_performed, s.splits_avoided), (1, 0));
    assert_eq!((s.records_inserted, s.records_removed), (1, 1));
}

#[test]
fn trim_last_record_in_place() {
    let mut t = dirty(&[(K4, 3 * K4 - 1)], true);
    assert!(t.clear_bits(0, 2 * K4 - 1, D));
    assert_eq!(records(&t), [(2 * K4, 3 * K4 - 1)]);
    let s = t.stats();
    assert_eq!(
        s,
        ExtentIoStats {
            splits_avoided: 1,
            trims_last: 1,
            ..ExtentIoStats::default()
        }
    );
    // The moved start is a working key: lookups, merges and further clears find it.
    assert_eq!(t.find_first_set(0, D), Some((2 * K4, 3 * K4 - 1)));
    assert!(t.test_bits(2 * K4, 3 * K4 - 1, D, true));
    t.set_bits(K4, 2 * K4 - 1, D);
    assert_eq!(records(&t), [(K4, 3 * K4 - 1)]);
    t.check_invariants().unwrap();

    let mut t = dirty(&[(K4, 3 * K4 - 1)], false);
    t.clear_bits(0, 2 * K4 - 1, D);
    assert_eq!(records(&t), [(2 * K4, 3 * K4 - 1)]);
    assert_eq!(
        (t.stats().splits_performed, t.stats().records_removed),
        (1, 1)
    );
}

#[test]
fn trim_both_edges_and_remove_the_middle() {
    // [0,8K) [12K,16K) [20K,28K); clear [4K, 24K): first and last trimmed, middle removed.
    let ranges = [(0, 2 * K4 - 1), (3 * K4, 4 * K4 - 1), (5 * K4, 7 * K4 - 1)];
    let mut t = dirty(&ranges, true);
    assert!(t.clear_bits(K4, 6 * K4 - 1, ExtentBits::ALL));
    assert_eq!(records(&t), [(0, K4 - 1), (6 * K4, 7 * K4 - 1)]);
    let s = t.stats();
    assert_eq!(
        (
            s.splits_performed,
            s.splits_avoided,
            s.trims_first,
            s.trims_last
        ),
        (0, 2, 1, 1)
    );
    assert_eq!((s.records_inserted, s.records_removed), (0, 1));

    let mut t = dirty(&ranges, false);
    t.clear_bits(K4, 6 * K4 - 1, ExtentBits::ALL);
    assert_eq!(records(&t), [(0, K4 - 1), (6 * K4, 7 * K4 - 1)]);
    let s = t.stats();
    assert_eq!(
        (s.splits_performed, s.records_inserted, s.records_removed),
        (2, 2, 3)
    );
}

#[test]
fn hole_inside_one_record_needs_one_split_not_two() {
    let mut t = dirty(&[(0, 3 * K4 - 1)], true);
    t.clear_bits(K4, 2 * K4 - 1, D);
    assert_eq!(records(&t), [(0, K4 - 1), (2 * K4, 3 * K4 - 1)]);
    let s = t.stats();
    assert_eq!(
        (s.splits_performed, s.splits_avoided, s.records_inserted),
        (1, 1, 1)
    );

    let mut t = dirty(&[(0, 3 * K4 - 1)], false);
    t.clear_bits(K4, 2 * K4 - 1, D);
    assert_eq!(records(&t), [(0, K4 - 1), (2 * K4, 3 * K4 - 1)]);
    assert_eq!(t.stats().splits_performed, 2);
}

#[test]
fn no_trim_when_bits_remain_or_record_untouched() {
    // DIRTY|UPTODATE loses only DIRTY: the edge record must split.
    let mut t = ExtentIoTree::new();
    t.set_bits(0, 2 * K4 - 1, D | ExtentBits::UPTODATE);
    t.reset_stats();
    t.clear_bits(K4, 3 * K4 - 1, D);
    let r: Vec<_> = t.iter().map(|r| (r.start, r.end, r.bits)).collect();
    assert_eq!(
        r,
        [
            (0, K4 - 1, D | ExtentBits::UPTODATE),
            (K4, 2 * K4 - 1, ExtentBits::UPTODATE)
        ]
    );
    assert_eq!(
        (t.stats().splits_performed, t.stats().splits_avoided),
        (1, 0)
    );

    // A record without any of the bits is neither split nor trimmed.
    t.reset_stats();
    assert!(!t.clear_bits(K4 / 2, K4 + 10, ExtentBits::WRITEBACK));
    assert_eq!(t.stats(), ExtentIoStats::default());
    t.check_invariants().unwrap();
}

#[test]
fn clearing_some_bits_merges_neighbours() {
    let mut t = ExtentIoTree::new();
    t.set_bits(0, 3 * K4 - 1, D);
    t.set_bits(K4, 2 * K4 - 1, ExtentBits::WRITEBACK);
    assert_eq!(t.len(), 3);
    t.clear_bits(K4, 2 * K4 - 1, ExtentBits::WRITEBACK);
    assert_eq!(records(&t), [(0, 3 * K4 - 1)]);
    t.check_invariants().unwrap();
}

// ---- range locking ------------------------------------------------------------------------

#[test]
fn overlapping_locks_serialize() {
    let tree = Arc::new(SharedExtentIoTree::new());
    tree.lock_range(0, 2 * K4 - 1);
    assert!(!tree.try_lock_range(K4, 3 * K4 - 1));
    assert_eq!(tree.wakeups(), 0);

    let acquired = Arc::new(AtomicBool::new(false));
    let (t2, a2) = (tree.clone(), acquired.clone());
    let waiter = thread::spawn(move || {
        t2.lock_range(K4, 3 * K4 - 1);
        a2.store(true, Ordering::SeqCst);
        // Holds [4K, 12K) now: the first holder's old range is free again except the overlap.
        assert!(t2.test_bits(K4, 3 * K4 - 1, ExtentBits::LOCKED, true));
        t2.unlock_range(K4, 3 * K4 - 1);
    });
    // Let the waiter block; whatever the timing, it must not get the lock while we hold it.
    thread::sleep(Duration::from_millis(50));
    assert!(!acquired.load(Ordering::SeqCst));
    assert!(tree.unlock_range(0, 2 * K4 - 1));
    waiter.join().unwrap();
    assert!(acquired.load(Ordering::SeqCst));
    assert!(tree.with(|t| t.is_empty()));
    assert!(tree.try_lock_range(0, 4 * K4 - 1));
    tree.unlock_range(0, 4 * K4 - 1);
}

#[test]
fn disjoint_locks_do_not_block() {
    let tree = Arc::new(SharedExtentIoTree::new());
    let _held = tree.lock_range_guard(0, K4 - 1);
    let (tx, rx) = mpsc::channel();
    let t2 = tree.clone();
    thread::spawn(move || {
        // Touching but not overlapping: [4K, 8K).
        t2.lock_range(K4, 2 * K4 - 1);
        tx.send(t2.records(0, 2 * K4 - 1).len()).unwrap();
        t2.unlock_range(K4, 2 * K4 - 1);
    });
    let n = rx
        .recv_timeout(Duration::from_secs(10))
        .expect("disjoint lock blocked");
    // Two holders' adjacent ranges stay two records (LOCKED does not merge).
    assert_eq!(n, 2);
    assert_eq!(tree.wakeups(), 0, "no waiter, no wake-up");
}

#[test]
fn lock_guard_unlocks_on_drop() {
    let tree = SharedExtentIoTree::new();
    {
        let g = tree.lock_range_guard(100, 199);
        assert_eq!(g.range(), (100, 199));
        assert!(!tree.try_lock_range(150, 150));
    }
    assert!(tree.try_lock_range(150, 150));
}

#[test]
fn many_threads_never_share_a_locked_block() {
    const BLOCKS: usize = 16;
    let tree = Arc::new(SharedExtentIoTree::new());
    let owners: Arc<Vec<AtomicU32>> = Arc::new((0..BLOCKS).map(|_| AtomicU32::new(0)).collect());
    let handles: Vec<_> = (0..4u64)
        .map(|id| {
            let (tree, owners) = (tree.clone(), owners.clone());
            thread::spawn(move || {
                let mut x = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
                for _ in 0..300 {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let first = (x % BLOCKS as u64) as usize;
                    let n = 1 + ((x >> 20) % 4) as usize;
                    let last = (first + n - 1).min(BLOCKS - 1);
                    let (s, e) = (first as u64 * K4, (last as u64 + 1) * K4 - 1);
                    tree.lock_range(s, e);
                    for o in &owners[first..=last] {
                        assert_eq!(o.fetch_add(1, Ordering::SeqCst), 0, "block locked twice");
                    }
                    thread::yield_now();
                    for o in &owners[first..=last] {
                        o.fetch_sub(1, Ordering::SeqCst);
                    }
                    tree.unlock_range(s, e);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    tree.with(|t| {
        assert!(t.is_empty());
        t.check_invariants().unwrap();
    });
}
