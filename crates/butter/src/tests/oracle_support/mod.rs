//! Kernel and btrfs-progs helpers for `../free_space_tree.rs` and `../check_more.rs`:
//! privilege checks, scratch directories, mkfs, loop mounts and filesystem freezes that undo
//! themselves on drop (also when a test panics).
//!
//! Availability: when root, loop devices, kernel btrfs or the tools are missing, a test prints a
//! notice and returns early, unless the environment variable `CI` is set: then it panics, since
//! a skipped oracle test would pass silently in CI.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

pub(crate) fn tool(name: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect())
        .unwrap_or_default();
    for d in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
        dirs.push(PathBuf::from(d));
    }
    dirs.into_iter().map(|d| d.join(name)).find(|p| p.is_file())
}

fn skip(why: &str) -> bool {
    if std::env::var_os("CI").is_some() {
        panic!("oracle test: {why}, and CI is set: refusing to skip");
    }
    eprintln!("NOTICE: skipping oracle test: {why}");
    false
}

/// mkfs.btrfs and btrfs are installed (no privileges needed).
pub(crate) fn have_progs() -> bool {
    for t in ["mkfs.btrfs", "btrfs"] {
        if tool(t).is_none() {
            return skip(&format!("{t} is not installed"));
        }
    }
    true
}

/// Root, loop devices, kernel btrfs and the mount tools are available.
pub(crate) fn have_root_and_loop() -> bool {
    static MISSING: OnceLock<Option<String>> = OnceLock::new();
    let missing = MISSING.get_or_init(|| {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Some("not running as root".into());
        }
        if !Path::new("/dev/loop-control").exists() {
            return Some("no /dev/loop-control".into());
        }
        let fss = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !fss
            .lines()
            .any(|l| l.split_whitespace().last() == Some("btrfs"))
        {
            return Some("the kernel has no btrfs".into());
        }
        for t in ["losetup", "mount", "umount", "mkfs.btrfs", "btrfs"] {
            if tool(t).is_none() {
                return Some(format!("{t} is not installed"));
            }
        }
        None
    });
    match missing {
        None => true,
        Some(why) => skip(why),
    }
}

/// Runs a tool; panics with its output when it fails. Returns stdout.
pub(crate) fn run(name: &str, args: &[&str]) -> String {
    let path = tool(name).unwrap_or_else(|| PathBuf::from(name));
    let out = Command::new(&path)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{name} {args:?}: {e}"));
    if !out.status.success() {
        panic!(
            "{name} {args:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `sh -c script` in `dir`; panics when it fails.
pub(crate) fn sh_in(dir: &Path, script: &str) -> String {
    run(
        "sh",
        &["-c", &format!("cd '{}' && {script}", dir.display())],
    )
}

/// `btrfs check --readonly img`: (passed, output).
pub(crate) fn btrfs_check(img: &Path) -> (bool, String) {
    let out = Command::new(tool("btrfs").unwrap_or_else(|| "btrfs".into()))
        .args(["check", "--readonly"])
        .arg(img)
        .output()
        .expect("run btrfs check");
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), s)
}

/// A directory under /tmp/butter-tests, emptied first and removed on drop unless something is
/// still mounted below it.
pub(crate) struct Scratch(pub PathBuf);

impl Scratch {
    pub(crate) fn new(name: &str) -> Scratch {
        static N: AtomicU32 = AtomicU32::new(0);
        let d = PathBuf::from(format!(
            "/tmp/butter-tests/{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        Scratch(d)
    }
    pub(crate) fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let busy = mounts
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .any(|m| Path::new(m).starts_with(&self.0));
        if busy {
            eprintln!("not removing {}: still mounted below it", self.0.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A sparse image file of `size` bytes formatted by `mkfs.btrfs -f -q <args>`.
pub(crate) fn mkfs(img: &Path, size: u64, args: &[&str]) {
    let _ = std::fs::remove_file(img);
    let f = std::fs::File::create(img).unwrap();
    f.set_len(size).unwrap();
    drop(f);
    let mut a = vec!["-f", "-q"];
    a.extend_from_slice(args);
    let img_s = img.to_str().unwrap();
    a.push(img_s);
    run("mkfs.btrfs", &a);
}

/// A loop device we attached and a btrfs mount on it; unmounted and detached on drop.
pub(crate) struct LoopMount {
    dev: String,
    pub mnt: PathBuf,
    mounted: bool,
}

impl LoopMount {
    pub(crate) fn new(img: &Path, mnt: &Path, options: &str) -> LoopMount {
        std::fs::create_dir_all(mnt).unwrap();
        let dev = run("losetup", &["--find", "--show", img.to_str().unwrap()])
            .trim()
            .to_string();
        let mut m = LoopMount {
            dev,
            mnt: mnt.to_path_buf(),
            mounted: false,
        };
        let mut args = vec!["-t", "btrfs"];
        if !options.is_empty() {
            args.extend(["-o", options]);
        }
        let dev = m.dev.clone();
        args.push(&dev);
        let mnt_s = mnt.to_str().unwrap().to_string();
        args.push(&mnt_s);
        run("mount", &args);
        m.mounted = true;
        m
    }

    /// Unmounts and detaches now (waiting for both), so the image can be read or checked.
    pub(crate) fn unmount(mut self) {
        self.release();
    }

    fn release(&mut self) {
        if self.mounted {
            let ok = Command::new(tool("umount").unwrap_or_else(|| "umount".into()))
                .arg(&self.mnt)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                eprintln!("umount {} failed", self.mnt.display());
            }
            self.mounted = false;
        }
        if !self.dev.is_empty() {
            let _ = Command::new(tool("losetup").unwrap_or_else(|| "losetup".into()))
                .args(["-d", &self.dev])
                .status();
            self.dev.clear();
        }
    }
}

impl Drop for LoopMount {
    fn drop(&mut self) {
        self.release();
    }
}

/// A frozen filesystem (FIFREEZE: every change committed, new ones blocked); thawed on drop.
/// While it lives, the image file holds one consistent committed state.
pub(crate) struct Frozen(std::fs::File);

const FIFREEZE: libc::c_ulong = 0xC004_5877;
const FITHAW: libc::c_ulong = 0xC004_5878;

impl Frozen {
    pub(crate) fn new(mnt: &Path) -> Frozen {
        use std::os::unix::io::AsRawFd;
        let f = std::fs::File::open(mnt).unwrap();
        // SAFETY: FIFREEZE takes an int argument it ignores; the fd is a valid open directory.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), FIFREEZE as _, 0) };
        assert_eq!(
            r,
            0,
            "FIFREEZE {}: {}",
            mnt.display(),
            std::io::Error::last_os_error()
        );
        Frozen(f)
    }
}

impl Drop for Frozen {
    fn drop(&mut self) {
        use std::os::unix::io::AsRawFd;
        // SAFETY: as for FIFREEZE.
        let r = unsafe { libc::ioctl(self.0.as_raw_fd(), FITHAW as _, 0) };
        if r != 0 {
            eprintln!("FITHAW: {}", std::io::Error::last_os_error());
        }
    }
}

/// Removes leaf item `slot` from `blk` (item data packed again, later headers moved down).
pub(crate) fn delete_leaf_item(blk: &mut [u8], slot: usize) {
    let n = butter::format::le_u32(blk, 96) as usize;
    let hdr = |i: usize| butter::format::HEADER_SIZE + i * butter::format::ITEM_SIZE;
    let off = |b: &[u8], i: usize| butter::format::le_u32(b, hdr(i) + 17) as usize;
    let size_i = butter::format::le_u32(blk, hdr(slot) + 21) as usize;
    let off_i = off(blk, slot);
    if slot + 1 < n {
        let off_last = off(blk, n - 1);
        blk.copy_within(
            butter::format::HEADER_SIZE + off_last..butter::format::HEADER_SIZE + off_i,
            butter::format::HEADER_SIZE + off_last + size_i,
        );
        for j in slot + 1..n {
            let v = (off(blk, j) + size_i) as u32;
            blk[hdr(j) + 17..hdr(j) + 21].copy_from_slice(&v.to_le_bytes());
        }
        blk.copy_within(hdr(slot + 1)..hdr(n), hdr(slot));
    }
    blk[96..100].copy_from_slice(&((n - 1) as u32).to_le_bytes());
}
