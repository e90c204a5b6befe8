//! Behaviour of `butter mount` that must be the kernel's btrfs's, each case run on a kernel
//! loop mount of a fresh image and on a butter mount of another, with the same expectations
//! and, where it says, the kernel's answer as the one to match:
//!
//! - A preallocation at a file's end (kept in memory by butter until the file is looked at)
//!   followed by a small write at offset 0, an O_APPEND write or an O_TRUNC open, with no look
//!   at the file in between: the size is the kernel's, on the mount and on disk afterwards
//!   (the kernel mounts butter's image and shows the same).
//! - Set-user-id and set-group-id bits: a write (buffered and O_DIRECT), truncate, fallocate
//!   (allocate, punch, zero) and O_TRUNC open by a user without CAP_FSETID clear them as the
//!   kernel clears them, root's leave them; a chmod by a user outside the file's group drops
//!   set-group-id.
//!
//! Every case ends with unmount, both checkers and a kernel mount that shows what the butter
//! mount showed. Needs root, /dev/fuse, loop devices and kernel btrfs; fails under CI without.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::{LoopMount, ScratchDir};
use common::manifest::{self, TakeOpts};
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

const IMAGE_SIZE: u64 = 512 << 20;
/// The user the set-id cases act as (nobody).
const USER: u32 = 65534;

/// Runs `case` on a kernel mount and on a butter mount (`mount_args`) of fresh images; each
/// returns what it observed, and the two must be equal. Then the butter image passes both
/// checkers and the kernel shows what the butter mount showed.
fn on_both<T: PartialEq + std::fmt::Debug>(
    test: &str,
    mount_args: &[&str],
    case: impl Fn(&Path) -> T,
) {
    if !fuse_mount::require(test, &[]) {
        return;
    }
    let scratch = ScratchDir::new(test);
    let kimg = scratch.join("kernel.img");
    fuse_mount::fresh_image(&kimg, IMAGE_SIZE);
    let k = LoopMount::btrfs(&kimg, &scratch.dir("kmnt"), "");
    fs::set_permissions(k.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let want = case(k.path());
    k.unmount();

    let img = scratch.join("butter.img");
    fuse_mount::fresh_image(&img, IMAGE_SIZE);
    let mut args = vec!["-o", "allow_other"];
    args.extend_from_slice(mount_args);
    let m = ButterMount::start(
        &img,
        &scratch.dir("mnt"),
        &args,
        &scratch.join("butter.log"),
    );
    fs::set_permissions(m.path(), fs::Permissions::from_mode(0o777)).unwrap();
    let got = case(m.path());
    let seen = manifest::take(m.path(), &TakeOpts::default());
    let log = m.log_text();
    m.unmount();
    assert_eq!(
        got, want,
        "{test} {mount_args:?}: the butter mount (left) and the kernel's btrfs (right) differ\n\
         butter log:\n{log}"
    );
    fuse_mount::verify_image(&img, &scratch.dir("verify"), Some(&seen), test);
}

fn fallocate(f: &File, mode: i32, offset: i64, len: i64) {
    use std::os::fd::AsRawFd;
    // SAFETY: a plain syscall on an open descriptor.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, offset, len) };
    assert_eq!(r, 0, "fallocate: {}", std::io::Error::last_os_error());
}

fn create(p: &Path) -> File {
    OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o644)
        .open(p)
        .unwrap()
}

/// (size, allocated 512-byte blocks > 0, the first 1000 bytes' sum) of a path, read after
/// the whole sequence ran.
fn size_and_data(p: &Path) -> (u64, u64) {
    let md = fs::metadata(p).unwrap();
    let data = fs::read(p).unwrap();
    let sum = data.iter().map(|&b| b as u64).sum();
    (md.len(), sum)
}

#[test]
fn a_small_write_after_a_preallocation_keeps_the_size() {
    for args in [&[][..], &["-o", "nodelalloc"][..]] {
        on_both("prealloc_small_write", args, |dir| {
            // The reproduction: fallocate 2 MiB, then 1000 bytes at 0, no look between.
            let a = dir.join("a");
            let f = create(&a);
            fallocate(&f, 0, 0, 2 << 20);
            f.write_all_at(&[b'x'; 1000], 0).unwrap();
            drop(f);
            // With a close and reopen between the two.
            let b = dir.join("b");
            fallocate(&create(&b), 0, 0, 1 << 20);
            OpenOptions::new()
                .write(true)
                .open(&b)
                .unwrap()
                .write_all_at(&[b'y'; 100], 0)
                .unwrap();
            // An append after a preallocation at the end goes after it.
            let c = dir.join("c");
            let f = create(&c);
            f.write_all_at(&[b'z'; 4096], 0).unwrap();
            fallocate(&f, 0, 4096, 8192);
            drop(f);
            let mut g = OpenOptions::new().append(true).open(&c).unwrap();
            std::io::Write::write_all(&mut g, b"tail").unwrap();
            drop(g);
            // An O_TRUNC open after a preallocation empties the file.
            let d = dir.join("d");
            fallocate(&create(&d), 0, 0, 65536);
            drop(create(&d));
            ["a", "b", "c", "d"]
                .map(|n| size_and_data(&dir.join(n)))
                .to_vec()
        });
    }
}

/// Runs `prog args` as [`USER`] (no capabilities) and says whether it exited 0.
fn as_user(prog: &str, args: &[&str]) -> bool {
    Command::new(prog)
        .args(args)
        .uid(USER)
        .gid(USER)
        .output()
        .unwrap_or_else(|e| panic!("{prog}: {e}"))
        .status
        .success()
}

fn mode(p: &Path) -> u32 {
    fs::metadata(p).unwrap().mode() & 0o7777
}

#[test]
fn set_id_bits_go_as_the_kernel_lets_them_go() {
    on_both("setid", &[], |dir| {
        let f = dir.join("f");
        let fs_ = f.to_str().unwrap().to_string();
        let mut seen = Vec::new();
        // (mode before, what runs) for each change, by the user and by root.
        let changes: Vec<(&str, Vec<&str>)> = vec![
            (
                "write",
                vec!["dd", "if=/dev/zero", "bs=4096", "count=1", "conv=notrunc"],
            ),
            (
                "direct write",
                vec![
                    "dd",
                    "if=/dev/zero",
                    "bs=4096",
                    "count=1",
                    "conv=notrunc",
                    "oflag=direct",
                ],
            ),
            ("truncate", vec!["truncate", "-s", "100000"]),
            ("fallocate", vec!["fallocate", "-o", "0", "-l", "65536"]),
            ("punch", vec!["fallocate", "-p", "-o", "4096", "-l", "4096"]),
            ("zero", vec!["fallocate", "-z", "-o", "4096", "-l", "4096"]),
        ];
        for start in [0o6666, 0o6676, 0o6766, 0o6777, 0o2666, 0o2676] {
            for (what, cmd) in &changes {
                for user in [true, false] {
                    fs::write(&f, vec![7u8; 192 << 10]).unwrap();
                    fs::set_permissions(&f, fs::Permissions::from_mode(start)).unwrap();
                    let mut args: Vec<String> = cmd[1..].iter().map(|s| s.to_string()).collect();
                    if cmd[0] == "dd" {
                        args.push(format!("of={fs_}"));
                    } else {
                        args.push(fs_.clone());
                    }
                    let args: Vec<&str> = args.iter().map(String::as_str).collect();
                    let ok = if user {
                        as_user(cmd[0], &args)
                    } else {
                        Command::new(cmd[0])
                            .args(&args)
                            .output()
                            .unwrap()
                            .status
                            .success()
                    };
                    seen.push(format!(
                        "{start:o} {what} by {}: {} -> {:o}",
                        if user { "nobody" } else { "root" },
                        if ok { "ok" } else { "failed" },
                        mode(&f)
                    ));
                }
            }
        }
        // O_TRUNC by the user.
        fs::write(&f, b"data").unwrap();
        fs::set_permissions(&f, fs::Permissions::from_mode(0o6777)).unwrap();
        let ok = as_user("sh", &["-c", &format!(": > {fs_}")]);
        seen.push(format!("O_TRUNC by nobody: {ok} -> {:o}", mode(&f)));
        // chmod by the owner outside the file's group: set-group-id dropped.
        let g = dir.join("g");
        fs::write(&g, b"x").unwrap();
        std::os::unix::fs::chown(&g, Some(USER), Some(0)).unwrap();
        let ok = as_user("chmod", &["2755", g.to_str().unwrap()]);
        seen.push(format!(
            "chmod 2755 by the owner outside the group: {ok} -> {:o}",
            mode(&g)
        ));
        let ok = Command::new("chmod")
            .args(["2755", g.to_str().unwrap()])
            .status()
            .unwrap();
        seen.push(format!(
            "chmod 2755 by root: {} -> {:o}",
            ok.success(),
            mode(&g)
        ));
        seen
    });
}
