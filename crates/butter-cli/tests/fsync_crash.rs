//! The fsync crash loop: a random fsync-heavy workload through the library on a RAM device
//! that loses power at a random write, then recovery and a model check.
//!
//! Each round starts from one base image (butter's mkfs, three directories and a subvolume,
//! a few committed files) in a [`RamDevice`], opened read-write. A seeded workload creates
//! files, writes (appends, overwrites, writes past the end), truncates down and up, punches
//! holes, preallocates (with and without KEEP_SIZE), sets and removes an xattr, unlinks,
//! renames files to new names (across directories of one subvolume), and
//! calls `Fs::fsync` (full and data-only) on files and sometimes on directories, makes new
//! subdirectory trees (a file, a nested directory with a file, an empty one) and fsyncs their
//! parent (the log carries them recursively), with an occasional `Fs::commit`. The power is cut at a random write number (chosen from the number
//! of writes a dry run of the same workload issues): that write and everything after it fail,
//! and the workload stops at its first error.
//!
//! The model, per file: every content (and xattr value) the file had from its last successful
//! fsync (or commit) on. After recovery a file must show one of those: a later log or commit
//! may have kept a later state, nothing may show an earlier one. fdatasync makes the content
//! durable but not the xattr. A file whose name was made durable (its fsync, an fsync of its
//! directory, a commit) must exist; an unlink made durable (directory fsync, commit) must be
//! gone; no name may appear that the workload never created. A rename is the old name's
//! unlink and a new name for the file: an fsync of the renamed file makes both durable.
//!
//! Recovery: [`RamDevice::durable_bytes`] (only flushed writes survived) goes to an image
//! file; butter opens it read-write (which replays any fsync log) and must satisfy the model;
//! butter's checker and `btrfs check --readonly` must be clean. Every few rounds a copy is
//! also mounted read-write by the kernel (its own replay): the kernel must satisfy the model
//! and show exactly what butter shows for every model file. The "torn" variant first applies
//! a random prefix of [`RamDevice::unflushed_writes`] (a device may persist some unflushed
//! writes, in order).
//!
//! Environment: `BUTTER_FSYNC_CRASH_ROUNDS` (default 30 per test), `BUTTER_FSYNC_CRASH_SEED`
//! (printed; a failure names its seed and round), `BUTTER_FSYNC_CRASH_ROUND` (run only that
//! round, to replay a failure). Needs root, loop devices, kernel btrfs and btrfs-progs: fails
//! without them.

mod common;

use butter::error::Error;
use butter::fs::{Fs, Inode};
use butter::inode::file::{FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE};
use butter::inode::namespace::Owner;
use butter::internals::{Faults, RamDevice};
use butter::mkfs::{mkfs, MkfsOptions};
use common::fsync::*;
use common::gen::Rng;
use common::kernel::{LoopMount, ScratchDir};
use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fs;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

const IMAGE_SIZE: u64 = 128 << 20;
const DEFAULT_ROUNDS: u64 = 30;
/// Every this many rounds the kernel replays the crash image too.
const KERNEL_EVERY: u64 = 4;
const OWNER: Owner = Owner { uid: 0, gid: 0 };
/// The workload's directories: three in the top level, and the root of subvolume "sv".
const DIRS: [&str; 4] = ["d0", "d1", "d2", "sv"];
const XATTR: &[u8] = b"user.v";
/// Files stay below this size (the data never gets near filling the image).
const MAX_FILE: u64 = 1 << 20;

/// One file of the model.
#[derive(Clone, Debug)]
struct MFile {
    dir: usize,
    name: Vec<u8>,
    ino: Inode,
    /// Contents from the last durable one on; the last is the current content.
    content: Vec<Vec<u8>>,
    /// Values of [`XATTR`] from the last durable one on.
    xattr: Vec<Option<Vec<u8>>>,
    name_durable: bool,
    unlinked: bool,
    unlink_durable: bool,
    /// In a subdirectory tree (`name` is a path below the workload directory; directories
    /// show as [`DIR_MARK`]): no operation touches it after it was made.
    fixed: bool,
    /// The file renamed over it: while that file keeps the name, the name never shows
    /// neither of them.
    replaced_by: Option<Inode>,
}

/// The content a view records for a directory.
const DIR_MARK: &[u8] = b"<directory>";

impl MFile {
    fn cur(&self) -> &Vec<u8> {
        self.content.last().expect("a content")
    }
    fn set(&mut self, c: Vec<u8>) {
        self.content.push(c);
    }
    fn data_durable(&mut self) {
        let c = self.content.pop().expect("a content");
        self.content = vec![c];
    }
    fn meta_durable(&mut self) {
        let x = self.xattr.pop().expect("an xattr state");
        self.xattr = vec![x];
    }
}

#[derive(Clone, Debug, Default)]
struct Model {
    files: Vec<MFile>,
    next_name: u64,
    /// Renames over another file so far, and files created with an unlinked file's name.
    renamed_over: u64,
    reused_names: u64,
}

impl Model {
    fn live(&self) -> Vec<usize> {
        (0..self.files.len())
            .filter(|&i| !self.files[i].unlinked && !self.files[i].fixed)
            .collect()
    }
    fn commit(&mut self) {
        for f in &mut self.files {
            f.data_durable();
            f.meta_durable();
            if f.unlinked {
                f.unlink_durable = true;
            } else {
                f.name_durable = true;
            }
        }
    }
}

/// The base image and the model of what it holds.
struct Base {
    bytes: Vec<u8>,
    model: Model,
}

/// Held around every kernel mount (see its use).
static KERNEL_MOUNT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The base image; `block_group_tree` picks where its block group items live (butter mkfs's
/// default, the block group tree, or the extent tree).
fn make_base(block_group_tree: bool) -> Base {
    let dev = Arc::new(RamDevice::new(vec![0u8; IMAGE_SIZE as usize]));
    let opts = MkfsOptions {
        size: IMAGE_SIZE,
        block_group_tree,
        ..MkfsOptions::default()
    };
    mkfs(dev.as_ref(), &opts).expect("mkfs");
    let fs = Fs::open_device_rw(dev.clone()).expect("open the new image");
    let root = fs.root_inode();
    let mut dirs = Vec::new();
    for d in &DIRS[..3] {
        dirs.push(fs.mkdir(root, d.as_bytes(), 0o755, OWNER).expect("mkdir"));
    }
    dirs.push(
        fs.create_subvolume(root, DIRS[3].as_bytes(), 0o755, OWNER, None)
            .expect("create subvolume"),
    );
    let mut model = Model::default();
    let mut rng = Rng::new(0x5eed);
    for (d, &dir) in dirs.iter().enumerate() {
        for i in 0..3u64 {
            let name = format!("base{i}").into_bytes();
            let ino = fs.create(dir, &name, 0o644, OWNER).expect("create");
            let len = [700u64, 9000, 200_000][i as usize] as usize;
            let data = rng.random_bytes(len);
            fs.write(ino, 0, &data).expect("write");
            model.files.push(MFile {
                dir: d,
                name,
                ino,
                content: vec![data],
                xattr: vec![None],
                name_durable: true,
                unlinked: false,
                unlink_durable: false,
                fixed: false,
                replaced_by: None,
            });
        }
    }
    fs.commit().expect("commit");
    drop(fs);
    Base {
        bytes: dev.live_bytes(),
        model,
    }
}

fn dir_inodes(fs: &Fs) -> Result<Vec<Inode>, Error> {
    let root = fs.root_inode();
    let mut out = Vec::new();
    for d in DIRS {
        let e = fs
            .lookup(root, d.as_bytes())?
            .ok_or_else(|| Error::NotFound(d.into()))?;
        out.push(e.target);
    }
    Ok(out)
}

/// How a workload run ended.
struct RunEnd {
    model: Model,
    ops: usize,
    fsyncs: usize,
    /// The operation that failed (the power cut), if any.
    error: Option<String>,
}

/// Runs the workload of `seed` on `fs` (already open on the base image).
fn workload(fs: &Fs, base: &Model, seed: u64, max_ops: usize) -> RunEnd {
    let mut m = base.clone();
    let mut rng = Rng::new(seed);
    let mut fsyncs = 0;
    let dirs = match dir_inodes(fs) {
        Ok(d) => d,
        Err(e) => {
            return RunEnd {
                model: m,
                ops: 0,
                fsyncs,
                error: Some(format!("directory lookup: {e}")),
            }
        }
    };
    for op in 0..max_ops {
        if let Err(e) = step(fs, &dirs, &mut m, &mut rng, &mut fsyncs) {
            return RunEnd {
                model: m,
                ops: op,
                fsyncs,
                error: Some(format!("op {op}: {e}")),
            };
        }
    }
    RunEnd {
        model: m,
        ops: max_ops,
        fsyncs,
        error: None,
    }
}

/// A random file offset and length for writes: appends, overwrites, writes past the end;
/// small (inline-sized), medium and large.
fn write_range(rng: &mut Rng, size: u64) -> (u64, usize) {
    if rng.below(4) == 0 {
        // Sector-aligned appends (the first may leave a gap to reach alignment), the kind
        // that gather in a delayed-allocation buffer until the fsync.
        let off = size.next_multiple_of(4096);
        let len = rng.range(1, 24) * 4096;
        if off + len <= MAX_FILE {
            return (off, len as usize);
        }
    }
    let len = match rng.below(10) {
        0..=3 => rng.range(1, 3000),
        4..=7 => rng.range(4096, 64 << 10),
        _ => rng.range(64 << 10, 300 << 10),
    };
    let off = match rng.below(3) {
        0 => size,
        1 => rng.below(size + 1),
        _ => rng.below(size + 16384),
    };
    let off = off.min(MAX_FILE - len.min(MAX_FILE));
    (off, len as usize)
}

/// One operation. The model changes only after the operation succeeded.
fn step(
    fs: &Fs,
    dirs: &[Inode],
    m: &mut Model,
    rng: &mut Rng,
    fsyncs: &mut usize,
) -> Result<(), Error> {
    let live = m.live();
    let choice = rng.below(100);
    let pick = |rng: &mut Rng| -> Option<usize> {
        if live.is_empty() {
            None
        } else {
            Some(*rng.pick(&live))
        }
    };
    match choice {
        // create (sometimes with data right away)
        0..=14 => {
            if live.len() >= 40 {
                return Ok(());
            }
            let dir = rng.below(DIRS.len() as u64) as usize;
            // Sometimes the name of a file unlinked (or renamed away) from that directory.
            let free: Vec<&MFile> = m
                .files
                .iter()
                .filter(|f| f.dir == dir && f.unlinked && !f.fixed)
                .filter(|f| {
                    !m.files
                        .iter()
                        .any(|g| !g.unlinked && g.dir == dir && g.name == f.name)
                })
                .collect();
            let reused =
                (!free.is_empty() && rng.chance(1, 4)).then(|| rng.pick(&free).name.clone());
            let name = match reused {
                Some(n) => {
                    m.reused_names += 1;
                    n
                }
                None => {
                    m.next_name += 1;
                    format!("f{:04}{}", m.next_name, "n".repeat(rng.below(30) as usize))
                        .into_bytes()
                }
            };
            let ino = fs.create(dirs[dir], &name, 0o644, OWNER)?;
            m.files.push(MFile {
                dir,
                name,
                ino,
                content: vec![Vec::new()],
                xattr: vec![None],
                name_durable: false,
                unlinked: false,
                unlink_durable: false,
                fixed: false,
                replaced_by: None,
            });
            if rng.chance(2, 3) {
                let i = m.files.len() - 1;
                let (_, len) = write_range(rng, 0);
                let data = rng.random_bytes(len);
                fs.write(ino, 0, &data)?;
                m.files[i].set(data);
            }
        }
        // write
        15..=39 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let f = &mut m.files[i];
            let (off, len) = write_range(rng, f.cur().len() as u64);
            let data = rng.random_bytes(len);
            fs.write(f.ino, off, &data)?;
            let mut c = f.cur().clone();
            let end = off as usize + len;
            if c.len() < end {
                c.resize(end, 0);
            }
            c[off as usize..end].copy_from_slice(&data);
            f.set(c);
        }
        // truncate down or up
        40..=46 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let f = &mut m.files[i];
            let size = f.cur().len() as u64;
            let to = if rng.chance(1, 2) {
                rng.below(size + 1)
            } else {
                (size + rng.range(1, 200_000)).min(MAX_FILE)
            };
            fs.truncate(f.ino, to)?;
            let mut c = f.cur().clone();
            c.resize(to as usize, 0);
            f.set(c);
        }
        // punch a hole
        47..=51 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let f = &mut m.files[i];
            let size = f.cur().len() as u64;
            if size == 0 {
                return Ok(());
            }
            let off = rng.below(size);
            let len = rng.range(1, (size - off).max(1) + 8192);
            fs.fallocate(f.ino, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off, len)?;
            let mut c = f.cur().clone();
            let end = (off + len).min(size) as usize;
            c[off as usize..end].fill(0);
            f.set(c);
        }
        // preallocate, growing the size or not
        52..=55 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let f = &mut m.files[i];
            let size = f.cur().len() as u64;
            let keep = rng.chance(1, 2);
            let len = rng.range(1, 256 << 10);
            let off = rng.below(size + 65536).min(MAX_FILE - len);
            fs.fallocate(f.ino, if keep { FALLOC_FL_KEEP_SIZE } else { 0 }, off, len)?;
            if !keep && off + len > size {
                let mut c = f.cur().clone();
                c.resize((off + len) as usize, 0);
                f.set(c);
            }
        }
        // set or remove the xattr
        56..=61 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let f = &mut m.files[i];
            let cur = f.xattr.last().cloned().flatten();
            if cur.is_some() && rng.chance(1, 3) {
                fs.removexattr(f.ino, XATTR)?;
                f.xattr.push(None);
            } else {
                let n = rng.range(0, 300) as usize;
                let v = rng.random_bytes(n);
                fs.setxattr(f.ino, XATTR, &v, 0)?;
                f.xattr.push(Some(v));
            }
        }
        // unlink
        62..=65 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let f = &mut m.files[i];
            fs.unlink(dirs[f.dir], &f.name)?;
            f.unlinked = true;
        }
        // rename to a new name, or over another file, in the same subvolume
        66..=68 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let from = m.files[i].dir;
            let in_sv = DIRS[from] == "sv";
            let victims: Vec<usize> = live
                .iter()
                .copied()
                .filter(|&j| j != i && (DIRS[m.files[j].dir] == "sv") == in_sv)
                .collect();
            let (to, name, replaced) = if !victims.is_empty() && rng.chance(1, 3) {
                let j = *rng.pick(&victims);
                (m.files[j].dir, m.files[j].name.clone(), Some(j))
            } else {
                let to = if in_sv { from } else { rng.below(3) as usize };
                m.next_name += 1;
                (to, format!("r{:04}", m.next_name).into_bytes(), None)
            };
            fs.rename(dirs[from], &m.files[i].name, dirs[to], &name, 0)?;
            let mut moved = m.files[i].clone();
            (moved.dir, moved.name, moved.name_durable) = (to, name, false);
            m.files[i].unlinked = true;
            if let Some(j) = replaced {
                // Its name is the moved file's now: its unlink is durable with that name.
                m.files[j].unlinked = true;
                m.files[j].replaced_by = Some(m.files[i].ino);
                m.renamed_over += 1;
            }
            m.files.push(moved);
        }
        // fsync or fdatasync of a file
        69..=89 => {
            let Some(i) = pick(rng) else { return Ok(()) };
            let datasync = rng.chance(1, 4);
            let f = &mut m.files[i];
            fs.fsync(f.ino, datasync)?;
            *fsyncs += 1;
            f.data_durable();
            if !datasync {
                f.meta_durable();
            }
            f.name_durable = true;
            // The names it had before a rename are gone for good, and so is a file it was
            // renamed over (the name is its own now).
            let (ino, dir, name) = (f.ino, f.dir, f.name.clone());
            for old in m.files.iter_mut().filter(|g| {
                g.unlinked && (g.ino == ino || (g.dir == dir && g.name == name && !g.fixed))
            }) {
                old.unlink_durable = true;
            }
        }
        // a new subdirectory tree, then an fsync of its parent: all of it is durable
        90..=91 => {
            let dir = rng.below(DIRS.len() as u64) as usize;
            m.next_name += 1;
            let top = format!("s{:04}", m.next_name);
            let first = m.files.len();
            let add = |m: &mut Model, path: String, content: Vec<Vec<u8>>| {
                m.files.push(MFile {
                    dir,
                    name: path.into_bytes(),
                    ino: dirs[dir],
                    content,
                    xattr: vec![None],
                    name_durable: false,
                    unlinked: false,
                    unlink_durable: false,
                    fixed: true,
                    replaced_by: None,
                });
            };
            let (_, len) = write_range(rng, 0);
            let z = rng.random_bytes(len);
            let wlen = rng.range(1, 3000) as usize;
            let w = rng.random_bytes(wlen);
            // Before the operations: a power cut in the middle may leave any part of it.
            add(m, top.clone(), vec![DIR_MARK.to_vec()]);
            add(m, format!("{top}/z"), vec![Vec::new(), z.clone()]);
            add(m, format!("{top}/deeper"), vec![DIR_MARK.to_vec()]);
            add(m, format!("{top}/deeper/w"), vec![Vec::new(), w.clone()]);
            add(m, format!("{top}/deeper/empty"), vec![DIR_MARK.to_vec()]);
            let sub = fs.mkdir(dirs[dir], top.as_bytes(), 0o755, OWNER)?;
            let zi = fs.create(sub, b"z", 0o644, OWNER)?;
            fs.write(zi, 0, &z)?;
            let deeper = fs.mkdir(sub, b"deeper", 0o700, OWNER)?;
            let wi = fs.create(deeper, b"w", 0o600, OWNER)?;
            fs.write(wi, 0, &w)?;
            fs.mkdir(deeper, b"empty", 0o755, OWNER)?;
            fs.fsync(dirs[dir], false)?;
            *fsyncs += 1;
            for f in &mut m.files[first..] {
                f.data_durable();
                f.name_durable = true;
            }
        }
        // fsync of a directory: its names (new ones and removed ones) are durable
        92..=96 => {
            let dir = rng.below(DIRS.len() as u64) as usize;
            fs.fsync(dirs[dir], false)?;
            *fsyncs += 1;
            for f in m.files.iter_mut().filter(|f| f.dir == dir) {
                if f.unlinked {
                    f.unlink_durable = true;
                } else {
                    f.name_durable = true;
                }
            }
        }
        // commit
        _ => {
            fs.commit()?;
            m.commit();
        }
    }
    Ok(())
}

/// What a file looks like in a view: content and the [`XATTR`] value.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Seen {
    content: Vec<u8>,
    xattr: Option<Vec<u8>>,
}

/// The files a view shows in the workload's directories: (dir, name) -> file.
type View = BTreeMap<(usize, Vec<u8>), Seen>;

fn butter_view(fs: &Fs) -> Result<View, Error> {
    let mut v = View::new();
    for (d, dir) in dir_inodes(fs)?.into_iter().enumerate() {
        butter_view_dir(fs, d, dir, Vec::new(), &mut v)?;
    }
    Ok(v)
}

/// The entries below `dir` into `v`, their names after `prefix` (subdirectories as
/// [`DIR_MARK`] and their entries as paths).
fn butter_view_dir(
    fs: &Fs,
    d: usize,
    dir: Inode,
    prefix: Vec<u8>,
    v: &mut View,
) -> Result<(), Error> {
    for e in &fs.readdir(dir, 0, 0)? {
        let name = [prefix.as_slice(), &e.name].concat();
        let st = fs.stat(e.target)?;
        if st.mode & 0o170000 == 0o040000 {
            v.insert(
                (d, name.clone()),
                Seen {
                    content: DIR_MARK.to_vec(),
                    xattr: None,
                },
            );
            butter_view_dir(fs, d, e.target, [name.as_slice(), b"/"].concat(), v)?;
            continue;
        }
        let content = fs.read(e.target, 0, st.size as usize)?;
        let xattr = fs.getxattr(e.target, XATTR)?;
        v.insert((d, name), Seen { content, xattr });
    }
    Ok(())
}

fn get_xattr(p: &Path, name: &[u8]) -> Option<Vec<u8>> {
    let cp = CString::new(p.as_os_str().as_bytes()).expect("path");
    let cn = CString::new(name).expect("name");
    let mut buf = vec![0u8; 65536];
    // SAFETY: valid C strings and a buffer of the given length.
    let r = unsafe { libc::getxattr(cp.as_ptr(), cn.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        assert_eq!(
            e.raw_os_error(),
            Some(libc::ENODATA),
            "getxattr {}: {e}",
            p.display()
        );
        return None;
    }
    buf.truncate(r as usize);
    Some(buf)
}

fn kernel_view(mnt: &Path) -> View {
    let mut v = View::new();
    for (d, dir) in DIRS.iter().enumerate() {
        kernel_view_dir(&mnt.join(dir), d, Vec::new(), &mut v);
    }
    v
}

/// [`butter_view_dir`] through the kernel's mount.
fn kernel_view_dir(path: &Path, d: usize, prefix: Vec<u8>, v: &mut View) {
    let rd =
        fs::read_dir(path).unwrap_or_else(|e| panic!("kernel readdir {}: {e}", path.display()));
    for e in rd {
        let e = e.expect("readdir entry");
        let p = e.path();
        let name = [prefix.as_slice(), e.file_name().as_bytes()].concat();
        if e.file_type().expect("file type").is_dir() {
            v.insert(
                (d, name.clone()),
                Seen {
                    content: DIR_MARK.to_vec(),
                    xattr: None,
                },
            );
            kernel_view_dir(&p, d, [name.as_slice(), b"/"].concat(), v);
            continue;
        }
        let content = fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
        let xattr = get_xattr(&p, XATTR);
        v.insert((d, name), Seen { content, xattr });
    }
}

fn show(m: &MFile) -> String {
    format!(
        "{}/{} (inode {})",
        DIRS[m.dir],
        String::from_utf8_lossy(&m.name),
        m.ino.ino
    )
}

fn describe(c: &[u8]) -> String {
    let nz = c.iter().filter(|&&b| b != 0).count();
    format!("{} bytes ({nz} nonzero)", c.len())
}

/// The model's rules on one view; the problems found. A name may have several files of the
/// model: the file that has it now and files that had it before (unlinked, or renamed over),
/// which a view may still show until their removal is durable.
fn check_model(m: &Model, v: &View) -> Vec<String> {
    let mut problems = Vec::new();
    let mut names: BTreeMap<(usize, Vec<u8>), Vec<&MFile>> = BTreeMap::new();
    for f in &m.files {
        names.entry((f.dir, f.name.clone())).or_default().push(f);
    }
    for (key, files) in &names {
        let cur = files.iter().find(|f| !f.unlinked);
        // Files the name may still show: its current one, earlier ones whose removal is not
        // durable.
        let allowed: Vec<&MFile> = files
            .iter()
            .copied()
            .filter(|f| !f.unlinked || !f.unlink_durable)
            .collect();
        match v.get(key) {
            None => {
                if let Some(f) = cur.filter(|f| f.name_durable) {
                    problems.push(format!(
                        "{}: its name was made durable, but it is missing",
                        show(f)
                    ));
                } else if let Some(f) = cur.and_then(|c| {
                    files.iter().find(|g| {
                        g.replaced_by == Some(c.ino) && g.name_durable && !g.unlink_durable
                    })
                }) {
                    // Renamed over, neither side durable: one of them must be there.
                    problems.push(format!(
                        "{}: renamed over, but neither it nor the file that took its name is \
                         there",
                        show(f)
                    ));
                }
            }
            Some(_) if allowed.is_empty() => {
                problems.push(format!(
                    "{}: its unlink was made durable, but it exists",
                    show(files[files.len() - 1])
                ));
            }
            Some(s) => {
                let fits = |f: &MFile| f.content.contains(&s.content) && f.xattr.contains(&s.xattr);
                if !allowed.iter().any(|f| fits(f)) {
                    for f in &allowed {
                        if !f.content.contains(&s.content) {
                            problems.push(format!(
                                "{}: content {} is none of the {} allowed since its last \
                                 fsync: {}",
                                show(f),
                                describe(&s.content),
                                f.content.len(),
                                f.content
                                    .iter()
                                    .map(|c| describe(c))
                                    .collect::<Vec<_>>()
                                    .join(", ")
                            ));
                        } else {
                            problems.push(format!(
                                "{}: xattr {:?} is none of the {} allowed since its last fsync",
                                show(f),
                                s.xattr.as_ref().map(|x| x.len()),
                                f.xattr.len()
                            ));
                        }
                    }
                }
            }
        }
    }
    for (d, name) in v.keys() {
        if !names.contains_key(&(*d, name.clone())) {
            problems.push(format!(
                "{}/{}: exists, but the workload never made it",
                DIRS[*d],
                String::from_utf8_lossy(name)
            ));
        }
    }
    problems
}

fn write_image(img: &[u8], path: &Path) {
    let f = fs::File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    f.set_len(img.len() as u64).expect("size the image file");
    for (i, c) in img.chunks(64 << 10).enumerate() {
        if c.iter().any(|&b| b != 0) {
            f.write_all_at(c, (i as u64) << 16)
                .expect("write the image file");
        }
    }
}

#[derive(Default)]
struct Stats {
    cuts: u64,
    completed: u64,
    with_log: u64,
    kernel: u64,
    torn_writes: u64,
    /// Pending ordered extents the dry runs' fsyncs logged before their completion.
    ordered_logged: u64,
    /// Delayed-allocation buffers the dry runs wrote back.
    delalloc: u64,
    /// The dry runs' renames over another file, and their fsyncs that committed instead of
    /// logging.
    renamed_over: u64,
    reused_names: u64,
    fallbacks: u64,
}

/// One round; panics with `what` (seed and round) on any problem.
/// The write engine's options of a round: compression forced for the compressed loop.
fn rw_options(compress: bool) -> butter::fs::RwOptions {
    butter::fs::RwOptions {
        compress: compress
            .then(|| {
                butter::format::compress::Compression::parse("zstd:1")
                    .ok()
                    .flatten()
            })
            .flatten(),
        compress_force: compress,
        ..Default::default()
    }
}

fn round(
    base: &Base,
    scratch: &ScratchDir,
    seed: u64,
    r: u64,
    (torn, compress): (bool, bool),
    st: &mut Stats,
) {
    let what = format!("BUTTER_FSYNC_CRASH_SEED={seed} BUTTER_FSYNC_CRASH_ROUND={r}");
    let mut rng = Rng::new(seed).fork(r);
    let wseed = rng.next_u64();
    let max_ops = rng.range(20, 160) as usize;
    // Dry run: how many writes the workload issues.
    let total = {
        let dev = Arc::new(RamDevice::new(base.bytes.clone()));
        let fs = Fs::open_device_rw_with(dev.clone(), rw_options(compress))
            .unwrap_or_else(|e| panic!("{what}: dry run: open: {e}"));
        let start = dev.write_count();
        let end = workload(&fs, &base.model, wseed, max_ops);
        if let Some(e) = end.error {
            panic!("{what}: dry run (no power cut) failed: {e}");
        }
        let stats = fs.stats().unwrap_or_default();
        st.ordered_logged += stats.log.ordered_logged;
        st.delalloc += stats.ordered.delalloc_flushed;
        st.renamed_over += end.model.renamed_over;
        st.reused_names += end.model.reused_names;
        st.fallbacks += stats.log.fallbacks;
        drop(fs);
        dev.write_count() - start
    };
    // The real run, with the power cut.
    let cut = rng.below(total + 1);
    let dev = Arc::new(RamDevice::new(base.bytes.clone()));
    let fs = Fs::open_device_rw_with(dev.clone(), rw_options(compress))
        .unwrap_or_else(|e| panic!("{what}: open: {e}"));
    dev.set_faults(Faults {
        fail_write_at: Some(dev.write_count() + cut),
        power_cut: true,
        ..Faults::default()
    });
    let end = workload(&fs, &base.model, wseed, max_ops);
    drop(fs);
    match &end.error {
        Some(e) => {
            assert!(
                dev.power_lost(),
                "{what}: the workload failed before the power cut: {e}"
            );
            st.cuts += 1;
        }
        None => st.completed += 1,
    }
    let mut img = dev.durable_bytes();
    let mut applied = 0;
    if torn {
        let pending = dev.unflushed_writes();
        applied = rng.below(pending.len() as u64 + 1) as usize;
        for (off, data) in &pending[..applied] {
            let o = *off as usize;
            img[o..o + data.len()].copy_from_slice(data);
        }
        st.torn_writes += applied as u64;
    }
    drop(dev);
    let log_root = log_root_of_bytes(&img);
    if log_root != 0 {
        st.with_log += 1;
    }
    eprintln!(
        "{what}: {} of {max_ops} ops, {} fsyncs, cut at write {cut} of {total}{}, log_root {log_root}{}",
        end.ops,
        end.fsyncs,
        if end.error.is_some() { "" } else { " (not reached)" },
        if torn {
            format!(", {applied} unflushed writes kept")
        } else {
            String::new()
        }
    );
    let path = scratch.join("crash.img");
    write_image(&img, &path);
    let kernel = r % KERNEL_EVERY == KERNEL_EVERY - 1;
    let kpath = scratch.join("kernel.img");
    if kernel {
        write_image(&img, &kpath);
    }
    drop(img);

    // butter's recovery.
    let bview = {
        let fs = Fs::open_rw(&path).unwrap_or_else(|e| panic!("{what}: butter open_rw: {e}"));
        butter_view(&fs).unwrap_or_else(|e| panic!("{what}: reading butter's replay: {e}"))
    };
    assert_eq!(log_root_of(&path), 0, "{what}: butter left log_root set");
    let problems = check_model(&end.model, &bview);
    assert!(
        problems.is_empty(),
        "{what}: after butter's recovery:\n{}",
        problems.join("\n")
    );
    assert_butter_check_lib(&path, &format!("{what}: after butter's recovery"));
    assert_btrfs_check(&path, &format!("{what}: after butter's recovery"));

    // The kernel's recovery of the same crash image.
    if kernel {
        st.kernel += 1;
        // The two tests run at once on images with one fsid: the kernel refuses a second
        // device with an fsid it has mounted (EEXIST), so one kernel mount at a time.
        let kview = {
            let _one = KERNEL_MOUNT.lock().unwrap_or_else(|e| e.into_inner());
            let m = LoopMount::btrfs(&kpath, &scratch.dir("kmnt"), "noatime");
            let v = kernel_view(m.path());
            m.unmount();
            v
        };
        let problems = check_model(&end.model, &kview);
        assert!(
            problems.is_empty(),
            "{what}: after the kernel's recovery:\n{}",
            problems.join("\n")
        );
        let mut diff = Vec::new();
        for k in bview.keys().chain(kview.keys()).collect::<BTreeSet<_>>() {
            let (b, kk) = (bview.get(k), kview.get(k));
            if b != kk {
                diff.push(format!(
                    "{}/{}: butter {:?}, kernel {:?}",
                    DIRS[k.0],
                    String::from_utf8_lossy(&k.1),
                    b.map(|s| (describe(&s.content), s.xattr.as_ref().map(|x| x.len()))),
                    kk.map(|s| (describe(&s.content), s.xattr.as_ref().map(|x| x.len())))
                ));
            }
        }
        assert!(
            diff.is_empty(),
            "{what}: butter's and the kernel's recovery differ:\n{}",
            diff.join("\n")
        );
        assert_btrfs_check(&kpath, &format!("{what}: after the kernel's recovery"));
    }
}

fn crash_loop(name: &str, torn: bool, seed_mix: u64, compress: bool) {
    require_or_fail(name, false);
    let rounds: u64 = std::env::var("BUTTER_FSYNC_CRASH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_ROUNDS);
    let seed: u64 = std::env::var("BUTTER_FSYNC_CRASH_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(1)
                ^ seed_mix
        });
    let only: Option<u64> = std::env::var("BUTTER_FSYNC_CRASH_ROUND")
        .ok()
        .and_then(|v| v.parse().ok());
    eprintln!("{name}: {rounds} rounds, BUTTER_FSYNC_CRASH_SEED={seed}");
    let scratch = ScratchDir::new(name);
    let t = Instant::now();
    // The plain loop runs on a block-group-tree image, the torn one on block group items in
    // the extent tree: both layouts meet power cuts.
    let base = make_base(!torn);
    let mut st = Stats::default();
    for r in 0..rounds {
        if only.is_some_and(|o| o != r) {
            continue;
        }
        round(&base, &scratch, seed, r, (torn, compress), &mut st);
    }
    eprintln!(
        "{name}: {rounds} rounds in {:.1} s: {} power cuts, {} ran to the end, {} crash images \
         with an fsync log, {} kernel replays, {} unflushed writes kept; the dry runs' fsyncs \
         logged {} ordered extents before their completion; {} delayed allocations written back; \
         {} renames over a file; {} files created with an unlinked file's name; {} fsyncs \
         committed instead of logging",
        t.elapsed().as_secs_f64(),
        st.cuts,
        st.completed,
        st.with_log,
        st.kernel,
        st.torn_writes,
        st.ordered_logged,
        st.delalloc,
        st.renamed_over,
        st.reused_names,
        st.fallbacks
    );
    if only.is_none() && rounds >= 10 && !compress {
        // The workload's writes leave pending ordered extents that its fsyncs log.
        assert!(
            st.ordered_logged > 0,
            "{name}: no fsync logged a pending ordered extent"
        );
        // Its aligned appends gather in delayed-allocation buffers.
        assert!(
            st.delalloc > 0,
            "{name}: no delayed allocation was written back"
        );
        assert!(st.renamed_over > 0, "{name}: no rename over a file");
        assert!(st.reused_names > 0, "{name}: no name reused");
    }
}

#[test]
fn power_cut_keeps_fsynced_data() {
    crash_loop("fsync-crash", false, 0, false);
}

/// The same with every write compressed (zstd, forced): compressed extents and compressed
/// inline extents meet the power cuts (an fsync of a file with compressed writes commits).
#[test]
fn power_cut_keeps_fsynced_compressed_data() {
    crash_loop("fsync-crash-zstd", false, 0x7a73_7464, true);
}

/// The same with a random prefix of the unflushed writes on the device.
#[test]
fn power_cut_with_torn_unflushed_writes() {
    crash_loop("fsync-crash-torn", true, 0x0072_726e, false);
}
