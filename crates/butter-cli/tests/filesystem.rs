//! `butter filesystem df` and `butter filesystem label` against btrfs-progs on a kernel
//! mount: df prints the Data, System and Metadata lines `btrfs filesystem df` prints (its
//! GlobalReserve line is the running kernel's, not on disk), for a mkfs.btrfs image the
//! kernel filled and for a butter-made one; a label butter sets is the one the kernel shows,
//! and both checkers stay clean. `butter filesystem usage` and `du` against `btrfs
//! filesystem usage` and `du` on kernel mounts of the same images (plain and
//! block-group-tree mkfs.btrfs images filled by the kernel with reflinks, a snapshot,
//! compressed, sparse and preallocated files, and a butter-made one), line by line. Needs
//! root, loop devices and btrfs-progs; without them the tests print a notice and pass,
//! unless CI is set (then they fail).

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

/// `btrfs filesystem usage -b` (or human units) on a mount of `img`, with the loop device's
/// name in place of ours: butter names the image.
fn progs_usage(m: &LoopMount, raw: bool) -> String {
    let mut args = vec!["filesystem", "usage"];
    if raw {
        args.push("-b");
    }
    let p = m.path().to_str().unwrap();
    args.push(p);
    kernel::sh("btrfs", &args)
}

fn butter_usage(img: &std::path::Path, dev: &std::path::Path, raw: bool) -> String {
    let i = img.to_str().unwrap();
    let out = if raw {
        butter(&["filesystem", "usage", "-b", i])
    } else {
        butter(&["filesystem", "usage", i])
    };
    out.replace(&format!("   {i}\t"), &format!("   {}\t", dev.display()))
}

/// The number after `label` on its line of a `usage -b` output.
fn usage_value(out: &str, label: &str) -> u64 {
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("no {label:?} line in\n{out}"));
    line[line.find(':').unwrap() + 1..]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap_or_else(|e| panic!("{line:?}: {e}"))
}

/// `Size` and `Used` of the `Data,...` line of a `usage -b` output.
fn data_size_used(out: &str) -> (u64, u64) {
    let line = out.lines().find(|l| l.starts_with("Data,")).unwrap();
    let num = |tag: &str| -> u64 {
        let at = line.find(tag).unwrap() + tag.len();
        line[at..]
            .split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    (num("Size:"), num("Used:"))
}

/// Compares `butter filesystem usage` of `img` with btrfs-progs: on a read-only kernel mount
/// of the image itself, line by line, except "Free (statfs, df)": a read-only mount marks
/// every block group read-only (the kernel's bytes_readonly), so its statfs leaves out the
/// free space inside data block groups, which butter (like a read-write mount) counts; the
/// difference must be exactly that space. Then on a read-write kernel mount of a copy, every
/// line, raw and human: the global reserve and the statfs free space are the running
/// kernel's, and butter computes them with the kernel's formulas from what the image holds
/// (a kernel that changes those formulas fails here, on purpose).
fn assert_usage_matches(sc: &ScratchDir, img: &std::path::Path) {
    let m = LoopMount::btrfs_ro(img, &sc.dir("m"));
    let theirs = progs_usage(&m, true);
    let ours = butter_usage(img, m.device(), true);
    m.unmount();
    let statfs = "Free (statfs, df):";
    let (size, used) = data_size_used(&ours);
    assert_eq!(
        usage_value(&ours, statfs) - usage_value(&theirs, statfs),
        size - used,
        "statfs free of {}: ours\n{ours}\ntheirs (read-only mount)\n{theirs}",
        img.display()
    );
    let drop_statfs = |s: &str| -> Vec<String> {
        s.lines()
            .filter(|l| !l.contains(statfs))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(
        drop_statfs(&ours),
        drop_statfs(&theirs),
        "usage -b of {} against a read-only mount",
        img.display()
    );
    let copy = sc.join("copy.img");
    std::fs::copy(img, &copy).unwrap();
    let m = LoopMount::btrfs(&copy, &sc.dir("m"), "");
    for raw in [true, false] {
        let theirs = progs_usage(&m, raw);
        let ours = butter_usage(img, m.device(), raw);
        assert_eq!(
            ours,
            theirs,
            "usage (raw {raw}) of {} against a read-write mount of a copy",
            img.display()
        );
    }
    m.unmount();
}

/// Compares `butter filesystem du` (raw, `-s`, human) with `btrfs filesystem du` run in the
/// mount's top directory with the same relative paths, which name the same files inside the
/// image; every line must be equal.
fn assert_du_matches(sc: &ScratchDir, img: &std::path::Path, paths: &[&str]) {
    let m = LoopMount::btrfs_ro(img, &sc.dir("m"));
    let i = img.to_str().unwrap();
    for opts in [&["--raw"][..], &["-s", "--raw"], &[]] {
        let mut args = vec!["filesystem", "du"];
        args.extend_from_slice(opts);
        let theirs = kernel::run(
            Command::new("btrfs")
                .args(&args)
                .args(paths)
                .current_dir(m.path()),
        );
        args.push(i);
        args.extend_from_slice(paths);
        let ours = butter(&args);
        assert_eq!(ours, theirs, "du {opts:?} {paths:?} of {}", img.display());
        // The numbers must be worth comparing: something is counted.
        assert!(ours.lines().count() > 1, "{ours}");
    }
    m.unmount();
}

/// A reflink of `[src_off, src_off + len)` of a file to `dst_off` in the same file
/// (FICLONERANGE), which `cp --reflink` cannot make.
fn clone_within(path: &std::path::Path, src_off: u64, len: u64, dst_off: u64) {
    use std::os::fd::AsRawFd;
    #[repr(C)]
    struct FileCloneRange {
        src_fd: i64,
        src_offset: u64,
        src_length: u64,
        dest_offset: u64,
    }
    const FICLONERANGE: libc::c_ulong = 0x4020_940d;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let arg = FileCloneRange {
        src_fd: f.as_raw_fd() as i64,
        src_offset: src_off,
        src_length: len,
        dest_offset: dst_off,
    };
    // SAFETY: a valid fd and a properly laid out argument that lives across the call.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), FICLONERANGE, &arg) };
    assert_eq!(rc, 0, "FICLONERANGE: {}", std::io::Error::last_os_error());
}

fn random_bytes(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Fills a kernel mount: plain, reflinked (whole file and inside a file), partly
/// overwritten, compressed, sparse, preallocated, inline and hard-linked files, a
/// subvolume and a snapshot of the top level (taken between writes, so some extents stay
/// shared through the snapshot's tree blocks and some are the original's alone).
fn fill(mnt: &std::path::Path) {
    use std::io::{Seek, SeekFrom, Write};
    // Enough inline files for an fs tree of several leaves under a node: a snapshot then
    // shares the leaves (not copied, unlike a root leaf), so the files' extents are shared
    // through tree blocks alone, with one back reference each.
    let many = mnt.join("many");
    std::fs::create_dir(&many).unwrap();
    for i in 0..300 {
        // Every 50th with a regular extent, in a leaf the writes after the snapshot leave
        // alone.
        let len = if i % 50 == 25 { 100 << 10 } else { 2000 };
        std::fs::write(many.join(format!("f{i:03}")), random_bytes(len, i)).unwrap();
    }
    let d = mnt.join("d");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("a"), random_bytes(6 << 20, 1)).unwrap();
    kernel::run(
        Command::new("cp")
            .arg("--reflink=always")
            .arg(d.join("a"))
            .arg(d.join("a2")),
    );
    std::fs::hard_link(d.join("a"), d.join("a_link")).unwrap();
    // b: one extent, its middle overwritten, so b refers to it twice with one back
    // reference (exclusive all the same).
    std::fs::write(d.join("b"), random_bytes(4 << 20, 2)).unwrap();
    kernel::sync_all();
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join("b"))
            .unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&random_bytes(256 << 10, 3)).unwrap();
    }
    // r: a reflink inside one file.
    std::fs::write(d.join("r"), random_bytes(1 << 20, 4)).unwrap();
    kernel::sync_all();
    clone_within(&d.join("r"), 0, 1 << 20, 1 << 20);
    // c: compressed (the property on the empty file), then partly overwritten.
    std::fs::write(d.join("c"), b"").unwrap();
    kernel::sh(
        "btrfs",
        &[
            "property",
            "set",
            d.join("c").to_str().unwrap(),
            "compression",
            "zstd",
        ],
    );
    let text: Vec<u8> = (0..3_000_000u32)
        .flat_map(|i| format!("line {i}\n").into_bytes())
        .take(3 << 20)
        .collect();
    std::fs::write(d.join("c"), &text).unwrap();
    kernel::sync_all();
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join("c"))
            .unwrap();
        f.seek(SeekFrom::Start(200 << 10)).unwrap();
        f.write_all(&random_bytes(64 << 10, 5)).unwrap();
    }
    // s: sparse; p: preallocated; i: inline.
    {
        let mut f = std::fs::File::create(d.join("s")).unwrap();
        f.write_all(&random_bytes(64 << 10, 6)).unwrap();
        f.seek(SeekFrom::Start(20 << 20)).unwrap();
        f.write_all(&random_bytes(8 << 10, 7)).unwrap();
    }
    kernel::sh("fallocate", &["-l", "3M", d.join("p").to_str().unwrap()]);
    std::fs::write(d.join("i"), b"small").unwrap();
    std::fs::create_dir(d.join("sub")).unwrap();
    std::fs::write(d.join("sub/x"), random_bytes(300 << 10, 8)).unwrap();
    kernel::sh(
        "btrfs",
        &["subvolume", "create", mnt.join("sv").to_str().unwrap()],
    );
    std::fs::write(mnt.join("sv/y"), random_bytes(1 << 20, 9)).unwrap();
    kernel::sync_all();
    kernel::sh(
        "btrfs",
        &[
            "subvolume",
            "snapshot",
            mnt.to_str().unwrap(),
            mnt.join("snap").to_str().unwrap(),
        ],
    );
    // After the snapshot: a new file, one whose middle is overwritten (its one extent
    // referred to twice through one back reference: exclusive), and part of b rewritten in
    // the original only.
    std::fs::write(d.join("new"), random_bytes(512 << 10, 10)).unwrap();
    std::fs::write(d.join("e"), random_bytes(2 << 20, 12)).unwrap();
    kernel::sync_all();
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join("e"))
            .unwrap();
        f.seek(SeekFrom::Start(512 << 10)).unwrap();
        f.write_all(&random_bytes(64 << 10, 13)).unwrap();
    }
    {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .open(d.join("b"))
            .unwrap();
        f.seek(SeekFrom::Start(3 << 20)).unwrap();
        f.write_all(&random_bytes(128 << 10, 11)).unwrap();
    }
    kernel::sync_all();
}

const DU_PATHS: &[&str] = &[
    ".", "d", "d/a", "d/b", "d/c", "d/e", "d/s", "snap", "snap/d", "sv", "d/i", "many",
];

#[test]
fn usage_and_du_match_btrfs_progs() {
    if !fuse_mount::require("usage_and_du_match_btrfs_progs", &["cp", "fallocate"]) {
        return;
    }
    let sc = ScratchDir::new("fs-usage");
    for (name, opts) in [("plain", &[][..]), ("bgt", &["-O", "block-group-tree"][..])] {
        let img = sc.join(format!("{name}.img"));
        kernel::mkfs_btrfs(&img, 512 << 20, opts);
        {
            let m = LoopMount::btrfs(&img, &sc.dir("m"), "");
            fill(m.path());
            m.unmount();
        }
        assert_usage_matches(&sc, &img);
        assert_du_matches(&sc, &img, DU_PATHS);
    }
    // A butter-made image, from a directory, compressed: the same comparisons.
    let src = sc.dir("src");
    std::fs::create_dir_all(src.join("t")).unwrap();
    std::fs::write(src.join("t/big"), random_bytes(3 << 20, 12)).unwrap();
    std::fs::write(src.join("t/text"), "butter ".repeat(200_000)).unwrap();
    std::fs::write(src.join("small"), b"tiny").unwrap();
    let bimg = sc.join("b.img");
    std::fs::File::create(&bimg)
        .unwrap()
        .set_len(512 << 20)
        .unwrap();
    butter(&[
        "mkfs",
        "--rootdir",
        src.to_str().unwrap(),
        "--compress",
        "zstd",
        bimg.to_str().unwrap(),
    ]);
    assert_usage_matches(&sc, &bimg);
    assert_du_matches(&sc, &bimg, &[".", "t", "t/big", "small"]);
}
