//! Tests of the oracle harness itself (tests/common), against the real kernel btrfs.
//!
//! They need root, loop devices and kernel btrfs: without them they print a notice and pass,
//! except when `CI` is set, where they fail. Each test uses one loop device at a time.

mod common;

use common::gen::{self, populate, Rng, Scale};
use common::kernel::{
    self, assert_btrfs_check, dump_tree, mkfs_btrfs, require_privileges, LoopMount, ScratchDir,
    TmpfsMount,
};
use common::manifest::{assert_same, diff, take, CompareOpts, Kind, Manifest, TakeOpts};
use common::variant::{self, build_variant_image_with, kernel_manifest, VARIANTS};
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;

const SEED: u64 = 0x5eed_0001;

/// Sanity checks that the populated tree has what the generator promises.
fn check_populated(m: &Manifest, scale: Scale) {
    assert!(m.errors().is_empty(), "read errors: {:?}", m.errors());
    let big = m.get(gen::BIG_DIR).expect("big_dir");
    let n = big.names.as_ref().map_or(0, |n| n.len());
    let want = if scale == Scale::Full { 20000 } else { 3000 };
    assert_eq!(n, want, "entries in big_dir");

    let many = m.get(gen::MANY_LINKS_DIR).expect("links/many");
    let names = many.names.as_ref().expect("names");
    assert!(names.len() >= 320);
    assert!(names.iter().all(|n| n.len() >= 200));
    let target = m.get("links/target").expect("links/target");
    assert_eq!(target.nlink as usize, names.len() + 1);
    let group = target
        .link_group
        .clone()
        .expect("links/target is in a link group");
    let members = m
        .entries
        .values()
        .filter(|e| e.link_group.as_ref() == Some(&group))
        .count();
    assert_eq!(members, names.len() + 1);

    let subvols: Vec<_> = m.subvolumes().iter().map(|p| p.to_path_buf()).collect();
    assert_eq!(
        subvols,
        vec![Path::new(gen::SNAPSHOT), Path::new(gen::SUBVOL)],
        "subvolume roots"
    );
    assert!(m.get("subvol/to_delete").is_none());
    assert!(m.get("snap/to_delete").is_some());
    assert!(m.get("subvol/added_after_snapshot").is_some());
    assert_ne!(
        m.get("subvol/to_overwrite").unwrap().sha256,
        m.get("snap/to_overwrite").unwrap().sha256
    );
    assert_eq!(
        m.get("subvol/data_1m").unwrap().sha256,
        m.get("snap/data_1m").unwrap().sha256
    );

    for (kind, at_least) in [
        (Kind::Fifo, 1),
        (Kind::Socket, 1),
        (Kind::CharDev, 2),
        (Kind::BlockDev, 2),
        (Kind::Symlink, 10),
    ] {
        assert!(m.count(kind) >= at_least, "{kind:?}: {}", m.count(kind));
    }
    assert_eq!(
        m.get("special/chr_big").unwrap().rdev,
        Some((4095, 1_048_575))
    );
    let long = m.get("symlinks/long_1000").unwrap();
    assert_eq!(long.target.as_ref().map(|t| t.len()), Some(1000));
    let sym = m.get("xattrs/symlink_with_xattrs").unwrap();
    assert_eq!(sym.xattrs.len(), 2, "trusted.* xattrs on a symlink");
    let big_x = m.get("xattrs/big").unwrap();
    assert!(big_x.xattrs.iter().any(|(_, v)| v.len() >= 3000));
    assert!(m.get("xattrs/dir_with_xattrs").unwrap().xattrs.len() >= 2);

    let modes: Vec<u32> = m.entries.values().map(|e| e.mode).collect();
    for bit in [0o4000, 0o2000, 0o1000] {
        assert!(modes.iter().any(|m| m & bit != 0), "mode bit {bit:o}");
    }
    let owners: std::collections::BTreeSet<_> = m.entries.values().map(|e| e.uid).collect();
    assert!(owners.len() >= 4, "owners: {owners:?}");
    let t = m.get("times/pre_epoch").unwrap();
    assert_eq!((t.mtime.sec, t.mtime.nsec), (-315_619_200, 123_456_789));
    assert!(m
        .entries
        .values()
        .any(|e| e.kind == Kind::File && e.size > 1 << 20));
    let empty = m.get("empty_dir").unwrap();
    assert_eq!(empty.names.as_deref(), Some(&[][..]));
    assert_eq!(m.get("empty_file").unwrap().size, 0);
}

/// Facts about the image that only the on-disk trees show.
fn check_dump_tree(img: &Path) {
    let dump = dump_tree(img, &[]);
    assert!(dump.contains("INODE_EXTREF"), "no INODE_EXTREF items");
    for c in [
        "compression 1 (zlib)",
        "compression 2 (lzo)",
        "compression 3 (zstd)",
    ] {
        assert!(dump.contains(c), "no extent with {c}");
    }
    assert!(dump.contains("type 2 (prealloc)"), "no prealloc extents");
    assert!(dump.contains("inline extent"), "no inline extents");

    // Subvolume roots: objectid >= 256 in the root tree; the snapshot is read-only.
    let root = dump_tree(img, &["-t", "root"]);
    let mut roots: BTreeMap<u64, bool> = BTreeMap::new();
    let lines: Vec<&str> = root.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        let Some(rest) = l.split("key (").nth(1) else {
            continue;
        };
        let mut f = rest.split_whitespace();
        let (Some(id), Some("ROOT_ITEM")) = (f.next(), f.next()) else {
            continue;
        };
        let Ok(id) = id.parse::<u64>() else { continue };
        if id < 256 {
            continue;
        }
        let ro = lines[i..(i + 12).min(lines.len())]
            .iter()
            .any(|l| l.contains("(RDONLY)"));
        roots.insert(id, ro);
    }
    assert_eq!(
        roots.values().filter(|ro| !**ro).count(),
        1,
        "one writable subvolume: {roots:?}"
    );
    assert_eq!(
        roots.values().filter(|ro| **ro).count(),
        1,
        "one read-only snapshot: {roots:?}"
    );
}

/// Populates an image through a kernel mount, takes a manifest while it is mounted read-write,
/// then again after remounting read-only: they must be identical in every field, including
/// ctime and inode numbers. Also checks what the image contains and that `btrfs check` passes.
#[test]
fn populate_then_remount_ro_gives_identical_manifest() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("harness-remount");
    let img = scratch.join("defaults.img");
    let mnt = scratch.dir("mnt");
    let scale = Scale::from_env();
    mkfs_btrfs(
        &img,
        variant::IMAGE_SIZE,
        variant::variant("defaults").mkfs_args,
    );
    let m = LoopMount::btrfs(&img, &mnt, "noatime");
    populate(m.path(), SEED, scale);
    let rw = take(m.path(), &TakeOpts::default());
    let rw_again = take(m.path(), &TakeOpts::default());
    assert_same(
        &rw,
        &rw_again,
        &CompareOpts::all(),
        "taking a manifest changed the tree",
    );
    m.unmount();

    assert_btrfs_check(&img);
    check_dump_tree(&img);

    let ro = kernel_manifest(&img, &mnt, &TakeOpts::default());
    assert_same(
        &rw,
        &ro,
        &CompareOpts::all(),
        "read-write vs read-only mount",
    );
    check_populated(&ro, scale);
    eprintln!("defaults image: {}", ro.summary());
}

/// A `cp -a` copy of the kernel mount (into a tmpfs) matches the image with the restore
/// preset: only directory sizes and link counts, ctime, inode numbers and subvolume
/// boundaries differ, and those are not compared. Then changes made to the copy are reported,
/// each one, and nothing else. Uses the 4 KiB-node variant.
#[test]
fn copy_of_a_variant_image_differs_only_where_expected() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("harness-copy");
    let v = variant::variant("nodesize-4k");
    let img = build_variant_image_with(v, scratch.path(), SEED, Scale::from_env());
    assert_btrfs_check(&img);
    check_dump_tree(&img);

    let kmnt = scratch.dir("kmnt");
    let copy_mnt = scratch.dir("copy");
    let tmpfs = TmpfsMount::new(&copy_mnt, 2 << 30);
    let m = LoopMount::btrfs_ro(&img, &kmnt);
    let want = take(m.path(), &TakeOpts::default());
    let mut src = m.path().as_os_str().to_owned();
    src.push("/.");
    kernel::run(Command::new("cp").arg("-a").arg(&src).arg(tmpfs.path()));
    m.unmount();

    let got = take(tmpfs.path(), &TakeOpts::default());
    check_populated(&want, Scale::from_env());
    assert_same(&want, &got, &CompareOpts::restore(), "cp -a copy");

    // With everything compared, the differences are exactly the kinds restore() leaves out.
    let all = diff(
        &want,
        &got,
        &CompareOpts {
            max_report: usize::MAX,
            ..CompareOpts::all()
        },
    );
    for line in &all {
        let expected = [
            ": ctime: ",
            ": btime: ",
            ": ino: ",
            ": subvolume root: ",
            // directories only: restore() compared the files' sizes and link counts
            ": nlink: ",
            ": size: ",
            "<root>: ",
        ];
        assert!(
            expected.iter().any(|x| line.contains(x)),
            "unexpected difference: {line}"
        );
    }
    assert!(!all.is_empty());

    // Now change the copy in known ways; diff must name each change and nothing else.
    let c = tmpfs.path();
    fs::write(c.join("regular/r00-4095"), b"changed").unwrap();
    fs::set_permissions(
        c.join("inline/tiny000"),
        std::os::unix::fs::PermissionsExt::from_mode(0o4711),
    )
    .unwrap();
    fs::remove_file(c.join("subvol/small_link")).unwrap();
    fs::remove_dir_all(c.join("tree")).unwrap();
    kernel::run(
        Command::new("setfattr")
            .args(["-n", "user.new", "-v", "x"])
            .arg(c.join("empty_file")),
    );
    let changed = take(c, &TakeOpts::default());
    let d = diff(&want, &changed, &CompareOpts::restore_no_times());
    let joined = d.join("\n");
    let expect = [
        "\"regular/r00-4095\": size: A=4095 B=7",
        "\"regular/r00-4095\": content differs",
        "\"inline/tiny000\": mode: ",
        "\"subvol/small_link\": only in A (File)",
        "\"subvol/small\": nlink: A=2 B=1",
        "\"subvol/small\": hard-link group: A=\"subvol/small\" B=-",
        "\"tree\": only in A (Dir, with ",
        "\"empty_file\": xattr \"user.new\" only in B",
        "<root>: directory entries differ",
        "\"subvol\": directory entries differ",
    ];
    for e in expect {
        assert!(joined.contains(e), "diff lacks {e:?}:\n{joined}");
    }
    assert_eq!(
        d.len(),
        expect.len(),
        "unexpected extra differences:\n{joined}"
    );
    tmpfs.unmount();
}

/// The same seed gives the same tree (all but ctime/btime); another seed does not.
/// Runs at the small scale whatever BUTTER_ORACLE_SCALE says.
#[test]
fn same_seed_same_tree() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("harness-seed");
    let v = variant::variant("defaults");
    let mut manifests = Vec::new();
    for (i, seed) in [7u64, 7, 8].into_iter().enumerate() {
        let dir = scratch.dir(format!("run{i}"));
        let img = build_variant_image_with(v, &dir, seed, Scale::Small);
        manifests.push(kernel_manifest(
            &img,
            &dir.join("mnt"),
            &TakeOpts::default(),
        ));
        fs::remove_file(&img).unwrap();
    }
    let same = CompareOpts {
        ctime: false,
        btime: false,
        ..CompareOpts::all()
    };
    assert_same(&manifests[0], &manifests[1], &same, "same seed");
    let d = diff(&manifests[0], &manifests[2], &same);
    assert!(d.len() > 40, "another seed should differ widely: {d:?}");
}

/// A LoopMount is unmounted and its loop device detached when the test panics, and when
/// the mount itself fails.
#[test]
fn loop_mount_cleans_up_on_panic() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("harness-panic");
    let img = scratch.join("ext4.img");
    kernel::mkfs_ext4(&img, 32 << 20);
    let mnt = scratch.dir("mnt");
    let r = std::panic::catch_unwind(|| {
        let m = LoopMount::new(&img, &mnt, kernel::FsType::Ext4, "noatime");
        fs::write(m.path().join("f"), b"x").unwrap();
        // Keep the mount busy for a moment: Drop must retry until it can unmount.
        let f = fs::File::open(m.path().join("f")).unwrap();
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(f);
        });
        panic!("deliberate");
    });
    assert!(r.is_err());
    assert!(!kernel::is_mountpoint(&mnt), "still mounted");
    let attached = kernel::run(Command::new("losetup").arg("-j").arg(&img));
    assert!(attached.trim().is_empty(), "still attached: {attached}");

    // A mount that fails still detaches the loop device it attached.
    let junk = scratch.join("junk.img");
    fs::write(&junk, vec![0u8; 1 << 20]).unwrap();
    let r = std::panic::catch_unwind(|| LoopMount::btrfs(&junk, &mnt, ""));
    assert!(r.is_err(), "mounting zeroes as btrfs must fail");
    let attached = kernel::run(Command::new("losetup").arg("-j").arg(&junk));
    assert!(attached.trim().is_empty(), "still attached: {attached}");
}

/// diff() on plain directories: every kind of change is reported once, and the report is
/// capped. Needs no privileges.
#[test]
fn diff_reports_changes_readably() {
    let scratch = ScratchDir::new("harness-diff");
    let (a, b) = (scratch.join("a"), scratch.join("b"));
    for d in [&a, &b] {
        fs::create_dir_all(d.join("sub/deep")).unwrap();
        fs::write(d.join("same"), b"same").unwrap();
        fs::write(d.join("sub/deep/f"), b"f").unwrap();
        std::os::unix::fs::symlink("same", d.join("link")).unwrap();
    }
    fs::write(b.join("same"), b"diff").unwrap();
    std::os::unix::fs::symlink("other", b.join("link2")).unwrap();
    fs::remove_dir_all(b.join("sub")).unwrap();
    let opts = CompareOpts::restore_no_times();
    let ma = take(&a, &TakeOpts::default());
    let mb = take(&b, &TakeOpts::default());
    let d = diff(&ma, &mb, &opts);
    let joined = d.join("\n");
    assert!(joined.contains("\"same\": content differs"), "{joined}");
    assert!(
        joined.contains("\"link2\": only in B (Symlink)"),
        "{joined}"
    );
    assert!(
        joined.contains("\"sub\": only in A (Dir, with 2 entries below)"),
        "{joined}"
    );
    assert_eq!(d.len(), 4, "{joined}"); // + the root's entry list
    assert!(diff(&ma, &ma, &CompareOpts::all()).is_empty());

    let capped = diff(
        &ma,
        &mb,
        &CompareOpts {
            max_report: 1,
            ..opts
        },
    );
    assert_eq!(capped.len(), 2);
    assert!(
        capped[1].contains("3 more differences (4 in all)"),
        "{capped:?}"
    );

    // The generator's PRNG is deterministic.
    let (mut r1, mut r2) = (Rng::new(1), Rng::new(1));
    assert_eq!(r1.random_bytes(100), r2.random_bytes(100));
    assert_ne!(r1.fork(1).next_u64(), r1.fork(2).next_u64());
}

/// Builds, checks and reads the variants named in BUTTER_ORACLE_VARIANTS (comma-separated or
/// `all`; none by default, since the tests above already build `defaults` and `nodesize-4k`).
#[test]
fn variants_from_env_build_and_pass_check() {
    let vs = variant::variants_from_env("BUTTER_ORACLE_VARIANTS", "");
    if vs.is_empty() {
        eprintln!(
            "no BUTTER_ORACLE_VARIANTS given; known: {:?}",
            VARIANTS.iter().map(|v| v.name).collect::<Vec<_>>()
        );
        return;
    }
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("harness-variants");
    let scale = Scale::from_env();
    for v in vs {
        let t = std::time::Instant::now();
        let img = build_variant_image_with(v, scratch.path(), SEED, scale);
        assert_btrfs_check(&img);
        check_dump_tree(&img);
        let sup = kernel::dump_super(&img);
        let m = kernel_manifest(&img, &scratch.join("mnt"), &TakeOpts::default());
        check_populated(&m, scale);
        let field = |name: &str| {
            sup.lines()
                .find(|l| l.starts_with(name))
                .map(|l| l[name.len()..].trim().to_string())
                .unwrap_or_default()
        };
        match v.name {
            "nodesize-4k" => assert_eq!(field("nodesize"), "4096"),
            "nodesize-64k" => assert_eq!(field("nodesize"), "65536"),
            "csum-xxhash" => assert!(field("csum_type").contains("xxhash")),
            "csum-sha256" => assert!(field("csum_type").contains("sha256")),
            "csum-blake2" => assert!(field("csum_type").contains("blake2")),
            "holes" => {
                let flags =
                    u64::from_str_radix(field("incompat_flags").trim_start_matches("0x"), 16)
                        .unwrap();
                assert_eq!(flags & 0x200, 0, "NO_HOLES must be off");
            }
            "fat-metadata" => {
                let flags =
                    u64::from_str_radix(field("incompat_flags").trim_start_matches("0x"), 16)
                        .unwrap();
                assert_eq!(flags & 0x100, 0, "SKINNY_METADATA must be off");
            }
            "no-fst" => assert_eq!(field("compat_ro_flags"), "0x0"),
            _ => {}
        }
        eprintln!("{}: {} in {:?}", v.name, m.summary(), t.elapsed());
        fs::remove_file(&img).unwrap();
    }
}
