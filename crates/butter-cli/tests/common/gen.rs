//! A seeded, deterministic tree generator for a kernel-mounted btrfs filesystem.
//!
//! [`populate`] fills a mounted btrfs filesystem with the cases a btrfs reader has to get right.
//! The same seed and scale give the same tree: the same paths, contents, modes, owners, xattrs,
//! link structure, and atime/mtime (every path gets explicit times at the end). Only ctime,
//! birth time and inode generation numbers differ between two runs (and inode numbers could
//! if the kernel allocated differently; in practice they match too).
//!
//! What it makes (paths relative to the mount point; counts for `Scale::Small` / `Scale::Full`):
//!
//! - `empty_file`, `empty_dir/`.
//! - `tree/`: nested directories (depth 3 / 5, fan-out 1–3) with small files.
//! - `big_dir/`: one directory with 3000 / 20000 entries (mostly empty files, some with data,
//!   some subdirectories), names of varied length.
//! - `inline/`: tiny files (1 byte up to 2048, plus 2049 and 4095) that the kernel stores as
//!   inline extents (and the ones just past the inline limit that it does not).
//! - `regular/`: files of sizes around block boundaries and some > 1 MiB (up to 3 MiB / 48 MiB),
//!   random and text content.
//! - `sparse/`: holes at the start, middle and end, a file that is all hole, many small holes,
//!   data at unaligned offsets, an inline file later extended by truncate.
//! - `prealloc/`: fallocate with and without KEEP_SIZE, fully unwritten, partly written,
//!   preallocated beyond EOF.
//! - `compressed/{zlib,lzo,zstd}/`: written while the mount had `compress-force=<alg>`:
//!   compressible text (small = inline compressed, large = several compressed extents),
//!   incompressible random data, mixed data, a sparse compressed file; `compressed/mixed_algos`
//!   has one extent range per algorithm; in the zstd phase a 4 KiB block in the middle of
//!   `compressed/zlib/text_large` is overwritten (a compressed extent referenced in two parts).
//!   Compression is left off (`compress=no`) afterwards.
//! - `links/`: `target` with 320 / 400 hard links of 200–250-char names in `links/many/` (more
//!   than an INODE_REF item can hold in a 64 KiB leaf, so INODE_EXTREF items appear), and a
//!   hard-link group spread over several directories.
//! - `symlinks/`: short, relative, absolute, to a directory, dangling, a chain, ~1000 and 2047
//!   chars long.
//! - `special/`: a fifo, a unix socket, char and block devices (including large major/minor).
//! - `xattrs/`: user.* xattrs with small, empty, binary and ~3 KiB values, several per file, on
//!   files and directories; trusted.* xattrs on a symlink (user.* is not allowed on symlinks).
//! - `names/`: names with spaces, UTF-8, non-UTF-8 bytes, leading dash/dot, 255 bytes.
//! - `perms/`: every interesting mode (setuid, setgid, sticky, 000, ...) on files and dirs,
//!   with varied owners (including uid/gid above 2^31).
//! - `times/`: a time before 1970, one in 2100, the epoch, nanoseconds 999999999.
//! - `subvol/`: a subvolume with files, a tree, hard links, a symlink, xattrs, a sparse file;
//!   `snap/`: a read-only snapshot of it; after the snapshot, `subvol/` is changed (files
//!   overwritten in part, appended, truncated, deleted, renamed, added, a mode changed), so the
//!   two share some extents and tree blocks and differ in others.
//! - Everywhere (except the read-only snapshot, which keeps what `subvol/` had): a random part
//!   of the paths get other owners and modes, then every path gets explicit atime/mtime with
//!   nanoseconds.
//!
//! It ends with `sync`. It remounts with `noatime` first (reading the tree must not change
//! atimes) and uses `mount -o remount,compress-force=...`, so `mnt` must be the mount point of a
//! kernel btrfs mount. It sets the process umask to 022.

use super::kernel::{remount, sh, sync_all};
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// Path of the subvolume, relative to the mount point.
pub const SUBVOL: &str = "subvol";
/// Path of the read-only snapshot of [`SUBVOL`] (taken before `subvol` was changed).
pub const SNAPSHOT: &str = "snap";
/// Directory with one inode hard-linked under hundreds of long names.
pub const MANY_LINKS_DIR: &str = "links/many";
/// The directory with thousands of entries.
pub const BIG_DIR: &str = "big_dir";

/// How big a tree to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// Quick (a few seconds per image): 3000-entry directory, files up to 3 MiB.
    Small,
    /// Thorough: 20000-entry directory, files up to 48 MiB.
    Full,
}

impl Scale {
    /// From `BUTTER_ORACLE_SCALE` (`small` or `full`); `Small` when unset. Panics on other
    /// values so a typo does not silently run the small suite.
    pub fn from_env() -> Scale {
        match std::env::var("BUTTER_ORACLE_SCALE") {
            Err(_) => Scale::Small,
            Ok(v) => match v.to_ascii_lowercase().as_str() {
                "" | "small" => Scale::Small,
                "full" => Scale::Full,
                other => panic!("BUTTER_ORACLE_SCALE={other:?}: expected `small` or `full`"),
            },
        }
    }

    fn params(self) -> Params {
        match self {
            Scale::Small => Params {
                tree_depth: 3,
                big_dir_entries: 3000,
                inline_files: 30,
                many_links: 320,
                big_sizes: &[1 << 20 | 1, 3 << 19, 3 * (1 << 20) + 77],
            },
            Scale::Full => Params {
                tree_depth: 5,
                big_dir_entries: 20000,
                inline_files: 200,
                many_links: 400,
                big_sizes: &[
                    1 << 20 | 1,
                    3 << 19,
                    3 * (1 << 20) + 77,
                    16 << 20,
                    48 * (1 << 20) + 4095,
                ],
            },
        }
    }
}

struct Params {
    tree_depth: u32,
    big_dir_entries: u32,
    inline_files: u32,
    many_links: u32,
    big_sizes: &'static [u64],
}

// ---------------------------------------------------------------------------------------------
// PRNG

/// SplitMix64: small, fast, and good enough to make varied test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform-ish in `0..n` (0 when n is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }

    /// In `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `num/den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    /// An independent stream for one part of the tree, so that changing one part does not
    /// shift the random numbers of the others.
    pub fn fork(&self, tag: u64) -> Rng {
        let mut r = Rng(self.0 ^ tag.wrapping_mul(0xD6E8_FEB8_6659_FD93));
        r.next_u64();
        r
    }

    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    /// `n` incompressible bytes.
    pub fn random_bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        self.fill(&mut v);
        v
    }

    /// Between `lo` and `hi` (inclusive) incompressible bytes.
    pub fn random_bytes_between(&mut self, lo: usize, hi: usize) -> Vec<u8> {
        let n = self.range(lo as u64, hi as u64) as usize;
        self.random_bytes(n)
    }

    /// `n` bytes of compressible text.
    pub fn text_bytes(&mut self, n: usize) -> Vec<u8> {
        const WORDS: &[&str] = &[
            "btrfs",
            "extent",
            "inode",
            "subvolume",
            "snapshot",
            "checksum",
            "leaf",
            "node",
            "chunk",
            "stripe",
            "device",
            "the",
            "a",
            "of",
            "and",
            "to",
            "in",
            "is",
            "tree",
            "root",
            "item",
            "key",
            "offset",
            "generation",
            "transaction",
            "block",
            "group",
            "free",
            "space",
            "data",
            "metadata",
            "system",
            "compress",
            "zlib",
            "lzo",
            "zstd",
        ];
        let mut v = Vec::with_capacity(n + 16);
        let mut col = 0;
        while v.len() < n {
            let w = self.pick(WORDS);
            v.extend_from_slice(w.as_bytes());
            col += w.len() + 1;
            if col > 70 {
                v.push(b'\n');
                col = 0;
            } else {
                v.push(b' ');
            }
        }
        v.truncate(n);
        v
    }

    /// `n` bytes alternating between text and random runs of 1–32 KiB.
    pub fn mixed_bytes(&mut self, n: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let run = (self.range(1024, 32 * 1024) as usize).min(n - v.len());
            if self.chance(1, 2) {
                v.extend(self.text_bytes(run));
            } else {
                v.extend(self.random_bytes(run));
            }
        }
        v
    }

    /// A name of `lo..=hi` bytes from a safe alphabet.
    pub fn name_between(&mut self, lo: usize, hi: usize) -> String {
        let n = self.range(lo as u64, hi as u64) as usize;
        self.name(n)
    }

    /// A file name of `len` bytes from a safe alphabet.
    pub fn name(&mut self, len: usize) -> String {
        const ALPHA: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.";
        (0..len)
            .map(|i| {
                let c = *self.pick(ALPHA);
                // no leading '.' or '-' (keeps names away from `.`/`..` and options)
                if i == 0 && (c == b'.' || c == b'-') {
                    'x'
                } else {
                    c as char
                }
            })
            .collect()
    }
}

// ---------------------------------------------------------------------------------------------
// Small syscall helpers (all panic with the path and errno: this is test setup)

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).expect("path contains NUL")
}

fn check<T>(r: io::Result<T>, what: &str, p: &Path) -> T {
    match r {
        Ok(v) => v,
        Err(e) => panic!("populate: {what} {}: {e}", p.display()),
    }
}

fn cvt(ret: libc::c_int) -> io::Result<()> {
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn mkdir(p: &Path) {
    check(fs::create_dir(p), "mkdir", p);
}

fn mkdir_all(p: &Path) {
    check(fs::create_dir_all(p), "mkdir -p", p);
}

fn write_file(p: &Path, data: &[u8]) {
    check(fs::write(p, data), "write", p);
}

fn open_rw(p: &Path) -> File {
    check(
        OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(p),
        "open",
        p,
    )
}

fn pwrite(f: &File, p: &Path, off: u64, data: &[u8]) {
    check(f.write_all_at(data, off), "pwrite", p);
}

fn fallocate(f: &File, p: &Path, keep_size: bool, off: u64, len: u64) {
    let mode = if keep_size {
        libc::FALLOC_FL_KEEP_SIZE
    } else {
        0
    };
    // SAFETY: plain syscall on a valid fd.
    let r = unsafe { libc::fallocate(f.as_raw_fd(), mode, off as i64, len as i64) };
    check(cvt(r), "fallocate", p);
}

fn symlink(target: &[u8], p: &Path) {
    check(
        std::os::unix::fs::symlink(OsStr::from_bytes(target), p),
        "symlink",
        p,
    );
}

fn hardlink(existing: &Path, new: &Path) {
    check(fs::hard_link(existing, new), "link", new);
}

fn mknod(p: &Path, mode: libc::mode_t, major: u32, minor: u32) {
    let c = cpath(p);
    // SAFETY: valid NUL-terminated path.
    let r = unsafe { libc::mknod(c.as_ptr(), mode, libc::makedev(major, minor)) };
    check(cvt(r), "mknod", p);
}

fn lchown(p: &Path, uid: u32, gid: u32) {
    let c = cpath(p);
    // SAFETY: valid NUL-terminated path.
    let r = unsafe { libc::lchown(c.as_ptr(), uid, gid) };
    check(cvt(r), "lchown", p);
}

fn chmod(p: &Path, mode: u32) {
    check(
        fs::set_permissions(p, fs::Permissions::from_mode(mode)),
        "chmod",
        p,
    );
}

fn lsetxattr(p: &Path, name: &str, value: &[u8]) -> io::Result<()> {
    let c = cpath(p);
    let n = CString::new(name).expect("xattr name contains NUL");
    // SAFETY: valid NUL-terminated path and name; value pointer/len from a slice.
    let r = unsafe {
        libc::lsetxattr(
            c.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    };
    cvt(r)
}

fn set_xattr(p: &Path, name: &str, value: &[u8]) {
    check(lsetxattr(p, name, value), &format!("lsetxattr {name}"), p);
}

/// Sets atime and mtime (seconds, nanoseconds) without following symlinks.
pub fn set_times(p: &Path, atime: (i64, u32), mtime: (i64, u32)) {
    let c = cpath(p);
    let ts = [
        libc::timespec {
            tv_sec: atime.0,
            tv_nsec: atime.1 as _,
        },
        libc::timespec {
            tv_sec: mtime.0,
            tv_nsec: mtime.1 as _,
        },
    ];
    // SAFETY: valid path, two timespecs.
    let r = unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c.as_ptr(),
            ts.as_ptr(),
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    check(cvt(r), "utimensat", p);
}

fn fsync(f: &File, p: &Path) {
    check(f.sync_all(), "fsync", p);
}

/// All paths below `root` (not `root` itself), depth first, children sorted by name bytes,
/// without following symlinks. Subtrees whose relative path is in `skip` are left out.
fn walk_sorted(root: &Path, skip: &[&str]) -> Vec<PathBuf> {
    fn rec(root: &Path, rel: &Path, skip: &[&str], out: &mut Vec<PathBuf>) {
        let dir = root.join(rel);
        let mut names: Vec<OsString> = check(fs::read_dir(&dir), "readdir", &dir)
            .map(|e| check(e, "readdir", &dir).file_name())
            .collect();
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        for n in names {
            let r = rel.join(&n);
            if skip.iter().any(|s| Path::new(s) == r) {
                continue;
            }
            let ft = check(fs::symlink_metadata(root.join(&r)), "lstat", &r).file_type();
            out.push(r.clone());
            if ft.is_dir() {
                rec(root, &r, skip, out);
            }
        }
    }
    let mut out = Vec::new();
    rec(root, Path::new(""), skip, &mut out);
    out
}

// ---------------------------------------------------------------------------------------------
// The generator

/// Fills the kernel btrfs mount at `mnt` (see the module comment for what it makes).
/// Panics with the failing path on any error.
pub fn populate(mnt: &Path, seed: u64, scale: Scale) {
    let p = scale.params();
    let rng = Rng::new(seed);
    // SAFETY: umask cannot fail.
    unsafe { libc::umask(0o022) };
    remount(mnt, "noatime");

    write_file(&mnt.join("empty_file"), b"");
    mkdir(&mnt.join("empty_dir"));
    make_tree(&mnt.join("tree"), &mut rng.fork(1), p.tree_depth);
    make_big_dir(&mnt.join(BIG_DIR), &mut rng.fork(2), p.big_dir_entries);
    make_inline(&mnt.join("inline"), &mut rng.fork(3), p.inline_files);
    make_regular(&mnt.join("regular"), &mut rng.fork(4), p.big_sizes);
    make_sparse(&mnt.join("sparse"), &mut rng.fork(5));
    make_prealloc(&mnt.join("prealloc"), &mut rng.fork(6));
    make_compressed(mnt, &mut rng.fork(7));
    make_links(&mnt.join("links"), &mut rng.fork(8), p.many_links);
    make_symlinks(&mnt.join("symlinks"), &mut rng.fork(9));
    make_special(&mnt.join("special"));
    make_xattrs(&mnt.join("xattrs"), &mut rng.fork(10));
    make_names(&mnt.join("names"), &mut rng.fork(11));
    make_perms(&mnt.join("perms"));
    mkdir(&mnt.join("times"));
    for n in ["pre_epoch", "far_future", "epoch", "max_nsec"] {
        write_file(&mnt.join("times").join(n), n.as_bytes());
    }

    // Subvolume, then its read-only snapshot, then changes in the source.
    let sv = mnt.join(SUBVOL);
    sh(
        "btrfs",
        &[
            OsStr::new("subvolume"),
            OsStr::new("create"),
            sv.as_os_str(),
        ],
    );
    make_subvol_content(&sv, &mut rng.fork(12));
    owners_and_modes(mnt, &[], &mut rng.fork(13));
    all_times(mnt, &[], &mut rng.fork(14));
    sync_all();
    let snap = mnt.join(SNAPSHOT);
    sh(
        "btrfs",
        &[
            OsStr::new("subvolume"),
            OsStr::new("snapshot"),
            OsStr::new("-r"),
            sv.as_os_str(),
            snap.as_os_str(),
        ],
    );
    change_subvol(&sv, &mut rng.fork(15));
    owners_and_modes(&sv, &[], &mut rng.fork(16));
    all_times(mnt, &[SNAPSHOT], &mut rng.fork(17));
    sync_all();
}

fn make_tree(dir: &Path, rng: &mut Rng, depth: u32) {
    mkdir(dir);
    for i in 0..rng.range(0, 4) {
        let len = rng.range(0, 20 * 1024) as usize;
        let data = rng.random_bytes(len);
        write_file(&dir.join(format!("f{i}")), &data);
    }
    if depth > 0 {
        for i in 0..rng.range(1, 3) {
            let name = format!("d{i}-{}", rng.name_between(1, 12));
            make_tree(&dir.join(name), rng, depth - 1);
        }
    }
}

fn make_big_dir(dir: &Path, rng: &mut Rng, n: u32) {
    mkdir(dir);
    for i in 0..n {
        let suffix = rng.name_between(0, 40);
        let p = dir.join(format!("e{i:05}-{suffix}"));
        if i % 500 == 499 {
            mkdir(&p);
            write_file(&p.join("inner"), &rng.random_bytes(100));
        } else if i % 50 == 7 {
            let len = rng.range(1, 5000) as usize;
            write_file(&p, &rng.text_bytes(len));
        } else {
            write_file(&p, b"");
        }
    }
}

fn make_inline(dir: &Path, rng: &mut Rng, n: u32) {
    mkdir(dir);
    for i in 0..n {
        let len = rng.range(1, 2048) as usize;
        let data = if i % 2 == 0 {
            rng.random_bytes(len)
        } else {
            rng.text_bytes(len)
        };
        write_file(&dir.join(format!("tiny{i:03}")), &data);
    }
    for len in [1usize, 2048, 2049, 4095] {
        write_file(&dir.join(format!("len{len}")), &rng.random_bytes(len));
    }
}

fn make_regular(dir: &Path, rng: &mut Rng, big: &[u64]) {
    mkdir(dir);
    let small: [u64; 8] = [4095, 4096, 4097, 12345, 65536, 131072 + 1, 500_000, 1 << 20];
    for (i, &len) in small.iter().chain(big.iter()).enumerate() {
        let data = if i % 3 == 2 {
            rng.text_bytes(len as usize)
        } else {
            rng.random_bytes(len as usize)
        };
        write_file(&dir.join(format!("r{i:02}-{len}")), &data);
    }
    // A file rewritten in place several times (extents replaced piecemeal).
    let p = dir.join("rewritten");
    let f = open_rw(&p);
    pwrite(&f, &p, 0, &rng.random_bytes(512 * 1024));
    fsync(&f, &p);
    for _ in 0..8 {
        let off = rng.below(500 * 1024);
        let len = rng.range(1, 40000) as usize;
        pwrite(&f, &p, off, &rng.random_bytes(len));
        fsync(&f, &p);
    }
}

fn make_sparse(dir: &Path, rng: &mut Rng) {
    mkdir(dir);
    const M: u64 = 1 << 20;
    let chunk = |rng: &mut Rng| rng.random_bytes(64 * 1024);

    let p = dir.join("hole_start");
    let f = open_rw(&p);
    pwrite(&f, &p, M, &chunk(rng));

    let p = dir.join("hole_middle");
    let f = open_rw(&p);
    pwrite(&f, &p, 0, &chunk(rng));
    pwrite(&f, &p, 2 * M, &chunk(rng));

    let p = dir.join("hole_end");
    let f = open_rw(&p);
    pwrite(&f, &p, 0, &chunk(rng));
    check(f.set_len(3 * M), "truncate", &p);

    let p = dir.join("all_hole");
    let f = open_rw(&p);
    check(f.set_len(5 * M + 17), "truncate", &p);

    let p = dir.join("many_holes");
    let f = open_rw(&p);
    let mut off = 0;
    for _ in 0..40 {
        off += rng.range(1, 16) * 4096;
        pwrite(&f, &p, off, &rng.random_bytes_between(4096, 3 * 4096));
        off += 3 * 4096;
    }

    let p = dir.join("unaligned");
    let f = open_rw(&p);
    pwrite(&f, &p, 12345, &rng.random_bytes(100));
    pwrite(&f, &p, 777_777, &rng.random_bytes(5000));
    check(f.set_len(1_234_567), "truncate", &p);

    // Inline extent first, then the file grows past it by truncate.
    let p = dir.join("inline_then_extended");
    let f = open_rw(&p);
    pwrite(&f, &p, 0, &rng.text_bytes(100));
    fsync(&f, &p);
    check(f.set_len(2 * M + 5), "truncate", &p);
    pwrite(&f, &p, M, &rng.random_bytes(4096));
}

fn make_prealloc(dir: &Path, rng: &mut Rng) {
    mkdir(dir);
    const K: u64 = 1024;
    const M: u64 = 1 << 20;

    let p = dir.join("unwritten");
    let f = open_rw(&p);
    fallocate(&f, &p, false, 0, M);

    let p = dir.join("keep_size_empty");
    let f = open_rw(&p);
    fallocate(&f, &p, true, 0, M);

    let p = dir.join("partly_written");
    let f = open_rw(&p);
    fallocate(&f, &p, false, 0, 2 * M);
    pwrite(&f, &p, 0, &rng.random_bytes(4096));
    pwrite(&f, &p, 512 * K, &rng.random_bytes(64 * K as usize));
    pwrite(&f, &p, 2 * M - 100, &rng.random_bytes(100));
    fsync(&f, &p);

    let p = dir.join("beyond_eof");
    let f = open_rw(&p);
    pwrite(&f, &p, 0, &rng.random_bytes(100 * K as usize));
    fsync(&f, &p);
    fallocate(&f, &p, true, 100 * K, M);

    let p = dir.join("keep_size_written_inside");
    let f = open_rw(&p);
    fallocate(&f, &p, true, 0, M);
    pwrite(&f, &p, 768 * K, &rng.random_bytes(8 * K as usize));
    fsync(&f, &p);

    let p = dir.join("middle_range");
    let f = open_rw(&p);
    pwrite(&f, &p, 0, &rng.random_bytes(64 * K as usize));
    fsync(&f, &p);
    fallocate(&f, &p, false, 256 * K, 256 * K);
    pwrite(&f, &p, 600 * K, &rng.random_bytes(4 * K as usize));
    fsync(&f, &p);
}

fn make_compressed(mnt: &Path, rng: &mut Rng) {
    let base = mnt.join("compressed");
    mkdir(&base);
    let mixed = base.join("mixed_algos");
    for (phase, alg) in ["zlib", "lzo", "zstd"].into_iter().enumerate() {
        remount(mnt, &format!("compress-force={alg}"));
        let dir = base.join(alg);
        mkdir(&dir);
        write_file(&dir.join("text_small"), &rng.text_bytes(1500));
        write_file(&dir.join("text_large"), &rng.text_bytes(300 * 1024 + 123));
        write_file(&dir.join("random_large"), &rng.random_bytes(256 * 1024));
        write_file(&dir.join("mixed"), &rng.mixed_bytes(1 << 20));
        let p = dir.join("sparse");
        let f = open_rw(&p);
        pwrite(&f, &p, 200 * 1024, &rng.text_bytes(100 * 1024));
        pwrite(&f, &p, 1 << 20, &rng.text_bytes(10_000));
        check(f.set_len(3 << 20), "truncate", &p);

        let f = open_rw(&mixed);
        pwrite(
            &f,
            &mixed,
            phase as u64 * 256 * 1024,
            &rng.text_bytes(200 * 1024),
        );

        if alg == "zstd" {
            let p = base.join("zlib").join("text_large");
            let f = open_rw(&p);
            pwrite(&f, &p, 128 * 1024 + 4096, &rng.text_bytes(4096));
        }
        // Compression happens at writeback: flush before switching the algorithm.
        sync_all();
    }
    remount(mnt, "compress=no");
}

fn make_links(dir: &Path, rng: &mut Rng, many: u32) {
    mkdir(dir);
    let target = dir.join("target");
    write_file(&target, &rng.random_bytes(10_000));
    let many_dir = dir.join("many");
    mkdir(&many_dir);
    for i in 0..many {
        let len = rng.range(200, 250) as usize - 5;
        let name = format!("{i:04}-{}", rng.name(len));
        hardlink(&target, &many_dir.join(name));
    }
    // One inode linked from several directories.
    let spread = dir.join("spread");
    write_file(&spread, &rng.text_bytes(3000));
    for d in ["a", "b", "a/deeper"] {
        mkdir(&dir.join(d));
        hardlink(&spread, &dir.join(d).join("link_to_spread"));
    }
    hardlink(&spread, &dir.join("a").join("second_name"));
    // An empty file with two names.
    write_file(&dir.join("empty_twice_1"), b"");
    hardlink(&dir.join("empty_twice_1"), &dir.join("empty_twice_2"));
}

fn make_symlinks(dir: &Path, rng: &mut Rng) {
    mkdir(dir);
    symlink(b"../regular/r00-4095", &dir.join("short"));
    symlink(b"x", &dir.join("one_char"));
    symlink(b"/etc/passwd", &dir.join("absolute"));
    symlink(b"../tree", &dir.join("to_dir"));
    symlink(b"does/not/exist", &dir.join("dangling"));
    symlink(b"chain2", &dir.join("chain1"));
    symlink(b"chain3", &dir.join("chain2"));
    symlink(b"short", &dir.join("chain3"));
    for (name, len) in [("long_1000", 1000usize), ("long_2047", 2047)] {
        let mut t = Vec::new();
        while t.len() < len {
            t.extend_from_slice(rng.name_between(1, 30).as_bytes());
            t.push(b'/');
        }
        t.truncate(len);
        if t.last() == Some(&b'/') {
            t.pop();
            t.push(b'z');
        }
        symlink(&t, &dir.join(name));
    }
}

fn make_special(dir: &Path) {
    mkdir(dir);
    let fifo = dir.join("fifo");
    let c = cpath(&fifo);
    // SAFETY: valid path.
    check(
        cvt(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }),
        "mkfifo",
        &fifo,
    );
    // mknod makes socket inodes too (bind() would limit the path to 108 bytes).
    mknod(&dir.join("socket"), libc::S_IFSOCK | 0o755, 0, 0);
    mknod(&dir.join("chr"), libc::S_IFCHR | 0o600, 240, 7);
    mknod(&dir.join("chr_big"), libc::S_IFCHR | 0o640, 4095, 1_048_575);
    mknod(&dir.join("blk"), libc::S_IFBLK | 0o660, 7, 200);
    mknod(
        &dir.join("blk_wide_minor"),
        libc::S_IFBLK | 0o600,
        259,
        70_000,
    );
}

fn make_xattrs(dir: &Path, rng: &mut Rng) {
    mkdir(dir);
    let f = dir.join("small");
    write_file(&f, b"small xattrs");
    set_xattr(&f, "user.one", b"1");
    set_xattr(&f, "user.two", b"second value");
    set_xattr(&f, "user.empty", b"");

    let f = dir.join("big");
    write_file(&f, &rng.random_bytes(5000));
    let v = rng.random_bytes_between(3000, 3200);
    set_xattr(&f, "user.big", &v);
    let v = rng.text_bytes(3100);
    set_xattr(&f, "user.big_text", &v);
    set_xattr(&f, "user.small", b"s");

    let f = dir.join("many");
    write_file(&f, b"");
    for i in 0..24 {
        let len = rng.range(0, 300) as usize;
        let name = format!("user.attr{i:02}.{}", rng.name_between(1, 40));
        set_xattr(&f, &name, &rng.random_bytes(len));
    }
    set_xattr(&f, "user.binary", &[0, 1, 2, 255, 0, 254]);

    let d = dir.join("dir_with_xattrs");
    mkdir(&d);
    set_xattr(&d, "user.dir", b"on a directory");
    set_xattr(&d, "user.dir_big", &rng.random_bytes(2900));
    write_file(&d.join("child"), b"child");

    let s = dir.join("symlink_with_xattrs");
    symlink(b"small", &s);
    // user.* is refused on symlinks by the VFS; trusted.* works for root.
    for (name, value) in [("trusted.on_symlink", &b"t"[..]), ("trusted.second", b"2")] {
        match lsetxattr(&s, name, value) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EPERM) => {}
            Err(e) => panic!("populate: lsetxattr {name} {}: {e}", s.display()),
        }
    }
    let f = dir.join("trusted_on_file");
    write_file(&f, b"t");
    set_xattr(&f, "trusted.file", b"trusted value");
    set_xattr(&f, "user.also", b"user value");
}

fn make_names(dir: &Path, rng: &mut Rng) {
    mkdir(dir);
    let mut names: Vec<Vec<u8>> = vec![
        b"with space".to_vec(),
        b" leading space".to_vec(),
        "\u{fc}n\u{ef}c\u{f6}d\u{e9} \u{65e5}\u{672c}"
            .as_bytes()
            .to_vec(),
        b"non-utf8-\xff\xfe\x80".to_vec(),
        b"-dash".to_vec(),
        b".hidden".to_vec(),
        b"..dots".to_vec(),
        b"tab\there".to_vec(),
        b"newline\nhere".to_vec(),
        b"quote'\"back\\slash".to_vec(),
        b"star*question?".to_vec(),
    ];
    names.push(rng.name(255).into_bytes());
    for (i, n) in names.into_iter().enumerate() {
        let p = dir.join(OsString::from_vec(n));
        if i % 3 == 1 {
            mkdir(&p);
        } else {
            write_file(&p, format!("name {i}").as_bytes());
        }
    }
}

const FILE_MODES: &[u32] = &[
    0o644, 0o600, 0o755, 0o4755, 0o2755, 0o6711, 0o1644, 0o000, 0o444, 0o777, 0o640, 0o7777,
];
const DIR_MODES: &[u32] = &[0o755, 0o700, 0o1777, 0o2775, 0o555, 0o3770, 0o711];
const OWNERS: &[(u32, u32)] = &[
    (0, 0),
    (1000, 1000),
    (1001, 100),
    (65534, 65534),
    (12345, 54321),
    (3_000_000_000, 4_000_000_000),
];

fn make_perms(dir: &Path) {
    mkdir(dir);
    for (i, &mode) in FILE_MODES.iter().enumerate() {
        let p = dir.join(format!("file_{mode:04o}"));
        write_file(&p, format!("mode {mode:o}").as_bytes());
        let (u, g) = OWNERS[i % OWNERS.len()];
        lchown(&p, u, g);
        chmod(&p, mode);
    }
    for (i, &mode) in DIR_MODES.iter().enumerate() {
        let p = dir.join(format!("dir_{mode:04o}"));
        mkdir(&p);
        write_file(&p.join("inside"), b"inside");
        let (u, g) = OWNERS[(i + 2) % OWNERS.len()];
        lchown(&p, u, g);
        chmod(&p, mode);
    }
    let s = dir.join("symlink_owned");
    symlink(b"file_0644", &s);
    lchown(&s, 1000, 1001);
}

fn make_subvol_content(sv: &Path, rng: &mut Rng) {
    write_file(&sv.join("small"), b"in the subvolume");
    write_file(&sv.join("data_1m"), &rng.random_bytes(1 << 20));
    write_file(&sv.join("text_200k"), &rng.text_bytes(200 * 1024));
    write_file(&sv.join("to_delete"), &rng.random_bytes(70_000));
    write_file(&sv.join("to_truncate"), &rng.random_bytes(300_000));
    write_file(&sv.join("to_append"), &rng.random_bytes(10_000));
    write_file(&sv.join("to_overwrite"), &rng.random_bytes(600_000));
    write_file(&sv.join("to_chmod"), b"mode changes after the snapshot");
    make_tree(&sv.join("tree"), rng, 2);
    mkdir(&sv.join("dir_to_rename"));
    write_file(&sv.join("dir_to_rename/file"), b"renamed with its dir");
    hardlink(&sv.join("small"), &sv.join("small_link"));
    symlink(b"small", &sv.join("symlink"));
    set_xattr(&sv.join("small"), "user.sv", b"subvolume xattr");
    set_xattr(sv, "user.on_subvol_root", b"root of the subvolume");
    let p = sv.join("sparse");
    let f = open_rw(&p);
    pwrite(&f, &p, 1 << 20, &rng.random_bytes(8192));
    check(f.set_len(4 << 20), "truncate", &p);
}

fn change_subvol(sv: &Path, rng: &mut Rng) {
    check(fs::remove_file(sv.join("to_delete")), "unlink", sv);
    let p = sv.join("to_truncate");
    let f = open_rw(&p);
    check(f.set_len(100_001), "truncate", &p);
    let p = sv.join("to_append");
    let mut f = check(OpenOptions::new().append(true).open(&p), "open", &p);
    check(f.write_all(&rng.random_bytes(50_000)), "append", &p);
    let p = sv.join("to_overwrite");
    let f = open_rw(&p);
    pwrite(&f, &p, 4096 * 10, &rng.random_bytes(8192));
    pwrite(&f, &p, 333_333, &rng.random_bytes(1000));
    chmod(&sv.join("to_chmod"), 0o4750);
    check(
        fs::rename(sv.join("dir_to_rename"), sv.join("dir_renamed")),
        "rename",
        sv,
    );
    write_file(&sv.join("added_after_snapshot"), &rng.random_bytes(40_000));
    mkdir_all(&sv.join("new_dir/nested"));
    write_file(&sv.join("new_dir/nested/file"), &rng.text_bytes(5000));
    set_xattr(&sv.join("small"), "user.sv", b"changed after the snapshot");
    set_xattr(&sv.join("text_200k"), "user.added", b"new xattr");
}

/// Random other owners and modes for a part of the paths below `root` (root itself excluded).
fn owners_and_modes(root: &Path, skip: &[&str], rng: &mut Rng) {
    for rel in walk_sorted(root, skip) {
        let p = root.join(&rel);
        // perms/ keeps its chosen modes; the snapshot is read-only.
        if rel.starts_with("perms") || rel.starts_with(SNAPSHOT) {
            continue;
        }
        let md = check(fs::symlink_metadata(&p), "lstat", &p);
        let ft = md.file_type();
        if rng.chance(1, 6) {
            let (u, g) = *rng.pick(OWNERS);
            lchown(&p, u, g);
        }
        if ft.is_file() && rng.chance(1, 10) {
            chmod(&p, *rng.pick(FILE_MODES));
        } else if ft.is_dir() && rng.chance(1, 10) {
            chmod(&p, *rng.pick(DIR_MODES));
        }
    }
}

/// Explicit atime and mtime (with nanoseconds) on every path, including the mount point.
fn all_times(mnt: &Path, skip: &[&str], rng: &mut Rng) {
    let mut paths = walk_sorted(mnt, skip);
    paths.push(PathBuf::new());
    for rel in paths {
        let mut t = || {
            (
                1_500_000_000 + rng.below(300_000_000) as i64,
                rng.below(1_000_000_000) as u32,
            )
        };
        let (a, m) = match rel.to_str() {
            Some("times/pre_epoch") => ((-1, 999_999_999), (-315_619_200, 123_456_789)),
            Some("times/far_future") => ((4_102_444_800, 1), (4_133_980_799, 999_999_999)),
            Some("times/epoch") => ((0, 0), (0, 0)),
            Some("times/max_nsec") => ((t().0, 999_999_999), (t().0, 999_999_999)),
            _ => (t(), t()),
        };
        set_times(&mnt.join(&rel), a, m);
    }
}
