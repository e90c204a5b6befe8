//! `butter mkfs`: the images it makes must pass `btrfs check` (exit status and no error
//! line), open in butter with an empty root directory and check clean with `butter check`,
//! mount read-write in the kernel, take writes, and still pass both checkers afterwards.
//! Same options, `-U` and SOURCE_DATE_EPOCH give byte-identical images.
//!
//! The kernel tests need root and loop devices: without them they print a notice and pass,
//! unless CI is set (then they fail). The CLI and determinism tests need nothing.

mod common;

use butter::fs::Fs;
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::path::Path;
use std::process::{Command, Output};

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const UUID: &str = "2b5c8a9e-1f3d-4c6b-9a7e-0d1c2b3a4f5e";
const EPOCH: &str = "1700000000";

/// Runs `butter mkfs ARGS IMAGE` with SOURCE_DATE_EPOCH set to `epoch` (or removed).
fn butter_mkfs(img: &Path, args: &[&str], epoch: Option<&str>) -> Output {
    let mut cmd = Command::new(BUTTER);
    cmd.arg("mkfs").args(args).arg(img);
    match epoch {
        Some(e) => cmd.env("SOURCE_DATE_EPOCH", e),
        None => cmd.env_remove("SOURCE_DATE_EPOCH"),
    };
    cmd.output().expect("run butter mkfs")
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// `butter mkfs` that must succeed.
fn mkfs_ok(img: &Path, args: &[&str]) -> String {
    let o = butter_mkfs(img, args, Some(EPOCH));
    assert!(
        o.status.success(),
        "butter mkfs {args:?} {} failed:\n{}",
        img.display(),
        text(&o)
    );
    text(&o)
}

/// `btrfs check --readonly` passes and prints no error line ("no error found" aside).
fn assert_btrfs_check_clean(img: &Path, when: &str) {
    let (ok, out) = kernel::btrfs_check(img);
    let errors: Vec<&str> = out
        .lines()
        .filter(|l| l.to_ascii_lowercase().contains("error") && !l.contains("no error found"))
        .collect();
    assert!(
        ok && errors.is_empty(),
        "btrfs check {when} on {}: passed={ok}, error lines {errors:?}\n{out}",
        img.display()
    );
    assert!(out.contains("no error found"), "{out}");
}

/// butter opens the image, the root directory holds exactly `names`, and `butter check`
/// finds nothing.
fn assert_butter_clean(img: &Path, names: &[&str], when: &str) -> Fs {
    let fs = Fs::open(img).unwrap_or_else(|e| panic!("butter open {when}: {e}"));
    let mut got: Vec<String> = fs
        .readdir(fs.root_inode(), 0, 0)
        .unwrap()
        .into_iter()
        .map(|e| String::from_utf8_lossy(&e.name).into_owned())
        .collect();
    got.sort();
    let mut want: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    want.sort();
    assert_eq!(got, want, "root directory {when}");
    let report = fs.check(Default::default(), &mut |_| {}).unwrap();
    assert!(
        report.is_clean(),
        "butter check {when}:\n{}",
        report
            .findings
            .iter()
            .map(|f| f.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
    fs
}

/// Deterministic file content (xorshift), fast enough for hundreds of MiB.
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Mounts the image read-write, writes files (and `big_mib` MiB of data in 16 MiB files),
/// a subvolume and a snapshot, unmounts; then both checkers must pass and butter must read
/// the files back.
fn kernel_round_trip(scratch: &ScratchDir, img: &Path, big_mib: usize) {
    let mnt = scratch.dir("mnt");
    let m = LoopMount::btrfs(img, &mnt, "");
    let root = m.path();
    fs::create_dir_all(root.join("d1/d2")).unwrap();
    fs::write(root.join("small"), b"hello from the kernel\n").unwrap();
    fs::write(root.join("d1/d2/medium"), content(1, 300_000)).unwrap();
    fs::hard_link(root.join("small"), root.join("d1/hard")).unwrap();
    std::os::unix::fs::symlink("small", root.join("link")).unwrap();
    for i in 0..50 {
        fs::write(root.join(format!("d1/f{i}")), format!("{i}\n")).unwrap();
    }
    fs::remove_file(root.join("d1/f7")).unwrap();
    fs::rename(root.join("d1/f8"), root.join("d1/d2/f8")).unwrap();
    for i in 0..big_mib.div_ceil(16) {
        fs::write(
            root.join(format!("big{i}")),
            content(100 + i as u64, 16 << 20),
        )
        .unwrap();
    }
    kernel::sh(
        "btrfs",
        &[
            "-q",
            "subvolume",
            "create",
            root.join("sub").to_str().unwrap(),
        ],
    );
    fs::write(root.join("sub/in-sub"), b"subvolume file\n").unwrap();
    kernel::sh(
        "btrfs",
        &[
            "-q",
            "subvolume",
            "snapshot",
            root.join("sub").to_str().unwrap(),
            root.join("snap").to_str().unwrap(),
        ],
    );
    kernel::sync_all();
    m.unmount();

    assert_btrfs_check_clean(img, "after kernel writes");
    let mut names = vec!["d1", "small", "link", "sub", "snap"];
    let bigs: Vec<String> = (0..big_mib.div_ceil(16))
        .map(|i| format!("big{i}"))
        .collect();
    names.extend(bigs.iter().map(String::as_str));
    let fs = assert_butter_clean(img, &names, "after kernel writes");
    let read = |path: &str| {
        let ino = fs
            .resolve_in(fs.root_inode(), path.as_bytes())
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        let size = fs.stat(ino).unwrap().size as usize;
        fs.read(ino, 0, size).unwrap()
    };
    assert_eq!(read("/small"), b"hello from the kernel\n");
    assert_eq!(read("/d1/hard"), b"hello from the kernel\n");
    assert_eq!(read("/d1/d2/medium"), content(1, 300_000));
    assert_eq!(read("/d1/d2/f8"), b"8\n");
    assert_eq!(read("/snap/in-sub"), b"subvolume file\n");
    if let Some(last) = bigs.last() {
        let i = bigs.len() - 1;
        assert_eq!(read(&format!("/{last}")), content(100 + i as u64, 16 << 20));
    }
}

/// The whole cycle for one option set: butter mkfs, btrfs check, butter open + check, kernel
/// writes, both checks again.
fn cycle(name: &str, size: &str, args: &[&str], big_mib: usize) {
    if !kernel::require_privileges() {
        return;
    }
    let scratch = ScratchDir::new(&format!("mkfs-{name}"));
    let img = scratch.join("img");
    let mut all = vec!["-b", size, "-U", UUID];
    all.extend_from_slice(args);
    mkfs_ok(&img, &all);
    assert_btrfs_check_clean(&img, "after butter mkfs");
    assert_butter_clean(&img, &[], "after butter mkfs");
    kernel_round_trip(&scratch, &img, big_mib);
}

#[test]
fn defaults_128m() {
    cycle("defaults", "128M", &[], 0);
}

#[test]
fn nodesize_4k() {
    cycle("nodesize4k", "128M", &["-n", "4096"], 0);
}

#[test]
fn csum_xxhash() {
    cycle("xxhash", "128M", &["--csum", "xxhash"], 0);
}

#[test]
fn csum_sha256() {
    cycle("sha256", "128M", &["--csum", "sha256"], 0);
}

#[test]
fn csum_blake2() {
    cycle("blake2", "128M", &["--csum", "blake2"], 0);
}

#[test]
fn metadata_single_data_dup() {
    cycle("msingle-ddup", "256M", &["-m", "single", "-d", "dup"], 0);
}

#[test]
fn no_holes_and_skinny_off() {
    cycle(
        "fat",
        "128M",
        &["-O", "^no-holes,^skinny-metadata", "-L", "fat"],
        0,
    );
}

#[test]
fn no_free_space_tree() {
    cycle("nofst", "128M", &["-R", "^free-space-tree"], 0);
}

#[test]
fn nodesize_64k_blake2() {
    cycle("nodesize64k", "128M", &["-n", "64k", "--csum", "blake2"], 0);
}

#[test]
fn refuses_a_mounted_image() {
    if !kernel::require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("mkfs-mounted");
    let img = scratch.join("img");
    mkfs_ok(&img, &["-b", "128M"]);
    let m = LoopMount::btrfs(&img, &scratch.dir("mnt"), "");
    let before = fs::read(&img).unwrap();
    let o = butter_mkfs(&img, &["-f"], Some(EPOCH));
    assert!(!o.status.success(), "mkfs of a mounted image succeeded");
    assert!(text(&o).contains("is mounted"), "{}", text(&o));
    assert!(fs::read(&img).unwrap() == before);
    m.unmount();
    assert_btrfs_check_clean(&img, "after a refused mkfs");
}

/// The issue asks for a gigabyte of kernel writes on a butter mkfs image.
#[test]
fn three_gib_with_a_gib_of_kernel_data() {
    cycle("3g", "3G", &[], 1024);
}

#[test]
fn same_uuid_and_epoch_are_byte_identical() {
    let scratch = ScratchDir::new("mkfs-determinism");
    let a = scratch.join("a");
    let b = scratch.join("b");
    let c = scratch.join("c");
    let args = ["-b", "128M", "-U", UUID, "-L", "same"];
    mkfs_ok(&a, &args);
    // b starts as garbage: mkfs overwrites every byte it owns.
    fs::write(&b, vec![0x5a; 128 << 20]).unwrap();
    let o = butter_mkfs(
        &b,
        &["-f", "-b", "128M", "-U", UUID, "-L", "same"],
        Some(EPOCH),
    );
    assert!(o.status.success(), "{}", text(&o));
    let (ba, bb) = (fs::read(&a).unwrap(), fs::read(&b).unwrap());
    // Every block butter wrote is the same; compare the images where both are not garbage.
    let differ = ba
        .chunks(4096)
        .zip(bb.chunks(4096))
        .filter(|(x, y)| x != y && !y.iter().all(|&v| v == 0x5a))
        .count();
    assert_eq!(differ, 0, "blocks differ between two runs");
    // A fresh file both times: byte-identical.
    let a2 = scratch.join("a2");
    mkfs_ok(&a2, &args);
    assert!(fs::read(&a2).unwrap() == ba, "two runs differ");
    // Another uuid: different image.
    mkfs_ok(
        &c,
        &[
            "-b",
            "128M",
            "-U",
            "2b5c8a9e-1f3d-4c6b-9a7e-0d1c2b3a4f5f",
            "-L",
            "same",
        ],
    );
    assert!(
        fs::read(&c).unwrap() != ba,
        "another uuid gave the same image"
    );
    // Without SOURCE_DATE_EPOCH the other uuids are random: different images.
    let d = scratch.join("d");
    let o = butter_mkfs(&d, &args, None);
    assert!(o.status.success(), "{}", text(&o));
    assert!(fs::read(&d).unwrap() != ba);
}

#[test]
fn cli_behaviour() {
    let scratch = ScratchDir::new("mkfs-cli");
    let img = scratch.join("img");

    // Missing file without -b.
    let o = butter_mkfs(&img, &[], Some(EPOCH));
    assert!(!o.status.success());
    assert!(text(&o).contains("-b SIZE"), "{}", text(&o));

    // -b creates the file; the summary names the uuid, sizes, profiles and features.
    let out = mkfs_ok(&img, &["-b", "300M", "-U", UUID, "-L", "lbl"]);
    assert_eq!(fs::metadata(&img).unwrap().len(), 300 << 20);
    for want in [
        "Label:              lbl",
        UUID,
        "Node size:          16384",
        "Sector size:        4096",
        "Filesystem size:    300.00MiB",
        "Metadata:         DUP",
        "Data:             single",
        "System:           DUP",
        "Features:           extref, skinny-metadata, no-holes, free-space-tree, block-group-tree",
        "Checksum:           crc32c",
    ] {
        assert!(out.contains(want), "summary lacks {want:?}:\n{out}");
    }

    // An existing btrfs is refused without -f, and kept.
    let before = fs::read(&img).unwrap();
    let o = butter_mkfs(
        &img,
        &["-U", "2b5c8a9e-1f3d-4c6b-9a7e-0d1c2b3a4f5f"],
        Some(EPOCH),
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("use -f"), "{}", text(&o));
    assert!(fs::read(&img).unwrap() == before);
    // -f overwrites; -q prints nothing; the whole file is used without -b.
    let o = butter_mkfs(&img, &["-f", "-q", "-n", "4k"], Some(EPOCH));
    assert!(o.status.success(), "{}", text(&o));
    assert!(o.stdout.is_empty(), "{}", text(&o));
    let fs = Fs::open(&img).unwrap();
    assert_eq!(fs.disk().sb.nodesize, 4096);
    assert_eq!(fs.disk().sb.total_bytes, 300 << 20);
    assert_ne!(butter::format::fmt_uuid(&fs.disk().sb.fsid), UUID);
    drop(fs);

    // -b larger than a regular file extends it.
    let o = butter_mkfs(&img, &["-f", "-q", "-b", "400M"], Some(EPOCH));
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(fs::metadata(&img).unwrap().len(), 400 << 20);

    // Too small, with the minimum in the message (as mkfs.btrfs).
    let small = scratch.join("small");
    let o = butter_mkfs(&small, &["-b", "100M"], Some(EPOCH));
    assert!(!o.status.success());
    assert!(text(&o).contains("114294784"), "{}", text(&o));
    assert!(!small.exists(), "a refused mkfs left the file it created");

    // Bad values.
    for args in [
        &["-f", "-n", "12k"][..],
        &["-f", "--csum", "md5"][..],
        &["-f", "-m", "raid1"][..],
        &["-f", "-O", "raid56"][..],
        &["-f", "-U", "not-a-uuid"][..],
        &["-f", "-b", "12Q"][..],
    ] {
        let o = butter_mkfs(&img, args, Some(EPOCH));
        assert!(!o.status.success(), "{args:?} succeeded");
    }
    let o = butter_mkfs(&img, &["-f"], Some("yesterday"));
    assert!(!o.status.success());
    assert!(text(&o).contains("SOURCE_DATE_EPOCH"), "{}", text(&o));

    // Feature list.
    let o = butter_mkfs(&img, &["-O", "list-all"], None);
    assert!(o.status.success());
    let t = text(&o);
    assert!(
        t.contains("no-holes") && t.contains("free-space-tree"),
        "{t}"
    );

    // Option values reach the image.
    let o = butter_mkfs(
        &img,
        &[
            "-f",
            "-q",
            "--csum",
            "blake2",
            "-m",
            "single",
            "-d",
            "dup",
            "-O",
            "^no-holes",
            "-R",
            "^free-space-tree",
        ],
        Some(EPOCH),
    );
    assert!(o.status.success(), "{}", text(&o));
    let fs = Fs::open(&img).unwrap();
    let sb = &fs.disk().sb;
    assert_eq!(sb.csum_type, butter::format::csum::CsumType::Blake2b);
    assert_eq!(sb.incompat_flags, 0x141);
    assert_eq!(sb.compat_ro_flags, 0);
}
