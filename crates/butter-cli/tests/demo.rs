//! The README's first command, `scripts/demo`, as a new user runs it (as root, no sudo): it
//! must end well and show butter's main jobs: mkfs from a directory, both checkers, a change
//! through a read-write mount, a snapshot sent and received into a second image, and the
//! kernel's btrfs reading the copy as the directory plus the change.
//!
//! The release binary has no debug info (under 20 MB).
//!
//! Needs root, FUSE, loop devices and btrfs-progs; fails under CI without.

mod common;

use common::fuse_mount;
use common::kernel::ScratchDir;
use std::path::Path;
use std::process::Command;

#[test]
fn the_demo_runs_as_written() {
    if !fuse_mount::require("the_demo_runs_as_written", &["setfattr"]) {
        return;
    }
    let sc = ScratchDir::new("demo");
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let out = Command::new("bash")
        .arg(repo.join("scripts/demo"))
        .env("DEMO_DIR", sc.join("work"))
        .output()
        .expect("run scripts/demo");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "scripts/demo failed:\n{text}");
    for step in [
        "butter mkfs --rootdir",
        "btrfs check: clean",
        "butter mount (read-write",
        "butter unmount",
        "sent and received",
        "the kernel shows the directory as changed through the mount",
    ] {
        assert!(
            text.contains(step),
            "the demo did not show {step:?}:\n{text}"
        );
    }
}

/// The binary the README points at is lean: no debug info in the release profile (58 MB
/// with it; `cargo build --profile profiling` keeps it for perf and gdb).
#[test]
#[cfg(not(debug_assertions))]
fn the_release_binary_is_lean() {
    let bin = env!("CARGO_BIN_EXE_butter");
    let len = std::fs::metadata(bin).unwrap().len();
    assert!(len < 20 << 20, "{bin} is {len} bytes");
}
