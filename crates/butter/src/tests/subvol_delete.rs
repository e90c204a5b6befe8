//! Subvolume delete and the tree drop (crate::inode::subvol_delete), white-box.
//!
//! - A subvolume of a few thousand files, a snapshot of it that then changes some files: the
//!   snapshot is deleted, then (on another copy) the source while the snapshot lives, with
//!   small drop batches so each drop spans many commits. Afterwards the other subvolume shows
//!   the same files, the ROOT_ITEM, ORPHAN item and uuid tree entry are gone, butter's checker
//!   is clean and the space is back.
//! - Refusals: a plain directory, a subvolume holding another, the default subvolume.
//! - Power cuts at every write of the delete and the drop's commits (RAM device): reopened
//!   read-write, the drop finishes, the checker is clean, the space is back; for a sample of
//!   the cuts the image also goes through `btrfs check`, and a kernel mount (which finishes
//!   the drop itself), then `btrfs check` again.

use super::crash_support::*;
use super::oracle_support::{self, LoopMount, Scratch};

use butter::error::Error;
use butter::format::*;
use butter::fs::{Fs, Inode};
use butter::internals::{Faults, RamDevice};
use butter::io::device::BlockDevice;
use butter::mkfs::Profile;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

const IMAGE_SIZE: u64 = 256 * MIB;

/// The drop batch is global: tests that change it run one at a time.
fn batch_lock() -> std::sync::MutexGuard<'static, ()> {
    static L: Mutex<()> = Mutex::new(());
    L.lock().unwrap_or_else(|e| e.into_inner())
}

fn look(fs: &Fs, dir: Inode, name: &str) -> Inode {
    fs.lookup(dir, name.as_bytes())
        .unwrap()
        .unwrap_or_else(|| panic!("{name} not found"))
        .target
}

/// `dirs` x `files` files in subvolume "sv" (small inline ones and data extents), committed;
/// then snapshot "snap", in which some files are rewritten, some removed and some added.
fn build(dirs: u64, files: u64) -> Arc<RamDevice> {
    let dev = Arc::new(RamDevice::new(fresh_image(
        IMAGE_SIZE,
        Profile::Dup,
        Profile::Single,
    )));
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let root = fs.root_inode();
    let sv = fs
        .create_subvolume(root, b"sv", 0o755, OWNER, None)
        .unwrap();
    for d in 0..dirs {
        let dir = fs
            .mkdir(sv, format!("d{d}").as_bytes(), 0o755, OWNER)
            .unwrap();
        for i in 0..files {
            let ino = fs
                .create(dir, format!("f{i}").as_bytes(), 0o644, OWNER)
                .unwrap();
            let len = if i % 4 == 0 {
                8192 + (i as usize * 331) % 20_000
            } else {
                100 + (i as usize * 37) % 1500
            };
            fs.write(ino, 0, &content(d * 100_000 + i, len)).unwrap();
            if i % 7 == 0 {
                fs.setxattr(ino, b"user.k", b"v", 0).unwrap();
            }
        }
    }
    fs.commit().unwrap();
    fs.create_snapshot(sv.root, root, b"snap", false, None)
        .unwrap();
    fs.commit().unwrap();
    let snap = look(&fs, root, "snap");
    for d in (0..dirs).step_by(3) {
        let dir = look(&fs, snap, &format!("d{d}"));
        for i in (0..files).step_by(11) {
            let f = look(&fs, dir, &format!("f{i}"));
            fs.write(f, 100, &content(7 + i, 5000)).unwrap();
        }
        fs.unlink(dir, b"f1").unwrap();
        let n = fs.create(dir, b"new", 0o644, OWNER).unwrap();
        fs.write(n, 0, &content(d, 30_000)).unwrap();
    }
    fs.commit().unwrap();
    drop(fs);
    dev
}

/// Butter's checker on a fresh read-only open of what `dev` holds now (an open read-write
/// filesystem keeps the superblock it was opened with).
fn check_now(dev: &Arc<dyn BlockDevice>) -> Result<(), String> {
    let mut img = vec![0u8; dev.len() as usize];
    dev.read_at(&mut img, 0).map_err(|e| e.to_string())?;
    let fs = Fs::open_device(Arc::new(RamDevice::new(img))).map_err(|e| e.to_string())?;
    butter_check(&fs)
}

/// Bytes in use (superblock bytes_used) of the image on `dev`.
fn used(dev: Arc<dyn BlockDevice>) -> u64 {
    Fs::open_device(dev).unwrap().disk().sb.bytes_used
}

/// The manifest without the paths under `/name`.
fn without(m: &Manifest, name: &str) -> Manifest {
    let p = format!("/{name}");
    m.iter()
        .filter(|(k, _)| **k != p && !k.starts_with(&format!("{p}/")))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// Whether the uuid tree holds `id` under `uuid`.
fn uuid_tree_has(fs: &Fs, uuid: &[u8; 16], id: u64) -> bool {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&uuid[..8]);
    b.copy_from_slice(&uuid[8..]);
    let key = Key::new(
        u64::from_le_bytes(a),
        UUID_KEY_SUBVOL,
        u64::from_le_bytes(b),
    );
    let Some(r) = fs.find_root_item(UUID_TREE_OBJECTID).unwrap() else {
        return false;
    };
    let root = butter::ctree::Root {
        id: UUID_TREE_OBJECTID,
        bytenr: r.bytenr,
        level: r.level,
        generation: r.generation,
    };
    match butter::ctree::lookup(fs.disk(), &root, &key).unwrap() {
        Some(it) => it.data().chunks(8).any(|c| c == id.to_le_bytes()),
        None => false,
    }
}

/// Whether the root tree still has an ORPHAN item for tree `id`.
fn orphan_item(fs: &Fs, id: u64) -> bool {
    butter::ctree::lookup(
        fs.disk(),
        &fs.core().tree_root(),
        &Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, id),
    )
    .unwrap()
    .is_some()
}

/// After the delete of `name` (tree `id`, uuid `uuid`): gone everywhere, the rest shows
/// `want`, the checker is clean.
fn assert_gone(
    fs: &Fs,
    dev: Arc<dyn BlockDevice>,
    id: u64,
    uuid: &[u8; 16],
    want: &Manifest,
    what: &str,
) {
    assert!(
        fs.find_root_item(id).unwrap().is_none(),
        "{what}: root item of {id} left"
    );
    assert!(!orphan_item(fs, id), "{what}: orphan item of {id} left");
    assert!(
        !uuid_tree_has(fs, uuid, id),
        "{what}: uuid tree entry of {id} left"
    );
    assert!(
        fs.list_subvolumes().unwrap().iter().all(|s| s.id != id),
        "{what}: {id} still listed"
    );
    let m = manifest(fs).unwrap();
    assert!(m == *want, "{what}: {}", diff(want, &m));
    check_now(&dev).unwrap_or_else(|e| panic!("{what}: {e}"));
}

#[test]
fn delete_snapshot_then_source() {
    let _b = batch_lock();
    let dev = build(12, 250);
    let before = used(dev.clone());
    // The size before the snapshot: the same files without the snapshot's.
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let all = manifest(&fs).unwrap();
    let snap = fs.list_subvolumes().unwrap();
    let (sv_id, sv_uuid) = snap
        .iter()
        .find(|s| s.path == b"sv")
        .map(|s| (s.id, s.item.uuid))
        .unwrap();
    let (snap_id, snap_uuid) = snap
        .iter()
        .find(|s| s.path == b"snap")
        .map(|s| (s.id, s.item.uuid))
        .unwrap();
    let level = fs.core().subvol_root(sv_id).unwrap().level;
    assert!(level >= 1, "the source tree should have several levels");
    drop(fs);

    // The snapshot.
    let copy = Arc::new(RamDevice::new(dev.live_bytes()));
    oracle_free_check(&copy, "snapshot");
    butter::inode::subvol_delete::set_drop_batch(8);
    let fs = Fs::open_device_rw(copy.clone()).unwrap();
    let commits = fs.core().writer().unwrap().stats().commits;
    let root = fs.root_inode();
    assert_eq!(fs.delete_subvolume(root, b"snap").unwrap(), snap_id);
    let commits = fs.core().writer().unwrap().stats().commits - commits;
    assert!(commits > 3, "the drop took {commits} commits");
    assert_gone(
        &fs,
        copy.clone(),
        snap_id,
        &snap_uuid,
        &without(&all, "snap"),
        "snapshot",
    );
    drop(fs);
    let after = used(copy.clone());
    assert!(after < before, "used {before} -> {after}");
    // Now the source, alone.
    let fs = Fs::open_device_rw(copy.clone()).unwrap();
    fs.delete_subvolume(root, b"sv").unwrap();
    assert_gone(
        &fs,
        copy.clone(),
        sv_id,
        &sv_uuid,
        &without(&without(&all, "snap"), "sv"),
        "source after snapshot",
    );
    drop(fs);
    let empty = used(copy.clone());
    assert!(
        empty < 2 * MIB,
        "an empty filesystem still uses {empty} bytes"
    );

    // The source while the snapshot lives (its blocks get full back references).
    let copy = Arc::new(RamDevice::new(dev.live_bytes()));
    let fs = Fs::open_device_rw(copy.clone()).unwrap();
    assert_eq!(fs.delete_subvolume(root, b"sv").unwrap(), sv_id);
    assert_gone(
        &fs,
        copy.clone(),
        sv_id,
        &sv_uuid,
        &without(&all, "sv"),
        "source",
    );
    // The snapshot still changes well (copy on write of blocks the source made).
    let snap = look(&fs, root, "snap");
    let d = look(&fs, snap, "d2");
    let f = look(&fs, d, "f4");
    fs.write(f, 0, b"changed").unwrap();
    fs.unlink(d, b"f8").unwrap();
    fs.commit().unwrap();
    check_now(&(copy.clone() as Arc<dyn BlockDevice>)).unwrap();
    // And then goes too.
    fs.delete_subvolume(root, b"snap").unwrap();
    check_now(&(copy.clone() as Arc<dyn BlockDevice>)).unwrap();
    drop(fs);
    let empty2 = used(copy.clone());
    assert!(
        empty2 < 2 * MIB,
        "an empty filesystem still uses {empty2} bytes"
    );
    butter::inode::subvol_delete::set_drop_batch(512);
}

/// `btrfs check` on the image (when the tools are there; the CLI suite runs the kernel).
fn oracle_free_check(dev: &RamDevice, what: &str) {
    if have_btrfs_progs() {
        btrfs_check(&dev.live_bytes(), &format!("subvol-delete-{what}"))
            .unwrap_or_else(|e| panic!("{what}: {e}"));
    }
}

#[test]
fn refusals() {
    let dev = build(1, 5);
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let root = fs.root_inode();
    let sv = look(&fs, root, "sv");
    // A plain directory.
    match fs.delete_subvolume(sv, b"d0") {
        Err(Error::Invalid(m)) => assert!(m.contains("not a subvolume"), "{m}"),
        r => panic!("delete of a directory: {r:?}"),
    }
    // A missing name.
    assert!(matches!(
        fs.delete_subvolume(root, b"nothing"),
        Err(Error::NotFound(_))
    ));
    // A subvolume holding another.
    fs.create_subvolume(sv, b"inner", 0o755, OWNER, None)
        .unwrap();
    match fs.delete_subvolume(root, b"sv") {
        Err(e @ Error::NotEmpty(_)) => {
            assert_eq!(e.errno(), libc::ENOTEMPTY);
            assert!(e.to_string().contains("holds subvolume"), "{e}");
        }
        r => panic!("delete of a subvolume holding another: {r:?}"),
    }
    // The default subvolume.
    let snap = look(&fs, root, "snap");
    fs.set_default_subvolume(snap.root).unwrap();
    match fs.delete_subvolume(root, b"snap") {
        Err(e @ Error::NotPermitted(_)) => assert!(e.to_string().contains("default"), "{e}"),
        r => panic!("delete of the default subvolume: {r:?}"),
    }
    fs.set_default_subvolume(FS_TREE_OBJECTID).unwrap();
    // Inner first, then the rest works.
    fs.delete_subvolume(sv, b"inner").unwrap();
    fs.delete_subvolume(root, b"sv").unwrap();
    fs.delete_subvolume(root, b"snap").unwrap();
    check_now(&(dev.clone() as Arc<dyn BlockDevice>)).unwrap();
    assert!(fs.list_subvolumes().unwrap().is_empty());
}

struct CrashSetup {
    /// Before the delete (committed).
    base: Arc<Vec<u8>>,
    /// What the filesystem shows once the source is deleted, and before.
    want: Manifest,
    full: Manifest,
    sv_id: u64,
    sv_uuid: [u8; 16],
    /// Device writes of the delete and its drop (and their flushes).
    ops: Vec<Op>,
    /// bytes_used when the clean run finished.
    used_after: u64,
}

const CRASH_BATCH: usize = 6;

fn crash_setup() -> &'static CrashSetup {
    static S: OnceLock<CrashSetup> = OnceLock::new();
    S.get_or_init(|| {
        let dev = build(4, 150);
        let base = dev.live_bytes();
        let fs = Fs::open_device(dev.clone()).unwrap();
        let full = manifest(&fs).unwrap();
        let want = without(&full, "sv");
        let sv = fs
            .list_subvolumes()
            .unwrap()
            .into_iter()
            .find(|s| s.path == b"sv")
            .unwrap();
        drop(fs);
        let ram = Arc::new(RamDevice::new(base.clone()));
        let tr = Arc::new(TraceDevice::new(ram.clone()));
        let fs = Fs::open_device_rw(tr.clone()).unwrap();
        let root = fs.root_inode();
        let _b = batch_lock();
        butter::inode::subvol_delete::set_drop_batch(CRASH_BATCH);
        fs.delete_subvolume(root, b"sv").unwrap();
        butter::inode::subvol_delete::set_drop_batch(512);
        drop(fs);
        let ops = tr.take();
        let used_after = used(Arc::new(RamDevice::new(ram.durable_bytes())));
        CrashSetup {
            base: Arc::new(base),
            want,
            full,
            sv_id: sv.id,
            sv_uuid: sv.item.uuid,
            ops,
            used_after,
        }
    })
}

/// Reopens a cut image read-write (the drop goes on) and checks the outcome.
fn verify_cut(s: &CrashSetup, pages: HashMap<u64, Vec<u8>>, what: &str) -> Result<(), String> {
    let dev = Arc::new(OverlayDevice::new(s.base.clone(), pages));
    let fs = Fs::open_device_rw(dev.clone()).map_err(|e| format!("{what}: open: {e}"))?;
    let m = manifest(&fs).map_err(|e| format!("{what}: {e}"))?;
    // Before the delete's commit the subvolume is still there; after it, gone.
    if m != s.want && m != s.full {
        return Err(format!(
            "{what}: shows neither state: {}",
            diff(&s.want, &m)
        ));
    }
    if m == s.want {
        if fs
            .find_root_item(s.sv_id)
            .map_err(|e| e.to_string())?
            .is_some()
        {
            return Err(format!("{what}: the drop did not finish"));
        }
        if orphan_item(&fs, s.sv_id) || uuid_tree_has(&fs, &s.sv_uuid, s.sv_id) {
            return Err(format!("{what}: orphan item or uuid entry left"));
        }
    }
    drop(fs);
    check_now(&(dev.clone() as Arc<dyn BlockDevice>)).map_err(|e| format!("{what}: {e}"))?;
    if m == s.want {
        let u = used(dev);
        let slack = 24 * 16384;
        if u > s.used_after + slack {
            return Err(format!(
                "{what}: {u} bytes used, the clean run ended with {}",
                s.used_after
            ));
        }
    }
    Ok(())
}

/// Every write of the delete and the drop's commits cut off: the image with only the flushed
/// writes, and the one with every write issued, reopened read-write.
#[test]
fn power_cut_at_every_write_of_the_drop() {
    let s = crash_setup();
    let writes = s
        .ops
        .iter()
        .filter(|o| matches!(o, Op::Write { .. }))
        .count();
    let flushes = s.ops.len() - writes;
    eprintln!("delete + drop: {writes} writes, {flushes} flushes");
    assert!(flushes >= 8, "the drop should span several commits");
    let mut live: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut durable_checked = false;
    let mut failures = Vec::new();
    let mut k = 0;
    for op in &s.ops {
        match op {
            Op::Flush => durable_checked = false,
            Op::Write { offset, data } => {
                if !durable_checked {
                    // The flushed state: what every cut until the next flush leaves at least.
                    if let Err(e) = verify_cut(s, live.clone(), &format!("durable k={k}")) {
                        failures.push(e);
                    }
                    durable_checked = true;
                }
                if k > 0 {
                    if let Err(e) = verify_cut(s, live.clone(), &format!("live k={k}")) {
                        failures.push(e);
                    }
                }
                apply_write(&s.base, &mut live, *offset, data);
                k += 1;
            }
        }
        if failures.len() > 5 {
            break;
        }
    }
    if let Err(e) = verify_cut(s, live, "complete") {
        failures.push(e);
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Real power cuts at a sample of writes: the cut image passes `btrfs check` as it is (a
/// half-dropped tree), butter finishes the drop on one copy, and the kernel mounts another,
/// finishes the drop itself (`btrfs subvolume sync`), and `btrfs check` passes afterwards.
#[test]
fn power_cut_sample_with_kernel() {
    assert!(
        oracle_support::have_root_and_loop(),
        "this test needs root, loop devices, kernel btrfs and btrfs-progs"
    );
    let s = crash_setup();
    let writes = s
        .ops
        .iter()
        .filter(|o| matches!(o, Op::Write { .. }))
        .count() as u64;
    let sc = Scratch::new("subvol-delete-cut");
    for k in [writes / 5, writes / 2, writes * 3 / 4, writes - 2] {
        let dev = Arc::new(RamDevice::new((*s.base).clone()));
        dev.set_faults(Faults {
            fail_write_at: Some(k),
            power_cut: true,
            ..Default::default()
        });
        {
            let _b = batch_lock();
            butter::inode::subvol_delete::set_drop_batch(CRASH_BATCH);
            let fs = Fs::open_device_rw(dev.clone()).unwrap();
            let r = fs.delete_subvolume(fs.root_inode(), b"sv");
            butter::inode::subvol_delete::set_drop_batch(512);
            assert!(r.is_err(), "k={k}: the delete went through a power cut");
        }
        let img = dev.durable_bytes();
        let path = sc.join(&format!("cut-{k}.img"));
        write_image(&img, &path);
        let (ok, out) = oracle_support::btrfs_check(&path);
        assert!(ok, "k={k}: btrfs check of the cut image:\n{out}");
        // Read-only, butter's checker accepts the half-dropped tree as it is.
        check_now(&(Arc::new(RamDevice::new(img.clone())) as Arc<dyn BlockDevice>))
            .unwrap_or_else(|e| panic!("k={k}: the cut image as it is: {e}"));
        // butter finishes it.
        verify_cut_image(s, &img, k);
        // The kernel finishes it.
        let mnt = sc.join(&format!("m{k}"));
        let dump_roots = |p: &std::path::Path| {
            oracle_support::run(
                "btrfs",
                &[
                    "inspect-internal",
                    "dump-tree",
                    "-t",
                    "root",
                    p.to_str().unwrap(),
                ],
            )
        };
        let deleted = dump_roots(&path).contains(&format!("ORPHAN_ITEM {})", s.sv_id));
        let m = LoopMount::new(&path, &mnt, "");
        oracle_support::run("btrfs", &["subvolume", "sync", mnt.to_str().unwrap()]);
        let list = oracle_support::run("btrfs", &["subvolume", "list", mnt.to_str().unwrap()]);
        assert_eq!(!list.contains(" path sv\n"), deleted, "k={k}: {list}");
        assert!(
            mnt.join("snap/d0/f0").exists(),
            "k={k}: the snapshot's files"
        );
        m.unmount();
        let (ok, out) = oracle_support::btrfs_check(&path);
        assert!(ok, "k={k}: btrfs check after the kernel's drop:\n{out}");
        let roots = dump_roots(&path);
        assert!(
            !roots.contains(&format!("ORPHAN_ITEM {})", s.sv_id)),
            "k={k}: the kernel left the orphan item"
        );
        let fs = Fs::open_device(Arc::new(
            butter::io::device::FileDevice::open(&path, false).unwrap(),
        ))
        .unwrap();
        butter_check(&fs).unwrap_or_else(|e| panic!("k={k}: after the kernel's drop: {e}"));
        let _ = std::fs::remove_file(&path);
    }
}

fn verify_cut_image(s: &CrashSetup, img: &[u8], k: u64) {
    let mut pages = HashMap::new();
    for (i, (a, b)) in img.chunks(4096).zip(s.base.chunks(4096)).enumerate() {
        if a != b {
            pages.insert(i as u64, a.to_vec());
        }
    }
    verify_cut(s, pages, &format!("real cut k={k}")).unwrap_or_else(|e| panic!("{e}"));
}

/// The drop level recorded in the ROOT_ITEM of tree `id` on an image (None when the item is
/// gone).
fn drop_state(img: Arc<dyn BlockDevice>, id: u64) -> Option<(u32, u8)> {
    let fs = Fs::open_device(img).ok()?;
    let ri = fs.find_root_item(id).ok()??;
    Some((ri.refs, ri.drop_level))
}

/// A three-level tree (4 KiB nodes) dropped in tiny batches: progress gets recorded at level 1
/// and at level 2, and every committed state in between reopens, finishes the drop and checks
/// clean.
#[test]
fn deep_tree_progress_at_every_level() {
    fixed_time();
    let size = 128 * MIB;
    let dev = Arc::new(RamDevice::new(vec![0u8; size as usize]));
    let opts = butter::mkfs::MkfsOptions {
        size,
        nodesize: 4096,
        metadata: Profile::Single,
        data: Profile::Single,
        fsid: Some(*b"butter-droptest!"),
        time: Some(1_700_000_000),
        ..Default::default()
    };
    butter::mkfs::mkfs(&*dev, &opts).unwrap();
    let fs = Fs::open_device_rw(dev.clone()).unwrap();
    let root = fs.root_inode();
    let mut ids = Vec::new();
    for name in ["a", "sv"] {
        let sv = fs
            .create_subvolume(root, name.as_bytes(), 0o755, OWNER, None)
            .unwrap();
        ids.push(sv.root);
        for d in 0..10u64 {
            let dir = fs
                .mkdir(sv, format!("d{d}").as_bytes(), 0o755, OWNER)
                .unwrap();
            for i in 0..150u64 {
                let f = fs
                    .create(dir, format!("f{i}").as_bytes(), 0o644, OWNER)
                    .unwrap();
                fs.write(f, 0, &content(d * 1000 + i, 100 + (i as usize % 5) * 700))
                    .unwrap();
            }
        }
    }
    fs.commit().unwrap();
    fs.create_snapshot(ids[1], root, b"snap", false, None)
        .unwrap();
    fs.commit().unwrap();
    let snap = look(&fs, root, "snap");
    for d in [1u64, 5, 9] {
        let dir = look(&fs, snap, &format!("d{d}"));
        let f = look(&fs, dir, "f3");
        fs.write(f, 0, b"changed").unwrap();
    }
    fs.commit().unwrap();
    for id in &ids {
        assert_eq!(fs.core().subvol_root(*id).unwrap().level, 2, "tree {id}");
    }
    let want = without(&without(&manifest(&fs).unwrap(), "a"), "sv");
    drop(fs);

    let base = Arc::new(dev.live_bytes());
    let ram = Arc::new(RamDevice::new((*base).clone()));
    let tr = Arc::new(TraceDevice::new(ram.clone()));
    {
        let _b = batch_lock();
        butter::inode::subvol_delete::set_drop_batch(3);
        let fs = Fs::open_device_rw(tr.clone()).unwrap();
        fs.delete_subvolume(root, b"a").unwrap();
        fs.delete_subvolume(root, b"sv").unwrap();
        butter::inode::subvol_delete::set_drop_batch(512);
    }
    let ops = tr.take();
    let mut live: HashMap<u64, Vec<u8>> = HashMap::new();
    let mut levels = std::collections::BTreeSet::new();
    let mut states = 0;
    let mut at_level2: Option<Vec<u8>> = None;
    for op in &ops {
        match op {
            Op::Write { offset, data } => apply_write(&base, &mut live, *offset, data),
            Op::Flush => {
                let img: Arc<dyn BlockDevice> =
                    Arc::new(OverlayDevice::new(base.clone(), live.clone()));
                for id in &ids {
                    if let Some((0, level)) = drop_state(img.clone(), *id) {
                        levels.insert(level);
                        if level == 2 && at_level2.is_none() {
                            at_level2 =
                                Some(OverlayDevice::new(base.clone(), live.clone()).bytes());
                        }
                    }
                }
                states += 1;
                if states % 4 != 0 {
                    continue;
                }
                // As it is (read-only): a half-dropped tree checks clean.
                check_now(&img).unwrap_or_else(|e| panic!("state {states} as it is: {e}"));
                let dev = Arc::new(OverlayDevice::new(base.clone(), live.clone()));
                let fs = Fs::open_device_rw(dev.clone()).unwrap();
                for id in &ids {
                    let left = fs.find_root_item(*id).unwrap();
                    assert!(
                        left.as_ref().is_none_or(|r| r.refs == 1),
                        "state {states}: {left:?}"
                    );
                }
                let m = manifest(&fs).unwrap();
                let any = m == want
                    || without(&m, "a") == want
                    || without(&without(&m, "a"), "sv") == want;
                assert!(any, "state {states}: {}", diff(&want, &m));
                drop(fs);
                check_now(&(dev as Arc<dyn BlockDevice>))
                    .unwrap_or_else(|e| panic!("state {states}: {e}"));
            }
        }
    }
    eprintln!("{states} committed states; drop levels recorded: {levels:?}");
    assert!(
        levels.contains(&1) && levels.contains(&2),
        "drop levels recorded: {levels:?}"
    );
    // The kernel continues a drop butter left at level 2.
    assert!(
        oracle_support::have_root_and_loop(),
        "this test needs root, loop devices, kernel btrfs and btrfs-progs"
    );
    let sc = Scratch::new("subvol-delete-level2");
    let path = sc.join("l2.img");
    write_image(&at_level2.unwrap_or_default(), &path);
    let (ok, out) = oracle_support::btrfs_check(&path);
    assert!(ok, "btrfs check of the level-2 drop state:\n{out}");
    let mnt = sc.join("m");
    let m = LoopMount::new(&path, &mnt, "");
    oracle_support::run("btrfs", &["subvolume", "sync", mnt.to_str().unwrap()]);
    assert!(mnt.join("snap/d1/f3").exists());
    m.unmount();
    let (ok, out) = oracle_support::btrfs_check(&path);
    assert!(ok, "btrfs check after the kernel finished the drop:\n{out}");
    let roots = oracle_support::run(
        "btrfs",
        &[
            "inspect-internal",
            "dump-tree",
            "-t",
            "root",
            path.to_str().unwrap(),
        ],
    );
    assert!(
        !roots.contains("ORPHAN_ITEM"),
        "orphan items left:\n{roots}"
    );
}
