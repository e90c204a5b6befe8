//! Devices on other machines through NBD, on loopback: nbdkit (Debian's NBD server) serves
//! image files over TCP on 127.0.0.1 and over a Unix socket, and butter uses them as devices
//! of a filesystem (`--device nbd://HOST:PORT/NAME`, `-o device=nbd+unix:///NAME?socket=PATH`).
//!
//! - A three-device RAID1 of one local file and two NBD exports, mounted read-write through
//!   butter: files written, then (the servers stopped) butter check and btrfs check of the
//!   files, and a kernel mount of them shows what butter's mount showed.
//! - nbdkit's error filter failing every read of one export once a read-only mount is up:
//!   every file read through the mount comes from the other copy, as the kernel shows it.
//! - A server that is not there, or not NBD, is an error naming the address.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs and nbdkit (scripts/
//! install-deps installs it). Without them: a notice and a pass, or a failure under CI.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::{self, MultiLoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, TakeOpts};
use common::nbd::Server;
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{output_text as text, run_butter as butter};

fn require() -> bool {
    fuse_mount::require("nbd", &["nbdkit"]) && kernel::require_privileges()
}

fn make_raid1(s: &ScratchDir, n: usize) -> Vec<PathBuf> {
    let images: Vec<PathBuf> = (0..n).map(|i| s.join(format!("dev{i}.img"))).collect();
    for img in &images {
        std::fs::File::create(img)
            .unwrap()
            .set_len(400 << 20)
            .unwrap();
    }
    kernel::run(
        Command::new("mkfs.btrfs")
            .args(["-f", "-q", "-d", "raid1", "-m", "raid1"])
            .args(&images),
    );
    images
}

fn write_tree(root: &Path) {
    let mut x = 0x1234_5678_9abc_def1u64;
    let mut bytes = |n: usize| -> Vec<u8> {
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    };
    std::fs::create_dir_all(root.join("a/b")).unwrap();
    for i in 0..50usize {
        std::fs::write(root.join(format!("a/b/f{i}")), bytes(100 + i * 4099)).unwrap();
    }
    std::fs::write(root.join("big"), bytes(24 << 20)).unwrap();
    std::os::unix::fs::symlink("a/b/f1", root.join("link")).unwrap();
    std::fs::remove_file(root.join("a/b/f7")).unwrap();
}

#[test]
fn raid1_of_a_file_and_two_nbd_exports_mounts_read_write() {
    if !require() {
        return;
    }
    let s = ScratchDir::new("nbd-raid1");
    let images = make_raid1(&s, 3);
    let tcp = Server::start(&images[1], None, &[], &[]);
    let unix = Server::start(&images[2], Some(&s.join("nbd.sock")), &[], &[]);
    let opts = format!("device={},device={}", tcp.addr, unix.addr);
    let m = ButterMount::start(
        &images[0],
        &s.dir("bmnt"),
        &["-o", &opts],
        &s.join("butter.log"),
    );
    write_tree(m.path());
    let seen = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    // Through the servers, then (stopped) from the files themselves.
    let o = butter(&[
        "check",
        images[0].to_str().unwrap(),
        "--device",
        &tcp.addr,
        "--device",
        &unix.addr,
    ]);
    assert!(o.status.success(), "butter check over NBD:\n{}", text(&o));
    drop(tcp);
    drop(unix);
    let o = butter(&[
        "check",
        images[0].to_str().unwrap(),
        "--device",
        images[1].to_str().unwrap(),
        "--device",
        images[2].to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "butter check of the files:\n{}",
        text(&o)
    );
    let (ok, t) = kernel::btrfs_check_devices(&images);
    assert!(ok, "btrfs check of the files:\n{t}");
    let km = MultiLoopMount::new(&images, &s.dir("kmnt"), "ro,noatime");
    let got = manifest::take(km.path(), &TakeOpts::default());
    km.unmount();
    let copts = CompareOpts {
        atime: false,
        ..CompareOpts::fuse()
    };
    manifest::assert_same(&seen, &got, &copts, "butter mount over NBD vs the kernel");
}

/// The other NBD servers Debian ships that need no root, side by side: a four-device
/// filesystem (metadata RAID1C4, data RAID1) of one local file, an export of qemu-nbd, one of
/// nbd-server and one of nbdkit behind its delay filter (every read 1 ms, every write 2 ms
/// late), made by `butter mkfs` through the servers and mounted read-write through butter;
/// then butter check through the servers, and, the servers stopped, both checkers and the
/// kernel on the files. A read-only export is refused by mkfs.
#[test]
fn raid1_over_qemu_nbd_nbd_server_and_a_slow_nbdkit() {
    if !require()
        || !fuse_mount::require(
            "raid1_over_qemu_nbd_nbd_server_and_a_slow_nbdkit",
            &["qemu-nbd", "nbd-server"],
        )
    {
        return;
    }
    let s = ScratchDir::new("nbd-servers");
    let images: Vec<PathBuf> = (0..4).map(|i| s.join(format!("dev{i}.img"))).collect();
    for img in &images {
        std::fs::File::create(img)
            .unwrap()
            .set_len(300 << 20)
            .unwrap();
    }
    let servers = vec![
        Server::qemu(&images[1]),
        Server::nbd_server(&images[2], &s.dir("nbd-server")),
        Server::start(
            &images[3],
            None,
            &["--filter=delay"],
            &["delay-read=1ms", "delay-write=2ms"],
        ),
    ];
    let addrs: Vec<String> = servers.iter().map(|x| x.addr.clone()).collect();
    // A read-only export is refused by name before anything is written.
    std::fs::File::create(s.join("ro.img"))
        .unwrap()
        .set_len(300 << 20)
        .unwrap();
    let ro = Server::start(&s.join("ro.img"), None, &["-r"], &[]);
    let o = butter(&["mkfs", images[0].to_str().unwrap(), &ro.addr]);
    assert!(
        !o.status.success() && text(&o).contains("read-only"),
        "mkfs on a read-only export: {}",
        text(&o)
    );
    assert!(
        std::fs::read(&images[0]).unwrap().iter().all(|&b| b == 0),
        "a refused mkfs wrote"
    );
    drop(ro);
    // butter mkfs makes the filesystem through the servers.
    let mut mkfs: Vec<&str> = vec!["mkfs", "-q", "-m", "raid1c4", "-d", "raid1"];
    mkfs.push(images[0].to_str().unwrap());
    mkfs.extend(addrs.iter().map(|a| a.as_str()));
    let o = butter(&mkfs);
    assert!(o.status.success(), "butter {mkfs:?}:\n{}", text(&o));
    let opts: Vec<String> = addrs.iter().map(|a| format!("device={a}")).collect();
    let m = ButterMount::start(
        &images[0],
        &s.dir("bmnt"),
        &["-o", &opts.join(",")],
        &s.join("butter.log"),
    );
    write_tree(m.path());
    let seen = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    let (rc, out) = fuse_mount::butter_check_set(&images[0], &addrs);
    assert_eq!(
        rc, 0,
        "butter check through qemu-nbd, nbd-server and nbdkit:\n{out}"
    );
    drop(servers);
    let paths: Vec<String> = images[1..]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    fuse_mount::verify_image_set(
        &images,
        &paths,
        &s.dir("kmnt"),
        Some(&seen),
        "written through qemu-nbd, nbd-server and nbdkit",
    );
}

#[test]
fn a_failing_export_is_read_around_and_bad_addresses_are_named() {
    if !require() {
        return;
    }
    let s = ScratchDir::new("nbd-faults");
    let images = make_raid1(&s, 2);
    let km = MultiLoopMount::new(&images, &s.dir("fill"), "");
    write_tree(km.path());
    km.unmount();
    let km = MultiLoopMount::new(&images, &s.dir("kro"), "ro,noatime");
    let want = manifest::take(km.path(), &TakeOpts::default());
    km.unmount();
    // Every read of the second device fails once the trigger file exists: after the mount
    // has read its superblock. Reading every file through the mount uses the first copy.
    let trigger = s.join("fail-now");
    let rate = format!("error-pread-file={}", trigger.display());
    let failing = Server::start(
        &images[1],
        None,
        &["--filter=error"],
        &["error=EIO", "error-pread-rate=100%", &rate],
    );
    let opts = format!("ro,device={}", failing.addr);
    let m = ButterMount::start(
        &images[0],
        &s.dir("bmnt"),
        &["-o", &opts],
        &s.join("butter.log"),
    );
    std::fs::write(&trigger, b"").unwrap();
    let got = manifest::take(m.path(), &TakeOpts::default());
    let log = m.log_text();
    m.unmount();
    let copts = CompareOpts {
        atime: false,
        ..CompareOpts::fuse()
    };
    manifest::assert_same(
        &want,
        &got,
        &copts,
        "a mount with one export failing every read",
    );
    assert!(
        log.contains("an earlier copy was bad"),
        "no read went to the failing export:\n{log}"
    );
    // A device whose superblock cannot be read is named; left out, --degraded reads the rest.
    let o = butter(&["ls", images[0].to_str().unwrap(), "--device", &failing.addr]);
    assert!(
        !o.status.success() && text(&o).contains(&failing.addr),
        "{}",
        text(&o)
    );
    drop(failing);
    let out = s.dir("restored");
    let o = butter(&[
        "restore",
        images[0].to_str().unwrap(),
        out.to_str().unwrap(),
        "--degraded",
    ]);
    assert!(o.status.success(), "degraded restore:\n{}", text(&o));
    let got = manifest::take(&out, &TakeOpts::default());
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::restore(),
        "restore without the second device",
    );
    // Nobody there; something that is not NBD; a malformed address.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let nobody = format!("nbd://127.0.0.1:{port}/x");
    let o = butter(&["ls", images[0].to_str().unwrap(), "--device", &nobody]);
    assert!(
        !o.status.success() && text(&o).contains(&nobody),
        "{}",
        text(&o)
    );
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let not_nbd = format!(
        "nbd://127.0.0.1:{}/x",
        listener.local_addr().unwrap().port()
    );
    let t = std::thread::spawn(move || {
        if let Ok((mut c, _)) = listener.accept() {
            use std::io::Write;
            let _ = c.write_all(b"SSH-2.0-OpenSSH_9.2\r\n\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0");
        }
    });
    let o = butter(&["ls", images[0].to_str().unwrap(), "--device", &not_nbd]);
    t.join().unwrap();
    assert!(
        !o.status.success() && text(&o).contains("not a newstyle NBD server"),
        "{}",
        text(&o)
    );
    assert!(!text(&o).contains("panicked"));
    let o = butter(&[
        "ls",
        images[0].to_str().unwrap(),
        "--device",
        "nbd+unix:///x",
    ]);
    assert!(
        !o.status.success() && text(&o).contains("socket=PATH"),
        "{}",
        text(&o)
    );
}

/// Losing a server while mounted read-write: the writes that reach it fail, the device is
/// dropped and the mount goes on with the other two copies (as the kernel's RAID1 goes on);
/// when the server returns, `butter scrub` repairs what it missed.
#[test]
fn losing_an_nbd_server_goes_on_degraded_and_scrub_repairs_its_return() {
    if !require() {
        return;
    }
    let s = ScratchDir::new("nbd-lost");
    let images = make_raid1(&s, 3);
    let tcp = Server::start(&images[1], None, &[], &[]);
    let unix = Server::start(&images[2], Some(&s.join("nbd.sock")), &[], &[]);
    let opts = format!("device={},device={}", tcp.addr, unix.addr);
    let log = s.join("butter.log");
    let m = ButterMount::start(&images[0], &s.dir("bmnt"), &["-o", &opts], &log);
    write_tree(m.path());
    kernel::sync_all();
    drop(tcp);
    // Writes go on, and a sync commits them (the lost device takes no superblock).
    std::fs::create_dir_all(m.path().join("after")).unwrap();
    for i in 0..20 {
        std::fs::write(
            m.path().join(format!("after/g{i}")),
            vec![i as u8; 50_000 + i * 999],
        )
        .unwrap();
    }
    kernel::sync_all();
    let seen = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    let log = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        log.contains("failed") && log.contains("degraded"),
        "no device was dropped:\n{log}"
    );
    drop(unix);
    // The server comes back (on another port) with what it had.
    let back = Server::start(&images[1], None, &[], &[]);
    let o = butter(&[
        "scrub",
        "start",
        images[0].to_str().unwrap(),
        "--device",
        &back.addr,
        "--device",
        images[2].to_str().unwrap(),
    ]);
    assert!(
        o.status.success(),
        "scrub with the server back:\n{}",
        text(&o)
    );
    drop(back);
    let args = [
        "check",
        images[0].to_str().unwrap(),
        "--device",
        images[1].to_str().unwrap(),
        "--device",
        images[2].to_str().unwrap(),
    ];
    let o = butter(&args);
    assert!(
        o.status.success(),
        "butter check after the scrub:\n{}",
        text(&o)
    );
    let (ok, t) = kernel::btrfs_check_devices(&images);
    assert!(ok, "btrfs check after the scrub:\n{t}");
    let km = MultiLoopMount::new(&images, &s.dir("kmnt"), "ro,noatime");
    let got = manifest::take(km.path(), &TakeOpts::default());
    km.unmount();
    let copts = CompareOpts {
        atime: false,
        ..CompareOpts::fuse()
    };
    manifest::assert_same(
        &seen,
        &got,
        &copts,
        "after losing a server, seen by the kernel",
    );
}
