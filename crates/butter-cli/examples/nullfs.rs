//! nullfs: a FUSE filesystem that does nothing useful, to measure what FUSE itself costs.
//!
//! `cargo run --release --example nullfs -- MOUNTPOINT [THREADS]` mounts an in-memory
//! namespace (directories, regular files, symlinks) whose file data is thrown away: a write
//! only moves the file size, a read returns zeros. Every request crosses the kernel/user
//! boundary like a butter request does, with the same fuser setup as `butter mount` (worker
//! threads on cloned /dev/fuse descriptors, `default_permissions`), so the
//! difference between nullfs and butter in a benchmark is butter's own work, and the
//! difference between nullfs and the kernel's btrfs is (mostly) FUSE.
//!
//! It serves until unmounted (`fusermount3 -u MOUNTPOINT` / `umount`). Needs root or a
//! setuid `fusermount3`. Used by the FUSE benchmarks in `bench/workloads/fuse_*.sh`.

use fuser::{
    Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo,
    InitFlags, KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs,
    ReplyWrite, Request, SessionACL, TimeOrNow, WriteFlags,
};
use std::collections::{BTreeMap, HashMap};
use std::ffi::{OsStr, OsString};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

const TTL: Duration = Duration::from_secs(1);
const ROOT: u64 = 1;
const BLOCK: u64 = 4096;

struct Node {
    attr: FileAttr,
    parent: u64,
    /// Directories only: name -> inode.
    children: BTreeMap<OsString, u64>,
    /// Symlinks only.
    target: Vec<u8>,
}

struct State {
    nodes: HashMap<u64, Node>,
    next_ino: u64,
}

struct NullFs {
    state: Mutex<State>,
}

fn new_attr(ino: u64, kind: FileType, perm: u16, uid: u32, gid: u32) -> FileAttr {
    let now = SystemTime::now();
    FileAttr {
        ino: INodeNo(ino),
        size: 0,
        blocks: 0,
        atime: now,
        mtime: now,
        ctime: now,
        crtime: now,
        kind,
        perm,
        nlink: if kind == FileType::Directory { 2 } else { 1 },
        uid,
        gid,
        rdev: 0,
        blksize: BLOCK as u32,
        flags: 0,
    }
}

fn set_size(attr: &mut FileAttr, size: u64) {
    attr.size = size;
    attr.blocks = size.div_ceil(BLOCK) * (BLOCK / 512);
}

fn time_of(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

impl NullFs {
    fn new() -> NullFs {
        let mut nodes = HashMap::new();
        nodes.insert(
            ROOT,
            Node {
                attr: new_attr(ROOT, FileType::Directory, 0o755, 0, 0),
                parent: ROOT,
                children: BTreeMap::new(),
                target: Vec::new(),
            },
        );
        NullFs {
            state: Mutex::new(State {
                nodes,
                next_ino: ROOT + 1,
            }),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic in one handler must not take the whole mount down.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a new node named `name` under `parent`; returns its attributes.
    fn add(
        &self,
        req: &Request,
        parent: u64,
        name: &OsStr,
        kind: FileType,
        mode: u32,
        target: &[u8],
    ) -> Result<FileAttr, Errno> {
        let mut st = self.lock();
        let State { nodes, next_ino } = &mut *st;
        let dir = nodes.get_mut(&parent).ok_or(Errno::ENOENT)?;
        if dir.attr.kind != FileType::Directory {
            return Err(Errno::ENOTDIR);
        }
        if name.len() > 255 {
            return Err(Errno::ENAMETOOLONG);
        }
        if dir.children.contains_key(name) {
            return Err(Errno::EEXIST);
        }
        let ino = *next_ino;
        *next_ino += 1;
        dir.children.insert(name.to_owned(), ino);
        let now = SystemTime::now();
        dir.attr.mtime = now;
        dir.attr.ctime = now;
        if kind == FileType::Directory {
            dir.attr.nlink += 1;
        }
        let mut attr = new_attr(ino, kind, (mode & 0o7777) as u16, req.uid(), req.gid());
        if kind == FileType::Symlink {
            set_size(&mut attr, target.len() as u64);
        }
        nodes.insert(
            ino,
            Node {
                attr,
                parent,
                children: BTreeMap::new(),
                target: target.to_vec(),
            },
        );
        Ok(attr)
    }

    fn remove(&self, parent: u64, name: &OsStr, want_dir: bool) -> Result<(), Errno> {
        let mut st = self.lock();
        let dir = st.nodes.get(&parent).ok_or(Errno::ENOENT)?;
        let ino = *dir.children.get(name).ok_or(Errno::ENOENT)?;
        let node = st.nodes.get(&ino).ok_or(Errno::ENOENT)?;
        let is_dir = node.attr.kind == FileType::Directory;
        if want_dir && !is_dir {
            return Err(Errno::ENOTDIR);
        }
        if !want_dir && is_dir {
            return Err(Errno::EISDIR);
        }
        if is_dir && !node.children.is_empty() {
            return Err(Errno::ENOTEMPTY);
        }
        // Open files keep no state here, so the node can go at once.
        st.nodes.remove(&ino);
        if let Some(dir) = st.nodes.get_mut(&parent) {
            dir.children.remove(name);
            let now = SystemTime::now();
            dir.attr.mtime = now;
            dir.attr.ctime = now;
            if is_dir {
                dir.attr.nlink -= 1;
            }
        }
        Ok(())
    }
}

impl Filesystem for NullFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        // butter's optional capabilities, except readdirplus (nullfs answers plain readdir;
        // none of the benchmarks lists large directories).
        for cap in [
            InitFlags::FUSE_CACHE_SYMLINKS,
            InitFlags::FUSE_PARALLEL_DIROPS,
        ] {
            let _ = config.add_capabilities(cap);
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let st = self.lock();
        let found = st
            .nodes
            .get(&parent.0)
            .and_then(|d| d.children.get(name))
            .and_then(|ino| st.nodes.get(ino));
        match found {
            Some(n) => reply.entry(&TTL, &n.attr, Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.lock().nodes.get(&ino.0) {
            Some(n) => reply.attr(&TTL, &n.attr),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn setattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        let mut st = self.lock();
        let Some(n) = st.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let a = &mut n.attr;
        if let Some(m) = mode {
            a.perm = (m & 0o7777) as u16;
        }
        if let Some(u) = uid {
            a.uid = u;
        }
        if let Some(g) = gid {
            a.gid = g;
        }
        if let Some(s) = size {
            set_size(a, s);
            a.mtime = SystemTime::now();
        }
        if let Some(t) = atime {
            a.atime = time_of(t);
        }
        if let Some(t) = mtime {
            a.mtime = time_of(t);
        }
        a.ctime = SystemTime::now();
        reply.attr(&TTL, a);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.lock().nodes.get(&ino.0) {
            Some(n) if n.attr.kind == FileType::Symlink => reply.data(&n.target),
            Some(_) => reply.error(Errno::EINVAL),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if mode & libc::S_IFMT != libc::S_IFREG {
            return reply.error(Errno::EPERM);
        }
        match self.add(
            req,
            parent.0,
            name,
            FileType::RegularFile,
            mode & !umask,
            b"",
        ) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        match self.add(req, parent.0, name, FileType::Directory, mode & !umask, b"") {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn unlink(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.remove(parent.0, name, false) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn rmdir(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        match self.remove(parent.0, name, true) {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(e),
        }
    }

    fn symlink(
        &self,
        req: &Request,
        parent: INodeNo,
        link_name: &OsStr,
        target: &Path,
        reply: ReplyEntry,
    ) {
        use std::os::unix::ffi::OsStrExt;
        let t = target.as_os_str().as_bytes();
        match self.add(req, parent.0, link_name, FileType::Symlink, 0o777, t) {
            Ok(a) => reply.entry(&TTL, &a, Generation(0)),
            Err(e) => reply.error(e),
        }
    }

    fn rename(
        &self,
        _req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        // Enough for benchmarks: plain renames of files, replacing a file at the target.
        let mut st = self.lock();
        let Some(ino) = st
            .nodes
            .get(&parent.0)
            .and_then(|d| d.children.get(name))
            .copied()
        else {
            return reply.error(Errno::ENOENT);
        };
        if !st.nodes.contains_key(&newparent.0) {
            return reply.error(Errno::ENOENT);
        }
        if let Some(old) = st
            .nodes
            .get(&newparent.0)
            .and_then(|d| d.children.get(newname))
            .copied()
        {
            if st.nodes.get(&old).map(|n| n.attr.kind) == Some(FileType::Directory) {
                return reply.error(Errno::EISDIR);
            }
            st.nodes.remove(&old);
        }
        if let Some(d) = st.nodes.get_mut(&parent.0) {
            d.children.remove(name);
        }
        if let Some(d) = st.nodes.get_mut(&newparent.0) {
            d.children.insert(newname.to_owned(), ino);
        }
        if let Some(n) = st.nodes.get_mut(&ino) {
            n.parent = newparent.0;
            n.attr.ctime = SystemTime::now();
        }
        reply.ok();
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.lock().nodes.contains_key(&ino.0) {
            reply.opened(FileHandle(0), FopenFlags::empty());
        } else {
            reply.error(Errno::ENOENT);
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let len = match self.lock().nodes.get(&ino.0) {
            Some(n) => n.attr.size.saturating_sub(offset).min(size as u64) as usize,
            None => return reply.error(Errno::ENOENT),
        };
        reply.data(&vec![0u8; len]);
    }

    fn write(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        let mut st = self.lock();
        let Some(n) = st.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let end = offset.saturating_add(data.len() as u64);
        if end > n.attr.size {
            set_size(&mut n.attr, end);
        }
        let now = SystemTime::now();
        n.attr.mtime = now;
        n.attr.ctime = now;
        reply.written(data.len() as u32);
    }

    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let st = self.lock();
        let Some(dir) = st.nodes.get(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        if dir.attr.kind != FileType::Directory {
            return reply.error(Errno::ENOTDIR);
        }
        // Offsets: 1 after ".", 2 after "..", 2 + k after the k-th child (sorted by name).
        let dots = [
            (ino.0, FileType::Directory, OsStr::new(".")),
            (dir.parent, FileType::Directory, OsStr::new("..")),
        ];
        let kids = dir.children.iter().map(|(name, child)| {
            let kind = st
                .nodes
                .get(child)
                .map_or(FileType::RegularFile, |n| n.attr.kind);
            (*child, kind, name.as_os_str())
        });
        for (i, (child, kind, name)) in dots
            .into_iter()
            .chain(kids)
            .enumerate()
            .skip(offset as usize)
        {
            if reply.add(INodeNo(child), i as u64 + 1, kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn fsyncdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let files = self.lock().nodes.len() as u64;
        // 1 TiB, all free: the data goes nowhere.
        let blocks = (1u64 << 40) / BLOCK;
        reply.statfs(
            blocks,
            blocks,
            blocks,
            files,
            1 << 30,
            BLOCK as u32,
            255,
            BLOCK as u32,
        );
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        match self.add(
            req,
            parent.0,
            name,
            FileType::RegularFile,
            mode & !umask,
            b"",
        ) {
            Ok(a) => reply.created(&TTL, &a, Generation(0), FileHandle(0), FopenFlags::empty()),
            Err(e) => reply.error(e),
        }
    }

    fn fallocate(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        let mut st = self.lock();
        let Some(n) = st.nodes.get_mut(&ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let end = offset.saturating_add(length);
        if mode & libc::FALLOC_FL_KEEP_SIZE == 0 && end > n.attr.size {
            set_size(&mut n.attr, end);
        }
        reply.ok();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(dir) = args.get(1) else {
        eprintln!("usage: nullfs MOUNTPOINT [THREADS]");
        std::process::exit(2);
    };
    let threads = match args.get(2).map(|t| t.parse::<usize>()) {
        None => 4, // butter mount's default
        Some(Ok(n)) if n > 0 => n,
        Some(_) => {
            eprintln!("nullfs: THREADS must be a positive integer");
            std::process::exit(2);
        }
    };
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::RW,
        MountOption::DefaultPermissions,
        MountOption::FSName("nullfs".into()),
        MountOption::CUSTOM("subtype=nullfs".into()),
    ];
    config.acl = SessionACL::Owner;
    config.n_threads = Some(threads);
    config.clone_fd = true;
    if let Err(e) = fuser::mount(NullFs::new(), dir, &config) {
        eprintln!("nullfs: {dir}: {e}");
        std::process::exit(1);
    }
}
