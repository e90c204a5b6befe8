//! FUSE over io_uring, the transport itself (`butter mount -o uring=...`); pjdfstest, fsx,
//! fuse_crash and deferred_diff run their cases over it too.
//!
//! - Requests the kernel holds while the queues come up (programs using the mount the moment
//!   it appears) are served: the last queue's registration makes the ring ready and hands
//!   them straight to that queue's entries. (A queue once took that for a failed start and
//!   stopped, and every request on the mount waited forever.)
//! - Without the kernel's offer (`enable_uring` N), `-o uring=on` says so and serves through
//!   /dev/fuse; `-o uring=off` never starts queues even when offered.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs, fusermount3 and
//! /sys/module/fuse/parameters/enable_uring (Linux 6.14 or later). Without them it prints a
//! notice and passes, unless CI is set: then it fails.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::ScratchDir;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const IMAGE_SIZE: u64 = 256 << 20;
const ENABLE_URING: &str = "/sys/module/fuse/parameters/enable_uring";

fn ready(test: &str) -> bool {
    if !fuse_mount::require(test, &[]) {
        return false;
    }
    if !Path::new(ENABLE_URING).exists() {
        return !fuse_mount::missing(test, ENABLE_URING);
    }
    true
}

fn ring_threads(bm: &ButterMount) -> usize {
    bm.thread_names()
        .iter()
        .filter(|n| n.starts_with("butter-ring-"))
        .count()
}

#[test]
fn requests_waiting_while_the_queues_start_are_served() {
    if !ready("fuse_uring") {
        return;
    }
    let sc = ScratchDir::new("fuse-uring-start");
    let img = sc.join("b.img");
    fuse_mount::fresh_image(&img, IMAGE_SIZE);
    for round in 0..6 {
        let mnt = sc.dir(format!("mnt{round}"));
        // Stats of the mount point from both CPUs, running before the mount exists and
        // while it comes up: the kernel holds them until the queues are ready.
        let stop = Arc::new(AtomicBool::new(false));
        let served = Arc::new(AtomicU64::new(0));
        let hammers: Vec<_> = (0..4)
            .map(|_| {
                let (stop, served, p) = (stop.clone(), served.clone(), mnt.join("."));
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        if std::fs::metadata(&p).is_ok_and(|m| m.ino() == 256) {
                            served.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        let bm = ButterMount::start(
            &img,
            &mnt,
            &["-o", "uring=on"],
            &sc.join(format!("butter-{round}.log")),
        );
        // Stats answered by butter (inode 256, the subvolume root) keep coming.
        let deadline = Instant::now() + Duration::from_secs(20);
        let before = served.load(Ordering::Relaxed);
        while served.load(Ordering::Relaxed) < before + 100 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        let got = served.load(Ordering::Relaxed) - before;
        stop.store(true, Ordering::Relaxed);
        // A hung mount would hang the joins: unmount first if nothing was served.
        assert!(
            got >= 100,
            "round {round}: only {got} stats served in 20 s over io_uring:\n{}",
            bm.log_text()
        );
        for h in hammers {
            h.join().unwrap();
        }
        eprintln!(
            "round {round}: {got} stats served, queue threads {}",
            ring_threads(&bm)
        );
        assert!(ring_threads(&bm) >= 1, "round {round}: no queue threads");
        assert!(
            !bm.log_text().contains("did not start"),
            "round {round}: the ring did not start:\n{}",
            bm.log_text()
        );
        std::fs::write(mnt.join(format!("f{round}")), b"over the ring").unwrap();
        bm.unmount();
    }
    let (rc, out) = fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check:\n{out}");
    fuse_mount::verify_image(&img, &sc.join("kmnt"), None, "after the ring mounts");
}

/// `uring=on` without the kernel's offer warns and serves through /dev/fuse; `uring=off`
/// starts no queues even when offered.
#[test]
fn the_ring_only_where_offered_and_wanted() {
    if !ready("fuse_uring") {
        return;
    }
    let sc = ScratchDir::new("fuse-uring-offer");
    let img = sc.join("b.img");
    fuse_mount::fresh_image(&img, IMAGE_SIZE);
    {
        // Offered, but off.
        let _offer = fuse_mount::UringWindow::open_as("Y");
        let bm = ButterMount::start(&img, &sc.dir("m1"), &["-o", "uring=off"], &sc.join("a.log"));
        std::fs::write(bm.path().join("a"), b"a").unwrap();
        assert_eq!(ring_threads(&bm), 0, "uring=off started queues");
        bm.unmount();
    }
    // Wanted, not offered: butter mount run by hand (ButterMount would offer it).
    let _no_offer = fuse_mount::UringWindow::open_as("N");
    let mnt = sc.dir("m2");
    let log = sc.join("b.log");
    let out = std::fs::File::create(&log).unwrap();
    let mut child = std::process::Command::new(fuse_mount::BUTTER)
        .args(["mount", "-o", "uring=on"])
        .arg(&img)
        .arg(&mnt)
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !fuse_mount::mounted_type(&mnt).is_some_and(|t| t.starts_with("fuse")) {
        assert!(Instant::now() < deadline, "not mounted in 30 s");
        assert!(child.try_wait().unwrap().is_none(), "butter mount exited");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::fs::write(mnt.join("b"), b"b").unwrap();
    assert_eq!(std::fs::read(mnt.join("a")).unwrap(), b"a");
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", child.id()))
        .unwrap()
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .collect();
    assert!(
        !threads.iter().any(|n| n.starts_with("butter-ring")),
        "queues without the kernel's offer: {threads:?}"
    );
    let st = std::process::Command::new("fusermount3")
        .arg("-u")
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(st.success());
    assert!(child.wait().unwrap().success());
    let text = std::fs::read_to_string(&log).unwrap();
    assert!(
        text.contains("does not offer FUSE over io_uring"),
        "no warning that the ring is not offered:\n{text}"
    );
    drop(_no_offer);
    fuse_mount::verify_image(&img, &sc.join("kmnt"), None, "after both mounts");
}
