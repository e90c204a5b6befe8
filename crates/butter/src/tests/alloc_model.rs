//! Seed 001's allocator (crate::space::alloc) under concurrency.
//!
//! - `allocator_against_a_model`: threads allocate (without the writer lock, as the file layer
//!   does), release, claim and free data space at random, with commits between, against a
//!   model of which bytes are taken. No byte is handed out twice; after every commit the free
//!   space tree on disk and the block group items equal the model; at the end, with
//!   everything given back, no byte is missing (no leak).
//! - `concurrent_files_survive_power_cuts`: threads append, fallocate, truncate and fsync
//!   files of their own through the filesystem (under the gate, as the mount does) while
//!   commits run (fallocates at a file's end and truncates back, in memory: delayed
//!   preallocation); images a power cut would leave, taken while they run, open (the fsync log
//!   replayed), pass butter's checker, and every block of every file holds its own file's
//!   data for that offset, or zeros (space handed out twice would show another's). The last
//!   image also passes `btrfs check` (required when `CI` is set).

use super::crash_support::{btrfs_check, butter_check, fresh_image, have_btrfs_progs, Rng};
use butter::ctree::{Root, TreeIter};
use butter::format::items::BlockGroupItem;
use butter::format::*;
use butter::fs::{Fs, Inode};
use butter::inode::namespace::Owner;
use butter::internals::RamDevice;
use butter::io::disk_io::Readahead;
use butter::mkfs::Profile;
use butter::space::alloc::{Allocator, ForFile, RangeSet, SpaceKind, Want};
use butter::space::free_space_tree as fst;
use std::sync::{Arc, Mutex};

const MIB: u64 = 1 << 20;

/// A fresh 256 MiB image on a RAM device, open read-write.
fn fresh_fs() -> (Arc<RamDevice>, Fs) {
    let dev = Arc::new(RamDevice::new(fresh_image(
        256 * MIB,
        Profile::Single,
        Profile::Single,
    )));
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    (dev, fs)
}

/// The data groups: (start, length).
fn data_groups(a: &Allocator) -> Vec<(u64, u64)> {
    a.starts()
        .into_iter()
        .filter_map(|s| {
            a.with_group(s, |g| {
                (SpaceKind::of_flags(g.flags) == Some(SpaceKind::Data)).then_some((g.start, g.len))
            })
            .flatten()
        })
        .collect()
}

/// Free space of one group as the committed free space tree has it, and its block group
/// item's used count.
fn on_disk(fs: &Fs, fst_root: Root, bg_tree: Root, start: u64, len: u64) -> (RangeSet, u64) {
    let disk = fs.disk().clone();
    let mut items = Vec::new();
    let mut it = TreeIter::new(
        disk.clone(),
        fst_root,
        Key::new(start, 0, 0),
        Readahead::None,
    )
    .expect("free space tree");
    while let Some(item) = it.next_item().expect("free space tree item") {
        if item.key.objectid >= start + len {
            break;
        }
        items.push((item.key, item.data().to_vec()));
    }
    let refs: Vec<(Key, &[u8])> = items.iter().map(|(k, v)| (*k, &v[..])).collect();
    let (space, _) = fst::decode(&refs, start, len, disk.sectorsize()).expect("decodes");
    let mut free = RangeSet::new();
    for (s, l) in space.extents {
        free.add(s, l).expect("disjoint");
    }
    let key = Key::new(start, BLOCK_GROUP_ITEM_KEY, len);
    let mut it = TreeIter::new(disk, bg_tree, key, Readahead::None).expect("block groups");
    let item = it.next_item().expect("item").expect("block group item");
    assert_eq!(item.key, key, "block group item of {start}");
    let used = BlockGroupItem::parse(item.data()).expect("parses").used;
    (free, used)
}

#[derive(Default)]
struct Model {
    /// Handed out and not given back (held, claimed, or freed but pinned).
    taken: RangeSet,
    /// Claimed (used on disk) and not freed.
    claimed: RangeSet,
    /// Freed in the running transaction.
    pinned: Vec<(u64, u64)>,
    commits: u32,
}

/// A commit (writer and model locked by the caller, so that allocations that get the space
/// it unpins are recorded after it is given back): what was freed leaves the model.
fn commit(w: &mut butter::transaction::Writer, m: &mut Model) {
    w.force_commit().unwrap();
    for (s, l) in std::mem::take(&mut m.pinned) {
        m.taken.remove(s, l);
    }
    m.commits += 1;
}

#[test]
fn allocator_against_a_model() {
    let (dev, fs) = fresh_fs();
    let fs = Arc::new(fs);
    let a = fs.core().allocator.clone().expect("read-write");
    let ss = fs.disk().sectorsize() as u64;
    // Enough data groups that the search moves between them.
    {
        let mut w = fs.core().writer().unwrap();
        while data_groups(&a).len() < 3 {
            w.alloc_chunk(SpaceKind::Data, MIB).unwrap();
        }
        w.force_commit().unwrap();
    }
    let groups = data_groups(&a);
    let bg_tree_id = fs.core().writer().unwrap().block_group_tree();
    // What is used before the test starts (nothing on a fresh image, but not assumed).
    let baseline: Vec<(RangeSet, u64)> = {
        let mut w = fs.core().writer().unwrap();
        let f = w.current_root(FREE_SPACE_TREE_OBJECTID).unwrap();
        let b = w.current_root(bg_tree_id).unwrap();
        groups
            .iter()
            .map(|&(s, l)| on_disk(&fs, f, b, s, l))
            .collect()
    };
    let model = Arc::new(Mutex::new(Model::default()));
    // After a commit (writer lock held): the trees on disk equal the model.
    let verify = |fs: &Fs, m: &Model, w: &mut butter::transaction::Writer| {
        let f = w.current_root(FREE_SPACE_TREE_OBJECTID).unwrap();
        let b = w.current_root(bg_tree_id).unwrap();
        for (i, &(s, l)) in groups.iter().enumerate() {
            let (free, used) = on_disk(fs, f, b, s, l);
            let mut want = baseline[i].0.clone();
            let mut claimed_here = 0;
            // (Ranges of the model may run across groups: groups can be adjacent.)
            for (cs, cl) in m.claimed.iter() {
                let (a, b) = (cs.max(s), (cs + cl).min(s + l));
                if a < b {
                    want.remove(a, b - a);
                    claimed_here += b - a;
                }
            }
            assert_eq!(
                free, want,
                "commit {}: free space tree of group {s} differs from the model",
                m.commits
            );
            assert_eq!(
                used,
                baseline[i].1 + claimed_here,
                "commit {}: used of group {s}",
                m.commits
            );
        }
    };
    let threads = 4;
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let (fs, a, model) = (fs.clone(), a.clone(), model.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x9e37_79b9 + t as u64 * 7919);
                let mut held: Vec<(u64, u64)> = Vec::new();
                let mut claimed: Vec<(u64, u64)> = Vec::new();
                let mut file_off = 0u64;
                for _ in 0..4000 {
                    match rng.below(100) {
                        0..=39 => {
                            let len = ss * (1 + rng.below(64));
                            let file = (rng.below(2) == 0).then(|| ForFile {
                                root: 5,
                                ino: 1000 + t as u64,
                                offset: file_off,
                            });
                            let want = Want {
                                kind: SpaceKind::Data,
                                len,
                                align: ss,
                                file,
                                held: true,
                            };
                            if let Some(at) = a.alloc_for(&want) {
                                assert_eq!(at % ss, 0);
                                let mut m = model.lock().unwrap();
                                if let Err(e) = m.taken.add(at, len) {
                                    panic!("thread {t}: {at}+{len} handed out twice: {e}");
                                }
                                held.push((at, len));
                                file_off += len;
                            }
                        }
                        40..=59 if !held.is_empty() => {
                            let (at, len) = held.swap_remove(rng.below(held.len() as u64) as usize);
                            // The model first: once released, another thread may get it.
                            model.lock().unwrap().taken.remove(at, len);
                            a.release_held(at, len);
                        }
                        60..=79 if !held.is_empty() => {
                            // Recorded in the trees: under the writer lock, as the engine does.
                            let (at, len) = held.swap_remove(rng.below(held.len() as u64) as usize);
                            let _w = fs.core().writer().unwrap();
                            a.claim_held(at, len);
                            a.account_used(at, len, true).unwrap();
                            model.lock().unwrap().claimed.add(at, len).unwrap();
                            claimed.push((at, len));
                        }
                        80..=95 if !claimed.is_empty() => {
                            let i = rng.below(claimed.len() as u64) as usize;
                            let (at, len) = claimed.swap_remove(i);
                            let _w = fs.core().writer().unwrap();
                            a.account_used(at, len, false).unwrap();
                            a.pin(at, len).unwrap();
                            let mut m = model.lock().unwrap();
                            m.claimed.remove(at, len);
                            m.pinned.push((at, len));
                        }
                        96..=99 => {
                            let mut w = fs.core().writer().unwrap();
                            let mut m = model.lock().unwrap();
                            commit(&mut w, &mut m);
                            // Checked by the main thread's verify too; here: the allocator's
                            // own view has nothing pinned right after a commit.
                            assert_eq!(a.pinned_bytes(SpaceKind::Data), 0);
                            drop(m);
                            drop(w);
                        }
                        _ => {}
                    }
                }
                (held, claimed)
            })
        })
        .collect();
    // Meanwhile: commits that check the trees against the model.
    let mut checked = 0;
    while !hs.iter().all(|h| h.is_finished()) {
        {
            let mut w = fs.core().writer().unwrap();
            let mut m = model.lock().unwrap();
            commit(&mut w, &mut m);
            verify(&fs, &m, &mut w);
            checked += 1;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let left: Vec<_> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(
        checked >= 2,
        "only {checked} commits checked against the model"
    );
    let stats = a.stats();
    assert!(stats.allocations > 1000, "{stats:?}");
    // Everything back: nothing may be missing (the files' windows included).
    a.release_windows();
    {
        let w = fs.core().writer().unwrap();
        for (held, claimed) in &left {
            for &(at, len) in held {
                a.release_held(at, len);
            }
            for &(at, len) in claimed {
                a.account_used(at, len, false).unwrap();
                a.pin(at, len).unwrap();
            }
        }
        drop(w);
        let mut w = fs.core().writer().unwrap();
        w.force_commit().unwrap();
        let mut m = model.lock().unwrap();
        m.claimed = RangeSet::new();
        m.commits += 1;
        verify(&fs, &m, &mut w);
    }
    let mut free_total = 0;
    for (i, &(s, l)) in groups.iter().enumerate() {
        let mine = a
            .with_group(s, |g| {
                assert!(
                    g.held.iter().next().is_none(),
                    "group {s}: held left behind"
                );
                assert!(
                    g.pinned.iter().next().is_none(),
                    "group {s}: pinned left behind"
                );
                g.free.union(&g.excluded)
            })
            .unwrap();
        assert_eq!(mine, baseline[i].0, "group {s}+{l}: space leaked");
        free_total += baseline[i].0.total();
    }
    assert!(free_total > 0);
    drop(a);
    let fs = Arc::try_unwrap(fs).ok().expect("threads done");
    fs.close().unwrap();
    drop(fs);
    let img = dev.live_bytes();
    let ro = Fs::open_device(Arc::new(RamDevice::new(img.clone()))).unwrap();
    butter_check(&ro).unwrap();
    check_with_progs(&img, "alloc-model");
}

/// `btrfs check` of an image; required in CI.
fn check_with_progs(img: &[u8], name: &str) {
    if !have_btrfs_progs() {
        assert!(
            std::env::var_os("CI").is_none(),
            "btrfs-progs missing: run scripts/install-deps"
        );
        eprintln!("btrfs-progs missing: skipping btrfs check");
        return;
    }
    btrfs_check(img, name).unwrap();
}

/// The bytes of block `blk` of thread `t`'s file, generation `gen`.
fn block(t: u64, blk: u64, gen: u64, ss: usize) -> Vec<u8> {
    let word = (t << 56) | (gen << 32) | blk;
    word.to_le_bytes().repeat(ss / 8)
}

/// Every block of every file holds that file's data for that offset, or zeros.
fn verify_files(fs: &Fs, files: &[(u64, Inode)], ss: usize) -> Result<(), String> {
    for &(t, ino) in files {
        let size = fs.inode_item(ino).map_err(|e| e.to_string())?.size;
        let data = fs.read(ino, 0, size as usize).map_err(|e| e.to_string())?;
        for (blk, c) in data.chunks(ss).enumerate() {
            if c.iter().all(|b| *b == 0) {
                continue;
            }
            let word = u64::from_le_bytes(c[..8].try_into().unwrap());
            let gen = (word >> 32) & 0xff_ffff;
            let want = block(t, blk as u64, gen, ss);
            if c != &want[..c.len()] || word >> 56 != t {
                return Err(format!(
                    "thread {t}'s file, block {blk}: holds {word:#x}, not its own data"
                ));
            }
        }
    }
    Ok(())
}

#[test]
fn concurrent_files_survive_power_cuts() {
    let (dev, fs) = fresh_fs();
    let fs = Arc::new(fs);
    let ss = fs.disk().sectorsize() as usize;
    let root = fs.root_inode();
    let threads = 4u64;
    let files: Vec<(u64, Inode)> = (0..threads)
        .map(|t| {
            let ino = fs
                .create(root, format!("f{t}").as_bytes(), 0o644, Owner::default())
                .unwrap();
            (t, ino)
        })
        .collect();
    fs.commit().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hs: Vec<_> = files
        .iter()
        .map(|&(t, ino)| {
            let (fs, stop) = (fs.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut rng = Rng(0x2545_f491 + t * 104_729);
                let mut gen = 1u64;
                let mut size = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    match rng.below(100) {
                        0..=54 => {
                            let n = 1 + rng.below(16);
                            let mut buf = Vec::new();
                            for k in 0..n {
                                buf.extend(block(t, size / ss as u64 + k, gen, ss));
                            }
                            let g = fs.write_gate(ino).unwrap();
                            fs.write(ino, size, &buf).unwrap();
                            drop(g);
                            size += buf.len() as u64;
                        }
                        55..=79 => {
                            // At the end: in memory (delayed preallocation), mostly.
                            let len = ss as u64 * (1 + rng.below(32));
                            fs.gated_fallocate(ino, 0, size, len).unwrap();
                            size += len;
                        }
                        80..=89 => fs.gated_fsync(ino).unwrap(),
                        _ if size > 4 * MIB || rng.below(10) == 0 => {
                            fs.gated_truncate(ino, 0).unwrap();
                            size = 0;
                            gen += 1;
                        }
                        _ => {}
                    }
                }
            })
        })
        .collect();
    let mut cuts = Vec::new();
    for i in 0..8 {
        std::thread::sleep(std::time::Duration::from_millis(60));
        if i % 2 == 0 {
            fs.gated_commit().unwrap();
        }
        cuts.push(dev.durable_bytes());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    let stats = fs.core().alloc_stats();
    let served = fs.core().ordered_stats().preallocs_in_memory;
    assert!(
        served > 10,
        "only {served} fallocates and truncates served in memory"
    );
    let fs = Arc::try_unwrap(fs).ok().expect("threads done");
    fs.close().unwrap();
    drop(fs);
    cuts.push(dev.live_bytes());
    assert!(stats.allocations > 100, "{stats:?}");
    let last = cuts.len() - 1;
    for (i, img) in cuts.into_iter().enumerate() {
        let d = Arc::new(RamDevice::new(img));
        // Read-write: the fsync log is replayed and committed.
        let fs = Fs::open_device_rw(d.clone()).unwrap_or_else(|e| panic!("cut {i}: open: {e}"));
        verify_files(&fs, &files, ss).unwrap_or_else(|e| panic!("cut {i}: {e}"));
        fs.close().unwrap();
        drop(fs);
        let img = d.live_bytes();
        let ro = Fs::open_device(Arc::new(RamDevice::new(img.clone()))).unwrap();
        butter_check(&ro).unwrap_or_else(|e| panic!("cut {i}: {e}"));
        if i == last || i == 3 {
            check_with_progs(&img, &format!("alloc-cut-{i}"));
        }
    }
}

/// Delayed preallocation: fallocates at a file's end served in memory end as the ordinary
/// path ends (size, nbytes, PREALLOC flag and extents, zeros read back), truncates back give
/// the space straight back, fsync makes them durable, and the image checks clean.
#[test]
fn delayed_preallocation_ends_as_fallocate_does() {
    use butter::format::items::FileExtentBody;
    let (dev, fs) = fresh_fs();
    let root = fs.root_inode();
    let mk = |name: &str| {
        let _g = fs.change_gate().unwrap();
        fs.create(root, name.as_bytes(), 0o644, Owner::default())
            .unwrap()
    };
    let (f, g) = (mk("in-memory"), mk("ordinary"));
    fs.gated_commit().unwrap();
    let before = fs.stat(f).unwrap();
    for i in 0..4u64 {
        fs.gated_fallocate(f, 0, i * 65536, 65536).unwrap();
    }
    assert_eq!(fs.core().ordered_stats().preallocs_in_memory, 4);
    assert!(fs.core().prealloc.has(Some(f)));
    // (Any change of the trees completes them first: this one does.)
    for i in 0..4u64 {
        let _g = fs.change_gate_on(g).unwrap();
        fs.fallocate(g, 0, i * 65536, 65536).unwrap();
    }
    // A reader of the file sees it all (its read gate completes them first).
    for i in 4..6u64 {
        fs.gated_fallocate(f, 0, i * 65536, 65536).unwrap();
        let _g = fs.change_gate_on(g).unwrap();
        fs.fallocate(g, 0, i * 65536, 65536).unwrap();
    }
    for i in 6..8u64 {
        fs.gated_fallocate(f, 0, i * 65536, 65536).unwrap();
    }
    for i in 6..8u64 {
        let _g = fs.change_gate_on(g).unwrap();
        fs.fallocate(g, 0, i * 65536, 65536).unwrap();
    }
    fs.gated_fallocate(f, 0, 8 * 65536, 65536).unwrap();
    assert!(fs.core().prealloc.has(Some(f)));
    let (sf, sg) = {
        let _r = fs.read_gate_on(f);
        (fs.stat(f).unwrap(), fs.stat(g).unwrap())
    };
    assert!(!fs.core().prealloc.has(Some(f)));
    {
        let _g = fs.change_gate_on(g).unwrap();
        fs.fallocate(g, 0, 8 * 65536, 65536).unwrap();
    }
    let sg = {
        let _r = fs.read_gate_on(g);
        let s = fs.stat(g).unwrap();
        assert!(s.size > sg.size);
        s
    };
    assert_eq!((sf.size, sf.blocks), (sg.size, sg.blocks));
    assert_eq!(sf.size, 9 * 65536);
    assert!(sf.flags & INODE_PREALLOC != 0);
    assert!(sf.ctime >= before.ctime);
    let ext = fs.core().file_extents(f, 0, u64::MAX).unwrap();
    // One extent per completion (5 here), one after the other on disk though the
    // ordinary file was fallocated in between.
    assert_eq!(ext.len(), 5, "{ext:?}");
    let on_disk: Vec<(u64, u64)> = ext
        .iter()
        .filter_map(|x| match x.item.body {
            FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                ..
            } => Some((disk_bytenr, disk_num_bytes)),
            _ => None,
        })
        .collect();
    assert!(
        on_disk.windows(2).all(|w| w[0].0 + w[0].1 == w[1].0),
        "the file's extents are not contiguous on disk: {on_disk:?}"
    );
    assert!(ext.iter().all(|x| x.item.ty == FILE_EXTENT_PREALLOC));
    let total: u64 = ext
        .iter()
        .map(|x| match x.item.body {
            FileExtentBody::Extent { num_bytes, .. } => num_bytes,
            _ => 0,
        })
        .sum();
    assert_eq!(total, 9 * 65536);
    assert_eq!(fs.read(f, 0, 9 * 65536).unwrap(), vec![0u8; 9 * 65536]);
    // Fallocate, then truncate back: the space is free again at once.
    let h = mk("dropped");
    let a = fs.core().allocator.clone().unwrap();
    // (Windows of other files go back first, so the count compares like with like.)
    a.release_windows();
    let free0 = a.free_bytes(SpaceKind::Data);
    for i in 0..3u64 {
        fs.gated_fallocate(h, 0, i * 8192, 8192).unwrap();
    }
    assert!(a.free_bytes(SpaceKind::Data) < free0);
    fs.gated_truncate(h, 0).unwrap();
    a.release_windows();
    assert_eq!(
        a.free_bytes(SpaceKind::Data),
        free0,
        "truncated preallocation not given back"
    );
    assert_eq!(fs.core().ordered_stats().preallocs_in_memory, 13);
    {
        let _r = fs.read_gate_on(h);
        assert_eq!(fs.stat(h).unwrap().size, 0);
        assert!(fs.core().file_extents(h, 0, u64::MAX).unwrap().is_empty());
    }
    // fsync makes it durable: a power cut right after shows it.
    let k = mk("fsynced");
    fs.gated_commit().unwrap();
    for i in 0..16u64 {
        fs.gated_fallocate(k, 0, i * 65536, 65536).unwrap();
    }
    fs.gated_fsync(k).unwrap();
    let cut = Fs::open_device_rw(Arc::new(RamDevice::new(dev.durable_bytes()))).unwrap();
    assert_eq!(cut.stat(k).unwrap().size, MIB, "fsynced preallocation lost");
    cut.close().unwrap();
    fs.close().unwrap();
    drop(fs);
    let img = dev.live_bytes();
    let ro = Fs::open_device(Arc::new(RamDevice::new(img.clone()))).unwrap();
    butter_check(&ro).unwrap();
    assert_eq!(ro.stat(f).unwrap().size, 9 * 65536);
    check_with_progs(&img, "delayed-prealloc");
}
