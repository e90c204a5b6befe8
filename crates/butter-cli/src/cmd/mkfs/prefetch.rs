//! `--rootdir`: the source files read, and compressed, ahead of the copy on every CPU.
//!
//! The copy itself runs on one thread, in the order that makes images reproducible (depth
//! first, names sorted by their bytes). A walker thread lists the regular files in that same
//! order, and worker threads (two per CPU) read them and compress them with
//! [`Precompressed::new`], so that the engine only stores what was prepared: reading and
//! compressing, most of mkfs's work, run beside the copy and on every CPU.
//!
//! The copy claims a file's data by its path. Nothing depends on a worker being on time: a
//! file not ready is read (and compressed) by the copy itself, the same bytes either way, so
//! the image does not depend on the timing. Prepared data is bounded ([`BUDGET`] bytes); a
//! file the copy passes without claiming (a hard link's second name, a file changed since it
//! was listed) is dropped when a later one is claimed.

use butter::format::compress::Compression;
use butter::inode::file::Precompressed;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::ffi::OsString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// Files up to this size are prepared ahead (larger ones are copied in pieces).
pub const MAX_FILE: u64 = 8 << 20;
/// Most bytes of file data prepared and not yet claimed (each file counted twice when it
/// is compressed: its bytes and, at most as many, compressed).
const BUDGET: u64 = 32 << 20;
/// Most files listed and not yet taken by a worker.
const MAX_QUEUED: usize = 1 << 13;
/// Most files being prepared or prepared and not yet claimed.
const MAX_READY: usize = 1 << 12;

/// A file's data as the copy writes it: its bytes, and them compressed when the copy
/// compresses.
pub struct Ready {
    pub data: Vec<u8>,
    pub packed: Option<Precompressed>,
}

/// Reads and compresses `p` (`size` bytes, no holes); `None` when it is not that file any
/// more (another size, holes) or cannot be read.
fn prepare(p: &Path, size: u64, c: Option<Compression>, sectorsize: u32) -> Option<Ready> {
    let f = open_noatime(p).ok()?;
    if !dense(&f, size) {
        return None;
    }
    let mut data = vec![0u8; size as usize];
    f.read_exact_at(&mut data, 0).ok()?;
    if f.metadata().ok()?.len() != size {
        return None;
    }
    let packed = c.map(|c| Precompressed::new(c, &data, sectorsize));
    Some(Ready { data, packed })
}

/// Opens `p` for reading without moving its atime (a second run must see the same tree).
fn open_noatime(p: &Path) -> std::io::Result<File> {
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOATIME)
        .open(p)
        .or_else(|_| File::open(p))
}

/// Whether the first `size` bytes of `f` are all data (no hole to keep).
fn dense(f: &File, size: u64) -> bool {
    // SAFETY: lseek on an open descriptor.
    let hole = unsafe { libc::lseek(f.as_raw_fd(), 0, libc::SEEK_HOLE) };
    hole < 0 || hole as u64 >= size
}

struct Job {
    seq: u64,
    path: PathBuf,
    size: u64,
}

#[derive(Default)]
struct State {
    /// Listed, not yet taken, in walk order.
    queue: VecDeque<Job>,
    /// Every listed file not yet claimed or dropped: its sequence number.
    seq_of: HashMap<PathBuf, u64>,
    /// Being prepared.
    running: HashMap<PathBuf, u64>,
    /// Prepared, by sequence number: the path, the size counted in `bytes`, the result.
    done: BTreeMap<u64, (PathBuf, u64, Option<Ready>)>,
    /// Bytes of the files being prepared or prepared and not claimed.
    bytes: u64,
    /// Files listed before the last claimed one were passed by the copy.
    claimed_upto: u64,
    walked: bool,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    compress: Option<Compression>,
    sectorsize: u32,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wait<'a>(&self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.changed.wait(g).unwrap_or_else(|e| e.into_inner())
    }
}

/// The walker and workers of one copy; stopped when dropped.
pub struct Prefetch {
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Prefetch {
    /// Starts listing `root` and preparing its files, compressed with `compress` for a
    /// filesystem of `sectorsize`.
    pub fn start(root: &Path, compress: Option<Compression>, sectorsize: u32) -> Prefetch {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            compress,
            sectorsize,
        });
        let mut threads = Vec::new();
        let (s, r) = (shared.clone(), root.to_path_buf());
        threads.push(std::thread::spawn(move || {
            let mut seq = 0;
            walk(&s, &r, &mut seq);
            s.lock().walked = true;
            s.changed.notify_all();
        }));
        // Twice the CPUs: a worker waiting for a cold disk leaves its CPU to one compressing
        // (100,000 files read from this VM's disk: 30 s with one per CPU, 22 s with two).
        let workers = 2 * std::thread::available_parallelism().map_or(1, |n| n.get());
        for _ in 0..workers {
            let s = shared.clone();
            threads.push(std::thread::spawn(move || work(&s)));
        }
        Prefetch { shared, threads }
    }

    /// The data of regular file `p` (`size` bytes, at most [`MAX_FILE`]) prepared: by a
    /// worker (waiting for it if one is at it), else here; `None` for a file that must be
    /// copied in pieces (it has holes, or is not `size` bytes long any more).
    pub fn get(&self, p: &Path, size: u64) -> Option<Ready> {
        if let Some(r) = self.claim(p, size) {
            return Some(r);
        }
        prepare(p, size, self.shared.compress, self.shared.sectorsize)
    }

    /// The data of `p` (`size` bytes) if a worker has it or is preparing it (then waits for
    /// it); `None` when the copy must read it itself.
    fn claim(&self, p: &Path, size: u64) -> Option<Ready> {
        let s = &self.shared;
        let mut g = s.lock();
        let seq = *g.seq_of.get(p)?;
        // Files listed before this one were passed by the copy: drop them.
        g.claimed_upto = g.claimed_upto.max(seq);
        while g.queue.front().is_some_and(|j| j.seq <= seq) {
            if let Some(j) = g.queue.pop_front() {
                g.seq_of.remove(&j.path);
            }
        }
        while let Some(e) = g.done.first_entry().filter(|e| *e.key() < seq) {
            let (k, n, _) = e.remove();
            g.bytes -= n;
            g.seq_of.remove(&k);
        }
        s.changed.notify_all();
        loop {
            if let Some((_, n, ready)) = g.done.remove(&seq) {
                g.bytes -= n;
                g.seq_of.remove(p);
                s.changed.notify_all();
                return ready.filter(|r| r.data.len() as u64 == size);
            }
            if !g.running.contains_key(p) {
                // Was queued (taken out above) or dropped: the copy reads it.
                g.seq_of.remove(p);
                return None;
            }
            g = s.wait(g);
        }
    }
}

impl Drop for Prefetch {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Lists the regular files under `dir` in the copy's order (names sorted by their bytes,
/// depth first), those a worker can prepare: one name, no larger than [`MAX_FILE`].
fn walk(s: &Shared, dir: &Path, seq: &mut u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut names: Vec<OsString> = rd.filter_map(|e| e.ok().map(|e| e.file_name())).collect();
    names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
    for name in names {
        let p = dir.join(&name);
        let Ok(m) = std::fs::symlink_metadata(&p) else {
            continue;
        };
        if m.is_dir() {
            walk(s, &p, seq);
        } else if m.is_file() && m.nlink() == 1 && m.len() > 0 && m.len() <= MAX_FILE {
            let mut g = s.lock();
            while g.queue.len() >= MAX_QUEUED && !g.stop {
                g = s.wait(g);
            }
            if g.stop {
                return;
            }
            *seq += 1;
            g.seq_of.insert(p.clone(), *seq);
            g.queue.push_back(Job {
                seq: *seq,
                path: p,
                size: m.len(),
            });
            drop(g);
            s.changed.notify_all();
        }
        if s.lock().stop {
            return;
        }
    }
}

/// What preparing a file of `size` bytes takes from the budget.
fn cost(s: &Shared, size: u64) -> u64 {
    if s.compress.is_some() {
        size * 2
    } else {
        size
    }
}

/// A worker: takes the next listed file when the budget has room for it, prepares it.
fn work(s: &Shared) {
    loop {
        let job = {
            let mut g = s.lock();
            loop {
                if g.stop {
                    return;
                }
                let room = g.running.len() + g.done.len() < MAX_READY;
                let fits = room
                    && g.queue
                        .front()
                        .is_some_and(|j| g.bytes == 0 || g.bytes + cost(s, j.size) <= BUDGET);
                if fits {
                    break;
                }
                if g.queue.is_empty() && g.walked {
                    return;
                }
                g = s.wait(g);
            }
            let Some(j) = g.queue.pop_front() else {
                continue;
            };
            g.bytes += cost(s, j.size);
            g.running.insert(j.path.clone(), j.seq);
            s.changed.notify_all();
            j
        };
        let ready = prepare(&job.path, job.size, s.compress, s.sectorsize);
        let mut g = s.lock();
        g.running.remove(&job.path);
        if job.seq < g.claimed_upto || !g.seq_of.contains_key(&job.path) {
            // Passed by the copy meanwhile.
            g.bytes -= cost(s, job.size);
            if g.seq_of.get(&job.path) == Some(&job.seq) && job.seq < g.claimed_upto {
                g.seq_of.remove(&job.path);
            }
        } else {
            g.done.insert(job.seq, (job.path, cost(s, job.size), ready));
        }
        drop(g);
        s.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    fn tree(tag: &str) -> PathBuf {
        let root =
            std::env::temp_dir().join(format!("butter-prefetch-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("sub")).unwrap();
        for i in 0..40u32 {
            let body: Vec<u8> = (0..(i as usize * 997 + 10))
                .map(|j| b"alpha beta gamma\n"[(j + i as usize) % 17])
                .collect();
            let dir = if i % 3 == 0 {
                root.join("sub")
            } else {
                root.clone()
            };
            std::fs::write(dir.join(format!("f{i:02}")), body).unwrap();
        }
        // A file with a hole: copied in pieces, never prepared.
        let mut f = File::create(root.join("holes")).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(b"end").unwrap();
        root
    }

    #[test]
    fn files_come_with_their_bytes_in_any_order() {
        let root = tree("order");
        let zstd = Compression::parse("zstd:3").unwrap();
        let pf = Prefetch::start(&root, zstd, 4096);
        let mut names: Vec<PathBuf> = (0..40u32)
            .map(|i| {
                let dir = if i % 3 == 0 {
                    root.join("sub")
                } else {
                    root.clone()
                };
                dir.join(format!("f{i:02}"))
            })
            .collect();
        // Out of the walk's order: later files first, then the ones passed (dropped by
        // then, read here), then again (nothing left ahead: read here).
        names.reverse();
        for round in 0..2 {
            for p in &names {
                let want = std::fs::read(p).unwrap();
                let r = pf
                    .get(p, want.len() as u64)
                    .unwrap_or_else(|| panic!("{} not prepared", p.display()));
                assert_eq!(r.data, want, "{} (round {round})", p.display());
                let z = r.packed.expect("compressed");
                assert!(
                    z == Precompressed::new(zstd.unwrap(), &want, 4096),
                    "{}: compressed bytes differ from a compression here",
                    p.display()
                );
            }
        }
        assert!(
            pf.get(&root.join("holes"), (1 << 20) + 3).is_none(),
            "a file with a hole was prepared"
        );
        // Another size than the file has: not that file.
        assert!(pf.get(&root.join("f05"), 3).is_none());
        drop(pf);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn stops_when_dropped_with_work_left() {
        let root = tree("drop");
        let pf = Prefetch::start(&root, None, 4096);
        let p = root.join("f07");
        let r = pf.get(&p, std::fs::metadata(&p).unwrap().len()).unwrap();
        assert!(r.packed.is_none());
        drop(pf); // joins the walker and the workers
        std::fs::remove_dir_all(&root).unwrap();
    }
}
