//! Filesystems of several devices, against the kernel: for each profile, mkfs.btrfs makes the
//! filesystem on several image files, the kernel fills it through loop devices, and butter
//! must read back exactly what the kernel shows (restore with `--device`, and a read-only
//! FUSE mount with `-o device=`): with every device, with devices missing (`--degraded`, as
//! many as the profile tolerates), and with random blocks of a device overwritten (reads
//! must find the good copy or rebuild from parity). Refusals are checked too: a missing
//! device without `--degraded`, a device given twice, a device of another filesystem, and a
//! change to a filesystem of several devices, which butter does not write yet.
//!
//! Needs root, loop devices, kernel btrfs and btrfs-progs; /dev/fuse for the mount. Without
//! them the tests print a notice and pass, unless `CI` is set (then they fail).

mod common;

use common::fuse_mount::ButterMount;
use common::kernel::{self, MultiLoopMount, ScratchDir};
use common::manifest::{self, CompareOpts, Manifest, TakeOpts};
use std::fs;
use std::io::{Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

const DEV_SIZE: u64 = 300 << 20;

use common::{output_text as text, run_butter as butter};

/// A small xorshift generator: the same bytes on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n + 8);
        while v.len() < n {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(n);
        v
    }
}

/// Files that cross 64 KiB stripe boundaries and full stripes, small ones kept inline, a
/// sparse one, a directory tree, a symlink, a hard link and an xattr.
fn fill(root: &Path, seed: u64) {
    let mut rng = Rng(seed | 1);
    let d = root.join("dir/sub");
    fs::create_dir_all(&d).unwrap();
    for (i, size) in [
        0usize,
        100,
        3000,
        4096,
        65536,
        65537,
        200_000,
        1 << 20,
        3_000_001,
    ]
    .into_iter()
    .enumerate()
    {
        fs::write(root.join(format!("f{i}")), rng.bytes(size)).unwrap();
    }
    for i in 0..40 {
        fs::write(d.join(format!("small{i}")), rng.bytes(500 + i * 37)).unwrap();
    }
    // Compressible text (compressed on the mounts that ask for it).
    let line = b"the quick brown fox jumps over the lazy dog 0123456789\n";
    fs::write(root.join("text"), line.repeat(20_000)).unwrap();
    let mut f = fs::File::create(root.join("sparse")).unwrap();
    f.seek(SeekFrom::Start(5 << 20)).unwrap();
    f.write_all(&rng.bytes(70_000)).unwrap();
    drop(f);
    std::os::unix::fs::symlink("dir/sub/small3", root.join("link")).unwrap();
    fs::hard_link(root.join("f5"), root.join("dir/f5-again")).unwrap();
    kernel::sh(
        "setfattr",
        &[
            "-n",
            "user.what",
            "-v",
            "multi",
            &root.join("f1").display().to_string(),
        ],
    );
}

/// One profile's filesystem: its images (the first is the one named as IMAGE).
struct Volume {
    images: Vec<PathBuf>,
}

impl Volume {
    /// mkfs.btrfs `-d data -m meta` over `n` images, filled by the kernel (`mount_opts`).
    fn make(
        s: &ScratchDir,
        name: &str,
        data: &str,
        meta: &str,
        n: usize,
        mount_opts: &str,
    ) -> Volume {
        let images: Vec<PathBuf> = (0..n).map(|i| s.join(format!("{name}-{i}.img"))).collect();
        for img in &images {
            let f = fs::File::create(img).unwrap();
            f.set_len(DEV_SIZE).unwrap();
        }
        kernel::run(
            Command::new("mkfs.btrfs")
                .args(["-f", "-q", "-d", data, "-m", meta])
                .args(&images),
        );
        let m = MultiLoopMount::new(&images, &s.dir(format!("{name}.kmnt")), mount_opts);
        fill(m.path(), name.len() as u64 * 7919);
        m.unmount();
        Volume { images }
    }

    /// `--device` for every image but the first, leaving out `skip`.
    fn device_args(&self, skip: &[usize]) -> Vec<String> {
        let mut v = Vec::new();
        for (i, img) in self.images.iter().enumerate().skip(1) {
            if !skip.contains(&i) {
                v.push("--device".to_string());
                v.push(img.display().to_string());
            }
        }
        v
    }

    /// What the kernel shows, mounted read-only with every device.
    fn kernel_manifest(&self, s: &ScratchDir, name: &str) -> Manifest {
        let m = MultiLoopMount::new(&self.images, &s.dir(format!("{name}.kro")), "ro,noatime");
        let got = manifest::take(m.path(), &TakeOpts::default());
        m.unmount();
        got
    }
}

/// `butter restore` of `first` (an image) with `args`, into a fresh directory; the result.
fn restore(s: &ScratchDir, first: &Path, args: &[String], what: &str) -> Manifest {
    let out = s.join(format!("restore-{}", what.replace([' ', '/', ','], "-")));
    let _ = fs::remove_dir_all(&out);
    fs::create_dir_all(&out).unwrap();
    let mut a: Vec<String> = vec![
        "restore".into(),
        first.display().to_string(),
        out.display().to_string(),
    ];
    a.extend(args.iter().cloned());
    let refs: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    let o = butter(&refs);
    assert!(
        o.status.success(),
        "{what}: butter {a:?} failed:\n{}",
        text(&o)
    );
    assert!(!text(&o).contains("panicked"), "{what}: {}", text(&o));
    let m = manifest::take(&out, &TakeOpts::default());
    fs::remove_dir_all(&out).unwrap();
    m
}

/// `butter check` with the devices in `args`: must be clean.
fn check_clean(first: &Path, args: &[String], what: &str) {
    let mut a: Vec<String> = vec!["check".into(), first.display().to_string()];
    a.extend(args.iter().cloned());
    let refs: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
    let o = butter(&refs);
    let t = text(&o);
    assert!(
        o.status.success(),
        "{what}: butter check found problems:\n{t}"
    );
    assert!(t.contains("0 fatal, 0 errors"), "{what}: {t}");
}

/// Overwrites `count` random 4 KiB blocks of `img` past its first MiB, sparing the
/// superblock copies, with random bytes.
fn scribble(img: &Path, count: usize, seed: u64) {
    let mut rng = Rng(seed | 1);
    let mut f = fs::OpenOptions::new().write(true).open(img).unwrap();
    let blocks = DEV_SIZE / 4096;
    let mut done = 0;
    while done < count {
        let b = 256 + rng.next() % (blocks - 256);
        let at = b * 4096;
        if at == 64 << 20 {
            continue;
        }
        f.seek(SeekFrom::Start(at)).unwrap();
        f.write_all(&rng.bytes(4096)).unwrap();
        done += 1;
    }
    f.sync_all().unwrap();
}

/// (name, data profile, metadata profile, devices, devices that may be missing, kernel
/// mount options while filling)
const PROFILES: &[(&str, &str, &str, usize, usize, &str)] = &[
    ("single", "single", "dup", 2, 0, ""),
    ("raid0", "raid0", "raid1", 3, 0, ""),
    ("raid1", "raid1", "raid1", 2, 1, ""),
    ("raid1c3", "raid1c3", "raid1c3", 3, 2, ""),
    ("raid1c4", "raid1c4", "raid1c4", 4, 3, ""),
    ("raid10", "raid10", "raid10", 4, 1, "compress=zstd"),
    ("raid5", "raid5", "raid5", 3, 1, "compress=zstd"),
    ("raid6", "raid6", "raid6", 4, 2, ""),
];

#[test]
fn every_profile_reads_as_the_kernel_shows_it_whole_degraded_and_damaged() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("multi-device-profiles");
    let opts = CompareOpts::restore();
    for &(name, data, meta, n, tolerated, mopts) in PROFILES {
        let v = Volume::make(&s, name, data, meta, n, mopts);
        let want = v.kernel_manifest(&s, name);
        assert!(
            want.len() > 50,
            "{name}: the kernel shows only {} entries",
            want.len()
        );
        // Whole.
        let all = v.device_args(&[]);
        let got = restore(&s, &v.images[0], &all, &format!("{name} whole"));
        manifest::assert_same(
            &want,
            &got,
            &opts,
            &format!("{name}: restore with every device"),
        );
        check_clean(&v.images[0], &all, name);
        // Named from another device, the others in reverse order.
        let mut rev: Vec<String> = Vec::new();
        for img in v.images.iter().rev().skip(1) {
            rev.push("--device".into());
            rev.push(img.display().to_string());
        }
        let got = restore(&s, &v.images[n - 1], &rev, &format!("{name} reversed"));
        manifest::assert_same(
            &want,
            &got,
            &opts,
            &format!("{name}: restore from the last device"),
        );
        // Without the others: refused, naming what is missing and what to do.
        let o = butter(&["ls", v.images[0].to_str().unwrap()]);
        let t = text(&o);
        assert!(
            !o.status.success(),
            "{name}: read without its other devices:\n{t}"
        );
        assert!(
            t.contains("missing") && t.contains("--device"),
            "{name}: {t}"
        );
        // Degraded: the last `tolerated` devices gone.
        if tolerated > 0 {
            let gone: Vec<usize> = (n - tolerated..n).collect();
            let mut args = v.device_args(&gone);
            args.push("--degraded".into());
            let got = restore(&s, &v.images[0], &args, &format!("{name} degraded"));
            manifest::assert_same(
                &want,
                &got,
                &opts,
                &format!("{name}: restore with devices {gone:?} missing"),
            );
            // Random blocks of one device (two for RAID6) overwritten: the good copy or the
            // parity serves every read, and nothing is written.
            let copies: Vec<PathBuf> = v
                .images
                .iter()
                .map(|img| {
                    let c = img.with_extension("damaged");
                    fs::copy(img, &c).unwrap();
                    c
                })
                .collect();
            for (k, c) in copies.iter().enumerate().skip(1).take(tolerated) {
                scribble(c, 3000, 17 + k as u64);
            }
            let before: Vec<Vec<u8>> = copies.iter().map(|c| fs::read(c).unwrap()).collect();
            let damaged = Volume { images: copies };
            let got = restore(
                &s,
                &damaged.images[0],
                &damaged.device_args(&[]),
                &format!("{name} damaged"),
            );
            manifest::assert_same(
                &want,
                &got,
                &opts,
                &format!("{name}: restore of damaged devices"),
            );
            for (c, b) in damaged.images.iter().zip(&before) {
                assert!(
                    fs::read(c).unwrap() == *b,
                    "{name}: a read-only restore wrote {}",
                    c.display()
                );
            }
            // butter scrub: read-only, it finds the damage and changes nothing; then it
            // repairs it; then nothing is left, for butter, btrfs check and the kernel's scrub.
            let dargs = damaged.device_args(&[]);
            let scrub = |extra: &[&str]| {
                let mut a: Vec<String> = vec!["scrub".into(), "start".into()];
                a.extend(extra.iter().map(|x| x.to_string()));
                a.push(damaged.images[0].display().to_string());
                a.extend(dargs.iter().cloned());
                let refs: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
                butter(&refs)
            };
            let o = scrub(&["-r"]);
            let t = text(&o);
            assert!(
                !o.status.success() && t.contains("Error summary:    csum="),
                "{name}: scrub -r:\n{t}"
            );
            for (c, b) in damaged.images.iter().zip(&before) {
                assert!(
                    fs::read(c).unwrap() == *b,
                    "{name}: scrub -r wrote {}",
                    c.display()
                );
            }
            let o = scrub(&["-d"]);
            let t = text(&o);
            assert!(
                o.status.success() && t.contains("Corrected:"),
                "{name}: scrub:\n{t}"
            );
            let o = scrub(&["-r"]);
            let t = text(&o);
            assert!(
                o.status.success() && t.contains("no errors found"),
                "{name}: scrub after repair:\n{t}"
            );
            let (ok, t) = kernel::btrfs_check_devices(&damaged.images);
            assert!(ok, "{name}: btrfs check after butter scrub:\n{t}");
            kernel_scrub_clean(&s, &damaged.images, &format!("{name} after butter scrub"));
            for c in &damaged.images {
                fs::remove_file(c).unwrap();
            }
        }
        // The kernel still agrees the devices are sound: nothing above wrote to them.
        let (ok, t) = kernel::btrfs_check_devices(&v.images);
        assert!(ok, "{name}: btrfs check after butter read it:\n{t}");
        for img in &v.images {
            fs::remove_file(img).unwrap();
        }
    }
}

/// Every profile of [`PROFILES`] through a read-only `butter mount`: with every device, and
/// (where the profile can lose some) with as many devices missing as it tolerates, the mount
/// shows what the kernel shows.
#[test]
fn mount_reads_every_profile_through_fuse_whole_and_degraded() {
    if !common::fuse_mount::require(
        "mount_reads_every_profile_through_fuse_whole_and_degraded",
        &[],
    ) || !kernel::require_privileges()
    {
        return;
    }
    let s = ScratchDir::new("multi-device-mount");
    for &(name, data, meta, n, tolerated, mount_opts) in PROFILES {
        let v = Volume::make(&s, name, data, meta, n, mount_opts);
        let want = v.kernel_manifest(&s, name);
        let gone: Vec<usize> = (n - tolerated..n).collect();
        let mut ways = vec![("whole", vec![], false)];
        if tolerated > 0 {
            ways.push(("degraded", gone, true));
        }
        for (what, skip, degraded) in ways {
            let mut o = vec!["ro".to_string()];
            for (i, img) in v.images.iter().enumerate().skip(1) {
                if !skip.contains(&i) {
                    o.push(format!("device={}", img.display()));
                }
            }
            if degraded {
                o.push("degraded".into());
            }
            let opts = o.join(",");
            let dir = s.dir(format!("{name}-{what}.mnt"));
            let log = s.join(format!("{name}-{what}.log"));
            let m = ButterMount::start(&v.images[0], &dir, &["-o", &opts], &log);
            let got = manifest::take(m.path(), &TakeOpts::default());
            m.unmount();
            manifest::assert_same(
                &want,
                &got,
                &CompareOpts::fuse(),
                &format!("{name}: butter mount -o {opts}"),
            );
        }
        for img in &v.images {
            fs::remove_file(img).unwrap();
        }
    }
}

#[test]
fn wrong_device_sets_are_refused_by_name_and_nothing_is_written() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("multi-device-refusals");
    let v = Volume::make(&s, "r1", "raid1", "raid1", 2, "");
    let other = Volume::make(&s, "o1", "raid1", "raid1", 2, "");
    let a = v.images[0].to_str().unwrap();
    let b = v.images[1].to_str().unwrap();
    let x = other.images[1].to_str().unwrap();
    let before: Vec<Vec<u8>> = v.images.iter().map(|i| fs::read(i).unwrap()).collect();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["ls", a],
            &["device 2", "missing", "--device", "--degraded"],
        ),
        (&["ls", a, "--device", a], &["same device", "once"]),
        (&["ls", a, "--device", x], &["another filesystem"]),
        (&["subvolume", "create", a, "new"], &["missing", "--device"]),
        (&["check", a], &["device 2", "missing", "--device"]),
    ];
    for (args, want) in cases {
        let o = butter(args);
        let t = text(&o);
        assert!(!o.status.success(), "butter {args:?} succeeded:\n{t}");
        assert!(!t.contains("panicked"), "butter {args:?}: {t}");
        // One device of several holds its share of the filesystem, not all of it.
        assert!(!t.contains("truncated"), "butter {args:?}: {t}");
        for w in *want {
            assert!(t.contains(w), "butter {args:?}: no {w:?} in:\n{t}");
        }
    }
    let dir = s.dir("rw.mnt");
    let log = s.join("rw.log");
    // RAID0 data lost with a device: not even a degraded read-write open.
    let z = Volume::make(&s, "z0", "raid0", "raid1", 2, "");
    let zb = fs::read(&z.images[0]).unwrap();
    let o = butter(&[
        "subvolume",
        "create",
        z.images[0].to_str().unwrap(),
        "new",
        "--degraded",
    ]);
    assert!(
        !o.status.success() && text(&o).contains("cannot be written degraded"),
        "{}",
        text(&o)
    );
    match ButterMount::try_start(&z.images[0], &dir, &["-o", "degraded"], &log) {
        Ok(m) => {
            m.unmount();
            panic!("a degraded read-write mount of RAID0 started");
        }
        Err((_, t)) => assert!(t.contains("cannot be written degraded"), "{t}"),
    }
    assert!(
        fs::read(&z.images[0]).unwrap() == zb,
        "a refused degraded open wrote"
    );
    for (img, b) in v.images.iter().zip(&before) {
        assert!(fs::read(img).unwrap() == *b, "{} changed", img.display());
    }
    // With both: a change goes to both devices, and both checkers and the kernel agree.
    let o = butter(&["subvolume", "create", a, "new", "--device", b]);
    assert!(o.status.success(), "{}", text(&o));
    let o = butter(&["ls", a, "--device", b]);
    assert!(
        o.status.success() && text(&o).contains("new"),
        "{}",
        text(&o)
    );
    check_clean(&v.images[0], &["--device".into(), b.into()], "raid1");
    let (ok, t) = kernel::btrfs_check_devices(&v.images);
    assert!(
        ok,
        "btrfs check after a subvolume create on two devices:\n{t}"
    );
    let m = MultiLoopMount::new(&v.images, &s.dir("rw.k"), "ro");
    assert!(
        m.path().join("new").is_dir(),
        "the kernel does not see the new subvolume"
    );
    m.unmount();
}

/// Changes through butter's mount: the files of [`fill`], a file large enough to need new
/// data chunks, then overwrites, a truncate and deletes.
fn churn(root: &Path, seed: u64) {
    fill(root, seed);
    let mut rng = Rng(seed ^ 0x9e37_79b9);
    let big = rng.bytes(200 << 20);
    fs::write(root.join("big"), &big).unwrap();
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(root.join("f7"))
        .unwrap();
    for i in 0..20u64 {
        f.seek(SeekFrom::Start((rng.next() % (1 << 20)) & !4095))
            .unwrap();
        f.write_all(&rng.bytes(4096 + i as usize * 100)).unwrap();
    }
    drop(f);
    fs::OpenOptions::new()
        .write(true)
        .open(root.join("f8"))
        .unwrap()
        .set_len(1_234_567)
        .unwrap();
    for i in (0..40).step_by(3) {
        fs::remove_file(root.join(format!("dir/sub/small{i}"))).unwrap();
    }
    fs::remove_file(root.join("f6")).unwrap();
}

#[test]
fn butter_writes_every_profile_and_the_kernel_reads_and_scrubs_it_clean() {
    if !common::fuse_mount::require(
        "butter_writes_every_profile_and_the_kernel_reads_and_scrubs_it_clean",
        &[],
    ) || !kernel::require_privileges()
    {
        return;
    }
    let s = ScratchDir::new("multi-device-writes");
    let profiles: &[(&str, &str, &str, usize, usize)] = &[
        ("single", "single", "raid1", 2, 0),
        ("raid0", "raid0", "raid0", 3, 0),
        ("raid1", "raid1", "raid1", 2, 1),
        ("raid1c3", "raid1c3", "raid1c3", 3, 2),
        ("raid1c4", "raid1c4", "raid1c4", 4, 3),
        ("dup", "dup", "raid1", 2, 0),
        ("raid10", "raid10", "raid10", 4, 1),
        ("raid5", "raid5", "raid5", 3, 1),
        ("raid6", "raid6", "raid6", 4, 2),
    ];
    for &(name, data, meta, n, tolerated) in profiles {
        let images: Vec<PathBuf> = (0..n).map(|i| s.join(format!("{name}-{i}.img"))).collect();
        for img in &images {
            fs::File::create(img).unwrap().set_len(512 << 20).unwrap();
        }
        kernel::run(
            Command::new("mkfs.btrfs")
                .args(["-f", "-q", "-d", data, "-m", meta])
                .args(&images),
        );
        let v = Volume { images };
        let mut o = Vec::new();
        for img in &v.images[1..] {
            o.push(format!("device={}", img.display()));
        }
        let opts = o.join(",");
        let dir = s.dir(format!("{name}.mnt"));
        let log = s.join(format!("{name}.log"));
        let m = ButterMount::start_env(
            &v.images[0],
            &dir,
            &["-o", &opts],
            &log,
            &[("RUST_LOG", "info")],
        );
        churn(m.path(), n as u64 * 31 + name.len() as u64);
        let shown = manifest::take(m.path(), &TakeOpts::default());
        m.unmount();
        assert!(
            fs::read_to_string(&log)
                .unwrap_or_default()
                .contains(&format!(
                    "added a {} Data chunk",
                    match data {
                        "single" => "single",
                        d => Box::leak(d.to_uppercase().into_boxed_str()),
                    }
                )),
            "{name}: no new data chunk was needed:\n{}",
            fs::read_to_string(&log).unwrap_or_default()
        );
        check_clean(&v.images[0], &v.device_args(&[]), name);
        let (ok, t) = kernel::btrfs_check_devices(&v.images);
        assert!(ok, "{name}: btrfs check of what butter wrote:\n{t}");
        let want = v.kernel_manifest(&s, name);
        manifest::assert_same(
            &shown,
            &want,
            &CompareOpts::fuse(),
            &format!("{name}: the kernel after butter wrote"),
        );
        if tolerated > 0 {
            // Every copy and parity block is right: the last devices can go.
            let gone: Vec<usize> = (n - tolerated..n).collect();
            let mut args = v.device_args(&gone);
            args.push("--degraded".into());
            let got = restore(&s, &v.images[0], &args, &format!("{name} written degraded"));
            manifest::assert_same(
                &want,
                &got,
                &CompareOpts::restore(),
                &format!("{name}: what butter wrote, read with devices {gone:?} missing"),
            );
        }
        // The kernel's scrub reads every copy and every parity block (after the degraded
        // read: it would repair a stale parity block).
        kernel_scrub_clean(&s, &v.images, name);
        for img in &v.images {
            fs::remove_file(img).unwrap();
        }
    }
}

/// The kernel's `btrfs scrub` over the devices finds nothing to correct.
fn kernel_scrub_clean(s: &ScratchDir, images: &[PathBuf], what: &str) {
    let km = MultiLoopMount::new(
        images,
        &s.dir(format!("{}.scrub", what.replace(' ', "-"))),
        "",
    );
    let out = kernel::run_output(
        Command::new("btrfs")
            .args(["scrub", "start", "-B", "-R"])
            .arg(km.path()),
    );
    let t = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    km.unmount();
    assert!(
        out.status.success(),
        "{what}: the kernel's scrub failed:\n{t}"
    );
    for field in [
        "csum_errors: 0",
        "verify_errors: 0",
        "read_errors: 0",
        "uncorrectable_errors: 0",
        "corrected_errors: 0",
    ] {
        assert!(
            t.contains(field),
            "{what}: scrub did not report {field}:\n{t}"
        );
    }
}

/// A read-write mount with the last device missing (`-o degraded`): changes go to the
/// devices left (RAID5 rows rebuilt around the missing one, new chunks SINGLE where the
/// devices left cannot make the profile). Then the device comes back with its stale copies:
/// `butter scrub` repairs them (a stale tree block fails the extent item's generation, stale
/// data its checksum), after which both checkers, the kernel's view and its scrub agree.
#[test]
fn degraded_read_write_then_the_device_returns_and_scrub_repairs_it() {
    if !common::fuse_mount::require(
        "degraded_read_write_then_the_device_returns_and_scrub_repairs_it",
        &[],
    ) || !kernel::require_privileges()
    {
        return;
    }
    let s = ScratchDir::new("multi-device-degraded-rw");
    for (name, n) in [("raid1", 2usize), ("raid5", 3), ("raid6", 4)] {
        let v = Volume::make(&s, &format!("dg-{name}"), name, name, n, "");
        let mut o = vec!["degraded".to_string()];
        for img in &v.images[1..n - 1] {
            o.push(format!("device={}", img.display()));
        }
        let opts = o.join(",");
        let log = s.join(format!("dg-{name}.log"));
        let m = ButterMount::start(
            &v.images[0],
            &s.dir(format!("dg-{name}.mnt")),
            &["-o", &opts],
            &log,
        );
        let mut rng = Rng(n as u64 * 977);
        std::fs::create_dir_all(m.path().join("while-away")).unwrap();
        for i in 0..30usize {
            fs::write(
                m.path().join(format!("while-away/w{i}")),
                rng.bytes(1000 + i * 7919),
            )
            .unwrap();
        }
        fs::write(m.path().join("while-away/big"), rng.bytes(40 << 20)).unwrap();
        let mut f = fs::OpenOptions::new()
            .write(true)
            .open(m.path().join("f7"))
            .unwrap();
        f.seek(SeekFrom::Start(4096)).unwrap();
        f.write_all(&rng.bytes(300_000)).unwrap();
        drop(f);
        fs::remove_file(m.path().join("f6")).unwrap();
        let seen = manifest::take(m.path(), &TakeOpts::default());
        m.unmount();
        let mut away = v.device_args(&[n - 1]);
        away.push("--degraded".into());
        check_clean(&v.images[0], &away, &format!("{name} degraded"));
        // The device is back: its copies are stale until the scrub.
        let all = v.device_args(&[]);
        let scrub = |extra: &[&str]| {
            let mut a: Vec<String> = vec!["scrub".into(), "start".into()];
            a.extend(extra.iter().map(|x| x.to_string()));
            a.push(v.images[0].display().to_string());
            a.extend(all.iter().cloned());
            let refs: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
            butter(&refs)
        };
        let o = scrub(&["-d"]);
        assert!(
            o.status.success(),
            "{name}: scrub after the device returned:\n{}",
            text(&o)
        );
        assert!(
            text(&o).contains("Corrected:"),
            "{name}: the scrub found nothing stale:\n{}",
            text(&o)
        );
        let o = scrub(&["-r"]);
        assert!(
            o.status.success() && text(&o).contains("no errors found"),
            "{name}: {}",
            text(&o)
        );
        check_clean(&v.images[0], &all, &format!("{name} after scrub"));
        let (ok, t) = kernel::btrfs_check_devices(&v.images);
        assert!(
            ok,
            "{name}: btrfs check after the degraded writes and the scrub:\n{t}"
        );
        let got = v.kernel_manifest(&s, &format!("dg-{name}"));
        let copts = CompareOpts {
            atime: false,
            ..CompareOpts::fuse()
        };
        manifest::assert_same(
            &seen,
            &got,
            &copts,
            &format!("{name}: written degraded, seen by the kernel"),
        );
        kernel_scrub_clean(&s, &v.images, &format!("dg-{name}"));
        for img in &v.images {
            fs::remove_file(img).unwrap();
        }
    }
}

/// `butter mkfs` over several devices with every profile (`-m`/`-d`, devices positional or
/// `--device`): both checkers pass on the new filesystem, the kernel mounts all the devices,
/// fills them past the first chunks and its scrub finds every copy and parity block right;
/// after that butter reads what the kernel wrote, whole and with the devices the profile
/// can lose missing.
#[test]
fn butter_mkfs_makes_every_profile_the_kernel_mounts_fills_and_scrubs() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("multi-device-mkfs");
    // (name, -m, -d, devices, devices that may be missing, sizes in MiB or 0 for DEV_SIZE)
    type Case<'a> = (&'a str, &'a str, &'a str, usize, usize, &'a [u64]);
    let cases: &[Case] = &[
        ("default", "", "", 2, 0, &[]),
        ("raid0-one", "raid0", "raid0", 1, 0, &[]),
        ("raid1", "raid1", "raid1", 2, 1, &[]),
        ("raid1c3", "raid1c3", "raid1c3", 3, 2, &[]),
        ("raid1c4", "raid1c4", "raid1c4", 4, 3, &[]),
        ("raid10", "raid10", "raid10", 4, 1, &[]),
        ("raid10-odd", "raid1", "raid10", 3, 1, &[]),
        ("raid5", "raid5", "raid5", 3, 1, &[200, 300, 400]),
        ("raid6", "raid6", "raid6", 4, 2, &[]),
        ("raid56", "raid6", "raid5", 5, 1, &[]),
        ("dup", "dup", "raid0", 2, 0, &[]),
    ];
    for &(name, meta, data, n, tolerated, sizes) in cases {
        let images: Vec<PathBuf> = (0..n).map(|i| s.join(format!("{name}-{i}.img"))).collect();
        for (i, img) in images.iter().enumerate() {
            let mib = sizes.get(i).copied().unwrap_or(DEV_SIZE >> 20);
            fs::File::create(img).unwrap().set_len(mib << 20).unwrap();
        }
        let mut args: Vec<String> = vec!["mkfs".into(), "-q".into()];
        if !meta.is_empty() {
            args.extend(["-m".into(), meta.into(), "-d".into(), data.into()]);
        }
        args.push(images[0].display().to_string());
        for (i, img) in images.iter().enumerate().skip(1) {
            // Half the devices named with --device, as every other command takes them.
            if i % 2 == 0 {
                args.push("--device".into());
            }
            args.push(img.display().to_string());
        }
        let refs: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
        let o = butter(&refs);
        assert!(o.status.success(), "{name}: butter {args:?}:\n{}", text(&o));
        let v = Volume { images };
        check_clean(&v.images[0], &v.device_args(&[]), &format!("{name} new"));
        let (ok, t) = kernel::btrfs_check_devices(&v.images);
        assert!(ok, "{name}: btrfs check of the new filesystem:\n{t}");
        // The profiles are the ones asked for (the default on several devices: RAID1
        // metadata, single data), as the kernel reports them.
        let m = MultiLoopMount::new(&v.images, &s.dir(format!("{name}.kmnt")), "");
        let df = kernel::run_output(
            Command::new("btrfs")
                .args(["filesystem", "df"])
                .arg(m.path()),
        );
        let df = String::from_utf8_lossy(&df.stdout).to_string();
        let (want_meta, want_data) = match meta {
            "" => ("RAID1".to_string(), "single".to_string()),
            m => {
                let up = |p: &str| match p {
                    "dup" => "DUP".to_string(),
                    p => p.to_uppercase(),
                };
                (up(m), up(data))
            }
        };
        for (kind, p) in [
            ("Data", &want_data),
            ("Metadata", &want_meta),
            ("System", &want_meta),
        ] {
            assert!(
                df.contains(&format!("{kind}, {p}:")),
                "{name}: no {kind}, {p} in the kernel's df:\n{df}"
            );
        }
        let devices = kernel::run_output(
            Command::new("btrfs")
                .args(["filesystem", "show"])
                .arg(m.path()),
        );
        let shown = String::from_utf8_lossy(&devices.stdout).to_string();
        assert!(
            shown.contains(&format!("Total devices {n}")),
            "{name}: the kernel does not see {n} devices:\n{shown}"
        );
        fill(m.path(), n as u64 * 131 + name.len() as u64);
        // More than the first data chunk holds: the kernel adds chunks of the profile.
        let mut rng = Rng(name.len() as u64 * 7 + 1);
        fs::write(m.path().join("big"), rng.bytes(120 << 20)).unwrap();
        m.unmount();
        let (ok, t) = kernel::btrfs_check_devices(&v.images);
        assert!(ok, "{name}: btrfs check after the kernel wrote:\n{t}");
        check_clean(&v.images[0], &v.device_args(&[]), &format!("{name} filled"));
        kernel_scrub_clean(&s, &v.images, name);
        let want = v.kernel_manifest(&s, name);
        let got = restore(&s, &v.images[0], &v.device_args(&[]), name);
        manifest::assert_same(
            &want,
            &got,
            &CompareOpts::restore(),
            &format!("{name}: butter reads what the kernel wrote on butter's mkfs"),
        );
        if tolerated > 0 {
            let gone: Vec<usize> = (n - tolerated..n).collect();
            let mut args = v.device_args(&gone);
            args.push("--degraded".into());
            let got = restore(&s, &v.images[0], &args, &format!("{name} degraded"));
            manifest::assert_same(
                &want,
                &got,
                &CompareOpts::restore(),
                &format!("{name}: with devices {gone:?} missing"),
            );
        }
        for img in &v.images {
            fs::remove_file(img).unwrap();
        }
    }
}

/// `butter mkfs --rootdir` over four devices: the kernel shows the tree as it was; and
/// what mkfs refuses on several devices, before it writes a byte.
#[test]
fn butter_mkfs_rootdir_on_several_devices_and_what_it_refuses() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("multi-device-mkfs-rootdir");
    let src = s.dir("src");
    fill(&src, 4242);
    let images: Vec<PathBuf> = (0..4).map(|i| s.join(format!("rd-{i}.img"))).collect();
    let mut args: Vec<String> = [
        "mkfs", "-q", "-b", "256M", "-m", "raid1c3", "-d", "raid10", "-r",
    ]
    .iter()
    .map(|x| x.to_string())
    .collect();
    args.push(src.display().to_string());
    args.extend(images.iter().map(|i| i.display().to_string()));
    let refs: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
    let o = butter(&refs);
    assert!(o.status.success(), "butter {args:?}:\n{}", text(&o));
    for img in &images {
        assert_eq!(
            fs::metadata(img).unwrap().len(),
            256 << 20,
            "-b sizes each device"
        );
    }
    let v = Volume {
        images: images.clone(),
    };
    check_clean(&images[0], &v.device_args(&[]), "rootdir");
    let (ok, t) = kernel::btrfs_check_devices(&images);
    assert!(ok, "btrfs check of mkfs --rootdir on four devices:\n{t}");
    let want = manifest::take(&src, &TakeOpts::default());
    let got = v.kernel_manifest(&s, "rootdir");
    manifest::assert_same(
        &want,
        &got,
        &CompareOpts::restore(),
        "the kernel's view of mkfs --rootdir over four devices",
    );
    kernel_scrub_clean(&s, &images, "rootdir");

    // Refusals: too few devices for a profile, a device named twice, --shrink; the
    // images keep every byte.
    let before: Vec<Vec<u8>> = images.iter().map(|i| fs::read(i).unwrap()).collect();
    let (a, b, c) = (
        images[0].to_str().unwrap(),
        images[1].to_str().unwrap(),
        images[2].to_str().unwrap(),
    );
    let cases: &[(&[&str], &[&str])] = &[
        (
            &["mkfs", "-f", "-m", "raid6", a, b],
            &["RAID6", "at least 3", "-m"],
        ),
        (
            &["mkfs", "-f", "-d", "raid1c4", a, b, c],
            &["RAID1C4", "at least 4", "-d"],
        ),
        (&["mkfs", "-f", "-m", "raid1", a], &["RAID1", "at least 2"]),
        (&["mkfs", "-f", a, b, "--device", a], &["given twice"]),
        (&["mkfs", a, b], &["existing filesystem", "-f"]),
        (
            &["mkfs", "-f", "--shrink", "-r", "/etc", a, b],
            &["--shrink", "one device"],
        ),
        (&["mkfs", "-f", "-m", "raid7", a, b], &["raid7", "raid1c3"]),
    ];
    for (args, want) in cases {
        let o = butter(args);
        let t = text(&o);
        assert!(!o.status.success(), "butter {args:?} succeeded:\n{t}");
        assert!(!t.contains("panicked"), "butter {args:?}: {t}");
        for w in *want {
            assert!(t.contains(w), "butter {args:?}: no {w:?} in:\n{t}");
        }
    }
    for (img, b) in images.iter().zip(&before) {
        assert!(fs::read(img).unwrap() == *b, "{} changed", img.display());
    }
}

/// The RAID5 write hole, made on purpose and met as the kernel meets it. A file of one 64 KiB
/// unit is written by the kernel on a RAID5 (made by `butter mkfs`); then the other data unit
/// of its row gets new bytes without its parity (what a power cut in the middle of a
/// read-modify-write leaves). With every device the file reads right (parity is not read).
/// With the file's own device gone, its bytes rebuilt from the stale parity are wrong: butter
/// and the kernel both fail the read on the checksum instead of returning them. A scrub with
/// every device rewrites the parity (butter's), after which both read the file degraded.
#[test]
fn raid5_write_hole_fails_degraded_reads_as_in_the_kernel_until_a_scrub() {
    if !kernel::require_privileges() {
        return;
    }
    let s = ScratchDir::new("multi-device-write-hole");
    let images: Vec<PathBuf> = (0..3).map(|i| s.join(format!("wh-{i}.img"))).collect();
    for img in &images {
        fs::File::create(img).unwrap().set_len(DEV_SIZE).unwrap();
    }
    let mut args: Vec<String> = ["mkfs", "-q", "-m", "raid1", "-d", "raid5"]
        .iter()
        .map(|x| x.to_string())
        .collect();
    args.extend(images.iter().map(|i| i.display().to_string()));
    let refs: Vec<&str> = args.iter().map(|x| x.as_str()).collect();
    let o = butter(&refs);
    assert!(o.status.success(), "{}", text(&o));
    let v = Volume {
        images: images.clone(),
    };
    let data = Rng(99).bytes(65536);
    let m = MultiLoopMount::new(&images, &s.dir("k1"), "");
    fs::write(m.path().join("a"), &data).unwrap();
    kernel::run(&mut Command::new("sync"));
    let frag = kernel::run(
        Command::new("filefrag")
            .args(["-v", "-b4096"])
            .arg(m.path().join("a")),
    );
    m.unmount();
    // The file's logical address (btrfs reports logical addresses as physical ones).
    let logical = frag
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').map(|x| x.trim()).collect();
            (f.len() >= 4 && f[0] == "0").then(|| {
                f[2].split("..")
                    .next()
                    .unwrap()
                    .trim()
                    .parse::<u64>()
                    .unwrap()
                    * 4096
            })
        })
        .unwrap_or_else(|| panic!("no extent in filefrag's output:\n{frag}"));
    // The data chunk: its logical start and (devid, offset) of each stripe.
    let mut dargs = vec!["dump-tree".to_string(), "-t".into(), "chunk".into()];
    dargs.push(images[0].display().to_string());
    dargs.extend(v.device_args(&[]));
    let drefs: Vec<&str> = dargs.iter().map(|x| x.as_str()).collect();
    let dump = text(&butter(&drefs));
    let lines: Vec<&str> = dump.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains("type DATA|RAID5"))
        .unwrap_or_else(|| panic!("no RAID5 data chunk:\n{dump}"));
    let chunk: u64 = lines[at - 1]
        .split("CHUNK_ITEM ")
        .nth(1)
        .and_then(|x| x.split(')').next())
        .and_then(|x| x.trim().parse().ok())
        .unwrap();
    let stripes: Vec<(usize, u64)> = lines[at..]
        .iter()
        .filter(|l| l.trim_start().starts_with("stripe "))
        .take(3)
        .map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w[3].parse::<usize>().unwrap() - 1, w[5].parse().unwrap())
        })
        .collect();
    assert!(logical >= chunk, "the file is not in the RAID5 chunk");
    let unit = (logical - chunk) / 65536;
    let (row, j) = (unit / 2, unit % 2);
    // Row r keeps data block j on stripe (j + r) % 3 (P on the one after the data).
    let place = |j: u64| stripes[((j + row) % 3) as usize];
    let (own_dev, own_at) = place(j);
    let (other_dev, other_at) = place(1 - j);
    let on_disk = {
        let mut b = vec![0u8; 65536];
        let f = fs::File::open(&images[own_dev]).unwrap();
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, own_at + row * 65536).unwrap();
        b
    };
    assert!(
        on_disk == data,
        "the file's unit is not where the chunk map says"
    );
    // The torn read-modify-write: the row's other data block changes, its parity does not.
    {
        let f = fs::OpenOptions::new()
            .write(true)
            .open(&images[other_dev])
            .unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &Rng(7).bytes(65536), other_at + row * 65536)
            .unwrap();
    }
    let img0 = images[0].to_str().unwrap();
    let cat = |skip: &[usize]| {
        let mut a: Vec<String> = vec![
            "cat".into(),
            images[if skip.contains(&0) { 1 } else { 0 }]
                .display()
                .to_string(),
        ];
        for (i, img) in images.iter().enumerate() {
            if !skip.contains(&i) && a[1] != img.display().to_string() {
                a.extend(["--device".into(), img.display().to_string()]);
            }
        }
        if !skip.is_empty() {
            a.push("--degraded".into());
        }
        a.push("/a".into());
        let r: Vec<&str> = a.iter().map(|x| x.as_str()).collect();
        butter(&r)
    };
    let whole = cat(&[]);
    assert!(
        whole.status.success() && whole.stdout == data,
        "with every device: {}",
        text(&whole)
    );
    let kernel_read = |name: &str| {
        let left: Vec<PathBuf> = images
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != own_dev)
            .map(|(_, p)| p.clone())
            .collect();
        let m = MultiLoopMount::new(&left, &s.dir(name), "ro,degraded");
        let r = fs::read(m.path().join("a"));
        m.unmount();
        r
    };
    let b = cat(&[own_dev]);
    assert!(
        !b.status.success(),
        "butter returned bytes rebuilt from stale parity"
    );
    assert!(
        text(&b).contains("checksum"),
        "butter's degraded read fails on the checksum: {}",
        text(&b)
    );
    let k = kernel_read("k2");
    assert!(
        k.as_ref().err().and_then(|e| e.raw_os_error()) == Some(5),
        "the kernel's degraded read: {:?}",
        k.map(|d| d == data)
    );
    // butter's scrub with every device rewrites the row's parity from its data.
    let mut sargs = vec!["scrub".to_string(), "start".into(), img0.into()];
    sargs.extend(v.device_args(&[]));
    let sr: Vec<&str> = sargs.iter().map(|x| x.as_str()).collect();
    let o = butter(&sr);
    assert!(!text(&o).contains("panicked"), "{}", text(&o));
    let b = cat(&[own_dev]);
    assert!(
        b.status.success() && b.stdout == data,
        "after scrub, degraded: {}",
        text(&b)
    );
    let k = kernel_read("k3");
    assert!(
        k.as_ref().is_ok_and(|d| *d == data),
        "the kernel's degraded read after butter's scrub: {:?}",
        k.map(|d| d == data)
    );
    check_clean(&images[0], &v.device_args(&[]), "write hole after scrub");
    let (ok, t) = kernel::btrfs_check_devices(&images);
    assert!(ok, "btrfs check after the scrub:\n{t}");
    eprintln!(
        "write hole: the file at logical {logical} (row {row}, block {j}) on device {}, the \
         torn block on device {}: degraded reads failed on the checksum until the scrub",
        own_dev + 1,
        other_dev + 1
    );
}
