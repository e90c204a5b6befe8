//! Read-only subvolumes and inode flags against the kernel's btrfs.
//!
//! - Read-only snapshots made by the kernel (`btrfs subvolume snapshot -r`), by `butter
//!   subvolume snapshot -r` and by `butter mkfs --rootdir --subvol ro:DIR` refuse every kind
//!   of change through `butter mount` (EROFS) and through the library
//!   (`Error::ReadOnlySubvol`); `butter property get/set ro` reads and flips the flag as
//!   `btrfs property` does (a received subvolume needs `-f`, which clears its received
//!   uuid as the kernel's SET_RECEIVED_SUBVOL does), and writes work after `ro false`.
//!   Every one of them made by butter on an image butter made stays read-only under a
//!   read-write kernel mount, and `btrfs send` takes it.
//! - NODATACOW/NODATASUM (`chattr +C`): writes add no checksums; an extent the file alone
//!   owns is overwritten in place (same disk bytenr), one shared with a snapshot is copied
//!   on write (the snapshot keeps its data); new files inherit the flags from a +C
//!   directory; lsattr/chattr work through the mount and the kernel shows the same flags.
//! - The default subvolume: `butter subvolume set-default` changes what the kernel and `butter
//!   mount` show without subvol=, and `btrfs subvolume get-default` agrees with `butter
//!   subvolume get-default`; `butter subvolume show` and `list -u -q -R` agree with
//!   `btrfs subvolume show` on kernel-made subvolumes.
//!
//! Each test that changes an image ends with `butter check`, `btrfs check --readonly` and a
//! kernel mount that shows the change. Needs root, FUSE, loop devices, btrfs-progs and
//! chattr/lsattr; without them the tests print a notice and pass, unless CI is set.

mod common;

use butter::fs::Fs;
use common::fuse_mount::{self, ButterMount, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs::{self, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

const SIZE: u64 = 512 << 20;

fn sh(prog: &str, args: &[&str]) -> String {
    kernel::sh(prog, args)
}

/// `butter ARGS...`: (success, stdout, stderr).
fn butter(args: &[&str]) -> (bool, String, String) {
    let out = kernel::run_output(Command::new(BUTTER).args(args));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Every kind of change inside `dir` (a read-only subvolume's root, holding file `f`,
/// directory `d` and symlink `l`) must fail with `errno`.
fn assert_all_refused(dir: &Path, other: &Path, errno: i32, what: &str) {
    let f = dir.join("f");
    let code = |r: std::io::Result<()>, op: &str| {
        let e = r.expect_err(&format!("{what}: {op} succeeded in a read-only subvolume"));
        assert_eq!(e.raw_os_error(), Some(errno), "{what}: {op}: {e}");
    };
    code(
        OpenOptions::new().write(true).open(&f).map(drop),
        "open for write",
    );
    code(
        OpenOptions::new().append(true).open(&f).map(drop),
        "open O_APPEND",
    );
    code(fs::write(dir.join("new"), b"x"), "create");
    code(fs::create_dir(dir.join("nd")), "mkdir");
    code(fs::remove_file(&f), "unlink");
    code(fs::remove_dir(dir.join("d")), "rmdir");
    code(std::os::unix::fs::symlink("x", dir.join("sl")), "symlink");
    code(fs::hard_link(&f, dir.join("hl")), "link");
    code(
        fs::set_permissions(&f, fs::Permissions::from_mode(0o600)),
        "chmod",
    );
    code(std::os::unix::fs::chown(&f, Some(1), Some(1)), "chown");
    code(fs::rename(&f, dir.join("g")), "rename inside");
    code(fs::rename(&f, other.join("g")), "rename out");
    let o = other.join("mover");
    fs::write(&o, b"m").unwrap();
    code(fs::rename(&o, dir.join("in")), "rename in");
    fs::remove_file(&o).unwrap();
    for (op, args) in [
        ("mknod", vec!["mknod", s(&dir.join("p")), "p"]),
        ("utimes", vec!["touch", "-d", "2001-01-01", s(&f)]),
        ("truncate", vec!["truncate", "-s", "0", s(&f)]),
        (
            "setxattr",
            vec!["setfattr", "-n", "user.a", "-v", "1", s(&f)],
        ),
        ("removexattr", vec!["setfattr", "-x", "user.k", s(&f)]),
        ("fallocate", vec!["fallocate", "-l", "1M", s(&f)]),
        ("chattr", vec!["chattr", "+A", s(&f)]),
    ] {
        let out = kernel::run_output(Command::new(args[0]).args(&args[1..]));
        assert!(!out.status.success(), "{what}: {op} succeeded");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("Read-only file system"), "{what}: {op}: {err}");
    }
    // Reading still works.
    assert_eq!(fs::read(&f).unwrap(), b"data\n", "{what}: read");
}

/// The library refuses with a typed error.
fn assert_library_refuses(img: &Path, path: &str) {
    let fs = Fs::open_rw(img).unwrap();
    let dir = fs.resolve_in(fs.root_inode(), path.as_bytes()).unwrap();
    let f = fs.lookup(dir, b"f").unwrap().unwrap().target;
    let errs = [
        fs.write(f, 0, b"x").map(drop),
        fs.truncate(f, 0),
        fs.create(dir, b"n", 0o644, Default::default()).map(drop),
        fs.unlink(dir, b"f"),
        fs.setxattr(f, b"user.x", b"1", 0),
        fs.fallocate(f, 0, 0, 4096),
        fs.set_fsflags(f, butter::inode::flags::FS_NOATIME_FL),
    ];
    for e in errs {
        match e {
            Err(e @ butter::Error::ReadOnlySubvol(_)) => assert_eq!(e.errno(), 30),
            other => panic!("library change in read-only {path}: {other:?}"),
        }
    }
}

#[test]
fn read_only_subvolumes_refuse_changes() {
    if !fuse_mount::require(
        "read_only_subvolumes_refuse_changes",
        &["chattr", "setfattr"],
    ) {
        return;
    }
    let sc = ScratchDir::new("subvol-ro");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, SIZE);
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        let p = m.path();
        sh("btrfs", &["subvolume", "create", s(&p.join("sv"))]);
        fs::write(p.join("sv/f"), b"data\n").unwrap();
        fs::create_dir(p.join("sv/d")).unwrap();
        std::os::unix::fs::symlink("f", p.join("sv/l")).unwrap();
        sh("setfattr", &["-n", "user.k", "-v", "v", s(&p.join("sv/f"))]);
        sh(
            "btrfs",
            &[
                "subvolume",
                "snapshot",
                "-r",
                s(&p.join("sv")),
                s(&p.join("ksnap")),
            ],
        );
        // A received subvolume (received_uuid set).
        fs::create_dir(p.join("recv")).unwrap();
        let stream = sc.join("send.stream");
        sh(
            "btrfs",
            &["send", "-q", "-f", s(&stream), s(&p.join("ksnap"))],
        );
        sh(
            "btrfs",
            &["receive", "-q", "-f", s(&stream), s(&p.join("recv"))],
        );
        m.unmount();
    }
    let (ok, _, err) = butter(&["subvolume", "snapshot", "-r", s(&img), "sv", "bsnap"]);
    assert!(ok, "butter snapshot -r: {err}");
    // property get: ro of each; a path that is not a subvolume root is refused.
    for (p, want) in [
        ("sv", "false"),
        ("ksnap", "true"),
        ("bsnap", "true"),
        ("recv/ksnap", "true"),
    ] {
        let (ok, out, err) = butter(&["property", "get", s(&img), p, "ro"]);
        assert!(ok, "property get {p}: {err}");
        assert_eq!(out, format!("ro={want}\n"), "property get {p}");
    }
    let (ok, _, err) = butter(&["property", "get", s(&img), "sv/f", "ro"]);
    assert!(!ok && err.contains("not compatible"), "ro of a file: {err}");

    // mkfs --rootdir with a read-only subvolume.
    let src = sc.dir("src");
    fs::create_dir(src.join("rosub")).unwrap();
    fs::write(src.join("rosub/f"), b"data\n").unwrap();
    fs::create_dir(src.join("rosub/d")).unwrap();
    std::os::unix::fs::symlink("f", src.join("rosub/l")).unwrap();
    sh(
        "setfattr",
        &["-n", "user.k", "-v", "v", s(&src.join("rosub/f"))],
    );
    let img2 = sc.join("b.img");
    let (ok, _, err) = butter(&[
        "mkfs",
        "-b",
        "256M",
        "--rootdir",
        s(&src),
        "--subvol",
        "ro:rosub",
        s(&img2),
    ]);
    assert!(ok, "butter mkfs: {err}");

    for (image, dirs) in [
        (&img, &["ksnap", "bsnap", "recv/ksnap"][..]),
        (&img2, &["rosub"][..]),
    ] {
        let m = ButterMount::start(image, &sc.dir("m"), &[], &sc.join("m.log"));
        for d in dirs {
            let dir = m.path().join(d);
            assert_all_refused(&dir, m.path(), libc::EROFS, d);
        }
        m.unmount();
        for d in dirs {
            assert_library_refuses(image, d);
        }
    }

    // ro -> rw: a received subvolume needs -f.
    let (ok, _, err) = butter(&["property", "set", s(&img), "recv/ksnap", "ro", "false"]);
    assert!(!ok && err.contains("received_uuid"), "{err}");
    let (ok, _, err) = butter(&["property", "set", s(&img), "recv/ksnap", "ro", "maybe"]);
    assert!(!ok && err.contains("invalid value"), "{err}");
    for (p, force) in [("ksnap", false), ("bsnap", false), ("recv/ksnap", true)] {
        let mut args = vec!["property", "set"];
        if force {
            args.push("-f");
        }
        args.extend([s(&img), p, "ro", "false"]);
        let (ok, _, err) = butter(&args);
        assert!(ok, "property set {p} ro false: {err}");
    }
    let (ok, _, err) = butter(&["property", "set", s(&img2), "rosub", "ro", "false"]);
    assert!(ok, "{err}");
    // The received uuid and its uuid tree entry are gone; rtransid was set.
    let roots = kernel::dump_tree(&img, &["-t", "root"]);
    assert!(
        !roots.contains("received_uuid")
            || roots
                .matches("received_uuid 00000000-0000-0000-0000-000000000000")
                .count()
                == roots.matches("received_uuid").count(),
        "a received uuid is left:\n{roots}"
    );
    let uuids = kernel::dump_tree(&img, &["-t", "uuid"]);
    assert!(
        !uuids.contains("UUID_KEY_RECEIVED_SUBVOL"),
        "received subvol uuid entry left:\n{uuids}"
    );
    // Writable again: every change works.
    let m = ButterMount::start(&img, &sc.dir("m"), &[], &sc.join("m2.log"));
    for d in ["ksnap", "bsnap", "recv/ksnap"] {
        let dir = m.path().join(d);
        fs::write(dir.join("f"), b"changed\n").unwrap();
        fs::create_dir(dir.join("nd")).unwrap();
        fs::rename(dir.join("l"), dir.join("l2")).unwrap();
        sh(
            "setfattr",
            &["-n", "user.new", "-v", "1", s(&dir.join("f"))],
        );
    }
    let want = common::manifest::take(m.path(), &Default::default());
    m.unmount();
    fuse_mount::verify_image(&img, &sc.dir("kv"), Some(&want), "after ro false");
    let m = ButterMount::start(&img2, &sc.dir("m"), &[], &sc.join("m3.log"));
    fs::write(m.path().join("rosub/f"), b"changed\n").unwrap();
    let want = common::manifest::take(m.path(), &Default::default());
    m.unmount();
    fuse_mount::verify_image(
        &img2,
        &sc.dir("kv"),
        Some(&want),
        "mkfs ro:rosub after ro false",
    );
    let (ok, out, _) = butter(&["property", "get", s(&img), "recv/ksnap"]);
    assert!(ok && out == "ro=false\n", "{out}");
}

/// Read-only subvolumes made by every butter path on an image butter made stay read-only
/// under the kernel: a read-write kernel mount refuses writes into them, `btrfs property`
/// says ro=true and `btrfs send` takes them, and afterwards the flag is still on disk.
#[test]
fn read_only_snapshots_stay_read_only_under_the_kernel() {
    if !fuse_mount::require("read_only_snapshots_stay_read_only_under_the_kernel", &[]) {
        return;
    }
    let sc = ScratchDir::new("subvol-ro-kernel");
    let src = sc.dir("src");
    fs::create_dir(src.join("rosub")).unwrap();
    fs::write(src.join("rosub/f"), b"data\n").unwrap();
    fs::write(src.join("top"), b"top\n").unwrap();
    let img = sc.join("t.img");
    let ok = |args: &[&str]| {
        let (ok, out, err) = butter(args);
        assert!(ok, "butter {args:?}: {err}");
        out
    };
    ok(&[
        "mkfs",
        "-b",
        "300M",
        "--rootdir",
        s(&src),
        "--subvol",
        "ro:rosub",
        s(&img),
    ]);
    // A snapshot of the top level (the item mkfs wrote), of a new subvolume, a writable
    // snapshot made read-only afterwards, and a received one.
    ok(&["subvolume", "snapshot", "-r", s(&img), "/", "s"]);
    ok(&["subvolume", "create", s(&img), "sv"]);
    ok(&["subvolume", "snapshot", "-r", s(&img), "sv", "svsnap"]);
    ok(&["subvolume", "snapshot", s(&img), "/", "w"]);
    ok(&["property", "set", s(&img), "w", "ro", "true"]);
    let stream = sc.join("s.stream");
    ok(&["send", "-q", "-f", s(&stream), s(&img), "/s"]);
    ok(&["subvolume", "create", s(&img), "in"]);
    ok(&["receive", "-q", "-f", s(&stream), s(&img), "in"]);
    let ro = ["rosub", "s", "svsnap", "w", "in/s"];
    let (ok_check, out, err) = butter(&["check", s(&img)]);
    assert!(ok_check && !out.contains("ROOT_ITEM_INIT"), "{out}{err}");

    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    for d in ro {
        let p = m.path().join(d);
        assert_eq!(
            sh("btrfs", &["property", "get", s(&p), "ro"]).trim(),
            "ro=true",
            "{d} under the kernel"
        );
        let e = fs::write(p.join("new"), b"x").expect_err(&format!("{d}: a write got in"));
        assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{d}: {e}");
        let out = kernel::run_output(Command::new("btrfs").args([
            "send",
            "-q",
            "-f",
            "/dev/null",
            s(&p),
        ]));
        assert!(
            out.status.success(),
            "btrfs send {d}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Writes elsewhere make the kernel commit the root items it holds.
    fs::write(m.path().join("after"), b"x").unwrap();
    m.unmount();
    for d in ro {
        let (ok, out, err) = butter(&["property", "get", s(&img), d, "ro"]);
        assert!(
            ok && out == "ro=true\n",
            "{d} after the kernel's mount: {out}{err}"
        );
    }
    both_checks_clean(&img, "read-only subvolumes after a kernel mount");
}

/// (disk bytenr, extent offset) of each EXTENT_DATA item of inode `ino` in `tree`.
fn extents(img: &Path, tree: &str, ino: u64) -> Vec<(u64, u64, u64)> {
    let dump = kernel::dump_tree(img, &["-t", tree]);
    let mut out = Vec::new();
    let mut lines = dump.lines();
    let key = format!("key ({ino} EXTENT_DATA ");
    while let Some(l) = lines.next() {
        if let Some(p) = l.find(&key) {
            let off: u64 = l[p + key.len()..]
                .split(')')
                .next()
                .unwrap()
                .parse()
                .unwrap();
            let _gen = lines.next();
            let disk = lines.next().unwrap_or("");
            let bytenr = disk
                .split("disk byte ")
                .nth(1)
                .and_then(|x| x.split_whitespace().next())
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            out.push((off, bytenr, 0));
        }
    }
    out
}

fn lsattr(path: &Path) -> String {
    sh("lsattr", &["-d", s(path)])
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}

#[test]
fn nodatacow_files_write_in_place() {
    if !fuse_mount::require("nodatacow_files_write_in_place", &["chattr", "lsattr"]) {
        return;
    }
    let sc = ScratchDir::new("nodatacow");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, SIZE);
    let data: Vec<u8> = (0..256 * 1024u32)
        .map(|i| (i * 7 + i / 4096) as u8)
        .collect();
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        let p = m.path();
        for f in ["nc", "lib"] {
            fs::write(p.join(f), b"").unwrap();
            sh("chattr", &["+C", s(&p.join(f))]);
            fs::write(p.join(f), &data).unwrap();
        }
        fs::create_dir(p.join("cdir")).unwrap();
        sh("chattr", &["+C", s(&p.join("cdir"))]);
        fs::write(p.join("plain"), &data).unwrap();
        m.unmount();
    }
    let ino_of = |name: &str| -> u64 {
        let fs = Fs::open(&img).unwrap();
        fs.lookup(fs.root_inode(), name.as_bytes())
            .unwrap()
            .unwrap()
            .target
            .ino
    };
    let (nc, lib) = (ino_of("nc"), ino_of("lib"));
    let before = extents(&img, "5", nc);
    let before_lib = extents(&img, "5", lib);
    assert_eq!(before.len(), 1, "{before:?}");

    // (a) through the mount: in place; (d) lsattr/chattr.
    let m = ButterMount::start(&img, &sc.dir("m"), &[], &sc.join("m.log"));
    let p = m.path().to_path_buf();
    let f = OpenOptions::new().write(true).open(p.join("nc")).unwrap();
    f.write_all_at(&[0xaa; 8192], 12288).unwrap();
    drop(f);
    assert_eq!(lsattr(&p.join("nc")), "---------------C------");
    // (c) inheritance.
    fs::write(p.join("cdir/new"), &data[..100_000]).unwrap();
    fs::create_dir(p.join("cdir/sub")).unwrap();
    assert_eq!(lsattr(&p.join("cdir/new")), "---------------C------");
    assert_eq!(lsattr(&p.join("cdir/sub")), "---------------C------");
    // chattr through the mount: +C on an empty file, others on anything; +C on a file with
    // data is accepted and ignored (as the kernel does).
    fs::write(p.join("empty"), b"").unwrap();
    sh("chattr", &["+C", s(&p.join("empty"))]);
    sh("chattr", &["+C", s(&p.join("plain"))]);
    assert_eq!(lsattr(&p.join("plain")), "----------------------");
    sh("chattr", &["+d", "+A", s(&p.join("plain"))]);
    sh("chattr", &["+i", s(&p.join("empty"))]);
    fs::write(p.join("app"), b"a").unwrap();
    sh("chattr", &["+a", s(&p.join("app"))]);
    // Immutable and append-only are enforced (EPERM).
    let e = OpenOptions::new()
        .write(true)
        .open(p.join("empty"))
        .unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EPERM),
        "write to immutable: {e}"
    );
    let e = fs::remove_file(p.join("empty")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EPERM), "unlink immutable: {e}");
    let e = OpenOptions::new()
        .write(true)
        .open(p.join("app"))
        .unwrap_err();
    assert_eq!(
        e.raw_os_error(),
        Some(libc::EPERM),
        "append-only without O_APPEND: {e}"
    );
    let mut a = OpenOptions::new().append(true).open(p.join("app")).unwrap();
    a.write_all(b"bc").unwrap();
    drop(a);
    let want_attrs: Vec<(String, String)> = [
        "nc", "plain", "empty", "app", "cdir", "cdir/new", "cdir/sub",
    ]
    .iter()
    .map(|n| (n.to_string(), lsattr(&p.join(n))))
    .collect();
    let want = common::manifest::take(&p, &Default::default());
    m.unmount();
    let after = extents(&img, "5", nc);
    assert_eq!(
        after, before,
        "the nodatacow overwrite did not stay in place"
    );

    // (a) through the library too.
    {
        let fs = Fs::open_rw(&img).unwrap();
        let ino = fs.lookup(fs.root_inode(), b"lib").unwrap().unwrap().target;
        fs.write(ino, 65536, &[0x55; 4096 * 3]).unwrap();
        fs.commit().unwrap();
    }
    assert_eq!(
        extents(&img, "5", lib),
        before_lib,
        "library write not in place"
    );
    let got = fuse_mount::verify_image(&img, &sc.dir("kv"), None, "nodatacow in place");
    let _ = (got, want);
    // No checksum items for nodatacow data, and the kernel shows the same flags and data.
    let csums = kernel::dump_tree(&img, &["-t", "csum"]);
    {
        let m = LoopMount::btrfs_ro(&img, &sc.dir("kv"));
        for (n, a) in &want_attrs {
            assert_eq!(&lsattr(&m.path().join(n)), a, "kernel lsattr of {n}");
        }
        let mut nc_data = data.clone();
        nc_data[12288..12288 + 8192].fill(0xaa);
        assert_eq!(fs::read(m.path().join("nc")).unwrap(), nc_data);
        let mut lib_data = data.clone();
        lib_data[65536..65536 + 12288].fill(0x55);
        assert_eq!(fs::read(m.path().join("lib")).unwrap(), lib_data);
        assert_eq!(fs::read(m.path().join("app")).unwrap(), b"abc");
        m.unmount();
    }
    // Only `plain` has data checksums: 64 sectors.
    let n_csum_items = csums.matches("EXTENT_CSUM").count();
    assert!(n_csum_items >= 1, "{csums}");
    let (_, text) = kernel::btrfs_check(&img);
    assert!(!text.contains("odd csum"), "{text}");

    // (b) after a snapshot, a write copies on write and the snapshot keeps its data.
    let (ok, _, err) = butter(&["subvolume", "snapshot", s(&img), "/", "snap"]);
    assert!(ok, "{err}");
    let m = ButterMount::start(&img, &sc.dir("m"), &[], &sc.join("m2.log"));
    let snap_before = fs::read(m.path().join("snap/nc")).unwrap();
    let f = OpenOptions::new()
        .write(true)
        .open(m.path().join("nc"))
        .unwrap();
    f.write_all_at(&[0xbb; 4096], 0).unwrap();
    drop(f);
    let mut r = Vec::new();
    fs::File::open(m.path().join("snap/nc"))
        .unwrap()
        .read_to_end(&mut r)
        .unwrap();
    assert_eq!(r, snap_before);
    let want = common::manifest::take(m.path(), &Default::default());
    m.unmount();
    let cowed = extents(&img, "5", nc);
    assert_ne!(
        cowed[0].1, before[0].1,
        "shared extent overwritten in place: {cowed:?}"
    );
    fuse_mount::verify_image(&img, &sc.dir("kv"), Some(&want), "nodatacow after snapshot");
    // The new extent is the file's alone: the next write goes in place into it.
    {
        let fs = Fs::open_rw(&img).unwrap();
        let ino = fs.lookup(fs.root_inode(), b"nc").unwrap().unwrap().target;
        fs.write(ino, 0, &[0xcc; 4096]).unwrap();
        fs.commit().unwrap();
    }
    assert_eq!(
        extents(&img, "5", nc),
        cowed,
        "second write after the snapshot moved"
    );
    fuse_mount::verify_image(&img, &sc.dir("kv"), None, "nodatacow second write");
    let m = LoopMount::btrfs_ro(&img, &sc.dir("kv"));
    let mut want_snap = data.clone();
    want_snap[12288..12288 + 8192].fill(0xaa);
    assert_eq!(fs::read(m.path().join("snap/nc")).unwrap(), want_snap);
    assert_eq!(
        &fs::read(m.path().join("nc")).unwrap()[..4096],
        &[0xcc; 4096][..]
    );
    m.unmount();
    let _ = Write::flush(&mut std::io::stdout());
}

/// Both checkers on `img`, clean.
fn both_checks_clean(img: &Path, what: &str) {
    let (rc, out) = fuse_mount::butter_check(img);
    assert_eq!(rc, 0, "{what}: butter check is not clean:\n{out}");
    kernel::assert_btrfs_check(img);
}

/// `butter subvolume set-default` makes a subvolume the one a mount without subvol= shows,
/// in the kernel (and `btrfs subvolume get-default` names it as `butter subvolume
/// get-default` does) and in `butter mount`; `--id 5` puts the top level back.
#[test]
fn default_subvolume_in_butter_and_the_kernel() {
    if !fuse_mount::require("default_subvolume_in_butter_and_the_kernel", &[]) {
        return;
    }
    let sc = ScratchDir::new("subvol-default");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, SIZE);
    let (ok, _, err) = butter(&["subvolume", "create", s(&img), "sv"]);
    assert!(ok, "subvolume create: {err}");
    {
        let fs = Fs::open_rw(&img).unwrap();
        let sv = fs.resolve_in(fs.root_inode(), b"sv").unwrap();
        let f = fs
            .create(
                sv,
                b"inside",
                0o644,
                butter::inode::namespace::Owner::default(),
            )
            .unwrap();
        fs.write(f, 0, b"in the subvolume\n").unwrap();
        fs.commit().unwrap();
    }
    let (ok, before, err) = butter(&["subvolume", "get-default", s(&img)]);
    assert!(ok, "get-default: {err}");
    assert_eq!(before.trim(), "ID 5 (FS_TREE)");

    let (ok, out, err) = butter(&["subvolume", "set-default", s(&img), "sv"]);
    assert!(ok, "set-default sv: {err}");
    let (ok, ours, err) = butter(&["subvolume", "get-default", s(&img)]);
    assert!(ok, "get-default: {err}");
    assert_eq!(out.trim(), ours.trim());
    assert!(ours.starts_with("ID 256 gen "), "{ours}");
    assert!(ours.trim().ends_with(" top level 5 path sv"), "{ours}");
    assert!(
        kernel::dump_super(&img).contains("DEFAULT_SUBVOL"),
        "the DEFAULT_SUBVOL incompat bit is not set"
    );
    both_checks_clean(&img, "after set-default sv");
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k1"), "");
        let p = m.path();
        assert_eq!(
            fs::read(p.join("inside")).unwrap(),
            b"in the subvolume\n",
            "the kernel does not mount the default subvolume"
        );
        let theirs = sh("btrfs", &["subvolume", "get-default", s(p)]);
        assert_eq!(
            theirs.trim(),
            ours.trim(),
            "btrfs and butter get-default differ"
        );
        m.unmount();
    }
    {
        let dir = sc.dir("b1");
        let m = ButterMount::start(&img, &dir, &[], &sc.join("b1.log"));
        assert_eq!(
            fs::read(dir.join("inside")).unwrap(),
            b"in the subvolume\n",
            "butter mount does not show the default subvolume"
        );
        m.unmount();
    }

    let (ok, _, err) = butter(&["subvolume", "set-default", "--id", "5", s(&img)]);
    assert!(ok, "set-default --id 5: {err}");
    let (_, back, _) = butter(&["subvolume", "get-default", s(&img)]);
    assert_eq!(back.trim(), "ID 5 (FS_TREE)");
    both_checks_clean(&img, "after set-default --id 5");
    let m = LoopMount::btrfs(&img, &sc.dir("k2"), "");
    assert!(m.path().join("sv/inside").exists(), "top level not back");
    let theirs = sh("btrfs", &["subvolume", "get-default", s(m.path())]);
    assert_eq!(theirs.trim(), "ID 5 (FS_TREE)");
    m.unmount();

    // A path that is not a subvolume's root is refused, naming it.
    let (ok, _, err) = butter(&["subvolume", "set-default", s(&img), "sv/inside"]);
    assert!(!ok && err.contains("not the root of a subvolume"), "{err}");
}

/// "Key: value" lines of a `subvolume show` output, whitespace trimmed.
fn show_fields(out: &str) -> std::collections::BTreeMap<String, String> {
    out.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

/// `butter subvolume show` gives what `btrfs subvolume show` gives for a kernel-made
/// subvolume and its read-only snapshot (uuids, parent uuid, generations, ids, flags), and
/// `butter subvolume list -u -q -R` lists the same uuids.
#[test]
fn subvolume_show_matches_the_kernel() {
    if !fuse_mount::require("subvolume_show_matches_the_kernel", &[]) {
        return;
    }
    let sc = ScratchDir::new("subvol-show");
    let img = sc.join("a.img");
    fuse_mount::fresh_image(&img, SIZE);
    let mut theirs = Vec::new();
    {
        let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
        let p = m.path();
        sh("btrfs", &["subvolume", "create", s(&p.join("sv"))]);
        fs::write(p.join("sv/f"), b"data\n").unwrap();
        sh(
            "btrfs",
            &[
                "subvolume",
                "snapshot",
                "-r",
                s(&p.join("sv")),
                s(&p.join("snap")),
            ],
        );
        kernel::sync_all();
        for name in ["sv", "snap"] {
            theirs.push(sh("btrfs", &["subvolume", "show", s(&p.join(name))]));
        }
        m.unmount();
    }
    let (ok, list, err) = butter(&["subvolume", "list", "-u", "-q", "-R", s(&img)]);
    assert!(ok, "list: {err}");
    for (name, theirs) in ["sv", "snap"].into_iter().zip(theirs) {
        let (ok, ours, err) = butter(&["subvolume", "show", s(&img), name]);
        assert!(ok, "show {name}: {err}");
        let (a, b) = (show_fields(&ours), show_fields(&theirs));
        for k in [
            "Name",
            "UUID",
            "Parent UUID",
            "Received UUID",
            "Subvolume ID",
            "Generation",
            "Gen at creation",
            "Parent ID",
            "Top level ID",
            "Flags",
            "Send transid",
            "Receive transid",
        ] {
            assert_eq!(
                a.get(k),
                b.get(k),
                "{name}: {k}\nbutter:\n{ours}\nbtrfs:\n{theirs}"
            );
        }
        let line = list
            .lines()
            .find(|l| {
                l.ends_with(&format!(" path {name}")) || l.contains(&format!(" path {name} "))
            })
            .unwrap_or_else(|| panic!("{name} not listed:\n{list}"));
        assert!(line.contains(&format!(" uuid {} ", b["UUID"])), "{line}");
        assert!(
            line.contains(&format!(" parent_uuid {} ", b["Parent UUID"])),
            "{line}"
        );
        assert!(
            line.contains(&format!(" received_uuid {} ", b["Received UUID"])),
            "{line}"
        );
    }
}
