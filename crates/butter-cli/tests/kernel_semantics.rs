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
//! - A file unlinked while open, or while only an O_PATH descriptor refers to it, reopens
//!   through /proc as on the kernel.
//! - File handles (open_by_handle_at) of a file and directories open after the kernel
//!   forgot the directories, also after a rename.
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
                    // The kernel caches the mode it saw (a change it did not make itself must
                    // reach it).
                    let before = mode(&f);
                    assert_eq!(before, start);
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

/// `filefrag -v` of `p`: (logical start, physical start, length, unwritten), in blocks.
fn layout(p: &Path) -> Vec<(u64, i64, u64, bool)> {
    let out = Command::new("filefrag").arg("-v").arg(p).output().unwrap();
    assert!(out.status.success(), "filefrag {}", p.display());
    let text = String::from_utf8_lossy(&out.stdout);
    let mut v = Vec::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(':').map(str::trim).collect();
        if f.len() < 5 || f[0].parse::<u64>().is_err() {
            continue;
        }
        let range = |s: &str| -> (u64, u64) {
            let (a, b) = s.split_once("..").unwrap();
            (a.trim().parse().unwrap(), b.trim().parse().unwrap())
        };
        let (ls, _) = range(f[1]);
        let (ps, _) = range(f[2]);
        let len: u64 = f[3].parse().unwrap();
        v.push((ls, ps as i64, len, line.contains("unwritten")));
    }
    v
}

#[test]
fn writes_into_preallocated_space_fill_it_in_place_with_checksums() {
    if !fuse_mount::require("prealloc_in_place", &["filefrag"]) {
        return;
    }
    let scratch = ScratchDir::new("prealloc_in_place");
    // The same changes on both: 1 MiB preallocated, then sector-aligned and unaligned
    // writes inside it, and an append into space preallocated past the end (KEEP_SIZE).
    let change = |dir: &Path| {
        let p = dir.join("f");
        let f = create(&p);
        fallocate(&f, 0, 0, 1 << 20);
        f.write_all_at(&[1u8; 65536], 131072).unwrap();
        f.write_all_at(&[2u8; 100], 700_000).unwrap();
        f.sync_all().unwrap();
        let q = dir.join("g");
        let g = create(&q);
        g.write_all_at(&[3u8; 8192], 0).unwrap();
        fallocate(&g, libc::FALLOC_FL_KEEP_SIZE, 8192, 65536);
        drop(g);
        let mut g = OpenOptions::new().append(true).open(&q).unwrap();
        std::io::Write::write_all(&mut g, &[4u8; 16384]).unwrap();
    };
    let kimg = scratch.join("kernel.img");
    fuse_mount::fresh_image(&kimg, IMAGE_SIZE);
    let k = LoopMount::btrfs(&kimg, &scratch.dir("kmnt"), "");
    change(k.path());
    k.unmount();
    let img = scratch.join("butter.img");
    fuse_mount::fresh_image(&img, IMAGE_SIZE);
    let m = ButterMount::start(&img, &scratch.dir("mnt"), &[], &scratch.join("butter.log"));
    change(m.path());
    let seen = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    fuse_mount::verify_image(
        &img,
        &scratch.dir("verify"),
        Some(&seen),
        "prealloc_in_place",
    );
    let out = Command::new("btrfs")
        .args(["check", "--readonly", "--check-data-csum"])
        .arg(&img)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "btrfs check --check-data-csum of butter's image:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // Which parts are written and which still preallocated must be the kernel's, and the
    // preallocated ranges (all of f, g from its second block on) must still sit where the
    // fallocate put them: one physical run, written parts inside it.
    let mut want = Vec::new();
    let mut got = Vec::new();
    for (image, into) in [(&kimg, &mut want), (&img, &mut got)] {
        let km = LoopMount::btrfs_ro(image, &scratch.dir("look"));
        for (n, from) in [("f", 0), ("g", 2)] {
            let l = layout(&km.path().join(n));
            let shifts: Vec<i64> = l
                .iter()
                .filter(|x| x.0 >= from)
                .map(|x| x.1 - x.0 as i64)
                .collect();
            // Runs of written and of preallocated blocks (FIEMAP merges what is contiguous
            // on disk too, and the kernel's delayed allocation places data differently).
            let mut parts: Vec<(u64, u64, bool)> = Vec::new();
            for x in &l {
                match parts.last_mut() {
                    Some(p) if p.2 == x.3 && p.0 + p.1 == x.0 => p.1 += x.2,
                    _ => parts.push((x.0, x.2, x.3)),
                }
            }
            into.push((n, parts, shifts.windows(2).all(|w| w[0] == w[1]), l));
        }
        km.unmount();
    }
    for (g, w) in got.iter().zip(&want) {
        assert!(
            w.2,
            "the kernel's {} is not one physical run: {:?}",
            w.0, w.3
        );
        assert!(
            g.2,
            "butter's {} is not one physical run (copied on write?): {:?}",
            g.0, g.3
        );
        assert_eq!(
            (g.0, &g.1),
            (w.0, &w.1),
            "written and preallocated parts: butter's image (left), the kernel's (right)"
        );
    }
}

/// errno of an io::Result, 0 for success.
fn errno_of<T>(r: std::io::Result<T>) -> i32 {
    r.err().map_or(0, |e| e.raw_os_error().unwrap_or(-1))
}

#[test]
fn rmdir_deletes_an_empty_subvolume() {
    if !fuse_mount::require("rmdir_subvolume", &[]) {
        return;
    }
    let scratch = ScratchDir::new("rmdir_subvolume");
    // Two subvolumes, one with a file: rmdir takes the empty one and refuses the other.
    let case = |dir: &Path| {
        fs::write(dir.join("full/f"), b"x").unwrap();
        let a = errno_of(fs::remove_dir(dir.join("empty")));
        let b = errno_of(fs::remove_dir(dir.join("full")));
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        (a, b, names)
    };
    let kimg = scratch.join("kernel.img");
    fuse_mount::fresh_image(&kimg, IMAGE_SIZE);
    let k = LoopMount::btrfs(&kimg, &scratch.dir("kmnt"), "");
    for n in ["empty", "full"] {
        common::kernel::run(
            Command::new("btrfs")
                .args(["subvolume", "create"])
                .arg(k.path().join(n)),
        );
    }
    let want = case(k.path());
    k.unmount();
    let img = scratch.join("butter.img");
    fuse_mount::fresh_image(&img, IMAGE_SIZE);
    for n in ["/empty", "/full"] {
        common::kernel::run(
            Command::new(fuse_mount::BUTTER)
                .args(["subvolume", "create"])
                .arg(&img)
                .arg(n),
        );
    }
    let m = ButterMount::start(&img, &scratch.dir("mnt"), &[], &scratch.join("butter.log"));
    let got = case(m.path());
    let seen = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    assert_eq!(
        got, want,
        "rmdir of subvolumes: butter (left), the kernel (right)"
    );
    fuse_mount::verify_image(&img, &scratch.dir("verify"), Some(&seen), "rmdir_subvolume");
}

#[test]
fn open_directories_outlive_their_removal_and_listings_end() {
    on_both("open_dirs", &[], |dir| {
        use std::os::fd::AsRawFd;
        let mut seen = Vec::new();
        // A directory renamed over while open, and one removed while open: fstat answers,
        // with no links.
        for (what, over) in [("renamed over", true), ("removed", false)] {
            let a = dir.join("a");
            let b = dir.join("b");
            fs::create_dir(&a).unwrap();
            if over {
                fs::create_dir(&b).unwrap();
            }
            let held = File::open(if over { &b } else { &a }).unwrap();
            if over {
                fs::rename(&a, &b).unwrap();
                fs::remove_dir(&b).unwrap();
            } else {
                fs::remove_dir(&a).unwrap();
            }
            // SAFETY: fstat into a zeroed struct on an open descriptor.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            let r = unsafe { libc::fstat(held.as_raw_fd(), &mut st) };
            seen.push(format!(
                "{what}: fstat {r}, nlink {}",
                if r == 0 { st.st_nlink } else { 99 }
            ));
        }
        // A listing while every entry is renamed away and back ends, with each name once
        // at least (the kernel's btrfs stops at the last entry there was at the open).
        let d = dir.join("many");
        fs::create_dir(&d).unwrap();
        for i in 0..600 {
            File::create(d.join(format!("f{i:04}"))).unwrap();
        }
        let mut n = 0;
        let mut names = std::collections::BTreeSet::new();
        for e in fs::read_dir(&d).unwrap() {
            let name = e.unwrap().file_name();
            n += 1;
            assert!(n <= 3 * 600, "the listing does not end");
            if names.insert(name.clone()) {
                fs::rename(d.join(&name), d.join("tmp")).unwrap();
                fs::rename(d.join("tmp"), d.join(&name)).unwrap();
            }
        }
        seen.push(format!(
            "listing: {} names, ends: {}",
            names.len() >= 600,
            n <= 1800
        ));
        // rewinddir: a listing from the start again shows what was created since the open.
        let c = std::ffi::CString::new(d.to_str().unwrap()).unwrap();
        let count = |dp: *mut libc::DIR| {
            let mut k = 0;
            // SAFETY: readdir on an open DIR stream until it ends.
            while !unsafe { libc::readdir(dp) }.is_null() {
                k += 1;
            }
            k
        };
        // SAFETY: an open DIR stream, read, rewound, read again and closed.
        unsafe {
            let dp = libc::opendir(c.as_ptr());
            assert!(!dp.is_null());
            let first = count(dp);
            File::create(d.join("late")).unwrap();
            libc::rewinddir(dp);
            let again = count(dp);
            libc::closedir(dp);
            seen.push(format!("rewinddir: {} more", again - first));
        }
        // mmap of a file opened with O_DIRECT.
        let p = dir.join("direct");
        fs::write(&p, vec![5u8; 8192]).unwrap();
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p)
            .unwrap();
        // SAFETY: a shared read mapping of an open descriptor, unmapped at once.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        let mapped = m != libc::MAP_FAILED;
        if mapped {
            // SAFETY: the mapping above, 8192 bytes.
            seen.push(format!("mmap of O_DIRECT: byte {}", unsafe {
                *(m as *const u8).add(100)
            }));
            unsafe { libc::munmap(m, 8192) };
        } else {
            seen.push(format!(
                "mmap of O_DIRECT: {}",
                std::io::Error::last_os_error()
            ));
        }
        seen
    });
}

/// What reopening descriptor `fd` through /proc/self/fd gives: the content read, a write of
/// `bytes` at 0 through a second open, and the content after it (errno on failure).
type Reopened = (
    Result<Vec<u8>, Option<i32>>,
    Result<(), Option<i32>>,
    Result<Vec<u8>, Option<i32>>,
);
fn reopen_through_proc(fd: i32, bytes: &[u8]) -> Reopened {
    let via = format!("/proc/self/fd/{fd}");
    let read = fs::read(&via).map_err(|e| e.raw_os_error());
    let wrote = OpenOptions::new()
        .write(true)
        .open(&via)
        .and_then(|f| f.write_all_at(bytes, 0))
        .map_err(|e| e.raw_os_error());
    let after = fs::read(&via).map_err(|e| e.raw_os_error());
    (read, wrote, after)
}

#[test]
fn an_unlinked_open_file_reopens_through_proc() {
    on_both("reopen_unlinked", &[], |dir| {
        use std::os::fd::AsRawFd;
        let p = dir.join("f");
        fs::write(&p, b"still here").unwrap();
        let held = File::open(&p).unwrap();
        fs::remove_file(&p).unwrap();
        // The kernel still holds the inode (an open file): /proc/self/fd reopens it, for
        // reading and for writing, as on the kernel's btrfs.
        let (read, wrote, after) = reopen_through_proc(held.as_raw_fd(), b"STILL");
        let nlink = held
            .metadata()
            .map(|m| m.nlink())
            .map_err(|e| e.raw_os_error());
        (read, wrote, after, nlink)
    });
}

#[test]
fn an_unlinked_file_held_only_by_o_path_reopens_through_proc() {
    on_both("reopen_unlinked_o_path", &[], |dir| {
        use std::os::fd::AsRawFd;
        let p = dir.join("f");
        fs::write(&p, b"kept by a path").unwrap();
        // An O_PATH descriptor is no open file to the filesystem: only the kernel's reference
        // to the inode (FUSE's lookup count) keeps it. The kernel's btrfs keeps the unlinked
        // file until that reference goes, so /proc reopens it.
        let held = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(&p)
            .unwrap();
        fs::remove_file(&p).unwrap();
        let (read, wrote, after) = reopen_through_proc(held.as_raw_fd(), b"KEPT");
        drop(held);
        // Once the reference went, so did the file: the directory is empty again and the
        // space comes back (the checkers after unmount see no orphan left behind).
        let left: Vec<_> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        (read, wrote, after, left)
    });
}

/// A file handle of `p` (name_to_handle_at): its type and bytes.
fn handle_of(p: &Path) -> Vec<u8> {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // struct file_handle: handle_bytes (u32), handle_type (i32), then the bytes.
    let mut buf = vec![0u8; 8 + libc::MAX_HANDLE_SZ as usize];
    buf[..4].copy_from_slice(&(libc::MAX_HANDLE_SZ as u32).to_ne_bytes());
    let mut mount_id: libc::c_int = 0;
    // SAFETY: buf is large enough for MAX_HANDLE_SZ bytes after the header.
    let r = unsafe {
        libc::name_to_handle_at(
            libc::AT_FDCWD,
            c.as_ptr(),
            buf.as_mut_ptr().cast(),
            &mut mount_id,
            0,
        )
    };
    assert_eq!(
        r,
        0,
        "name_to_handle_at {p:?}: {}",
        std::io::Error::last_os_error()
    );
    buf
}

/// Opens a handle from [`handle_of`] on the filesystem of `mount` (open_by_handle_at).
fn open_handle(mount: &File, handle: &[u8], flags: i32) -> std::io::Result<File> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let mut h = handle.to_vec();
    // SAFETY: h holds a handle name_to_handle_at filled in.
    let fd = unsafe { libc::open_by_handle_at(mount.as_raw_fd(), h.as_mut_ptr().cast(), flags) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor we own from here on.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[test]
fn file_handles_open_after_the_kernel_forgot_their_directories() {
    on_both("file_handles", &[], |dir| {
        let d = dir.join("a").join("b");
        fs::create_dir_all(&d).unwrap();
        let f = d.join("f");
        fs::write(&f, b"by handle").unwrap();
        let handles = [handle_of(&f), handle_of(&d), handle_of(&dir.join("a"))];
        // The kernel forgets every inode nothing holds (FUSE: FORGET for the directories),
        // so opening a handle makes it find the file and connect each directory to the root
        // again by asking for "..": as after an unmount and mount.
        fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
        let mount = File::open(dir).unwrap();
        let data = open_handle(&mount, &handles[0], libc::O_RDONLY)
            .and_then(|mut h| {
                let mut v = Vec::new();
                std::io::Read::read_to_end(&mut h, &mut v).map(|_| v)
            })
            .map_err(|e| e.raw_os_error());
        let dirs: Vec<_> = handles[1..]
            .iter()
            .map(|h| {
                open_handle(&mount, h, libc::O_RDONLY | libc::O_DIRECTORY)
                    .and_then(|f| f.metadata())
                    .map(|m| m.is_dir())
                    .map_err(|e| e.raw_os_error())
            })
            .collect();
        // A renamed directory's handle still opens it.
        fs::rename(dir.join("a"), dir.join("c")).unwrap();
        fs::write("/proc/sys/vm/drop_caches", "2").unwrap();
        let renamed = open_handle(&mount, &handles[0], libc::O_RDONLY)
            .and_then(|f| f.metadata())
            .map(|m| m.len())
            .map_err(|e| e.raw_os_error());
        (data, dirs, renamed)
    });
}

#[test]
fn device_nodes_work_on_a_mount_made_by_root() {
    on_both("dev_nodes", &[], |dir| {
        // A mount root makes, like a loop mount of the kernel's btrfs, lets device nodes
        // be opened (FUSE's own default is nodev).
        let p = dir.join("null");
        let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: mknod of a character device (1, 3: /dev/null) at a path we own.
        let r = unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR | 0o666, libc::makedev(1, 3)) };
        let opened = OpenOptions::new()
            .write(true)
            .open(&p)
            .and_then(|mut f| std::io::Write::write_all(&mut f, b"gone"))
            .map_err(|e| e.raw_os_error());
        (r, opened)
    });
}
