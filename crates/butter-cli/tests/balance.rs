//! `butter balance start` offline with the kernel's filters: the empty block groups the
//! filters select are removed (the kernel then shows less allocated, both checkers are clean,
//! the files are the same), groups in use are relocated (-dusage=100 -musage=100), after
//! which `filesystem resize min` gives their device space back; what the kernel refuses (a
//! profile without its devices, less metadata redundancy or system chunks without --force),
//! an unknown filter, and a balance without filters or --full-balance change nothing.
//!
//! Needs root, loop devices, kernel btrfs and btrfs-progs: fails without them under CI.

mod common;

use common::fuse_mount::ButterMount;
use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, TakeOpts};
use common::{output_text as text, run_butter as butter};
use std::fs;
use std::path::Path;
use std::process::Command;

/// `btrfs filesystem df` of a kernel mount, with the kernel's view of the files.
fn kernel_view(img: &Path, s: &ScratchDir, name: &str) -> (String, manifest::Manifest) {
    let m = LoopMount::btrfs_ro(img, &s.dir(name));
    let df = kernel::run(
        Command::new("btrfs")
            .args(["filesystem", "df", "-b"])
            .arg(m.path()),
    );
    let man = manifest::take(m.path(), &TakeOpts::default());
    m.unmount();
    (df, man)
}

/// Total bytes of the data block groups in `btrfs filesystem df -b` output.
fn data_total(df: &str) -> u64 {
    df.lines()
        .find(|l| l.starts_with("Data,"))
        .and_then(|l| l.split("total=").nth(1))
        .and_then(|t| t.split(',').next())
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or_else(|| panic!("no data total in:\n{df}"))
}

#[test]
fn usage_zero_removes_empty_groups_and_the_rest_is_refused_unchanged() {
    if !common::fuse_mount::require("balance", &[]) || !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("balance");
    let img = s.join("fs.img");
    kernel::mkfs_btrfs(&img, 1 << 30, &["-O", "block-group-tree"]);
    // Through butter: a big file makes data chunks; deleting it leaves them empty (butter,
    // unlike the kernel's cleaner, does not remove unused block groups by itself).
    {
        let m = ButterMount::start(&img, &s.dir("bm"), &["-o", "uring=off"], &s.join("b.log"));
        fs::create_dir(m.path().join("keep")).unwrap();
        for i in 0..20 {
            fs::write(m.path().join(format!("keep/f{i}")), vec![i as u8; 40_000]).unwrap();
        }
        fs::write(m.path().join("big"), vec![9u8; 300 << 20]).unwrap();
        m.unmount();
        let m = ButterMount::start(&img, &s.dir("bm2"), &["-o", "uring=off"], &s.join("b2.log"));
        fs::remove_file(m.path().join("big")).unwrap();
        m.unmount();
    }
    let (df0, want) = kernel_view(&img, &s, "k0");
    let before = fs::read(&img).unwrap();
    let i = img.to_str().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (&["balance", "start", i], &["--full-balance"]),
        (
            &["balance", "start", "-dconvert=raid1", i],
            &["RAID1", "needs 2 devices"],
        ),
        (
            &["balance", "start", "-mconvert=single", i],
            &["reduces", "--force"],
        ),
        (
            &["balance", "start", "-sconvert=single", i],
            &["system chunks", "--force"],
        ),
        (
            &["balance", "start", "-dfoo=1", i],
            &["unknown balance filter"],
        ),
        (
            &["balance", "start", "-dsoft", i],
            &["only goes with convert"],
        ),
        (&["balance", "resume", i], &["no balance to resume"]),
        (&["balance", "cancel", i], &["no balance to cancel"]),
    ];
    for (args, want) in cases {
        let o = butter(args);
        let t = text(&o);
        assert!(!o.status.success(), "butter {args:?} succeeded:\n{t}");
        assert!(!t.contains("panicked"), "{t}");
        for w in *want {
            assert!(t.contains(w), "butter {args:?}: no {w:?} in:\n{t}");
        }
    }
    assert!(
        fs::read(&img).unwrap() == before,
        "a refused balance changed the image"
    );

    let o = butter(&["balance", "start", "-dusage=0", "-musage=0", i]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("Done, had to relocate"), "{}", text(&o));
    let (rc, out) = common::fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check after the balance:\n{out}");
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after the balance:\n{t}");
    let (df1, got) = kernel_view(&img, &s, "k1");
    assert!(
        data_total(&df1) + (200 << 20) < data_total(&df0),
        "the empty data groups are gone:\nbefore\n{df0}\nafter\n{df1}"
    );
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::restore(),
        "files after the balance",
    );

    // Relocation: every group under 100% used moves (the kernel's -dusage=100 does the
    // same), and the files are the same through the kernel.
    let o = butter(&["balance", "start", "-dusage=100", "-musage=100", i]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    let n: usize = t
        .split("relocate ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no count in {t}"));
    assert!(n >= 2, "{t}");
    let o = butter(&["balance", "status", i]);
    assert!(text(&o).contains("No balance found"), "{}", text(&o));
    let (rc, out) = common::fuse_mount::butter_check(&img);
    assert_eq!(rc, 0, "butter check after relocation:\n{out}");
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after relocation:\n{t}");
    let (_, got) = kernel_view(&img, &s, "k-rel");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::restore(),
        "files after relocation",
    );

    // Their device space comes back: the image shrinks to its last chunk.
    let o = butter(&["filesystem", "resize", i, "min"]);
    assert!(o.status.success(), "{}", text(&o));
    let len = fs::metadata(&img).unwrap().len();
    assert!(len < 600 << 20, "the image is still {len} bytes");
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after resize min:\n{t}");
    let (_, got) = kernel_view(&img, &s, "k2");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::restore(),
        "files after resize min",
    );
    // The kernel writes into the shrunk filesystem (small files: min leaves its metadata
    // room and its data chunks full).
    let m = LoopMount::btrfs(&img, &s.dir("k3"), "");
    for k in 0..20 {
        fs::write(m.path().join(format!("new{k}")), b"small").unwrap();
    }
    m.unmount();
    let (ok, t) = kernel::btrfs_check(&img);
    assert!(ok, "btrfs check after the kernel wrote:\n{t}");
}
