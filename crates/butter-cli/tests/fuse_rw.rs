//! `butter mount` read-write against the kernel's btrfs: the same script of operations runs
//! on a butter FUSE mount of one fresh image and on a kernel mount of another; both trees
//! must look the same (everything but times and inode numbers). Then the butter image is
//! unmounted, checked (`butter check`, `btrfs check --readonly`), mounted by the kernel and
//! must show exactly what the FUSE mount showed, times included. Also: one writer per image
//! (a second read-write mount and a kernel-mounted image are refused), SIGTERM commits,
//! SIGKILL leaves the last commit, `--daemon` returns with the mount usable.
//!
//! Needs root, /dev/fuse, fusermount3, loop devices, kernel btrfs and btrfs-progs. Without
//! them the tests print a notice and pass, unless CI is set: then they fail.

mod common;

use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, TakeOpts};
use std::ffi::CString;
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const IMAGE_SIZE: u64 = 512 << 20;

/// Root, loop devices, kernel btrfs (common::kernel), plus /dev/fuse and fusermount3.
fn prerequisites(test: &str) -> bool {
    if !kernel::require_privileges() {
        return false;
    }
    let mut missing = Vec::new();
    if !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse");
    }
    if Command::new("fusermount3").arg("-V").output().is_err() {
        missing.push("fusermount3");
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("{test} needs {}", missing.join(", "));
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; CI is set, so this is a failure, not a skip");
    }
    eprintln!("notice: skipping {msg}");
    false
}

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// Deterministic bytes.
fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// A butter mount as a child process

struct ButterMount {
    child: Option<Child>,
    dir: PathBuf,
}

impl ButterMount {
    /// `butter mount [args] image dir`, waiting until `dir` is a mount point.
    fn start(image: &Path, dir: &Path, args: &[&str]) -> ButterMount {
        let child = Command::new(BUTTER)
            .arg("mount")
            .args(args)
            .arg(image)
            .arg(dir)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .spawn()
            .expect("spawning butter mount");
        let mut m = ButterMount {
            child: Some(child),
            dir: dir.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !kernel::is_mountpoint(dir) {
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                m.child = None;
                panic!("butter mount exited early: {st}");
            }
            assert!(Instant::now() < deadline, "butter mount did not mount");
            std::thread::sleep(Duration::from_millis(20));
        }
        m
    }

    fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    fn signal(&self, sig: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid(), sig) };
    }

    /// Waits for the process to exit (at most 30 s).
    fn wait(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("already waited");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                return st;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("butter mount did not exit within 30 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// `fusermount3 -u`, then the process must exit 0.
    fn unmount(mut self) {
        if let Err(e) = fusermount_u(&self.dir) {
            panic!("fusermount3 -u: {e}");
        }
        let st = self.wait();
        assert!(st.success(), "butter mount exited with {st}");
    }
}

impl Drop for ButterMount {
    fn drop(&mut self) {
        if kernel::is_mountpoint(&self.dir) {
            let _ = Command::new("fusermount3")
                .args(["-u", "-z"])
                .arg(&self.dir)
                .status();
        }
        if let Some(mut c) = self.child.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while c.try_wait().ok().flatten().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `fusermount3 -u dir`, retried for a while when the mount is busy (a file closed just
/// before may still be on its way out).
fn fusermount_u(dir: &Path) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = Command::new("fusermount3")
            .arg("-u")
            .arg(dir)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            return Ok(());
        }
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        if Instant::now() > deadline || !err.contains("busy") {
            return Err(err);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn butter_check(image: &Path) {
    let out = Command::new(BUTTER)
        .arg("check")
        .arg(image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "butter check: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

// ---------------------------------------------------------------------------------------------
// The script

/// Raw POSIX ACL xattr: (tag, perm, id) entries.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for (t, p, id) in entries {
        v.extend_from_slice(&t.to_le_bytes());
        v.extend_from_slice(&p.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}

fn setxattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).unwrap();
    // SAFETY: valid C strings and buffer.
    let r = unsafe {
        libc::lsetxattr(
            cstr(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "setxattr {name} on {}: errno {}",
        p.display(),
        errno()
    );
}

fn seek(f: &File, offset: i64, whence: i32) -> Result<i64, i32> {
    use std::os::fd::AsRawFd;
    // SAFETY: lseek on an open descriptor.
    let r = unsafe { libc::lseek(f.as_raw_fd(), offset, whence) };
    if r < 0 {
        Err(errno())
    } else {
        Ok(r)
    }
}

fn utimens(p: &Path, atime: (i64, i64), mtime: (i64, i64)) {
    let ts = [
        libc::timespec {
            tv_sec: atime.0,
            tv_nsec: atime.1,
        },
        libc::timespec {
            tv_sec: mtime.0,
            tv_nsec: mtime.1,
        },
    ];
    // SAFETY: valid path and two timespecs.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            cstr(p).as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(r, 0, "utimensat {}: errno {}", p.display(), errno());
}

const UID: u32 = 1000;

/// The operations, with their immediate results checked. Runs the same on any mount.
fn exercise(root: &Path) {
    let p = |rel: &str| root.join(rel);
    // Small, big, appended, truncated.
    fs::write(p("small"), b"hello world\n").unwrap();
    {
        // In 128 KiB writes, as cp writes.
        let mut f = File::create(p("big")).unwrap();
        for c in pseudo_random(5 << 20, 1).chunks(128 << 10) {
            f.write_all(c).unwrap();
        }
    }
    {
        let mut f = OpenOptions::new()
            .append(true)
            .create(true)
            .truncate(false)
            .open(p("log"))
            .unwrap();
        f.write_all(b"one\n").unwrap();
        // A positioned write on an O_APPEND file still appends (Linux).
        f.write_all_at(b"two\n", 0).unwrap();
        f.write_all(&pseudo_random(100_000, 2)).unwrap();
    }
    assert_eq!(&fs::read(p("log")).unwrap()[..8], b"one\ntwo\n");
    fs::write(p("shrink"), pseudo_random(300_000, 3)).unwrap();
    OpenOptions::new()
        .write(true)
        .open(p("shrink"))
        .unwrap()
        .set_len(12_345)
        .unwrap();
    fs::write(p("grow"), b"abc").unwrap();
    OpenOptions::new()
        .write(true)
        .open(p("grow"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    {
        // Overwrite in the middle of a big file, and O_TRUNC an existing one.
        let f = OpenOptions::new().write(true).open(p("big")).unwrap();
        f.write_all_at(&pseudo_random(70_000, 4), 1_000_000)
            .unwrap();
        fs::write(p("small"), b"replaced\n").unwrap();
    }
    // Directories, renames.
    fs::create_dir_all(p("d1/d2/d3")).unwrap();
    fs::write(p("d1/a"), b"a").unwrap();
    fs::write(p("d1/d2/b"), b"bb").unwrap();
    fs::rename(p("d1/a"), p("d1/d2/a-moved")).unwrap();
    fs::rename(p("d1/d2/d3"), p("d3-moved")).unwrap();
    fs::write(p("victim"), b"to be replaced").unwrap();
    fs::rename(p("d1/d2/b"), p("victim")).unwrap();
    fs::create_dir(p("xa")).unwrap();
    fs::write(p("xa/inside"), b"x").unwrap();
    fs::write(p("xb"), b"a file").unwrap();
    let rename2 = |a: &str, b: &str, flags: u32| -> i32 {
        let (a, b) = (cstr(&p(a)), cstr(&p(b)));
        // SAFETY: valid C strings.
        let r = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                a.as_ptr(),
                libc::AT_FDCWD,
                b.as_ptr(),
                flags,
            )
        };
        if r == 0 {
            0
        } else {
            errno()
        }
    };
    assert_eq!(rename2("xa", "xb", libc::RENAME_EXCHANGE), 0);
    assert!(p("xb/inside").exists() && p("xa").is_file());
    assert_eq!(rename2("xa", "small", libc::RENAME_NOREPLACE), libc::EEXIST);
    fs::create_dir(p("empty")).unwrap();
    fs::remove_dir(p("empty")).unwrap();
    assert_eq!(
        fs::remove_dir(p("d1")).unwrap_err().raw_os_error(),
        Some(libc::ENOTEMPTY)
    );
    // Hard links and symlinks.
    fs::hard_link(p("small"), p("d1/small-link")).unwrap();
    fs::hard_link(p("small"), p("small-link2")).unwrap();
    fs::remove_file(p("small-link2")).unwrap();
    assert_eq!(fs::metadata(p("small")).unwrap().nlink(), 2);
    std::os::unix::fs::symlink("small", p("sym")).unwrap();
    std::os::unix::fs::symlink("d1/d2/../../nowhere", p("dangling")).unwrap();
    std::os::unix::fs::symlink("x".repeat(1000), p("longsym")).unwrap();
    assert_eq!(fs::read(p("sym")).unwrap(), b"replaced\n");
    // Special files.
    let mk = |rel: &str, mode: u32, dev: u64| {
        // SAFETY: valid C string.
        let r = unsafe { libc::mknod(cstr(&p(rel)).as_ptr(), mode, dev) };
        assert_eq!(r, 0, "mknod {rel}: errno {}", errno());
    };
    mk("fifo", libc::S_IFIFO | 0o640, 0);
    mk("chr", libc::S_IFCHR | 0o600, libc::makedev(1, 3));
    mk("blk", libc::S_IFBLK | 0o600, libc::makedev(259, 70000));
    mk("sock", libc::S_IFSOCK | 0o755, 0);
    // Xattrs.
    setxattr(&p("small"), "user.one", b"1");
    setxattr(&p("small"), "user.two", &pseudo_random(3000, 5));
    setxattr(&p("d1"), "user.dir", b"");
    setxattr(&p("small"), "user.gone", b"x");
    let n = CString::new("user.gone").unwrap();
    // SAFETY: valid C strings.
    assert_eq!(
        unsafe { libc::lremovexattr(cstr(&p("small")).as_ptr(), n.as_ptr()) },
        0
    );
    // Attributes.
    fs::write(p("attrs"), b"attrs").unwrap();
    fs::set_permissions(p("attrs"), fs::Permissions::from_mode(0o4751)).unwrap();
    std::os::unix::fs::chown(p("attrs"), Some(UID), Some(2000)).unwrap();
    std::os::unix::fs::lchown(p("sym"), Some(3), Some(4)).unwrap();
    utimens(
        &p("attrs"),
        (1_000_000_000, 123_456_789),
        (1_100_000_000, 5),
    );
    utimens(&p("d3-moved"), (-5, 500), (2_000_000_000, 999_999_999));
    // UTIME_OMIT leaves atime, UTIME_NOW sets mtime.
    utimens(&p("grow"), (0, libc::UTIME_OMIT), (0, libc::UTIME_NOW));
    // setgid directory: group and bit inherited.
    fs::create_dir(p("sgid")).unwrap();
    std::os::unix::fs::chown(p("sgid"), None, Some(4321)).unwrap();
    fs::set_permissions(p("sgid"), fs::Permissions::from_mode(0o2775)).unwrap();
    fs::write(p("sgid/file"), b"g").unwrap();
    fs::create_dir(p("sgid/sub")).unwrap();
    assert_eq!(fs::metadata(p("sgid/file")).unwrap().gid(), 4321);
    assert_eq!(fs::metadata(p("sgid/sub")).unwrap().mode() & 0o2000, 0o2000);
    // fallocate, holes, SEEK_DATA / SEEK_HOLE.
    {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(p("sparse"))
            .unwrap();
        f.write_all_at(&pseudo_random(65536, 6), 0).unwrap();
        f.write_all_at(&pseudo_random(65536, 7), 1 << 20).unwrap();
        f.sync_all().unwrap();
        assert_eq!(seek(&f, 0, libc::SEEK_HOLE), Ok(65536));
        assert_eq!(seek(&f, 65536, libc::SEEK_DATA), Ok(1 << 20));
        assert_eq!(
            seek(&f, (1 << 20) + 65536, libc::SEEK_DATA),
            Err(libc::ENXIO)
        );
        assert_eq!(seek(&f, 70_000, libc::SEEK_HOLE), Ok(70_000));
        use std::os::fd::AsRawFd;
        let fd = f.as_raw_fd();
        // SAFETY: fallocate on an open descriptor.
        unsafe {
            assert_eq!(libc::fallocate(fd, 0, 2 << 20, 65536), 0, "{}", errno());
            assert_eq!(
                libc::fallocate(fd, libc::FALLOC_FL_KEEP_SIZE, 3 << 20, 65536),
                0
            );
            assert_eq!(
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    4096,
                    8192
                ),
                0
            );
            assert_eq!(
                libc::fallocate(fd, libc::FALLOC_FL_ZERO_RANGE, (1 << 20) + 4096, 4096),
                0
            );
        }
        assert_eq!(f.metadata().unwrap().len(), (2 << 20) + 65536);
        assert_eq!(seek(&f, 0, libc::SEEK_HOLE), Ok(4096));
        assert_eq!(seek(&f, 4096, libc::SEEK_DATA), Ok(12288));
    }
    // copy_file_range.
    {
        let src = File::open(p("big")).unwrap();
        let dst = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(p("copy"))
            .unwrap();
        use std::os::fd::AsRawFd;
        let mut off_in: i64 = 1000;
        let mut off_out: i64 = 0;
        let mut left = 3 << 20;
        while left > 0 {
            // SAFETY: valid descriptors and offsets.
            let n = unsafe {
                libc::copy_file_range(
                    src.as_raw_fd(),
                    &mut off_in,
                    dst.as_raw_fd(),
                    &mut off_out,
                    left,
                    0,
                )
            };
            assert!(n > 0, "copy_file_range: errno {}", errno());
            left -= n as usize;
        }
    }
    assert_eq!(
        fs::read(p("copy")).unwrap(),
        fs::read(p("big")).unwrap()[1000..1000 + (3 << 20)]
    );
    // Unlink while open: the data stays readable until the close.
    {
        fs::write(p("orphan"), pseudo_random(200_000, 8)).unwrap();
        let mut f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(p("orphan"))
            .unwrap();
        fs::remove_file(p("orphan")).unwrap();
        assert!(!p("orphan").exists());
        f.write_all_at(b"still here", 10).unwrap();
        let mut back = Vec::new();
        f.seek(SeekFrom::Start(0)).unwrap();
        f.read_to_end(&mut back).unwrap();
        let mut want = pseudo_random(200_000, 8);
        want[10..20].copy_from_slice(b"still here");
        assert_eq!(back, want);
    }
    // POSIX ACLs (raw xattrs, as setfacl writes them): an access ACL with a named user sets
    // the mode from the mask; chmod changes the mask; a default ACL is inherited.
    const U: u32 = u32::MAX;
    fs::write(p("acl-file"), b"acl").unwrap();
    fs::set_permissions(p("acl-file"), fs::Permissions::from_mode(0o600)).unwrap();
    setxattr(
        &p("acl-file"),
        "system.posix_acl_access",
        &acl(&[
            (1, 6, U),
            (2, 4, UID),
            (4, 0, U),
            (0x10, 4, U),
            (0x20, 0, U),
        ]),
    );
    assert_eq!(fs::metadata(p("acl-file")).unwrap().mode() & 0o777, 0o640);
    fs::write(p("no-acl"), b"private").unwrap();
    fs::set_permissions(p("no-acl"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::create_dir(p("acl-dir")).unwrap();
    setxattr(
        &p("acl-dir"),
        "system.posix_acl_default",
        &acl(&[
            (1, 7, U),
            (2, 5, UID),
            (4, 5, U),
            (0x10, 7, U),
            (0x20, 0, U),
        ]),
    );
    fs::write(p("acl-dir/inherits"), b"i").unwrap();
    fs::create_dir(p("acl-dir/subdir")).unwrap();
    fs::write(p("acl-chmod"), b"c").unwrap();
    setxattr(
        &p("acl-chmod"),
        "system.posix_acl_access",
        &acl(&[
            (1, 7, U),
            (2, 7, UID),
            (4, 5, U),
            (0x10, 7, U),
            (0x20, 5, U),
        ]),
    );
    fs::set_permissions(p("acl-chmod"), fs::Permissions::from_mode(0o750)).unwrap();
    // A base-only ACL is just mode bits.
    fs::write(p("acl-base"), b"b").unwrap();
    setxattr(
        &p("acl-base"),
        "system.posix_acl_access",
        &acl(&[(1, 7, U), (4, 1, U), (0x20, 4, U)]),
    );
    assert_eq!(fs::metadata(p("acl-base")).unwrap().mode() & 0o777, 0o714);
    // The ACL is enforced: user 1000 may read acl-file (named entry), not no-acl.
    let cat_as = |rel: &str| {
        Command::new("cat")
            .arg(p(rel))
            .uid(UID)
            .gid(UID)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
    };
    assert!(cat_as("acl-file"), "ACL entry for user {UID} not honoured");
    assert!(!cat_as("no-acl"), "mode 0600 not enforced");
    // Many files in one directory (a multi-leaf directory).
    fs::create_dir(p("many")).unwrap();
    for i in 0..400 {
        fs::write(p(&format!("many/file-{i:04}")), format!("{i}")).unwrap();
    }
    for i in (0..400).step_by(3) {
        fs::remove_file(p(&format!("many/file-{i:04}"))).unwrap();
    }
}

/// Where the two mounts may differ: times (they ran at other moments) and inode numbers.
fn same_script_opts() -> CompareOpts {
    CompareOpts {
        atime: false,
        mtime: false,
        ctime: false,
        btime: false,
        inode_numbers: false,
        subvolumes: false,
        ..CompareOpts::all()
    }
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn read_write_mount_matches_the_kernel() {
    if !prerequisites("read_write_mount_matches_the_kernel") {
        return;
    }
    let s = ScratchDir::new("fuse-rw");
    // The mount points must be reachable by user 1000 (ACL check).
    fs::set_permissions(s.path(), fs::Permissions::from_mode(0o755)).unwrap();
    let bimg = s.join("butter.img");
    let kimg = s.join("kernel.img");
    kernel::mkfs_btrfs(&bimg, IMAGE_SIZE, &[] as &[&str]);
    kernel::mkfs_btrfs(&kimg, IMAGE_SIZE, &[] as &[&str]);
    let bdir = s.dir("butter");
    let kdir = s.dir("kernel");

    let want = {
        let k = LoopMount::btrfs(&kimg, &kdir, "");
        exercise(k.path());
        let m = manifest::take(k.path(), &TakeOpts::default());
        k.unmount();
        m
    };
    let b = ButterMount::start(&bimg, &bdir, &["-o", "allow_other"]);
    exercise(&bdir);
    let got = manifest::take(&bdir, &TakeOpts::default());
    manifest::assert_same(&want, &got, &same_script_opts(), "kernel vs butter mount");
    // Times set explicitly are kept exactly.
    let e = got.get("attrs").unwrap();
    assert_eq!((e.atime.sec, e.atime.nsec), (1_000_000_000, 123_456_789));
    assert_eq!((e.mtime.sec, e.mtime.nsec), (1_100_000_000, 5));
    let e = got.get("d3-moved").unwrap();
    assert_eq!((e.atime.sec, e.atime.nsec), (-5, 500));
    let g = got.get("grow").unwrap();
    assert!(
        g.mtime >= g.atime,
        "UTIME_NOW mtime before the omitted atime"
    );
    // statfs follows the data.
    let st = statvfs(&bdir);
    assert!(st.0 > 0 && st.1 < st.0, "statfs {st:?}");
    b.unmount();

    butter_check(&bimg);
    kernel::assert_btrfs_check(&bimg);
    let k = LoopMount::btrfs_ro(&bimg, &kdir);
    let after = manifest::take(k.path(), &TakeOpts::default());
    let big_ino = fs::metadata(k.path().join("big")).unwrap().ino();
    k.unmount();
    // "big" (5 MiB in 128 KiB writes, each after the kernel's security.capability lookup,
    // which must not write the file's buffer back)
    // gathered in delayed-allocation buffers: two extents (4 MiB and 1 MiB), not one per
    // write; the overwrite in its middle makes up to four more items.
    let items = kernel::dump_tree(&bimg, &["-t", "5"])
        .lines()
        .filter(|l| l.contains(&format!("key ({big_ino} EXTENT_DATA ")))
        .count();
    assert!(
        (2..=6).contains(&items),
        "\"big\" has {items} file extent items:\n{}",
        kernel::dump_tree(&bimg, &["-t", "5"])
    );
    manifest::assert_same(
        &got,
        &after,
        &CompareOpts {
            btime: false,
            inode_numbers: false,
            subvolumes: false,
            ..CompareOpts::all()
        },
        "butter mount vs kernel mount of the image butter wrote",
    );
}

/// (blocks, free blocks) of statvfs.
fn statvfs(dir: &Path) -> (u64, u64) {
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out pointer.
    assert_eq!(unsafe { libc::statvfs(cstr(dir).as_ptr(), &mut st) }, 0);
    (st.f_blocks, st.f_bfree)
}

#[test]
fn one_writer_per_image() {
    if !prerequisites("one_writer_per_image") {
        return;
    }
    let s = ScratchDir::new("fuse-rw-lock");
    let img = s.join("img");
    kernel::mkfs_btrfs(&img, 256 << 20, &[] as &[&str]);
    let d1 = s.dir("m1");
    let d2 = s.dir("m2");
    {
        let b = ButterMount::start(&img, &d1, &[]);
        let out = Command::new(BUTTER)
            .arg("mount")
            .arg(&img)
            .arg(&d2)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "second read-write mount was allowed");
        // Says who holds it and what to do.
        assert!(
            err.contains("open read-write in process")
                && err.contains(&format!("process {}", b.pid()))
                && err.contains("butter unmount"),
            "{err}"
        );
        assert!(!kernel::is_mountpoint(&d2));
        b.unmount();
    }
    // Once the first is gone, the image can be mounted again.
    ButterMount::start(&img, &d2, &[]).unmount();
    {
        let _k = LoopMount::btrfs(&img, &s.dir("k"), "");
        let out = Command::new(BUTTER)
            .arg("mount")
            .arg(&img)
            .arg(&d1)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "mounting a kernel-mounted image was allowed"
        );
        assert!(err.contains("loop") && err.contains("unmount"), "{err}");
        assert!(!kernel::is_mountpoint(&d1));
    }
    kernel::assert_btrfs_check(&img);
}

#[test]
fn sigterm_commits_and_sigkill_keeps_the_last_commit() {
    if !prerequisites("sigterm_commits_and_sigkill_keeps_the_last_commit") {
        return;
    }
    let s = ScratchDir::new("fuse-rw-signals");
    let img = s.join("img");
    kernel::mkfs_btrfs(&img, 256 << 20, &[] as &[&str]);
    let d = s.dir("m");
    let k = s.dir("k");
    // commit=0: no periodic commit; fsync writes the log and the end of the mount commits (close
    // does not, as on the kernel).
    let b = ButterMount::start(&img, &d, &["-o", "commit=0"]);
    fs::write(d.join("closed"), b"committed at fsync").unwrap();
    fs::create_dir(d.join("dir")).unwrap();
    std::os::unix::fs::symlink("closed", d.join("dir/link")).unwrap();
    setxattr(&d.join("dir"), "user.k", b"v");
    let mut open = File::create(d.join("open")).unwrap();
    open.write_all(b"written, not closed").unwrap();
    open.flush().unwrap();
    // Let go of the file first: a busy mount would only be detached.
    drop(open);
    b.signal(libc::SIGTERM);
    let mut b = b;
    let st = b.wait();
    assert!(st.success(), "SIGTERM: exit {st}");
    assert!(!kernel::is_mountpoint(&d));
    drop(b);
    kernel::assert_btrfs_check(&img);
    {
        let km = LoopMount::btrfs_ro(&img, &k);
        assert_eq!(
            fs::read(km.path().join("closed")).unwrap(),
            b"committed at fsync"
        );
        assert_eq!(
            fs::read_link(km.path().join("dir/link")).unwrap(),
            Path::new("closed")
        );
        assert_eq!(
            fs::read(km.path().join("open")).unwrap(),
            b"written, not closed"
        );
        km.unmount();
    }

    // SIGKILL: what came after the last commit is gone, the rest intact. fsync=commit: the
    // fsync commits, so the open unlinked file below is committed as an orphan (with the
    // default fsync log it would not be; fsync_matrix and fuse_crash cover the log).
    let mut b = ButterMount::start(&img, &d, &["-o", "commit=0,fsync=commit"]);
    let f = File::create(d.join("synced")).unwrap();
    (&f).write_all(b"fsynced").unwrap();
    // A file unlinked while open when the writer dies: an orphan the next mount deletes.
    let orphan = File::create(d.join("orphan")).unwrap();
    (&orphan).write_all(&pseudo_random(100_000, 11)).unwrap();
    fs::remove_file(d.join("orphan")).unwrap();
    f.sync_all().unwrap();
    fs::create_dir(d.join("uncommitted")).unwrap();
    (&f).write_all(b" and more").unwrap();
    b.signal(libc::SIGKILL);
    let st = b.wait();
    assert!(!st.success());
    drop(f);
    drop(orphan);
    let _ = Command::new("fusermount3")
        .args(["-u", "-z"])
        .arg(&d)
        .status();
    drop(b);
    butter_check(&img);
    kernel::assert_btrfs_check(&img);
    let orphans = |img: &Path| {
        kernel::dump_tree(img, &["-t", "5"])
            .lines()
            .filter(|l| l.contains("ORPHAN ORPHAN_ITEM"))
            .count()
    };
    assert_eq!(orphans(&img), 1, "the unlinked open file is an orphan");
    ButterMount::start(&img, &d, &[]).unmount();
    assert_eq!(
        orphans(&img),
        0,
        "the next read-write mount deletes orphans"
    );
    butter_check(&img);
    kernel::assert_btrfs_check(&img);
    let km = LoopMount::btrfs_ro(&img, &k);
    assert_eq!(fs::read(km.path().join("synced")).unwrap(), b"fsynced");
    assert!(!km.path().join("uncommitted").exists());
    assert!(km.path().join("dir/link").is_symlink());
    km.unmount();
}

#[test]
fn daemon_returns_when_the_mount_is_usable() {
    if !prerequisites("daemon_returns_when_the_mount_is_usable") {
        return;
    }
    let s = ScratchDir::new("fuse-rw-daemon");
    let img = s.join("img");
    kernel::mkfs_btrfs(&img, 256 << 20, &[] as &[&str]);
    let d = s.dir("m");
    let out = Command::new(BUTTER)
        .args(["mount", "--daemon", "-o", "commit=1"])
        .arg(&img)
        .arg(&d)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "butter mount --daemon: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mounted = kernel::is_mountpoint(&d);
    let wrote = mounted && fs::write(d.join("f"), pseudo_random(300_000, 9)).is_ok();
    let unmounted = fusermount_u(&d);
    assert!(mounted, "not mounted when --daemon returned");
    assert!(wrote, "writing to the daemon's mount failed");
    if let Err(e) = unmounted {
        panic!("fusermount3 -u: {e}");
    }
    // The daemon exits after its final commit, releasing the image lock.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&img)
            .unwrap();
        if f.try_lock().is_ok() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the daemon did not let go of the image"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    butter_check(&img);
    kernel::assert_btrfs_check(&img);
    let km = LoopMount::btrfs_ro(&img, &s.dir("k"));
    assert_eq!(
        fs::read(km.path().join("f")).unwrap(),
        pseudo_random(300_000, 9)
    );
    km.unmount();
    // Failing to mount: the parent reports it.
    let out = Command::new(BUTTER)
        .args(["mount", "--daemon"])
        .arg(s.join("no-such-image"))
        .arg(&d)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!kernel::is_mountpoint(&d));
}

#[test]
fn periodic_commit() {
    if !prerequisites("periodic_commit") {
        return;
    }
    let s = ScratchDir::new("fuse-rw-periodic");
    let img = s.join("img");
    kernel::mkfs_btrfs(&img, 256 << 20, &[] as &[&str]);
    let d = s.dir("m");
    let mut b = ButterMount::start(&img, &d, &["-o", "commit=1"]);
    // Changes no flush or fsync commits: only the periodic commit makes them durable.
    fs::create_dir(d.join("periodic")).unwrap();
    setxattr(&d.join("periodic"), "user.p", b"1");
    std::thread::sleep(Duration::from_millis(3500));
    b.signal(libc::SIGKILL);
    let st = b.wait();
    assert!(!st.success());
    let _ = Command::new("fusermount3")
        .args(["-u", "-z"])
        .arg(&d)
        .status();
    drop(b);
    kernel::assert_btrfs_check(&img);
    let km = LoopMount::btrfs_ro(&img, &s.dir("k"));
    assert!(km.path().join("periodic").is_dir());
    km.unmount();
}

#[test]
fn parallel_writers_and_readers() {
    if !prerequisites("parallel_writers_and_readers") {
        return;
    }
    let s = ScratchDir::new("fuse-rw-parallel");
    let img = s.join("img");
    kernel::mkfs_btrfs(&img, 512 << 20, &[] as &[&str]);
    let d = s.dir("m");
    let b = ButterMount::start(&img, &d, &["-o", "commit=1", "--threads", "4"]);
    let writers: Vec<_> = (0..4u64)
        .map(|t| {
            let dir = d.join(format!("t{t}"));
            std::thread::spawn(move || {
                fs::create_dir(&dir).unwrap();
                for i in 0..60u64 {
                    let data = pseudo_random((i as usize % 7) * 40_000 + 100, t * 1000 + i);
                    let f = dir.join(format!("f{i}"));
                    fs::write(&f, &data).unwrap();
                    assert_eq!(fs::read(&f).unwrap(), data, "t{t} f{i} read back");
                    if i % 5 == 0 {
                        fs::rename(&f, dir.join(format!("r{i}"))).unwrap();
                    }
                    if i % 7 == 3 && (i - 1) % 5 != 0 {
                        fs::remove_file(dir.join(format!("f{}", i - 1))).unwrap();
                    }
                }
            })
        })
        .collect();
    let reader = {
        let d = d.clone();
        std::thread::spawn(move || {
            for _ in 0..30 {
                let _ = manifest::take(&d, &TakeOpts::default());
            }
        })
    };
    for w in writers {
        w.join().expect("writer");
    }
    reader.join().expect("reader");
    let live = manifest::take(&d, &TakeOpts::default());
    assert!(live.errors().is_empty(), "{:?}", live.errors());
    b.unmount();
    butter_check(&img);
    kernel::assert_btrfs_check(&img);
    let km = LoopMount::btrfs_ro(&img, &s.dir("k"));
    let after = manifest::take(km.path(), &TakeOpts::default());
    km.unmount();
    manifest::assert_same(
        &live,
        &after,
        &CompareOpts {
            btime: false,
            inode_numbers: false,
            subvolumes: false,
            ..CompareOpts::all()
        },
        "after parallel writers: FUSE view vs kernel view",
    );
}

/// A slow fsync (a commit that writes back a big file) does not stall reads of other files:
/// opens and reads that reach butter keep completing while the fsync is in flight. (Ordering,
/// not speed: it counts reads that finished in the middle half of the fsync.)
#[test]
fn reads_go_on_during_a_slow_fsync() {
    if !prerequisites("reads_go_on_during_a_slow_fsync") {
        return;
    }
    let s = ScratchDir::new("fuse-rw-slow-fsync");
    let img = s.join("img");
    kernel::mkfs_btrfs(&img, 1 << 30, &[] as &[&str]);
    let d = s.dir("m");
    let b = ButterMount::start(&img, &d, &["-o", "commit=0", "--threads", "4"]);
    let small = d.join("small");
    fs::write(&small, b"small file").unwrap();
    File::open(&small).unwrap().sync_all().unwrap();
    let big = File::create(d.join("big")).unwrap();
    let chunk = pseudo_random(1 << 20, 5);
    for i in 0..300u64 {
        big.write_all_at(&chunk, i << 20).unwrap();
    }
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let stop = stop.clone();
        let small = small.clone();
        std::thread::spawn(move || {
            let mut done = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                // A fresh open each time: on a read-write mount every open reaches butter and
                // starts from an empty page cache, so the read does too.
                let mut v = Vec::new();
                File::open(&small).unwrap().read_to_end(&mut v).unwrap();
                assert_eq!(v, b"small file");
                done.push(Instant::now());
            }
            done
        })
    };
    std::thread::sleep(Duration::from_millis(50));
    let t0 = Instant::now();
    big.sync_all().unwrap();
    let t1 = Instant::now();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let done = reader.join().expect("reader");
    let q = (t1 - t0) / 4;
    let during = done.iter().filter(|t| **t > t0 + q && **t < t1 - q).count();
    assert!(
        during > 0,
        "no read finished during the middle half of a {:?} fsync ({} reads in all)",
        t1 - t0,
        done.len()
    );
    drop(big);
    b.unmount();
    butter_check(&img);
    kernel::assert_btrfs_check(&img);
    let km = LoopMount::btrfs_ro(&img, &s.dir("k"));
    assert_eq!(
        fs::read(km.path().join("big")).unwrap().len(),
        300 << 20,
        "the fsynced file under the kernel"
    );
    km.unmount();
}

/// Physical offsets of every copy of the tree block at `logical`.
fn block_copies(img: &Path, logical: u64) -> Vec<u64> {
    let out = kernel::run(
        Command::new("btrfs-map-logical")
            .args(["-l", &logical.to_string()])
            .arg(img),
    );
    out.split_whitespace()
        .collect::<Vec<_>>()
        .windows(2)
        .filter(|w| w[0] == "physical")
        .filter_map(|w| w[1].parse().ok())
        .collect()
}

#[test]
fn corrupt_metadata_gives_eio_and_stops_changes() {
    if !prerequisites("corrupt_metadata_gives_eio_and_stops_changes") {
        return;
    }
    let s = ScratchDir::new("fuse-rw-corrupt");
    let img = s.join("img");
    kernel::mkfs_btrfs(&img, 256 << 20, &[] as &[&str]);
    let k = s.dir("k");
    {
        let m = LoopMount::btrfs(&img, &k, "");
        fs::create_dir(m.path().join("a")).unwrap();
        for i in 0..1000 {
            fs::write(m.path().join(format!("a/file-with-a-long-name-{i}")), "x").unwrap();
        }
        fs::write(m.path().join("keep"), b"keep").unwrap();
        m.unmount();
    }
    // Damage both copies of a leaf holding only directory index items of "a": names still
    // resolve (DIR_ITEM, inode items elsewhere), but listing "a" and unlinking from it
    // reach the damaged leaf, the unlink after it already changed other items.
    let dump = kernel::dump_tree(&img, &["-t", "5"]);
    let mut leaves: Vec<(u64, bool)> = Vec::new();
    for l in dump.lines() {
        if l.starts_with("leaf ") && l.contains("owner FS_TREE") {
            if let Some(n) = l.split_whitespace().nth(1).and_then(|n| n.parse().ok()) {
                leaves.push((n, true));
            }
        } else if l.trim_start().starts_with("item ") {
            if let Some(last) = leaves.last_mut() {
                last.1 &= l.contains(" key (257 DIR_INDEX ");
            }
        }
    }
    let leaves: Vec<u64> = leaves.iter().filter(|l| l.1).map(|l| l.0).collect();
    assert!(
        !leaves.is_empty(),
        "no leaf of DIR_INDEX items only:\n{dump}"
    );
    let copies = block_copies(&img, leaves[0]);
    assert!(!copies.is_empty());
    let f = OpenOptions::new().write(true).open(&img).unwrap();
    for c in copies {
        f.write_all_at(b"XXXXXXXX", c + 2000).unwrap();
    }
    drop(f);

    let d = s.dir("m");
    let mut b = ButterMount::start(&img, &d, &["-o", "commit=0"]);
    {
        let f = File::create(d.join("before")).unwrap();
        (&f).write_all(b"committed at fsync").unwrap();
        f.sync_all().unwrap();
    }
    assert_eq!(fs::read(d.join("keep")).unwrap(), b"keep");
    let err = fs::read_dir(d.join("a"))
        .unwrap()
        .collect::<Result<Vec<_>, _>>()
        .expect_err("listing a directory with a damaged leaf");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // Unlinking every entry reaches the damaged leaf: EIO, then the mount stops changing.
    let mut failed = None;
    for i in 0..1000 {
        if let Err(e) = fs::remove_file(d.join(format!("a/file-with-a-long-name-{i}"))) {
            failed = Some(e);
            break;
        }
    }
    let e = failed.expect("no unlink met the damaged leaf");
    assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
    let e = fs::write(d.join("after"), b"x").expect_err("a change after the failure");
    assert_eq!(e.raw_os_error(), Some(libc::EROFS), "{e}");
    // Reading still works.
    assert_eq!(fs::read(d.join("before")).unwrap(), b"committed at fsync");
    let out = Command::new("fusermount3")
        .arg("-u")
        .arg(&d)
        .output()
        .unwrap();
    assert!(out.status.success());
    let st = b.wait();
    assert!(
        !st.success(),
        "the dropped changes must show in the exit status"
    );
    drop(b);
    // The image is what the last commit left plus the fsync log: the damage, and "before"
    // once the kernel replayed the log (a read-write mount: replay writes).
    let m = LoopMount::btrfs(&img, &k, "noatime");
    assert_eq!(
        fs::read(m.path().join("before")).unwrap(),
        b"committed at fsync"
    );
    assert!(!m.path().join("after").exists());
    m.unmount();
}
