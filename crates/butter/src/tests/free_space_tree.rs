//! The free space tree codec (`butter::space::free_space_tree`) against the kernel's own trees.
//!
//! A kernel-mounted image is fragmented one file deletion per transaction (the filesystem is
//! frozen after each step so the image file holds one committed state). After every step, for
//! every block group:
//! * `decode` of the group's free space tree items, read by butter, equals the free space the
//!   extent tree implies (the group minus its EXTENT_ITEMs and METADATA_ITEMs);
//! * `encode` of that free space, given the group's current format, reproduces the kernel's
//!   items byte for byte (keys and bodies, FREE_SPACE_INFO included);
//! * the kernel's format agrees with `thresholds`: extents only up to the high threshold,
//!   bitmaps only down to the low one, and each switch seen happens exactly one extent past
//!   the threshold.
//!
//! Needs root and loop devices (skipped with a notice without them, a failure when `CI` is set).

use super::oracle_support;

use butter::ctree::{Root, TreeIter};
use butter::format::items::BlockGroupItem;
use butter::format::*;
use butter::fs::Fs;
use butter::io::disk_io::Readahead;
use butter::space::free_space_tree::{self as fst, BgFreeSpace};
use oracle_support::*;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Group {
    start: u64,
    len: u64,
    flags: u64,
    bitmaps: bool,
    count: u64,
}

fn root_of(fs: &Fs, id: u64) -> Option<Root> {
    fs.find_root_item(id).unwrap().map(|ri| Root {
        id,
        bytenr: ri.bytenr,
        level: ri.level,
        generation: ri.generation,
    })
}

fn items_of(fs: &Fs, root: Root) -> Vec<(Key, Vec<u8>)> {
    let mut it = TreeIter::new(fs.disk().clone(), root, Key::MIN, Readahead::None).unwrap();
    let mut v = Vec::new();
    while let Some(item) = it.next_item().unwrap() {
        v.push((item.key, item.data().to_vec()));
    }
    v
}

/// Checks every block group of the image (see the file comment) and returns their states and
/// the free space tree items that lie in no block group (mkfs.btrfs leaves some behind for the
/// temporary groups it removes).
fn verify_image(img: &Path) -> (Vec<Group>, Vec<Key>) {
    let fs = Fs::open(img).unwrap();
    let ss = fs.disk().sectorsize();
    let nodesize = fs.disk().nodesize() as u64;
    assert!(
        fs.disk().sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE),
        "image has no free space tree"
    );
    let extent = items_of(&fs, root_of(&fs, EXTENT_TREE_OBJECTID).unwrap());
    let bg_items = match root_of(&fs, BLOCK_GROUP_TREE_OBJECTID) {
        Some(r) => items_of(&fs, r),
        None => extent.clone(),
    };
    let mut used: Vec<(u64, u64)> = Vec::new();
    for (k, _) in &extent {
        match k.ty {
            EXTENT_ITEM_KEY => used.push((k.objectid, k.offset)),
            METADATA_ITEM_KEY => used.push((k.objectid, nodesize)),
            _ => {}
        }
    }
    let mut groups = BTreeMap::new();
    for (k, d) in &bg_items {
        if k.ty == BLOCK_GROUP_ITEM_KEY {
            groups.insert(
                k.objectid,
                (k.offset, BlockGroupItem::parse(d).unwrap().flags),
            );
        }
    }
    let fst_items = items_of(&fs, root_of(&fs, FREE_SPACE_TREE_OBJECTID).unwrap());
    let mut per_group: BTreeMap<u64, Vec<(Key, Vec<u8>)>> = BTreeMap::new();
    let mut outside = Vec::new();
    for (k, d) in fst_items {
        match groups.range(..=k.objectid).next_back() {
            Some((&s, &(l, _))) if k.objectid < s + l => {
                per_group.entry(s).or_default().push((k, d))
            }
            _ => outside.push(k),
        }
    }
    let mut out = Vec::new();
    for (&start, &(len, flags)) in &groups {
        let items = per_group.remove(&start).unwrap_or_default();
        let refs: Vec<(Key, &[u8])> = items.iter().map(|(k, d)| (*k, d.as_slice())).collect();
        let (space, bitmaps) = fst::decode(&refs, start, len, ss)
            .unwrap_or_else(|e| panic!("block group {start}: decode failed: {e}"));
        let implied = BgFreeSpace::from_used(start, len, used.iter().copied());
        assert_eq!(
            space, implied,
            "block group {start}+{len}: the free space tree differs from the extent tree"
        );
        let (enc_bitmaps, enc) = fst::encode(&implied, ss, bitmaps);
        assert_eq!(
            enc_bitmaps, bitmaps,
            "block group {start}: encode picks another format"
        );
        assert_eq!(
            enc.len(),
            items.len(),
            "block group {start}: item count differs"
        );
        for (i, ((ek, ed), (kk, kd))) in enc.iter().zip(&items).enumerate() {
            assert_eq!(ek, kk, "block group {start}: key of item {i}");
            assert_eq!(ed, kd, "block group {start}: body of item {i} ({kk})");
        }
        out.push(Group {
            start,
            len,
            flags,
            bitmaps,
            count: space.extents.len() as u64,
        });
    }
    (out, outside)
}

/// Thresholds hold at rest; a switch between two states one extent apart happens exactly one
/// past the threshold. Returns (switches to bitmaps, switches to extents) seen exactly.
fn judge_step(prev: &[Group], cur: &[Group], ss: u32) -> (u32, u32) {
    let mut seen = (0, 0);
    for g in cur {
        let (high, low) = fst::thresholds(g.len, ss);
        if g.bitmaps {
            assert!(
                g.count >= low as u64,
                "group {} in bitmaps with {} extents, below the low threshold {low}",
                g.start,
                g.count
            );
        } else {
            assert!(
                g.count <= high as u64,
                "group {} in extents with {} extents, above the high threshold {high}",
                g.start,
                g.count
            );
        }
        let Some(p) = prev.iter().find(|p| p.start == g.start) else {
            continue;
        };
        if p.bitmaps != g.bitmaps && p.count.abs_diff(g.count) == 1 {
            if g.bitmaps {
                assert_eq!(
                    (p.count, g.count),
                    (high as u64, high as u64 + 1),
                    "group {}",
                    g.start
                );
                seen.0 += 1;
            } else {
                assert_eq!(
                    (p.count, g.count),
                    (low as u64, low as u64 - 1),
                    "group {}",
                    g.start
                );
                seen.1 += 1;
            }
        }
    }
    seen
}

/// A fresh mkfs image: every group round-trips; the stale items mkfs leaves (if any) are
/// whole groups of their own.
#[test]
fn mkfs_image_round_trips() {
    if !have_progs() {
        return;
    }
    let s = Scratch::new("fst-mkfs");
    for (i, args) in [
        &["--nodesize", "16384"][..],
        &["--nodesize", "4096", "-m", "single"][..],
        &["-s", "65536", "-n", "65536"][..],
    ]
    .iter()
    .enumerate()
    {
        let img = s.join(&format!("m{i}.img"));
        mkfs(&img, 1 << 30, args);
        let (groups, outside) = verify_image(&img);
        assert!(groups.len() >= 3, "{groups:?}");
        eprintln!(
            "mkfs {args:?}: {} groups, stale items {outside:?}",
            groups.len()
        );
    }
}

/// The kernel fragments the small first data group past its high threshold (to bitmaps), then,
/// after a balance moved the data to a larger group, that group past its high threshold and
/// back below its low one (to extents).
#[test]
fn kernel_fragmentation_matches_extent_tree() {
    if !have_root_and_loop() {
        return;
    }
    let s = Scratch::new("fst-kernel");
    let img = s.join("k.img");
    mkfs(&img, 1 << 30, &[]);
    let ss = 4096;
    let mut total = (0, 0);
    let mut max_count = 0;
    let mut last = Vec::new();
    {
        let m = LoopMount::new(&img, &s.join("mnt"), "");
        let root = m.mnt.clone();
        let step = |last: &mut Vec<Group>, total: &mut (u32, u32)| {
            let cur = {
                let _frozen = Frozen::new(&root);
                verify_image(&img).0
            };
            let seen = judge_step(last, &cur, ss);
            total.0 += seen.0;
            total.1 += seen.1;
            *last = cur;
        };
        step(&mut last, &mut total);
        // The first data group (8 MiB: high threshold 11, low 0): 40 files, every other one
        // deleted.
        std::fs::create_dir(root.join("a")).unwrap();
        for i in 0..40 {
            std::fs::write(root.join(format!("a/{i}")), vec![1u8; 4096]).unwrap();
        }
        step(&mut last, &mut total);
        for i in (0..40).step_by(2) {
            std::fs::remove_file(root.join(format!("a/{i}"))).unwrap();
            step(&mut last, &mut total);
        }
        // Relocate the data into a new, larger group (the 8 MiB one goes away with its
        // free space items), so the next files land in a group with a low threshold above 0.
        run(
            "btrfs",
            &[
                "balance",
                "start",
                "-d",
                "--full-balance",
                root.to_str().unwrap(),
            ],
        );
        step(&mut last, &mut total);
        // 500 files in the new group, every other one deleted (past its high threshold), then
        // the rest (back below its low threshold).
        std::fs::create_dir(root.join("b")).unwrap();
        for i in 0..500 {
            std::fs::write(root.join(format!("b/{i}")), vec![2u8; 4096]).unwrap();
        }
        step(&mut last, &mut total);
        for i in (0..500).step_by(2).chain((1..500).step_by(2)) {
            std::fs::remove_file(root.join(format!("b/{i}"))).unwrap();
            step(&mut last, &mut total);
            max_count = last
                .iter()
                .filter(|g| g.flags & BLOCK_GROUP_DATA != 0)
                .map(|g| g.count)
                .max()
                .unwrap_or(0)
                .max(max_count);
        }
        m.unmount();
    }
    let (groups, outside) = verify_image(&img);
    // The checker agrees: only the stale mkfs leftovers, as warnings.
    let fs = Fs::open(&img).unwrap();
    let report = fs.check(Default::default(), &mut |_| {}).unwrap();
    assert!(report.is_clean(), "{:#?}", report.findings);
    eprintln!(
        "groups {groups:?}\nstale items {outside:?}\nmost data extents {max_count}; exact switches to bitmaps {}, to extents {}",
        total.0, total.1
    );
    assert!(
        total.0 >= 2,
        "expected both data groups to switch to bitmaps, saw {}",
        total.0
    );
    assert!(total.1 >= 1, "expected a switch back to extents");
}
