//! `butter mkfs --rootdir DIR --reflink IMAGE` against the kernel. A btrfs loop mount holds a
//! source tree (files of many sizes, some not a multiple of 4 KiB, an inline one, a sparse
//! one, an empty one, real zeroes, a hard link, a nodatasum file, nested directories) and the
//! images:
//!
//! - the --reflink image is byte-identical to the image made without it (same
//!   SOURCE_DATE_EPOCH, DETERMINISTIC_SEED and -U);
//! - it shares exactly the whole sectors of the source files' data with them (`btrfs
//!   filesystem du` on the outer mount: total minus exclusive bytes);
//! - `btrfs check --readonly` and `butter check` pass, and a kernel mount shows the source tree;
//! - on tmpfs (cross-filesystem: EXDEV; tmpfs to tmpfs: EOPNOTSUPP) the image is still the
//!   same and a warning says --reflink had no effect and why;
//! - --reflink without --rootdir, and with a block device as IMAGE, is refused before anything
//!   is written; with --compress it stores the data plain, as mkfs.btrfs does.
//!
//! Needs root, loop devices and btrfs-progs: without them the test prints a notice and passes,
//! unless CI is set (then it fails).

mod common;

use common::kernel::{btrfs_check, require_privileges, run, sync_all, LoopMount, ScratchDir};
use common::kernel::{run_output, TmpfsMount};
use common::manifest::{assert_same, take, CompareOpts, TakeOpts};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const UUID: &str = "5eed5eed-0000-4000-8000-00000000ef1c";
const SS: u64 = 4096;

/// `butter mkfs -U UUID --rootdir SRC EXTRA... IMG`, reproducible; the output whatever the
/// exit status.
fn mkfs(src: Option<&Path>, img: &Path, extra: &[&str]) -> Output {
    let mut c = Command::new(BUTTER);
    c.arg("mkfs").args(["-U", UUID]).args(extra);
    if let Some(src) = src {
        c.arg("--rootdir").arg(src);
    }
    c.arg(img)
        .env("SOURCE_DATE_EPOCH", "1700000000")
        .env("DETERMINISTIC_SEED", "1")
        .env_remove("BUTTER_FIXED_TIME");
    run_output(&mut c)
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn mkfs_ok(src: &Path, img: &Path, extra: &[&str]) -> Output {
    let o = mkfs(Some(src), img, extra);
    assert!(
        o.status.success(),
        "butter mkfs {extra:?} {} failed:\n{}",
        img.display(),
        text(&o)
    );
    o
}

/// Pseudo-random bytes (xorshift), different per seed.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

/// Fills `src`; returns the bytes of whole sectors of file data that live in extents (what
/// --reflink can clone), each inode once.
fn make_tree(src: &Path) -> u64 {
    let w = |rel: &str, data: &[u8]| {
        let p = src.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, data).unwrap();
    };
    let mut cloneable = 0;
    for (seed, (rel, len)) in (1..).zip([
        ("one_sector", 4096usize),
        ("odd", 12345),
        ("big", (3 << 20) + 100),
        ("sub/deep/nested", 200_000),
        ("sub/eight_sectors", 8 * 4096),
        ("sub/nosum/unsummed", 50_000),
    ]) {
        w(rel, &noise(len, seed));
        cloneable += len as u64 / SS * SS;
    }
    // Inline (in the tree block) and empty: nothing to clone.
    w("tiny", b"a small file, stored inline\n");
    w("empty", b"");
    // Real zeroes, not a hole.
    w("sub/zeros", &vec![0u8; 64 << 10]);
    cloneable += 64 << 10;
    // Sparse: 8 MiB with 64 KiB of data at 1 MiB and 10000 bytes at 6 MiB + 123 (the three
    // sectors holding them are data, zero-filled around the bytes).
    let sparse = std::fs::File::create(src.join("sparse")).unwrap();
    sparse.set_len(8 << 20).unwrap();
    sparse.write_all_at(&noise(64 << 10, 99), 1 << 20).unwrap();
    sparse
        .write_all_at(&noise(10_000, 98), (6 << 20) + 123)
        .unwrap();
    drop(sparse);
    cloneable += (64 << 10) + 3 * SS;
    // A hard link: one inode, copied (and cloned) once.
    std::fs::hard_link(src.join("big"), src.join("sub/big_link")).unwrap();
    cloneable
}

/// `btrfs filesystem du -s --raw PATH`: (total, exclusive).
fn du(path: &Path) -> (u64, u64) {
    let out = run(Command::new("btrfs")
        .args(["filesystem", "du", "-s", "--raw"])
        .arg(path));
    let line = out.lines().nth(1).unwrap_or_default().to_string();
    let n: Vec<u64> = line
        .split_whitespace()
        .take(2)
        .filter_map(|x| x.parse().ok())
        .collect();
    assert_eq!(n.len(), 2, "btrfs filesystem du output: {out}");
    (n[0], n[1])
}

fn assert_same_bytes(a: &Path, b: &Path, what: &str) {
    let x = std::fs::read(a).unwrap();
    let y = std::fs::read(b).unwrap();
    assert_eq!(x.len(), y.len(), "{what}: image sizes differ");
    if let Some(at) = x.iter().zip(&y).position(|(p, q)| p != q) {
        panic!("{what}: the images differ, first at byte {at}");
    }
}

/// A loop device on a file, not mounted, detached on drop.
struct LoopDev(PathBuf);

impl LoopDev {
    fn new(file: &Path) -> LoopDev {
        let out = run(Command::new("losetup").args(["-f", "--show"]).arg(file));
        LoopDev(PathBuf::from(out.trim()))
    }
}

impl Drop for LoopDev {
    fn drop(&mut self) {
        let o = run_output(Command::new("losetup").arg("-d").arg(&self.0));
        if !o.status.success() {
            eprintln!(
                "losetup -d {}: {}",
                self.0.display(),
                String::from_utf8_lossy(&o.stderr)
            );
        }
    }
}

#[test]
fn reflink_clones_source_data_into_the_image() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("mkfs-reflink");
    let outer_img = scratch.join("outer.img");
    common::kernel::mkfs_btrfs(&outer_img, 1 << 30, &[] as &[&str]);
    // noatime: reading the source (the copies, the manifest) changes nothing in it.
    let outer = LoopMount::btrfs(&outer_img, &scratch.join("outer"), "noatime");
    let src = outer.path().join("src");
    let cloneable = make_tree(&src);
    sync_all();
    let want = take(&src, &TakeOpts::default());
    let flags = ["--inode-flags", "nodatasum:sub/nosum"];

    let plain = outer.path().join("plain.img");
    mkfs_ok(&src, &plain, &flags);
    let img = outer.path().join("reflink.img");
    let o = mkfs_ok(&src, &img, &[&flags[..], &["--reflink"]].concat());
    let out = text(&o);
    assert!(
        !out.contains("no effect"),
        "--reflink on one btrfs warned:\n{out}"
    );
    // The summary counts what was cloned (more than 1 MiB here, so in MiB).
    let line = format!("Reflinked:          {:.2}MiB", cloneable as f64 / 1048576.0);
    assert!(out.contains(&line), "summary lacks `{line}`:\n{out}");
    assert_same_bytes(&plain, &img, "--reflink vs plain image");

    // The image shares the whole sectors of the source data, and only those.
    sync_all();
    let (total, exclusive) = du(&img);
    assert_eq!(
        total - exclusive,
        cloneable,
        "shared bytes of the --reflink image (total {total}, exclusive {exclusive})"
    );
    let (ptotal, pexclusive) = du(&plain);
    assert_eq!(ptotal, pexclusive, "the plain image shares data");

    let (ok, report) = btrfs_check(&img);
    assert!(
        ok,
        "btrfs check --readonly of the --reflink image:\n{report}"
    );
    let (rc, report) = common::fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check of the --reflink image:\n{report}");
    let got = {
        let m = LoopMount::btrfs_ro(&img, &scratch.join("new"));
        let got = take(m.path(), &TakeOpts::default());
        m.unmount();
        got
    };
    let opts = CompareOpts {
        // A copy gets new inodes: ctime = mtime, birth time = SOURCE_DATE_EPOCH.
        ctime: false,
        btime: false,
        inode_numbers: false,
        subvolumes: false,
        // The root's attributes come from the source directory, the mount point's are the
        // image's root: compared too.
        ..CompareOpts::all()
    };
    assert_same(
        &want,
        &got,
        &opts,
        "source tree vs kernel mount of the image",
    );

    // --compress with --reflink: mkfs.btrfs leaves the data uncompressed; so does butter, and
    // says so.
    let comp = outer.path().join("compress.img");
    let o = mkfs_ok(
        &src,
        &comp,
        &[&flags[..], &["--reflink", "--compress", "zstd:3"]].concat(),
    );
    assert!(
        text(&o).contains("--compress is ignored with --reflink"),
        "no warning:\n{}",
        text(&o)
    );
    assert_same_bytes(&plain, &comp, "--reflink --compress vs plain image");
    std::fs::remove_file(&comp).unwrap();

    // On tmpfs (not the source's filesystem): the same image, and a warning with the reason.
    let tmp = TmpfsMount::new(&scratch.join("tmpfs"), 1 << 30);
    let timg = tmp.path().join("reflink.img");
    let o = mkfs_ok(&src, &timg, &[&flags[..], &["--reflink"]].concat());
    let out = text(&o);
    assert!(
        out.contains("--reflink had no effect") && out.contains("EXDEV"),
        "image on tmpfs, source on btrfs:\n{out}"
    );
    assert_eq!(
        out.matches("no effect").count(),
        1,
        "warned more than once:\n{out}"
    );
    assert_same_bytes(&plain, &timg, "--reflink on tmpfs vs plain image");
    std::fs::remove_file(&timg).unwrap();
    // Both on tmpfs: tmpfs cannot clone at all.
    let tsrc = tmp.path().join("src");
    std::fs::create_dir(&tsrc).unwrap();
    std::fs::write(tsrc.join("f"), noise(100_000, 7)).unwrap();
    let o = mkfs_ok(&tsrc, &timg, &["--reflink"]);
    let out = text(&o);
    assert!(
        out.contains("--reflink had no effect") && out.contains("EOPNOTSUPP"),
        "image and source on tmpfs:\n{out}"
    );
    tmp.unmount();
    drop(outer);
}

#[test]
fn reflink_refusals_write_nothing() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("mkfs-reflink-refused");
    let src = scratch.dir("src");
    std::fs::write(src.join("f"), noise(50_000, 3)).unwrap();

    // Without --rootdir: refused, no file made, an existing one untouched.
    let missing = scratch.join("missing.img");
    let o = mkfs(None, &missing, &["-b", "300M", "--reflink"]);
    assert!(!o.status.success(), "--reflink without --rootdir ran");
    assert!(text(&o).contains("--rootdir"), "error: {}", text(&o));
    assert!(!missing.exists(), "--reflink without --rootdir made a file");
    let old = scratch.join("old.img");
    let before = noise(1 << 20, 5);
    std::fs::write(&old, &before).unwrap();
    let o = mkfs(None, &old, &["-f", "--reflink"]);
    assert!(!o.status.success(), "--reflink without --rootdir ran");
    assert!(
        std::fs::read(&old).unwrap() == before,
        "the old file changed"
    );

    // A block device cannot take clones: refused before a byte is written.
    let backing = scratch.join("backing.img");
    let before = noise(300 << 20, 6);
    std::fs::write(&backing, &before).unwrap();
    {
        let dev = LoopDev::new(&backing);
        let o = mkfs(Some(&src), &dev.0, &["-f", "--reflink"]);
        assert!(!o.status.success(), "--reflink onto a block device ran");
        assert!(
            text(&o).contains("not a regular file"),
            "error: {}",
            text(&o)
        );
    }
    assert!(
        std::fs::read(&backing).unwrap() == before,
        "the refused block device was written"
    );
}
