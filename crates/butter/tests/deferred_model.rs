//! Deferred changes against a model (issue 29): delayed allocation of appends, delayed
//! preallocation (an fallocate at a file's end kept in memory, a truncate back dropping it in
//! memory), compressed write-back, ordered extents and unlocked write-back must give the same
//! sizes, contents, holes, allocations and link counts as if every change were applied at
//! once, whether or not anything looks at a file in between.
//!
//! Seeded random sequences over a few files in three directories, through the operations of
//! `Fs`, each of which takes its own passage through the engine's gate as the FUSE mount's
//! calls do (`write`, `fallocate`, `truncate` or `setattr`, `clone_range`, `create`,
//! `rename`, `link`, `unlink`, `fsync`, `commit`, `read`): creates, writes at random offsets (small ones at offset 0 make inline
//! files), appends at the end (sector-aligned and not, a byte to 1 MiB), truncates up, down,
//! to zero and back to where a preallocation at the end started, fallocate (mode 0, KEEP_SIZE,
//! PUNCH_HOLE, ZERO_RANGE, at the end and elsewhere), aligned clones, renames (also over
//! another file), links, unlinks, fsyncs and commits. The model keeps each file's bytes and,
//! per sector, which of hole / preallocated / data it may be (one where the operations say,
//! several where they leave it open: the partial sectors at a punched range's edges, say).
//!
//! - **Differential** ([`differential`]): with no look at any file between operations, and
//!   again with reads, stats and extent maps at random between them (each compared with the
//!   model then), the end state (sizes, bytes, sectors, st_blocks where the sectors decide it,
//!   link counts, names) must be the model's; again after `Fs::close` and a read-only open,
//!   whose checker must be clean. Under four write-engine option sets: the defaults, delayed
//!   allocation off, zstd with compress-force, fsync log off. A failing sequence is shrunk to a
//!   short one (`BUTTER_DEFERRED_NO_SHRINK=1` skips that) and printed.
//! - **Power cut** ([`power_cut`]): the same sequences on a RAM device that loses power at a
//!   random write (chosen from a dry run's count); the image that survived (flushed writes
//!   only) is opened read-write (log replay): every file whose fsync (or a commit) returned
//!   shows its bytes as of then or a later state, nothing shows a name or a state that never
//!   was, a file unlinked before a commit is gone, and the checker is clean.
//!
//! Environment: `BUTTER_DEFERRED_OPS` (operations per sequence, default 120),
//! `BUTTER_DEFERRED_SEEDS` (sequences per variant and mode, default 3; power-cut rounds per
//! test are 3 times that), `BUTTER_DEFERRED_SEED` (the base seed, printed; by default from the
//! clock), `BUTTER_DEFERRED_SHRINK_SECS` (time for shrinking a failure, default 90). A failure
//! names the seed and sequence.

mod crash_support;

use butter::fs::{Fs, Inode, RwOptions, SetAttr};
use butter::inode::file::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
use butter::internals::{Faults, RamDevice};
use butter::io::device::BlockDevice;
use butter::mkfs::Profile;
use crash_support::{butter_check, content, fresh_image, Rng, OWNER};
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{Hash, Hasher};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

const SS: u64 = 4096;
const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;
const IMAGE_SIZE: u64 = 256 * MIB;
/// No file grows past this (offsets and lengths are chosen below it).
const MAX_FILE: u64 = 3 * MIB;
/// Live files at most.
const MAX_FILES: usize = 6;
/// The workload's directories: the top directory and two below it.
const DIRS: usize = 3;
/// fallocate's ZERO_RANGE (the engine keeps its constant crate-private).
const ZERO_RANGE: u32 = 0x10;

/// What a sector may be: a hole, preallocated, data (bits; several where it is left open).
const HOLE: u8 = 1;
const PRE: u8 = 2;
const DATA: u8 = 4;
const ANY: u8 = HOLE | PRE | DATA;

// ---------------------------------------------------------------------------------------------
// Operations
// ---------------------------------------------------------------------------------------------

/// A name: (directory index, number), shown as `n{number}`.
type Name = (usize, u32);

#[derive(Clone, Debug, PartialEq, Eq)]
enum Op {
    Create {
        f: usize,
        at: Name,
    },
    Write {
        f: usize,
        off: u64,
        len: u64,
        seed: u64,
    },
    /// Through `truncate`, or `setattr` as the mount does.
    Truncate {
        f: usize,
        size: u64,
        setattr: bool,
    },
    Falloc {
        f: usize,
        mode: u32,
        off: u64,
        len: u64,
    },
    Clone {
        src: usize,
        soff: u64,
        dst: usize,
        doff: u64,
        len: u64,
    },
    Rename {
        from: Name,
        to: Name,
    },
    Link {
        f: usize,
        at: Name,
    },
    Unlink {
        at: Name,
    },
    Fsync {
        f: usize,
    },
    Commit,
    // Looks (the second differential mode only).
    Read {
        f: usize,
        off: u64,
        len: u64,
    },
    Stat {
        f: usize,
    },
    Ranges {
        f: usize,
    },
}

fn name_bytes(n: Name) -> Vec<u8> {
    format!("n{}", n.1).into_bytes()
}

fn mode_name(mode: u32) -> String {
    let mut v = Vec::new();
    if mode & ZERO_RANGE != 0 {
        v.push("ZERO_RANGE");
    }
    if mode & FALLOC_FL_PUNCH_HOLE != 0 {
        v.push("PUNCH_HOLE");
    }
    if mode & FALLOC_FL_KEEP_SIZE != 0 {
        v.push("KEEP_SIZE");
    }
    if v.is_empty() {
        "0".into()
    } else {
        v.join("|")
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, out: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nm = |n: &Name| format!("d{}/n{}", n.0, n.1);
        match self {
            Op::Create { f, at } => write!(out, "create f{f} as {}", nm(at)),
            Op::Write { f, off, len, seed } => {
                write!(out, "write f{f} at {off} len {len} (data {seed})")
            }
            Op::Truncate { f, size, setattr } => write!(
                out,
                "{} f{f} to {size}",
                if *setattr { "setattr size" } else { "truncate" }
            ),
            Op::Falloc { f, mode, off, len } => {
                write!(
                    out,
                    "fallocate f{f} {} at {off} len {len}",
                    mode_name(*mode)
                )
            }
            Op::Clone {
                src,
                soff,
                dst,
                doff,
                len,
            } => write!(out, "clone f{src} at {soff} len {len} to f{dst} at {doff}"),
            Op::Rename { from, to } => write!(out, "rename {} to {}", nm(from), nm(to)),
            Op::Link { f, at } => write!(out, "link f{f} as {}", nm(at)),
            Op::Unlink { at } => write!(out, "unlink {}", nm(at)),
            Op::Fsync { f } => write!(out, "fsync f{f}"),
            Op::Commit => write!(out, "commit"),
            Op::Read { f, off, len } => write!(out, "read f{f} at {off} len {len}"),
            Op::Stat { f } => write!(out, "stat f{f}"),
            Op::Ranges { f } => write!(out, "extent map of f{f}"),
        }
    }
}

fn show_ops(ops: &[Op]) -> String {
    ops.iter()
        .enumerate()
        .map(|(i, o)| format!("  {i:3}: {o}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// The bytes a write of `len` with data seed `seed` writes: random, or (odd seeds) a short
/// pattern repeated with a little noise, which compresses.
fn data_of(seed: u64, len: u64) -> Vec<u8> {
    let len = len as usize;
    if seed.is_multiple_of(2) {
        return content(seed, len);
    }
    let pat = content(seed, 37 + (seed % 50) as usize);
    let noise = content(seed ^ 0x55, len / 512 + 1);
    let mut v: Vec<u8> = pat.iter().copied().cycle().take(len).collect();
    for (i, n) in noise.iter().enumerate() {
        if let Some(b) = v.get_mut(i * 512) {
            *b = *n;
        }
    }
    v
}

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug, Default)]
struct MFile {
    data: Vec<u8>,
    /// Per sector (beyond its end: holes), what it may be.
    alloc: Vec<u8>,
    nlink: u32,
    /// Sector 0 may be an inline extent (the file was shorter than a sector since it last
    /// had no extents).
    maybe_inline: bool,
    /// Where the last fallocate at the file's end started (a truncate back there is served in
    /// memory when that preallocation still is).
    falloc_from: Option<u64>,
    // Power-cut tracking.
    /// Hashes of the states (size and bytes) from the last durable one on.
    states: Vec<u64>,
    /// Its fsync or a commit returned since its creation.
    durable: bool,
    /// A name of it changed since it was last made durable.
    names_changed: bool,
    /// Unlinked for good (its last name gone) and a commit returned since.
    gone_durable: bool,
}

fn hash_state(data: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    data.len().hash(&mut h);
    data.hash(&mut h);
    h.finish()
}

impl MFile {
    fn size(&self) -> u64 {
        self.data.len() as u64
    }
    fn get(&self, s: u64) -> u8 {
        self.alloc.get(s as usize).copied().unwrap_or(HOLE)
    }
    fn put(&mut self, s: u64, m: u8) {
        let s = s as usize;
        if self.alloc.len() <= s {
            self.alloc.resize(s + 1, HOLE);
        }
        self.alloc[s] = m;
    }
    fn or(&mut self, s: u64, m: u8) {
        let v = self.get(s) | m;
        self.put(s, v);
    }
    /// A partial sector's bytes were zeroed: it may have been written (data) or left.
    fn touched_partial(&mut self, s: u64) {
        self.or(s, DATA);
    }
    /// fallocate of sector `s`: a hole becomes preallocated.
    fn prealloc(&mut self, s: u64) {
        let m = self.get(s);
        if m & HOLE != 0 {
            self.put(s, (m & !HOLE) | PRE);
        }
    }
    fn resize(&mut self, n: u64) {
        self.data.resize(n as usize, 0);
    }
    fn trim_alloc(&mut self) {
        while self.alloc.last() == Some(&HOLE) {
            self.alloc.pop();
        }
    }
    fn settle(&mut self) {
        if !self.data.is_empty() && self.size() < SS {
            self.maybe_inline = true;
        }
        self.trim_alloc();
    }
    fn changed(&mut self, track: bool) {
        self.settle();
        if track {
            let h = hash_state(&self.data);
            if self.states.last() != Some(&h) {
                self.states.push(h);
            }
        }
    }
    fn make_durable(&mut self) {
        let h = hash_state(&self.data);
        self.states = vec![h];
        self.durable = true;
        self.names_changed = false;
    }
}

#[derive(Clone, Debug, Default)]
struct Model {
    files: BTreeMap<usize, MFile>,
    names: BTreeMap<Name, usize>,
    /// Every (name, file) there ever was.
    ever: BTreeSet<(Name, usize)>,
    /// Keep state hashes (power-cut mode).
    track: bool,
}

impl Model {
    fn live(&self) -> Vec<usize> {
        self.files
            .iter()
            .filter(|(_, f)| f.nlink > 0)
            .map(|(i, _)| *i)
            .collect()
    }
    fn alive(&self, f: usize) -> bool {
        self.files.get(&f).is_some_and(|x| x.nlink > 0)
    }
    fn file(&self, f: usize) -> &MFile {
        &self.files[&f]
    }

    /// Whether `op` can run on this state (after shrinking, some cannot).
    fn valid(&self, op: &Op) -> bool {
        match op {
            Op::Create { f, at } => !self.files.contains_key(f) && !self.names.contains_key(at),
            Op::Write { f, off, len, .. } => {
                self.alive(*f) && *len > 0 && off + len <= MAX_FILE + MIB
            }
            Op::Truncate { f, .. } | Op::Fsync { f } | Op::Stat { f } | Op::Ranges { f } => {
                self.alive(*f)
            }
            Op::Read { f, .. } => self.alive(*f),
            Op::Falloc { f, mode, off, len } => {
                if !self.alive(*f) || *len == 0 {
                    return false;
                }
                // PUNCH_HOLE and ZERO_RANGE inside the file only (past it the kernel and the
                // engine differ in what they clip, and nothing is defined to check).
                if mode & (FALLOC_FL_PUNCH_HOLE | ZERO_RANGE) != 0 {
                    return off + len <= self.file(*f).size();
                }
                true
            }
            Op::Clone {
                src,
                soff,
                dst,
                doff,
                len,
            } => {
                if !self.alive(*src) || !self.alive(*dst) || *len == 0 {
                    return false;
                }
                let (s, d) = (self.file(*src), self.file(*dst));
                if !soff.is_multiple_of(SS) || !doff.is_multiple_of(SS) || soff + len > s.size() {
                    return false;
                }
                let to_eof = soff + len == s.size();
                if !(len.is_multiple_of(SS) || (to_eof && doff + len >= d.size())) {
                    return false;
                }
                let span = len.div_ceil(SS) * SS;
                if src == dst && *soff < doff + span && *doff < soff + span {
                    return false;
                }
                doff + span <= MAX_FILE + MIB
            }
            Op::Rename { from, to } => match (self.names.get(from), self.names.get(to)) {
                (Some(a), Some(b)) => a != b,
                (Some(_), None) => true,
                _ => false,
            },
            Op::Link { f, at } => self.alive(*f) && !self.names.contains_key(at),
            Op::Unlink { at } => self.names.contains_key(at),
            Op::Commit => true,
        }
    }

    /// Applies a valid `op` to the model.
    fn apply(&mut self, op: &Op) {
        let track = self.track;
        match op {
            Op::Create { f, at } => {
                let mut m = MFile {
                    nlink: 1,
                    names_changed: true,
                    ..MFile::default()
                };
                m.states = vec![hash_state(&[])];
                self.files.insert(*f, m);
                self.names.insert(*at, *f);
                self.ever.insert((*at, *f));
            }
            Op::Write { f, off, len, seed } => {
                let m = self.files.get_mut(f).unwrap();
                let (off, len) = (*off, *len);
                let old = m.size();
                if off > old && !old.is_multiple_of(SS) {
                    m.touched_partial(old / SS);
                }
                if m.size() < off + len {
                    m.resize(off + len);
                }
                m.data[off as usize..(off + len) as usize].copy_from_slice(&data_of(*seed, len));
                for s in off / SS..(off + len).div_ceil(SS) {
                    m.put(s, DATA);
                }
                if off == 0 && len >= SS.min(m.size()) && m.size() >= SS {
                    m.maybe_inline = false;
                }
                m.changed(track);
            }
            Op::Truncate { f, size, .. } => {
                let m = self.files.get_mut(f).unwrap();
                let (old, n) = (m.size(), *size);
                if n < old {
                    let keep = n.div_ceil(SS) as usize;
                    m.alloc.truncate(keep);
                    if !n.is_multiple_of(SS) {
                        m.touched_partial(n / SS);
                    }
                } else if n > old {
                    if !old.is_multiple_of(SS) {
                        m.touched_partial(old / SS);
                    }
                } else {
                    // The same size: preallocations past the end may go (the kernel's
                    // truncate drops them) or stay (butter keeps them).
                    for s in old.div_ceil(SS)..m.alloc.len() as u64 {
                        if m.get(s) & PRE != 0 {
                            m.or(s, HOLE);
                        }
                    }
                }
                m.resize(n);
                if n == 0 && old > 0 {
                    m.maybe_inline = false;
                    m.alloc.clear();
                }
                m.falloc_from = None;
                m.changed(track);
            }
            Op::Falloc { f, mode, off, len } => {
                let m = self.files.get_mut(f).unwrap();
                let (off, end, size) = (*off, off + len, m.size());
                if mode & FALLOC_FL_PUNCH_HOLE != 0 {
                    let to = end.min(size);
                    if off < to {
                        m.data[off as usize..to as usize].fill(0);
                        for s in off / SS..to.div_ceil(SS) {
                            let whole = s * SS >= off && (s + 1) * SS <= to;
                            // (An inline extent is zeroed by a write: data.)
                            m.put(s, if whole && !m.maybe_inline { HOLE } else { ANY });
                        }
                    }
                    m.falloc_from = None;
                } else {
                    if mode & ZERO_RANGE != 0 {
                        let to = end.min(size);
                        if off < to {
                            m.data[off as usize..to as usize].fill(0);
                        }
                        for s in off / SS..end.div_ceil(SS) {
                            let whole = s * SS >= off && (s + 1) * SS <= end;
                            m.put(s, if whole && !m.maybe_inline { PRE } else { ANY });
                        }
                    } else {
                        if !size.is_multiple_of(SS) && end > size {
                            m.touched_partial(size / SS);
                        }
                        for s in off / SS..end.div_ceil(SS) {
                            m.prealloc(s);
                        }
                    }
                    let grows = mode & FALLOC_FL_KEEP_SIZE == 0 && end > size;
                    if grows {
                        m.resize(end);
                    }
                    m.falloc_from = (*mode == 0 && off == size && grows).then_some(size);
                }
                m.changed(track);
            }
            Op::Clone {
                src,
                soff,
                dst,
                doff,
                len,
            } => {
                let s = self.files[src].clone();
                let m = self.files.get_mut(dst).unwrap();
                let (soff, doff, len) = (*soff, *doff, *len);
                let bytes = s.data[soff as usize..(soff + len) as usize].to_vec();
                if m.size() < doff + len {
                    m.resize(doff + len);
                }
                m.data[doff as usize..(doff + len) as usize].copy_from_slice(&bytes);
                // A source with an inline extent is copied (written), not shared.
                let copied = s.maybe_inline && soff == 0;
                for i in 0..len.div_ceil(SS) {
                    let a = s.get(soff / SS + i);
                    m.put(doff / SS + i, if copied { a | DATA } else { a });
                }
                if copied {
                    m.maybe_inline = true;
                }
                m.falloc_from = None;
                m.changed(track);
            }
            Op::Rename { from, to } => {
                let f = self.names.remove(from).unwrap();
                if let Some(v) = self.names.insert(*to, f) {
                    let vm = self.files.get_mut(&v).unwrap();
                    vm.nlink -= 1;
                    vm.names_changed = true;
                }
                self.files.get_mut(&f).unwrap().names_changed = true;
                self.ever.insert((*to, f));
            }
            Op::Link { f, at } => {
                self.names.insert(*at, *f);
                self.ever.insert((*at, *f));
                let m = self.files.get_mut(f).unwrap();
                m.nlink += 1;
                m.names_changed = true;
            }
            Op::Unlink { at } => {
                let f = self.names.remove(at).unwrap();
                let m = self.files.get_mut(&f).unwrap();
                m.nlink -= 1;
                m.names_changed = true;
            }
            Op::Fsync { f } => {
                if track {
                    self.files.get_mut(f).unwrap().make_durable();
                }
            }
            Op::Commit => {
                if track {
                    for m in self.files.values_mut() {
                        if m.nlink == 0 {
                            m.gone_durable = true;
                        }
                        m.make_durable();
                    }
                }
            }
            Op::Read { .. } | Op::Stat { .. } | Op::Ranges { .. } => {}
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The generator
// ---------------------------------------------------------------------------------------------

trait RngExt {
    fn range(&mut self, lo: u64, hi: u64) -> u64;
    fn chance(&mut self, n: u64, d: u64) -> bool;
    fn pick<T: Copy>(&mut self, v: &[T]) -> T;
}

impl RngExt for Rng {
    /// In `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi.saturating_sub(lo) + 1)
    }
    fn chance(&mut self, n: u64, d: u64) -> bool {
        self.below(d) < n
    }
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.below(v.len() as u64) as usize]
    }
}

struct Gen {
    rng: Rng,
    next_file: usize,
    next_name: u32,
}

impl Gen {
    fn new_name(&mut self) -> Name {
        self.next_name += 1;
        (self.rng.below(DIRS as u64) as usize, self.next_name)
    }

    /// An append's length: a byte to a sector, whole sectors, up to 1 MiB.
    fn append_len(&mut self) -> u64 {
        match self.rng.below(10) {
            0..=3 => self.rng.range(1, SS),
            4..=7 => self.rng.range(1, 64) * SS,
            _ => self.rng.range(64 * KIB, MIB),
        }
    }

    /// One operation for the model's state.
    fn op(&mut self, m: &Model) -> Op {
        let live = m.live();
        let r = &mut self.rng;
        let p = if live.is_empty() { 0 } else { r.below(100) };
        if p < 8 && live.len() < MAX_FILES || live.is_empty() {
            self.next_file += 1;
            return Op::Create {
                f: self.next_file,
                at: self.new_name(),
            };
        }
        let f = r.pick(&live);
        let size = m.file(f).size();
        match p {
            0..=37 => {
                let (off, len) = match r.below(100) {
                    // small at offset 0: inline files
                    0..=24 => (0, r.range(1, 2048)),
                    // appends at the end, sector-aligned or not
                    25..=59 => {
                        let off = if r.chance(1, 2) {
                            size
                        } else {
                            size.next_multiple_of(SS)
                        };
                        (off, self.append_len())
                    }
                    // anywhere, a little past the end too
                    _ => (
                        r.below(size + 64 * KIB),
                        match r.below(3) {
                            0 => r.range(1, 2048),
                            1 => r.range(1, 16) * SS,
                            _ => r.range(1, 128 * KIB),
                        },
                    ),
                };
                let r = &mut self.rng;
                if off + len > MAX_FILE {
                    return Op::Truncate {
                        f,
                        size: r.below(size + 1),
                        setattr: r.chance(1, 3),
                    };
                }
                Op::Write {
                    f,
                    off,
                    len,
                    seed: r.next(),
                }
            }
            38..=49 => {
                let to = match r.below(10) {
                    0 => 0,
                    1 => size,
                    2..=3 => m.file(f).falloc_from.unwrap_or_else(|| r.below(size + 1)),
                    4..=5 => r.below(size + 1),
                    6 => r.below(size + 1) / SS * SS,
                    _ => (size + r.range(1, 256 * KIB)).min(MAX_FILE),
                };
                Op::Truncate {
                    f,
                    size: to,
                    setattr: r.chance(1, 3),
                }
            }
            50..=65 => {
                let end_aligned = size.next_multiple_of(SS);
                let (mode, off, len) = match r.below(10) {
                    // at the end, whole sectors: served in memory
                    0..=2 => (
                        0,
                        if r.chance(3, 4) { size } else { end_aligned },
                        r.range(1, 128) * SS,
                    ),
                    3 => (0, size, r.range(1, 300 * KIB)),
                    4 => (
                        FALLOC_FL_KEEP_SIZE,
                        end_aligned + r.below(4) * SS,
                        r.range(1, 64) * SS,
                    ),
                    5 => (
                        if r.chance(1, 2) {
                            0
                        } else {
                            FALLOC_FL_KEEP_SIZE
                        },
                        r.below(size + 1),
                        r.range(1, 256 * KIB),
                    ),
                    6..=7 if size > 0 => {
                        let off = r.below(size);
                        let len = r.range(1, size - off);
                        (FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, len)
                    }
                    8..=9 if size > 0 => {
                        let off = r.below(size);
                        let len = r.range(1, size - off);
                        let keep = if r.chance(1, 2) {
                            FALLOC_FL_KEEP_SIZE
                        } else {
                            0
                        };
                        (ZERO_RANGE | keep, off, len)
                    }
                    _ => (0, size, SS),
                };
                let len = len.min(MAX_FILE.saturating_sub(off));
                if len == 0 {
                    return Op::Commit;
                }
                Op::Falloc { f, mode, off, len }
            }
            66..=71 => {
                let src = r.pick(&live);
                let dst = r.pick(&live);
                let (ssz, dsz) = (m.file(src).size(), m.file(dst).size());
                if ssz == 0 {
                    return Op::Fsync { f: src };
                }
                let soff = r.below(ssz) / SS * SS;
                let avail = ssz - soff;
                let len = if r.chance(1, 4) || avail < SS {
                    avail
                } else {
                    r.range(1, (avail / SS).min(128)) * SS
                };
                let doff = match r.below(3) {
                    0 => dsz.next_multiple_of(SS),
                    1 => 0,
                    _ => r.below(dsz + 64 * KIB) / SS * SS,
                };
                let op = Op::Clone {
                    src,
                    soff,
                    dst,
                    doff,
                    len,
                };
                if m.valid(&op) {
                    op
                } else {
                    Op::Fsync { f: dst }
                }
            }
            72..=76 => {
                let names: Vec<Name> = m.names.keys().copied().collect();
                let from = r.pick(&names);
                let to = if r.chance(1, 3) {
                    r.pick(&names)
                } else {
                    self.new_name()
                };
                let op = Op::Rename { from, to };
                if m.valid(&op) {
                    op
                } else {
                    Op::Commit
                }
            }
            77..=79 => Op::Link {
                f,
                at: self.new_name(),
            },
            80..=83 => {
                let names: Vec<Name> = m.names.keys().copied().collect();
                Op::Unlink { at: r.pick(&names) }
            }
            84..=94 => Op::Fsync { f },
            _ => Op::Commit,
        }
    }

    fn look(&mut self, m: &Model) -> Option<Op> {
        let live = m.live();
        if live.is_empty() {
            return None;
        }
        let r = &mut self.rng;
        let f = r.pick(&live);
        let size = m.file(f).size();
        Some(match r.below(3) {
            0 => Op::Stat { f },
            1 => Op::Ranges { f },
            _ => {
                let off = r.below(size + 8 * KIB);
                Op::Read {
                    f,
                    off,
                    len: r.range(1, 256 * KIB),
                }
            }
        })
    }
}

/// The operations of sequence `seed`: `n` changes, with looks between them when `looks`.
fn gen_ops(seed: u64, n: usize, looks: bool) -> Vec<Op> {
    let mut g = Gen {
        rng: Rng(seed | 1),
        next_file: 0,
        next_name: 0,
    };
    // Mix the seed (xorshift from small seeds starts slowly).
    for _ in 0..8 {
        g.rng.next();
    }
    let mut m = Model::default();
    let mut ops = Vec::with_capacity(n * 2);
    while ops.len() < n {
        if looks && g.rng.chance(1, 3) {
            if let Some(l) = g.look(&m) {
                ops.push(l);
            }
        }
        let op = g.op(&m);
        if m.valid(&op) {
            m.apply(&op);
            ops.push(op);
        }
    }
    ops
}

// ---------------------------------------------------------------------------------------------
// Running a sequence on butter
// ---------------------------------------------------------------------------------------------

/// The write engine's option sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    Default,
    NoDelalloc,
    ZstdForce,
    NoFsyncLog,
}

const VARIANTS: [Variant; 4] = [
    Variant::Default,
    Variant::NoDelalloc,
    Variant::ZstdForce,
    Variant::NoFsyncLog,
];

impl Variant {
    fn options(self) -> RwOptions {
        let mut o = RwOptions::default();
        match self {
            Variant::Default => {}
            Variant::NoDelalloc => o.delayed_allocation = false,
            Variant::ZstdForce => {
                o.compress = butter::format::compress::Compression::parse("zstd:1")
                    .ok()
                    .flatten();
                assert!(o.compress.is_some(), "zstd:1 parses");
                o.compress_force = true;
            }
            Variant::NoFsyncLog => o.fsync_log = false,
        }
        o
    }
}

/// Why a run stopped.
#[derive(Debug)]
enum Fail {
    /// An operation failed in butter.
    Fs(usize, String),
    /// Butter showed something the model does not.
    Model(String),
}

impl std::fmt::Display for Fail {
    fn fmt(&self, out: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fail::Fs(i, e) => write!(out, "op {i} failed: {e}"),
            Fail::Model(e) => write!(out, "{e}"),
        }
    }
}

/// The base image: mkfs, then the directories `d1` and `d2`, committed.
fn base_image() -> &'static Vec<u8> {
    static BASE: OnceLock<Vec<u8>> = OnceLock::new();
    BASE.get_or_init(|| {
        let img = fresh_image(IMAGE_SIZE, Profile::Dup, Profile::Single);
        let dev = Arc::new(RamDevice::new(img));
        let fs = Fs::open_device_rw(dev.clone()).expect("open the fresh image");
        let root = fs.root_inode();
        for d in 1..DIRS {
            fs.mkdir(root, format!("d{d}").as_bytes(), 0o755, OWNER)
                .expect("mkdir");
        }
        fs.close().expect("close");
        drop(fs);
        dev.live_bytes()
    })
}

fn dir_inodes(fs: &Fs) -> Result<Vec<Inode>, String> {
    let root = fs.root_inode();
    let mut v = vec![root];
    for d in 1..DIRS {
        let e = fs
            .lookup(root, format!("d{d}").as_bytes())
            .map_err(|e| format!("lookup d{d}: {e}"))?
            .ok_or_else(|| format!("d{d} missing"))?;
        v.push(e.target);
    }
    Ok(v)
}

/// The sector states `file_ranges` shows, up to the last allocated sector.
fn sectors_of(fs: &Fs, ino: Inode) -> Result<(Vec<u8>, bool), String> {
    let r = fs
        .file_ranges(ino, u64::MAX, 0)
        .map_err(|e| format!("file_ranges: {e}"))?;
    let mut v: Vec<u8> = Vec::new();
    let mut mark = |lo: u64, hi: u64, m: u8| {
        for s in lo / SS..hi.div_ceil(SS) {
            let s = s as usize;
            if v.len() <= s {
                v.resize(s + 1, HOLE);
            }
            // Data wins over preallocated where both touch a sector (a partial one).
            if v[s] != DATA {
                v[s] = m;
            }
        }
    };
    for &(lo, hi) in &r.prealloc {
        mark(lo, hi, PRE);
    }
    for &(lo, hi) in &r.data {
        mark(lo, hi, DATA);
    }
    let inline = r
        .data
        .first()
        .is_some_and(|&(lo, hi)| lo == 0 && !hi.is_multiple_of(SS));
    while v.last() == Some(&HOLE) {
        v.pop();
    }
    Ok((v, inline))
}

fn state_name(m: u8) -> String {
    let mut v = Vec::new();
    if m & HOLE != 0 {
        v.push("hole");
    }
    if m & PRE != 0 {
        v.push("prealloc");
    }
    if m & DATA != 0 {
        v.push("data");
    }
    v.join("|")
}

/// Compares file `f` (inode `ino`) with the model: size, link count, bytes, sectors and
/// st_blocks where the sectors decide it. The caller holds the read gate when the
/// filesystem is open read-write.
fn check_file(fs: &Fs, f: usize, ino: Inode, m: &MFile, full: bool) -> Result<(), String> {
    let st = fs.stat(ino).map_err(|e| format!("f{f}: stat: {e}"))?;
    if st.size != m.size() {
        return Err(format!("f{f}: size {} (model {})", st.size, m.size()));
    }
    if st.nlink != m.nlink {
        return Err(format!("f{f}: nlink {} (model {})", st.nlink, m.nlink));
    }
    if full {
        let got = fs
            .read(ino, 0, m.data.len() + 4096)
            .map_err(|e| format!("f{f}: read: {e}"))?;
        compare_bytes(f, 0, &got, &m.data)?;
    }
    let (secs, inline) = sectors_of(fs, ino).map_err(|e| format!("f{f}: {e}"))?;
    let n = secs.len().max(m.alloc.len());
    let mut bad = Vec::new();
    for s in 0..n as u64 {
        let got = secs.get(s as usize).copied().unwrap_or(HOLE);
        let want = m.get(s);
        // An inline extent is data in sector 0 (it may stand where the model has any data).
        if want & got == 0 {
            bad.push(format!(
                "sector {s} (byte {}) is {} (model {})",
                s * SS,
                state_name(got),
                state_name(want)
            ));
        }
    }
    if !bad.is_empty() {
        let k = bad.len();
        bad.truncate(6);
        return Err(format!(
            "f{f}: {k} sectors differ (size {}): {}",
            m.size(),
            bad.join(", ")
        ));
    }
    // st_blocks: defined where every sector's state is, and no inline extent counts its bytes.
    let exact = m.alloc.iter().all(|&x| x.count_ones() == 1);
    if exact && !inline && !m.maybe_inline {
        let bytes = m.alloc.iter().filter(|&&x| x != HOLE).count() as u64 * SS;
        if st.blocks != bytes / 512 {
            return Err(format!(
                "f{f}: st_blocks {} (model {}: {} sectors allocated)",
                st.blocks,
                bytes / 512,
                bytes / SS
            ));
        }
    }
    Ok(())
}

fn compare_bytes(f: usize, off: u64, got: &[u8], want: &[u8]) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    if got.len() != want.len() {
        return Err(format!(
            "f{f}: read at {off} gave {} bytes (model {})",
            got.len(),
            want.len()
        ));
    }
    let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap_or(0);
    let j = got.len()
        - got
            .iter()
            .rev()
            .zip(want.iter().rev())
            .position(|(a, b)| a != b)
            .unwrap_or(0);
    let nz = got[i..j].iter().filter(|&&b| b != 0).count();
    Err(format!(
        "f{f}: bytes {}..{} differ from the model ({} of them nonzero in what butter shows, \
         {} in the model)",
        off + i as u64,
        off + j as u64,
        nz,
        want[i..j].iter().filter(|&&b| b != 0).count()
    ))
}

/// Runs `op` on butter and the model; `Ok(false)` when the model says it cannot run.
fn exec(
    fs: &Fs,
    dirs: &[Inodes],
    inos: &mut BTreeMap<usize, Inode>,
    m: &mut Model,
    i: usize,
    op: &Op,
) -> Result<bool, Fail> {
    if !m.valid(op) {
        return Ok(false);
    }
    let fsf = |what: &str, e: butter::Error| Fail::Fs(i, format!("{what}: {e}"));
    let ino = |f: &usize| inos[f];
    match op {
        Op::Create { f, at } => {
            let new = fs
                .create(dirs[at.0].0, &name_bytes(*at), 0o644, OWNER)
                .map_err(|e| fsf("create", e))?;
            inos.insert(*f, new);
        }
        Op::Write { f, off, len, seed } => {
            let data = data_of(*seed, *len);
            let n = fs.write(ino(f), *off, &data).map_err(|e| fsf("write", e))?;
            if n as u64 != *len {
                return Err(Fail::Fs(i, format!("short write: {n} of {len}")));
            }
        }
        Op::Truncate { f, size, setattr } => {
            if *setattr {
                let a = SetAttr {
                    size: Some(*size),
                    ..SetAttr::default()
                };
                fs.setattr(ino(f), &a).map_err(|e| fsf("setattr", e))?;
            } else {
                fs.truncate(ino(f), *size).map_err(|e| fsf("truncate", e))?;
            }
        }
        Op::Falloc { f, mode, off, len } => {
            fs.fallocate(ino(f), *mode, *off, *len)
                .map_err(|e| fsf("fallocate", e))?;
        }
        Op::Clone {
            src,
            soff,
            dst,
            doff,
            len,
        } => {
            let n = fs
                .clone_range(ino(src), *soff, ino(dst), *doff, *len)
                .map_err(|e| fsf("clone", e))?;
            if n != *len {
                return Err(Fail::Fs(i, format!("clone of {len} bytes did {n}")));
            }
        }
        Op::Rename { from, to } => {
            fs.rename(
                dirs[from.0].0,
                &name_bytes(*from),
                dirs[to.0].0,
                &name_bytes(*to),
                0,
            )
            .map_err(|e| fsf("rename", e))?;
        }
        Op::Link { f, at } => {
            fs.link(ino(f), dirs[at.0].0, &name_bytes(*at))
                .map_err(|e| fsf("link", e))?;
        }
        Op::Unlink { at } => {
            fs.unlink(dirs[at.0].0, &name_bytes(*at))
                .map_err(|e| fsf("unlink", e))?;
        }
        Op::Fsync { f } => fs.fsync(ino(f), false).map_err(|e| fsf("fsync", e))?,
        Op::Commit => fs.commit().map_err(|e| fsf("commit", e))?,
        Op::Read { f, off, len } => {
            let mf = m.file(*f);
            let got = fs
                .read(ino(f), *off, *len as usize)
                .map_err(|e| fsf("read", e))?;
            let lo = (*off).min(mf.size()) as usize;
            let hi = (off + len).min(mf.size()) as usize;
            compare_bytes(*f, *off, &got, &mf.data[lo..hi])
                .map_err(|e| Fail::Model(format!("op {i}: {e}")))?;
        }
        Op::Stat { f } | Op::Ranges { f } => {
            check_file(fs, *f, ino(f), m.file(*f), false)
                .map_err(|e| Fail::Model(format!("op {i}: {e}")))?;
        }
    }
    m.apply(op);
    Ok(true)
}

/// The directories' inodes (a newtype so a file's inode is not passed for a directory).
#[derive(Clone, Copy)]
struct Inodes(Inode);

/// The names butter shows in the workload's directories against the model's, and each
/// live file against the model.
fn check_all(
    fs: &Fs,
    dirs: &[Inodes],
    inos: &BTreeMap<usize, Inode>,
    m: &Model,
) -> Result<(), String> {
    let mut shown: BTreeMap<Name, Inode> = BTreeMap::new();
    for (d, dir) in dirs.iter().enumerate() {
        let ents = fs
            .readdir(dir.0, 0, 0)
            .map_err(|e| format!("readdir d{d}: {e}"))?;
        for e in ents {
            let n = std::str::from_utf8(&e.name)
                .ok()
                .and_then(|s| s.strip_prefix('n'))
                .and_then(|s| s.parse::<u32>().ok());
            match n {
                Some(n) => {
                    shown.insert((d, n), e.target);
                }
                None if d == 0 && (e.name == b"d1" || e.name == b"d2") => {}
                None => {
                    return Err(format!(
                        "d{d}: unexpected name {:?}",
                        String::from_utf8_lossy(&e.name)
                    ))
                }
            }
        }
    }
    let want: BTreeMap<Name, Inode> = m.names.iter().map(|(n, f)| (*n, inos[f])).collect();
    if shown != want {
        let mut d = Vec::new();
        for (n, i) in &want {
            match shown.get(n) {
                None => d.push(format!("d{}/n{} missing (inode {})", n.0, n.1, i.ino)),
                Some(j) if j != i => d.push(format!(
                    "d{}/n{} is inode {} (model {})",
                    n.0, n.1, j.ino, i.ino
                )),
                _ => {}
            }
        }
        for (n, j) in &shown {
            if !want.contains_key(n) {
                d.push(format!(
                    "d{}/n{} (inode {}) should not be there",
                    n.0, n.1, j.ino
                ));
            }
        }
        return Err(format!("names differ: {}", d.join(", ")));
    }
    for f in m.live() {
        check_file(fs, f, inos[&f], m.file(f), true)?;
    }
    Ok(())
}

/// Runs `ops` on a fresh copy of the base image under `v`; then checks the end state, closes,
/// checks it again read-only with the checker.
fn run_differential(ops: &[Op], v: Variant) -> Result<usize, String> {
    let dev = Arc::new(RamDevice::new(base_image().clone()));
    let fs = Fs::open_device_rw_with(dev.clone(), v.options()).map_err(|e| format!("open: {e}"))?;
    let dirs: Vec<Inodes> = dir_inodes(&fs)?.into_iter().map(Inodes).collect();
    let mut inos = BTreeMap::new();
    let mut m = Model::default();
    let mut done = 0;
    for (i, op) in ops.iter().enumerate() {
        match exec(&fs, &dirs, &mut inos, &mut m, i, op) {
            Ok(true) => done += 1,
            Ok(false) => {}
            Err(e) => return Err(format!("{e} ({op})")),
        }
    }
    check_all(&fs, &dirs, &inos, &m).map_err(|e| format!("at the end: {e}"))?;
    fs.close().map_err(|e| format!("close: {e}"))?;
    drop(fs);
    if dev.durable_bytes() != dev.live_bytes() {
        return Err("unflushed writes after close".into());
    }
    let ro = Fs::open_device(dev.clone() as Arc<dyn BlockDevice>)
        .map_err(|e| format!("read-only open after close: {e}"))?;
    check_all(&ro, &dirs, &inos, &m).map_err(|e| format!("after close: {e}"))?;
    butter_check(&ro).map_err(|e| format!("butter check after close: {e}"))?;
    Ok(done)
}

// ---------------------------------------------------------------------------------------------
// Shrinking a failing sequence
// ---------------------------------------------------------------------------------------------

/// The first line of a failure, without numbers that move when operations are removed.
fn failure_kind(e: &str) -> String {
    let first = e.lines().next().unwrap_or("");
    first
        .split(|c: char| c.is_ascii_digit())
        .collect::<Vec<_>>()
        .join("#")
        .chars()
        .take(40)
        .collect()
}

/// Delta debugging over the operations: a shorter sequence that fails the same way, within
/// `budget`.
fn shrink(ops: &[Op], v: Variant, err: &str, budget: Duration) -> (Vec<Op>, String) {
    let t = Instant::now();
    let kind = failure_kind(err);
    let fails = |c: &[Op]| -> Option<String> {
        match run_differential(c, v) {
            Err(e) if failure_kind(&e) == kind => Some(e),
            _ => None,
        }
    };
    let mut cur = ops.to_vec();
    let mut cur_err = err.to_string();
    // Nothing after the failing operation matters when it failed during the run.
    let mut chunk = cur.len() / 2;
    while chunk >= 1 && t.elapsed() < budget {
        let mut i = 0;
        let mut progress = false;
        while i < cur.len() && t.elapsed() < budget {
            let end = (i + chunk).min(cur.len());
            let mut c = cur.clone();
            c.drain(i..end);
            if let Some(e) = fails(&c) {
                cur = c;
                cur_err = e;
                progress = true;
            } else {
                i += chunk;
            }
        }
        if !progress {
            chunk /= 2;
        }
    }
    // Keep only what the model accepts (so the listing replays as printed).
    let mut m = Model::default();
    let mut out = Vec::new();
    for op in cur {
        if m.valid(&op) {
            m.apply(&op);
            out.push(op);
        }
    }
    (out, cur_err)
}

// ---------------------------------------------------------------------------------------------
// Power cuts
// ---------------------------------------------------------------------------------------------

/// Runs `ops` on `fs` until one fails: the model of what ran (with the failed operation's
/// state allowed too: it may have gone through before its failure), the inodes the creates
/// made, the error and the number of operations that ran.
fn run_until_failure(
    fs: &Fs,
    ops: &[Op],
) -> (Model, BTreeMap<usize, Inode>, Option<String>, usize) {
    let mut m = Model {
        track: true,
        ..Model::default()
    };
    let mut inos = BTreeMap::new();
    let dirs: Vec<Inodes> = match dir_inodes(fs) {
        Ok(d) => d.into_iter().map(Inodes).collect(),
        Err(e) => return (m, inos, Some(e), 0),
    };
    for (i, op) in ops.iter().enumerate() {
        if let Err(e) = exec(fs, &dirs, &mut inos, &mut m, i, op) {
            // (exec changes the model only after the operation succeeded.)
            let mut n = m.clone();
            if n.valid(op) {
                n.apply(op);
                for (f, nf) in &n.files {
                    if let (Some(mf), Some(h)) = (m.files.get_mut(f), nf.states.last()) {
                        if !mf.states.contains(h) {
                            mf.states.push(*h);
                        }
                    }
                }
                m.ever.extend(n.ever);
            }
            return (m, inos, Some(format!("{e} ({op})")), i);
        }
    }
    (m, inos, None, ops.len())
}

/// What the recovered filesystem must satisfy: see the module comment.
fn check_recovered(fs: &Fs, m: &Model, inos: &BTreeMap<usize, Inode>) -> Vec<String> {
    let mut problems = Vec::new();
    let dirs = match dir_inodes(fs) {
        Ok(d) => d,
        Err(e) => return vec![e],
    };
    let by_ino: BTreeMap<Inode, usize> = inos.iter().map(|(f, i)| (*i, *f)).collect();
    let mut seen: BTreeMap<usize, Vec<Name>> = BTreeMap::new();
    for (d, dir) in dirs.iter().enumerate() {
        let ents = match fs.readdir(*dir, 0, 0) {
            Ok(e) => e,
            Err(e) => {
                problems.push(format!("readdir d{d}: {e}"));
                continue;
            }
        };
        for e in ents {
            let label = String::from_utf8_lossy(&e.name).to_string();
            if d == 0 && (label == "d1" || label == "d2") {
                continue;
            }
            let n = label.strip_prefix('n').and_then(|s| s.parse::<u32>().ok());
            let Some(n) = n else {
                problems.push(format!("d{d}/{label}: a name never made"));
                continue;
            };
            let Some(&f) = by_ino.get(&e.target) else {
                problems.push(format!(
                    "d{d}/{label}: inode {} that no create made",
                    e.target.ino
                ));
                continue;
            };
            if !m.ever.contains(&((d, n), f)) {
                problems.push(format!(
                    "d{d}/{label}: names f{f}, which never had that name"
                ));
            }
            seen.entry(f).or_default().push((d, n));
        }
    }
    for (f, mf) in &m.files {
        let Some(&ino) = inos.get(f) else { continue };
        let must = mf.durable && !mf.names_changed && mf.nlink > 0;
        if mf.gone_durable && seen.contains_key(f) {
            problems.push(format!("f{f}: unlinked before a commit, but it has names"));
            continue;
        }
        if must && !seen.contains_key(f) {
            problems.push(format!(
                "f{f} (inode {}): fsynced or committed with its names, but no name shows it",
                ino.ino
            ));
        }
        if !seen.contains_key(f) && !must {
            continue;
        }
        let st = match fs.stat(ino) {
            Ok(s) => s,
            Err(e) => {
                problems.push(format!("f{f}: stat: {e}"));
                continue;
            }
        };
        let data = match fs.read(ino, 0, st.size as usize) {
            Ok(d) => d,
            Err(e) => {
                problems.push(format!("f{f}: read: {e}"));
                continue;
            }
        };
        if !mf.states.contains(&hash_state(&data)) {
            problems.push(format!(
                "f{f} (inode {}): size {} ({} nonzero bytes) is none of the {} states since \
                 its last durable one{} (model now: size {})",
                ino.ino,
                data.len(),
                data.iter().filter(|&&b| b != 0).count(),
                mf.states.len(),
                if mf.durable {
                    ""
                } else {
                    " (never made durable)"
                },
                mf.size()
            ));
        }
    }
    problems
}

/// One power-cut round: a dry run counts the writes, the real run loses power at a random
/// one of them; the image that survived must satisfy the model. Returns a line for the log.
fn power_round(ops: &[Op], v: Variant, cut_pick: u64, what: &str) -> Result<String, String> {
    let base = base_image();
    let total = {
        let dev = Arc::new(RamDevice::new(base.clone()));
        let fs =
            Fs::open_device_rw_with(dev.clone(), v.options()).map_err(|e| format!("open: {e}"))?;
        let start = dev.write_count();
        let (_, _, err, _) = run_until_failure(&fs, ops);
        if let Some(e) = err {
            return Err(format!("{what}: dry run (no power cut): {e}"));
        }
        drop(fs);
        dev.write_count() - start
    };
    let cut = cut_pick % (total + 1);
    let dev = Arc::new(RamDevice::new(base.clone()));
    let fs = Fs::open_device_rw_with(dev.clone(), v.options()).map_err(|e| format!("open: {e}"))?;
    dev.set_faults(Faults {
        fail_write_at: Some(dev.write_count() + cut),
        power_cut: true,
        ..Faults::default()
    });
    let (m, inos, err, done) = run_until_failure(&fs, ops);
    drop(fs);
    if let Some(e) = &err {
        if !dev.power_lost() {
            return Err(format!("{what}: failed before the power cut: {e}"));
        }
    }
    let img = dev.durable_bytes();
    drop(dev);
    let rdev = Arc::new(RamDevice::new(img));
    let fs = Fs::open_device_rw(rdev.clone())
        .map_err(|e| format!("{what}: open after the power cut: {e}"))?;
    let problems = check_recovered(&fs, &m, &inos);
    if !problems.is_empty() {
        return Err(format!(
            "{what}: after the power cut at write {cut} of {total} (op {done}):\n  {}",
            problems.join("\n  ")
        ));
    }
    fs.close()
        .map_err(|e| format!("{what}: close after recovery: {e}"))?;
    drop(fs);
    let ro = Fs::open_device(rdev as Arc<dyn BlockDevice>)
        .map_err(|e| format!("{what}: read-only open after recovery: {e}"))?;
    butter_check(&ro).map_err(|e| format!("{what}: butter check after recovery: {e}"))?;
    Ok(format!(
        "cut at write {cut} of {total}, {done} of {} ops ran",
        ops.len()
    ))
}

// ---------------------------------------------------------------------------------------------
// The tests
// ---------------------------------------------------------------------------------------------

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn settings() -> (usize, u64, u64) {
    let ops = env_u64("BUTTER_DEFERRED_OPS").unwrap_or(120) as usize;
    let seeds = env_u64("BUTTER_DEFERRED_SEEDS").unwrap_or(3);
    let seed = env_u64("BUTTER_DEFERRED_SEED").unwrap_or_else(|| {
        static CLOCK: OnceLock<u64> = OnceLock::new();
        *CLOCK.get_or_init(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64 % 1_000_000_007)
                .unwrap_or(1)
        })
    });
    (ops, seeds, seed)
}

/// Sequence `k` of a test's base seed.
fn seq_seed(seed: u64, k: u64) -> u64 {
    seed.wrapping_mul(0x9E37_79B9)
        .wrapping_add(k.wrapping_mul(0x1000_0001))
}

fn differential(v: Variant) {
    let (n, seeds, seed) = settings();
    eprintln!("deferred differential {v:?}: BUTTER_DEFERRED_SEED={seed}");
    let t = Instant::now();
    let (mut seqs, mut total) = (0, 0);
    for k in 0..seeds {
        for looks in [false, true] {
            let s = seq_seed(seed, k);
            let ops = gen_ops(s, n, looks);
            let what = format!(
                "{v:?}, BUTTER_DEFERRED_SEED={seed} sequence {k} ({} looks)",
                if looks { "with" } else { "without" }
            );
            match run_differential(&ops, v) {
                Ok(done) => {
                    seqs += 1;
                    total += done;
                }
                Err(e) => {
                    let (small, err) = if std::env::var_os("BUTTER_DEFERRED_NO_SHRINK").is_some() {
                        (ops.clone(), e.clone())
                    } else {
                        shrink(
                            &ops,
                            v,
                            &e,
                            Duration::from_secs(
                                env_u64("BUTTER_DEFERRED_SHRINK_SECS").unwrap_or(90),
                            ),
                        )
                    };
                    panic!(
                        "{what}: {e}\n\nshrunk to {} operations, which fail with: {err}\n{}",
                        small.len(),
                        show_ops(&small)
                    );
                }
            }
        }
    }
    eprintln!(
        "deferred differential {v:?}: {seqs} sequences, {total} operations, \
         BUTTER_DEFERRED_SEED={seed}, {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn differential_default() {
    differential(Variant::Default);
}

#[test]
fn differential_no_delayed_allocation() {
    differential(Variant::NoDelalloc);
}

#[test]
fn differential_zstd_forced() {
    differential(Variant::ZstdForce);
}

#[test]
fn differential_no_fsync_log() {
    differential(Variant::NoFsyncLog);
}

/// Power-cut rounds, the variants in turn.
fn power_cut(mix: u64) {
    let (n, seeds, seed) = settings();
    let t = Instant::now();
    let rounds = seeds * 3;
    let mut lines = 0;
    for r in 0..rounds {
        let v = VARIANTS[((r + mix) % VARIANTS.len() as u64) as usize];
        let s = seq_seed(seed ^ 0x00c0_ffee ^ mix, r);
        let ops = gen_ops(s, n, false);
        let mut rng = Rng(s | 1);
        for _ in 0..4 {
            rng.next();
        }
        let what = format!("power cut, {v:?}, BUTTER_DEFERRED_SEED={seed} round {r} (mix {mix})");
        match power_round(&ops, v, rng.next(), &what) {
            Ok(line) => {
                lines += 1;
                eprintln!("{what}: {line}");
            }
            Err(e) => panic!("{e}\n\nthe sequence:\n{}", show_ops(&ops)),
        }
    }
    eprintln!(
        "deferred power cuts (mix {mix}): {lines} rounds of {n} operations, {:.1} s",
        t.elapsed().as_secs_f64()
    );
}

#[test]
fn power_cut_rounds() {
    power_cut(0);
}

#[test]
fn power_cut_rounds_more() {
    power_cut(2);
}

// ---------------------------------------------------------------------------------------------
// Bugs the sequences above found, shrunk to a few operations (each failed before its fix)
// ---------------------------------------------------------------------------------------------

/// Runs `ops` under every variant; panics naming the variants that fail.
fn fixed_bug(ops: &[Op]) {
    let mut failed = Vec::new();
    for v in VARIANTS {
        if let Err(e) = run_differential(ops, v) {
            failed.push(format!("{v:?}: {e}"));
        }
    }
    assert!(
        failed.is_empty(),
        "{}\n\nthe sequence:\n{}",
        failed.join("\n"),
        show_ops(ops)
    );
}

/// An inline file (779 bytes) written to far past its end: the gap must stay a hole (the
/// kernel writes sector 0 and the new one, st_blocks 16), but butter writes zeros over it, so
/// the file is data from 0 to its end (st_blocks 208).
#[test]
fn an_inline_file_extended_by_a_write_keeps_its_gap_a_hole() {
    fixed_bug(&[
        Op::Create { f: 1, at: (0, 1) },
        Op::Write {
            f: 1,
            off: 0,
            len: 779,
            seed: 2,
        },
        Op::Write {
            f: 1,
            off: 102400,
            len: 10,
            seed: 4,
        },
    ]);
}

/// An inline file (756 bytes) truncated up to 175439 bytes, then preallocated past its end
/// with KEEP_SIZE: the hole from 4096 on must stay a hole, but the fallocate moves the inline
/// content to a regular extent as long as the whole file, writing zeros over the hole.
#[test]
fn fallocate_of_an_extended_inline_file_keeps_its_gap_a_hole() {
    fixed_bug(&[
        Op::Create { f: 1, at: (0, 1) },
        Op::Write {
            f: 1,
            off: 0,
            len: 756,
            seed: 2,
        },
        Op::Truncate {
            f: 1,
            size: 175439,
            setattr: false,
        },
        Op::Falloc {
            f: 1,
            mode: FALLOC_FL_KEEP_SIZE,
            off: 113803,
            len: 163647,
        },
    ]);
}

/// The bug of issue 29: a delayed preallocation at a new file's end (2 MiB), then a small
/// write at offset 0 (inline-sized) left the size at the write's end.
#[test]
fn delayed_prealloc_then_small_write_keeps_size() {
    fixed_bug(&[
        Op::Create { f: 1, at: (0, 1) },
        Op::Falloc {
            f: 1,
            mode: 0,
            off: 0,
            len: 2 * MIB,
        },
        Op::Write {
            f: 1,
            off: 0,
            len: 1000,
            seed: 3,
        },
        Op::Fsync { f: 1 },
    ]);
}
