//! `butter filesystem resize` offline, against the kernel's resize on a mount: growing (the
//! image file extended, the kernel then fills the new space), `max`, shrinking over chunks
//! the kernel wrote a file into (relocated below the new end, the file cut), `min`, a device
//! of a RAID1 by DEVID, and what is refused (below what the device holds, a device that is
//! not there, bad sizes) with nothing changed.
//! After each change both checkers are clean and the kernel mounts the image; the device and
//! filesystem sizes in the superblock are the ones the kernel's own resize writes.
//!
//! Needs root, loop devices, kernel btrfs and btrfs-progs: fails without them under CI.

mod common;

use common::kernel::{self, LoopMount, MultiLoopMount, ScratchDir};
use common::{output_text as text, run_butter as butter};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MIB: u64 = 1 << 20;

/// (filesystem total_bytes, device 1's total_bytes) from the primary superblock.
fn sizes(img: &Path) -> (u64, u64) {
    (
        kernel::super_field(img, "total_bytes"),
        kernel::super_field(img, "dev_item.total_bytes"),
    )
}

fn resize(img: &Path, spec: &str, extra: &[&str]) -> std::process::Output {
    let mut a = vec!["filesystem", "resize", img.to_str().unwrap(), spec];
    a.extend(extra);
    butter(&a)
}

/// Both checkers clean, and the kernel mounts it and lists `file`.
fn checked(img: &Path, s: &ScratchDir, what: &str) {
    let (rc, out) = common::fuse_mount::butter_check(img);
    assert_eq!(rc, 0, "{what}: butter check:\n{out}");
    let (ok, t) = kernel::btrfs_check(img);
    assert!(ok, "{what}: btrfs check:\n{t}");
    let m = LoopMount::btrfs_ro(img, &s.dir(format!("{}.ro", what.replace(' ', "-"))));
    assert!(
        m.path().join("file").is_file(),
        "{what}: the kernel lost the file"
    );
    m.unmount();
}

/// The kernel's resize of a copy of `img` (its loop device as long as `len`): the sizes
/// its superblock then has.
fn kernel_resize(img: &Path, s: &ScratchDir, spec: &str, len: u64) -> (u64, u64) {
    let copy = img.with_extension("kernel.img");
    fs::copy(img, &copy).unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(&copy)
        .unwrap()
        .set_len(len)
        .unwrap();
    let m = LoopMount::btrfs(&copy, &s.dir("k-resize"), "");
    kernel::run(
        Command::new("btrfs")
            .args(["filesystem", "resize", spec])
            .arg(m.path()),
    );
    m.unmount();
    let got = sizes(&copy);
    fs::remove_file(&copy).unwrap();
    got
}

#[test]
fn grow_max_shrink_and_min_as_the_kernel_resizes() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("resize");
    let img = s.join("fs.img");
    kernel::mkfs_btrfs(&img, 300 * MIB, &["-O", "block-group-tree"]);
    {
        let m = LoopMount::btrfs(&img, &s.dir("fill"), "");
        fs::write(m.path().join("file"), vec![7u8; 5 << 20]).unwrap();
        m.unmount();
    }

    // Grow by 200 MiB: the file grows, the sizes are the kernel's.
    let want = kernel_resize(&img, &s, "+200M", 500 * MIB);
    let o = resize(&img, "+200M", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("from 300.00MiB to 500.00MiB"),
        "{}",
        text(&o)
    );
    assert_eq!(fs::metadata(&img).unwrap().len(), 500 * MIB);
    assert_eq!(sizes(&img), want, "sizes after +200M, butter vs the kernel");
    assert_eq!(want, (500 * MIB, 500 * MIB));
    checked(&img, &s, "grown");
    // The kernel uses the new space: more than the old size holds.
    {
        let m = LoopMount::btrfs(&img, &s.dir("big"), "");
        fs::write(m.path().join("big"), vec![1u8; 380 << 20])
            .expect("the kernel writes 380 MiB into the grown filesystem");
        fs::remove_file(m.path().join("big")).unwrap();
        m.unmount();
    }
    checked(&img, &s, "filled");

    // max: the whole file, after it was made longer.
    fs::OpenOptions::new()
        .write(true)
        .open(&img)
        .unwrap()
        .set_len(700 * MIB)
        .unwrap();
    let want = kernel_resize(&img, &s, "max", 700 * MIB);
    let o = resize(&img, "max", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(sizes(&img), want, "sizes after max, butter vs the kernel");
    checked(&img, &s, "max");

    // Shrinking over chunks relocates them below the new end, as the kernel's shrink does:
    // the kernel writes a file into chunks past 260 MiB, and both shrink to 260 MiB.
    {
        let m = LoopMount::btrfs(&img, &s.dir("late"), "");
        fs::write(m.path().join("late"), vec![8u8; 100 << 20]).unwrap();
        m.unmount();
    }
    let past = kernel::run(
        Command::new("btrfs")
            .args(["inspect-internal", "dump-tree", "-t", "dev"])
            .arg(&img),
    )
    .lines()
    .filter_map(|l| l.split("DEV_EXTENT ").nth(1))
    .filter_map(|t| t.split(')').next()?.trim().parse::<u64>().ok())
    .any(|off| off >= 260 * MIB);
    assert!(past, "the kernel put no chunk past 260 MiB");
    let want = kernel_resize(&img, &s, "260M", 700 * MIB);
    let o = resize(&img, "260M", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(sizes(&img), want, "sizes after 260M, butter vs the kernel");
    assert_eq!(fs::metadata(&img).unwrap().len(), 260 * MIB);
    checked(&img, &s, "relocated");
    {
        let m = LoopMount::btrfs_ro(&img, &s.dir("late-ro"));
        assert!(fs::read(m.path().join("late")).unwrap() == vec![8u8; 100 << 20]);
        m.unmount();
    }

    // Below what the device holds, it is refused by name before anything moves.
    let before = fs::read(&img).unwrap();
    let o = resize(&img, "10M", &[]);
    assert!(
        !o.status.success(),
        "shrinking below the contents: {}",
        text(&o)
    );
    assert!(
        text(&o).contains("holds") && text(&o).contains("min"),
        "{}",
        text(&o)
    );
    assert!(
        fs::read(&img).unwrap() == before,
        "a refused shrink changed the image"
    );

    // min (spelt --shrink-to-min): down to where the last chunk ends, the file cut there;
    // then shrinking by a little more is refused.
    let o = butter(&[
        "filesystem",
        "resize",
        "--shrink-to-min",
        img.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let (total, dev) = sizes(&img);
    assert_eq!(total, dev);
    // The kernel's deleted 380 MiB left empty data groups past the first: min takes them
    // away too, so the filesystem ends below its first size.
    assert!(dev < 300 * MIB, "min gave {dev}");
    assert_eq!(
        fs::metadata(&img).unwrap().len(),
        dev,
        "the file is cut at the new end"
    );
    checked(&img, &s, "min");
    let o = resize(&img, "-1M", &[]);
    assert!(!o.status.success(), "{}", text(&o));

    // Growing again, then a shrink that frees only unallocated space, as the kernel does.
    // (The kernel's resize refuses sizes under 256 MiB; butter's takes them, as min did.)
    let o = resize(&img, "+300M", &[]);
    assert!(o.status.success(), "{}", text(&o));
    let want = kernel_resize(&img, &s, "-60M", dev + 300 * MIB);
    let o = resize(&img, "-60M", &[]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(sizes(&img), want, "sizes after -60M, butter vs the kernel");
    assert_eq!(fs::metadata(&img).unwrap().len(), dev + 240 * MIB);
    checked(&img, &s, "shrunk");

    // Refusals with nothing written.
    let before = fs::read(&img).unwrap();
    for (spec, want) in [
        ("2:+1M", "no device 2"),
        ("+1Q", "resize"),
        ("x:1G", "not a device id"),
        ("-100G", "cannot shrink"),
    ] {
        let o = resize(&img, spec, &[]);
        assert!(!o.status.success(), "{spec}: {}", text(&o));
        assert!(
            text(&o).contains(want),
            "{spec}: no {want:?} in {}",
            text(&o)
        );
        assert!(!text(&o).contains("panicked"), "{}", text(&o));
    }
    assert!(
        fs::read(&img).unwrap() == before,
        "a refused resize changed the image"
    );
}

/// A device of a RAID1 by its devid: only it grows, and the kernel mounts both.
#[test]
fn grows_one_device_of_a_raid1_by_devid() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("resize-raid1");
    let images: Vec<PathBuf> = (0..2).map(|i| s.join(format!("d{i}.img"))).collect();
    for img in &images {
        fs::File::create(img).unwrap().set_len(300 * MIB).unwrap();
    }
    let o = butter(&[
        "mkfs",
        "-q",
        "-m",
        "raid1",
        "-d",
        "raid1",
        images[0].to_str().unwrap(),
        images[1].to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let o = resize(
        &images[0],
        "2:+200M",
        &["--device", images[1].to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(fs::metadata(&images[1]).unwrap().len(), 500 * MIB);
    assert_eq!(fs::metadata(&images[0]).unwrap().len(), 300 * MIB);
    let (ok, t) = kernel::btrfs_check_devices(&images);
    assert!(ok, "btrfs check:\n{t}");
    let m = MultiLoopMount::new(&images, &s.dir("k"), "ro");
    let out = kernel::run(
        Command::new("btrfs")
            .args(["filesystem", "show", "--raw"])
            .arg(m.path()),
    );
    m.unmount();
    assert!(
        out.contains(&format!("size {} used", 500 * MIB))
            && out.contains(&format!("size {} used", 300 * MIB)),
        "the kernel's view of the device sizes:\n{out}"
    );
    // Without the other device, resizing it is refused by name.
    let o = resize(&images[0], "2:+1M", &["--degraded"]);
    assert!(
        !o.status.success() && text(&o).contains("missing"),
        "{}",
        text(&o)
    );
}
