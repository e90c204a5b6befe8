//! Model tests of the tree block mutation primitives (`crate::ctree::ops`).
//!
//! Random operation sequences run on a row of sibling blocks (the leaf level, or one node
//! level, of a tree) and on a `BTreeMap` model side by side. After every operation each block
//! is finalized and must pass the real tree checker (`disk_io::check_tree_block`), the items read
//! back through the read side's `TreeBlock` must equal the model, and neighbouring blocks must
//! keep their keys in order. Requests that cannot be met must fail with `Error::Internal` and
//! leave the bytes unchanged.
//!
//! `BUTTER_PROPTEST_CASES` raises the number of cases per test (default 48).
//!
//! A last test rebuilds every leaf and node of mkfs.btrfs images from their items alone and
//! expects the very same bytes (skipped when mkfs.btrfs is missing, an error under CI).

use super::ops::*;
use crate::format::csum::CsumType;
use crate::format::{Key, HEADER_SIZE, ITEM_SIZE};
use crate::io::disk_io::{check_tree_block, Expect, TreeBlock};
use crate::Error;
use proptest::prelude::*;
use std::collections::BTreeMap;

const FSID: [u8; 16] = *b"butter-ops-fsid!";
const CHUNK_UUID: [u8; 16] = *b"butter-chunk-uid";
const GEN: u64 = 42;
const OWNER: u64 = 5;

fn cases() -> u32 {
    std::env::var("BUTTER_PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

fn header(bytenr: u64) -> NewHeader {
    NewHeader {
        bytenr,
        owner: OWNER,
        generation: GEN,
        fsid: FSID,
        chunk_tree_uuid: CHUNK_UUID,
        flags: 1,
        ..Default::default()
    }
}

/// What the random runs did, so a test can tell that it exercised each path at all.
#[derive(Debug, Default, Clone)]
struct Stats {
    split_one_left: usize,
    split_one_right: usize,
    split_two_insert: usize,
    split_two_extend: usize,
    too_big: usize,
    pushed_left: usize,
    pushed_right: usize,
    merged: usize,
    merge_refused: usize,
    full_node_splits: usize,
    max_blocks: usize,
}

thread_local! {
    static STATS: std::cell::RefCell<Stats> = std::cell::RefCell::new(Stats::default());
}

fn count(f: impl FnOnce(&mut Stats)) {
    STATS.with(|s| f(&mut s.borrow_mut()));
}

fn csum_of(sel: u8) -> CsumType {
    CsumType::from_disk((sel % 4) as u16).unwrap()
}

/// Blocks `i` and `i + 1` of a row, both mutable.
fn pair(v: &mut [Vec<u8>], i: usize) -> (&mut Vec<u8>, &mut Vec<u8>) {
    let (a, b) = v.split_at_mut(i + 1);
    (&mut a[i], &mut b[0])
}

/// Asserts `r` is `Error::Internal` and the bytes did not change.
fn assert_refused<T: std::fmt::Debug>(r: crate::Result<T>, before: &[u8], after: &[u8]) {
    match r {
        Err(Error::Internal(_)) => {}
        other => panic!("expected Error::Internal, got {other:?}"),
    }
    assert!(before == after, "a refused request changed the block");
}

fn key_of(obj: u16, ty: u8, off: u16) -> Key {
    const TYPES: [u8; 4] = [1, 12, 84, 108];
    Key::new(obj as u64 % 48, TYPES[ty as usize % 4], off as u64 % 512)
}

/// Deterministic fill bytes.
fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| seed.wrapping_mul(31).wrapping_add(i as u8).rotate_left(3))
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Leaves
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum LeafOp {
    Insert {
        key: (u16, u8, u16),
        len: (u8, u16),
        fill: u8,
    },
    InsertBatch {
        key: (u16, u8, u16),
        count: u8,
        len: (u8, u16),
        fill: u8,
    },
    Delete {
        pick: u16,
        count: u8,
    },
    Extend {
        pick: u16,
        len: (u8, u16),
        fill: u8,
    },
    Truncate {
        pick: u16,
        keep: u16,
        from_end: bool,
    },
    SetKey {
        pick: u16,
        up: bool,
    },
    PushLeft {
        pick: u16,
        frac: u8,
    },
    PushRight {
        pick: u16,
        frac: u8,
    },
    Merge {
        pick: u16,
    },
    Split {
        pick: u16,
        at: u16,
    },
}

fn leaf_op() -> impl Strategy<Value = LeafOp> {
    let key = (any::<u16>(), any::<u8>(), any::<u16>());
    let len = (any::<u8>(), any::<u16>());
    prop_oneof![
        10 => (key, len, any::<u8>())
            .prop_map(|(key, len, fill)| LeafOp::Insert { key, len, fill }),
        2 => (key, 2u8..6, len, any::<u8>())
            .prop_map(|(key, count, len, fill)| LeafOp::InsertBatch { key, count, len, fill }),
        3 => (any::<u16>(), 1u8..5).prop_map(|(pick, count)| LeafOp::Delete { pick, count }),
        3 => (any::<u16>(), len, any::<u8>())
            .prop_map(|(pick, len, fill)| LeafOp::Extend { pick, len, fill }),
        3 => (any::<u16>(), any::<u16>(), any::<bool>())
            .prop_map(|(pick, keep, from_end)| LeafOp::Truncate { pick, keep, from_end }),
        2 => (any::<u16>(), any::<bool>()).prop_map(|(pick, up)| LeafOp::SetKey { pick, up }),
        2 => (any::<u16>(), any::<u8>()).prop_map(|(pick, frac)| LeafOp::PushLeft { pick, frac }),
        2 => (any::<u16>(), any::<u8>()).prop_map(|(pick, frac)| LeafOp::PushRight { pick, frac }),
        1 => any::<u16>().prop_map(|pick| LeafOp::Merge { pick }),
        1 => (any::<u16>(), any::<u16>()).prop_map(|(pick, at)| LeafOp::Split { pick, at }),
    ]
}

/// A data length: mostly small, sometimes medium, sometimes near (or past) the largest item.
fn data_len(nodesize: usize, (class, raw): (u8, u16)) -> usize {
    let max = max_item_size(nodesize);
    match class % 10 {
        0..=5 => raw as usize % 48,
        6..=8 => raw as usize % (nodesize / 6),
        _ => (max + 8).saturating_sub(raw as usize % 400),
    }
}

struct LeafRow {
    nodesize: usize,
    csum: CsumType,
    blocks: Vec<Vec<u8>>,
    next_bytenr: u64,
    model: BTreeMap<Key, Vec<u8>>,
}

impl LeafRow {
    fn new(nodesize: usize, csum: CsumType) -> LeafRow {
        let mut r = LeafRow {
            nodesize,
            csum,
            blocks: Vec::new(),
            next_bytenr: 1 << 20,
            model: BTreeMap::new(),
        };
        let b = r.new_block();
        r.blocks.push(b);
        r
    }

    fn new_block(&mut self) -> Vec<u8> {
        let mut b = vec![0xa5u8; self.nodesize];
        LeafMut::init(&mut b, &header(self.next_bytenr)).unwrap();
        self.next_bytenr += self.nodesize as u64;
        b
    }

    /// The leaf a search would land in: the last one whose first key is <= key (else the first).
    fn leaf_for(&mut self, key: &Key) -> usize {
        let mut at = 0;
        for (i, b) in self.blocks.iter_mut().enumerate() {
            match LeafMut::new(b).unwrap().first_key() {
                Some(f) if f <= *key => at = i,
                _ => {}
            }
        }
        at
    }

    /// Leaf index and slot of the item at index `pick` of the model (modulo its size).
    fn locate(&mut self, pick: u16) -> Option<(usize, usize)> {
        if self.model.is_empty() {
            return None;
        }
        let mut idx = pick as usize % self.model.len();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let n = LeafMut::new(b).unwrap().nritems();
            if idx < n {
                return Some((i, idx));
            }
            idx -= n;
        }
        unreachable!("model has more items than the leaves")
    }

    fn slot_in(&mut self, leaf: usize, key: &Key) -> usize {
        let l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
        (0..l.nritems())
            .find(|&s| l.key(s).unwrap() >= *key)
            .unwrap_or(l.nritems())
    }

    /// Makes room for `growth` at (`leaf`, `slot`) by splitting as planned; returns where the
    /// target slot is afterwards, or None if the growth cannot fit even alone.
    fn make_room(&mut self, leaf: usize, slot: usize, growth: Growth) -> Option<(usize, usize)> {
        let plan = {
            let l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
            match l.plan_split(slot, growth) {
                Ok(p) => p,
                Err(Error::Internal(_)) => {
                    let alone = match growth {
                        Growth::Insert { items, data_len } => items * ITEM_SIZE + data_len,
                        Growth::Extend { extra } => {
                            extra + l.item(slot).unwrap().size as usize + ITEM_SIZE
                        }
                    };
                    assert!(
                        alone > self.nodesize - HEADER_SIZE,
                        "plan refused {growth:?}"
                    );
                    count(|s| s.too_big += 1);
                    return None;
                }
                Err(e) => panic!("{e}"),
            }
        };
        match plan {
            LeafSplit::NotNeeded => Some((leaf, slot)),
            LeafSplit::One { at, into_right } => {
                let mut right = self.new_block();
                let first = {
                    let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                    let mut r = LeafMut::new(&mut right).unwrap();
                    let first = split_leaf(&mut l, &mut r, at).unwrap();
                    assert_eq!(first, r.first_key());
                    first
                };
                self.blocks.insert(leaf + 1, right);
                count(|s| {
                    if into_right {
                        s.split_one_right += 1
                    } else {
                        s.split_one_left += 1
                    }
                });
                if into_right {
                    assert!(slot >= at);
                    assert!(first.is_some() || matches!(growth, Growth::Insert { .. }));
                    Some((leaf + 1, slot - at))
                } else {
                    Some((leaf, slot))
                }
            }
            LeafSplit::Two { first, second } => {
                let mut middle = self.new_block();
                let mut right = self.new_block();
                {
                    let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                    let mut r = LeafMut::new(&mut right).unwrap();
                    split_leaf(&mut l, &mut r, second).unwrap();
                    let mut m = LeafMut::new(&mut middle).unwrap();
                    split_leaf(&mut l, &mut m, first).unwrap();
                    assert!(l.nritems() > 0 && r.nritems() > 0, "Two left an empty leaf");
                }
                self.blocks.insert(leaf + 1, middle);
                self.blocks.insert(leaf + 2, right);
                count(|s| {
                    if first == second {
                        s.split_two_insert += 1
                    } else {
                        s.split_two_extend += 1
                    }
                });
                Some((leaf + 1, 0))
            }
        }
    }

    fn fits_alone(&self, need: usize) -> bool {
        need <= self.nodesize - HEADER_SIZE
    }

    fn apply(&mut self, op: &LeafOp) {
        let ns = self.nodesize;
        match *op {
            LeafOp::Insert { key, len, fill } => {
                let key = key_of(key.0, key.1, key.2);
                let len = data_len(ns, len);
                let leaf = self.leaf_for(&key);
                let slot = self.slot_in(leaf, &key);
                if self.model.contains_key(&key) {
                    let b = &mut self.blocks[leaf];
                    let before = b.clone();
                    let r = LeafMut::new(b)
                        .unwrap()
                        .insert_item(slot, key, 0)
                        .map(|_| ());
                    assert_refused(r, &before, b);
                    return;
                }
                let Some((leaf, slot)) = self.make_room(
                    leaf,
                    slot,
                    Growth::Insert {
                        items: 1,
                        data_len: len,
                    },
                ) else {
                    assert!(!self.fits_alone(len + ITEM_SIZE));
                    return;
                };
                let data = pattern(fill, len);
                let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                let area = l.insert_item(slot, key, len).unwrap();
                assert!(area.iter().all(|&x| x == 0), "new item data not zeroed");
                area.copy_from_slice(&data);
                self.model.insert(key, data);
            }
            LeafOp::InsertBatch {
                key,
                count,
                len,
                fill,
            } => {
                let first = key_of(key.0, key.1, key.2);
                let keys: Vec<Key> = (0..count as u64)
                    .map(|i| Key::new(first.objectid, first.ty, first.offset + i))
                    .collect();
                let last = *keys.last().unwrap();
                if self.model.range(first..=last).next().is_some() {
                    return;
                }
                let len = data_len(ns, len) / count as usize;
                let leaf = self.leaf_for(&first);
                let slot = self.slot_in(leaf, &first);
                let growth = Growth::Insert {
                    items: keys.len(),
                    data_len: len * keys.len(),
                };
                let Some((leaf, slot)) = self.make_room(leaf, slot, growth) else {
                    return;
                };
                let items: Vec<(Key, usize)> = keys.iter().map(|k| (*k, len)).collect();
                let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                l.insert_items(slot, &items).unwrap();
                for (j, k) in keys.iter().enumerate() {
                    let data = pattern(fill.wrapping_add(j as u8), len);
                    let area = l.item_data_mut(slot + j).unwrap();
                    assert!(area.iter().all(|&x| x == 0));
                    area.copy_from_slice(&data);
                    self.model.insert(*k, data);
                }
            }
            LeafOp::Delete { pick, count } => {
                let Some((leaf, slot)) = self.locate(pick) else {
                    return;
                };
                let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                let n = l.nritems();
                let count = (count as usize).min(n - slot);
                let before = l.as_bytes().to_vec();
                let r = l.delete_items(slot, n - slot + 1);
                assert_refused(r, &before, l.as_bytes());
                for s in slot..slot + count {
                    self.model.remove(&l.key(s).unwrap());
                }
                l.delete_items(slot, count).unwrap();
                if l.nritems() == 0 && self.blocks.len() > 1 {
                    self.blocks.remove(leaf);
                }
            }
            LeafOp::Extend { pick, len, fill } => {
                let Some((leaf, slot)) = self.locate(pick) else {
                    return;
                };
                let extra = data_len(ns, len) / 2;
                let key = LeafMut::new(&mut self.blocks[leaf])
                    .unwrap()
                    .key(slot)
                    .unwrap();
                let Some((leaf, slot)) = self.make_room(leaf, slot, Growth::Extend { extra })
                else {
                    return;
                };
                let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                assert_eq!(l.key(slot).unwrap(), key, "split moved the target");
                l.extend_item(slot, extra).unwrap();
                let d = l.item_data_mut(slot).unwrap();
                let old = d.len() - extra;
                assert!(d[old..].iter().all(|&x| x == 0), "extension not zeroed");
                let add = pattern(fill, extra);
                d[old..].copy_from_slice(&add);
                self.model.get_mut(&key).unwrap().extend_from_slice(&add);
            }
            LeafOp::Truncate {
                pick,
                keep,
                from_end,
            } => {
                let Some((leaf, slot)) = self.locate(pick) else {
                    return;
                };
                let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                let key = l.key(slot).unwrap();
                let size = l.item(slot).unwrap().size as usize;
                let before = l.as_bytes().to_vec();
                let r = l.truncate_item(slot, size + 1, from_end);
                assert_refused(r, &before, l.as_bytes());
                let new_size = size * keep as usize / 65536;
                l.truncate_item(slot, new_size, from_end).unwrap();
                let v = self.model.get_mut(&key).unwrap();
                if from_end {
                    v.truncate(new_size);
                } else {
                    v.drain(..size - new_size);
                }
            }
            LeafOp::SetKey { pick, up } => {
                let Some((leaf, slot)) = self.locate(pick) else {
                    return;
                };
                let mut l = LeafMut::new(&mut self.blocks[leaf]).unwrap();
                let key = l.key(slot).unwrap();
                // A neighbour's key is always refused.
                let n = l.nritems();
                if n > 1 {
                    let other = if slot + 1 < n { slot + 1 } else { slot - 1 };
                    let nk = l.key(other).unwrap();
                    let before = l.as_bytes().to_vec();
                    let r = l.set_key(slot, nk);
                    assert_refused(r, &before, l.as_bytes());
                }
                // A key strictly between the neighbours in the whole row is accepted.
                let cand = if up {
                    Key::new(key.objectid, key.ty, key.offset + 1)
                } else if key.offset > 0 {
                    Key::new(key.objectid, key.ty, key.offset - 1)
                } else {
                    return;
                };
                if self.model.contains_key(&cand) {
                    return;
                }
                l.set_key(slot, cand).unwrap();
                let v = self.model.remove(&key).unwrap();
                self.model.insert(cand, v);
            }
            LeafOp::PushLeft { pick, frac } => {
                if self.blocks.len() < 2 {
                    return;
                }
                let i = pick as usize % (self.blocks.len() - 1);
                let (a, b) = pair(&mut self.blocks, i);
                let mut left = LeafMut::new(a).unwrap();
                let mut right = LeafMut::new(b).unwrap();
                let max = right.items_fitting_from_start(left.free_space());
                if max < right.nritems() {
                    let (lb, rb) = (left.as_bytes().to_vec(), right.as_bytes().to_vec());
                    let r = push_leaf_left(&mut left, &mut right, max + 1);
                    assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
                    assert!(lb == left.as_bytes() && rb == right.as_bytes());
                }
                let count = frac as usize % (max + 1);
                let first = push_leaf_left(&mut left, &mut right, count).unwrap();
                if count > 0 {
                    self::count(|s| s.pushed_left += 1);
                }
                assert_eq!(first, right.first_key());
                if right.nritems() == 0 {
                    self.blocks.remove(i + 1);
                }
            }
            LeafOp::PushRight { pick, frac } => {
                if self.blocks.len() < 2 {
                    return;
                }
                let i = pick as usize % (self.blocks.len() - 1);
                let (a, b) = pair(&mut self.blocks, i);
                let mut left = LeafMut::new(a).unwrap();
                let mut right = LeafMut::new(b).unwrap();
                let max = left.items_fitting_from_end(right.free_space());
                if max < left.nritems() {
                    let (lb, rb) = (left.as_bytes().to_vec(), right.as_bytes().to_vec());
                    let r = push_leaf_right(&mut left, &mut right, max + 1);
                    assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
                    assert!(lb == left.as_bytes() && rb == right.as_bytes());
                }
                let count = frac as usize % (max + 1);
                let first = push_leaf_right(&mut left, &mut right, count).unwrap();
                if count > 0 {
                    self::count(|s| s.pushed_right += 1);
                }
                assert_eq!(first, right.first_key());
                assert!(first.is_some());
                if left.nritems() == 0 {
                    self.blocks.remove(i);
                }
            }
            LeafOp::Merge { pick } => {
                if self.blocks.len() < 2 {
                    return;
                }
                let i = pick as usize % (self.blocks.len() - 1);
                let (a, b) = pair(&mut self.blocks, i);
                let mut left = LeafMut::new(a).unwrap();
                let mut right = LeafMut::new(b).unwrap();
                let need = right.used_bytes(0..right.nritems()).unwrap();
                if need <= left.free_space() {
                    merge_leaves(&mut left, &mut right).unwrap();
                    count(|s| s.merged += 1);
                    assert_eq!(right.nritems(), 0);
                    self.blocks.remove(i + 1);
                } else {
                    let (lb, rb) = (left.as_bytes().to_vec(), right.as_bytes().to_vec());
                    let r = merge_leaves(&mut left, &mut right);
                    count(|s| s.merge_refused += 1);
                    assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
                    assert!(lb == left.as_bytes() && rb == right.as_bytes());
                }
            }
            LeafOp::Split { pick, at } => {
                let i = pick as usize % self.blocks.len();
                let n = LeafMut::new(&mut self.blocks[i]).unwrap().nritems();
                if n < 2 {
                    return;
                }
                let at = 1 + at as usize % (n - 1);
                let mut right = self.new_block();
                let mut l = LeafMut::new(&mut self.blocks[i]).unwrap();
                let mut r = LeafMut::new(&mut right).unwrap();
                let first = split_leaf(&mut l, &mut r, at).unwrap();
                assert_eq!(first, r.first_key());
                // A second split into a non-empty leaf is refused.
                let (lb, rb) = (l.as_bytes().to_vec(), r.as_bytes().to_vec());
                let e = split_leaf(&mut l, &mut r, 0);
                assert!(matches!(e, Err(Error::Internal(_))));
                assert!(lb == l.as_bytes() && rb == r.as_bytes());
                self.blocks.insert(i + 1, right);
            }
        }
    }

    /// Finalizes and checks every block; compares the items with the model.
    fn verify(&mut self) {
        let mut items: Vec<(Key, Vec<u8>)> = Vec::new();
        let nblocks = self.blocks.len();
        count(|s| s.max_blocks = s.max_blocks.max(nblocks));
        for b in self.blocks.iter_mut() {
            let bytenr = read_header(b).unwrap().bytenr;
            let (free, n) = {
                let mut l = LeafMut::new(b).unwrap();
                l.finalize(self.csum).unwrap();
                (l.free_space(), l.nritems())
            };
            assert!(n > 0 || nblocks == 1, "an empty leaf stayed in the row");
            let expect = Expect {
                owner: Some(OWNER),
                level: Some(0),
                generation: Some(GEN),
                first_key: None,
            };
            let h = check_tree_block(b, bytenr, self.nodesize as u32, self.csum, &FSID, &expect)
                .unwrap_or_else(|e| panic!("tree checker: {e}"));
            let tb = TreeBlock {
                bytenr,
                header: h,
                data: b.clone().into_boxed_slice(),
            };
            assert_eq!(tb.leaf_free_space(), free);
            assert_eq!(tb.header.flags, 1);
            assert_eq!(tb.header.backref_rev, 1);
            for s in 0..tb.nritems() {
                items.push((tb.key(s), tb.item_data(s).to_vec()));
            }
            // Free space is zeroed (the buffers start out dirty, init zeroes them).
            let start = HEADER_SIZE + n * ITEM_SIZE;
            assert!(b[start..start + free].iter().all(|&x| x == 0));
        }
        let want: Vec<(Key, Vec<u8>)> = self.model.iter().map(|(k, v)| (*k, v.clone())).collect();
        assert!(items == want, "leaves differ from the model");
    }
}

fn run_leaf_ops(nodesize: usize, csum: u8, ops: &[LeafOp]) {
    let mut row = LeafRow::new(nodesize, csum_of(csum));
    row.verify();
    for op in ops {
        row.apply(op);
        row.verify();
    }
}

/// Runs `cases()` random cases of `strategy` through `body` (shrinking a failure), then
/// returns what the cases did.
fn run_cases<S: Strategy>(strategy: S, body: impl Fn(S::Value)) -> Stats
where
    S::Value: std::fmt::Debug,
{
    count(|s| *s = Stats::default());
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let r = runner.run(&strategy, |v| {
        body(v);
        Ok(())
    });
    if let Err(e) = r {
        panic!("{e}");
    }
    let stats = STATS.with(|s| s.borrow().clone());
    eprintln!("{stats:?}");
    stats
}

fn leaf_ops_match_model(nodesize: usize) {
    let st = run_cases(
        (any::<u8>(), prop::collection::vec(leaf_op(), 1..200)),
        |(csum, ops)| run_leaf_ops(nodesize, csum, &ops),
    );
    assert!(st.split_one_left > 0 && st.split_one_right > 0, "{st:?}");
    assert!(st.split_two_insert > 0 && st.too_big > 0, "{st:?}");
    assert!(st.pushed_left > 0 && st.pushed_right > 0, "{st:?}");
    assert!(st.merged > 0 && st.merge_refused > 0, "{st:?}");
}

fn node_ops_match_model(nodesize: usize) {
    let st = run_cases(
        (
            any::<u8>(),
            1u8..8,
            prop::collection::vec(node_op(), 1..120),
        ),
        |(csum, level, ops)| run_node_ops(nodesize, level, csum, &ops),
    );
    assert!(st.full_node_splits > 0, "{st:?}");
    assert!(st.pushed_left > 0 && st.pushed_right > 0, "{st:?}");
    assert!(st.merged > 0 && st.merge_refused > 0, "{st:?}");
}

#[test]
fn leaf_ops_4k_match_model() {
    leaf_ops_match_model(4096);
}

#[test]
fn leaf_ops_16k_match_model() {
    leaf_ops_match_model(16384);
}

#[test]
fn node_ops_4k_match_model() {
    node_ops_match_model(4096);
}

#[test]
fn node_ops_16k_match_model() {
    node_ops_match_model(16384);
}

// ---------------------------------------------------------------------------------------------
// Nodes
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone)]
enum NodeOp {
    Insert {
        key: (u16, u8, u16),
        ptr: u32,
        gen: u8,
    },
    Fill {
        key: (u16, u8, u16),
        count: u8,
        ptr: u32,
    },
    Delete {
        pick: u16,
        count: u8,
    },
    SetPtr {
        pick: u16,
        ptr: u32,
        gen: u8,
    },
    SetKey {
        pick: u16,
        up: bool,
    },
    PushLeft {
        pick: u16,
        frac: u16,
    },
    PushRight {
        pick: u16,
        frac: u16,
    },
    Merge {
        pick: u16,
    },
    Split {
        pick: u16,
        at: u16,
    },
}

fn node_op() -> impl Strategy<Value = NodeOp> {
    let key = (any::<u16>(), any::<u8>(), any::<u16>());
    prop_oneof![
        8 => (key, any::<u32>(), any::<u8>())
            .prop_map(|(key, ptr, gen)| NodeOp::Insert { key, ptr, gen }),
        2 => (key, 1u8..200, any::<u32>())
            .prop_map(|(key, count, ptr)| NodeOp::Fill { key, count, ptr }),
        3 => (any::<u16>(), 1u8..40).prop_map(|(pick, count)| NodeOp::Delete { pick, count }),
        2 => (any::<u16>(), any::<u32>(), any::<u8>())
            .prop_map(|(pick, ptr, gen)| NodeOp::SetPtr { pick, ptr, gen }),
        2 => (any::<u16>(), any::<bool>()).prop_map(|(pick, up)| NodeOp::SetKey { pick, up }),
        2 => (any::<u16>(), any::<u16>()).prop_map(|(pick, frac)| NodeOp::PushLeft { pick, frac }),
        2 => (any::<u16>(), any::<u16>()).prop_map(|(pick, frac)| NodeOp::PushRight { pick, frac }),
        1 => any::<u16>().prop_map(|pick| NodeOp::Merge { pick }),
        1 => (any::<u16>(), any::<u16>()).prop_map(|(pick, at)| NodeOp::Split { pick, at }),
    ]
}

/// Child addresses: block aligned, non-zero, far below the nodes' own addresses.
fn child_ptr(raw: u32) -> u64 {
    4096 * (1 + (raw as u64 % (1 << 20)))
}
fn child_gen(raw: u8) -> u64 {
    1 + raw as u64 % GEN
}

struct NodeRow {
    nodesize: usize,
    level: u8,
    csum: CsumType,
    blocks: Vec<Vec<u8>>,
    next_bytenr: u64,
    model: BTreeMap<Key, (u64, u64)>,
}

impl NodeRow {
    fn new(nodesize: usize, level: u8, csum: CsumType) -> NodeRow {
        let mut r = NodeRow {
            nodesize,
            level,
            csum,
            blocks: Vec::new(),
            next_bytenr: 1 << 40,
            model: BTreeMap::new(),
        };
        let b = r.new_block();
        r.blocks.push(b);
        r
    }

    fn new_block(&mut self) -> Vec<u8> {
        let mut b = vec![0x5au8; self.nodesize];
        NodeMut::init(&mut b, self.level, &header(self.next_bytenr)).unwrap();
        self.next_bytenr += self.nodesize as u64;
        b
    }

    fn node_for(&mut self, key: &Key) -> usize {
        let mut at = 0;
        for (i, b) in self.blocks.iter_mut().enumerate() {
            match NodeMut::new(b).unwrap().first_key() {
                Some(f) if f <= *key => at = i,
                _ => {}
            }
        }
        at
    }

    fn locate(&mut self, pick: u16) -> Option<(usize, usize)> {
        if self.model.is_empty() {
            return None;
        }
        let mut idx = pick as usize % self.model.len();
        for (i, b) in self.blocks.iter_mut().enumerate() {
            let n = NodeMut::new(b).unwrap().nritems();
            if idx < n {
                return Some((i, idx));
            }
            idx -= n;
        }
        unreachable!()
    }

    /// Inserts one pointer, splitting the node in half when it is full.
    fn insert(&mut self, key: Key, ptr: u64, gen: u64) {
        let i = self.node_for(&key);
        let (slot, full, n) = {
            let nd = NodeMut::new(&mut self.blocks[i]).unwrap();
            let n = nd.nritems();
            let slot = (0..n).find(|&s| nd.key(s).unwrap() >= key).unwrap_or(n);
            (slot, nd.free_ptrs() == 0, n)
        };
        if self.model.contains_key(&key) {
            let b = &mut self.blocks[i];
            let before = b.clone();
            let r = NodeMut::new(b).unwrap().insert_ptr(slot, key, ptr, gen);
            assert_refused(r, &before, b);
            return;
        }
        let (i, slot) = if full {
            let before = self.blocks[i].clone();
            let r = NodeMut::new(&mut self.blocks[i])
                .unwrap()
                .insert_ptr(slot, key, ptr, gen);
            assert_refused(r, &before, &self.blocks[i]);
            let at = n / 2;
            let mut right = self.new_block();
            let mut l = NodeMut::new(&mut self.blocks[i]).unwrap();
            let mut r = NodeMut::new(&mut right).unwrap();
            let first = split_node(&mut l, &mut r, at).unwrap();
            assert_eq!(first, r.first_key());
            self.blocks.insert(i + 1, right);
            count(|s| s.full_node_splits += 1);
            if slot <= at {
                (i, slot)
            } else {
                (i + 1, slot - at)
            }
        } else {
            (i, slot)
        };
        let mut nd = NodeMut::new(&mut self.blocks[i]).unwrap();
        nd.insert_ptr(slot, key, ptr, gen).unwrap();
        self.model.insert(key, (ptr, gen));
    }

    fn apply(&mut self, op: &NodeOp) {
        match *op {
            NodeOp::Insert { key, ptr, gen } => {
                self.insert(key_of(key.0, key.1, key.2), child_ptr(ptr), child_gen(gen));
            }
            NodeOp::Fill { key, count, ptr } => {
                let k = key_of(key.0, key.1, key.2);
                for j in 0..count as u64 {
                    let key = Key::new(k.objectid, k.ty, k.offset + j * 3);
                    if !self.model.contains_key(&key) {
                        self.insert(key, child_ptr(ptr.wrapping_add(j as u32)), GEN);
                    }
                }
            }
            NodeOp::Delete { pick, count } => {
                let Some((i, slot)) = self.locate(pick) else {
                    return;
                };
                let mut nd = NodeMut::new(&mut self.blocks[i]).unwrap();
                let n = nd.nritems();
                let count = (count as usize).min(n - slot);
                let before = nd.as_bytes().to_vec();
                let r = nd.delete_ptrs(slot, n - slot + 1);
                assert_refused(r, &before, nd.as_bytes());
                for s in slot..slot + count {
                    self.model.remove(&nd.key(s).unwrap());
                }
                nd.delete_ptrs(slot, count).unwrap();
                if nd.nritems() == 0 && self.blocks.len() > 1 {
                    self.blocks.remove(i);
                }
            }
            NodeOp::SetPtr { pick, ptr, gen } => {
                let Some((i, slot)) = self.locate(pick) else {
                    return;
                };
                let mut nd = NodeMut::new(&mut self.blocks[i]).unwrap();
                let key = nd.key(slot).unwrap();
                let (ptr, gen) = (child_ptr(ptr), child_gen(gen));
                nd.set_ptr(slot, ptr, gen).unwrap();
                let p = nd.ptr(slot).unwrap();
                assert_eq!((p.key, p.blockptr, p.generation), (key, ptr, gen));
                self.model.insert(key, (ptr, gen));
            }
            NodeOp::SetKey { pick, up } => {
                let Some((i, slot)) = self.locate(pick) else {
                    return;
                };
                let mut nd = NodeMut::new(&mut self.blocks[i]).unwrap();
                let key = nd.key(slot).unwrap();
                let n = nd.nritems();
                if n > 1 {
                    let other = if slot + 1 < n { slot + 1 } else { slot - 1 };
                    let nk = nd.key(other).unwrap();
                    let before = nd.as_bytes().to_vec();
                    let r = nd.set_key(slot, nk);
                    assert_refused(r, &before, nd.as_bytes());
                }
                let cand = if up {
                    Key::new(key.objectid, key.ty, key.offset + 1)
                } else if key.offset > 0 {
                    Key::new(key.objectid, key.ty, key.offset - 1)
                } else {
                    return;
                };
                if self.model.contains_key(&cand) {
                    return;
                }
                nd.set_key(slot, cand).unwrap();
                let v = self.model.remove(&key).unwrap();
                self.model.insert(cand, v);
            }
            NodeOp::PushLeft { pick, frac } => {
                if self.blocks.len() < 2 {
                    return;
                }
                let i = pick as usize % (self.blocks.len() - 1);
                let (a, b) = pair(&mut self.blocks, i);
                let mut left = NodeMut::new(a).unwrap();
                let mut right = NodeMut::new(b).unwrap();
                let max = right.nritems().min(left.free_ptrs());
                if max < right.nritems() {
                    let (lb, rb) = (left.as_bytes().to_vec(), right.as_bytes().to_vec());
                    let r = push_node_left(&mut left, &mut right, max + 1);
                    assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
                    assert!(lb == left.as_bytes() && rb == right.as_bytes());
                }
                let count = frac as usize % (max + 1);
                let first = push_node_left(&mut left, &mut right, count).unwrap();
                if count > 0 {
                    self::count(|s| s.pushed_left += 1);
                }
                assert_eq!(first, right.first_key());
                if right.nritems() == 0 {
                    self.blocks.remove(i + 1);
                }
            }
            NodeOp::PushRight { pick, frac } => {
                if self.blocks.len() < 2 {
                    return;
                }
                let i = pick as usize % (self.blocks.len() - 1);
                let (a, b) = pair(&mut self.blocks, i);
                let mut left = NodeMut::new(a).unwrap();
                let mut right = NodeMut::new(b).unwrap();
                let max = left.nritems().min(right.free_ptrs());
                if max < left.nritems() {
                    let (lb, rb) = (left.as_bytes().to_vec(), right.as_bytes().to_vec());
                    let r = push_node_right(&mut left, &mut right, max + 1);
                    assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
                    assert!(lb == left.as_bytes() && rb == right.as_bytes());
                }
                let count = frac as usize % (max + 1);
                let first = push_node_right(&mut left, &mut right, count).unwrap();
                if count > 0 {
                    self::count(|s| s.pushed_right += 1);
                }
                assert_eq!(first, right.first_key());
                if left.nritems() == 0 {
                    self.blocks.remove(i);
                }
            }
            NodeOp::Merge { pick } => {
                if self.blocks.len() < 2 {
                    return;
                }
                let i = pick as usize % (self.blocks.len() - 1);
                let (a, b) = pair(&mut self.blocks, i);
                let mut left = NodeMut::new(a).unwrap();
                let mut right = NodeMut::new(b).unwrap();
                if right.nritems() <= left.free_ptrs() {
                    merge_nodes(&mut left, &mut right).unwrap();
                    count(|s| s.merged += 1);
                    assert_eq!(right.nritems(), 0);
                    self.blocks.remove(i + 1);
                } else {
                    let (lb, rb) = (left.as_bytes().to_vec(), right.as_bytes().to_vec());
                    let r = merge_nodes(&mut left, &mut right);
                    count(|s| s.merge_refused += 1);
                    assert!(matches!(r, Err(Error::Internal(_))), "{r:?}");
                    assert!(lb == left.as_bytes() && rb == right.as_bytes());
                }
            }
            NodeOp::Split { pick, at } => {
                let i = pick as usize % self.blocks.len();
                let n = NodeMut::new(&mut self.blocks[i]).unwrap().nritems();
                if n < 2 {
                    return;
                }
                let at = 1 + at as usize % (n - 1);
                let mut right = self.new_block();
                let mut l = NodeMut::new(&mut self.blocks[i]).unwrap();
                let mut r = NodeMut::new(&mut right).unwrap();
                let first = split_node(&mut l, &mut r, at).unwrap();
                assert_eq!(first, r.first_key());
                self.blocks.insert(i + 1, right);
            }
        }
    }

    fn verify(&mut self) {
        let mut ptrs: Vec<(Key, (u64, u64))> = Vec::new();
        let nblocks = self.blocks.len();
        count(|s| s.max_blocks = s.max_blocks.max(nblocks));
        for b in self.blocks.iter_mut() {
            let bytenr = read_header(b).unwrap().bytenr;
            let n = {
                let mut nd = NodeMut::new(b).unwrap();
                nd.finalize(self.csum).unwrap();
                nd.nritems()
            };
            let expect = Expect {
                owner: Some(OWNER),
                level: Some(self.level),
                generation: Some(GEN),
                first_key: None,
            };
            let r = check_tree_block(b, bytenr, self.nodesize as u32, self.csum, &FSID, &expect);
            if n == 0 {
                // Only a sole, empty node (an emptied tree level): the checker refuses it.
                assert_eq!(nblocks, 1, "an empty node stayed in the row");
                assert!(r.is_err());
                continue;
            }
            let h = r.unwrap_or_else(|e| panic!("tree checker: {e}"));
            let tb = TreeBlock {
                bytenr,
                header: h,
                data: b.clone().into_boxed_slice(),
            };
            for s in 0..tb.nritems() {
                let p = tb.ptr(s);
                ptrs.push((p.key, (p.blockptr, p.generation)));
            }
            let used = HEADER_SIZE + n * crate::format::KEY_PTR_SIZE;
            assert!(
                b[used..].iter().all(|&x| x == 0),
                "node free space not zeroed"
            );
        }
        let want: Vec<(Key, (u64, u64))> = self.model.iter().map(|(k, v)| (*k, *v)).collect();
        assert!(ptrs == want, "nodes differ from the model");
    }
}

fn run_node_ops(nodesize: usize, level: u8, csum: u8, ops: &[NodeOp]) {
    let mut row = NodeRow::new(nodesize, level, csum_of(csum));
    row.verify();
    for op in ops {
        row.apply(op);
        row.verify();
    }
}

// ---------------------------------------------------------------------------------------------
// Deterministic cases the random runs reach rarely
// ---------------------------------------------------------------------------------------------

/// Sequential appends fill each leaf completely before starting the next one.
#[test]
fn appends_fill_leaves() {
    let mut row = LeafRow::new(4096, CsumType::Crc32c);
    for i in 0..400u16 {
        row.apply(&LeafOp::Insert {
            key: (1, 0, i),
            len: (0, 75),
            fill: i as u8,
        });
    }
    row.verify();
    let n = row.blocks.len();
    for b in &mut row.blocks[..n - 1] {
        let l = LeafMut::new(b).unwrap();
        assert!(
            l.free_space() < 75 + ITEM_SIZE,
            "leaf left {} free",
            l.free_space()
        );
    }
}

/// An item as large as a leaf allows, inserted between two large items, lands alone.
#[test]
fn max_item_between_big_items_goes_alone() {
    for ns in [4096usize, 16384] {
        let mut row = LeafRow::new(ns, CsumType::Xxhash64);
        let max = max_item_size(ns);
        let third = (ns - HEADER_SIZE) / 3 - ITEM_SIZE;
        for (off, len) in [(0u64, third), (10, third), (20, third)] {
            let mut l = LeafMut::new(&mut row.blocks[0]).unwrap();
            let slot = l.nritems();
            l.insert_item(slot, Key::new(1, 1, off), len).unwrap();
            row.model.insert(Key::new(1, 1, off), vec![0; len]);
        }
        let l = LeafMut::new(&mut row.blocks[0]).unwrap();
        let g = Growth::Insert {
            items: 1,
            data_len: max,
        };
        assert_eq!(
            l.plan_split(1, g).unwrap(),
            LeafSplit::Two {
                first: 1,
                second: 1
            }
        );
        let (leaf, slot) = row.make_room(0, 1, g).unwrap();
        assert_eq!((leaf, slot), (1, 0));
        let mut l = LeafMut::new(&mut row.blocks[1]).unwrap();
        l.insert_item(0, Key::new(1, 1, 5), max).unwrap().fill(9);
        assert_eq!(l.free_space(), 0);
        row.model.insert(Key::new(1, 1, 5), vec![9; max]);
        row.verify();
        assert_eq!(row.blocks.len(), 3);
        // One byte more never fits, not even alone.
        let l = LeafMut::new(&mut row.blocks[0]).unwrap();
        let g = Growth::Insert {
            items: 1,
            data_len: max + 1,
        };
        assert!(matches!(l.plan_split(0, g), Err(Error::Internal(_))));
    }
}

// ---------------------------------------------------------------------------------------------
// Byte compatibility with mkfs.btrfs
// ---------------------------------------------------------------------------------------------

fn require_mkfs() -> bool {
    let ok = std::process::Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok && std::env::var_os("CI").is_some() {
        panic!("mkfs.btrfs is required in CI (install btrfs-progs)");
    }
    if !ok {
        eprintln!("skipping: mkfs.btrfs not installed");
    }
    ok
}

fn new_header_of(tb: &TreeBlock) -> NewHeader {
    NewHeader {
        bytenr: tb.bytenr,
        owner: tb.header.owner,
        generation: tb.header.generation,
        fsid: tb.header.fsid,
        chunk_tree_uuid: tb.header.chunk_tree_uuid,
        flags: tb.header.flags,
        backref_rev: tb.header.backref_rev,
    }
}

/// Rebuilds a block from its items or pointers alone; returns the bytes.
fn rebuild(tb: &TreeBlock, csum: CsumType) -> Vec<u8> {
    let mut b = vec![0xffu8; tb.data.len()];
    if tb.is_leaf() {
        let mut l = LeafMut::init(&mut b, &new_header_of(tb)).unwrap();
        // Half in one batch, the rest one by one at the end (both paths of the code).
        let n = tb.nritems();
        let batch: Vec<(Key, usize)> = (0..n / 2)
            .map(|s| (tb.key(s), tb.item_data(s).len()))
            .collect();
        l.insert_items(0, &batch).unwrap();
        for s in n / 2..n {
            l.insert_item(s, tb.key(s), tb.item_data(s).len())
                .unwrap()
                .copy_from_slice(tb.item_data(s));
        }
        for s in 0..n / 2 {
            l.item_data_mut(s).unwrap().copy_from_slice(tb.item_data(s));
        }
        l.finalize(csum).unwrap();
    } else {
        let mut nd = NodeMut::init(&mut b, tb.level(), &new_header_of(tb)).unwrap();
        // Back to front, so every insert shifts the pointers after it.
        for s in (0..tb.nritems()).rev() {
            let p = tb.ptr(s);
            nd.insert_ptr(0, p.key, p.blockptr, p.generation).unwrap();
        }
        nd.finalize(csum).unwrap();
    }
    b
}

#[test]
fn rebuilt_mkfs_blocks_are_identical() {
    use crate::ctree::{next_leaf, search_slot, Root};
    use crate::format::{FS_TREE_OBJECTID, ROOT_ITEM_KEY};
    use crate::io::disk_io::Readahead;
    use std::sync::Arc;
    if !require_mkfs() {
        return;
    }
    /// Removes the scratch directory (and its images) even when an assertion fails.
    struct Scratch(std::path::PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let t = std::env::temp_dir().join(format!("butter-ctree-ops-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&t);
    let scratch = Scratch(t.clone());
    let src = t.join("src");
    for i in 0..600 {
        let d = src.join(format!("dir{}", i % 9));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(format!("file-{i}")), pattern(i as u8, i % 3000)).unwrap();
    }
    let mut compared = (0usize, 0usize);
    for (name, ns, csum) in [("n4k", "4096", "crc32c"), ("n16k", "16384", "xxhash")] {
        let img = t.join(format!("{name}.img"));
        let f = std::fs::File::create(&img).unwrap();
        f.set_len(256 << 20).unwrap();
        drop(f);
        let out = std::process::Command::new("mkfs.btrfs")
            .args(["-q", "-f", "--nodesize", ns, "--csum", csum, "--rootdir"])
            .arg(&src)
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let fs = crate::fs::Fs::open(&img).unwrap();
        let csum = fs.disk().sb.csum_type;
        // Every tree in the root tree, plus the root tree itself.
        let mut roots = vec![fs.core().tree_root()];
        let mut it = crate::ctree::TreeIter::new(
            fs.disk().clone(),
            fs.core().tree_root(),
            Key::MIN,
            Readahead::None,
        )
        .unwrap();
        while let Some(item) = it.next_item().unwrap() {
            if item.key.ty == ROOT_ITEM_KEY {
                let ri = crate::format::items::RootItem::parse(item.data()).unwrap();
                roots.push(Root {
                    id: item.key.objectid,
                    bytenr: ri.bytenr,
                    level: ri.level,
                    generation: ri.generation,
                });
            }
        }
        assert!(roots.iter().any(|r| r.id == FS_TREE_OBJECTID));
        let mut seen = std::collections::HashSet::new();
        for root in roots {
            let (mut path, _) = search_slot(fs.disk(), &root, &Key::MIN, Readahead::None).unwrap();
            loop {
                for (b, _) in &path.nodes {
                    let b: &Arc<TreeBlock> = b;
                    if !seen.insert(b.bytenr) {
                        continue;
                    }
                    let mine = rebuild(b, csum);
                    let n = b.nritems();
                    let used = HEADER_SIZE
                        + n * if b.is_leaf() {
                            ITEM_SIZE
                        } else {
                            crate::format::KEY_PTR_SIZE
                        };
                    let free = if b.is_leaf() {
                        b.leaf_free_space()
                    } else {
                        b.data.len() - used
                    };
                    if b.data[used..used + free].iter().all(|&x| x == 0) {
                        assert!(
                            mine[..] == b.data[..],
                            "block {} of tree {} differs",
                            b.bytenr,
                            root.id
                        );
                        compared.0 += 1;
                    } else {
                        // mkfs left old bytes in the free space: compare all but that.
                        assert!(mine[32..used] == b.data[32..used], "block {}", b.bytenr);
                        assert!(mine[used + free..] == b.data[used + free..]);
                        compared.1 += 1;
                    }
                }
                if !next_leaf(fs.disk(), &mut path).unwrap() {
                    break;
                }
            }
        }
    }
    eprintln!(
        "rebuilt {} blocks byte for byte, {} apart from stale free space",
        compared.0, compared.1
    );
    assert!(compared.0 + compared.1 > 20);
    drop(scratch);
}

/// Extending the middle one of three big items moves it into a leaf of its own.
#[test]
fn extend_that_needs_its_own_leaf() {
    for ns in [4096usize, 16384] {
        let mut row = LeafRow::new(ns, CsumType::Sha256);
        let third = (ns - HEADER_SIZE) / 3 - ITEM_SIZE;
        for (i, off) in [0u64, 10, 20].into_iter().enumerate() {
            row.apply(&LeafOp::Insert {
                key: (1, 0, off as u16),
                len: (6, 0),
                fill: 0,
            });
            let key = Key::new(1, 1, off);
            let mut l = LeafMut::new(&mut row.blocks[0]).unwrap();
            l.extend_item(i, third).unwrap();
            l.item_data_mut(i).unwrap().fill(i as u8 + 1);
            row.model.insert(key, vec![i as u8 + 1; third]);
        }
        row.verify();
        let extra = third + 100;
        let l = LeafMut::new(&mut row.blocks[0]).unwrap();
        assert_eq!(
            l.plan_split(1, Growth::Extend { extra }).unwrap(),
            LeafSplit::Two {
                first: 1,
                second: 2
            }
        );
        row.apply(&LeafOp::Extend {
            pick: 1,
            len: (0, 0),
            fill: 0,
        });
        assert_eq!(row.blocks.len(), 1, "a zero extend needs no split");
        let (leaf, slot) = row.make_room(0, 1, Growth::Extend { extra }).unwrap();
        assert_eq!((leaf, slot, row.blocks.len()), (1, 0, 3));
        let mut l = LeafMut::new(&mut row.blocks[1]).unwrap();
        l.extend_item(0, extra).unwrap();
        assert_eq!(l.item_data(0).unwrap()[..third], vec![2u8; third][..]);
        row.model
            .get_mut(&Key::new(1, 1, 10))
            .unwrap()
            .extend(vec![0; extra]);
        row.verify();
    }
}
