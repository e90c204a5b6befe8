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

/// The fewest corpus images `butter check --repair` must leave clean for both checkers (the
/// count when this was written: it only goes up).
const REPAIRED_FLOOR: usize = 34;

/// `butter check --repair` on a copy of every damaged corpus image, beside `btrfs check
/// --repair` on another copy: butter's repair never panics or hangs, never claims a clean
/// result that `btrfs check` disagrees with, and leaves at least `REPAIRED_FLOOR` images
/// clean for both checkers. The table lists each image with both repairs' outcomes.
#[test]
fn corpus_repairs() {
    if !have_tools() {
        return;
    }
    let filter = std::env::var("BUTTER_CORPUS_FILTER").ok();
    let images: Vec<_> = common::corpus::images()
        .into_iter()
        .filter(|i| filter.as_deref().is_none_or(|f| i.name.contains(f)))
        .collect();
    assert!(!images.is_empty(), "no corpus images");
    let scratch = common::kernel::ScratchDir::new("corpus-repair");
    let mut failures = Vec::new();
    let (mut damaged, mut progs_fixed, mut ours_fixed, mut only_ours) = (0, 0, 0, 0);
    println!("{:<60} {:>8} {:>8}", "damaged image", "progs", "butter");
    for img in &images {
        let readonly = |p: &Path| {
            run_with_timeout(Command::new("btrfs").args(["check", "--readonly"]).arg(p)).code
                == Some(0)
        };
        if readonly(&img.path) {
            continue;
        }
        damaged += 1;
        let theirs = scratch.join("progs.img");
        let ours = scratch.join("butter.img");
        common::corpus::copy_to(img, &theirs);
        common::corpus::copy_to(img, &ours);
        // btrfs-progs asks before some repairs (the log tree): yes to all.
        let p = run_with_timeout(Command::new("sh").arg("-c").arg(format!(
            "yes | btrfs check --repair --force '{}'",
            theirs.display()
        )));
        let progs_ok = !p.timed_out && readonly(&theirs);
        let r = run_with_timeout(Command::new(BUTTER).args(["check", "--repair"]).arg(&ours));
        if r.timed_out {
            failures.push(format!("{}: butter check --repair hung", img.name));
        }
        if r.code == Some(101) || r.out.contains("panicked") {
            failures.push(format!(
                "{}: butter check --repair panicked:\n{}",
                img.name,
                tail(&r.out, 15)
            ));
        }
        let claims_clean = r.code == Some(0);
        let progs_agrees = readonly(&ours);
        if claims_clean && !progs_agrees {
            failures.push(format!(
                "{}: butter's repair says the result is clean, btrfs check does not:\n{}",
                img.name,
                tail(&r.out, 15)
            ));
        }
        let fixed = claims_clean && progs_agrees;
        progs_fixed += usize::from(progs_ok);
        ours_fixed += usize::from(fixed);
        only_ours += usize::from(fixed && !progs_ok);
        let word = |b: bool| if b { "fixed" } else { "-" };
        println!("{:<60} {:>8} {:>8}", img.name, word(progs_ok), word(fixed));
        let _ = std::fs::remove_file(&theirs);
        let _ = std::fs::remove_file(&ours);
    }
    println!(
        "damaged images: {damaged}; btrfs check --repair fixes {progs_fixed}, butter check \
         --repair {ours_fixed} ({only_ours} that btrfs-progs does not)"
    );
    if filter.is_none() && ours_fixed < REPAIRED_FLOOR {
        failures.push(format!(
            "butter's repair fixed {ours_fixed} images, fewer than the {REPAIRED_FLOOR} it fixed before"
        ));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
