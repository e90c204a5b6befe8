//! `butter mount` against the kernel's btrfs: build an image through a kernel mount, then
//! mount it read-only twice, by the kernel and by butter, and compare everything a program can
//! see (stat fields, directory order, symlinks, contents, xattrs), plus statfs, the xattr
//! size-probe semantics, readdir cookies, stable inode numbers, subvolume mounts, errors on
//! damaged data, and the ways a mount ends (signals, external unmount, busy mount).
//!
//! Needs root, /dev/fuse, loop devices and mkfs.btrfs. Without them the tests print a notice
//! and pass, unless the environment variable CI is set: then they fail. Every mount is undone
//! by a guard's Drop, also when an assertion fails. Each test has its own scratch directory
//! under the system temp dir and at most one loop device.

use std::collections::{BTreeMap, HashMap};
use std::ffi::{CString, OsStr};
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const IMAGE_SIZE: u64 = 256 << 20;

// ---------------------------------------------------------------------------------------------
// Environment and guards

/// True when this machine can run the tests; otherwise a notice (or a failure under CI).
fn prerequisites(test: &str) -> bool {
    let mut missing = Vec::new();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        missing.push("root");
    }
    if !Path::new("/dev/fuse").exists() {
        missing.push("/dev/fuse");
    }
    if !Path::new("/dev/loop-control").exists() {
        missing.push("loop devices");
    }
    if Command::new("mkfs.btrfs")
        .arg("--version")
        .output()
        .is_err()
    {
        missing.push("mkfs.btrfs");
    }
    if Command::new("btrfs").arg("--version").output().is_err() {
        missing.push("btrfs-progs");
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

fn run(cmd: &str, args: &[&dyn AsRef<OsStr>]) -> String {
    let out = Command::new(cmd)
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap_or_else(|e| panic!("running {cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {:?} failed ({}): {}",
        args.iter().map(|a| a.as_ref()).collect::<Vec<_>>(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The file system type mounted on `dir`, if any (from /proc/self/mountinfo).
fn mounted_type(dir: &Path) -> Option<String> {
    let info = fs::read_to_string("/proc/self/mountinfo").ok()?;
    let want = dir.to_str()?;
    let mut found = None;
    for line in info.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let Some(sep) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        if fields.get(4) == Some(&want) {
            found = fields.get(sep + 1).map(|s| s.to_string());
        }
    }
    found
}

fn unmount_retrying(dir: &Path) {
    for _ in 0..50 {
        if mounted_type(dir).is_none() {
            return;
        }
        let _ = Command::new("umount")
            .arg(dir)
            .stderr(Stdio::null())
            .status();
        if mounted_type(dir).is_none() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = Command::new("umount").arg("-l").arg(dir).status();
}

/// A scratch directory, removed last (declare it first).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Scratch {
        let dir = std::env::temp_dir().join(format!("butter-mount-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        Scratch(dir)
    }
    fn path(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
    fn mkdir(&self, p: &str) -> PathBuf {
        let d = self.path(p);
        fs::create_dir_all(&d).unwrap();
        d
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // Only if nothing is mounted below it any more.
        let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if !info.contains(self.0.to_str().unwrap_or("\0")) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

/// A kernel mount (loop device attached by mount, detached with it).
struct KernelMount(PathBuf);

impl KernelMount {
    fn new(image: &Path, dir: &Path, opts: &str) -> KernelMount {
        run("mount", &[&"-o", &format!("loop,{opts}"), &image, &dir]);
        KernelMount(dir.to_path_buf())
    }
}

impl Drop for KernelMount {
    fn drop(&mut self) {
        unmount_retrying(&self.0);
    }
}

/// A running `butter mount`; unmounted and reaped on drop.
struct ButterMount {
    child: Option<Child>,
    dir: PathBuf,
    log: PathBuf,
}

impl ButterMount {
    fn start(image: &Path, dir: &Path, extra: &[&str]) -> ButterMount {
        let log = dir.with_extension("log");
        let child = Command::new(BUTTER)
            .arg("mount")
            .args(extra)
            .arg(image)
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).unwrap())
            .spawn()
            .expect("starting butter mount");
        let mut m = ButterMount {
            child: Some(child),
            dir: dir.to_path_buf(),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if mounted_type(dir).as_deref() == Some("fuse.butter") {
                return m;
            }
            if let Some(st) = m.child.as_mut().unwrap().try_wait().unwrap() {
                panic!(
                    "butter mount exited ({st}) before mounting: {}",
                    m.log_text()
                );
            }
            assert!(
                Instant::now() < deadline,
                "butter mount did not mount in time"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, sig: i32) {
        let pid = self.child.as_ref().unwrap().id() as i32;
        // SAFETY: plain kill(2) on our own child.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
    }

    /// Waits for the process to end by itself.
    fn wait(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        let child = self.child.as_mut()?;
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                self.child = None;
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().unwrap().is_none(),
            None => false,
        }
    }
}

impl Drop for ButterMount {
    fn drop(&mut self) {
        if mounted_type(&self.dir).as_deref() == Some("fuse.butter") {
            unmount_retrying(&self.dir);
        }
        if self.wait(Duration::from_secs(10)).is_none() {
            if let Some(mut c) = self.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}

fn mkfs(image: &Path) {
    let f = File::create(image).unwrap();
    f.set_len(IMAGE_SIZE).unwrap();
    drop(f);
    run("mkfs.btrfs", &[&"-q", &"-f", &image]);
}

// ---------------------------------------------------------------------------------------------
// Making the test tree (through the kernel)

fn cstr(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

fn last_errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

fn pseudo_random(len: usize, mut seed: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        v.extend_from_slice(&seed.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn setxattr(p: &Path, name: &str, value: &[u8]) {
    let n = CString::new(name).unwrap();
    // SAFETY: valid C strings and a buffer of the given length.
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
        last_errno()
    );
}

fn mknod(p: &Path, mode: u32, major: u32, minor: u32) {
    // SAFETY: a valid C string.
    let r = unsafe { libc::mknod(cstr(p).as_ptr(), mode, libc::makedev(major, minor)) };
    assert_eq!(r, 0, "mknod {}: errno {}", p.display(), last_errno());
}

fn set_times(p: &Path, atime: (i64, i64), mtime: (i64, i64)) {
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
    // SAFETY: a valid C string and two timespecs.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            cstr(p).as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    assert_eq!(r, 0, "utimensat {}: errno {}", p.display(), last_errno());
}

/// Fills a freshly made filesystem mounted read-write at `m`. Returns the id of subvolume
/// "sub".
fn populate(m: &Path) -> u64 {
    let p = |s: &str| m.join(s);
    fs::create_dir_all(p("d1/d2/d3")).unwrap();
    fs::create_dir(p("empty")).unwrap();
    fs::write(p("small"), b"hello\n").unwrap(); // inline extent
    fs::write(p("d1/f5000"), pseudo_random(5000, 1)).unwrap();
    fs::write(p("big"), pseudo_random(3_000_000, 2)).unwrap();
    fs::write(p("zero"), b"").unwrap();
    // Sparse: holes before, between and after two written ranges.
    let f = File::create(p("sparse")).unwrap();
    f.set_len(10 << 20).unwrap();
    f.write_all_at(&pseudo_random(12288, 3), 400 << 10).unwrap();
    f.write_all_at(b"tail", (10 << 20) - 4).unwrap();
    drop(f);
    // Preallocated (reads as zeros) beyond some real data.
    let mut f = File::create(p("prealloc")).unwrap();
    f.write_all(&pseudo_random(10000, 4)).unwrap();
    // SAFETY: a valid open descriptor.
    let r = unsafe { libc::fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, 0, 1 << 20) };
    assert_eq!(r, 0, "fallocate: errno {}", last_errno());
    drop(f);
    std::os::unix::fs::symlink("small", p("sl")).unwrap();
    std::os::unix::fs::symlink("x".repeat(1000), p("longsl")).unwrap();
    std::os::unix::fs::symlink("/nowhere/at/all", p("d1/dangling")).unwrap();
    fs::hard_link(p("big"), p("d1/big.link")).unwrap();
    fs::hard_link(p("small"), p("d1/d2/d3/small.link")).unwrap();
    mknod(&p("fifo"), libc::S_IFIFO | 0o640, 0, 0);
    mknod(&p("cdev"), libc::S_IFCHR | 0o600, 1, 3);
    mknod(&p("bdev"), libc::S_IFBLK | 0o660, 259, 70000);
    for i in 0..300 {
        fs::write(p(&format!("d1/d2/file_{i}")), format!("{i}\n")).unwrap();
    }
    fs::write(p(&"n".repeat(255)), b"long name").unwrap();
    fs::write(p("héllo wörld ✓"), b"unicode").unwrap();
    setxattr(&p("small"), "user.a", b"hello");
    setxattr(&p("small"), "user.empty", b"");
    setxattr(&p("d1"), "user.big", &[b'v'; 3000]);
    setxattr(&p("fifo"), "trusted.t", b"on a fifo");
    for i in 0..20 {
        setxattr(
            &p("d1/f5000"),
            &format!("user.many{i}"),
            format!("{i}").as_bytes(),
        );
    }
    fs::set_permissions(p("small"), fs::Permissions::from_mode(0o4755)).unwrap();
    fs::set_permissions(p("d1/d2"), fs::Permissions::from_mode(0o1777)).unwrap();
    std::os::unix::fs::lchown(p("d1/f5000"), Some(1234), Some(5678)).unwrap();
    std::os::unix::fs::lchown(p("sl"), Some(42), Some(43)).unwrap();
    set_times(
        &p("d1/d2/d3"),
        (-315_619_200, 123_456_789),
        (-1, 999_999_999),
    );
    set_times(&p("zero"), (2_000_000_000, 1), (4_000_000_000, 999_999_999));
    // A subvolume with a hardlink pair, a snapshot of it, then a nested subvolume.
    run("btrfs", &[&"subvolume", &"create", &p("sub")]);
    fs::write(p("sub/a"), b"in the subvolume\n").unwrap();
    fs::hard_link(p("sub/a"), p("sub/a2")).unwrap();
    fs::create_dir(p("sub/dd")).unwrap();
    fs::write(p("sub/dd/b"), pseudo_random(70000, 5)).unwrap();
    setxattr(&p("sub/dd"), "user.sub", b"x");
    run(
        "btrfs",
        &[&"subvolume", &"snapshot", &"-r", &p("sub"), &p("snap")],
    );
    fs::write(p("sub/after-snapshot"), b"new\n").unwrap();
    run("btrfs", &[&"subvolume", &"create", &p("sub/nested")]);
    fs::write(p("sub/nested/x"), b"nested\n").unwrap();
    let id = run("btrfs", &[&"inspect-internal", &"rootid", &p("sub")]);
    id.trim().parse().expect("subvolume id")
}

// ---------------------------------------------------------------------------------------------
// Looking at a tree

#[derive(Debug, PartialEq)]
struct Node {
    mode: u32,
    nlink: u64,
    uid: u32,
    gid: u32,
    rdev: u64,
    size: u64,
    blocks: u64,
    blksize: u64,
    atime: (i64, i64),
    mtime: (i64, i64),
    ctime: (i64, i64),
    link: Option<Vec<u8>>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Names in readdir order.
    children: Option<Vec<Vec<u8>>>,
}

struct Seen {
    node: Node,
    dev: u64,
    ino: u64,
}

fn list_xattrs(p: &Path) -> Vec<(Vec<u8>, Vec<u8>)> {
    let c = cstr(p);
    // SAFETY: size-0 probe with a null buffer is the documented way to get the length.
    let n = unsafe { libc::llistxattr(c.as_ptr(), std::ptr::null_mut(), 0) };
    assert!(n >= 0, "listxattr {}: errno {}", p.display(), last_errno());
    let mut buf = vec![0u8; n as usize];
    // SAFETY: buffer of the given length.
    let n2 = unsafe { libc::llistxattr(c.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(n2, n);
    let mut out = Vec::new();
    for name in buf.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let cn = CString::new(name).unwrap();
        // SAFETY: as above.
        let len = unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), std::ptr::null_mut(), 0) };
        assert!(len >= 0, "getxattr {}: errno {}", p.display(), last_errno());
        let mut v = vec![0u8; len as usize];
        // SAFETY: as above.
        let l2 =
            unsafe { libc::lgetxattr(c.as_ptr(), cn.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
        assert_eq!(l2, len);
        out.push((name.to_vec(), v));
    }
    out.sort();
    out
}

fn walk(root: &Path) -> BTreeMap<PathBuf, Seen> {
    let mut out = BTreeMap::new();
    let mut todo = vec![PathBuf::new()];
    while let Some(rel) = todo.pop() {
        let path = root.join(&rel);
        let md = fs::symlink_metadata(&path).unwrap();
        let children = if md.is_dir() {
            let mut names = Vec::new();
            for e in fs::read_dir(&path).unwrap() {
                let name = e.unwrap().file_name();
                todo.push(rel.join(&name));
                names.push(name.as_bytes().to_vec());
            }
            Some(names)
        } else {
            None
        };
        let link = md.file_type().is_symlink().then(|| {
            fs::read_link(&path)
                .unwrap()
                .as_os_str()
                .as_bytes()
                .to_vec()
        });
        let node = Node {
            mode: md.mode(),
            nlink: md.nlink(),
            uid: md.uid(),
            gid: md.gid(),
            rdev: md.rdev(),
            size: md.size(),
            blocks: md.blocks(),
            blksize: md.blksize(),
            atime: (md.atime(), md.atime_nsec()),
            mtime: (md.mtime(), md.mtime_nsec()),
            ctime: (md.ctime(), md.ctime_nsec()),
            link,
            xattrs: list_xattrs(&path),
            children,
        };
        out.insert(
            rel,
            Seen {
                node,
                dev: md.dev(),
                ino: md.ino(),
            },
        );
    }
    out
}

fn same_content(a: &Path, b: &Path) {
    let (mut fa, mut fb) = (File::open(a).unwrap(), File::open(b).unwrap());
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut off = 0u64;
    loop {
        let na = read_full(&mut fa, &mut ba);
        let nb = read_full(&mut fb, &mut bb);
        assert_eq!(na, nb, "{}: lengths differ after offset {off}", b.display());
        if let Some(i) = (0..na).find(|&i| ba[i] != bb[i]) {
            panic!(
                "{}: content differs at offset {}",
                b.display(),
                off + i as u64
            );
        }
        if na == 0 {
            return;
        }
        off += na as u64;
    }
}

fn read_full(f: &mut File, buf: &mut [u8]) -> usize {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]).unwrap() {
            0 => break,
            k => n += k,
        }
    }
    n
}

/// Compares the trees under `kernel` and `fuse`. Inodes of the mounted subvolume (same st_dev
/// as the kernel mount's root) must keep their numbers; all inodes must map one to one.
fn compare_trees(kernel: &Path, fuse: &Path) {
    let k = walk(kernel);
    let f = walk(fuse);
    let kn: Vec<_> = k.keys().collect();
    let fn_: Vec<_> = f.keys().collect();
    assert_eq!(kn, fn_, "the two mounts list different paths");
    let root_dev = k[&PathBuf::new()].dev;
    let mut k_to_f: HashMap<(u64, u64), u64> = HashMap::new();
    let mut f_to_k: HashMap<u64, (u64, u64)> = HashMap::new();
    for (path, ks) in &k {
        let fs_ = &f[path];
        assert_eq!(ks.node, fs_.node, "{} differs", path.display());
        if ks.dev == root_dev {
            assert_eq!(ks.ino, fs_.ino, "{}: inode number not kept", path.display());
        }
        let kk = (ks.dev, ks.ino);
        assert_eq!(
            *k_to_f.entry(kk).or_insert(fs_.ino),
            fs_.ino,
            "{}: one kernel inode, two butter inode numbers",
            path.display()
        );
        assert_eq!(
            *f_to_k.entry(fs_.ino).or_insert(kk),
            kk,
            "{}: two kernel inodes share a butter inode number",
            path.display()
        );
        if ks.node.mode & libc::S_IFMT == libc::S_IFREG {
            same_content(&kernel.join(path), &fuse.join(path));
        }
    }
    // And what find(1) prints, through its own getdents/fstatat path.
    let fmt = "%P|%y|%m|%n|%U|%G|%s|%b|%A@|%T@|%C@|%l\\n";
    let listing = |dir: &Path| {
        let out = run("find", &[&dir, &"-printf", &fmt]);
        let mut lines: Vec<String> = out.lines().map(str::to_string).collect();
        lines.sort();
        lines
    };
    assert_eq!(listing(kernel), listing(fuse), "find -printf differs");
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn refuses_unknown_options() {
    let out = Command::new(BUTTER)
        .args(["mount", "-o", "ro,frobnicate", "/nonexistent.img", "/tmp"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("frobnicate"));
}

#[test]
fn same_view_as_the_kernel() {
    if !prerequisites("same_view_as_the_kernel") {
        return;
    }
    let s = Scratch::new("view");
    let image = s.path("img");
    let kdir = s.mkdir("kernel");
    let fdir = s.mkdir("butter");
    mkfs(&image);
    let sub_id = {
        let _rw = KernelMount::new(&image, &kdir, "rw");
        populate(&kdir)
    };

    {
        let _k = KernelMount::new(&image, &kdir, "ro");
        let b = ButterMount::start(&image, &fdir, &["--ro"]);
        compare_trees(&kdir, &fdir);
        check_details(&kdir, &fdir);
        drop(b);
    }
    // Another subvolume as the mount's root: its inodes keep their numbers.
    {
        let _k = KernelMount::new(&image, &kdir, "ro,subvol=sub");
        {
            let _b = ButterMount::start(&image, &fdir, &["--ro", "--subvol", "sub"]);
            compare_trees(&kdir, &fdir);
        }
        {
            let _b = ButterMount::start(&image, &fdir, &["-o", &format!("ro,subvolid={sub_id}")]);
            compare_trees(&kdir, &fdir);
        }
    }
    // The top level by id, with the default options spelled out.
    {
        let _k = KernelMount::new(&image, &kdir, "ro,subvolid=5");
        let _b = ButterMount::start(
            &image,
            &fdir,
            &["--ro", "--subvol-id", "5", "--threads", "2"],
        );
        compare_trees(&kdir, &fdir);
    }
    // Not a subvolume, no such subvolume: refused before mounting.
    for args in [["--subvol", "d1"], ["--subvol-id", "999"]] {
        let out = Command::new(BUTTER)
            .args(["mount", "--ro", args[0], args[1]])
            .arg(&image)
            .arg(&fdir)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} mounted");
        assert!(mounted_type(&fdir).is_none());
    }
}

/// What a tree walk does not show: mount options, statfs, xattr probing, readdir positions,
/// partial and concurrent reads.
fn check_details(kdir: &Path, fdir: &Path) {
    let opts = fs::read_to_string("/proc/self/mounts").unwrap();
    let line = opts
        .lines()
        .find(|l| l.split(' ').nth(1) == fdir.to_str())
        .expect("butter mount in /proc/self/mounts");
    let fields: Vec<&str> = line.split(' ').collect();
    assert_eq!(fields[0], "butter");
    assert_eq!(fields[2], "fuse.butter");
    assert!(fields[3].split(',').any(|o| o == "ro"), "{line}");
    assert!(fields[3].contains("default_permissions"), "{line}");
    assert!(!fields[3].contains("allow_other"), "{line}");

    // statfs
    // SAFETY: zeroed statvfs is a valid out-parameter.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-parameter.
    assert_eq!(unsafe { libc::statvfs(cstr(fdir).as_ptr(), &mut st) }, 0);
    assert_eq!(st.f_bsize, 4096);
    assert_eq!(st.f_frsize, 4096);
    assert_eq!(st.f_blocks * 4096, IMAGE_SIZE);
    assert!(st.f_bfree > 0 && st.f_bfree < st.f_blocks);
    assert_eq!(st.f_namemax, 255);

    // xattr probe semantics: size 0 gives the size, a short buffer ERANGE, none ENODATA.
    let small = cstr(&fdir.join("small"));
    let name = CString::new("user.a").unwrap();
    let mut buf = [0u8; 64];
    // SAFETY: buffers of the stated sizes.
    unsafe {
        assert_eq!(
            libc::lgetxattr(small.as_ptr(), name.as_ptr(), std::ptr::null_mut(), 0),
            5
        );
        assert_eq!(
            libc::lgetxattr(small.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 2),
            -1
        );
        assert_eq!(last_errno(), libc::ERANGE);
        assert_eq!(
            libc::lgetxattr(small.as_ptr(), name.as_ptr(), buf.as_mut_ptr().cast(), 64),
            5
        );
        assert_eq!(&buf[..5], b"hello");
        let none = CString::new("user.none").unwrap();
        assert_eq!(
            libc::lgetxattr(small.as_ptr(), none.as_ptr(), buf.as_mut_ptr().cast(), 64),
            -1
        );
        assert_eq!(last_errno(), libc::ENODATA);
        let total = libc::llistxattr(small.as_ptr(), std::ptr::null_mut(), 0);
        assert_eq!(total as usize, "user.a\0user.empty\0".len());
        assert_eq!(
            libc::llistxattr(small.as_ptr(), buf.as_mut_ptr().cast(), 3),
            -1
        );
        assert_eq!(last_errno(), libc::ERANGE);
        let empty = CString::new("user.empty").unwrap();
        assert_eq!(
            libc::lgetxattr(small.as_ptr(), empty.as_ptr(), std::ptr::null_mut(), 0),
            0
        );
    }

    // Writing is refused.
    assert!(fs::OpenOptions::new()
        .write(true)
        .open(fdir.join("small"))
        .is_err());
    assert!(fs::write(fdir.join("new"), b"x").is_err());
    assert!(fs::create_dir(fdir.join("newdir")).is_err());

    // readdir positions: seek back to a telldir() cookie in a 300-entry directory.
    let d2 = cstr(&fdir.join("d1/d2"));
    // SAFETY: standard dirent use on a valid path; the stream is closed at the end.
    unsafe {
        let dir = libc::opendir(d2.as_ptr());
        assert!(!dir.is_null());
        let name_of = |e: *mut libc::dirent64| {
            std::ffi::CStr::from_ptr((*e).d_name.as_ptr())
                .to_bytes()
                .to_vec()
        };
        let mut all = Vec::new();
        let mut pos = 0;
        let mut at_150 = None;
        loop {
            if all.len() == 150 {
                pos = libc::telldir(dir);
            }
            let e = libc::readdir64(dir);
            if e.is_null() {
                break;
            }
            if all.len() == 150 {
                at_150 = Some(name_of(e));
            }
            all.push(name_of(e));
        }
        assert_eq!(all.len(), 303, "300 files, d3, . and ..");
        assert_eq!(&all[..2], &[b".".to_vec(), b"..".to_vec()]);
        libc::seekdir(dir, pos);
        let e = libc::readdir64(dir);
        assert!(!e.is_null());
        assert_eq!(Some(name_of(e)), at_150);
        libc::closedir(dir);
    }

    // ".." and "." resolve to the right inodes.
    let ino = |p: PathBuf| fs::metadata(p).unwrap().ino();
    assert_eq!(ino(fdir.join("d1/d2/..")), ino(fdir.join("d1")));
    assert_eq!(ino(fdir.join("sub/dd/../..")), ino(fdir.to_path_buf()));
    assert_eq!(ino(fdir.to_path_buf()), 256);

    // Unaligned and large reads, from several threads at once.
    let big_k = fs::read(kdir.join("big")).unwrap();
    std::thread::scope(|sc| {
        for t in 0..4u64 {
            let big_k = &big_k;
            sc.spawn(move || {
                let f = File::open(fdir.join("big")).unwrap();
                for i in 0..20u64 {
                    let off = (t * 7919 + i * 104_729) % 2_900_000;
                    let len = 1 + ((i * 31 + t) * 4099) as usize % 200_000;
                    let mut buf = vec![0u8; len];
                    let n = f.read_at(&mut buf, off).unwrap();
                    let end = (off as usize + len).min(big_k.len());
                    assert_eq!(&buf[..n], &big_k[off as usize..end]);
                }
            });
        }
    });
    let mut f = File::open(fdir.join("sparse")).unwrap();
    f.seek(SeekFrom::Start((10 << 20) - 4)).unwrap();
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).unwrap();
    assert_eq!(tail, b"tail");
}

/// Finds the sector-aligned offset of `marker` in the image.
fn find_in_image(image: &Path, marker: &[u8]) -> u64 {
    let mut f = File::open(image).unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut base = 0u64;
    loop {
        let n = read_full(&mut f, &mut buf);
        if n == 0 {
            panic!("marker not found in the image");
        }
        for off in (0..n).step_by(4096) {
            if buf[off..].starts_with(marker) {
                return base + off as u64;
            }
        }
        base += n as u64;
    }
}

#[test]
fn damaged_data_gives_eio_and_the_mount_lives_on() {
    if !prerequisites("damaged_data_gives_eio_and_the_mount_lives_on") {
        return;
    }
    let s = Scratch::new("damaged");
    let image = s.path("img");
    let kdir = s.mkdir("kernel");
    let fdir = s.mkdir("butter");
    mkfs(&image);
    let marker = b"butter-fuse-test-marker-0123456789";
    {
        let _rw = KernelMount::new(&image, &kdir, "rw");
        let mut data = marker.to_vec();
        data.extend(pseudo_random(65536, 9));
        fs::write(kdir.join("victim"), &data).unwrap();
        fs::write(kdir.join("healthy"), pseudo_random(65536, 10)).unwrap();
    }
    let at = find_in_image(&image, marker);
    let f = fs::OpenOptions::new().write(true).open(&image).unwrap();
    f.write_all_at(b"X", at + 100).unwrap();
    drop(f);

    let mut b = ButterMount::start(&image, &fdir, &["--ro"]);
    let err = fs::read(fdir.join("victim")).expect_err("damaged data read back");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    assert_eq!(
        fs::read(fdir.join("healthy")).unwrap(),
        pseudo_random(65536, 10)
    );
    assert_eq!(
        fs::metadata(fdir.join("victim")).unwrap().len(),
        65536 + marker.len() as u64
    );
    let err = fs::read(fdir.join("nonexistent")).expect_err("nonexistent file");
    assert_eq!(err.raw_os_error(), Some(libc::ENOENT));
    assert!(b.is_running());
    let log = b.log_text();
    assert!(
        log.contains("checksum"),
        "no log line for the bad data: {log}"
    );
}

#[test]
fn signals_and_unmounts_end_the_mount_cleanly() {
    if !prerequisites("signals_and_unmounts_end_the_mount_cleanly") {
        return;
    }
    let s = Scratch::new("signals");
    let image = s.path("img");
    let fdir = s.mkdir("butter");
    mkfs(&image);

    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut b = ButterMount::start(&image, &fdir, &["--ro"]);
        assert!(fs::read_dir(&fdir).unwrap().next().is_none());
        b.signal(sig);
        let st = b
            .wait(Duration::from_secs(10))
            .expect("butter did not exit");
        assert!(st.success(), "signal {sig}: {st}: {}", b.log_text());
        assert!(
            mounted_type(&fdir).is_none(),
            "still mounted after signal {sig}"
        );
    }

    // Unmounted by someone else.
    let mut b = ButterMount::start(&image, &fdir, &["-o", "ro"]);
    run("umount", &[&fdir]);
    let st = b
        .wait(Duration::from_secs(10))
        .expect("butter did not exit");
    assert!(st.success(), "{st}: {}", b.log_text());

    // Busy: the mount is detached at once, the process ends when the last user lets go.
    let mut b = ButterMount::start(&image, &fdir, &["--ro"]);
    let busy = File::open(&fdir).unwrap();
    b.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_secs(10);
    while mounted_type(&fdir).is_some() {
        assert!(Instant::now() < deadline, "busy mount not detached");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(b.is_running(), "exited while the mount was still in use");
    drop(busy);
    let st = b
        .wait(Duration::from_secs(10))
        .expect("butter did not exit");
    assert!(st.success(), "{st}: {}", b.log_text());
    assert!(b.log_text().contains("detach"), "{}", b.log_text());
}

/// The connection aborted through fusectl (what an administrator does to a hung FUSE mount):
/// butter's readers see ECONNABORTED, which ends the session like an unmount. The process
/// exits cleanly after its final commit, so a file written before the abort is in the image.
#[test]
fn an_aborted_connection_ends_the_mount_with_a_commit() {
    if !prerequisites("an_aborted_connection_ends_the_mount_with_a_commit") {
        return;
    }
    let conns = Path::new("/sys/fs/fuse/connections");
    if fs::read_dir(conns).map_or(true, |mut d| d.next().is_none()) && mounted_type(conns).is_none()
    {
        run("mount", &[&"-t", &"fusectl", &"fusectl", &conns]);
    }
    let s = Scratch::new("abort");
    let image = s.path("img");
    let fdir = s.mkdir("butter");
    let kdir = s.mkdir("kernel");
    mkfs(&image);

    // No periodic commit: only the session's end can make the file durable.
    let mut b = ButterMount::start(&image, &fdir, &["-o", "commit=0"]);
    fs::write(fdir.join("before-abort"), pseudo_random(100_000, 7)).unwrap();
    let dev = fs::metadata(&fdir).unwrap().dev();
    let conn = conns.join(libc::minor(dev).to_string());
    fs::write(conn.join("abort"), "1").unwrap();
    let st = b
        .wait(Duration::from_secs(20))
        .expect("butter did not exit after the abort");
    assert!(st.success(), "{st}: {}", b.log_text());
    // The aborted mount stays until someone unmounts it.
    run("umount", &[&"-l", &fdir]);

    let out = Command::new(BUTTER)
        .arg("check")
        .arg(&image)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "butter check: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    run("btrfs", &[&"check", &"--readonly", &image]);
    let _k = KernelMount::new(&image, &kdir, "ro");
    assert_eq!(
        fs::read(kdir.join("before-abort")).unwrap(),
        pseudo_random(100_000, 7)
    );
}
