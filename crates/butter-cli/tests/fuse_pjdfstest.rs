//! pjdfstest (the Rust POSIX conformance suite, `cargo install pjdfstest`) against a
//! read-write `butter mount`, with the kernel's btrfs as the baseline computed in the same run:
//! every pjdfstest case that passes on a kernel btrfs loop mount must pass on butter, except
//! those in [`KNOWN_DIFFERENCES`], each of which says why FUSE cannot do it.
//!
//! Afterwards the image must pass `butter check` and `btrfs check --readonly`, and a kernel
//! mount must show the same tree the butter mount showed.
//!
//! Needs root, /dev/fuse, loop devices, kernel btrfs, btrfs-progs, fusermount3, `pjdfstest`
//! (scripts/install-deps installs it into /usr/local/bin) and the users pjdfstest switches to
//! (`nobody` with group `nogroup`, and `tests`). Without them it prints a notice and passes,
//! unless CI is set: then it fails. Takes about 2 s on the kernel and some seconds on butter.
//!
//! `BUTTER_PJDFSTEST_FILTER=chmod,rename` runs only the cases whose names contain one of
//! those strings (pjdfstest's own pattern matching).

mod common;

use common::fuse_mount::{self, ButterMount};
use common::kernel::{self, LoopMount, ScratchDir};
use common::manifest::{self, TakeOpts};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// pjdfstest cases that pass on kernel btrfs but cannot pass through FUSE, with the reason.
/// Only what the FUSE protocol or the kernel's FUSE client makes impossible belongs here;
/// everything else is a butter bug to fix.
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[];

const IMAGE_SIZE: u64 = 512 << 20;
/// A hung case must not hang the suite.
const RUN_LIMIT: Duration = Duration::from_secs(240);

const CONFIG: &str = r#"# pjdfstest configuration for butter's test suite (written by fuse_pjdfstest.rs)
[features]
posix_fallocate = {}
rename_ctime = {}
utime_now = {}
utimensat = {}

[settings]
# Longer than the timestamp granularity of both systems (nanoseconds).
naptime = 0.01
# EROFS cases remount the file system read-only: not done here.
allow_remount = false

[dummy_auth]
entries = [
  ["nobody", "nogroup"],
  ["tests", "tests"],
]
"#;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    Failed,
    Skipped,
    /// "PASSED UNEXPECTEDLY" / "failed as expected" (only with expected_failures configured).
    Other,
}

struct Run {
    cases: BTreeMap<String, Outcome>,
    output: String,
    took: Duration,
}

impl Run {
    fn count(&self, o: Outcome) -> usize {
        self.cases.values().filter(|x| **x == o).count()
    }
    fn summary(&self) -> String {
        format!(
            "{} cases: {} ok, {} failed, {} skipped, {} other, in {:.1} s",
            self.cases.len(),
            self.count(Outcome::Ok),
            self.count(Outcome::Failed),
            self.count(Outcome::Skipped),
            self.count(Outcome::Other),
            self.took.as_secs_f64()
        )
    }
    /// The lines pjdfstest printed about one case (its status line and the indented details).
    fn details(&self, case: &str) -> String {
        let mut out = Vec::new();
        let mut inside = false;
        for line in self.output.lines() {
            if !line.starts_with(char::is_whitespace) {
                inside = line.split_whitespace().next() == Some(case);
            }
            if inside && !line.trim_start().starts_with(|c: char| c.is_ascii_digit()) {
                out.push(line);
            }
            if out.len() > 12 {
                break;
            }
        }
        out.join("\n")
    }
}

/// Case name and outcome from pjdfstest's status lines ("NAME   ok", "NAME   FAILED", ...).
fn parse(output: &str) -> BTreeMap<String, Outcome> {
    let mut cases = BTreeMap::new();
    for line in output.lines() {
        if line.starts_with(char::is_whitespace) || line.is_empty() {
            continue;
        }
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        if !name.contains("::") {
            continue; // "Summary: ...", "Error: ...", backtrace headers
        }
        let rest = line[name.len()..].trim();
        let outcome = match rest {
            "ok" => Outcome::Ok,
            "FAILED" => Outcome::Failed,
            "skipped" => Outcome::Skipped,
            "PASSED UNEXPECTEDLY" | "failed as expected" => Outcome::Other,
            _ => continue,
        };
        cases.insert(name.to_string(), outcome);
    }
    cases
}

/// Runs pjdfstest in `dir` (its own temporary directory below it, removed at the end).
fn pjdfstest(dir: &Path, scratch: &ScratchDir, label: &str) -> Run {
    let cfg = scratch.join("pjdfstest.toml");
    std::fs::write(&cfg, CONFIG).unwrap();
    // A directory on another file system (the scratch dir's) for the EXDEV cases.
    let secondary = scratch.dir(format!("secondary-{label}"));
    let log = scratch.join(format!("pjdfstest-{label}.log"));
    let mut cmd = Command::new(fuse_mount::tool("pjdfstest"));
    cmd.arg("-c")
        .arg(&cfg)
        .arg("-p")
        .arg(dir)
        .arg("-s")
        .arg(&secondary)
        .env("NO_COLOR", "1")
        .env("RUST_BACKTRACE", "0");
    if let Ok(f) = std::env::var("BUTTER_PJDFSTEST_FILTER") {
        cmd.args(f.split(',').filter(|s| !s.is_empty()));
    }
    let t0 = Instant::now();
    let status = fuse_mount::run_logged(&mut cmd, &log, RUN_LIMIT);
    let took = t0.elapsed();
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    let Some(status) = status else {
        let tail: Vec<&str> = output.lines().rev().take(20).collect();
        panic!(
            "pjdfstest on {label} did not finish within {RUN_LIMIT:?}; last lines:\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    };
    let cases = parse(&output);
    // Exit status 1 just means some case failed; anything else (or no cases) is a broken run.
    assert!(
        !cases.is_empty() && status.code().is_some_and(|c| c <= 1),
        "pjdfstest on {label} did not run ({status}):\n{output}"
    );
    let run = Run {
        cases,
        output,
        took,
    };
    eprintln!("pjdfstest on {label}: {}", run.summary());
    run
}

fn user_exists(user: &str, group: &str) -> bool {
    let ok = |db: &str, name: &str| {
        Command::new("getent")
            .args([db, name])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    ok("passwd", user) && ok("group", group)
}

#[test]
fn pjdfstest_butter_passes_what_kernel_btrfs_passes() {
    pjdfstest_against_kernel("fuse-pjdfstest", &[]);
}

/// The same with butter served through FUSE over io_uring (the ring transport's own request
/// decoder and reply encoder).
#[test]
fn pjdfstest_over_io_uring() {
    pjdfstest_against_kernel("fuse-pjdfstest-uring", &["-o", "uring=on"]);
}

fn pjdfstest_against_kernel(scratch_name: &str, transport: &[&str]) {
    const NAME: &str = "fuse_pjdfstest";
    if !fuse_mount::require(NAME, &["pjdfstest", "getent"]) {
        return;
    }
    if !user_exists("nobody", "nogroup") || !user_exists("tests", "tests") {
        fuse_mount::missing(NAME, "users nobody (group nogroup) and tests (group tests)");
        return;
    }
    let scratch = ScratchDir::new(scratch_name);

    // The baseline: a fresh kernel btrfs, read-write.
    let kimg = scratch.join("kernel.img");
    fuse_mount::fresh_image(&kimg, IMAGE_SIZE);
    let km = LoopMount::btrfs(&kimg, &scratch.join("kmnt"), "");
    let kernel_run = pjdfstest(km.path(), &scratch, "kernel-btrfs");
    km.unmount();

    // butter on an equal fresh image. allow_other: pjdfstest switches to other users, and a
    // FUSE mount refuses everyone but its owner without it.
    let bimg = scratch.join("butter.img");
    fuse_mount::fresh_image(&bimg, IMAGE_SIZE);
    let bm = ButterMount::start(
        &bimg,
        &scratch.join("bmnt"),
        &[&["-o", "allow_other"], transport].concat(),
        &scratch.join("butter-mount.log"),
    );
    let butter_run = pjdfstest(bm.path(), &scratch, "butter");
    // Leave a few things behind so the final comparison has a tree to compare.
    populate_leftovers(bm.path());
    let seen = manifest::take(bm.path(), &TakeOpts::default());
    bm.unmount();
    fuse_mount::verify_image(
        &bimg,
        &scratch.join("kmnt2"),
        Some(&seen),
        "after pjdfstest",
    );

    let mut regressions = Vec::new();
    let mut excused = Vec::new();
    for (case, outcome) in &kernel_run.cases {
        if *outcome != Outcome::Ok {
            continue;
        }
        let got = butter_run.cases.get(case).copied();
        if got == Some(Outcome::Ok) {
            continue;
        }
        if let Some((_, why)) = KNOWN_DIFFERENCES.iter().find(|(c, _)| c == case) {
            excused.push(format!("{case}: {why}"));
            continue;
        }
        regressions.push(match got {
            None => format!("{case}: did not run on butter"),
            Some(o) => format!("{case}: {o:?} on butter\n{}", butter_run.details(case)),
        });
    }
    let stale: Vec<&str> = KNOWN_DIFFERENCES
        .iter()
        .filter(|(c, _)| butter_run.cases.get(*c) == Some(&Outcome::Ok))
        .map(|(c, _)| *c)
        .collect();
    eprintln!(
        "kernel btrfs: {}\nbutter: {}\nknown differences excused: {}",
        kernel_run.summary(),
        butter_run.summary(),
        excused.len()
    );
    for e in &excused {
        eprintln!("  excused: {e}");
    }
    assert!(
        regressions.is_empty(),
        "{} pjdfstest cases pass on kernel btrfs but not on butter:\n{}",
        regressions.len(),
        regressions.join("\n")
    );
    assert!(
        stale.is_empty(),
        "KNOWN_DIFFERENCES lists cases that pass on butter now; remove them: {stale:?}"
    );
}

/// A small tree of every kind pjdfstest uses, left on the image for the final comparison.
fn populate_leftovers(root: &Path) {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let d = root.join("left");
    std::fs::create_dir(&d).unwrap();
    std::fs::write(d.join("file"), b"pjdfstest was here\n").unwrap();
    std::fs::set_permissions(d.join("file"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::hard_link(d.join("file"), d.join("link")).unwrap();
    symlink("file", d.join("sym")).unwrap();
    kernel::sh("mkfifo", &[d.join("fifo")]);
    kernel::sh(
        "chown",
        &["65534:65534".as_ref(), d.join("file").as_os_str()],
    );
}
