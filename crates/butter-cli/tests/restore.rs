//! `butter restore` against the real kernel: make an image with mkfs.btrfs, fill it through a
//! loop mount, unmount it, restore it with butter, and compare the result with what the kernel
//! shows of the same image (mounted read-only, so nothing changes its atimes): types, modes,
//! owners, sizes, device numbers, atime/mtime with nanoseconds, symlink targets, hardlink
//! groups, xattrs (ACLs, capabilities, trusted, security, btrfs properties), content and
//! sparseness.
//!
//! These tests need root, loop devices and btrfs-progs. Without them they print a notice and
//! pass, except when the environment variable CI is set: then they fail, so a CI machine that
//! lost its oracle cannot go green silently. Each test uses its own scratch directory, images
//! and loop devices, and releases them (unmount, detach) even when it fails.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");

/// Whether the kernel oracle is usable; panics in CI when it is not.
fn oracle() -> bool {
    let mut missing = Vec::new();
    // SAFETY: geteuid cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root".to_string());
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push("loop devices (/dev/loop-control)".to_string());
    }
    if !fs::read_to_string("/proc/filesystems")
        .map(|s| s.contains("btrfs"))
        .unwrap_or(false)
    {
        missing.push("btrfs in the kernel".to_string());
    }
    for tool in ["mkfs.btrfs", "btrfs", "losetup", "mount", "umount"] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !found {
            missing.push(tool.to_string());
        }
    }
    if missing.is_empty() {
        return true;
    }
    let msg = format!("restore oracle tests need {}", missing.join(", "));
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; CI is set, so this is a failure, not a skip");
    }
    eprintln!("notice: skipping: {msg}");
    false
}

fn run(cmd: &str, args: &[&str]) -> String {
    let o = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        o.status.success(),
        "{cmd} {args:?} failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn butter(args: &[&str]) -> Output {
    Command::new(BUTTER)
        .args(args)
        .output()
        .expect("run butter")
}

fn ok(o: &Output) -> &Output {
    assert!(
        o.status.success(),
        "butter failed: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// A scratch directory with the mounts and loop devices made in it; all released on drop.
struct Scratch {
    dir: PathBuf,
    /// (mount point, loop device), in mount order.
    mounts: Vec<(PathBuf, String)>,
}

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir =
            std::env::temp_dir().join(format!("butter-restore-test-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Scratch {
            dir,
            mounts: Vec::new(),
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.join(p)
    }

    /// A fresh sparse image file formatted with mkfs.btrfs.
    fn image(&self, name: &str, mib: u64) -> PathBuf {
        let img = self.path(name);
        fs::File::create(&img).unwrap().set_len(mib << 20).unwrap();
        run("mkfs.btrfs", &["-q", "-f", img.to_str().unwrap()]);
        img
    }

    fn mount(&mut self, img: &Path, mnt: &Path, opts: &str) {
        fs::create_dir_all(mnt).unwrap();
        // Attach the loop device ourselves so that detaching is synchronous (btrfs-progs and
        // later mounts then see the image as free). Another test may take the same free
        // device at the same moment: retry.
        let mut dev = String::new();
        for _ in 0..5 {
            let o = Command::new("losetup")
                .args(["-f", "--show", img.to_str().unwrap()])
                .output()
                .unwrap();
            if o.status.success() {
                dev = String::from_utf8_lossy(&o.stdout).trim().to_string();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        assert!(!dev.is_empty(), "losetup failed for {}", img.display());
        let o = Command::new("mount")
            .args(["-t", "btrfs", "-o", opts, &dev, mnt.to_str().unwrap()])
            .output()
            .unwrap();
        if !o.status.success() {
            let _ = Command::new("losetup").args(["-d", &dev]).output();
            panic!("mount failed: {}", String::from_utf8_lossy(&o.stderr));
        }
        self.mounts.push((mnt.to_path_buf(), dev));
    }

    fn umount(&mut self, mnt: &Path) {
        let i = self
            .mounts
            .iter()
            .position(|(m, _)| m == mnt)
            .expect("not mounted");
        let (m, dev) = self.mounts.remove(i);
        run("umount", &[m.to_str().unwrap()]);
        run("losetup", &["-d", &dev]);
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        while let Some((m, dev)) = self.mounts.pop() {
            let ok = Command::new("umount")
                .arg(&m)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                let _ = Command::new("umount").arg("-l").arg(&m).status();
            }
            let _ = Command::new("losetup").args(["-d", &dev]).status();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

// ---- populating through the kernel ----

fn c(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn check(r: libc::c_int, what: &str, p: &Path) {
    assert!(
        r >= 0,
        "{what} {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

fn setxattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).unwrap();
    // SAFETY: valid strings and a live slice.
    let r = unsafe {
        libc::lsetxattr(
            c(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    check(r, &format!("setxattr {name}"), p);
}

fn mknod(p: &Path, mode: u32, major: u32, minor: u32) {
    // SAFETY: valid path.
    let r = unsafe { libc::mknod(c(p).as_ptr(), mode, libc::makedev(major, minor)) };
    check(r, "mknod", p);
}

fn lchown(p: &Path, uid: u32, gid: u32) {
    // SAFETY: valid path.
    check(
        unsafe { libc::lchown(c(p).as_ptr(), uid, gid) },
        "lchown",
        p,
    );
}

fn chmod(p: &Path, mode: u32) {
    fs::set_permissions(p, fs::Permissions::from_mode(mode)).unwrap();
}

fn set_times(p: &Path, a: (i64, i64), m: (i64, i64)) {
    // SAFETY: timespec is plain data.
    let mut t: [libc::timespec; 2] = unsafe { std::mem::zeroed() };
    t[0].tv_sec = a.0 as _;
    t[0].tv_nsec = a.1 as _;
    t[1].tv_sec = m.0 as _;
    t[1].tv_nsec = m.1 as _;
    // SAFETY: valid path and two timespecs.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c(p).as_ptr(),
            t.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    check(r, "utimensat", p);
}

fn fallocate(p: &Path, mode: i32, off: i64, len: i64) {
    let f = fs::OpenOptions::new().write(true).open(p).unwrap();
    // SAFETY: open descriptor.
    let r = unsafe { libc::fallocate(std::os::unix::io::AsRawFd::as_raw_fd(&f), mode, off, len) };
    check(r, "fallocate", p);
}

/// Deterministic incompressible bytes.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

fn write_at(p: &Path, off: u64, data: &[u8]) {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(p)
        .unwrap();
    f.seek(SeekFrom::Start(off)).unwrap();
    f.write_all(data).unwrap();
}

/// A POSIX ACL xattr value: (tag, perm, id) entries in the kernel's order.
fn acl(entries: &[(u16, u16, u32)]) -> Vec<u8> {
    let mut v = 2u32.to_le_bytes().to_vec();
    for (tag, perm, id) in entries {
        v.extend_from_slice(&tag.to_le_bytes());
        v.extend_from_slice(&perm.to_le_bytes());
        v.extend_from_slice(&id.to_le_bytes());
    }
    v
}
const NOID: u32 = u32::MAX;

/// Every kind of inode restore handles, with the metadata it must keep.
fn populate(m: &Path) {
    let p = |s: &str| m.join(s);
    fs::create_dir_all(p("d1/d2/d3")).unwrap();
    fs::write(p("d1/d2/d3/deep"), b"deep\n").unwrap();
    fs::write(p("small"), b"abc").unwrap(); // inline extent
    fs::write(p("empty"), b"").unwrap();
    fs::write(p("medium"), noise(1, 100_000)).unwrap();
    // Crosses 1 MiB read chunks and ends mid-sector.
    fs::write(p("big"), noise(2, 3 * 1048576 + 123)).unwrap();
    // Sparse: two islands of data, holes around them, length not sector aligned.
    write_at(&p("sparse"), 409_600, &noise(3, 4096));
    write_at(&p("sparse"), 5 << 20, &noise(4, 10_000));
    fs::OpenOptions::new()
        .write(true)
        .open(p("sparse"))
        .unwrap()
        .set_len((10 << 20) + 77)
        .unwrap();
    fs::File::create(p("hole_only"))
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    // Zeros written as data: restored as a hole.
    fs::write(p("zeros"), vec![0u8; 65536]).unwrap();
    // Preallocated, inside the size and beyond it.
    fs::write(p("prealloc"), b"").unwrap();
    fallocate(&p("prealloc"), 0, 0, 1 << 20);
    fs::write(p("prealloc_keep"), b"0123456789").unwrap();
    fallocate(&p("prealloc_keep"), libc::FALLOC_FL_KEEP_SIZE, 0, 256 << 10);

    std::os::unix::fs::symlink("d1/d2/d3/deep", p("sym")).unwrap();
    std::os::unix::fs::symlink("/nonexistent/absolute", p("dangling")).unwrap();
    std::os::unix::fs::symlink("x".repeat(1000), p("longlink")).unwrap();
    lchown(&p("sym"), 1234, 5678);
    setxattr(&p("sym"), "trusted.onlink", b"lv");

    fs::write(p("h1"), b"linked\n").unwrap();
    fs::hard_link(p("h1"), p("h2")).unwrap();
    fs::hard_link(p("h1"), p("d1/h3")).unwrap();

    mknod(&p("null"), libc::S_IFCHR | 0o666, 1, 3);
    mknod(&p("sdb1"), libc::S_IFBLK | 0o660, 8, 17);
    mknod(&p("bigdev"), libc::S_IFCHR | 0o600, 300, 70000);
    mknod(&p("fifo"), libc::S_IFIFO | 0o644, 0, 0);
    mknod(&p("sock"), libc::S_IFSOCK | 0o755, 0, 0);

    // setuid with a file capability: lchown would clear both if done after them.
    fs::write(p("suid"), b"#!/bin/true\n").unwrap();
    lchown(&p("suid"), 1000, 1000);
    chmod(&p("suid"), 0o4755);
    let mut cap = (0x0200_0000u32 | 1).to_le_bytes().to_vec();
    for w in [1u32 << 10, 0, 0, 0] {
        cap.extend_from_slice(&w.to_le_bytes());
    }
    setxattr(&p("suid"), "security.capability", &cap);
    fs::write(p("sgid"), b"").unwrap();
    lchown(&p("sgid"), 0, 100);
    chmod(&p("sgid"), 0o2750);
    fs::create_dir(p("sticky")).unwrap();
    chmod(&p("sticky"), 0o1777);
    fs::write(p("noperm"), b"secret").unwrap();
    chmod(&p("noperm"), 0o000);
    // A read-only directory with content: its mode must come after its children.
    fs::create_dir(p("rodir")).unwrap();
    fs::write(p("rodir/inside"), b"in").unwrap();
    chmod(&p("rodir"), 0o555);
    fs::write(p("owned"), b"o").unwrap();
    lchown(&p("owned"), 4242, 4343);

    setxattr(&p("d1/d2/d3/deep"), "user.a", b"hello");
    setxattr(&p("d1/d2/d3/deep"), "user.empty", b"");
    setxattr(&p("d1/d2/d3/deep"), "user.bin", &[0, 1, 2, 255, 0]);
    setxattr(&p("d1/d2/d3/deep"), "trusted.t", b"tv");
    setxattr(&p("d1/d2/d3/deep"), "security.s", b"sv");
    setxattr(&p("medium"), "user.long", &noise(5, 3000));
    setxattr(&p("d1"), "user.dir", b"dv");
    setxattr(&p("fifo"), "trusted.onfifo", b"f");
    // ACLs: an access ACL on a file, access and default ACLs on a directory.
    let file_acl = acl(&[
        (1, 6, NOID),
        (2, 4, 1234),
        (4, 4, NOID),
        (0x10, 6, NOID),
        (0x20, 0, NOID),
    ]);
    setxattr(&p("owned"), "system.posix_acl_access", &file_acl);
    fs::create_dir(p("acldir")).unwrap();
    let dir_acl = acl(&[
        (1, 7, NOID),
        (2, 5, 1234),
        (4, 5, NOID),
        (0x10, 7, NOID),
        (0x20, 5, NOID),
    ]);
    setxattr(&p("acldir"), "system.posix_acl_access", &dir_acl);
    setxattr(&p("acldir"), "system.posix_acl_default", &dir_acl);
    // Created under the default ACL: the kernel decides what it inherits.
    fs::write(p("acldir/child"), b"c").unwrap();
    // A btrfs property (an xattr in the btrfs. namespace), set after the data.
    setxattr(&p("medium"), "btrfs.compression", b"zstd");

    // More entries than restore reads per readdir call.
    fs::create_dir(p("many")).unwrap();
    for i in 0..4500 {
        fs::write(p(&format!("many/f{i:05}")), format!("{i}")).unwrap();
    }

    // Subvolumes: one at the top, one nested in it, one in a directory; a snapshot of the
    // first (the nested one shows as an empty directory in the snapshot), and a change after.
    let ms = m.to_str().unwrap();
    run(
        "btrfs",
        &["-q", "subvolume", "create", &format!("{ms}/sub")],
    );
    fs::write(p("sub/x"), b"in sub\n").unwrap();
    fs::create_dir(p("sub/sd")).unwrap();
    fs::write(p("sub/sd/y"), noise(6, 20_000)).unwrap();
    fs::write(p("sub/hl"), b"hl").unwrap();
    fs::hard_link(p("sub/hl"), p("sub/sd/hl2")).unwrap();
    run(
        "btrfs",
        &["-q", "subvolume", "create", &format!("{ms}/sub/inner")],
    );
    fs::write(p("sub/inner/z"), b"inner\n").unwrap();
    run(
        "btrfs",
        &[
            "-q",
            "subvolume",
            "snapshot",
            &format!("{ms}/sub"),
            &format!("{ms}/snap"),
        ],
    );
    fs::write(p("sub/x"), b"changed after the snapshot\n").unwrap();
    run(
        "btrfs",
        &["-q", "subvolume", "create", &format!("{ms}/d1/nested")],
    );
    fs::write(p("d1/nested/n"), b"n").unwrap();

    // Distinct atime/mtime with nanoseconds everywhere, children before their directories.
    let mut all = Vec::new();
    collect(m, Path::new(""), &mut all);
    all.reverse();
    for (i, rel) in all.iter().enumerate() {
        let path = m.join(rel);
        if fs::symlink_metadata(&path).unwrap().ino() == 2 {
            continue; // the snapshot's stand-in for a nested subvolume: not settable
        }
        let i = i as i64;
        set_times(
            &path,
            (1_000_000_000 + i * 1000, (i * 7919 + 1) % 1_000_000_000),
            (900_000_000 + i * 1000, (i * 104_729 + 13) % 1_000_000_000),
        );
    }
}

/// Relative paths in pre-order (a directory before its entries), sorted by name.
fn collect(root: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
    out.push(rel.to_path_buf());
    let p = root.join(rel);
    if fs::symlink_metadata(&p).unwrap().is_dir() {
        let mut names: Vec<_> = fs::read_dir(&p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for n in names {
            collect(root, &rel.join(n), out);
        }
    }
}

// ---- comparing two trees ----

#[derive(Debug, PartialEq)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    /// None for directories unless both sides are btrfs.
    size: Option<u64>,
    /// Non-directories only.
    nlink: Option<u64>,
    rdev: (u32, u32),
    atime: (i64, i64),
    /// None for the kernel's empty stand-in directory (its mtime is the lookup time).
    mtime: Option<(i64, i64)>,
    /// First path of the same inode (hardlinks).
    same_as: Option<String>,
    xattrs: BTreeMap<Vec<u8>, Vec<u8>>,
}

struct Tree {
    meta: BTreeMap<String, Meta>,
    blocks: BTreeMap<String, u64>,
    /// Kernel's stand-in directories (inode 2).
    stubs: BTreeSet<String>,
}

fn xattrs(p: &Path) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let cp = c(p);
    let mut out = BTreeMap::new();
    let mut names = vec![0u8; 65536];
    // SAFETY: buffer pointer and length describe a live buffer.
    let n = unsafe { libc::llistxattr(cp.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert!(n >= 0, "llistxattr {}", p.display());
    for name in names[..n as usize]
        .split(|&b| b == 0)
        .filter(|n| !n.is_empty())
    {
        let cn = CString::new(name).unwrap();
        let mut v = vec![0u8; 65536];
        // SAFETY: as above.
        let len =
            unsafe { libc::lgetxattr(cp.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        assert!(len >= 0, "lgetxattr {} {:?}", p.display(), cn);
        v.truncate(len as usize);
        out.insert(name.to_vec(), v);
    }
    out
}

/// Metadata of every entry under `root`. Each directory is stat'ed before it is listed and
/// nothing is read, so atimes are seen as they were even on a read-write target.
fn scan(root: &Path, dir_sizes: bool) -> Tree {
    let mut t = Tree {
        meta: BTreeMap::new(),
        blocks: BTreeMap::new(),
        stubs: BTreeSet::new(),
    };
    let mut first_of: BTreeMap<(u64, u64), String> = BTreeMap::new();
    scan_at(root, Path::new(""), dir_sizes, &mut t, &mut first_of);
    t
}

fn scan_at(
    root: &Path,
    rel: &Path,
    dir_sizes: bool,
    t: &mut Tree,
    first_of: &mut BTreeMap<(u64, u64), String>,
) {
    let p = root.join(rel);
    let md = fs::symlink_metadata(&p).unwrap();
    let key = rel.to_string_lossy().into_owned();
    let dir = md.is_dir();
    let same_as = if !dir && md.nlink() > 1 {
        Some(
            first_of
                .entry((md.dev(), md.ino()))
                .or_insert(key.clone())
                .clone(),
        )
    } else {
        None
    };
    if dir && md.ino() == 2 {
        t.stubs.insert(key.clone());
    }
    let rdev = md.rdev();
    t.meta.insert(
        key.clone(),
        Meta {
            mode: md.mode(),
            uid: md.uid(),
            gid: md.gid(),
            size: (!dir || dir_sizes).then_some(md.size()),
            nlink: (!dir).then_some(md.nlink()),
            rdev: (libc::major(rdev), libc::minor(rdev)),
            atime: (md.atime(), md.atime_nsec()),
            mtime: Some((md.mtime(), md.mtime_nsec())),
            same_as,
            xattrs: xattrs(&p),
        },
    );
    if md.is_file() {
        t.blocks.insert(key, md.blocks());
    }
    if dir {
        let mut names: Vec<_> = fs::read_dir(&p)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        names.sort();
        for n in names {
            scan_at(root, &rel.join(n), dir_sizes, t, first_of);
        }
    }
}

fn same_content(a: &Path, b: &Path) -> bool {
    let (mut fa, mut fb) = (fs::File::open(a).unwrap(), fs::File::open(b).unwrap());
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    loop {
        let na = read_full(&mut fa, &mut ba);
        let nb = read_full(&mut fb, &mut bb);
        if na != nb || ba[..na] != bb[..nb] {
            return false;
        }
        if na == 0 {
            return true;
        }
    }
}

fn read_full(f: &mut fs::File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

/// Asserts that `restored` shows what the kernel shows at `kernel`; returns both scans.
fn assert_same_tree(kernel: &Path, restored: &Path, dir_sizes: bool) -> (Tree, Tree) {
    let mut k = scan(kernel, dir_sizes);
    let mut r = scan(restored, dir_sizes);
    for s in k.stubs.clone() {
        for t in [&mut k, &mut r] {
            if let Some(m) = t.meta.get_mut(&s) {
                m.mtime = None;
            }
        }
    }
    let kk: Vec<_> = k.meta.keys().collect();
    let rk: Vec<_> = r.meta.keys().collect();
    assert_eq!(kk, rk, "different sets of paths");
    for (path, km) in &k.meta {
        assert_eq!(Some(km), r.meta.get(path), "metadata of {path:?} differs");
    }
    // Reading after all metadata was taken (a read may change atimes on the restored side).
    for path in k.meta.keys() {
        let (a, b) = (kernel.join(path), restored.join(path));
        let ma = fs::symlink_metadata(&a).unwrap();
        if ma.file_type().is_symlink() {
            assert_eq!(
                fs::read_link(&a).unwrap(),
                fs::read_link(&b).unwrap(),
                "{path}"
            );
        } else if ma.is_file() {
            assert!(same_content(&a, &b), "content of {path:?} differs");
        }
    }
    (k, r)
}

fn count_lines(s: &str, needle: &str) -> usize {
    s.lines().filter(|l| l.contains(needle)).count()
}

/// Everything at once: restored into a second btrfs so that directory sizes, properties and
/// allocation compare exactly.
#[test]
fn round_trip_every_kind_of_inode() {
    if !oracle() {
        return;
    }
    let mut s = Scratch::new("all");
    let img = s.image("src.img", 512);
    let dst = s.image("dst.img", 512);
    let (src_mnt, dst_mnt) = (s.path("src"), s.path("dst"));
    s.mount(&img, &src_mnt, "rw");
    populate(&src_mnt);
    s.umount(&src_mnt);

    s.mount(&dst, &dst_mnt, "rw");
    let o = butter(&[
        "restore",
        img.to_str().unwrap(),
        dst_mnt.to_str().unwrap(),
        "-v",
    ]);
    ok(&o);
    let listed = String::from_utf8_lossy(&o.stdout);
    assert!(listed.lines().any(|l| l == "d1/d2/d3/deep"), "{listed}");
    run("mount", &["-o", "remount,ro", dst_mnt.to_str().unwrap()]);
    s.mount(&img, &src_mnt, "ro");

    let (k, r) = assert_same_tree(&src_mnt, &dst_mnt, true);

    // Sparse files stay sparse; preallocated space stays allocated; written zeros become a hole.
    for f in [
        "sparse",
        "hole_only",
        "big",
        "medium",
        "prealloc",
        "prealloc_keep",
    ] {
        assert_eq!(k.blocks[f], r.blocks[f], "allocated blocks of {f}");
    }
    assert_eq!(k.blocks["hole_only"], 0);
    assert!(k.blocks["sparse"] <= 64, "{}", k.blocks["sparse"]);
    assert_eq!(r.blocks["zeros"], 0);
    // A snapshot's copy of a file is a copy, not a hardlink to the source's.
    let md = |p: &str| fs::symlink_metadata(dst_mnt.join(p)).unwrap();
    assert_ne!(md("sub/sd/y").ino(), md("snap/sd/y").ino());
    assert_eq!(md("sub/hl").ino(), md("sub/sd/hl2").ino());
    assert!(k.stubs.contains("snap/inner"), "{:?}", k.stubs);
}

/// --subvol, --subvol-id, --no-subvols, --dry-run, refusing a non-empty target, --force.
#[test]
fn subvolume_selection_and_options() {
    if !oracle() {
        return;
    }
    let mut s = Scratch::new("opts");
    let img = s.image("src.img", 256);
    let mnt = s.path("mnt");
    s.mount(&img, &mnt, "rw");
    let ms = mnt.to_str().unwrap().to_string();
    fs::write(mnt.join("top"), b"top\n").unwrap();
    fs::create_dir(mnt.join("dir")).unwrap();
    fs::write(mnt.join("dir/f"), noise(7, 5000)).unwrap();
    run(
        "btrfs",
        &["-q", "subvolume", "create", &format!("{ms}/dir/sub")],
    );
    fs::write(mnt.join("dir/sub/a"), b"a\n").unwrap();
    setxattr(&mnt.join("dir/sub/a"), "user.x", b"y");
    run(
        "btrfs",
        &["-q", "subvolume", "create", &format!("{ms}/dir/sub/inner")],
    );
    fs::write(mnt.join("dir/sub/inner/b"), b"b\n").unwrap();
    run(
        "btrfs",
        &[
            "-q",
            "subvolume",
            "snapshot",
            "-r",
            &format!("{ms}/dir/sub"),
            &format!("{ms}/snap"),
        ],
    );
    let snap_id = run(
        "btrfs",
        &["inspect-internal", "rootid", &format!("{ms}/snap")],
    );
    let snap_id = snap_id.trim().to_string();
    s.umount(&mnt);
    s.mount(&img, &mnt, "ro");
    let imgs = img.to_str().unwrap();

    // Dry run: lists, creates nothing.
    let out = s.path("out-dry");
    let o = butter(&["restore", "--dry-run", imgs, out.to_str().unwrap()]);
    ok(&o);
    let listed = String::from_utf8_lossy(&o.stdout);
    assert!(!out.exists(), "dry run created the target");
    for want in ["dir/sub/inner/b", "snap/inner", "dir/f", "top"] {
        assert_eq!(count_lines(&listed, want), 1, "{want} in:\n{listed}");
    }

    // --subvol: a subvolume by path, with its nested subvolume.
    let out = s.path("out-sub");
    ok(&butter(&[
        "restore",
        "--subvol",
        "dir/sub",
        imgs,
        out.to_str().unwrap(),
    ]));
    assert_same_tree(&mnt.join("dir/sub"), &out, false);

    // --subvol-id: the snapshot, where the nested subvolume is an empty directory.
    let out = s.path("out-snap");
    ok(&butter(&[
        "restore",
        "--subvol-id",
        &snap_id,
        imgs,
        out.to_str().unwrap(),
    ]));
    let (k, _) = assert_same_tree(&mnt.join("snap"), &out, false);
    assert!(k.stubs.contains("inner"));
    assert_eq!(fs::read_dir(out.join("inner")).unwrap().count(), 0);

    // --no-subvols: the default subvolume without what hangs below it.
    let out = s.path("out-nosub");
    ok(&butter(&[
        "restore",
        "--no-subvols",
        imgs,
        out.to_str().unwrap(),
    ]));
    assert!(out.join("dir/f").exists());
    assert!(!out.join("dir/sub").exists() && !out.join("snap").exists());

    // A non-empty target is refused without --force, and left alone.
    let out = s.path("out-force");
    fs::create_dir_all(&out).unwrap();
    fs::write(out.join("mine"), b"keep").unwrap();
    fs::write(out.join("top"), b"stale content, to be replaced").unwrap();
    let o = butter(&["restore", imgs, out.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("not empty"));
    assert_eq!(
        fs::read(out.join("top")).unwrap(),
        b"stale content, to be replaced"
    );
    ok(&butter(&[
        "restore",
        "--force",
        imgs,
        out.to_str().unwrap(),
    ]));
    assert_eq!(fs::read(out.join("mine")).unwrap(), b"keep");
    assert_eq!(fs::read(out.join("top")).unwrap(), b"top\n");
    assert_eq!(fs::read(out.join("dir/sub/inner/b")).unwrap(), b"b\n");
    // Restoring again over itself with --force works too.
    ok(&butter(&[
        "restore",
        "--force",
        imgs,
        out.to_str().unwrap(),
    ]));

    // Another default subvolume: restored by default, as a plain mount shows it; the top level
    // is still reachable by path.
    s.umount(&mnt);
    s.mount(&img, &mnt, "rw");
    let sub_id = run(
        "btrfs",
        &["inspect-internal", "rootid", &format!("{ms}/dir/sub")],
    );
    run("btrfs", &["subvolume", "set-default", sub_id.trim(), &ms]);
    s.umount(&mnt);
    s.mount(&img, &mnt, "ro");
    let out = s.path("out-default");
    ok(&butter(&["restore", imgs, out.to_str().unwrap()]));
    assert_same_tree(&mnt, &out, false);
    assert!(out.join("inner/b").exists());
    let out = s.path("out-top");
    ok(&butter(&[
        "restore",
        "--subvol",
        "/",
        "--no-subvols",
        imgs,
        out.to_str().unwrap(),
    ]));
    assert_eq!(fs::read(out.join("top")).unwrap(), b"top\n");

    // A path that is not there is an error, not a panic.
    let o = butter(&[
        "restore",
        "--subvol",
        "nope",
        imgs,
        s.path("x").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("nope"));
}

/// A file whose data fails its checksum is reported, the rest is restored, the readable
/// sectors of the damaged file are saved, and the exit status says so.
#[test]
fn damaged_file_is_reported_and_the_rest_restored() {
    if !oracle() {
        return;
    }
    let mut s = Scratch::new("damage");
    let img = s.image("src.img", 256);
    let mnt = s.path("mnt");
    s.mount(&img, &mnt, "rw");
    let good = noise(8, 50_000);
    fs::write(mnt.join("good1"), &good).unwrap();
    let mut bad = Vec::new();
    for i in 0..32 {
        let mut sector = format!("DAMAGE-SECTOR-{i:04}-").into_bytes();
        sector.extend_from_slice(&noise(100 + i, 4096 - sector.len()));
        bad.extend_from_slice(&sector);
    }
    fs::create_dir(mnt.join("d")).unwrap();
    fs::write(mnt.join("d/bad"), &bad).unwrap();
    fs::write(mnt.join("good2"), b"second good file\n").unwrap();
    s.umount(&mnt);

    // Find sector 5 of d/bad in the image (data is SINGLE: one copy) and overwrite it.
    let marker = b"DAMAGE-SECTOR-0005-";
    let mut f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&img)
        .unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut pos = 0u64;
    let mut found = None;
    loop {
        let n = read_full(&mut f, &mut buf);
        if n == 0 {
            break;
        }
        if let Some(i) = (0..n).step_by(4096).find(|&i| buf[i..].starts_with(marker)) {
            found = Some(pos + i as u64);
            break;
        }
        pos += n as u64;
    }
    let at = found.expect("sector 5 of d/bad not found in the image");
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&[0xAA; 4096]).unwrap();
    drop(f);

    let out = s.path("out");
    let o = butter(&["restore", img.to_str().unwrap(), out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{err}");
    assert!(err.contains("d/bad"), "{err}");
    assert!(err.contains("restored 4 files, 1 errors"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(fs::read(out.join("good1")).unwrap(), good);
    assert_eq!(fs::read(out.join("good2")).unwrap(), b"second good file\n");
    let got = fs::read(out.join("d/bad")).unwrap();
    assert_eq!(got.len(), bad.len());
    let mut want = bad.clone();
    want[5 * 4096..6 * 4096].fill(0);
    assert!(
        got == want,
        "damaged file: readable sectors not saved as they were"
    );
}
