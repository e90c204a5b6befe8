//! Helpers shared by the crash-consistency and ENOSPC tests: fresh images made with butter's
//! mkfs, a manifest of what the filesystem shows through the read API, a write-tracing device,
//! a cheap copy-on-write image view, and `btrfs check` on an image file.
//!
//! One file, two users: the integration tests here declare it as their own `mod crash_support`,
//! and the white-box suites (`src/tests/crash.rs`, `engine_rules.rs`) build it into the library's unit-test
//! binary (`src/tests/mod.rs` names it by path). So it uses only `butter::` paths.

#![allow(dead_code)]

use butter::fs::{Fs, Inode};
use butter::inode::namespace::Owner;
use butter::internals::RamDevice;
use butter::io::device::BlockDevice;
use butter::mkfs::{mkfs, MkfsOptions, Profile};
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub const MIB: u64 = 1 << 20;

/// Where test images go (`/tmp/crashtest` unless `BUTTER_CRASH_TMP` says otherwise).
pub fn tmp_dir() -> PathBuf {
    let d = std::env::var_os("BUTTER_CRASH_TMP")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("crashtest"));
    std::fs::create_dir_all(&d).expect("creating the test image directory");
    d
}

/// A fresh filesystem of `size` bytes in memory (fixed fsid and time: reproducible).
pub fn fresh_image(size: u64, metadata: Profile, data: Profile) -> Vec<u8> {
    fixed_time();
    let dev = RamDevice::new(vec![0u8; size as usize]);
    let opts = MkfsOptions {
        size,
        metadata,
        data,
        fsid: Some(*b"butter-crashtest"),
        time: Some(1_700_000_000),
        ..MkfsOptions::default()
    };
    mkfs(&dev, &opts).expect("mkfs");
    dev.live_bytes()
}

/// Inode times from a fixed clock, so that replaying a run gives the same bytes.
pub fn fixed_time() {
    if std::env::var_os("BUTTER_FIXED_TIME").is_none() {
        std::env::set_var("BUTTER_FIXED_TIME", "1700000000");
    }
}

/// A small xorshift generator for reproducible "random" choices in tests.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Deterministic content: `len` bytes from `seed`.
pub fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(&x.to_le_bytes());
    }
    out.truncate(len);
    out
}

pub const OWNER: Owner = Owner { uid: 0, gid: 0 };

fn hash_bytes(b: &[u8]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    b.hash(&mut h);
    h.finish()
}

/// What one path shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub mode: u32,
    pub nlink: u32,
    pub size: u64,
    /// Hash of the content (files), of the target (symlinks); 0 for directories.
    pub hash: u64,
    /// Hash of the sorted (name, value) xattr list.
    pub xattrs: u64,
}

/// Every path below the root with what it shows.
pub type Manifest = BTreeMap<String, Entry>;

/// Walks the whole namespace through the read API. Errors are returned as text (a crashed
/// image must not make the test panic somewhere unhelpful).
pub fn manifest(fs: &Fs) -> Result<Manifest, String> {
    let mut m = Manifest::new();
    walk(fs, fs.root_inode(), "", &mut m)?;
    Ok(m)
}

fn walk(fs: &Fs, dir: Inode, prefix: &str, m: &mut Manifest) -> Result<(), String> {
    let mut after = 0u64;
    loop {
        let ents = fs
            .readdir(dir, after, 512)
            .map_err(|e| format!("readdir {prefix}/: {e}"))?;
        if ents.is_empty() {
            return Ok(());
        }
        for e in ents {
            after = e.index;
            let path = format!("{prefix}/{}", String::from_utf8_lossy(&e.name));
            let st = fs
                .stat(e.target)
                .map_err(|er| format!("stat {path}: {er}"))?;
            let hash = if st.is_reg() {
                let data = fs
                    .read(e.target, 0, st.size as usize)
                    .map_err(|er| format!("read {path}: {er}"))?;
                if data.len() as u64 != st.size {
                    return Err(format!("{path}: read {} of {} bytes", data.len(), st.size));
                }
                hash_bytes(&data)
            } else if st.is_symlink() {
                hash_bytes(
                    &fs.readlink(e.target)
                        .map_err(|er| format!("readlink {path}: {er}"))?,
                )
            } else {
                0
            };
            let mut xa = fs
                .xattrs(e.target)
                .map_err(|er| format!("xattrs {path}: {er}"))?;
            xa.sort();
            let mut h = std::collections::hash_map::DefaultHasher::new();
            xa.hash(&mut h);
            m.insert(
                path.clone(),
                Entry {
                    mode: st.mode,
                    nlink: st.nlink,
                    size: if st.is_dir() { 0 } else { st.size },
                    hash,
                    xattrs: h.finish(),
                },
            );
            if st.is_dir() {
                walk(fs, e.target, &path, m)?;
            }
        }
    }
}

/// Differences between two manifests, for failure messages (at most a few lines).
pub fn diff(a: &Manifest, b: &Manifest) -> String {
    let mut out = Vec::new();
    for (p, e) in a {
        match b.get(p) {
            None => out.push(format!("only in first: {p}")),
            Some(f) if f != e => out.push(format!("differs: {p}: {e:?} vs {f:?}")),
            _ => {}
        }
    }
    for p in b.keys() {
        if !a.contains_key(p) {
            out.push(format!("only in second: {p}"));
        }
    }
    let n = out.len();
    out.truncate(8);
    format!("{n} differences: {}", out.join("; "))
}

/// Runs butter's checker; the findings as text when not clean.
pub fn butter_check(fs: &Fs) -> Result<(), String> {
    let r = fs
        .check(Default::default(), &mut |_| {})
        .map_err(|e| format!("check failed: {e}"))?;
    if r.is_clean() {
        Ok(())
    } else {
        let f: Vec<String> = r
            .findings
            .iter()
            .take(10)
            .map(|f| format!("{f:?}"))
            .collect();
        Err(format!("{} findings: {}", r.findings.len(), f.join("\n  ")))
    }
}

/// Writes an image to a file, sparsely (zero 64 KiB runs are holes).
pub fn write_image(img: &[u8], path: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::create(path).expect("creating image file");
    f.set_len(img.len() as u64).expect("sizing image file");
    for (i, c) in img.chunks(64 << 10).enumerate() {
        if c.iter().any(|&b| b != 0) {
            f.write_all_at(c, (i as u64) << 16)
                .expect("writing image file");
        }
    }
}

/// Whether `btrfs` (btrfs-progs) is installed.
pub fn have_btrfs_progs() -> bool {
    std::process::Command::new("btrfs")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

/// `btrfs check --readonly` on an image (written to a file named `name`); output on failure.
pub fn btrfs_check(img: &[u8], name: &str) -> Result<(), String> {
    let path = tmp_dir().join(format!("{name}.img"));
    write_image(img, &path);
    let out = std::process::Command::new("btrfs")
        .args(["check", "--readonly"])
        .arg(&path)
        .output()
        .map_err(|e| format!("running btrfs check: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        let _ = std::fs::remove_file(&path);
        Ok(())
    } else {
        Err(format!(
            "btrfs check {} failed ({}):\n{text}",
            path.display(),
            out.status
        ))
    }
}

/// One device operation seen by [`TraceDevice`].
#[derive(Debug, Clone)]
pub enum Op {
    Write { offset: u64, data: Vec<u8> },
    Flush,
}

/// Passes everything to an inner device and records the writes and flushes that succeeded.
pub struct TraceDevice {
    pub inner: Arc<dyn BlockDevice>,
    pub ops: Mutex<Vec<Op>>,
}

impl TraceDevice {
    pub fn new(inner: Arc<dyn BlockDevice>) -> TraceDevice {
        TraceDevice {
            inner,
            ops: Mutex::new(Vec::new()),
        }
    }
    pub fn take(&self) -> Vec<Op> {
        std::mem::take(&mut *self.ops.lock().unwrap())
    }
}

impl BlockDevice for TraceDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.inner.write_at(buf, offset)?;
        self.ops.lock().unwrap().push(Op::Write {
            offset,
            data: buf.to_vec(),
        });
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        self.inner.flush()?;
        self.ops.lock().unwrap().push(Op::Flush);
        Ok(())
    }
    fn len(&self) -> u64 {
        self.inner.len()
    }
}

const PAGE: u64 = 4096;

/// A shared base image plus private 4 KiB pages: opening many variants of one image costs
/// only the pages that differ.
pub struct OverlayDevice {
    base: Arc<Vec<u8>>,
    pages: Arc<Mutex<HashMap<u64, Vec<u8>>>>,
}

impl OverlayDevice {
    pub fn new(base: Arc<Vec<u8>>, pages: HashMap<u64, Vec<u8>>) -> OverlayDevice {
        OverlayDevice {
            base,
            pages: Arc::new(Mutex::new(pages)),
        }
    }
    /// The private pages, shared: take them back with `std::mem::take` when done (an `Fs`
    /// may keep the device alive a little longer).
    pub fn pages(&self) -> Arc<Mutex<HashMap<u64, Vec<u8>>>> {
        self.pages.clone()
    }
    /// The whole image.
    pub fn bytes(&self) -> Vec<u8> {
        let mut img = (*self.base).clone();
        for (p, d) in self.pages.lock().unwrap().iter() {
            let o = (*p * PAGE) as usize;
            img[o..o + PAGE as usize].copy_from_slice(d);
        }
        img
    }
}

/// Applies a write to a page map over `base`.
pub fn apply_write(base: &[u8], pages: &mut HashMap<u64, Vec<u8>>, offset: u64, data: &[u8]) {
    let mut done = 0usize;
    while done < data.len() {
        let pos = offset + done as u64;
        let p = pos / PAGE;
        let in_page = (pos % PAGE) as usize;
        let n = (PAGE as usize - in_page).min(data.len() - done);
        let page = pages.entry(p).or_insert_with(|| {
            let o = (p * PAGE) as usize;
            base[o..o + PAGE as usize].to_vec()
        });
        page[in_page..in_page + n].copy_from_slice(&data[done..done + n]);
        done += n;
    }
}

impl BlockDevice for OverlayDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let end = offset
            .checked_add(buf.len() as u64)
            .filter(|&e| e <= self.base.len() as u64)
            .ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read past end"))?;
        let pages = self.pages.lock().unwrap();
        let mut pos = offset;
        while pos < end {
            let p = pos / PAGE;
            let in_page = (pos % PAGE) as usize;
            let n = ((PAGE as usize - in_page) as u64).min(end - pos) as usize;
            let dst = &mut buf[(pos - offset) as usize..(pos - offset) as usize + n];
            match pages.get(&p) {
                Some(d) => dst.copy_from_slice(&d[in_page..in_page + n]),
                None => dst.copy_from_slice(&self.base[pos as usize..pos as usize + n]),
            }
            pos += n as u64;
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|e| e > self.base.len() as u64)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "write past end",
            ));
        }
        apply_write(&self.base, &mut self.pages.lock().unwrap(), offset, buf);
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        Ok(())
    }
    fn len(&self) -> u64 {
        self.base.len() as u64
    }
}

/// Opens an image read-only and read-write, and checks both show `want` and that the checker
/// is clean. `what` names the case in messages.
pub fn verify_image(
    dev: Arc<dyn BlockDevice>,
    want: &[(&str, &Manifest)],
    what: &str,
) -> Result<String, String> {
    let fs = Fs::open_device(dev.clone()).map_err(|e| format!("{what}: open read-only: {e}"))?;
    let m = manifest(&fs).map_err(|e| format!("{what}: read-only: {e}"))?;
    let Some((name, _)) = want.iter().find(|(_, w)| **w == m) else {
        let d: Vec<String> = want
            .iter()
            .map(|(n, w)| format!("vs {n}: {}", diff(w, &m)))
            .collect();
        return Err(format!(
            "{what}: shows neither expected state: {}",
            d.join(" | ")
        ));
    };
    butter_check(&fs).map_err(|e| format!("{what} (state {name}): butter check: {e}"))?;
    drop(fs);
    let fs = Fs::open_device_rw(dev).map_err(|e| format!("{what}: open read-write: {e}"))?;
    let m2 = manifest(&fs).map_err(|e| format!("{what}: read-write: {e}"))?;
    if m2 != m {
        return Err(format!(
            "{what}: read-write open shows another state: {}",
            diff(&m, &m2)
        ));
    }
    Ok(name.to_string())
}

/// Data and metadata profiles of the small images.
pub fn single() -> Profile {
    Profile::Single
}
