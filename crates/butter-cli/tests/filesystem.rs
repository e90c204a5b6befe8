//! `butter filesystem df` and `butter filesystem label` against btrfs-progs on a kernel
//! mount: df prints the Data, System and Metadata lines `btrfs filesystem df` prints (its
//! GlobalReserve line is the running kernel's, not on disk), for a mkfs.btrfs image the
//! kernel filled and for a butter-made one; a label butter sets is the one the kernel shows,
//! and both checkers stay clean. Needs root, loop devices and btrfs-progs; without them the
//! test prints a notice and passes, unless CI is set.

mod common;

use common::fuse_mount::{self, butter_check, BUTTER};
use common::kernel::{self, LoopMount, ScratchDir};
use std::process::Command;

fn butter(args: &[&str]) -> String {
    let out = kernel::run_output(Command::new(BUTTER).args(args));
    assert!(
        out.status.success(),
        "butter {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn df_and_label_match_btrfs_progs() {
    if !fuse_mount::require("df_and_label_match_btrfs_progs", &[]) {
        return;
    }
    let sc = ScratchDir::new("filesystem");
    let kimg = sc.join("k.img");
    fuse_mount::fresh_image(&kimg, 512 << 20);
    {
        let m = LoopMount::btrfs(&kimg, &sc.dir("m"), "");
        std::fs::write(m.path().join("f"), vec![7u8; 40 << 20]).unwrap();
        for i in 0..300 {
            std::fs::write(m.path().join(format!("s{i}")), format!("{i}")).unwrap();
        }
        m.unmount();
    }
    let bimg = sc.join("b.img");
    std::fs::File::create(&bimg)
        .unwrap()
        .set_len(512 << 20)
        .unwrap();
    butter(&["mkfs", "-L", "before", bimg.to_str().unwrap()]);
    for img in [&kimg, &bimg] {
        let ours = butter(&["filesystem", "df", img.to_str().unwrap()]);
        let m = LoopMount::btrfs_ro(img, &sc.dir("m"));
        let theirs = kernel::sh("btrfs", &["filesystem", "df", m.path().to_str().unwrap()]);
        m.unmount();
        let theirs: String = theirs
            .lines()
            .filter(|l| !l.starts_with("GlobalReserve"))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(ours, theirs, "df of {}", img.display());
    }
    assert_eq!(
        butter(&["filesystem", "label", bimg.to_str().unwrap()]),
        "before\n"
    );
    butter(&["filesystem", "label", bimg.to_str().unwrap(), "a new label"]);
    assert_eq!(
        butter(&["filesystem", "label", bimg.to_str().unwrap()]),
        "a new label\n"
    );
    let (rc, out) = butter_check(&bimg);
    assert_eq!(rc, 0, "butter check after the label:\n{out}");
    kernel::assert_btrfs_check(&bimg);
    let m = LoopMount::btrfs_ro(&bimg, &sc.dir("m"));
    let theirs = kernel::sh(
        "btrfs",
        &["filesystem", "label", m.path().to_str().unwrap()],
    );
    m.unmount();
    assert_eq!(theirs.trim_end(), "a new label");
    let long = "x".repeat(256);
    let out = kernel::run_output(Command::new(BUTTER).args([
        "filesystem",
        "label",
        bimg.to_str().unwrap(),
        &long,
    ]));
    assert!(!out.status.success(), "a 256-byte label was accepted");
}
