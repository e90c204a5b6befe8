//! `butter mkfs --rootdir DIR IMAGE` against the kernel: the seeded generator fills a kernel
//! btrfs mount (every file type, hard links incl. extended refs, xattrs, sparse and
//! preallocated files, files of a few MiB, subvolumes that the copy turns into plain
//! directories); butter copies that tree into a new image; `btrfs check` and butter's checker
//! must pass, and a kernel mount of the new image must show the same tree (names, types, modes,
//! owners, sizes, content, xattrs, link targets, hard-link groups, atime/mtime). Two runs with
//! SOURCE_DATE_EPOCH and the same -U must give byte-identical images.
//!
//! Needs root, loop devices and btrfs-progs: without them the test prints a notice and passes,
//! unless CI is set (then it fails).

mod common;

use common::gen::{populate, Rng, Scale};
use common::kernel::{btrfs_check, require_privileges, LoopMount, ScratchDir};
use common::manifest::{assert_same, take, CompareOpts, Kind, TakeOpts};
use std::path::Path;
use std::process::Command;

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const UUID: &str = "5eed5eed-0000-4000-8000-00000000b077";

fn butter_mkfs_rootdir(src: &Path, img: &Path, extra: &[&str]) {
    let out = Command::new(BUTTER)
        .arg("mkfs")
        .arg("-q")
        .args(["-U", UUID])
        .args(extra)
        .arg("--rootdir")
        .arg(src)
        .arg(img)
        .env("SOURCE_DATE_EPOCH", "1700000000")
        .env_remove("BUTTER_FIXED_TIME")
        .output()
        .expect("run butter");
    assert!(
        out.status.success(),
        "butter mkfs --rootdir failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

fn butter_check(img: &Path) {
    let fs = butter::fs::Fs::open(img).unwrap_or_else(|e| panic!("butter open: {e}"));
    let report = fs.check(Default::default(), &mut |_| {}).unwrap();
    assert!(
        report.is_clean(),
        "butter check of {}:\n{}",
        img.display(),
        report
            .findings
            .iter()
            .map(|f| f.to_string())
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[test]
fn rootdir_copies_the_generated_tree() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("mkfs-rootdir");
    let src_img = scratch.join("src.img");
    common::kernel::mkfs_btrfs(&src_img, 1 << 30, &[] as &[&str]);
    let src = LoopMount::btrfs(&src_img, &scratch.join("src"), "");
    populate(src.path(), 0x5eed, Scale::Small);
    // The generator leaves the mount noatime: reading it for the copy changes nothing.
    let want = take(src.path(), &TakeOpts::default());
    assert!(want.count(Kind::Fifo) > 0 && want.count(Kind::Socket) > 0);
    assert!(want.count(Kind::CharDev) > 0 && want.count(Kind::BlockDev) > 0);

    let img1 = scratch.join("one.img");
    let img2 = scratch.join("two.img");
    butter_mkfs_rootdir(src.path(), &img1, &[]);
    butter_mkfs_rootdir(src.path(), &img2, &[]);
    let a = std::fs::read(&img1).unwrap();
    let b = std::fs::read(&img2).unwrap();
    assert_eq!(a.len(), b.len(), "image sizes differ between two runs");
    if a != b {
        let first = a.iter().zip(&b).position(|(x, y)| x != y).unwrap_or(0);
        panic!("two runs with SOURCE_DATE_EPOCH and -U differ, first at byte {first}");
    }
    drop((a, b));

    let (ok, text) = btrfs_check(&img1);
    assert!(ok, "btrfs check failed on the --rootdir image:\n{text}");
    butter_check(&img1);

    let got = {
        let m = LoopMount::btrfs_ro(&img1, &scratch.join("new"));
        let got = take(m.path(), &TakeOpts::default());
        m.unmount();
        got
    };
    let opts = CompareOpts {
        // A copy gets new inodes: ctime = mtime, birth time = SOURCE_DATE_EPOCH.
        ctime: false,
        btime: false,
        inode_numbers: false,
        // Subvolumes of the source are copied as plain directories.
        subvolumes: false,
        ..CompareOpts::all()
    };
    assert_same(
        &want,
        &got,
        &opts,
        "source tree vs kernel mount of the --rootdir image",
    );
    assert!(got.len() > 3000, "only {} entries copied", got.len());

    // --subvol: the source's subvolumes (the read-only snapshot read-only) stay subvolumes.
    let img3 = scratch.join("subvols.img");
    let subvols: Vec<String> = want
        .subvolumes()
        .iter()
        .map(|p| {
            let p = p.to_string_lossy().into_owned();
            if p == common::gen::SNAPSHOT {
                format!("ro:{p}")
            } else {
                p
            }
        })
        .collect();
    assert!(subvols.len() >= 2, "the generator made {subvols:?}");
    let mut extra: Vec<&str> = Vec::new();
    for s in &subvols {
        extra.push("--subvol");
        extra.push(s);
    }
    butter_mkfs_rootdir(src.path(), &img3, &extra);
    drop(src);
    let (ok, text) = btrfs_check(&img3);
    assert!(ok, "btrfs check failed on the --subvol image:\n{text}");
    butter_check(&img3);
    let m = LoopMount::btrfs_ro(&img3, &scratch.join("new3"));
    let got3 = take(m.path(), &TakeOpts::default());
    let list = Command::new("btrfs")
        .args(["subvolume", "list", "-r"])
        .arg(m.path())
        .output()
        .expect("btrfs subvolume list");
    m.unmount();
    assert_same(
        &want,
        &got3,
        &CompareOpts {
            subvolumes: true,
            ..opts.clone()
        },
        "source tree vs kernel mount of the --rootdir --subvol image",
    );
    let ro = String::from_utf8_lossy(&list.stdout);
    assert!(
        ro.lines().count() == 1 && ro.contains(common::gen::SNAPSHOT),
        "read-only subvolumes of the --subvol image: {ro}"
    );
    // Holes stay holes.
    let blocks = |p: &str| got.get(p).unwrap_or_else(|| panic!("{p} missing")).blocks;
    assert_eq!(
        blocks("sparse/all_hole"),
        0,
        "sparse/all_hole got data blocks"
    );
    assert!(
        blocks("sparse/hole_middle") * 512 <= 256 * 1024,
        "sparse/hole_middle: {} blocks",
        blocks("sparse/hole_middle")
    );
}

#[test]
fn rootdir_too_small_says_so() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("mkfs-rootdir-small");
    let src = scratch.dir("src");
    // 200 MiB of incompressible data does not fit in a 128 MiB image.
    let mut x: u64 = 0x1234_5678_9abc_def1;
    let mut data = vec![0u8; 1 << 20];
    for i in 0..200 {
        for chunk in data.chunks_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        std::fs::write(src.join(format!("f{i:03}")), &data).unwrap();
    }
    let img = scratch.join("small.img");
    let out = Command::new(BUTTER)
        .args(["mkfs", "-q", "-b", "128M", "--rootdir"])
        .arg(&src)
        .arg(&img)
        .output()
        .expect("run butter");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a 128 MiB image took 200 MiB");
    assert!(
        err.contains("the image is too small for") && err.contains("use a larger -b"),
        "unexpected error: {err}"
    );
}

/// 100k small files (the issue's size): the kernel's mount of the result must equal the source.
/// About a minute; bench/workloads/mkfs_rootdir.sh times the same thing against mkfs.btrfs.
#[test]
fn rootdir_100k_files() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("mkfs-rootdir-100k");
    let src = scratch.dir("src");
    for d in 0..100 {
        let dir = src.join(format!("d{d:03}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..1000 {
            let body = format!("file {d}/{f}\n").repeat(f % 7 + 1);
            std::fs::write(dir.join(format!("f{f:04}")), body).unwrap();
        }
    }
    let img = scratch.join("big.img");
    butter_mkfs_rootdir(&src, &img, &[]);
    let (ok, text) = btrfs_check(&img);
    assert!(ok, "btrfs check failed:\n{text}");
    let want = take(&src, &TakeOpts::default());
    let m = LoopMount::btrfs_ro(&img, &scratch.join("new"));
    let got = take(m.path(), &TakeOpts::default());
    m.unmount();
    let opts = CompareOpts {
        ctime: false,
        btime: false,
        inode_numbers: false,
        // The source is on any filesystem: directory sizes and link counts differ.
        dir_size: false,
        dir_nlink: false,
        root_attrs: false,
        subvolumes: false,
        ..CompareOpts::all()
    };
    assert_same(&want, &got, &opts, "100k tree");
}

/// `--subvol default:DIR` and `default-ro:DIR`, mkfs.btrfs's types: the kernel mounts that
/// subvolume without subvol= (read-only for default-ro), `btrfs subvolume get-default` names
/// it, the other types keep working beside it, and two defaults are refused before anything
/// is written.
#[test]
fn rootdir_default_subvolumes() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("rootdir-default");
    let src = scratch.dir("src");
    for d in ["root", "home", "var", "var/log"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
        std::fs::write(src.join(d).join("marker"), d).unwrap();
    }
    for (ty, ro) in [("default", false), ("default-ro", true)] {
        let img = scratch.join(format!("{ty}.img"));
        butter_mkfs_rootdir(
            &src,
            &img,
            &[
                "--subvol",
                &format!("{ty}:root"),
                "--subvol",
                "ro:home",
                "--subvol",
                "rw:var/log",
            ],
        );
        butter_check(&img);
        let (ok, text) = btrfs_check(&img);
        assert!(ok, "{ty}: btrfs check:\n{text}");
        let m = LoopMount::btrfs_ro(&img, &scratch.join("k"));
        assert_eq!(
            std::fs::read_to_string(m.path().join("marker")).unwrap(),
            "root",
            "{ty}: the kernel does not mount root by default"
        );
        let show = common::kernel::sh("btrfs", &["subvolume", "show", m.path().to_str().unwrap()]);
        assert_eq!(show.contains("readonly"), ro, "{ty}: flags:\n{show}");
        let def = common::kernel::sh(
            "btrfs",
            &["subvolume", "get-default", m.path().to_str().unwrap()],
        );
        assert!(def.contains("path root"), "{ty}: get-default says {def}");
        m.unmount();
        let m = LoopMount::new(
            &img,
            &scratch.join("k"),
            common::kernel::FsType::Btrfs,
            "ro,subvolid=5",
        );
        assert_eq!(
            std::fs::read_to_string(m.path().join("var/log/marker")).unwrap(),
            "var/log"
        );
        let home = common::kernel::sh(
            "btrfs",
            &["subvolume", "show", m.path().join("home").to_str().unwrap()],
        );
        assert!(home.contains("readonly"), "ro:home is not read-only");
        m.unmount();
    }
    let bad = scratch.join("bad.img");
    let out = Command::new(BUTTER)
        .args([
            "mkfs",
            "-q",
            "--subvol",
            "default:root",
            "--subvol",
            "default:home",
            "--rootdir",
        ])
        .arg(&src)
        .arg(&bad)
        .output()
        .unwrap();
    assert!(!out.status.success(), "two defaults accepted");
    assert!(!bad.exists(), "a refused mkfs left an image");
}

/// `--inode-flags nodatacow:DIR` and `nodatasum:FILE`: the directory, everything below it
/// but not a subvolume inside it, and the file carry the flags (the kernel's lsattr shows C;
/// dump-tree shows NODATASUM and no checksums for their data), contents are intact, both
/// checkers pass.
#[test]
fn rootdir_inode_flags() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("rootdir-inode-flags");
    let src = scratch.dir("src");
    for d in ["vm/disks", "vm/sub", "data"] {
        std::fs::create_dir_all(src.join(d)).unwrap();
    }
    let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
    for f in [
        "vm/disks/a.img",
        "vm/sub/b.img",
        "data/plain",
        "data/nosum",
        "top",
    ] {
        std::fs::write(src.join(f), &body).unwrap();
    }
    let img = scratch.join("f.img");
    butter_mkfs_rootdir(
        &src,
        &img,
        &[
            "--subvol",
            "vm/sub",
            "--inode-flags",
            "nodatacow:vm",
            "--inode-flags",
            "nodatasum:data/nosum",
        ],
    );
    butter_check(&img);
    let (ok, text) = btrfs_check(&img);
    assert!(ok, "btrfs check:\n{text}");
    let m = LoopMount::btrfs_ro(&img, &scratch.join("k"));
    let attr = |p: &str| {
        let out = common::kernel::sh("lsattr", &["-d", m.path().join(p).to_str().unwrap()]);
        out.split_whitespace().next().unwrap_or("").to_string()
    };
    for p in ["vm", "vm/disks", "vm/disks/a.img"] {
        assert!(attr(p).contains('C'), "{p} lacks nodatacow: {}", attr(p));
    }
    for p in ["vm/sub", "vm/sub/b.img", "data/plain", "data/nosum", "top"] {
        assert!(!attr(p).contains('C'), "{p} has nodatacow: {}", attr(p));
    }
    for f in [
        "vm/disks/a.img",
        "vm/sub/b.img",
        "data/plain",
        "data/nosum",
        "top",
    ] {
        assert_eq!(std::fs::read(m.path().join(f)).unwrap(), body, "{f}");
    }
    m.unmount();
    let dump = common::kernel::dump_tree(&img, &["-t", "5"]);
    let nosum = dump.matches("NODATASUM").count();
    // vm/disks/a.img (nodatacow implies it) and data/nosum.
    assert!(nosum >= 2, "NODATASUM on {nosum} inodes:\n{dump}");
    let bad = Command::new(BUTTER)
        .args(["mkfs", "-q", "--inode-flags", "nocompress:top", "--rootdir"])
        .arg(&src)
        .arg(scratch.join("bad.img"))
        .output()
        .unwrap();
    assert!(!bad.status.success(), "an unknown flag was accepted");
}

/// Reproducible images with no new flag: SOURCE_DATE_EPOCH and DETERMINISTIC_SEED=1 (the
/// names btrfs-progs' reproducible-build work uses) without `-U` give the same bytes twice,
/// another seed another filesystem; the image checks clean.
#[test]
fn rootdir_deterministic_seed() {
    let scratch = ScratchDir::new("rootdir-seed");
    let src = scratch.dir("src");
    for i in 0..20 {
        std::fs::write(
            src.join(format!("f{i}")),
            format!("file {i}").repeat(i * 100),
        )
        .unwrap();
    }
    let make = |name: &str, seed: &str| {
        let img = scratch.join(name);
        let out = Command::new(BUTTER)
            .args(["mkfs", "-q", "--rootdir"])
            .arg(&src)
            .arg(&img)
            .env("SOURCE_DATE_EPOCH", "1700000000")
            .env("DETERMINISTIC_SEED", seed)
            .env_remove("BUTTER_FIXED_TIME")
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        std::fs::read(&img).unwrap()
    };
    let a = make("a.img", "1");
    let b = make("b.img", "1");
    let c = make("c.img", "2");
    assert!(a == b, "two runs with DETERMINISTIC_SEED=1 differ");
    assert!(a != c, "another seed gave the same image");
    butter_check(&scratch.join("a.img"));
}

/// `--shrink`: the filesystem and the image file end where the last chunk ends, no bigger
/// than what `mkfs.btrfs --rootdir --shrink` makes of the same tree; the kernel shows the
/// tree exactly and both checkers pass.
#[test]
fn rootdir_shrink() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("rootdir-shrink");
    let src_img = scratch.join("src.img");
    common::kernel::mkfs_btrfs(&src_img, 1 << 30, &[] as &[&str]);
    let mnt = LoopMount::btrfs(&src_img, &scratch.join("src"), "");
    populate(mnt.path(), 11, Scale::Small);
    let src = mnt.path().to_path_buf();
    let img = scratch.join("b.img");
    butter_mkfs_rootdir(&src, &img, &["--shrink"]);
    let theirs = scratch.join("k.img");
    std::fs::File::create(&theirs).unwrap();
    let out = Command::new("mkfs.btrfs")
        .args(["-q", "--shrink", "--rootdir"])
        .arg(&src)
        .arg(&theirs)
        .output()
        .unwrap();
    assert!(out.status.success(), "mkfs.btrfs --shrink: {out:?}");
    let (ours, progs) = (
        std::fs::metadata(&img).unwrap().len(),
        std::fs::metadata(&theirs).unwrap().len(),
    );
    assert!(
        ours <= progs,
        "--shrink made {ours} bytes, mkfs.btrfs --shrink {progs}"
    );
    butter_check(&img);
    let (ok, text) = btrfs_check(&img);
    assert!(ok, "btrfs check:\n{text}");
    let want = take(&src, &TakeOpts::default());
    let m = LoopMount::btrfs_ro(&img, &scratch.join("k"));
    let got = take(m.path(), &TakeOpts::default());
    m.unmount();
    mnt.unmount();
    let opts = CompareOpts {
        root_attrs: false,
        atime: false,
        ..CompareOpts::restore()
    };
    assert_same(&want, &got, &opts, "--shrink");
}

/// SIGINT at points spread over a `mkfs --rootdir` never leaves an image that a checker or
/// the kernel takes for a filesystem, unless the copy completed (then both checkers pass):
/// the superblocks carry the temporary magic until the end. The command says what it left
/// (exit 130); an image file it created itself is removed.
#[test]
fn rootdir_interrupted_leaves_no_filesystem() {
    if !require_privileges() {
        return;
    }
    let scratch = ScratchDir::new("mkfs-rootdir-sigint");
    let src = scratch.dir("src");
    let mut rng = Rng::new(0x9e37_79b9_7f4a_7c15);
    for d in 0..40 {
        let dir = src.join(format!("d{d:02}"));
        std::fs::create_dir(&dir).unwrap();
        for f in 0..200 {
            std::fs::write(
                dir.join(format!("f{f:03}")),
                format!("{d}/{f}\n").repeat(f % 9 + 1),
            )
            .unwrap();
        }
    }
    let mut data = vec![0u8; 4 << 20];
    for i in 0..8 {
        rng.fill(&mut data);
        std::fs::write(src.join(format!("big{i}")), &data).unwrap();
    }
    let img = scratch.join("t.img");
    let run = |delay: Option<std::time::Duration>, img: &Path| {
        let child = Command::new(BUTTER)
            .args(["mkfs", "-f", "-q", "-b", "1G", "--rootdir"])
            .arg(&src)
            .arg(img)
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run butter");
        if let Some(d) = delay {
            std::thread::sleep(d);
            // SAFETY: a signal to our own child.
            unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
        }
        let out = child.wait_with_output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    std::fs::File::create(&img)
        .unwrap()
        .set_len(1 << 30)
        .unwrap();
    let t0 = std::time::Instant::now();
    let (code, err) = run(None, &img);
    let full = t0.elapsed();
    assert_eq!(code, Some(0), "{err}");
    butter_check(&img);
    let (mut unfinished, mut complete) = (0, 0);
    for k in 0..8u32 {
        // Spread over the run, and past its end for the last points.
        let frac = (f64::from(k) + rng.below(1000) as f64 / 1000.0) / 7.0;
        let delay = full.mul_f64(frac);
        let (code, err) = run(Some(delay), &img);
        let (ok, text) = btrfs_check(&img);
        if code == Some(0) {
            complete += 1;
            assert!(ok, "a complete copy fails btrfs check:\n{text}");
            butter_check(&img);
            continue;
        }
        unfinished += 1;
        assert_eq!(code, Some(130), "interrupted at {delay:?}: {err}");
        assert!(
            err.contains("interrupted") && err.contains("left unfinished"),
            "interrupted at {delay:?}: {err}"
        );
        assert!(
            !ok,
            "interrupted at {delay:?}, yet btrfs check passes:\n{text}"
        );
        let ours = Command::new(BUTTER)
            .arg("check")
            .arg(&img)
            .output()
            .unwrap();
        assert!(
            !ours.status.success(),
            "butter check passes an unfinished image"
        );
        assert!(
            String::from_utf8_lossy(&ours.stderr).contains("unfinished"),
            "{}",
            String::from_utf8_lossy(&ours.stderr)
        );
        let mnt = scratch.dir(format!("m{k}"));
        let mounted = Command::new("mount")
            .args(["-t", "btrfs", "-o", "ro,loop"])
            .arg(&img)
            .arg(&mnt)
            .output()
            .unwrap();
        if mounted.status.success() {
            let _ = Command::new("umount").arg(&mnt).status();
            panic!("the kernel mounted an image interrupted at {delay:?}");
        }
    }
    assert!(
        unfinished >= 3,
        "only {unfinished} runs were interrupted (full run {full:?})"
    );
    assert!(complete <= 5, "{complete}");
    // An image the command created itself is removed.
    let fresh = scratch.join("fresh.img");
    let (code, err) = run(Some(full / 3), &fresh);
    if code != Some(0) {
        assert_eq!(code, Some(130), "{err}");
        assert!(err.contains("removed"), "{err}");
        assert!(!fresh.exists(), "{err}");
    }
}
