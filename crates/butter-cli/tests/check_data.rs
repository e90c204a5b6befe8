//! `butter check` beyond the metadata: the data pass (`--check-data-csum`), csums on NODATASUM
//! data, images shorter than their superblock says, and files that are not btrfs at all.
//!
//! The data tests fill an image through a kernel loop mount: they need root and loop devices
//! (skipped with a notice without them, a failure when `CI` is set). The others need
//! mkfs.btrfs / mkfs.ext4 only.

mod common;

use common::kernel::{self, LoopMount, ScratchDir};
use std::fs;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const MIB: u64 = 1 << 20;

/// `butter ARGS...`: (exit code, stdout + stderr).
fn butter(args: &[&str], img: &Path) -> (i32, String) {
    let out = Command::new(BUTTER).args(args).arg(img).output().unwrap();
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    s.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), s)
}

/// True when mkfs.btrfs is there (CI: it must be).
fn have_mkfs() -> bool {
    if Command::new("mkfs.btrfs").arg("--version").output().is_ok() {
        return true;
    }
    if std::env::var_os("CI").is_some() {
        panic!("mkfs.btrfs missing (CI is set, so this is an error rather than a skip)");
    }
    eprintln!("SKIPPED: mkfs.btrfs not installed");
    false
}

/// Deterministic bytes, distinct per 4 KiB sector, so a sector can be found in the raw image.
fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Physical offset of `needle` in the image file.
fn find_in_image(img: &Path, needle: &[u8]) -> u64 {
    let data = fs::read(img).unwrap();
    data.windows(needle.len())
        .position(|w| w == needle)
        .expect("data not found in the image") as u64
}

fn flip_byte(img: &Path, at: u64) {
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(img)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x5a;
    f.write_all_at(&b, at).unwrap();
    f.sync_all().unwrap();
}

#[test]
fn data_pass_names_file_and_offset() {
    if !kernel::require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("check-data-csum");
    let img = scratch.join("d.img");
    kernel::mkfs_btrfs(&img, 256 * MIB, &[] as &[&str]);
    let content = pattern(1 << 20, 7);
    {
        let m = LoopMount::btrfs(&img, &scratch.join("mnt"), "");
        fs::create_dir(m.path().join("dir")).unwrap();
        fs::write(m.path().join("dir/file"), &content).unwrap();
        m.unmount();
    }
    let (rc, out) = butter(&["check", "--check-data-csum"], &img);
    assert_eq!(rc, 0, "clean image, data pass:\n{out}");
    assert!(out.contains("[7/7]"), "no data pass summary:\n{out}");

    // Damage the sector at file offset 8192.
    let off = 8192usize;
    let phys = find_in_image(&img, &content[off..off + 4096]);
    flip_byte(&img, phys + 100);
    let (rc, out) = butter(&["check"], &img);
    assert_eq!(rc, 0, "plain check does not read data:\n{out}");
    let (rc, out) = butter(&["check", "--check-data-csum"], &img);
    assert_ne!(rc, 0, "data pass must fail:\n{out}");
    let line = out
        .lines()
        .find(|l| l.contains("DataCsumMismatch"))
        .unwrap_or_else(|| panic!("no DataCsumMismatch:\n{out}"));
    assert!(line.contains("file /dir/file"), "{line}");
    assert!(line.contains(&format!("file offset {off}")), "{line}");
    assert!(line.contains("logical "), "{line}");
    assert_eq!(
        out.lines()
            .filter(|l| l.contains("DataCsumMismatch"))
            .count(),
        1,
        "one sector damaged:\n{out}"
    );
    let out = kernel::run_output(
        Command::new("btrfs")
            .args(["check", "--readonly", "--check-data-csum"])
            .arg(&img),
    );
    let (ok, text) = (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        !ok,
        "btrfs check --check-data-csum should fail too:\n{text}"
    );
}

#[test]
fn csum_on_nodatasum_is_caught() {
    if !kernel::require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("check-nodatasum");
    let img = scratch.join("n.img");
    kernel::mkfs_btrfs(&img, 256 * MIB, &[] as &[&str]);
    {
        let m = LoopMount::btrfs(&img, &scratch.join("mnt"), "");
        let p = m.path().display().to_string();
        kernel::sh(
            "sh",
            &[
                "-c",
                &format!(
                    "cd {p} && touch nocsum && chattr +C nocsum && head -c 65536 /dev/urandom > nocsum \
                     && head -c 8192 /dev/urandom > withcsum && sync"
                ),
            ],
        );
        m.unmount();
    }
    let (rc, out) = butter(&["check"], &img);
    assert_eq!(rc, 0, "clean image:\n{out}");
    // The only csum item (the other file's) moved onto the NODATASUM file's data.
    let dump = kernel::dump_tree(&img, &["-t", "5"]);
    let nocsum_ino = inode_of(&dump, "nocsum");
    let logical = disk_bytenr_of(&dump, nocsum_ino);
    let csums = kernel::dump_tree(&img, &["-t", "7"]);
    assert_eq!(
        csums.matches("EXTENT_CSUM EXTENT_CSUM").count(),
        1,
        "expected one csum item:\n{csums}"
    );
    move_csum_item(&img, logical);
    let (rc, out) = butter(&["check"], &img);
    assert_ne!(rc, 0, "csum on NODATASUM data must be an error:\n{out}");
    let line = out
        .lines()
        .find(|l| l.contains("CsumOnNodatasum"))
        .unwrap_or_else(|| panic!("no CsumOnNodatasum:\n{out}"));
    assert!(line.contains(&format!("inode {nocsum_ino}")), "{line}");
    assert!(
        out.contains("CsumMissing"),
        "the other file lost its csums:\n{out}"
    );
    let (ok, text) = kernel::btrfs_check(&img);
    assert!(!ok, "btrfs check should fail too:\n{text}");
}

/// The inode number of `name` in the top directory, from a dump-tree of the fs tree.
fn inode_of(dump: &str, name: &str) -> u64 {
    let lines: Vec<&str> = dump.lines().collect();
    for (i, l) in lines.iter().enumerate() {
        if l.contains("DIR_INDEX")
            && lines
                .get(i + 3)
                .is_some_and(|n| n.trim() == format!("name: {name}"))
        {
            let loc = lines[i + 1].trim();
            // "location key (257 INODE_ITEM 0) type FILE"
            let n = loc
                .split('(')
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
                .unwrap();
            return n.parse().unwrap();
        }
    }
    panic!("no entry {name} in:\n{dump}");
}

/// The disk bytenr of inode `ino`'s first extent.
fn disk_bytenr_of(dump: &str, ino: u64) -> u64 {
    let lines: Vec<&str> = dump.lines().collect();
    let key = format!("key ({ino} EXTENT_DATA 0)");
    let i = lines
        .iter()
        .position(|l| l.contains(&key))
        .unwrap_or_else(|| panic!("no {key}"));
    let l = lines[i + 2].trim();
    // "extent data disk byte 13631488 nr 65536"
    l.split_whitespace().nth(4).unwrap().parse().unwrap()
}

/// Rewrites the key offset of the csum tree's only item to `logical` (and reseals the leaf).
fn move_csum_item(img: &Path, logical: u64) {
    use common::damage::ondisk::{CSUM_TREE, EXTENT_CSUM};
    patch_first_item(
        img,
        CSUM_TREE,
        |k| k.ty == EXTENT_CSUM,
        |block, hdr, _| block[hdr + 9..hdr + 17].copy_from_slice(&logical.to_le_bytes()),
    );
}

/// Lets `edit(block, item header offset, item data offset)` change the first item of tree `id`
/// matching `pred`, reseals the block and writes every copy.
fn patch_first_item(
    img: &Path,
    id: u64,
    pred: impl Fn(&butter::format::Key) -> bool,
    edit: impl FnOnce(&mut [u8], usize, usize),
) {
    common::damage::patch_item(img, id, false, |k, _| pred(k), edit);
}

#[test]
fn qgroup_numbers_are_checked() {
    if !kernel::require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("check-qgroup");
    let img = scratch.join("q.img");
    kernel::mkfs_btrfs(&img, 256 * MIB, &["--nodesize", "4096"]);
    {
        let m = LoopMount::btrfs(&img, &scratch.join("mnt"), "");
        let p = m.path().display().to_string();
        kernel::sh(
            "sh",
            &[
                "-c",
                &format!(
                    "cd {p} && btrfs -q quota enable . && btrfs -q subvolume create sv \
                     && for i in $(seq 1 200); do head -c $((i*100)) /dev/urandom > sv/f$i; done \
                     && btrfs -q subvolume snapshot sv snap && btrfs -q qgroup create 1/1 . \
                     && (btrfs -q qgroup assign 0/256 1/1 . || true) && (btrfs -q qgroup assign 0/257 1/1 . || true) \
                     && for i in $(seq 1 50); do echo x >> snap/f$i; done && cp --reflink=always sv/f100 r \
                     && sync && btrfs -q quota rescan -w . && for i in $(seq 60 80); do rm sv/f$i; done && sync"
                ),
            ],
        );
        m.unmount();
    }
    let (rc, out) = butter(&["check"], &img);
    assert_eq!(rc, 0, "kernel quota image:\n{out}");
    kernel::assert_btrfs_check(&img);
    // 0/256 referenced one sector more than its subvolume holds.
    patch_first_item(
        &img,
        common::damage::ondisk::QUOTA_TREE,
        |k| k.ty == common::damage::ondisk::QGROUP_INFO && k.offset == 256,
        |b, _, d| {
            let v = u64::from_le_bytes(b[d + 8..d + 16].try_into().unwrap()) + 4096;
            b[d + 8..d + 16].copy_from_slice(&v.to_le_bytes());
        },
    );
    let (rc, out) = butter(&["check"], &img);
    assert_ne!(rc, 0, "{out}");
    assert!(
        out.lines()
            .any(|l| l.contains("QgroupMismatch") && l.contains("qgroup 0/256")),
        "{out}"
    );
    let (ok, text) = kernel::btrfs_check(&img);
    assert!(!ok, "btrfs check should see it too:\n{text}");
}

#[test]
fn truncated_image_names_sizes() {
    if !have_mkfs() {
        return;
    }
    let scratch = ScratchDir::new("check-truncated");
    let img = scratch.join("t.img");
    kernel::mkfs_btrfs(&img, 256 * MIB, &[] as &[&str]);
    let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.set_len(40 * MIB).unwrap();
    drop(f);
    let (rc, out) = butter(&["check"], &img);
    assert_ne!(rc, 0, "a truncated image is an error:\n{out}");
    assert!(!out.contains("panicked"), "{out}");
    let size_line = out
        .lines()
        .find(|l| l.contains("DeviceSizeMismatch") && l.contains("268435456"))
        .unwrap_or_else(|| panic!("no device size finding:\n{out}"));
    assert!(size_line.contains(&(40 * MIB).to_string()), "{size_line}");
    assert!(
        out.lines()
            .any(|l| l.contains("DeviceSizeMismatch") && l.contains("past the end of the image")),
        "no chunk past the end named:\n{out}"
    );

    // Shorter still: the chunk tree itself is gone; the open fails and says why.
    let f = fs::OpenOptions::new().write(true).open(&img).unwrap();
    f.set_len(20 * MIB).unwrap();
    drop(f);
    let (rc, out) = butter(&["check"], &img);
    assert_ne!(rc, 0, "{out}");
    assert!(!out.contains("panicked"), "{out}");
    assert!(
        out.contains("268435456")
            && out.contains(&(20 * MIB).to_string())
            && out.contains("truncated"),
        "{out}"
    );
}

#[test]
fn not_btrfs_is_said_so() {
    let scratch = ScratchDir::new("check-not-btrfs");
    let empty = scratch.join("empty.img");
    fs::write(&empty, b"").unwrap();
    let zero = scratch.join("zero.img");
    fs::File::create(&zero).unwrap().set_len(100 * MIB).unwrap();
    let random = scratch.join("random.img");
    fs::write(&random, pattern(2 << 20, 3)).unwrap();
    let mut cases = vec![
        (empty, "empty"),
        (zero, "all zeroes"),
        (random, "other content"),
    ];
    let have_ext4 = Command::new("mkfs.ext4").arg("-V").output().is_ok();
    if have_ext4 {
        let ext4 = scratch.join("ext4.img");
        kernel::mkfs_ext4(&ext4, 64 * MIB);
        cases.push((ext4, "ext2/ext3/ext4"));
    } else if std::env::var_os("CI").is_some() {
        panic!("mkfs.ext4 missing (CI is set, so this is an error rather than a skip)");
    }
    for (img, what) in &cases {
        for cmd in [
            &["check"][..],
            &["check", "--check-data-csum"][..],
            &["dump-super"][..],
            &["ls"][..],
            &["subvolumes"][..],
        ] {
            let (rc, out) = butter(cmd, img);
            assert_ne!(rc, 0, "butter {cmd:?} {}: {out}", img.display());
            assert!(
                out.contains("not a btrfs filesystem") && out.contains(what),
                "butter {cmd:?} {}: {out}",
                img.display()
            );
            assert!(
                !out.contains("damaged") && !out.contains("corrupt") && !out.contains("panicked"),
                "butter {cmd:?} {}: {out}",
                img.display()
            );
        }
    }
}
