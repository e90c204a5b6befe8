//! Helpers shared by the fsync tests (fsync_matrix.rs, fsync_crash.rs): file operations with
//! real syscalls, the superblock's log pointer, sparse copies of an image (a power cut), both
//! replays (the kernel's by mounting, butter's by a read-write open) and the checkers.
//!
//! Several of these repeat small helpers of log_replay.rs (`pattern`, `fallocate`,
//! `log_root_of`, `copy_sparse`, the kernel-vs-butter compare options), which keeps its own
//! copies.

#![allow(dead_code)]

use super::butter_target::manifest_of;
use super::fuse_mount;
use super::kernel::{self, sh, LoopMount};
use super::manifest::{self, CompareOpts, Manifest, TakeOpts};
use butter::fs::Fs;
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// Fails the test (never skips) unless it can use root, loop devices, kernel btrfs,
/// btrfs-progs and, with `fuse`, /dev/fuse and fusermount3.
pub fn require_or_fail(test: &str, fuse: bool) {
    let ok = if fuse {
        fuse_mount::require(test, &[])
    } else {
        kernel::require_privileges()
    };
    assert!(
        ok,
        "{test} needs root, loop devices, kernel btrfs and btrfs-progs{} (see the notice \
         above); this test fails rather than skips without them",
        if fuse {
            ", /dev/fuse and fusermount3"
        } else {
            ""
        }
    );
}

/// Deterministic content.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(7) as u8 ^ seed)
        .collect()
}

pub fn write_file(p: &Path, len: usize, seed: u8) {
    fs::write(p, pattern(len, seed)).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
}

pub fn open_rw(p: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap_or_else(|e| panic!("open {}: {e}", p.display()))
}

/// fsync(2) of a file or directory (`sync_all` on a fresh descriptor).
pub fn fsync_path(p: &Path) {
    File::open(p)
        .and_then(|f| f.sync_all())
        .unwrap_or_else(|e| panic!("fsync {}: {e}", p.display()));
}

/// fdatasync(2) of a file.
pub fn fdatasync_path(p: &Path) {
    File::open(p)
        .and_then(|f| f.sync_data())
        .unwrap_or_else(|e| panic!("fdatasync {}: {e}", p.display()));
}

pub fn fallocate(f: &File, mode: i32, off: i64, len: i64) {
    // SAFETY: a valid open descriptor; plain integer arguments.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off, len) };
    assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path without NUL")
}

/// renameat2(2) with RENAME_EXCHANGE: `a` and `b` swap names.
pub fn exchange(a: &Path, b: &Path) {
    let (ca, cb) = (cstr(a), cstr(b));
    // SAFETY: valid C strings.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            ca.as_ptr(),
            libc::AT_FDCWD,
            cb.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    assert_eq!(
        r,
        0,
        "exchange {} and {}: {}",
        a.display(),
        b.display(),
        std::io::Error::last_os_error()
    );
}

pub fn setxattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).expect("name");
    // SAFETY: valid C strings and a buffer of the given length.
    let r = unsafe {
        libc::setxattr(
            cstr(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(r, 0, "setxattr: {}", std::io::Error::last_os_error());
}

pub fn removexattr(p: &Path, name: &str) {
    let n = CString::new(name).expect("name");
    // SAFETY: valid C strings.
    let r = unsafe { libc::removexattr(cstr(p).as_ptr(), n.as_ptr()) };
    assert_eq!(r, 0, "removexattr: {}", std::io::Error::last_os_error());
}

/// The primary superblock's log_root (0: no fsync log).
pub fn log_root_of(img: &Path) -> u64 {
    let mut f = File::open(img).expect("open image");
    let mut b = [0u8; 8];
    f.seek(SeekFrom::Start(65536 + 96)).expect("seek");
    f.read_exact(&mut b).expect("read superblock");
    u64::from_le_bytes(b)
}

/// log_root of an image in memory (0 when it is too short to have a superblock).
pub fn log_root_of_bytes(img: &[u8]) -> u64 {
    img.get(65536 + 96..65536 + 104)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .unwrap_or(0)
}

/// `cp --sparse=always`: the image as the page cache has it right now.
pub fn copy_sparse(from: &Path, to: &Path) {
    sh(
        "cp",
        &["--sparse=always".as_ref(), from.as_os_str(), to.as_os_str()],
    );
}

/// Kernel mount vs butter's `Fs` after both replayed one log: what a FUSE view can reproduce
/// except ctime (an inode that loses a name in a replay gets the replay's time as ctime).
/// Two kernel mounts of copies of one crash image, one replayed by the kernel and one by
/// butter: everything but ctime (replay stamps it) and the root's attributes.
pub fn kernel_views_compare_opts() -> CompareOpts {
    CompareOpts {
        inode_numbers: true,
        ctime: false,
        root_attrs: false,
        ..CompareOpts::all()
    }
}

pub fn replay_compare_opts() -> CompareOpts {
    CompareOpts {
        ctime: false,
        ..CompareOpts::fuse()
    }
}

/// Mounts `img` on `mnt` with `options` (read-write: the kernel replays a log), takes the
/// manifest and unmounts.
pub fn kernel_manifest(img: &Path, mnt: &Path, options: &str) -> Manifest {
    let m = LoopMount::btrfs(img, mnt, options);
    let man = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    man
}

/// butter's replay: a read-write open (which replays the log and commits), then the manifest
/// of the top-level subvolume through the library. Asserts the log pointer is cleared.
pub fn butter_replay_manifest(img: &Path, what: &str) -> Manifest {
    let got = {
        let fs = Fs::open_rw(img).unwrap_or_else(|e| panic!("{what}: butter open_rw: {e}"));
        fs.commit()
            .unwrap_or_else(|e| panic!("{what}: commit after replay: {e}"));
        manifest_of(&fs, fs.root_inode())
    };
    assert_eq!(log_root_of(img), 0, "{what}: butter left log_root set");
    got
}

/// butter's checker through the library (a read-only open): no finding above a warning.
pub fn assert_butter_check_lib(img: &Path, what: &str) {
    let fs = Fs::open(img).unwrap_or_else(|e| panic!("{what}: butter open: {e}"));
    let report = fs
        .check(Default::default(), &mut |_| {})
        .unwrap_or_else(|e| panic!("{what}: butter check: {e}"));
    let bad: Vec<_> = report
        .findings
        .iter()
        .filter(|f| f.severity != butter::check::Severity::Warning)
        .collect();
    assert!(bad.is_empty(), "{what}: butter check: {bad:#?}");
}

/// `btrfs check --readonly`, which must pass.
pub fn assert_btrfs_check(img: &Path, what: &str) {
    let (ok, text) = kernel::btrfs_check(img);
    assert!(
        ok,
        "{what}: btrfs check --readonly {}:\n{text}",
        img.display()
    );
}
