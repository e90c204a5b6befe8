//! Running one damaged image: open and walk it in a thread with a time limit, catch panics,
//! measure the walk thread's allocations, and judge the outcome against what the case wants.

#![allow(dead_code)]

use super::alloc_track::{self, AllocReport};
use super::walk::{walk_tolerant, Walk, WalkError, WalkLimits};
use butter::fs::Fs;
use butter::internals::{Faults, RamDevice};
use butter::io::device::BlockDevice;
use butter::Error;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest single allocation an open + walk may make (the walk reads 64 KiB at a time; the
/// engine allocates tree blocks, read buffers and small records). Anything larger was sized
/// by a value read from the image.
pub(crate) const MAX_SINGLE_ALLOC: usize = 2 << 20;
/// Peak bytes held by the walk thread (block cache included: these images have a few MiB of
/// metadata).
pub(crate) const MAX_PEAK_LIVE: i64 = 96 << 20;

/// How long one case may take before it counts as a hang. Debug builds on a loaded 2-core
/// machine walk the kernel image in a few seconds.
pub(crate) fn case_timeout() -> Duration {
    let s = std::env::var("BUTTER_CORRUPT_TIMEOUT_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    Duration::from_secs(s)
}

/// What a case must produce.
#[derive(Debug, Clone)]
pub(crate) enum Want {
    /// Opens and walks without error, identical to the undamaged walk (a good copy exists).
    Same,
    /// Fails: some error's text contains every one of these strings (and, like every error,
    /// names a location).
    Err(Vec<String>),
    /// Either outcome, as long as it is not a panic, a hang or a damaged-size allocation; errors
    /// must name a location.
    Any,
}

pub(crate) fn want_err(parts: &[&str]) -> Want {
    Want::Err(parts.iter().map(|s| s.to_string()).collect())
}

/// One damaged image: `damage` is applied to a copy of the undamaged image when the case runs
/// (images are large: never hold many at once). It may also shorten the image.
pub(crate) type Damage<'a> = Box<dyn FnOnce(&mut Vec<u8>) + 'a>;

pub(crate) struct Case<'a> {
    pub name: String,
    pub damage: Damage<'a>,
    pub faults: Option<Faults>,
    pub want: Want,
}

impl<'a> Case<'a> {
    pub(crate) fn new(
        name: impl Into<String>,
        damage: impl FnOnce(&mut Vec<u8>) + 'a,
        want: Want,
    ) -> Self {
        Case {
            name: name.into(),
            damage: Box::new(damage),
            faults: None,
            want,
        }
    }
}

pub(crate) struct Outcome {
    /// `Err` when the image did not open.
    pub open: Result<(), Error>,
    pub walk: Option<Walk>,
    pub errors: Vec<WalkError>,
    pub alloc: AllocReport,
    pub elapsed: Duration,
}

impl Outcome {
    /// Every error text, open error first.
    pub(crate) fn error_texts(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Err(e) = &self.open {
            v.push(e.to_string());
        }
        v.extend(self.errors.iter().map(|e| e.err.to_string()));
        v
    }
    pub(crate) fn all_errors(&self) -> Vec<&Error> {
        let mut v: Vec<&Error> = Vec::new();
        if let Err(e) = &self.open {
            v.push(e);
        }
        v.extend(self.errors.iter().map(|e| &e.err));
        v
    }
}

/// Words that say where: every error a damaged image produces must contain one.
pub(crate) const LOCATION_WORDS: &[&str] = &[
    "superblock",
    "block ",
    "tree ",
    "slot ",
    "inode ",
    "logical ",
    "sys_chunk_array",
    "chunk ",
    "subvolume ",
];

pub(crate) fn names_location(s: &str) -> bool {
    LOCATION_WORDS.iter().any(|w| s.contains(w))
}

/// Opens and walks the image on `dev` in a worker thread. `Err` describes a panic or a hang.
pub(crate) fn run_device(
    name: &str,
    dev: Arc<RamDevice>,
    lim: WalkLimits,
) -> Result<Outcome, String> {
    let (tx, rx) = mpsc::channel();
    let thread_name = format!("case {name}");
    std::thread::Builder::new()
        .name(thread_name)
        .spawn(move || {
            let start = Instant::now();
            alloc_track::arm();
            let r =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    match Fs::open_device(dev) {
                        Ok(fs) => {
                            let (w, errors) = walk_tolerant(&fs, &lim);
                            (Ok(()), Some(w), errors)
                        }
                        Err(e) => (Err(e), None, Vec::new()),
                    }
                }));
            let alloc = alloc_track::disarm();
            let msg = match r {
                Ok((open, walk, errors)) => Ok(Outcome {
                    open,
                    walk,
                    errors,
                    alloc,
                    elapsed: start.elapsed(),
                }),
                Err(p) => Err(p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "non-string panic".into())),
            };
            let _ = tx.send(msg);
        })
        .expect("spawn case thread");
    let limit = case_timeout();
    match rx.recv_timeout(limit) {
        Ok(Ok(o)) => Ok(o),
        Ok(Err(p)) => Err(format!("PANIC: {p}")),
        Err(mpsc::RecvTimeoutError::Timeout) => Err(format!("HANG: no result within {limit:?}")),
        Err(mpsc::RecvTimeoutError::Disconnected) => Err("worker thread died".into()),
    }
}

/// Judges an outcome. `Err` explains what is wrong.
pub(crate) fn judge(want: &Want, o: &Outcome, baseline: &Walk) -> Result<(), String> {
    if o.alloc.max_single > MAX_SINGLE_ALLOC {
        return Err(format!(
            "MEMORY: a single allocation of {} bytes (limit {MAX_SINGLE_ALLOC})",
            o.alloc.max_single
        ));
    }
    if o.alloc.peak_live > MAX_PEAK_LIVE {
        return Err(format!(
            "MEMORY: peak {} bytes held (limit {MAX_PEAK_LIVE})",
            o.alloc.peak_live
        ));
    }
    let texts = o.error_texts();
    for t in &texts {
        if t.contains("walk budget") {
            return Err(format!("the walk did not finish: {t}"));
        }
        if !names_location(t) {
            return Err(format!("error does not name a location: {t:?}"));
        }
    }
    match want {
        Want::Any => Ok(()),
        Want::Same => {
            if !texts.is_empty() {
                return Err(format!(
                    "wanted the undamaged result, got {} error(s), first: {}",
                    texts.len(),
                    texts[0]
                ));
            }
            let w = o.walk.as_ref().expect("opened");
            match baseline.diff(w) {
                None => Ok(()),
                Some(d) => Err(format!("walk differs from the undamaged walk: {d}")),
            }
        }
        Want::Err(parts) => {
            if texts.is_empty() {
                let same = o
                    .walk
                    .as_ref()
                    .map(|w| baseline.diff(w).is_none())
                    .unwrap_or(false);
                return Err(format!(
                    "wanted an error containing {parts:?}, got none (walk identical to undamaged: {same})"
                ));
            }
            if texts.iter().any(|t| parts.iter().all(|p| t.contains(p))) {
                Ok(())
            } else {
                Err(format!(
                    "no error contains all of {parts:?}; errors: {:?}",
                    &texts[..texts.len().min(5)]
                ))
            }
        }
    }
}

/// Size of the pages compared to find what a case changed.
const PAGE: usize = 4096;

/// Runs every case against `base` (the undamaged image) and returns a failure line per failed
/// case.
///
/// Copying a 128 MiB image twice per case (once to damage it, once inside `RamDevice::new`)
/// dominated the run time, so one RAM device holding the undamaged image is reused: each case
/// damages a scratch copy, the pages it changed are written into the device, and after the run
/// the original pages are written back. Cases that change the length (truncation) get a fresh
/// device; so does every case after a panic or a hang.
pub(crate) fn run_cases(cases: Vec<Case<'_>>, base: &[u8], baseline: &Walk) -> Vec<String> {
    let mut failures = Vec::new();
    let n = cases.len();
    let mut dev = Arc::new(RamDevice::new(base.to_vec()));
    let mut scratch = base.to_vec();
    for (i, c) in cases.into_iter().enumerate() {
        let t0 = Instant::now();
        (c.damage)(&mut scratch);
        let same_len = scratch.len() == base.len();
        let mut changed = Vec::new();
        let case_dev = if same_len {
            for (p, (a, b)) in scratch.chunks(PAGE).zip(base.chunks(PAGE)).enumerate() {
                if a != b {
                    changed.push(p * PAGE);
                    dev.write_at(a, (p * PAGE) as u64)
                        .expect("patch RAM device");
                }
            }
            dev.clone()
        } else {
            Arc::new(RamDevice::new(scratch.clone()))
        };
        if let Some(f) = c.faults.clone() {
            case_dev.set_faults(f);
        }
        let r = run_device(&c.name, case_dev.clone(), WalkLimits::default());
        // Restore the undamaged image (scratch and device) for the next case.
        case_dev.set_faults(Faults::default());
        if same_len {
            for &off in &changed {
                let end = (off + PAGE).min(base.len());
                scratch[off..end].copy_from_slice(&base[off..end]);
                dev.write_at(&base[off..end], off as u64)
                    .expect("restore RAM device");
            }
        } else {
            scratch = base.to_vec();
        }
        let r = r.and_then(|o| judge(&c.want, &o, baseline).map(|_| o));
        match r {
            Ok(o) => {
                let first = o.error_texts().into_iter().next().unwrap_or_default();
                eprintln!(
                    "  ok   [{}/{n}] {} ({:.1?}, max alloc {} B) {}",
                    i + 1,
                    c.name,
                    t0.elapsed(),
                    o.alloc.max_single,
                    first
                );
            }
            Err(why) => {
                eprintln!("  FAIL [{}/{n}] {}: {why}", i + 1, c.name);
                if why.starts_with("PANIC") || why.starts_with("HANG") {
                    // A stuck worker may still hold the shared device: start afresh.
                    dev = Arc::new(RamDevice::new(base.to_vec()));
                }
                failures.push(format!("{}: {why}", c.name));
            }
        }
    }
    failures
}
