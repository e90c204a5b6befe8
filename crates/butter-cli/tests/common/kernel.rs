//! The real kernel and btrfs-progs as an oracle: privilege checks, scratch directories, loop
//! mounts that always clean up, and thin wrappers over `mkfs.btrfs`, `btrfs check` and
//! `btrfs inspect-internal dump-tree`.
//!
//! Every helper panics with the command line and its output when a command fails: these are
//! test helpers, and a failing oracle command is a test failure. Nothing here panics from `Drop`
//! (a panic while unwinding would abort the whole test binary); cleanup problems are printed.
//!
//! Environment:
//! - `CI` set: a missing privilege is a test failure, not a skip.
//! - `BUTTER_ORACLE_TMP`: base directory for scratch directories (default `/tmp/butter-oracle`).
//! - `BUTTER_ORACLE_KEEP` set: scratch directories (images, copies) are kept for inspection.

use std::ffi::OsStr;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::thread::sleep;
use std::time::{Duration, Instant};

/// Returns true when this process can use loop devices and mount kernel btrfs (root, btrfs in
/// the kernel, `/dev/loop-control`, the btrfs-progs and util-linux tools).
///
/// When something is missing: with the environment variable `CI` set this panics (an oracle test
/// must not pass silently in CI); otherwise it prints a notice to stderr and returns false, and
/// the caller should return early: `if !require_privileges() { return; }`.
pub fn require_privileges() -> bool {
    static MISSING: OnceLock<Option<String>> = OnceLock::new();
    let missing = MISSING.get_or_init(find_missing_privilege);
    match missing {
        None => true,
        Some(why) => {
            if std::env::var_os("CI").is_some() {
                panic!("oracle test needs root, loop devices and kernel btrfs, but {why} (CI is set, so this is an error rather than a skip)");
            }
            eprintln!("SKIPPED: oracle test needs root, loop devices and kernel btrfs, but {why}");
            false
        }
    }
}

fn find_missing_privilege() -> Option<String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the test does not run as root".into());
    }
    match fs::read_to_string("/proc/filesystems") {
        Ok(s)
            if s.lines()
                .any(|l| l.split_whitespace().last() == Some("btrfs")) => {}
        Ok(_) => {
            // Perhaps a module that is not loaded yet; try once.
            let _ = Command::new("modprobe").arg("btrfs").output();
            let s = fs::read_to_string("/proc/filesystems").unwrap_or_default();
            if !s
                .lines()
                .any(|l| l.split_whitespace().last() == Some("btrfs"))
            {
                return Some("the kernel has no btrfs (/proc/filesystems)".into());
            }
        }
        Err(e) => return Some(format!("/proc/filesystems is unreadable: {e}")),
    }
    if !Path::new("/dev/loop-control").exists() {
        return Some("/dev/loop-control does not exist".into());
    }
    for tool in ["losetup", "mount", "umount", "mkfs.btrfs", "btrfs", "sync"] {
        if find_in_path(tool).is_none() {
            return Some(format!("`{tool}` is not installed"));
        }
    }
    None
}

fn find_in_path(tool: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].iter().map(PathBuf::from))
        .map(|d| d.join(tool))
        .find(|p| p.is_file())
}

/// Renders a command line for messages.
fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for a in cmd.get_args() {
        s.push(' ');
        s.push_str(&a.to_string_lossy());
    }
    s
}

/// Runs a command and returns its output whatever the exit status; panics only when the
/// program cannot be started.
pub fn run_output(cmd: &mut Command) -> Output {
    match cmd.output() {
        Ok(o) => o,
        Err(e) => panic!("cannot run `{}`: {e}", describe(cmd)),
    }
}

/// Runs a command that must succeed and returns its stdout (lossy UTF-8).
/// Panics with the command line, exit status, stdout and stderr otherwise.
pub fn run(cmd: &mut Command) -> String {
    let out = run_output(cmd);
    if !out.status.success() {
        panic!(
            "`{}` failed ({}):\nstdout:\n{}\nstderr:\n{}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Shorthand for `run(Command::new(prog).args(args))`.
pub fn sh<S: AsRef<OsStr>>(prog: &str, args: &[S]) -> String {
    run(Command::new(prog).args(args))
}

/// `sync(2)`: flushes every filesystem.
pub fn sync_all() {
    // SAFETY: sync has no preconditions.
    unsafe { libc::sync() };
}

// ---------------------------------------------------------------------------------------------
// Scratch directories

/// A per-test directory under `$BUTTER_ORACLE_TMP` (default `/tmp/butter-oracle`), emptied when
/// created and removed on drop (unless `BUTTER_ORACLE_KEEP` is set).
///
/// Removal is refused while anything is still mounted below it (so a leaked mount can never
/// make `remove_dir_all` delete the contents of a mounted filesystem). Declare the
/// `ScratchDir` *before* the `LoopMount`s that live in it, so they drop first.
pub struct ScratchDir {
    path: PathBuf,
}

impl ScratchDir {
    /// `name` should identify the test; the process id and a counter make it unique.
    pub fn new(name: &str) -> ScratchDir {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let base = std::env::var_os("BUTTER_ORACLE_TMP")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/tmp/butter-oracle"));
        fs::create_dir_all(&base).unwrap_or_else(|e| panic!("mkdir {}: {e}", base.display()));
        let base = fs::canonicalize(&base).unwrap_or(base);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let path = base.join(format!("{name}-{}-{n}", std::process::id()));
        if path.exists() {
            if !mounts_under(&path).is_empty() {
                panic!("{} exists and has mounts below it", path.display());
            }
            let _ = fs::remove_dir_all(&path);
        }
        fs::create_dir_all(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        ScratchDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `self.path().join(rel)`.
    pub fn join<P: AsRef<Path>>(&self, rel: P) -> PathBuf {
        self.path.join(rel)
    }

    /// Creates (if needed) and returns the subdirectory `rel`, e.g. a mount point.
    pub fn dir<P: AsRef<Path>>(&self, rel: P) -> PathBuf {
        let p = self.path.join(rel);
        fs::create_dir_all(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        p
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        if std::env::var_os("BUTTER_ORACLE_KEEP").is_some() {
            eprintln!("BUTTER_ORACLE_KEEP: keeping {}", self.path.display());
            return;
        }
        let mounts = mounts_under(&self.path);
        if !mounts.is_empty() {
            eprintln!(
                "NOT removing {}: still mounted below it: {:?}",
                self.path.display(),
                mounts
            );
            return;
        }
        if let Err(e) = fs::remove_dir_all(&self.path) {
            eprintln!("cannot remove {}: {e}", self.path.display());
        }
    }
}

/// Mount points (from /proc/self/mountinfo) equal to or below `dir`.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let info = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mountinfo(m)))
        .filter(|m| m.starts_with(dir))
        .collect()
}

/// Undoes the `\ooo` octal escapes of /proc/self/mountinfo.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            let v = (b[i + 1] - b'0') as u32 * 64
                + (b[i + 2] - b'0') as u32 * 8
                + (b[i + 3] - b'0') as u32;
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// True when `path` is a mount point of this process's mount namespace.
pub fn is_mountpoint(path: &Path) -> bool {
    let p = fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    mounts_under(&p).contains(&p)
}

// ---------------------------------------------------------------------------------------------
// Images

/// Creates (replacing any old file) a sparse image of `size` bytes and runs
/// `mkfs.btrfs -f -q <extra_args> img` on it.
pub fn mkfs_btrfs<S: AsRef<OsStr>>(img: &Path, size: u64, extra_args: &[S]) {
    make_sparse_file(img, size);
    run(Command::new("mkfs.btrfs")
        .arg("-f")
        .arg("-q")
        .args(extra_args)
        .arg(img));
}

/// Creates (replacing any old file) a sparse image of `size` bytes with an ext4 filesystem.
pub fn mkfs_ext4(img: &Path, size: u64) {
    make_sparse_file(img, size);
    run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(img));
}

fn make_sparse_file(img: &Path, size: u64) {
    let _ = fs::remove_file(img);
    let f = fs::File::create(img).unwrap_or_else(|e| panic!("create {}: {e}", img.display()));
    f.set_len(size)
        .unwrap_or_else(|e| panic!("truncate {} to {size}: {e}", img.display()));
}

/// `btrfs check --readonly img`: (passed, stdout followed by stderr).
/// The image must not be mounted (drop its `LoopMount` first).
pub fn btrfs_check(img: &Path) -> (bool, String) {
    let out = run_output(Command::new("btrfs").args(["check", "--readonly"]).arg(img));
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// Panics with the checker's output unless `btrfs check --readonly img` passes.
pub fn assert_btrfs_check(img: &Path) {
    let (ok, text) = btrfs_check(img);
    assert!(ok, "btrfs check failed on {}:\n{text}", img.display());
}

/// `btrfs inspect-internal dump-tree <args> img` (e.g. `&["-t", "root"]`); panics on failure.
pub fn dump_tree(img: &Path, args: &[&str]) -> String {
    run(Command::new("btrfs")
        .args(["inspect-internal", "dump-tree"])
        .args(args)
        .arg(img))
}

/// `btrfs inspect-internal dump-super img`; panics on failure.
pub fn dump_super(img: &Path) -> String {
    run(Command::new("btrfs")
        .args(["inspect-internal", "dump-super"])
        .arg(img))
}

// ---------------------------------------------------------------------------------------------
// Loop mounts

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsType {
    Btrfs,
    Ext4,
}

impl FsType {
    fn name(self) -> &'static str {
        match self {
            FsType::Btrfs => "btrfs",
            FsType::Ext4 => "ext4",
        }
    }
}

/// An image attached to a loop device (`losetup -f --show`, read-only when the mount options
/// contain `ro`) and mounted on a directory. Drop unmounts it (retrying for a while if busy,
/// lazily as a last resort) and detaches the loop device it attached, also when the test
/// panicked; then it waits until the device has really let go of the image, so `btrfs check`
/// can run on the image right away.
pub struct LoopMount {
    image: PathBuf,
    device: Option<PathBuf>,
    mountpoint: PathBuf,
    fstype: FsType,
    mounted: bool,
}

impl LoopMount {
    /// Attaches `image` and mounts it on `mountpoint` (created if missing) with `options`
    /// (comma-separated, may be empty). Panics (after cleaning up) if either step fails.
    pub fn new(image: &Path, mountpoint: &Path, fstype: FsType, options: &str) -> LoopMount {
        fs::create_dir_all(mountpoint)
            .unwrap_or_else(|e| panic!("mkdir {}: {e}", mountpoint.display()));
        let read_only = options.split(',').any(|o| o == "ro");
        let mut losetup = Command::new("losetup");
        if read_only {
            losetup.arg("-r");
        }
        losetup.args(["-f", "--show"]).arg(image);
        let dev = PathBuf::from(run(&mut losetup).trim());
        let mut me = LoopMount {
            image: image.to_path_buf(),
            device: Some(dev),
            mountpoint: mountpoint.to_path_buf(),
            fstype,
            mounted: false,
        };
        let mut mount = Command::new("mount");
        mount.args(["-t", fstype.name()]);
        if !options.is_empty() {
            mount.args(["-o", options]);
        }
        mount.arg(me.device()).arg(mountpoint);
        run(&mut mount); // on panic, `me` drops and detaches the device
        me.mounted = true;
        me
    }

    /// Mounts a btrfs image; `options` as for [`LoopMount::new`].
    pub fn btrfs(image: &Path, mountpoint: &Path, options: &str) -> LoopMount {
        LoopMount::new(image, mountpoint, FsType::Btrfs, options)
    }

    /// Mounts a btrfs image read-only (`ro,noatime`, loop device read-only too), the way an
    /// oracle reads an image it must not change.
    pub fn btrfs_ro(image: &Path, mountpoint: &Path) -> LoopMount {
        LoopMount::new(image, mountpoint, FsType::Btrfs, "ro,noatime")
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The loop device (e.g. `/dev/loop3`).
    pub fn device(&self) -> &Path {
        self.device.as_deref().unwrap_or(Path::new(""))
    }

    pub fn image(&self) -> &Path {
        &self.image
    }

    pub fn fstype(&self) -> FsType {
        self.fstype
    }

    /// `mount -o remount,<options> mountpoint`.
    pub fn remount(&self, options: &str) {
        remount(&self.mountpoint, options);
    }

    /// Unmounts and detaches now, panicking if that fails (Drop only prints).
    pub fn unmount(mut self) {
        if let Err(e) = self.cleanup() {
            panic!("{e}");
        }
    }

    fn cleanup(&mut self) -> Result<(), String> {
        let mut problems = Vec::new();
        if self.mounted {
            if let Err(e) = umount_retrying(&self.mountpoint) {
                problems.push(e);
            }
            self.mounted = false;
        }
        if let Some(dev) = self.device.take() {
            if let Err(e) = detach_loop(&dev, self.fstype == FsType::Btrfs) {
                problems.push(e);
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        if let Err(e) = self.cleanup() {
            eprintln!("LoopMount cleanup of {}: {e}", self.image.display());
        }
    }
}

/// Detaches loop device `dev` (first making the kernel's btrfs forget it, when `btrfs`, so
/// a later image on the same loop device is not confused with this one) and waits up to 10 s
/// until it has let go of its image (detaching completes asynchronously while the device is
/// still open somewhere).
fn detach_loop(dev: &Path, btrfs: bool) -> Result<(), String> {
    if btrfs {
        let _ = run_output(
            Command::new("btrfs")
                .args(["device", "scan", "--forget"])
                .arg(dev),
        );
    }
    let out = run_output(Command::new("losetup").arg("-d").arg(dev));
    if !out.status.success() {
        return Err(format!(
            "losetup -d {} failed: {}",
            dev.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let Some(name) = dev.file_name() else {
        return Ok(());
    };
    let backing = Path::new("/sys/block").join(name).join("loop/backing_file");
    let deadline = Instant::now() + Duration::from_secs(10);
    while backing.exists() {
        if Instant::now() > deadline {
            return Err(format!("{} still attached after 10 s", dev.display()));
        }
        sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// A tmpfs mounted on a directory (created if missing), unmounted on drop. Useful as a copy or
/// restore target that holds every kind of inode and large xattrs without a loop device.
pub struct TmpfsMount {
    mountpoint: PathBuf,
    mounted: bool,
}

impl TmpfsMount {
    /// Mounts a tmpfs of at most `size` bytes; panics on failure.
    pub fn new(mountpoint: &Path, size: u64) -> TmpfsMount {
        fs::create_dir_all(mountpoint)
            .unwrap_or_else(|e| panic!("mkdir {}: {e}", mountpoint.display()));
        run(Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size={size},mode=0755"))
            .arg("tmpfs")
            .arg(mountpoint));
        TmpfsMount {
            mountpoint: mountpoint.to_path_buf(),
            mounted: true,
        }
    }

    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts now, panicking if that fails.
    pub fn unmount(mut self) {
        if let Err(e) = umount_retrying(&self.mountpoint) {
            self.mounted = false;
            panic!("{e}");
        }
        self.mounted = false;
    }
}

impl Drop for TmpfsMount {
    fn drop(&mut self) {
        if self.mounted {
            if let Err(e) = umount_retrying(&self.mountpoint) {
                eprintln!("TmpfsMount cleanup: {e}");
            }
        }
    }
}

/// `umount`, retried for up to 10 s while it fails (busy), then `umount -l`. Err describes a
/// mount that had to be detached lazily.
fn umount_retrying(mountpoint: &Path) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = run_output(Command::new("umount").arg(mountpoint));
        if out.status.success() {
            return Ok(());
        }
        if Instant::now() > deadline {
            let _ = run_output(Command::new("umount").arg("-l").arg(mountpoint));
            return Err(format!(
                "umount {} kept failing ({}); detached lazily",
                mountpoint.display(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        sleep(Duration::from_millis(100));
    }
}

/// `mount -o remount,<options> <mountpoint>`; panics on failure.
pub fn remount(mountpoint: &Path, options: &str) {
    run(Command::new("mount")
        .arg("-o")
        .arg(format!("remount,{options}"))
        .arg(mountpoint));
}

/// Images of one filesystem of several devices, each attached to a loop device, mounted by
/// the kernel together (`-o device=` for each). Drop unmounts, forgets and detaches them all,
/// also when the test panicked.
pub struct MultiLoopMount {
    devices: Vec<PathBuf>,
    mountpoint: PathBuf,
    mounted: bool,
}

impl MultiLoopMount {
    /// Attaches every image and mounts them on `mountpoint` (created if missing) with
    /// `options` (comma-separated, may be empty) plus a `device=` for each.
    pub fn new(images: &[PathBuf], mountpoint: &Path, options: &str) -> MultiLoopMount {
        fs::create_dir_all(mountpoint)
            .unwrap_or_else(|e| panic!("mkdir {}: {e}", mountpoint.display()));
        let mut me = MultiLoopMount {
            devices: Vec::new(),
            mountpoint: mountpoint.to_path_buf(),
            mounted: false,
        };
        for img in images {
            let dev = run(Command::new("losetup").args(["-f", "--show"]).arg(img));
            me.devices.push(PathBuf::from(dev.trim()));
        }
        let mut opts: Vec<String> = me
            .devices
            .iter()
            .map(|d| format!("device={}", d.display()))
            .collect();
        if !options.is_empty() {
            opts.push(options.to_string());
        }
        run(Command::new("mount")
            .args(["-t", "btrfs", "-o", &opts.join(",")])
            .arg(&me.devices[0])
            .arg(mountpoint));
        me.mounted = true;
        me
    }

    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// Unmounts and detaches now, panicking if that fails (Drop only prints).
    pub fn unmount(mut self) {
        if let Err(e) = self.cleanup() {
            panic!("{e}");
        }
    }

    fn cleanup(&mut self) -> Result<(), String> {
        let mut problems = Vec::new();
        if self.mounted {
            if let Err(e) = umount_retrying(&self.mountpoint) {
                problems.push(e);
            }
            self.mounted = false;
        }
        for dev in std::mem::take(&mut self.devices) {
            if let Err(e) = detach_loop(&dev, true) {
                problems.push(e);
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("; "))
        }
    }
}

impl Drop for MultiLoopMount {
    fn drop(&mut self) {
        if let Err(e) = self.cleanup() {
            eprintln!(
                "MultiLoopMount cleanup of {}: {e}",
                self.mountpoint.display()
            );
        }
    }
}

/// A number field of `btrfs inspect-internal dump-super IMG` (total_bytes, num_devices,
/// dev_item.total_bytes, ...), from the primary superblock.
pub fn super_field(img: &Path, name: &str) -> u64 {
    let out = run(Command::new("btrfs")
        .args(["inspect-internal", "dump-super"])
        .arg(img));
    out.lines()
        .find_map(|l| {
            let mut w = l.split_whitespace();
            (w.next() == Some(name)).then(|| w.next().and_then(|v| v.parse().ok()))?
        })
        .unwrap_or_else(|| {
            panic!(
                "no number {name} in dump-super of {}:\n{out}",
                img.display()
            )
        })
}

/// `btrfs check --readonly` of a filesystem of several image files: each attached to a
/// read-only loop device and scanned, the check run on the first, then all forgotten and
/// detached. (passed, output)
pub fn btrfs_check_devices(images: &[PathBuf]) -> (bool, String) {
    let mut devs = Vec::new();
    for img in images {
        let d = run(Command::new("losetup")
            .args(["-r", "-f", "--show"])
            .arg(img));
        devs.push(PathBuf::from(d.trim()));
    }
    for d in &devs {
        let _ = run_output(Command::new("btrfs").args(["device", "scan"]).arg(d));
    }
    let out = run_output(
        Command::new("btrfs")
            .args(["check", "--readonly"])
            .arg(&devs[0]),
    );
    for d in &devs {
        if let Err(e) = detach_loop(d, true) {
            eprintln!("{e}");
        }
    }
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}
