//! `Fs::set_memory`: the blocks a transaction changes are held in memory until its commit,
//! so past the dirty limit a change commits (as the kernel's btrfs commits when its dirty
//! metadata passes a threshold). Seen from outside: after many creates and no commit asked
//! for, an image dropped without closing (a crash) keeps most of them with a limit, and none
//! without one.

mod crash_support;

use butter::fs::{Fs, MemoryLimits};
use butter::internals::RamDevice;
use butter::mkfs::Profile;
use crash_support::*;
use std::sync::Arc;

const FILES: usize = 3000;

/// Creates FILES files under `limits` and drops the filesystem without a commit; returns how
/// many a fresh open of the device shows.
fn files_after_crash(limits: Option<MemoryLimits>) -> usize {
    let dev = Arc::new(RamDevice::new(fresh_image(
        256 << 20,
        Profile::Dup,
        Profile::Single,
    )));
    let fs = Fs::open_device_rw(dev.clone()).expect("open fresh image");
    if let Some(m) = limits {
        fs.set_memory(m);
    }
    let root = fs.root_inode();
    let dir = fs.mkdir(root, b"d", 0o755, OWNER).unwrap();
    for i in 0..FILES {
        fs.create(dir, format!("f{i}").as_bytes(), 0o644, OWNER)
            .unwrap();
    }
    drop(fs);
    let fs = Fs::open_device_rw(dev.clone()).expect("reopen after the crash");
    let found = match fs.resolve_in(fs.root_inode(), b"d") {
        Ok(d) => fs.readdir(d, 0, usize::MAX).unwrap().len(),
        Err(_) => 0,
    };
    let opts = butter::check::Options {
        check_data_csum: true,
    };
    let report = fs.check(opts, &mut |_| {}).unwrap();
    assert!(
        report.is_clean(),
        "checker after the crash: {:?}",
        report.findings
    );
    found
}

#[test]
fn past_the_dirty_limit_a_change_commits() {
    let none = files_after_crash(None);
    assert_eq!(none, 0, "without a limit nothing was committed");
    let limited = files_after_crash(Some(MemoryLimits {
        cache: 1 << 20,
        dirty: 256 << 10,
    }));
    assert!(
        limited >= FILES / 2,
        "with a 256 KiB dirty limit only {limited} of {FILES} creates were committed"
    );
}
