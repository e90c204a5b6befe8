//! `butter mkfs --rootdir DIR --reflink IMAGE`: file data cloned into the image file with
//! FICLONERANGE instead of written, where DIR's files and IMAGE share a filesystem that can
//! clone (btrfs, xfs). The image's data extents then share their blocks with the source files.
//!
//! The write engine is not told anything: it lays the filesystem out and writes every byte as
//! without --reflink, through [`CloningDevice`], the image's device with a filter in front.
//! The copy registers every whole, sector-aligned sector it reads from a source file (a hash
//! of its bytes, the file, the offset) before it hands the bytes to the engine. When the engine
//! writes, each run of sectors whose bytes are consecutive registered sectors of one source
//! file is compared, byte for byte, with that file (read again, from the page cache as a rule)
//! and, when equal, cloned from it at the write's offset in the image; the rest of the write,
//! and any run whose clone is refused, is written as usual. A clone is only ever made of the
//! very bytes the engine was writing there, so the image is byte-identical to one made without
//! --reflink, by construction.
//!
//! What gets cloned is what mkfs.btrfs --reflink clones: the whole sectors of plain file data
//! extents. Inline data lives in tree blocks, and a file's partial last sector is written
//! zero-padded in the middle of the image, which the kernel's remap rules only allow at the end
//! of both files: neither is registered, so both are written. Tree blocks are written (a run
//! starts at a write's first sector or at a sector that is not all zeroes, and the first
//! sector of a tree block is its header).
//!
//! Refusals (EXDEV: not one mounted filesystem; EOPNOTSUPP: no clone support; EINVAL: ranges
//! not aligned to the filesystem's block) fall back to writing; the first reason is kept for
//! [`CloningDevice::outcome`]. EXDEV and EOPNOTSUPP stop further attempts; so does EINVAL
//! while nothing was cloned yet.
//!
//! Registered sectors are forgotten at each commit of the copy ([`CloningDevice::forget`]),
//! since a commit writes every buffered byte: the registry holds one commit's worth of data.

use butter::format::csum::CsumType;
use butter::io::device::{BlockDevice, FileDevice};
use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Source files kept open at once for clones; beyond this the cache starts again.
const OPEN_SOURCES: usize = 64;
/// Longest run compared and cloned at once (the comparison reads it into memory).
const MAX_RUN: usize = 8 << 20;

/// Sectors read from the source files, not yet written by the engine.
#[derive(Default)]
struct Registry {
    /// Source file paths; a registered sector names its file by index.
    paths: Vec<PathBuf>,
    /// The index of the file registered last (the copy reads a file piece by piece).
    last: Option<(PathBuf, u32)>,
    /// Sector hash -> one source sector with those bytes (file index, offset).
    by_hash: HashMap<u64, (u32, u64)>,
    /// (file index, offset) -> the hash of that sector: to follow a run along one file.
    by_pos: HashMap<(u32, u64), u64>,
    /// Open source files (opened O_NOATIME where allowed, as the copy opens them).
    open: HashMap<u32, Arc<File>>,
}

/// A run of a write to clone: `len` bytes at `buf_off` of the write from `src_off` of file
/// `file`.
struct Run {
    file: u32,
    src_off: u64,
    buf_off: usize,
    len: usize,
}

/// The image's device, cloning from the source files what it can (see the module doc).
pub struct CloningDevice {
    inner: Arc<FileDevice>,
    /// The image file, opened for writing, as the clones' destination.
    image: File,
    sectorsize: u64,
    reg: Mutex<Registry>,
    /// No more clone attempts (a refusal that will not change).
    stopped: AtomicBool,
    cloned: AtomicU64,
    /// Bytes of whole source sectors the copy registered.
    registered: AtomicU64,
    /// The first refusal, as a sentence.
    refusal: Mutex<Option<String>>,
}

/// What --reflink did.
pub struct Outcome {
    /// Bytes cloned into the image (each copy of a DUP extent counts).
    pub cloned: u64,
    /// Why nothing was cloned, when nothing was.
    pub no_effect: Option<String>,
}

fn sector_hash(s: &[u8]) -> u64 {
    let h = CsumType::Xxhash64.compute(s);
    u64::from_le_bytes([h[0], h[1], h[2], h[3], h[4], h[5], h[6], h[7]])
}

impl CloningDevice {
    /// Wraps `inner`, the device of image file `image` whose filesystem has sectors of
    /// `sectorsize` bytes.
    pub fn new(inner: Arc<FileDevice>, image: &Path, sectorsize: u32) -> io::Result<Self> {
        let file = std::fs::OpenOptions::new().write(true).open(image)?;
        Ok(CloningDevice {
            inner,
            image: file,
            sectorsize: sectorsize as u64,
            reg: Mutex::new(Registry::default()),
            stopped: AtomicBool::new(false),
            cloned: AtomicU64::new(0),
            registered: AtomicU64::new(0),
            refusal: Mutex::new(None),
        })
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.reg.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The copy read `data` at `offset` of source file `path` and is about to write it: its
    /// whole sectors (at multiples of the sector size) may be cloned from there.
    pub fn register(&self, path: &Path, offset: u64, data: &[u8]) {
        if self.stopped.load(Ordering::Relaxed) {
            return;
        }
        let ss = self.sectorsize;
        let first = offset.div_ceil(ss) * ss;
        let end = offset + data.len() as u64;
        if first + ss > end {
            return;
        }
        let hashes: Vec<(u64, u64)> = (first..)
            .step_by(ss as usize)
            .take_while(|o| o + ss <= end)
            .map(|o| {
                let at = (o - offset) as usize;
                (o, sector_hash(&data[at..at + ss as usize]))
            })
            .collect();
        let mut r = self.registry();
        let file = match &r.last {
            Some((p, i)) if p == path => *i,
            _ => {
                let i = r.paths.len() as u32;
                r.paths.push(path.to_path_buf());
                r.last = Some((path.to_path_buf(), i));
                i
            }
        };
        for &(o, h) in &hashes {
            r.by_hash.entry(h).or_insert((file, o));
            r.by_pos.insert((file, o), h);
        }
        self.registered
            .fetch_add(hashes.len() as u64 * ss, Ordering::Relaxed);
    }

    /// Forgets every registered sector and closes the source files: everything the copy
    /// handed over so far has been written (a commit).
    pub fn forget(&self) {
        *self.registry() = Registry::default();
    }

    /// What happened, for the summary and the warning.
    pub fn outcome(&self) -> Outcome {
        let cloned = self.cloned.load(Ordering::Relaxed);
        let no_effect = (cloned == 0).then(|| {
            self.refusal
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
                .unwrap_or_else(|| {
                    if self.registered.load(Ordering::Relaxed) == 0 {
                        format!(
                            "no file has a whole {}-byte sector of data to clone (small files \
                             are stored inline, a partial last sector is written)",
                            self.sectorsize
                        )
                    } else {
                        "the image got none of the registered data as plain extents".into()
                    }
                })
        });
        Outcome { cloned, no_effect }
    }

    /// Splits a write into runs to clone (see the module doc). Needs the registry lock only.
    fn plan(&self, buf: &[u8]) -> Vec<Run> {
        let ss = self.sectorsize as usize;
        if self.registry().by_pos.is_empty() {
            return Vec::new();
        }
        let hashes: Vec<u64> = buf.chunks_exact(ss).map(sector_hash).collect();
        let r = self.registry();
        let mut runs: Vec<Run> = Vec::new();
        let mut cur: Option<Run> = None;
        for (i, &h) in hashes.iter().enumerate() {
            if let Some(c) = &mut cur {
                let next = c.src_off + c.len as u64;
                if r.by_pos.get(&(c.file, next)) == Some(&h) {
                    if c.len + ss <= MAX_RUN {
                        c.len += ss;
                    } else {
                        let file = c.file;
                        runs.extend(cur.take());
                        cur = Some(Run {
                            file,
                            src_off: next,
                            buf_off: i * ss,
                            len: ss,
                        });
                    }
                    continue;
                }
                runs.extend(cur.take());
            }
            let sector = &buf[i * ss..(i + 1) * ss];
            if i > 0 && sector.iter().all(|&b| b == 0) {
                continue;
            }
            if let Some(&(file, src_off)) = r.by_hash.get(&h) {
                cur = Some(Run {
                    file,
                    src_off,
                    buf_off: i * ss,
                    len: ss,
                });
            }
        }
        runs.extend(cur);
        runs
    }

    /// The open source file `file`.
    fn source(&self, file: u32) -> io::Result<Arc<File>> {
        let mut r = self.registry();
        if let Some(f) = r.open.get(&file) {
            return Ok(f.clone());
        }
        let path = r
            .paths
            .get(file as usize)
            .cloned()
            .ok_or_else(|| io::Error::other("source file forgotten"))?;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOATIME)
            .open(&path)
            .or_else(|_| File::open(&path))?;
        let f = Arc::new(f);
        if r.open.len() >= OPEN_SOURCES {
            r.open.clear();
        }
        r.open.insert(file, f.clone());
        Ok(f)
    }

    /// Clones `run` of `buf` (meant for image offset `at`) when the source still holds those
    /// bytes; false when it does not, or the clone was refused (then the caller writes).
    fn clone_run(&self, buf: &[u8], at: u64, run: &Run) -> bool {
        if self.stopped.load(Ordering::Relaxed) {
            return false;
        }
        let want = &buf[run.buf_off..run.buf_off + run.len];
        let Ok(src) = self.source(run.file) else {
            return false;
        };
        let mut have = vec![0u8; run.len];
        if src.read_exact_at(&mut have, run.src_off).is_err() || have != want {
            return false;
        }
        let arg = libc::file_clone_range {
            src_fd: src.as_raw_fd() as i64,
            src_offset: run.src_off,
            src_length: run.len as u64,
            dest_offset: at + run.buf_off as u64,
        };
        // SAFETY: FICLONERANGE on two open descriptors with a valid argument struct.
        let rc = unsafe { libc::ioctl(self.image.as_raw_fd(), libc::FICLONERANGE, &arg) };
        if rc == 0 {
            self.cloned.fetch_add(run.len as u64, Ordering::Relaxed);
            return true;
        }
        let e = io::Error::last_os_error();
        let nothing_yet = self.cloned.load(Ordering::Relaxed) == 0;
        let (why, stop) = match e.raw_os_error() {
            Some(libc::EXDEV) => (
                "the image file and the --rootdir files are not on one mounted filesystem \
                 (FICLONERANGE: EXDEV)"
                    .to_string(),
                true,
            ),
            Some(libc::EOPNOTSUPP) | Some(libc::ENOTTY) | Some(libc::ENOSYS) => (
                "the filesystem holding the image cannot clone file ranges (FICLONERANGE: \
                 EOPNOTSUPP)"
                    .to_string(),
                true,
            ),
            Some(libc::EINVAL) => (
                format!(
                    "the filesystem refused to clone {}-byte sectors (FICLONERANGE: EINVAL): \
                     its block size may be larger than the image's sector size",
                    self.sectorsize
                ),
                nothing_yet,
            ),
            _ => (format!("cloning failed (FICLONERANGE: {e})"), false),
        };
        if stop {
            self.stopped.store(true, Ordering::Relaxed);
        }
        let mut r = self.refusal.lock().unwrap_or_else(|e| e.into_inner());
        if r.is_none() {
            *r = Some(why);
        }
        false
    }
}

impl BlockDevice for CloningDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        let ss = self.sectorsize;
        if self.stopped.load(Ordering::Relaxed)
            || !offset.is_multiple_of(ss)
            || (buf.len() as u64) < ss
            || offset
                .checked_add(buf.len() as u64)
                .is_none_or(|end| end > self.inner.len())
        {
            return self.inner.write_at(buf, offset);
        }
        let mut done = 0usize;
        for run in self.plan(buf) {
            if !self.clone_run(buf, offset, &run) {
                continue;
            }
            if done < run.buf_off {
                self.inner
                    .write_at(&buf[done..run.buf_off], offset + done as u64)?;
            }
            done = run.buf_off + run.len;
        }
        if done < buf.len() {
            self.inner.write_at(&buf[done..], offset + done as u64)?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        self.inner.flush()
    }

    fn len(&self) -> u64 {
        self.inner.len()
    }

    fn will_need(&self, offset: u64, len: u64) {
        self.inner.will_need(offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sector(seed: u8) -> Vec<u8> {
        (0..4096u32)
            .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
            .collect()
    }

    /// A device on a scratch file (cloning is not exercised: `plan` only).
    fn device(name: &str) -> (CloningDevice, PathBuf) {
        let p = std::env::temp_dir().join(format!("butter-reflink-{name}-{}", std::process::id()));
        std::fs::write(&p, vec![0u8; 1 << 20]).unwrap();
        let inner = Arc::new(FileDevice::open(&p, true).unwrap());
        (CloningDevice::new(inner, &p, 4096).unwrap(), p)
    }

    #[test]
    fn runs_follow_one_source_file() {
        let (d, p) = device("runs");
        let (a, b, c, h) = (sector(3), sector(5), sector(7), sector(11));
        let z = vec![0u8; 4096];
        // File "x": a b zero c, then a partial sector (not registered).
        let x = [&a[..], &b, &z, &c, &[1u8; 100]].concat();
        d.register(Path::new("x"), 0, &x);
        // File "y" read from an unaligned offset: only its whole aligned sectors count.
        let y = [&[9u8; 100][..], &h].concat();
        d.register(Path::new("y"), 4096 - 100, &y);
        // A write of header, a b zero c, h: one run of four sectors from x at 0, then y's.
        let w = [&sector(13)[..], &a, &b, &z, &c, &h].concat();
        let runs = d.plan(&w);
        let got: Vec<_> = runs
            .iter()
            .map(|r| (r.file, r.src_off, r.buf_off, r.len))
            .collect();
        assert_eq!(got, vec![(0, 0, 4096, 4 * 4096), (1, 4096, 5 * 4096, 4096)]);
        // A zero sector alone, not first in the write, starts nothing; first, it may.
        assert!(d.plan(&[&sector(17)[..], &z].concat()).is_empty());
        assert_eq!(d.plan(&z).len(), 1);
        // Forgotten after a commit.
        d.forget();
        assert!(d.plan(&w).is_empty());
        std::fs::remove_file(p).unwrap();
    }

    #[test]
    fn refused_clones_write_the_same_bytes() {
        let (d, p) = device("fallback");
        let src = p.with_extension("src");
        let data = [sector(3), sector(5)].concat();
        std::fs::write(&src, &data).unwrap();
        d.register(&src, 0, &data);
        // Wherever the scratch file lives, the bytes land (cloned, or written when refused).
        d.write_at(&data, 8192).unwrap();
        let mut back = vec![0u8; data.len()];
        d.read_at(&mut back, 8192).unwrap();
        assert!(back == data);
        std::fs::remove_file(p).unwrap();
        std::fs::remove_file(src).unwrap();
    }
}
