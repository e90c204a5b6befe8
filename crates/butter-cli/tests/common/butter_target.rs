//! The model harness's [`Target`] over butter's library API: ops go to an image opened
//! read-write with [`Fs::open_rw`]; a checkpoint commits and walks the tree through the same
//! `Fs` into a [`Manifest`].
//!
//! The checks the kernel's VFS makes before a filesystem sees a call (path resolution, O_NOFOLLOW
//! on data ops, setuid clearing on chown, user xattrs only on files and directories, fallocate
//! argument checks) are made here, so the errno seen is what a program would see.

#![allow(dead_code)]

use super::manifest::{Entry, Kind, Manifest, Ts};
use super::model::*;
use butter::format::items::Timespec;
use butter::fs::{Fs, Inode};
use butter::inode::namespace::{Owner, SetAttr};
use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

pub struct ButterTarget {
    pub image: PathBuf,
    /// The filesystem's other devices (several devices), opened with the image.
    pub others: Vec<PathBuf>,
    /// Path (from the top of the filesystem) of the directory that is this target's root.
    pub base: PathBuf,
    pub fs: Option<Fs>,
    /// Commit after every op (slow; crash tests) instead of at checkpoints only.
    pub commit_each: bool,
}

impl ButterTarget {
    pub fn open(image: &Path) -> ButterTarget {
        Self::open_at(image, Path::new(""))
    }

    /// A target whose root is the directory `base` (e.g. a subvolume) of the image.
    pub fn open_at(image: &Path, base: &Path) -> ButterTarget {
        let fs = open_rw_retrying(image, &[])
            .unwrap_or_else(|e| panic!("open {} read-write: {e}", image.display()));
        ButterTarget {
            image: image.to_path_buf(),
            others: Vec::new(),
            base: base.to_path_buf(),
            fs: Some(fs),
            commit_each: false,
        }
    }

    /// A target on a filesystem of several devices: `images[0]` and the others.
    #[allow(dead_code)]
    pub fn open_devices(images: &[PathBuf]) -> ButterTarget {
        let fs = open_rw_retrying(&images[0], &images[1..])
            .unwrap_or_else(|e| panic!("open {} read-write: {e}", images[0].display()));
        ButterTarget {
            image: images[0].clone(),
            others: images[1..].to_vec(),
            base: PathBuf::new(),
            fs: Some(fs),
            commit_each: false,
        }
    }

    fn base_inode(&self) -> Inode {
        let fs = self.fs();
        let mut cur = fs.root_inode();
        for c in self.base.iter() {
            cur = fs
                .lookup(cur, c.as_bytes())
                .ok()
                .flatten()
                .unwrap_or_else(|| panic!("base {} missing", self.base.display()))
                .target;
        }
        cur
    }

    pub fn fs(&self) -> &Fs {
        self.fs.as_ref().expect("butter target is closed")
    }

    /// Commits and closes the image (so the kernel or a checker can take it).
    pub fn close(&mut self) {
        if let Some(fs) = self.fs.take() {
            fs.commit().unwrap_or_else(|e| panic!("final commit: {e}"));
        }
    }

    pub fn reopen(&mut self) {
        self.close();
        self.fs = Some(
            open_rw_retrying(&self.image, &self.others).unwrap_or_else(|e| panic!("reopen: {e}")),
        );
    }

    fn err(e: butter::Error) -> i32 {
        if matches!(
            e,
            butter::Error::Corrupt { .. } | butter::Error::Aborted(_) | butter::Error::Io { .. }
        ) || matches!(e, butter::Error::Invalid(_))
        {
            eprintln!("butter error: {e}");
        }
        e.errno()
    }

    /// Resolves a path: ENOENT for a missing component, ENOTDIR for a non-directory one.
    fn resolve(&self, p: &Path) -> Result<Inode, i32> {
        let fs = self.fs();
        let mut cur = self.base_inode();
        for c in p.iter() {
            let st = fs.stat(cur).map_err(Self::err)?;
            if !st.is_dir() {
                return Err(ENOTDIR);
            }
            let name = c.as_bytes();
            if name.len() > NAME_MAX {
                return Err(ENAMETOOLONG);
            }
            cur = fs
                .lookup(cur, name)
                .map_err(Self::err)?
                .ok_or(ENOENT)?
                .target;
        }
        Ok(cur)
    }

    /// Parent directory and last name of a path.
    fn parent(&self, p: &Path) -> Result<(Inode, Vec<u8>), i32> {
        let name = p.file_name().ok_or(EINVAL)?.as_bytes().to_vec();
        let dir = self.resolve(p.parent().unwrap_or(Path::new("")))?;
        if !self.fs().stat(dir).map_err(Self::err)?.is_dir() {
            return Err(ENOTDIR);
        }
        if name.len() > NAME_MAX {
            return Err(ENAMETOOLONG);
        }
        Ok((dir, name))
    }

    /// Owner of a new inode: root, with the group of a setgid parent.
    fn owner_in(&self, dir: Inode) -> Result<Owner, i32> {
        let st = self.fs().stat(dir).map_err(Self::err)?;
        Ok(Owner {
            uid: 0,
            gid: if st.mode & 0o2000 != 0 { st.gid } else { 0 },
        })
    }

    fn exists(&self, dir: Inode, name: &[u8]) -> Result<bool, i32> {
        Ok(self.fs().lookup(dir, name).map_err(Self::err)?.is_some())
    }

    /// Opens for writing with O_NOFOLLOW: EISDIR on a directory, ELOOP on a symlink.
    fn open_w(&self, p: &Path) -> Result<Inode, i32> {
        let ino = self.resolve(p)?;
        let st = self.fs().stat(ino).map_err(Self::err)?;
        if st.is_dir() {
            return Err(EISDIR);
        }
        if st.is_symlink() {
            return Err(ELOOP);
        }
        Ok(ino)
    }

    fn chmod_exact(&self, ino: Inode, mode: u32) -> Result<(), i32> {
        self.fs()
            .setattr(
                ino,
                &SetAttr {
                    mode: Some(mode),
                    ..Default::default()
                },
            )
            .map(|_| ())
            .map_err(Self::err)
    }

    fn do_apply(&mut self, op: &Op) -> Result<(), i32> {
        let fs = self.fs.as_ref().expect("closed");
        match op {
            Op::Create { path, mode } | Op::Mkdir { path, mode } => {
                let (dir, name) = self.parent(path)?;
                if self.exists(dir, &name)? {
                    return Err(EEXIST);
                }
                let o = self.owner_in(dir)?;
                let ino = if matches!(op, Op::Create { .. }) {
                    fs.create(dir, &name, *mode, o)
                } else {
                    fs.mkdir(dir, &name, *mode, o)
                }
                .map_err(Self::err)?;
                self.chmod_exact(ino, *mode)
            }
            Op::Mknod {
                path,
                kind,
                mode,
                rdev,
            } => {
                let (dir, name) = self.parent(path)?;
                if self.exists(dir, &name)? {
                    return Err(EEXIST);
                }
                let ty = match kind {
                    NodeKind::Fifo => 0o010000,
                    NodeKind::Socket => 0o140000,
                    NodeKind::CharDev => 0o020000,
                    NodeKind::BlockDev => 0o060000,
                };
                let dev = ((rdev.0 as u64) << 20) | rdev.1 as u64;
                let o = self.owner_in(dir)?;
                let ino = fs.mknod(dir, &name, ty | mode, dev, o).map_err(Self::err)?;
                self.chmod_exact(ino, *mode)
            }
            Op::Symlink { path, target } => {
                if target.is_empty() {
                    return Err(ENOENT);
                }
                let (dir, name) = self.parent(path)?;
                if self.exists(dir, &name)? {
                    return Err(EEXIST);
                }
                let o = self.owner_in(dir)?;
                fs.symlink(dir, &name, target, o)
                    .map(|_| ())
                    .map_err(Self::err)
            }
            Op::Link { from, to } => {
                let src = self.resolve(from)?;
                let (dir, name) = self.parent(to)?;
                if self.exists(dir, &name)? {
                    return Err(EEXIST);
                }
                fs.link(src, dir, &name).map(drop).map_err(Self::err)
            }
            Op::Unlink { path } => {
                let (dir, name) = self.parent(path)?;
                fs.unlink(dir, &name).map_err(Self::err)
            }
            Op::Rmdir { path } => {
                let (dir, name) = self.parent(path)?;
                fs.rmdir(dir, &name).map_err(Self::err)
            }
            Op::Rename { from, to, how } => {
                let (fd, fname) = self.parent(from)?;
                let (td, tname) = self.parent(to)?;
                if !self.exists(fd, &fname)? {
                    return Err(ENOENT);
                }
                let flags = match how {
                    RenameHow::Plain => 0,
                    RenameHow::NoReplace => butter::inode::namespace::RENAME_NOREPLACE,
                    RenameHow::Exchange => butter::inode::namespace::RENAME_EXCHANGE,
                };
                fs.rename(fd, &fname, td, &tname, flags)
                    .map(drop)
                    .map_err(Self::err)
            }
            Op::Write {
                path,
                offset,
                len,
                seed,
            } => {
                let ino = self.open_w(path)?;
                let data = write_data(*seed, *len as usize);
                fs.write(ino, *offset, &data).map(|_| ()).map_err(Self::err)
            }
            Op::Truncate { path, size } => {
                let ino = self.open_w(path)?;
                fs.truncate(ino, *size).map_err(Self::err)
            }
            Op::Fallocate {
                path,
                mode,
                offset,
                len,
            } => {
                let ino = self.open_w(path)?;
                if *len == 0 {
                    return Err(EINVAL);
                }
                let punch = mode & FALLOC_PUNCH_HOLE != 0;
                if punch && (mode & FALLOC_KEEP_SIZE == 0 || mode & FALLOC_ZERO_RANGE != 0) {
                    return Err(EOPNOTSUPP);
                }
                fs.fallocate(ino, *mode, *offset, *len).map_err(Self::err)
            }
            Op::Chmod { path, mode } => {
                let ino = self.resolve(path)?;
                if fs.stat(ino).map_err(Self::err)?.is_symlink() {
                    return Err(EOPNOTSUPP);
                }
                self.chmod_exact(ino, *mode)
            }
            Op::Chown { path, uid, gid } => {
                let ino = self.resolve(path)?;
                let st = fs.stat(ino).map_err(Self::err)?;
                let mut a = SetAttr {
                    uid: *uid,
                    gid: *gid,
                    ..Default::default()
                };
                if !st.is_dir() && !st.is_symlink() {
                    let mut m = st.mode & 0o7777 & !0o4000;
                    if st.mode & 0o010 != 0 {
                        m &= !0o2000;
                    }
                    a.mode = Some(m);
                }
                fs.setattr(ino, &a).map(|_| ()).map_err(Self::err)
            }
            Op::Utimens {
                atime: None,
                mtime: None,
                ..
            } => Ok(()), // no lookup at all
            Op::Utimens { path, atime, mtime } => {
                let ino = self.resolve(path)?;
                let ts = |t: &Option<Ts>| {
                    t.map(|t| Timespec {
                        sec: t.sec,
                        nsec: t.nsec,
                    })
                };
                let a = SetAttr {
                    atime: ts(atime),
                    mtime: ts(mtime),
                    ..Default::default()
                };
                fs.setattr(ino, &a).map(|_| ()).map_err(Self::err)
            }
            Op::SetXattr {
                path,
                name,
                value,
                how,
            } => {
                let ino = self.resolve(path)?;
                let st = fs.stat(ino).map_err(Self::err)?;
                if name.starts_with(b"user.") && !st.is_dir() && !st.is_reg() {
                    return Err(EPERM);
                }
                let flags = match how {
                    XattrHow::Either => 0,
                    XattrHow::Create => 1,
                    XattrHow::Replace => 2,
                };
                fs.setxattr(ino, name, value, flags).map_err(Self::err)
            }
            Op::RemoveXattr { path, name } => {
                let ino = self.resolve(path)?;
                let st = fs.stat(ino).map_err(Self::err)?;
                if name.starts_with(b"user.") && !st.is_dir() && !st.is_reg() {
                    return Err(EPERM);
                }
                fs.removexattr(ino, name).map_err(Self::err)
            }
        }
    }
}

impl Target for ButterTarget {
    fn name(&self) -> String {
        format!("butter on {}", self.image.display())
    }

    fn apply(&mut self, op: &Op) -> Result<(), i32> {
        // BUTTER_TRACE_INO=n: print every op that touches inode n, with its size after.
        let watch: Option<u64> = std::env::var("BUTTER_TRACE_INO")
            .ok()
            .and_then(|v| v.parse().ok());
        let before: Vec<Inode> = match watch {
            Some(_) => op
                .paths()
                .iter()
                .filter_map(|p| self.resolve(p).ok())
                .collect(),
            None => Vec::new(),
        };
        let r = self.do_apply(op);
        if let Some(w) = watch {
            if before.iter().any(|i| i.ino == w) {
                let ino = Inode {
                    root: self.base_inode().root,
                    ino: w,
                };
                let size = self.fs().stat(ino).map(|s| s.size).ok();
                eprintln!("TRACE ino {w}: {op} => {r:?}, size {size:?}");
            }
        }
        if self.commit_each {
            self.fs()
                .commit()
                .unwrap_or_else(|e| panic!("commit after {op}: {e}"));
        }
        r
    }

    fn read_file(&mut self, path: &Path) -> Option<Vec<u8>> {
        let ino = self.resolve(path).ok()?;
        let st = self.fs().stat(ino).ok()?;
        self.fs().read(ino, 0, st.size as usize).ok()
    }

    fn checkpoint(&mut self) -> Result<Manifest, String> {
        let fs = self.fs();
        fs.commit().map_err(|e| format!("commit: {e}"))?;
        Ok(manifest_of(fs, self.base_inode()))
    }
}

fn ts(t: Timespec) -> Ts {
    Ts {
        sec: t.sec,
        nsec: t.nsec,
    }
}

/// Everything the model compares, read through butter's `Fs`.
pub fn manifest_of(fs: &Fs, top: Inode) -> Manifest {
    let mut m = Manifest {
        root: PathBuf::from("butter"),
        entries: BTreeMap::new(),
        skipped_mounts: Vec::new(),
    };
    let mut inos: HashMap<Inode, Vec<PathBuf>> = HashMap::new();
    let mut stack = vec![(PathBuf::new(), top)];
    while let Some((path, ino)) = stack.pop() {
        let mut e = Entry {
            kind: Kind::Unknown(0),
            mode: 0,
            uid: 0,
            gid: 0,
            size: 0,
            nlink: 0,
            blocks: 0,
            atime: Ts::default(),
            mtime: Ts::default(),
            ctime: Ts::default(),
            btime: None,
            rdev: None,
            xattrs: Vec::new(),
            target: None,
            sha256: None,
            dev: 0,
            ino: ino.ino,
            subvol_root: false,
            names: None,
            link_group: None,
            errors: Vec::new(),
        };
        match fs.stat(ino) {
            Ok(st) => {
                e.kind = match st.mode & 0o170000 {
                    0o100000 => Kind::File,
                    0o040000 => Kind::Dir,
                    0o120000 => Kind::Symlink,
                    0o010000 => Kind::Fifo,
                    0o140000 => Kind::Socket,
                    0o020000 => Kind::CharDev,
                    0o060000 => Kind::BlockDev,
                    x => Kind::Unknown(x),
                };
                e.mode = st.mode & 0o7777;
                e.uid = st.uid;
                e.gid = st.gid;
                e.size = st.size;
                e.nlink = st.nlink;
                e.blocks = st.blocks;
                e.atime = ts(st.atime);
                e.mtime = ts(st.mtime);
                e.ctime = ts(st.ctime);
                e.btime = Some(ts(st.otime));
                if matches!(e.kind, Kind::CharDev | Kind::BlockDev) {
                    e.rdev = Some(((st.rdev >> 20) as u32, (st.rdev & 0xfffff) as u32));
                }
                match fs.xattrs(ino) {
                    Ok(mut x) => {
                        x.sort();
                        e.xattrs = x;
                    }
                    Err(er) => e.errors.push(format!("xattrs: {er}")),
                }
                if st.is_symlink() {
                    match fs.readlink(ino) {
                        Ok(t) => e.target = Some(t),
                        Err(er) => e.errors.push(format!("readlink: {er}")),
                    }
                }
                if st.is_reg() {
                    match fs.read(ino, 0, st.size as usize) {
                        Ok(d) => e.sha256 = Some(Sha256::digest(&d).into()),
                        Err(er) => e.errors.push(format!("read: {er}")),
                    }
                    inos.entry(ino).or_default().push(path.clone());
                } else if !st.is_dir() {
                    inos.entry(ino).or_default().push(path.clone());
                }
                if st.is_dir() {
                    let mut names = Vec::new();
                    let mut after = 0;
                    loop {
                        match fs.readdir(ino, after, 1024) {
                            Ok(v) if v.is_empty() => break,
                            Ok(v) => {
                                for d in v {
                                    after = d.index;
                                    stack.push((
                                        path.join(std::ffi::OsStr::from_bytes(&d.name)),
                                        d.target,
                                    ));
                                    names.push(d.name);
                                }
                            }
                            Err(er) => {
                                e.errors.push(format!("readdir: {er}"));
                                break;
                            }
                        }
                    }
                    names.sort();
                    e.names = Some(names);
                }
            }
            Err(er) => e.errors.push(format!("stat: {er}")),
        }
        m.entries.insert(path, e);
    }
    for paths in inos.values() {
        if paths.len() > 1 {
            let min = paths.iter().min().cloned();
            for p in paths {
                if let Some(e) = m.entries.get_mut(p) {
                    e.link_group = min.clone();
                }
            }
        }
    }
    m
}

/// [`Fs::open_rw`], retried for a few seconds while the image's lock is busy: the previous
/// writer of this process has closed it, but a test running in parallel may have forked a
/// child (to run `btrfs` or `mount`) that holds a copy of its descriptor, and so the lock,
/// until it execs.
fn open_rw_retrying(image: &Path, others: &[PathBuf]) -> butter::Result<Fs> {
    let mut tries = 0;
    let mut paths: Vec<&Path> = vec![image];
    paths.extend(others.iter().map(|p| p.as_path()));
    loop {
        match Fs::open_rw_paths(&paths, Default::default()) {
            Err(butter::Error::NotPermitted(m)) if m.contains("already open") && tries < 50 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            r => return r,
        }
    }
}
