//! mount(8) and fstab: the butter binary invoked as `mount.fuse.butter` is mount(8)'s helper
//! for `-t fuse.butter` (it returns once the mount is usable and serves in the background), and
//! as `umount.fuse.butter` umount(8)'s, so `umount DIR` returns only once the final commit is
//! on disk. The links are put in /sbin for the test (as `scripts/install` puts them) and taken
//! away after. Needs root, FUSE, loop devices and btrfs-progs; fails under CI without.

mod common;

use common::fuse_mount::{self, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// /sbin/mount.fuse.butter and umount.fuse.butter pointing at the binary under test, put back
/// as they were at the end.
struct Links(Vec<(PathBuf, Option<PathBuf>)>);

impl Links {
    fn install() -> Links {
        let mut saved = Vec::new();
        for name in ["mount.fuse.butter", "umount.fuse.butter"] {
            let at = Path::new("/sbin").join(name);
            let before = fs::read_link(&at).ok();
            let _ = fs::remove_file(&at);
            std::os::unix::fs::symlink(BUTTER, &at).unwrap();
            saved.push((at, before));
        }
        Links(saved)
    }
}

impl Drop for Links {
    fn drop(&mut self) {
        for (at, before) in &self.0 {
            let _ = fs::remove_file(at);
            if let Some(b) = before {
                let _ = std::os::unix::fs::symlink(b, at);
            }
        }
    }
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = kernel::run_output(cmd);
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn mounted_type(dir: &Path) -> Option<String> {
    let text = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let d = dir.to_str().unwrap();
    text.lines().rev().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        (left.split(' ').nth(4)? == d).then(|| right.split(' ').next().unwrap().to_string())
    })
}

/// The pids of processes whose command line names `dir`.
fn serving(dir: &Path) -> Vec<u32> {
    let d = dir.to_str().unwrap().as_bytes().to_vec();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.split(|&b| b == 0).any(|a| a == d.as_slice()))
        })
        .collect()
}

#[test]
fn mount_and_umount_through_mount8_and_fstab() {
    if !fuse_mount::require("mount_and_umount_through_mount8_and_fstab", &[]) {
        return;
    }
    let _links = Links::install();
    let sc = ScratchDir::new("mount-helper");
    let img = sc.join("a.img");
    let dir = fs::canonicalize(sc.dir("m")).unwrap();
    let (ok, out) = run(Command::new(BUTTER)
        .args(["mkfs", "-q", "-b", "256M"])
        .arg(&img));
    assert!(ok, "mkfs: {out}");
    let data: Vec<u8> = (0..24u32 << 20).map(|i| (i % 251) as u8).collect();

    // mount(8) with options as users write them; -f (fake) mounts nothing.
    let (ok, out) = run(Command::new("mount")
        .args(["-f", "-t", "fuse.butter"])
        .arg(&img)
        .arg(&dir));
    assert!(ok, "mount -f: {out}");
    assert_eq!(mounted_type(&dir), None, "mount -f mounted");
    let (ok, out) = run(Command::new("mount")
        .args(["-t", "fuse.butter"])
        .arg(&img)
        .arg(&dir)
        .args([
            "-o",
            "defaults,noatime,compress=zstd:-3,space_cache=v2,x-systemd.automount",
        ]));
    assert!(ok, "mount -t fuse.butter: {out}");
    assert_eq!(mounted_type(&dir).as_deref(), Some("fuse.butter"));
    fs::write(dir.join("big"), &data).unwrap();
    // umount returns once the butter process has exited: its final commit is on disk.
    let (ok, out) = run(Command::new("umount").arg(&dir));
    assert!(ok, "umount: {out}");
    assert_eq!(mounted_type(&dir), None);
    assert_eq!(
        serving(&dir),
        Vec::<u32>::new(),
        "a butter process outlived umount"
    );
    let cat = kernel::run_output(Command::new(BUTTER).arg("cat").arg(&img).arg("big"));
    assert!(
        cat.stdout == data,
        "the file is not in the image after umount returned"
    );
    let utab = fs::read_to_string("/run/mount/utab").unwrap_or_default();
    assert!(
        !utab.contains(dir.to_str().unwrap()),
        "utab keeps the mount: {utab}"
    );

    // An fstab line: `mount DIR` finds it.
    let fstab = sc.join("fstab");
    fs::write(
        &fstab,
        format!(
            "# butter\n{} {} fuse.butter defaults,nofail,x-systemd.device-timeout=5s 0 0\n",
            img.display(),
            dir.display()
        ),
    )
    .unwrap();
    let (ok, out) = run(Command::new("mount").arg("-T").arg(&fstab).arg(&dir));
    assert!(ok, "mount DIR through fstab: {out}");
    assert_eq!(mounted_type(&dir).as_deref(), Some("fuse.butter"));
    assert!(fs::read(dir.join("big")).unwrap() == data);
    fs::remove_file(dir.join("big")).unwrap();
    fs::write(dir.join("small"), b"fstab\n").unwrap();
    let (ok, out) = run(Command::new("umount").arg(&dir));
    assert!(ok, "umount: {out}");
    assert_eq!(serving(&dir), Vec::<u32>::new());

    // A mount that fails says why, and mount(8) fails.
    let (ok, out) = run(Command::new("mount")
        .args(["-t", "fuse.butter"])
        .arg(sc.join("missing.img"))
        .arg(&dir));
    assert!(!ok && out.contains("missing.img"), "{out}");
    assert_eq!(mounted_type(&dir), None);

    let (rc, report) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "{report}");
    kernel::assert_btrfs_check(&img);
    let m = LoopMount::btrfs(&img, &sc.dir("k"), "");
    assert_eq!(fs::read(m.path().join("small")).unwrap(), b"fstab\n");
    assert!(!m.path().join("big").exists());
    m.unmount();
}
