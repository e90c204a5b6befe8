//! `walk_everything`: the whole read surface of [`Fs`] in one pass.
//!
//! Visits every directory reachable from the default subvolume (crossing into subvolumes and
//! snapshots), reads each directory with `readdir` in small pages, looks every name up again
//! through its DIR_ITEM hash, stats every entry, reads every regular file fully in chunks,
//! reads symlinks, lists and fetches xattrs, resolves each inode's path and lists subvolumes.
//!
//! Nothing here trusts the image: directories are visited once (a directory entry that points
//! back to an ancestor cannot loop the walk), the number of entries is capped and a file's
//! reported size only drives reads up to a limit (beyond it only the last chunk is read), so a
//! damaged value cannot make the walk itself hang or grow without bound.
//!
//! This file is also built for the fuzz crate (with `fuzz_logic.rs`, under the `fuzzing`
//! feature, for `butter::fuzz`), so it depends on nothing but `butter` and std.

#![allow(dead_code)]

use butter::fs::{Fs, Inode};
use butter::Error;
use std::collections::{BTreeMap, HashSet};
use std::hash::Hasher;

/// Bounds of one walk.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WalkLimits {
    /// Bytes per `Fs::read` call.
    pub chunk: usize,
    /// A file is read fully up to this many bytes; past it only its last chunk is read.
    pub max_file_bytes: u64,
    /// Entries (all kinds) visited before the walk gives up with a budget error.
    pub max_entries: usize,
    /// `readdir` page size (exercises the resume cookie).
    pub readdir_page: usize,
}

impl Default for WalkLimits {
    fn default() -> Self {
        WalkLimits {
            chunk: 64 * 1024,
            max_file_bytes: 16 << 20,
            max_entries: 100_000,
            readdir_page: 64,
        }
    }
}

/// What the walk saw of one entry; equal walks mean equal file trees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryInfo {
    pub inode: Inode,
    pub mode: u32,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub size: u64,
    pub mtime: (i64, u32),
    /// Hash of the bytes read (regular files).
    pub content: Option<u64>,
    /// Bytes read from the file.
    pub bytes: u64,
    /// Symlink target.
    pub target: Option<Vec<u8>>,
    pub xattrs: Vec<(Vec<u8>, Vec<u8>)>,
    /// Whether a DIR_ITEM lookup by name found the same inode as readdir.
    pub lookup_agrees: bool,
    /// `Fs::inode_path` of the inode (None for subvolume roots and on error).
    pub inode_path: Option<String>,
}

/// Counters of one walk.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct WalkStats {
    pub dirs: u64,
    pub files: u64,
    pub symlinks: u64,
    pub other: u64,
    pub bytes_read: u64,
    pub xattrs: u64,
    pub subvols: u64,
}

/// The result of a walk: every entry by path, the subvolume list and counters.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Walk {
    pub entries: BTreeMap<String, EntryInfo>,
    /// (id, parent, path) of every subvolume.
    pub subvols: Vec<(u64, u64, String)>,
    pub stats: WalkStats,
}

impl Walk {
    /// A short description of the first difference from `other`, if any.
    pub(crate) fn diff(&self, other: &Walk) -> Option<String> {
        if self.subvols != other.subvols {
            return Some(format!(
                "subvolumes differ: {:?} vs {:?}",
                self.subvols, other.subvols
            ));
        }
        for (p, e) in &self.entries {
            match other.entries.get(p) {
                None => return Some(format!("{p:?} only in the first walk")),
                Some(o) if o != e => return Some(format!("{p:?} differs: {e:?} vs {o:?}")),
                _ => {}
            }
        }
        for p in other.entries.keys() {
            if !self.entries.contains_key(p) {
                return Some(format!("{p:?} only in the second walk"));
            }
        }
        if self.stats != other.stats {
            return Some(format!(
                "stats differ: {:?} vs {:?}",
                self.stats, other.stats
            ));
        }
        None
    }
}

/// An error met during a walk and where the walk was.
#[derive(Debug)]
pub(crate) struct WalkError {
    /// Path (or step) the walk was at.
    pub at: String,
    pub err: Error,
}

impl std::fmt::Display for WalkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "at {}: {}", self.at, self.err)
    }
}

/// Walks everything; stops at the first error.
pub(crate) fn walk_everything(fs: &Fs) -> Result<Walk, Error> {
    let (walk, mut errors) = walk_tolerant(fs, &WalkLimits::default());
    if errors.is_empty() {
        Ok(walk)
    } else {
        Err(errors.swap_remove(0).err)
    }
}

/// Walks everything, carrying on past errors (each damaged spot is reported, the rest still
/// read). A walk that runs out of its entry budget ends with an `Error::Range` ("walk budget").
pub(crate) fn walk_tolerant(fs: &Fs, lim: &WalkLimits) -> (Walk, Vec<WalkError>) {
    let mut w = Walker {
        fs,
        lim: *lim,
        walk: Walk::default(),
        errors: Vec::new(),
        visited: HashSet::new(),
        budget: lim.max_entries,
    };
    w.run();
    (w.walk, w.errors)
}

struct Walker<'a> {
    fs: &'a Fs,
    lim: WalkLimits,
    walk: Walk,
    errors: Vec<WalkError>,
    visited: HashSet<Inode>,
    budget: usize,
}

impl Walker<'_> {
    fn err(&mut self, at: &str, err: Error) {
        // Cap the list: one damaged leaf can make thousands of entries fail the same way.
        if self.errors.len() < 1000 {
            self.errors.push(WalkError {
                at: at.to_string(),
                err,
            });
        }
    }

    fn run(&mut self) {
        match self.fs.list_subvolumes() {
            Ok(list) => {
                self.walk.stats.subvols = list.len() as u64;
                self.walk.subvols = list
                    .into_iter()
                    .map(|s| {
                        (
                            s.id,
                            s.parent,
                            String::from_utf8_lossy(&s.path).into_owned(),
                        )
                    })
                    .collect();
            }
            Err(e) => self.err("list_subvolumes", e),
        }
        let root = self.fs.root_inode();
        let mut stack = vec![(root, String::new())];
        self.entry(root, "", None, true);
        self.visited.insert(root);
        while let Some((dir, path)) = stack.pop() {
            self.read_dir(dir, &path, &mut stack);
            if self.budget == 0 {
                break;
            }
        }
    }

    fn read_dir(&mut self, dir: Inode, path: &str, stack: &mut Vec<(Inode, String)>) {
        let mut after = 0u64;
        loop {
            let page = match self.fs.readdir(dir, after, self.lim.readdir_page) {
                Ok(p) => p,
                Err(e) => {
                    self.err(&format!("readdir {path:?}"), e);
                    return;
                }
            };
            if page.is_empty() {
                return;
            }
            for e in &page {
                if self.budget == 0 {
                    self.err(
                        path,
                        Error::Range(format!(
                            "walk budget of {} entries exhausted",
                            self.lim.max_entries
                        )),
                    );
                    return;
                }
                self.budget -= 1;
                if e.index <= after {
                    // readdir must return increasing cookies; never go backwards.
                    self.err(
                        path,
                        Error::Invalid(format!(
                            "readdir of inode {} returned index {} after {after}",
                            dir.ino, e.index
                        )),
                    );
                    return;
                }
                after = e.index;
                let child = format!("{path}/{}", String::from_utf8_lossy(&e.name));
                let lookup_agrees = match self.fs.lookup(dir, &e.name) {
                    Ok(Some(l)) => l.target == e.target,
                    Ok(None) => false,
                    Err(err) => {
                        self.err(&format!("lookup {child:?}"), err);
                        false
                    }
                };
                let is_dir = self.entry(e.target, &child, Some(lookup_agrees), false);
                if is_dir && self.visited.insert(e.target) {
                    stack.push((e.target, child));
                }
            }
        }
    }

    /// Stats and reads one entry; returns whether it is a directory to descend into.
    fn entry(
        &mut self,
        ino: Inode,
        path: &str,
        lookup_agrees: Option<bool>,
        is_root: bool,
    ) -> bool {
        let st = match self.fs.stat(ino) {
            Ok(s) => s,
            Err(e) => {
                self.err(&format!("stat {path:?}"), e);
                return false;
            }
        };
        let mut info = EntryInfo {
            inode: ino,
            mode: st.mode,
            nlink: st.nlink,
            uid: st.uid,
            gid: st.gid,
            size: st.size,
            mtime: (st.mtime.sec, st.mtime.nsec),
            content: None,
            bytes: 0,
            target: None,
            xattrs: Vec::new(),
            lookup_agrees: lookup_agrees.unwrap_or(true),
            inode_path: None,
        };
        match self.fs.xattrs(ino) {
            Ok(x) => {
                for (name, value) in &x {
                    match self.fs.getxattr(ino, name) {
                        Ok(Some(v)) if &v == value => {}
                        Ok(other) => self.err(
                            &format!("getxattr {path:?}"),
                            Error::Invalid(format!(
                                "inode {}: getxattr {:?} gave {:?}, listing gave {} bytes",
                                ino.ino,
                                String::from_utf8_lossy(name),
                                other.map(|v| v.len()),
                                value.len()
                            )),
                        ),
                        Err(e) => self.err(&format!("getxattr {path:?}"), e),
                    }
                }
                self.walk.stats.xattrs += x.len() as u64;
                info.xattrs = x;
            }
            Err(e) => self.err(&format!("xattrs {path:?}"), e),
        }
        // Subvolume roots (256) and the placeholder directory shown for a subvolume link
        // whose subvolume is gone (2, as the kernel does) have no name in their tree.
        if !is_root && ino.ino != butter::format::FIRST_FREE_OBJECTID && ino.ino != 2 {
            match self.fs.core().inode_path(ino) {
                Ok(p) => info.inode_path = Some(p),
                Err(e) => self.err(&format!("inode_path {path:?}"), e),
            }
        }
        let is_dir = st.is_dir();
        if is_dir {
            self.walk.stats.dirs += 1;
        } else if st.is_reg() {
            self.walk.stats.files += 1;
            self.read_file(ino, st.size, path, &mut info);
        } else if st.is_symlink() {
            self.walk.stats.symlinks += 1;
            match self.fs.readlink(ino) {
                Ok(t) => info.target = Some(t),
                Err(e) => self.err(&format!("readlink {path:?}"), e),
            }
        } else {
            self.walk.stats.other += 1;
        }
        let key = if path.is_empty() { "/" } else { path };
        self.walk.entries.insert(key.to_string(), info);
        is_dir
    }

    fn read_file(&mut self, ino: Inode, size: u64, path: &str, info: &mut EntryInfo) {
        let chunk = self.lim.chunk as u64;
        let mut h = std::collections::hash_map::DefaultHasher::new();
        let mut ranges = Vec::new();
        if size <= self.lim.max_file_bytes {
            ranges.push((0, size));
        } else {
            // A size this large is probably damage: read the start and the last chunk only.
            ranges.push((0, self.lim.max_file_bytes / 2));
            ranges.push((size - chunk.min(size), size));
        }
        for (start, end) in ranges {
            let mut off = start;
            while off < end {
                let want = chunk.min(end - off) as usize;
                match self.fs.read(ino, off, want) {
                    Ok(buf) => {
                        h.write(&buf);
                        info.bytes += buf.len() as u64;
                        self.walk.stats.bytes_read += buf.len() as u64;
                        if buf.len() != want {
                            self.err(
                                &format!("read {path:?}"),
                                Error::Invalid(format!(
                                    "inode {}: read of {want} bytes at {off} gave {}",
                                    ino.ino,
                                    buf.len()
                                )),
                            );
                            break;
                        }
                        off += want as u64;
                    }
                    Err(e) => {
                        self.err(&format!("read {path:?} at {off}"), e);
                        // Skip the failing chunk and carry on: later chunks may be fine.
                        off += want as u64;
                    }
                }
            }
        }
        info.content = Some(h.finish());
    }
}
