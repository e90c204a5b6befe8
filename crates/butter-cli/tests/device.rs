//! `butter device add` offline, against the kernel's `btrfs device add` on a mount: the new
//! device's item and the superblock's device count and size are the kernel's; the kernel then
//! mounts both devices and fills the new one; butter reads what it wrote; what is refused
//! (a device of the filesystem already, one holding a filesystem, one too small) changes
//! nothing.
//!
//! Needs root, loop devices, kernel btrfs and btrfs-progs: fails without them under CI.

mod common;

use common::kernel::{self, LoopMount, MultiLoopMount, ScratchDir};
use common::{output_text as text, run_butter as butter};
use std::fs;
use std::path::Path;
use std::process::Command;

const MIB: u64 = 1 << 20;

fn blank(p: &Path, size: u64) {
    fs::File::create(p).unwrap().set_len(size).unwrap();
}

/// The DEV_ITEM of device 2 as butter's dump-tree prints it, without its uuid lines.
fn dev_item_2(first: &Path, second: &Path) -> String {
    let o = butter(&[
        "dump-tree",
        "-t",
        "chunk",
        first.to_str().unwrap(),
        "--device",
        second.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = String::from_utf8_lossy(&o.stdout).to_string();
    let lines: Vec<&str> = t.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains("(DEV_ITEMS DEV_ITEM 2)"))
        .unwrap_or_else(|| panic!("no DEV_ITEM 2:\n{t}"));
    lines[at + 1..at + 5]
        .iter()
        .map(|l| l.trim().to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

/// (num_devices, total_bytes) of a device's superblock.
fn counts(img: &Path) -> (u64, u64) {
    (
        kernel::super_field(img, "num_devices"),
        kernel::super_field(img, "total_bytes"),
    )
}

#[test]
fn device_add_as_the_kernel_adds_it_and_the_kernel_fills_it() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("device-add");
    let a = s.join("a.img");
    kernel::mkfs_btrfs(&a, 300 * MIB, &["-O", "block-group-tree"]);
    let data: Vec<u8> = (0..100 * MIB as usize)
        .map(|i| (i * 7 % 251) as u8)
        .collect();
    {
        let m = LoopMount::btrfs(&a, &s.dir("fill"), "");
        fs::write(m.path().join("file"), &data).unwrap();
        m.unmount();
    }
    // The kernel's own device add, on copies.
    let (ka, kb) = (s.join("ka.img"), s.join("kb.img"));
    fs::copy(&a, &ka).unwrap();
    blank(&kb, 300 * MIB);
    {
        let m = LoopMount::btrfs(&ka, &s.dir("k-add"), "");
        let dev = kernel::run(Command::new("losetup").args(["-f", "--show"]).arg(&kb));
        let dev = dev.trim().to_string();
        kernel::run(
            Command::new("btrfs")
                .args(["device", "add", "-K", "-f", &dev])
                .arg(m.path()),
        );
        m.unmount();
        kernel::run(Command::new("losetup").args(["-d", &dev]));
    }
    let b = s.join("b.img");
    blank(&b, 300 * MIB);
    let o = butter(&["device", "add", a.to_str().unwrap(), b.to_str().unwrap()]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("Added device 2"), "{}", text(&o));
    assert_eq!(
        dev_item_2(&a, &b),
        dev_item_2(&ka, &kb),
        "device 2's item, butter vs the kernel"
    );
    assert_eq!(counts(&a), counts(&ka), "device 1's superblock");
    assert_eq!(counts(&b), counts(&kb), "device 2's superblock");
    assert_eq!(counts(&b), (2, 600 * MIB));

    let images = vec![a.clone(), b.clone()];
    let (ok, t) = kernel::btrfs_check_devices(&images);
    assert!(ok, "btrfs check after butter's device add:\n{t}");
    let (rc, t) = common::fuse_mount::butter_check_set(&a, &[b.display().to_string()]);
    assert_eq!(rc, 0, "butter check:\n{t}");
    // The kernel uses the new device: more than device 1 holds.
    let big: Vec<u8> = (0..330 * MIB as usize)
        .map(|i| (i * 13 % 253) as u8)
        .collect();
    {
        let m = MultiLoopMount::new(&images, &s.dir("k"), "");
        fs::write(m.path().join("big"), &big).expect("the kernel fills both devices");
        let show = kernel::run(
            Command::new("btrfs")
                .args(["filesystem", "show", "--raw"])
                .arg(m.path()),
        );
        assert!(show.contains("Total devices 2"), "{show}");
        m.unmount();
    }
    let (ok, t) = kernel::btrfs_check_devices(&images);
    assert!(ok, "btrfs check after the kernel wrote:\n{t}");
    for (name, want) in [("/file", &data), ("/big", &big)] {
        let o = butter(&[
            "cat",
            a.to_str().unwrap(),
            "--device",
            b.to_str().unwrap(),
            name,
        ]);
        assert!(
            o.status.success() && o.stdout == *want,
            "butter reads {name}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    }
}

#[test]
fn device_add_refuses_members_filesystems_and_small_devices() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("device-add-refused");
    let a = s.join("a.img");
    kernel::mkfs_btrfs(&a, 300 * MIB, &[] as &[&str]);
    let other = s.join("other.img");
    kernel::mkfs_btrfs(&other, 300 * MIB, &[] as &[&str]);
    let small = s.join("small.img");
    blank(&small, 10 * MIB);
    let before: Vec<Vec<u8>> = [&a, &other, &small]
        .iter()
        .map(|p| fs::read(p).unwrap())
        .collect();
    let (ap, op, sp) = (
        a.to_str().unwrap(),
        other.to_str().unwrap(),
        small.to_str().unwrap(),
    );
    let cases: &[(&[&str], &[&str])] = &[
        (&["device", "add", ap, ap], &["given twice"]),
        (&["device", "add", ap, op], &["existing filesystem", "-f"]),
        (&["device", "add", ap, sp], &["at least"]),
        (&["device", "add", ap], &["DEVICE"]),
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
    for (p, b) in [&a, &other, &small].iter().zip(&before) {
        assert!(fs::read(p).unwrap() == *b, "{} changed", p.display());
    }
}

/// A device that holds no chunk (just added) comes out again: the filesystem is one device
/// as before (the kernel mounts it alone), the removed device's superblocks are wiped; a
/// device with chunks, the IMAGE itself and an unknown one are refused unchanged.
#[test]
fn device_remove_takes_out_an_empty_device_and_refuses_the_rest() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("device-remove");
    let a = s.join("a.img");
    kernel::mkfs_btrfs(&a, 300 * MIB, &[] as &[&str]);
    {
        let m = LoopMount::btrfs(&a, &s.dir("fill"), "");
        fs::write(m.path().join("file"), vec![5u8; 3 << 20]).unwrap();
        m.unmount();
    }
    let b = s.join("b.img");
    blank(&b, 300 * MIB);
    let (ap, bp) = (a.to_str().unwrap(), b.to_str().unwrap());
    let o = butter(&["device", "add", ap, bp]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(counts(&a), (2, 600 * MIB));
    let o = butter(&["device", "remove", ap, "--device", bp, bp]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(counts(&a), (1, 300 * MIB));
    let sb = kernel::run_output(
        Command::new("btrfs")
            .args(["inspect-internal", "dump-super"])
            .arg(&b),
    );
    assert!(
        !String::from_utf8_lossy(&sb.stdout).contains("_BHRfS_M [match]"),
        "the removed device still has a btrfs superblock"
    );
    let (ok, t) = kernel::btrfs_check(&a);
    assert!(ok, "btrfs check after the remove:\n{t}");
    let (rc, t) = common::fuse_mount::butter_check(&a);
    assert_eq!(rc, 0, "butter check:\n{t}");
    let m = LoopMount::btrfs_ro(&a, &s.dir("k"));
    assert_eq!(fs::read(m.path().join("file")).unwrap(), vec![5u8; 3 << 20]);
    m.unmount();

    // A RAID1 of two devices: removing one would leave RAID1 on one device.
    let r: Vec<std::path::PathBuf> = (0..2).map(|i| s.join(format!("r{i}.img"))).collect();
    for p in &r {
        blank(p, 300 * MIB);
    }
    let (r0, r1) = (r[0].to_str().unwrap(), r[1].to_str().unwrap());
    let o = butter(&["mkfs", "-q", "-d", "raid1", r0, r1]);
    assert!(o.status.success(), "{}", text(&o));
    let before: Vec<Vec<u8>> = r.iter().map(|p| fs::read(p).unwrap()).collect();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["device", "remove", r0, "--device", r1, "2"],
            &["needs 2 devices", "convert"],
        ),
        (
            &["device", "remove", r0, "--device", r1, r0],
            &["needs 2 devices"],
        ),
        (
            &["device", "remove", r0, "--device", r1, "7"],
            &["not a device"],
        ),
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
    for (p, b) in r.iter().zip(&before) {
        assert!(fs::read(p).unwrap() == *b, "{} changed", p.display());
    }
}
