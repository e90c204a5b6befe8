//! Crash test for the read-write `butter mount`: write-heavy work on the mount, SIGKILL of the
//! butter process at a random moment, many rounds on the same image. After each kill the dead
//! FUSE mount is detached and then:
//!
//! - the image may hold an fsync log: the kernel replays it on a copy (read-write loop mount)
//!   and butter on the image (a read-write butter mount); after each replay the checks below
//!   hold, and `butter check` and `btrfs check --readonly` are clean;
//! - what each writer's fsyncs made durable is there with the right content: an fsync of a
//!   file makes that file (content and name) and its directories durable, not the writer's
//!   other changes (butter writes the fsync log for it, as the kernel does); an fsync of the
//!   writer's directory makes its entries durable: the names in it exist, names removed from
//!   it stay gone (file contents only from their own fsyncs).
//!   Paths a writer touched after they were last made durable may be in any state.
//!
//! The next round mounts the crashed image again and writes more; a final clean unmount ends
//! with the usual checks and a kernel-vs-butter tree comparison.
//!
//! Only the last 10 rounds' files stay: older rounds are deleted (and committed) before a
//! round's writers start, so long loops keep the image from filling up.
//!
//! Each round: two writer threads, each in its own directory, creating files (inline-sized
//! and multi-extent), overwriting ranges, extending, truncating, renaming, unlinking, making
//! subdirectories and calling fsync every few operations; SIGKILL after a random 0.1–1.5 s.
//! Writer errors are expected only after the kill; an error before it fails the test.
//!
//! `BUTTER_CRASH_ROUNDS` (default 20) sets the number of rounds, `BUTTER_CRASH_SEED` the seed
//! (printed at the start, so a failure can be replayed). Needs root, /dev/fuse, loop devices,
//! kernel btrfs, btrfs-progs and fusermount3; without them a notice and a pass, or a failure
//! under CI.

mod common;

use common::fuse_mount::{self, ButterMount};
use common::gen::Rng;
use common::kernel::ScratchDir;
use common::manifest::{self, TakeOpts};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// 2 GiB (sparse). The ten rounds of files kept reach ~670 MB of live data with some seeds
/// (`du` on the mount), and the metadata and system chunks take ~150 MB more: on 1 GiB a
/// round's writers then filled the filesystem for real (one CI run, round 14). Pinned space
/// is not the cause: data allocation commits to get it back (log_write's
/// `overwrites_under_fsync_get_pinned_space_back`).
const IMAGE_SIZE: u64 = 2 << 30;
const DEFAULT_ROUNDS: u64 = 20;
const WRITERS: u64 = 2;
/// Rounds whose files stay on the image; older rounds are deleted (through butter, before the
/// next round's writers start, and committed), so a long loop does not fill the image.
const KEEP_ROUNDS: u64 = 10;
/// Extra `butter mount` arguments: a short commit interval, so that a crash can also land in
/// the middle of a periodic commit (fsync commits anyway).
const MOUNT_ARGS: &[&str] = &["-o", "commit=1"];
/// Odd rounds: no periodic commit during the round, so the kill finds the fsync log that
/// the fsyncs since the round's start wrote (the rest of the image is their last commit).
const MOUNT_ARGS_LOG: &[&str] = &["-o", "commit=600"];

/// A file's content by length and SHA-256.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Digest32 {
    len: u64,
    sha: [u8; 32],
}

fn digest(data: &[u8]) -> Digest32 {
    Digest32 {
        len: data.len() as u64,
        sha: Sha256::digest(data).into(),
    }
}

/// What one writer guarantees: the tree below its directory as of its last fsync that
/// returned, and the paths (relative to its directory) it changed after that.
#[derive(Clone, Debug, Default)]
struct Durable {
    /// Relative path -> Some(content) for files, None for directories.
    entries: BTreeMap<PathBuf, Option<Digest32>>,
    /// Files that must exist, content unknown (named by a directory fsync).
    names_only: BTreeSet<PathBuf>,
    touched_after: BTreeSet<PathBuf>,
    fsyncs: u64,
    /// Operations completed in all (durable or not).
    ops: u64,
}

/// One writer's live model (full contents, to compute the result of partial overwrites).
struct Writer {
    dir: PathBuf,
    rng: Rng,
    files: BTreeMap<PathBuf, Vec<u8>>,
    dirs: BTreeSet<PathBuf>,
    next_name: u64,
    shared: Arc<Mutex<Durable>>,
    killed: Arc<AtomicBool>,
}

impl Writer {
    fn touch(&self, rel: &Path) {
        let mut d = self.shared.lock().unwrap();
        d.touched_after.insert(rel.to_path_buf());
        // A path inside a touched directory counts too (checked with starts_with).
    }

    fn new_name(&mut self) -> PathBuf {
        self.next_name += 1;
        let name = format!(
            "f{:04}-{}",
            self.next_name,
            "x".repeat(self.rng.below(40) as usize)
        );
        // Sometimes inside a subdirectory.
        let dirs: Vec<PathBuf> = self.dirs.iter().cloned().collect();
        if !dirs.is_empty() && self.rng.chance(1, 3) {
            self.rng.pick(&dirs).join(name)
        } else {
            PathBuf::from(name)
        }
    }

    fn content(&mut self) -> Vec<u8> {
        // Mostly small (btrfs stores up to ~2 KiB inline), some multi-extent.
        let n = match self.rng.below(10) {
            0..=4 => self.rng.below(2048),
            5..=7 => self.rng.range(4096, 64 << 10),
            _ => self.rng.range(64 << 10, 512 << 10),
        } as usize;
        let mut v = self.rng.random_bytes(n);
        // Some runs of zeros and repeated bytes, as real files have.
        if n > 100 && self.rng.chance(1, 3) {
            let a = self.rng.below(n as u64 / 2) as usize;
            let b = a + self.rng.below((n - a) as u64) as usize;
            v[a..b].fill(0);
        }
        v
    }

    fn pick_file(&mut self) -> Option<PathBuf> {
        let files: Vec<PathBuf> = self.files.keys().cloned().collect();
        if files.is_empty() {
            None
        } else {
            Some(self.rng.pick(&files).clone())
        }
    }

    /// One operation; Ok(false) when there was nothing to do.
    fn step(&mut self) -> io::Result<bool> {
        let choice = self.rng.below(100);
        match choice {
            // create + write in one to three pieces
            0..=34 => {
                let rel = self.new_name();
                let data = self.content();
                self.touch(&rel);
                let f = OpenOptions::new()
                    .write(true)
                    .create_new(true)
                    .open(self.dir.join(&rel))?;
                let pieces = self.rng.range(1, 3) as usize;
                let step = data.len().div_ceil(pieces).max(1);
                for (i, chunk) in data.chunks(step).enumerate() {
                    f.write_all_at(chunk, (i * step) as u64)?;
                }
                drop(f);
                self.files.insert(rel, data);
            }
            // overwrite (maybe extending) a range
            35..=54 => {
                let Some(rel) = self.pick_file() else {
                    return Ok(false);
                };
                let old_len = self.files[&rel].len() as u64;
                let off = self.rng.below(old_len + 8192);
                let len = self.rng.range(1, 96 << 10) as usize;
                let data = self.rng.random_bytes(len);
                self.touch(&rel);
                let f = OpenOptions::new().write(true).open(self.dir.join(&rel))?;
                f.write_all_at(&data, off)?;
                drop(f);
                let v = self.files.get_mut(&rel).unwrap();
                let end = off as usize + len;
                if v.len() < end {
                    v.resize(end, 0);
                }
                v[off as usize..end].copy_from_slice(&data);
            }
            // truncate
            55..=62 => {
                let Some(rel) = self.pick_file() else {
                    return Ok(false);
                };
                let old_len = self.files[&rel].len() as u64;
                let new_len = self.rng.below(old_len + 100_000);
                self.touch(&rel);
                let f = OpenOptions::new().write(true).open(self.dir.join(&rel))?;
                f.set_len(new_len)?;
                drop(f);
                self.files
                    .get_mut(&rel)
                    .unwrap()
                    .resize(new_len as usize, 0);
            }
            // rename (possibly over an existing file)
            63..=72 => {
                let Some(from) = self.pick_file() else {
                    return Ok(false);
                };
                let to = if self.rng.chance(1, 4) {
                    self.pick_file().unwrap()
                } else {
                    self.new_name()
                };
                if to == from {
                    return Ok(false);
                }
                self.touch(&from);
                self.touch(&to);
                fs::rename(self.dir.join(&from), self.dir.join(&to))?;
                let data = self.files.remove(&from).unwrap();
                self.files.insert(to, data);
            }
            // unlink
            73..=82 => {
                let Some(rel) = self.pick_file() else {
                    return Ok(false);
                };
                self.touch(&rel);
                fs::remove_file(self.dir.join(&rel))?;
                self.files.remove(&rel);
            }
            // mkdir
            83..=87 => {
                if self.dirs.len() >= 4 {
                    return Ok(false);
                }
                self.next_name += 1;
                let rel = PathBuf::from(format!("d{:04}", self.next_name));
                self.touch(&rel);
                fs::create_dir(self.dir.join(&rel))?;
                self.dirs.insert(rel);
            }
            // fsync: of a file (that file is durable) or of the writer's directory (butter
            // commits everything for a directory)
            _ => match self.pick_file() {
                Some(rel) if self.rng.chance(3, 4) => {
                    File::open(self.dir.join(&rel))?.sync_all()?;
                    self.record_file_durable(&rel);
                }
                _ => {
                    File::open(&self.dir)?.sync_all()?;
                    self.record_dir_durable();
                }
            },
        }
        self.shared.lock().unwrap().ops += 1;
        Ok(true)
    }

    /// The fsync of one file returned: its content under its name is durable, and the
    /// directories on its path exist.
    fn record_file_durable(&self, rel: &Path) {
        let mut d = self.shared.lock().unwrap();
        d.entries
            .insert(rel.to_path_buf(), Some(digest(&self.files[rel])));
        d.names_only.remove(rel);
        d.touched_after.remove(rel);
        for a in rel.ancestors().skip(1) {
            if !a.as_os_str().is_empty() {
                d.entries.insert(a.to_path_buf(), None);
                d.touched_after.remove(a);
            }
        }
        d.fsyncs += 1;
    }

    /// The fsync of the writer's directory returned: the directory exists, and its entries
    /// are what they are now: the files and subdirectories in it exist (a file's content is
    /// known only from its own fsync, if untouched since), and names removed from it are gone.
    fn record_dir_durable(&self) {
        let mut d = self.shared.lock().unwrap();
        d.touched_after.remove(Path::new(""));
        let direct = |p: &Path| p.parent().is_some_and(|q| q.as_os_str().is_empty());
        let touched: Vec<PathBuf> = d
            .touched_after
            .iter()
            .filter(|p| direct(p))
            .cloned()
            .collect();
        for rel in touched {
            d.touched_after.remove(&rel);
            if self.files.contains_key(&rel) {
                d.entries.remove(&rel);
                d.names_only.insert(rel);
            } else if self.dirs.contains(&rel) {
                d.entries.insert(rel, None);
            } else {
                d.entries.remove(&rel);
                d.names_only.remove(&rel);
            }
        }
        d.fsyncs += 1;
    }

    fn run(mut self) -> Result<(), String> {
        loop {
            if let Err(e) = self.step() {
                if self.killed.load(Ordering::SeqCst) {
                    return Ok(()); // the mount died under us: expected
                }
                // Give the killer a moment: an error racing with the kill is not a bug.
                std::thread::sleep(Duration::from_millis(300));
                if self.killed.load(Ordering::SeqCst) {
                    return Ok(());
                }
                return Err(format!("{}: {e} (before the kill)", self.dir.display()));
            }
            if self.killed.load(Ordering::SeqCst) {
                return Ok(());
            }
        }
    }
}

/// Checks one writer's guarantees against the tree at `dir` (a kernel mount of the image);
/// returns the number of entries it could check and the problems found.
fn check_durable(dir: &Path, d: &Durable, what: &str) -> (usize, Vec<String>) {
    let mut problems = Vec::new();
    let mut checked = 0;
    let touched = |p: &Path| {
        d.touched_after
            .iter()
            .any(|t| p.starts_with(t) || t.starts_with(p))
    };
    for rel in &d.names_only {
        if touched(rel) {
            continue;
        }
        checked += 1;
        if !dir.join(rel).is_file() {
            problems.push(format!(
                "{what}: {} is missing (its directory was fsynced)",
                rel.display()
            ));
        }
    }
    for (rel, want) in &d.entries {
        if touched(rel) {
            continue;
        }
        checked += 1;
        let path = dir.join(rel);
        match want {
            None => {
                if !path.is_dir() {
                    problems.push(format!("{what}: directory {} is missing", rel.display()));
                }
            }
            Some(want) => match fs::read(&path) {
                Ok(data) => {
                    let got = digest(&data);
                    if &got != want {
                        problems.push(format!(
                            "{what}: {} has {} bytes (sha {}), fsynced {} bytes (sha {})",
                            rel.display(),
                            got.len,
                            hex(&got.sha),
                            want.len,
                            hex(&want.sha)
                        ));
                    }
                }
                Err(e) => problems.push(format!("{what}: {}: {e}", rel.display())),
            },
        }
    }
    // Nothing may exist that the durable state does not have, unless touched afterwards.
    let mut stack = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let Ok(rd) = fs::read_dir(dir.join(&rel)) else {
            continue;
        };
        for e in rd.flatten() {
            let child = rel.join(e.file_name());
            if !d.entries.contains_key(&child) && !d.names_only.contains(&child) && !touched(&child)
            {
                problems.push(format!(
                    "{what}: {} exists but was not there at the last fsync",
                    child.display()
                ));
            }
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                stack.push(child);
            }
        }
    }
    (checked, problems)
}

fn hex(b: &[u8]) -> String {
    b.iter().take(6).map(|x| format!("{x:02x}")).collect()
}

struct RoundResult {
    dir_rel: PathBuf,
    durable: Durable,
}

#[test]
fn sigkill_rounds_keep_what_was_fsynced() {
    crash_rounds("fuse-crash", &[], rounds_from_env() * 3 / 5);
}

/// The same on a block-group-tree image (mkfs.btrfs's default since 6.19); the rounds are
/// shared between the two layouts.
#[test]
fn sigkill_rounds_on_block_group_tree() {
    crash_rounds(
        "fuse-crash-bgt",
        &["-O", "block-group-tree"],
        rounds_from_env() * 2 / 5,
    );
}

/// Served through FUSE over io_uring: a SIGKILL with requests in the ring's entries.
#[test]
fn sigkill_rounds_over_io_uring() {
    crash_rounds_with(
        "fuse-crash-uring",
        &[],
        (rounds_from_env() * 3 / 10).max(4),
        &["-o", "uring=on"],
    );
}

fn rounds_from_env() -> u64 {
    std::env::var("BUTTER_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ROUNDS)
}

fn crash_rounds(name: &str, mkfs_args: &[&str], rounds: u64) {
    crash_rounds_with(name, mkfs_args, rounds, &[]);
}

/// [`crash_rounds`] with `transport` added to every mount's arguments.
fn crash_rounds_with(name: &str, mkfs_args: &[&str], rounds: u64, transport: &[&str]) {
    if !fuse_mount::require("fuse_crash", &[]) {
        return;
    }
    let scratch = ScratchDir::new(name);
    let img = scratch.join("crash.img");
    common::kernel::mkfs_btrfs(&img, IMAGE_SIZE, mkfs_args);
    let mut target = Target {
        images: vec![img],
        others: Vec::new(),
        servers: Vec::new(),
        sockets: Vec::new(),
    };
    run_rounds(name, &scratch, &mut target, rounds, transport);
}

/// The two-machine setup of issue 32 on loopback: a RAID1 (metadata RAID1C3) of one local
/// file and two NBD exports that nbdkit serves, one over TCP on 127.0.0.1 and one over a
/// Unix socket, each through nbdkit's cache filter in writeback mode: a write reaches the
/// file only when butter flushes. Each kill of butter is followed by a SIGKILL of both
/// servers, which loses every write butter had not flushed (a power cut of those machines);
/// then new servers come up on the same files. The checks read the files, with every
/// device, the kernel too.
#[test]
fn sigkill_rounds_on_raid1_over_nbd_with_power_cuts() {
    if !fuse_mount::require("fuse_crash", &["nbdkit"]) {
        return;
    }
    let name = "fuse-crash-nbd";
    let scratch = ScratchDir::new(name);
    let images: Vec<PathBuf> = (0..3)
        .map(|i| scratch.join(format!("dev{i}.img")))
        .collect();
    for img in &images {
        File::create(img).unwrap().set_len(IMAGE_SIZE / 2).unwrap();
    }
    common::kernel::run(
        std::process::Command::new("mkfs.btrfs")
            .args(["-f", "-q", "-m", "raid1c3", "-d", "raid1"])
            .args(&images),
    );
    let mut target = Target {
        images,
        others: Vec::new(),
        servers: Vec::new(),
        sockets: vec![None, Some(scratch.join("nbd.sock"))],
    };
    target.start_servers();
    run_rounds(
        name,
        &scratch,
        &mut target,
        (rounds_from_env() * 2 / 5).max(3),
        &[],
    );
}

/// The filesystem a crash loop runs on: its device files (the first one is IMAGE) and how
/// butter is given the others (paths, or the addresses of NBD servers).
struct Target {
    images: Vec<PathBuf>,
    others: Vec<String>,
    /// The NBD servers of images 1.. (none: butter opens the files).
    servers: Vec<common::nbd::Server>,
    /// For each server, its Unix socket, or TCP on 127.0.0.1.
    sockets: Vec<Option<PathBuf>>,
}

impl Target {
    fn image(&self) -> &Path {
        &self.images[0]
    }

    /// (Re)starts an nbdkit for each image after the first, caching writes until a flush.
    fn start_servers(&mut self) {
        self.servers.clear();
        for (img, sock) in self.images[1..].iter().zip(&self.sockets) {
            if let Some(sock) = sock {
                let _ = fs::remove_file(sock);
            }
            self.servers.push(common::nbd::Server::start(
                img,
                sock.as_deref(),
                &["--filter=cache"],
                &["cache=writeback"],
            ));
        }
        self.others = self.servers.iter().map(|s| s.addr.clone()).collect();
    }

    /// After butter was killed: the servers lose power too (their unflushed writes gone)
    /// and come back.
    fn power_cut(&mut self) {
        if !self.servers.is_empty() {
            self.start_servers();
        }
    }

    /// `args` with the other devices added as `-o device=`.
    fn mount_args(&self, args: &[&str]) -> Vec<String> {
        let mut v: Vec<String> = args.iter().map(|a| a.to_string()).collect();
        if !self.others.is_empty() {
            let devs: Vec<String> = self.others.iter().map(|o| format!("device={o}")).collect();
            v.extend(["-o".to_string(), devs.join(",")]);
        }
        v
    }

    fn mount(&self, dir: &Path, args: &[&str], log: &Path) -> ButterMount {
        let args = self.mount_args(args);
        let refs: Vec<&str> = args.iter().map(|a| a.as_str()).collect();
        ButterMount::start(self.image(), dir, &refs, log)
    }
}

fn run_rounds(
    name: &str,
    scratch: &ScratchDir,
    target: &mut Target,
    rounds: u64,
    transport: &[&str],
) {
    let rounds = rounds.max(2);
    let seed: u64 = std::env::var("BUTTER_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
        });
    eprintln!("{name}: {rounds} rounds, BUTTER_CRASH_SEED={seed}");
    let mnt = scratch.dir("bmnt");
    let kmnt = scratch.dir("kmnt");
    let mut rng = Rng::new(seed);
    let mut done: Vec<RoundResult> = Vec::new();
    let t_all = Instant::now();

    for round in 0..rounds {
        let log = scratch.join(format!("butter-{round}.log"));
        let args = if round % 2 == 1 {
            MOUNT_ARGS_LOG
        } else {
            MOUNT_ARGS
        };
        let args = [args, transport].concat();
        let bm = target.mount(&mnt, &args, &log);
        if round >= KEEP_ROUNDS {
            let old = PathBuf::from(format!("r{:03}", round - KEEP_ROUNDS));
            let path = bm.path().join(&old);
            fs::remove_dir_all(&path)
                .unwrap_or_else(|e| panic!("round {round}: rm -r {}: {e}", path.display()));
            File::open(bm.path())
                .and_then(|d| d.sync_all())
                .unwrap_or_else(|e| panic!("round {round}: fsync of the mount root: {e}"));
            done.retain(|r| !r.dir_rel.starts_with(&old));
        }
        let killed = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        let mut shared = Vec::new();
        for w in 0..WRITERS {
            let dir_rel = PathBuf::from(format!("r{round:03}/w{w}"));
            let dir = bm.path().join(&dir_rel);
            fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
            let s = Arc::new(Mutex::new(Durable::default()));
            // The directory itself is not durable before the first fsync: treat it as touched.
            s.lock().unwrap().touched_after.insert(PathBuf::new());
            shared.push((dir_rel, s.clone()));
            let writer = Writer {
                dir,
                rng: rng.fork(round * 100 + w),
                files: BTreeMap::new(),
                dirs: BTreeSet::new(),
                next_name: 0,
                shared: s,
                killed: killed.clone(),
            };
            handles.push(std::thread::spawn(move || writer.run()));
        }
        let delay = Duration::from_millis(rng.range(100, 1500));
        std::thread::sleep(delay);
        killed.store(true, Ordering::SeqCst);
        bm.kill9();
        target.power_cut();
        let mut errors = Vec::new();
        for h in handles {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => errors.push(e),
                Err(_) => errors.push("a writer thread panicked".into()),
            }
        }
        assert!(
            errors.is_empty(),
            "round {round}: writer errors before the kill:\n{}\nbutter log:\n{}",
            errors.join("\n"),
            fs::read_to_string(&log).unwrap_or_default()
        );
        for (dir_rel, s) in shared {
            let durable = s.lock().unwrap().clone();
            done.push(RoundResult { dir_rel, durable });
        }
        let stats: Vec<String> = done[done.len() - WRITERS as usize..]
            .iter()
            .map(|r| format!("{} ops/{} fsyncs", r.durable.ops, r.durable.fsyncs))
            .collect();
        eprintln!(
            "round {round}: killed after {} ms; writers: {}",
            delay.as_millis(),
            stats.join(", ")
        );
        check_after_crash(target, &kmnt, &done, round);
    }

    // A last clean mount: everything durable still there, then unmount and compare the tree.
    let last = [MOUNT_ARGS, transport].concat();
    let bm = target.mount(&mnt, &last, &scratch.join("butter-final.log"));
    let mut problems = Vec::new();
    for r in &done {
        problems.extend(
            check_durable(
                &bm.path().join(&r.dir_rel),
                &r.durable,
                &format!("final butter mount, {}", r.dir_rel.display()),
            )
            .1,
        );
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let seen = manifest::take(bm.path(), &TakeOpts::default());
    bm.unmount();
    fuse_mount::verify_image_set(
        &target.images,
        &target.others,
        &kmnt,
        Some(&seen),
        "after the crash rounds",
    );
    eprintln!(
        "{name}: {rounds} rounds in {:.1} s",
        t_all.elapsed().as_secs_f64()
    );
}

/// After a kill the image may hold an fsync log. The kernel replays it on a copy (a
/// read-write loop mount) and every writer's durable state must be there; then butter replays
/// it on the image itself (a read-write butter mount, as the next round does) and the same
/// must hold; after both replays `butter check` and `btrfs check` are clean.
fn check_after_crash(target: &Target, kmnt: &Path, done: &[RoundResult], round: u64) {
    let img = target.image();
    let had_log = log_root_of(img) != 0;
    let copies: Vec<PathBuf> = target
        .images
        .iter()
        .map(|i| i.with_extension("kernel.img"))
        .collect();
    for (i, copy) in target.images.iter().zip(&copies) {
        let st = std::process::Command::new("cp")
            .arg("--sparse=always")
            .arg(i)
            .arg(copy)
            .status()
            .expect("cp");
        assert!(st.success(), "cp {} failed", i.display());
    }
    let mut problems = Vec::new();
    let mut checked = 0;
    {
        let m = common::kernel::MultiLoopMount::new(&copies, kmnt, "noatime");
        for r in done {
            let (n, p) = check_durable(
                &m.path().join(&r.dir_rel),
                &r.durable,
                &format!("round {round} (kernel replay), {}", r.dir_rel.display()),
            );
            checked += n;
            problems.extend(p);
        }
        m.unmount();
    }
    let (ok, text) = common::kernel::btrfs_check_devices(&copies);
    assert!(
        ok,
        "round {round}: btrfs check after the kernel replayed butter's log failed:\n{text}"
    );
    for copy in &copies {
        let _ = fs::remove_file(copy);
    }
    let bdir = kmnt.with_file_name("replay-mnt");
    fs::create_dir_all(&bdir).unwrap();
    let bm = target.mount(
        &bdir,
        &["-o", "commit=3600"],
        &kmnt.with_file_name("replay.log"),
    );
    for r in done {
        let (_, p) = check_durable(
            &bm.path().join(&r.dir_rel),
            &r.durable,
            &format!("round {round} (butter replay), {}", r.dir_rel.display()),
        );
        problems.extend(p);
    }
    bm.unmount();
    assert!(
        problems.is_empty(),
        "round {round}: after SIGKILL, fsynced data is wrong:\n{}",
        problems.join("\n")
    );
    let (rc, out) = fuse_mount::butter_check_set(img, &target.others);
    assert_eq!(
        rc, 0,
        "round {round}: butter check after replay is not clean:\n{out}"
    );
    let (ok, text) = common::kernel::btrfs_check_devices(&target.images);
    assert!(
        ok,
        "round {round}: btrfs check after butter's replay failed:\n{text}"
    );
    eprintln!(
        "round {round}: checks clean ({}), {checked} fsynced entries as expected in both replays",
        if had_log {
            "the image had an fsync log"
        } else {
            "no log"
        }
    );
}

/// The superblock's log_root.
fn log_root_of(img: &Path) -> u64 {
    let mut sb = [0u8; 8];
    let f = File::open(img).expect("open image");
    f.read_exact_at(&mut sb, 0x10000 + 96)
        .expect("read superblock");
    u64::from_le_bytes(sb)
}
