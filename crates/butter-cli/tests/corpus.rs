//! `butter check` against `btrfs check --readonly` over every image of btrfs-progs' checker
//! corpus (tests/corpus/, extracted by common::corpus).
//!
//! For each image both checkers run under a timeout (a hang is a failure); a panic of butter
//! (exit code 101, or "panicked" in its output) is a failure. The verdicts (clean or not) must
//! agree, except for the images in [`KNOWN`], each listed with the reason. The test prints a
//! table and the agreement count.
//!
//! Needs `btrfs`, `btrfs-image`, `xz` and `tar` (no root): without them the test prints a notice
//! and passes, unless `CI` is set (then it fails). `BUTTER_CORPUS_FILTER=SUBSTRING` runs only
//! the images whose name contains it.

mod common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BUTTER: &str = env!("CARGO_BIN_EXE_butter");
const TIMEOUT: Duration = Duration::from_secs(60);

/// Images where the verdicts differ for a reason not fixed yet: (name, reason).
const KNOWN: &[(&str, &str)] = &[];

struct Run {
    code: Option<i32>,
    timed_out: bool,
    out: String,
}

/// Runs `cmd` with stdout and stderr captured, killing it after [`TIMEOUT`].
fn run_with_timeout(cmd: &mut Command) -> Run {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    // Drain both pipes on threads so a chatty child cannot block on a full pipe.
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t1 = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let t2 = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child.try_wait().expect("wait") {
            break Some(st);
        }
        if start.elapsed() > TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            timed_out = true;
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::from_utf8_lossy(&t1.join().unwrap()).into_owned();
    out.push_str(&String::from_utf8_lossy(&t2.join().unwrap()));
    Run {
        code: status.and_then(|s| s.code()),
        timed_out,
        out,
    }
}

fn have_tools() -> bool {
    let missing: Vec<&str> = ["btrfs", "btrfs-image", "xz", "tar"]
        .into_iter()
        .filter(|t| common::fuse_mount::find_tool(t).is_none())
        .collect();
    if missing.is_empty() {
        return true;
    }
    let msg = format!("the corpus test needs {}", missing.join(", "));
    if std::env::var_os("CI").is_some() {
        panic!("{msg}; CI is set, so this is a failure, not a skip");
    }
    eprintln!("SKIPPED: {msg}");
    false
}

fn verdict(clean: bool) -> &'static str {
    if clean {
        "clean"
    } else {
        "errors"
    }
}

/// The last few lines of `s`, for the failure message.
fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

#[test]
fn corpus_verdicts_agree() {
    if !have_tools() {
        return;
    }
    let filter = std::env::var("BUTTER_CORPUS_FILTER").ok();
    let images: Vec<_> = common::corpus::images()
        .into_iter()
        .filter(|i| filter.as_deref().is_none_or(|f| i.name.contains(f)))
        .collect();
    assert!(!images.is_empty(), "no corpus images");
    let mut agree = 0;
    let mut failures = Vec::new();
    let mut known_seen = Vec::new();
    println!("{:<60} {:>8} {:>8}  result", "image", "btrfs", "butter");
    for img in &images {
        let p: &Path = &img.path;
        let progs = run_with_timeout(Command::new("btrfs").args(["check", "--readonly"]).arg(p));
        let ours = run_with_timeout(Command::new(BUTTER).arg("check").arg(p));
        let mut problems = Vec::new();
        if progs.timed_out {
            problems.push("btrfs check timed out".to_string());
        }
        if ours.timed_out {
            problems.push(format!("butter check hung (killed after {TIMEOUT:?})"));
        }
        if ours.code == Some(101) || ours.out.contains("panicked") {
            problems.push(format!("butter check panicked:\n{}", tail(&ours.out, 15)));
        }
        let progs_clean = progs.code == Some(0);
        let ours_clean = ours.code == Some(0);
        let same = progs_clean == ours_clean && !ours.timed_out && !progs.timed_out;
        let known = KNOWN.iter().find(|(n, _)| *n == img.name);
        let result = if same {
            agree += 1;
            if known.is_some() {
                known_seen.push(format!("{} agrees now; drop it from KNOWN", img.name));
            }
            "agree"
        } else if let Some((_, why)) = known {
            known_seen.push(format!("{}: known: {why}", img.name));
            "KNOWN"
        } else {
            problems.push(format!(
                "verdicts differ: btrfs check {} (exit {:?}), butter check {} (exit {:?})\n--- btrfs check:\n{}\n--- butter check:\n{}",
                verdict(progs_clean),
                progs.code,
                verdict(ours_clean),
                ours.code,
                tail(&progs.out, 15),
                tail(&ours.out, 15)
            ));
            "DIFFER"
        };
        println!(
            "{:<60} {:>8} {:>8}  {result}",
            img.name,
            if progs.timed_out {
                "hang"
            } else {
                verdict(progs_clean)
            },
            if ours.timed_out {
                "hang"
            } else {
                verdict(ours_clean)
            },
        );
        if !problems.is_empty() {
            failures.push(format!("{}: {}", img.name, problems.join("\n")));
        }
    }
    println!("agreement: {agree} of {} images", images.len());
    for k in &known_seen {
        println!("{k}");
    }
    assert!(
        failures.is_empty(),
        "{} of {} images fail:\n\n{}",
        failures.len(),
        images.len(),
        failures.join("\n\n")
    );
}
