//! Test images made by the real mkfs.btrfs and kernel.
//!
//! * [`kernel_image`]: 128 MiB, nodesize 4096 (deep trees with few files), metadata DUP, data
//!   SINGLE; populated through a kernel loop mount: nested directories, ~600 files from 0 bytes
//!   to 3 MiB (inline and regular extents), a sparse file, a preallocated file, a NOCOW
//!   (nodatasum) file, xattrs small and large, symlinks short and long, a hardlink, a fifo, a
//!   subvolume with a read-only snapshot taken before a later overwrite. Needs root and loop.
//! * [`rootdir_image`]: 128 MiB, nodesize 4096, metadata AND data DUP, made by
//!   `mkfs.btrfs --rootdir` from a directory tree (no mount, no root needed).
//!
//! Availability policy: when a tool or privilege is missing the builder prints a notice and
//! returns `None` (the test returns early) unless `CI` is set, in which case it panics: in CI a
//! skipped oracle test would pass silently.

#![allow(dead_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, OnceLock};

// The tool runner the oracle suites share (a tool that fails panics with its output).
pub(crate) use crate::tests::oracle_support::{run, tool};

pub(crate) const IMAGE_SIZE: u64 = 128 << 20;

/// Returns false after printing a notice, or panics when `CI` is set.
pub(crate) fn unavailable(why: &str) -> bool {
    if std::env::var_os("CI").is_some() {
        panic!("corruption suite: {why}, and CI is set: refusing to skip");
    }
    eprintln!("NOTICE: skipping corruption image test: {why}");
    false
}

pub(crate) fn have_mkfs() -> bool {
    if tool("mkfs.btrfs").is_none() {
        return unavailable("mkfs.btrfs not installed");
    }
    true
}

pub(crate) fn have_root_and_loop() -> bool {
    if !have_mkfs() {
        return false;
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return unavailable("not running as root (needed for a loop mount)");
    }
    if !Path::new("/dev/loop-control").exists() {
        return unavailable("no /dev/loop-control");
    }
    for t in ["losetup", "mount", "umount", "btrfs"] {
        if tool(t).is_none() {
            return unavailable(&format!("{t} not installed"));
        }
    }
    let fss = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
    if !fss
        .lines()
        .any(|l| l.split_whitespace().last() == Some("btrfs"))
    {
        return unavailable("the kernel has no btrfs");
    }
    true
}

/// /tmp/corrupt/<name>-<pid>, emptied first, removed on drop.
pub(crate) struct Scratch(pub PathBuf);

impl Scratch {
    pub(crate) fn new(name: &str) -> Scratch {
        let d = PathBuf::from(format!("/tmp/corrupt/{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A loop device we attached and a mount on it; both undone on drop, even on panic.
struct LoopMount {
    dev: String,
    mnt: PathBuf,
    mounted: bool,
}

impl LoopMount {
    fn new(img: &Path, mnt: &Path) -> LoopMount {
        std::fs::create_dir_all(mnt).unwrap();
        let dev = run("losetup", &["--find", "--show", img.to_str().unwrap()])
            .trim()
            .to_string();
        let mut m = LoopMount {
            dev,
            mnt: mnt.to_path_buf(),
            mounted: false,
        };
        run("mount", &["-t", "btrfs", &m.dev, mnt.to_str().unwrap()]);
        m.mounted = true;
        m
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        if self.mounted {
            let _ = Command::new(tool("umount").unwrap_or_else(|| "umount".into()))
                .arg(&self.mnt)
                .status();
        }
        let _ = Command::new(tool("losetup").unwrap_or_else(|| "losetup".into()))
            .args(["-d", &self.dev])
            .status();
    }
}

/// Deterministic bytes (xorshift64*) for file contents.
pub(crate) fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
        out.extend_from_slice(&v.to_le_bytes()[..(len - out.len()).min(8)]);
    }
    out
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

pub(crate) fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    let c = cpath(p);
    let n = CString::new(name).unwrap();
    // SAFETY: valid NUL-terminated strings and a buffer of the given length.
    let r = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "setxattr {name} on {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

fn write(p: &Path, data: &[u8]) {
    std::fs::write(p, data).unwrap_or_else(|e| panic!("write {}: {e}", p.display()));
}

/// The file tree both images share (kernel-only features are added by the caller).
/// `files` small files spread over a few directories, sized to give deep trees at 4 KiB nodes.
fn populate_common(root: &Path, files: usize) {
    let mk = |p: &str| std::fs::create_dir_all(root.join(p)).unwrap();
    for d in ["a/b/c/d", "many1", "many2", "empty-dir", "x"] {
        mk(d);
    }
    for i in 0..files {
        let dir = if i % 2 == 0 { "many1" } else { "many2" };
        let name = format!("f{i:05}-{}", "n".repeat(i % 40));
        let size = (i * 131) % 3100; // 0..3100: inline and (past 2 KiB) regular extents
        let p = root.join(dir).join(name);
        write(&p, &pattern(i as u64, size));
        if i % 7 == 0 {
            set_xattr(&p, "user.small", format!("v{i}").as_bytes());
        }
        if i % 50 == 0 {
            set_xattr(&p, "user.big", &pattern(1000 + i as u64, 1500));
        }
    }
    write(&root.join("empty"), b"");
    write(&root.join("tiny"), b"hello, butter\n");
    write(&root.join("a/b/c/d/deep.txt"), &pattern(7, 5000));
    write(&root.join("x/10k"), &pattern(10, 10_000));
    write(&root.join("x/70k"), &pattern(70, 70_000));
    write(&root.join("x/1m"), &pattern(1, 1 << 20));
    write(&root.join("x/3m"), &pattern(3, 3 << 20));
    std::os::unix::fs::symlink("tiny", root.join("link-short")).unwrap();
    std::os::unix::fs::symlink("a/b/c/d/".repeat(30) + "deep.txt", root.join("link-long")).unwrap();
    std::fs::hard_link(root.join("x/10k"), root.join("a/hardlink-10k")).unwrap();
    set_xattr(&root.join("a"), "user.dir", b"on a directory");
}

fn read_image(img: &Path) -> Vec<u8> {
    std::fs::read(img).unwrap_or_else(|e| panic!("read {}: {e}", img.display()))
}

fn new_image_file(path: &Path) {
    let f = std::fs::File::create(path).unwrap();
    f.set_len(IMAGE_SIZE).unwrap();
}

fn build_kernel_image() -> Vec<u8> {
    let s = Scratch::new("kernel-image");
    let img = s.0.join("k.img");
    new_image_file(&img);
    run(
        "mkfs.btrfs",
        &[
            "-f",
            "-q",
            "-n",
            "4096",
            "-L",
            "corrupt",
            img.to_str().unwrap(),
        ],
    );
    {
        let m = LoopMount::new(&img, &s.0.join("mnt"));
        let root = m.mnt.clone();
        populate_common(&root, 600);
        // A sparse file: data at 0 and at 5 MiB, a hole between (NO_HOLES: no hole items).
        {
            use std::os::unix::fs::FileExt;
            let f = std::fs::File::create(root.join("x/sparse")).unwrap();
            f.write_all_at(&pattern(11, 8192), 0).unwrap();
            f.write_all_at(&pattern(12, 4096), 5 << 20).unwrap();
        }
        // Preallocated (reads as zeros) with a written middle.
        {
            use std::os::unix::fs::FileExt;
            use std::os::unix::io::AsRawFd;
            let f = std::fs::File::create(root.join("x/prealloc")).unwrap();
            // SAFETY: a valid open file descriptor.
            let r = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, 256 << 10) };
            assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
            f.write_all_at(&pattern(13, 4096), 64 << 10).unwrap();
        }
        // NOCOW implies nodatasum: data without checksums.
        {
            use std::io::Write;
            use std::os::unix::io::AsRawFd;
            let mut f = std::fs::File::create(root.join("x/nocow")).unwrap();
            let mut flags: libc::c_long = 0;
            // SAFETY: FS_IOC_GETFLAGS/SETFLAGS take a pointer to a long on Linux.
            unsafe {
                libc::ioctl(f.as_raw_fd(), 0x8008_6601, &mut flags); // FS_IOC_GETFLAGS
                flags |= 0x0080_0000; // FS_NOCOW_FL
                libc::ioctl(f.as_raw_fd(), 0x4008_6602, &flags); // FS_IOC_SETFLAGS
            }
            f.write_all(&pattern(14, 20_000)).unwrap();
        }
        let fifo = cpath(&root.join("x/fifo"));
        // SAFETY: a valid path.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o644) }, 0);
        let sv = root.join("sv");
        run(
            "btrfs",
            &["-q", "subvolume", "create", sv.to_str().unwrap()],
        );
        std::fs::create_dir_all(sv.join("in/sub")).unwrap();
        write(&sv.join("in/sub/file"), &pattern(20, 9000));
        write(&sv.join("changed"), &pattern(21, 12_000));
        write(&sv.join("inline"), b"inline in a subvolume");
        set_xattr(&sv.join("in"), "user.sv", b"subvol xattr");
        // Enough files that the subvolume tree has nodes, so the snapshot shares leaves.
        for i in 0..120 {
            write(
                &sv.join(format!("in/s{i:04}")),
                &pattern(100 + i, (i as usize * 37) % 900),
            );
        }
        run("sync", &[]);
        run(
            "btrfs",
            &[
                "-q",
                "subvolume",
                "snapshot",
                "-r",
                sv.to_str().unwrap(),
                root.join("snap").to_str().unwrap(),
            ],
        );
        // After the snapshot: the subvolume's copy diverges from the snapshot's.
        write(&sv.join("changed"), &pattern(22, 12_000));
        write(&sv.join("new-after-snap"), &pattern(23, 300));
        run("sync", &[]);
    }
    read_image(&img)
}

fn build_rootdir_image() -> Vec<u8> {
    let s = Scratch::new("rootdir-image");
    let src = s.0.join("src");
    std::fs::create_dir_all(&src).unwrap();
    populate_common(&src, 300);
    let img = s.0.join("r.img");
    new_image_file(&img);
    run(
        "mkfs.btrfs",
        &[
            "-f",
            "-q",
            "-n",
            "4096",
            "-d",
            "dup",
            "--rootdir",
            src.to_str().unwrap(),
            img.to_str().unwrap(),
        ],
    );
    read_image(&img)
}

static KERNEL: OnceLock<Arc<Vec<u8>>> = OnceLock::new();
static ROOTDIR: OnceLock<Arc<Vec<u8>>> = OnceLock::new();

/// The kernel-populated image (built once per test binary), or None when unavailable.
pub(crate) fn kernel_image() -> Option<Arc<Vec<u8>>> {
    if !have_root_and_loop() {
        return None;
    }
    Some(
        KERNEL
            .get_or_init(|| Arc::new(build_kernel_image()))
            .clone(),
    )
}

/// The `mkfs.btrfs --rootdir` image (no root needed), or None when mkfs is unavailable.
pub(crate) fn rootdir_image() -> Option<Arc<Vec<u8>>> {
    if !have_mkfs() {
        return None;
    }
    Some(
        ROOTDIR
            .get_or_init(|| Arc::new(build_rootdir_image()))
            .clone(),
    )
}
