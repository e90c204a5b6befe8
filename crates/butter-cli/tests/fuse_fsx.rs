//! fsx (File System eXerciser, `cargo install fsx`) on a read-write `butter mount`: seeded
//! random pread/pwrite, mmap reads and writes, truncate, posix_fallocate, hole punching,
//! copy_file_range, sendfile, fsync/fdatasync, close/reopen and msync invalidation on one file,
//! with every read checked against fsx's model of the file. Two fsx processes run at once on
//! two files (different seeds), so butter serves them concurrently.
//!
//! Afterwards: unmount, `butter check` and `btrfs check --readonly` clean, and a kernel mount
//! shows the same tree (both files with the same content) as the butter mount did.
//!
//! A fourth run ([`FSX_CONFIG_NOSTAT`]) leaves out fsx's size check after every operation
//! (`nosizechecks`: no stat, no lseek(SEEK_END)) and reads less, so only the reads look at
//! the file between changes (issue 29, item 5).
//!
//! The suite runs a short version ([`SUITE_OPS`] operations per file, seconds); the long run
//! (100k+ operations) is `bench/fsx_long.sh`. `BUTTER_FSX_OPS` and `BUTTER_FSX_SEED` override
//! the operation count and the first seed.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs, fusermount3 and `fsx`
//! (scripts/install-deps installs it). Without them: a notice and a pass, or a failure under
//! CI.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::ScratchDir;
use common::manifest::{self, TakeOpts};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::{Duration, Instant};

const SUITE_OPS: u64 = 15_000;
const SEED: u64 = 7_001;
const IMAGE_SIZE: u64 = 512 << 20;

/// fsx's configuration: every operation it has on Linux, a 4 MiB file (many extents),
/// unaligned operations of up to 128 KiB. Kept in sync with bench/fsx_long.sh.
pub const FSX_CONFIG: &str = r#"# fsx configuration for butter (fuse_fsx.rs, bench/fsx_long.sh)
flen = 4194304
nomsyncafterwrite = false
nosizechecks = false
blockmode = false

[opsize]
max = 131072
min = 0
align = 1

[weights]
close_open = 1
read = 10
write = 10
mapread = 5
mapwrite = 5
invalidate = 1
truncate = 3
fsync = 1
fdatasync = 1
posix_fallocate = 2
punch_hole = 2
sendfile = 1
posix_fadvise = 1
copy_file_range = 2
"#;

/// The same operations without fsx's size check after every operation (`nosizechecks`: no
/// fstat and no lseek(SEEK_END) between them) and with fewer reads, so the mount's deferred
/// work (delayed allocation, delayed preallocation, ordered extents) piles up between the
/// looks; fsx still checks every read against its model.
pub const FSX_CONFIG_NOSTAT: &str = r#"# fsx without stat after each operation (fuse_fsx.rs)
flen = 4194304
nomsyncafterwrite = false
nosizechecks = true
blockmode = false

[opsize]
max = 131072
min = 0
align = 1

[weights]
close_open = 1
read = 3
write = 12
mapread = 2
mapwrite = 4
invalidate = 1
truncate = 4
fsync = 1
fdatasync = 1
posix_fallocate = 4
punch_hole = 3
sendfile = 1
posix_fadvise = 1
copy_file_range = 3
"#;

/// Starts `fsx` on `file` (its output to `artifacts/fsx.log`, its artifacts in `artifacts`).
fn spawn_fsx(
    cfg: &Path,
    file: &Path,
    ops: u64,
    seed: u64,
    artifacts: &Path,
) -> std::process::Child {
    std::fs::create_dir_all(artifacts).unwrap();
    let log = artifacts.join("fsx.log");
    let out = std::fs::File::create(&log).unwrap();
    let err = out.try_clone().unwrap();
    Command::new(fuse_mount::tool("fsx"))
        .arg("-f")
        .arg(cfg)
        .arg("-N")
        .arg(ops.to_string())
        .arg("-S")
        .arg(seed.to_string())
        .arg("-P")
        .arg(artifacts)
        .arg(file)
        .stdout(out)
        .stderr(err)
        .spawn()
        .expect("start fsx")
}

fn wait_limited(child: &mut std::process::Child, deadline: Instant) -> Option<ExitStatus> {
    loop {
        if let Some(st) = child.try_wait().unwrap_or(None) {
            return Some(st);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
fn fsx_on_butter_mount() {
    let ops = env_u64("BUTTER_FSX_OPS", SUITE_OPS);
    fsx_run("fuse-fsx", FSX_CONFIG, &[], &[], ops);
}

/// Without a stat after each operation ([`FSX_CONFIG_NOSTAT`]), half as long: what butter
/// keeps in memory must come out right when only the reads look.
#[test]
fn fsx_without_size_checks() {
    let ops = env_u64("BUTTER_FSX_OPS", SUITE_OPS) / 2;
    fsx_run("fuse-fsx-nostat", FSX_CONFIG_NOSTAT, &[], &[], ops);
}

/// Both configurations served through FUSE over io_uring (the ring transport's decoder and
/// encoder), half as long each.
#[test]
fn fsx_over_io_uring() {
    let ops = env_u64("BUTTER_FSX_OPS", SUITE_OPS) / 2;
    let ring = &["-o", "uring=on"];
    fsx_run("fuse-fsx-uring", FSX_CONFIG, &[], ring, ops);
    fsx_run("fuse-fsx-uring-nostat", FSX_CONFIG_NOSTAT, &[], ring, ops);
}

/// The same on a block-group-tree image (mkfs.btrfs's default since 6.19), a third as long.
#[test]
fn fsx_on_block_group_tree() {
    let ops = env_u64("BUTTER_FSX_OPS", SUITE_OPS) / 3;
    fsx_run(
        "fuse-fsx-bgt",
        FSX_CONFIG,
        &["-O", "block-group-tree"],
        &[],
        ops,
    );
}

/// The same with every write compressed (`compress-force=zstd`), a third as long: partial
/// overwrites, truncates and holes over compressed extents.
#[test]
fn fsx_with_compression() {
    let ops = env_u64("BUTTER_FSX_OPS", SUITE_OPS) / 3;
    fsx_run(
        "fuse-fsx-zstd",
        FSX_CONFIG,
        &[],
        &["-o", "compress-force=zstd"],
        ops,
    );
}

/// On filesystems of several devices made by mkfs.btrfs: a two-device RAID1 and a
/// four-device RAID10, each a third as long; afterwards both checkers with every device,
/// and the kernel mounting all of them shows what the butter mount showed.
#[test]
fn fsx_on_raid1_and_raid10() {
    if !fuse_mount::require("fuse_fsx", &["fsx"]) || !common::kernel::require_privileges() {
        return;
    }
    let ops = env_u64("BUTTER_FSX_OPS", SUITE_OPS) / 3;
    for (profile, n) in [("raid1", 2usize), ("raid10", 4)] {
        let name = format!("fuse-fsx-{profile}");
        let scratch = ScratchDir::new(&name);
        let images: Vec<PathBuf> = (0..n)
            .map(|i| scratch.join(format!("dev{i}.img")))
            .collect();
        for img in &images {
            std::fs::File::create(img)
                .unwrap()
                .set_len(IMAGE_SIZE)
                .unwrap();
        }
        common::kernel::run(
            Command::new("mkfs.btrfs")
                .args(["-f", "-q", "-d", profile, "-m", profile])
                .args(&images),
        );
        let opts: Vec<String> = images[1..]
            .iter()
            .map(|p| format!("device={}", p.display()))
            .collect();
        let opts = opts.join(",");
        let bm = ButterMount::start(
            &images[0],
            &scratch.join("bmnt"),
            &["-o", &opts],
            &scratch.join("butter.log"),
        );
        let seen = fsx_jobs(&scratch, FSX_CONFIG, &bm, ops);
        bm.unmount();
        let mut args: Vec<String> = vec!["check".into(), images[0].display().to_string()];
        for img in &images[1..] {
            args.push("--device".into());
            args.push(img.display().to_string());
        }
        let o = Command::new(env!("CARGO_BIN_EXE_butter"))
            .args(&args)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "{profile}: butter check after fsx:\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let (ok, t) = common::kernel::btrfs_check_devices(&images);
        assert!(ok, "{profile}: btrfs check after fsx:\n{t}");
        let km = common::kernel::MultiLoopMount::new(&images, &scratch.join("kmnt"), "ro,noatime");
        let got = manifest::take(km.path(), &TakeOpts::default());
        km.unmount();
        let copts = manifest::CompareOpts {
            atime: false,
            ..manifest::CompareOpts::fuse()
        };
        manifest::assert_same(
            &seen,
            &got,
            &copts,
            &format!("{profile}: butter mount vs kernel"),
        );
    }
}

/// fsx through the two-machine setup on loopback: a RAID1 made by `butter mkfs` over one
/// local file and two NBD exports (nbdkit over TCP and over a Unix socket, writes cached
/// until butter flushes); then butter check through the servers, and, the servers stopped,
/// both checkers and the kernel on the files.
#[test]
fn fsx_on_raid1_over_nbd() {
    if !fuse_mount::require("fuse_fsx", &["fsx", "nbdkit"]) || !common::kernel::require_privileges()
    {
        return;
    }
    let ops = env_u64("BUTTER_FSX_OPS", SUITE_OPS) / 3;
    let scratch = ScratchDir::new("fuse-fsx-nbd");
    let images: Vec<PathBuf> = (0..3)
        .map(|i| scratch.join(format!("dev{i}.img")))
        .collect();
    let mut mkfs = Command::new(env!("CARGO_BIN_EXE_butter"));
    mkfs.args(["mkfs", "-q", "-b", "256M", "-m", "raid1", "-d", "raid1"])
        .args(&images);
    let o = mkfs.output().unwrap();
    assert!(
        o.status.success(),
        "butter mkfs: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let servers: Vec<common::nbd::Server> = vec![
        common::nbd::Server::start(&images[1], None, &["--filter=cache"], &["cache=writeback"]),
        common::nbd::Server::start(
            &images[2],
            Some(&scratch.join("nbd.sock")),
            &["--filter=cache"],
            &["cache=writeback"],
        ),
    ];
    let addrs: Vec<String> = servers.iter().map(|s| s.addr.clone()).collect();
    let opts: Vec<String> = addrs.iter().map(|a| format!("device={a}")).collect();
    let bm = ButterMount::start(
        &images[0],
        &scratch.join("bmnt"),
        &["-o", &opts.join(",")],
        &scratch.join("butter.log"),
    );
    let seen = fsx_jobs(&scratch, FSX_CONFIG, &bm, ops);
    bm.unmount();
    let (rc, out) = fuse_mount::butter_check_set(&images[0], &addrs);
    assert_eq!(rc, 0, "butter check through NBD after fsx:\n{out}");
    drop(servers);
    let paths: Vec<String> = images[1..]
        .iter()
        .map(|p| p.display().to_string())
        .collect();
    fuse_mount::verify_image_set(
        &images,
        &paths,
        &scratch.join("kmnt"),
        Some(&seen),
        "fsx over NBD",
    );
}

fn fsx_run(name: &str, config: &str, mkfs_args: &[&str], mount_args: &[&str], ops: u64) {
    if !fuse_mount::require("fuse_fsx", &["fsx"]) {
        return;
    }
    let scratch = ScratchDir::new(name);
    let img = scratch.join("butter.img");
    common::kernel::mkfs_btrfs(&img, IMAGE_SIZE, mkfs_args);
    let bm = ButterMount::start(
        &img,
        &scratch.join("bmnt"),
        mount_args,
        &scratch.join("butter.log"),
    );
    let seen = fsx_jobs(&scratch, config, &bm, ops);
    bm.unmount();
    fuse_mount::verify_image(&img, &scratch.join("kmnt"), Some(&seen), "after fsx");
}

/// Two fsx processes on two files of the mount, `ops` operations each; panics with their
/// logs when one fails. Returns what the mount shows afterwards.
fn fsx_jobs(scratch: &ScratchDir, config: &str, bm: &ButterMount, ops: u64) -> manifest::Manifest {
    let seed = env_u64("BUTTER_FSX_SEED", SEED);
    let cfg = scratch.join("fsx.toml");
    std::fs::write(&cfg, config).unwrap();

    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(240);
    let jobs: Vec<(u64, PathBuf, PathBuf)> = (0..2)
        .map(|i| {
            let file = bm.path().join(format!("fsx{i}.bin"));
            (seed + i, file, scratch.join(format!("fsx{i}")))
        })
        .collect();
    let mut children: Vec<_> = jobs
        .iter()
        .map(|(s, file, art)| spawn_fsx(&cfg, file, ops, *s, art))
        .collect();
    let mut failures = Vec::new();
    for ((s, _, art), child) in jobs.iter().zip(children.iter_mut()) {
        let st = wait_limited(child, deadline);
        let log = std::fs::read_to_string(art.join("fsx.log")).unwrap_or_default();
        match st {
            Some(st) if st.success() => {}
            Some(st) => failures.push(format!("fsx seed {s}, {ops} ops: {st}\n{}", tail(&log, 60))),
            None => failures.push(format!(
                "fsx seed {s}, {ops} ops: timed out\n{}",
                tail(&log, 30)
            )),
        }
    }
    eprintln!(
        "fsx: 2 files x {ops} ops, seeds {seed} and {}, in {:.1} s",
        seed + 1,
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "fsx failed on the butter mount:\n{}\nbutter log:\n{}",
        failures.join("\n\n"),
        tail(&bm.log_text(), 40)
    );
    manifest::take(bm.path(), &TakeOpts::default())
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
