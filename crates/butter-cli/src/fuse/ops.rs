//! The adapter's operations, one per FUSE request, independent of the transport: each takes
//! the request's arguments as plain values and returns its answer (or an errno), which the
//! transport encodes, fuser's `/dev/fuse` loops ([`super::ButterFuse`]) and the io_uring
//! queues (crate::fuse::ring) alike. Each is one engine call (which takes its own passage
//! through the engine's gate) plus the adapter's own bookkeeping (node ids, lookup counts,
//! handles).

use super::{fs_err, negative_entry, Adapter, Handle, OpError, OpResult, BULK_WRITE, NAME_MAX};
use crate::setid::Caller;
use butter::fs::{At, Inode, NewKind, NewNode};
use butter::inode::namespace::{Owner, SetAttr};
use butter::inode::seek::Seek;
use butter::Error;
use fuser::{Errno, FileAttr, FileType, FopenFlags, INodeNo};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// A found or made entry: what the kernel caches, and for how long.
pub(crate) struct EntryOut {
    /// Node id 0: a negative entry (the name is missing).
    pub attr: FileAttr,
    pub entry_ttl: Duration,
    pub attr_ttl: Duration,
}

/// An open file or directory.
pub(crate) struct OpenOut {
    pub fh: u64,
    pub flags: FopenFlags,
}

/// statfs, in the units FUSE reports.
pub(crate) struct StatfsOut {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub bsize: u32,
    pub namelen: u32,
}

/// What readdir adds an entry with: `(st_ino, next offset, kind, name)`, true when full.
pub(crate) type DirAdd<'a> = &'a mut dyn FnMut(u64, u64, FileType, &[u8]) -> bool;

/// A getxattr/listxattr answer: the size for a size-0 probe, else the bytes.
pub(crate) enum XattrOut {
    Size(u32),
    Data(Vec<u8>),
}

/// A new inode as the request asks for it, owned by its caller; `open` holds it for a
/// handle (create).
fn new_node<'a>(c: &Caller, kind: NewKind<'a>, mode: u32, umask: u32, open: bool) -> NewNode<'a> {
    NewNode {
        kind,
        mode,
        umask,
        owner: Owner {
            uid: c.uid,
            gid: c.gid,
        },
        open,
    }
}

/// The answer to a getxattr/listxattr of `value` into a buffer of `size` bytes: ERANGE when
/// it does not fit.
fn xattr_out(size: u32, value: Vec<u8>) -> Result<XattrOut, Errno> {
    let len = u32::try_from(value.len()).map_err(|_| Errno::from_i32(libc::E2BIG))?;
    if size == 0 {
        Ok(XattrOut::Size(len))
    } else if len > size {
        Err(Errno::from_i32(libc::ERANGE))
    } else {
        Ok(XattrOut::Data(value))
    }
}

impl Adapter {
    /// An entry answer for `attr`, counting the kernel's new reference to it.
    fn entry_out(&self, attr: FileAttr) -> EntryOut {
        self.looked_up(&attr);
        EntryOut {
            attr,
            entry_ttl: self.caching.entry,
            attr_ttl: self.caching.attr,
        }
    }

    fn entry_reply(&self, r: Result<FileAttr, Errno>) -> Result<EntryOut, Errno> {
        r.map(|a| self.entry_out(a))
    }

    pub(crate) fn lookup(&self, parent: u64, name: &[u8]) -> Result<EntryOut, Errno> {
        // "." and ".." (the kernel asks for them to decode a file handle) name no child of
        // `parent`: nothing to remember as the target's parent, and the node id goes in the
        // reply's ino (the mounted root must come back as node 1, the kernel's root, or a
        // handle's path never reaches it).
        let r = self.guard("lookup", parent, || {
            let dir = self.inode(parent)?;
            if name.len() > NAME_MAX {
                return Err(OpError::Quiet(libc::ENAMETOOLONG));
            }
            let dot = |target: Inode| -> OpResult<FileAttr> {
                let node = self.map.node_id(target);
                let attr = self.attr(node, target)?;
                Ok(FileAttr {
                    ino: INodeNo(node),
                    ..attr
                })
            };
            match name {
                b"." => dot(dir),
                b".." => dot(self.parent_dir(parent, dir)?),
                _ => match self.fs.lookup_item(dir, name).map_err(fs_err)? {
                    Some((e, item)) => self.entry(parent, e.target, &item),
                    None => Err(OpError::Quiet(libc::ENOENT)),
                },
            }
        });
        if matches!(r, Err(e) if e.code() == libc::ENOENT) && !self.caching.negative.is_zero() {
            // A negative entry (node id 0) the kernel keeps: the next lookup of the name
            // does not come here; a create of it does, and makes the entry positive.
            return Ok(EntryOut {
                attr: negative_entry(),
                entry_ttl: self.caching.negative,
                attr_ttl: self.caching.negative,
            });
        }
        self.entry_reply(r)
    }

    pub(crate) fn forget(&self, node: u64, nlookup: u64) {
        let mut l = self.lookups.lock().unwrap_or_else(|e| e.into_inner());
        let gone = match l.get_mut(&node) {
            Some((n, _)) => {
                *n = n.saturating_sub(nlookup);
                *n == 0
            }
            None => false,
        };
        if gone {
            let held = l.remove(&node).and_then(|(_, held)| held);
            drop(l);
            if let Some(i) = held {
                self.unhold(node, i);
            }
            // The kernel no longer knows the node: it asks for ".." of it no more. Node ids
            // themselves stay valid (stable inode numbers), so nothing else is freed.
            if node != INodeNo::ROOT.0 {
                self.parents
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .remove(&node);
            }
        }
    }

    pub(crate) fn getattr(&self, node: u64) -> Result<FileAttr, Errno> {
        self.guard("getattr", node, || self.attr(node, self.inode(node)?))
    }

    pub(crate) fn setattr(&self, c: &Caller, node: u64, a: &SetAttr) -> Result<FileAttr, Errno> {
        self.change("setattr", node, || {
            let i = self.inode(node)?;
            let (item, _) = self.fs.setattr_as(c, i, a).map_err(fs_err)?;
            self.attr_of(node, i, &item)
        })
    }

    pub(crate) fn readlink(&self, node: u64) -> Result<Vec<u8>, Errno> {
        self.guard("readlink", node, || {
            Ok(self.fs.readlink(self.inode(node)?)?)
        })
    }

    /// mknod, mkdir and symlink: a new inode of `kind` named `name` in `parent`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn make(
        &self,
        op: &str,
        c: &Caller,
        parent: u64,
        name: &[u8],
        kind: NewKind<'_>,
        mode: u32,
        umask: u32,
    ) -> Result<EntryOut, Errno> {
        let r = self.change(op, parent, || {
            let new = new_node(c, kind, mode, umask, false);
            Ok(self.create_node(parent, name, &new)?.1)
        });
        self.entry_reply(r)
    }

    pub(crate) fn unlink(&self, parent: u64, name: &[u8]) -> Result<(), Errno> {
        self.change("unlink", parent, || {
            self.fs.unlink(self.inode(parent)?, name).map_err(fs_err)
        })
    }

    pub(crate) fn rmdir(&self, parent: u64, name: &[u8]) -> Result<(), Errno> {
        self.change("rmdir", parent, || {
            self.fs.rmdir(self.inode(parent)?, name).map_err(fs_err)
        })
    }

    /// rename and rename2: `flags` are RENAME_* of renameat2(2).
    pub(crate) fn rename(
        &self,
        parent: u64,
        name: &[u8],
        newparent: u64,
        newname: &[u8],
        flags: u32,
    ) -> Result<(), Errno> {
        use butter::inode::namespace::{RENAME_EXCHANGE, RENAME_NOREPLACE};
        self.change("rename", parent, || {
            let from_dir = self.inode(parent)?;
            let to_dir = self.inode(newparent)?;
            let mut f = 0;
            if flags & libc::RENAME_NOREPLACE != 0 {
                f |= RENAME_NOREPLACE;
            }
            if flags & libc::RENAME_EXCHANGE != 0 {
                f |= RENAME_EXCHANGE;
            }
            if flags & libc::RENAME_WHITEOUT != 0 {
                return Err(OpError::Quiet(libc::EINVAL));
            }
            let moved = self
                .fs
                .rename(from_dir, name, to_dir, newname, f)
                .map_err(fs_err)?;
            // Directories moved keep ".." right.
            if let Some(s) = moved.moved.filter(|s| s.mode_type() == libc::S_IFDIR) {
                self.remember_parent(self.map.node_id(s.target), newparent);
            }
            if f & RENAME_EXCHANGE != 0 {
                if let Some(d) = moved.replaced.filter(|d| d.mode_type() == libc::S_IFDIR) {
                    self.remember_parent(self.map.node_id(d.target), parent);
                }
            }
            Ok(())
        })
    }

    pub(crate) fn link(
        &self,
        node: u64,
        newparent: u64,
        newname: &[u8],
    ) -> Result<EntryOut, Errno> {
        let r = self.change("link", node, || {
            let i = self.inode(node)?;
            let item = self
                .fs
                .link(i, self.inode(newparent)?, newname)
                .map_err(fs_err)?;
            self.entry(newparent, i, &item)
        });
        self.entry_reply(r)
    }

    /// open(2) of a file with `flags` (O_*).
    pub(crate) fn open(&self, c: &Caller, node: u64, flags: i32) -> Result<OpenOut, Errno> {
        let writing = flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0;
        if writing && !self.writable {
            return Err(Errno::from_i32(libc::EROFS));
        }
        // A read-only subvolume (EROFS), an immutable or append-only file (EPERM): the
        // engine refuses the open, not the first write. An inode an unlink deleted between
        // the kernel's lookup and this open (nothing held it) fails as it would have after
        // the unlink (ENOENT), not the reads after it.
        let fh = self.guard("open", node, || {
            let i = self.inode(node)?;
            let (_, side) = self
                .fs
                .open_file(
                    c,
                    i,
                    writing,
                    flags & libc::O_APPEND != 0,
                    flags & libc::O_TRUNC != 0,
                )
                .map_err(fs_err)?;
            self.after(node, side);
            Ok(self.new_handle(i, flags))
        })?;
        Ok(OpenOut {
            fh,
            flags: self.fopen_flags(flags),
        })
    }

    pub(crate) fn create(
        &self,
        c: &Caller,
        parent: u64,
        name: &[u8],
        mode: u32,
        umask: u32,
        flags: i32,
    ) -> Result<(EntryOut, OpenOut), Errno> {
        let (attr, fh) = self.change("create", parent, || {
            let mode = if mode & libc::S_IFMT == 0 {
                mode | libc::S_IFREG
            } else {
                mode
            };
            let new = new_node(c, NewKind::Node { rdev: 0 }, mode, umask, true);
            let (i, attr) = self.create_node(parent, name, &new)?;
            Ok((attr, self.new_handle(i, flags)))
        })?;
        Ok((
            self.entry_out(attr),
            OpenOut {
                fh,
                flags: self.fopen_flags(flags),
            },
        ))
    }

    pub(crate) fn read(&self, node: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        self.guard("read", node, || {
            Ok(self.fs.read(self.inode(node)?, offset, size as usize)?)
        })
    }

    /// A write of `data` at `offset` through handle `fh` (opened with `flags`);
    /// `from_page`: a page written back from a shared mapping (FUSE_WRITE_CACHE).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn write(
        &self,
        c: &Caller,
        node: u64,
        fh: u64,
        offset: u64,
        data: &[u8],
        from_page: bool,
        flags: i32,
    ) -> Result<u32, Errno> {
        let serve = || {
            self.change("write", node, || {
                let i = self.inode(node)?;
                // A page written back from a shared mapping goes where the page is, even
                // through a handle opened with O_APPEND.
                let append = !from_page
                    && (flags & libc::O_APPEND != 0
                        || self
                            .handles
                            .lock()
                            .unwrap_or_else(|e| e.into_inner())
                            .get(&fh)
                            .is_some_and(|h| h.append));
                let at = if append { At::End } else { At::Offset(offset) };
                let (n, side) = self.fs.write_as(c, i, at, data).map_err(fs_err)?;
                self.after(node, side);
                Ok(u32::try_from(n).unwrap_or(u32::MAX))
            })
        };
        // A large write's engine work goes to the file's bulk lane (crate::bulk); small ones
        // are served here.
        match &self.bulk {
            Some(bulk) if data.len() >= BULK_WRITE => {
                let mut r = Err(Errno::EIO);
                bulk.run(node, || r = serve());
                r
            }
            _ => serve(),
        }
    }

    /// The end of a handle on `ino` (none: a handle never handed out): the engine deletes
    /// the last handle's unlinked file or removed directory (Fs::release).
    fn release_inode(&self, op: &str, node: u64, ino: Option<Inode>) -> Result<(), Errno> {
        let Some(ino) = ino else {
            return Ok(());
        };
        self.guard(op, node, || Ok(self.fs.release(ino)?))
    }

    pub(crate) fn release(&self, node: u64, fh: u64) -> Result<(), Errno> {
        let h = self
            .handles
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&fh);
        self.release_inode("release", node, h.map(|h: Handle| h.ino))
    }

    /// fsync and fsyncdir: the inode's changes (or, where the engine cannot log them, all
    /// changes) are durable when this returns.
    pub(crate) fn fsync(&self, op: &str, node: u64, datasync: bool) -> Result<(), Errno> {
        self.guard(op, node, || {
            if !self.writable {
                return Ok(());
            }
            let i = self.inode(node)?;
            self.fs
                .fsync(i, datasync)
                .map_err(|e| OpError::Edge(libc::EIO, format!("{op}: {e}")))
        })
    }

    pub(crate) fn opendir(&self, node: u64) -> Result<OpenOut, Errno> {
        let fh = self.guard("opendir", node, || {
            let i = self.inode(node)?;
            // Held open: removed meanwhile (rmdir, a rename over it), it stays until the
            // release, with nlink 0, as on the kernel's filesystems.
            let last = self.fs.open_dir(i)?;
            let fh = self.next_fh.fetch_add(1, Ordering::Relaxed);
            self.dirs
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(fh, (i, last));
            Ok(fh)
        })?;
        Ok(OpenOut {
            fh,
            flags: if self.caching.keep_cache {
                FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_CACHE_DIR
            } else {
                FopenFlags::empty()
            },
        })
    }

    pub(crate) fn releasedir(&self, node: u64, fh: u64) -> Result<(), Errno> {
        let d = self
            .dirs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&fh);
        self.release_inode("releasedir", node, d.map(|d| d.0))
    }

    /// readdir: `add(st_ino, next offset, kind, name)` returns true when the reply is full.
    pub(crate) fn readdir(
        &self,
        node: u64,
        fh: u64,
        offset: u64,
        add: DirAdd<'_>,
    ) -> Result<(), Errno> {
        self.guard("readdir", node, || {
            let dir = self.inode(node)?;
            let parent = self.map.node_id(self.parent_dir(node, dir)?);
            self.fill_dir(node, fh, offset, false, |name, next, e| {
                let (st_ino, kind) = match e {
                    None if name == b"." => (self.map.st_ino(node), FileType::Directory),
                    None => (self.map.st_ino(parent), FileType::Directory),
                    Some((e, item)) => (
                        self.map.st_ino(self.map.node_id(e.target)),
                        self.entry_kind(e, item)?,
                    ),
                };
                Ok(add(st_ino, next, kind, name))
            })
        })
    }

    /// readdirplus: `add(name, next offset, entry)` returns true when the reply is full.
    pub(crate) fn readdirplus(
        &self,
        node: u64,
        fh: u64,
        offset: u64,
        add: &mut dyn FnMut(&[u8], u64, &EntryOut) -> bool,
    ) -> Result<(), Errno> {
        self.guard("readdirplus", node, || {
            let dir = self.inode(node)?;
            let parent = self.map.node_id(self.parent_dir(node, dir)?);
            // The kernel ignores the attributes sent with "." and "..": a blank set will do.
            self.fill_dir(node, fh, offset, true, |name, next, e| {
                let attr = match e {
                    None => {
                        let n = if name == b"." { node } else { parent };
                        FileAttr {
                            ino: INodeNo(self.map.st_ino(n)),
                            kind: FileType::Directory,
                            ..negative_entry()
                        }
                    }
                    Some((e, Some(item))) => self.entry(node, e.target, item)?,
                    Some((e, None)) => {
                        self.entry(node, e.target, &self.fs.inode_item(e.target)?)?
                    }
                };
                let out = EntryOut {
                    attr,
                    entry_ttl: self.caching.entry,
                    attr_ttl: self.caching.attr,
                };
                let full = add(name, next, &out);
                // The kernel takes a reference for every entry it accepts, except the dots.
                if !full && e.is_some() {
                    self.looked_up(&out.attr);
                }
                Ok(full)
            })
        })
    }

    pub(crate) fn statfs(&self) -> Result<StatfsOut, Errno> {
        // Data freed since the last commit (a file removed) comes back at the commit;
        // `sync` cannot ask for one (the kernel sends FUSE_SYNCFS to virtiofs only), so the
        // engine commits on a look at the free space, as `sync; df` does on the kernel's
        // btrfs.
        let s = self.guard("statfs", INodeNo::ROOT.0, || Ok(self.fs.statfs()?))?;
        let bs = u64::from(s.bsize.max(1));
        let free = s.free / bs;
        Ok(StatfsOut {
            blocks: s.total / bs,
            bfree: (s.unused / bs).max(free),
            bavail: free,
            bsize: s.bsize,
            namelen: NAME_MAX as u32,
        })
    }

    pub(crate) fn setxattr(
        &self,
        c: &Caller,
        node: u64,
        name: &[u8],
        value: &[u8],
        flags: i32,
    ) -> Result<(), Errno> {
        self.change("setxattr", node, || {
            let i = self.inode(node)?;
            let flags = (flags & (libc::XATTR_CREATE | libc::XATTR_REPLACE)) as u32;
            let side = self
                .fs
                .setxattr_as(c, i, name, value, flags)
                .map_err(|e| match e {
                    Error::Invalid(_) => OpError::Quiet(libc::EINVAL),
                    e => fs_err(e),
                })?;
            self.after(node, side);
            Ok(())
        })
    }

    pub(crate) fn getxattr(&self, node: u64, name: &[u8], size: u32) -> Result<XattrOut, Errno> {
        let value = self.guard("getxattr", node, || {
            self.fs
                .getxattr(self.inode(node)?, name)?
                .ok_or(OpError::Quiet(libc::ENODATA))
        })?;
        xattr_out(size, value)
    }

    pub(crate) fn listxattr(&self, node: u64, size: u32) -> Result<XattrOut, Errno> {
        let list = self.guard("listxattr", node, || {
            let mut out = Vec::new();
            for name in self.fs.listxattr(self.inode(node)?)? {
                out.extend_from_slice(&name);
                out.push(0);
            }
            Ok(out)
        })?;
        xattr_out(size, list)
    }

    pub(crate) fn removexattr(&self, node: u64, name: &[u8]) -> Result<(), Errno> {
        self.change("removexattr", node, || {
            self.fs.removexattr(self.inode(node)?, name).map_err(fs_err)
        })
    }

    /// The inode flags of chattr/lsattr. The kernel sends these itself (fileattr_get/set)
    /// after its own checks (owner, CAP_LINUX_IMMUTABLE), always with a 4-byte flags word
    /// or a struct fsxattr. The answer is the ioctl's out data (its result is 0).
    pub(crate) fn ioctl(
        &self,
        node: u64,
        uid: u32,
        cmd: u32,
        in_data: &[u8],
        out_size: u32,
    ) -> Result<Vec<u8>, Errno> {
        // The kernel's resize, device add, removal and replace and balance, for `butter
        // filesystem resize`, `butter device add|remove|replace` and `butter balance start`
        // given the mount point (btrfs-progs
        // refuses a FUSE mount by its statfs magic before it gets here). Root only, as the
        // kernel wants CAP_SYS_ADMIN. Each runs to its end inside the request (the kernel's
        // replace runs in the background and is polled; here START returns when done).
        const BTRFS_IOC_RESIZE: u32 = 0x5000_9403;
        const BTRFS_IOC_ADD_DEV: u32 = 0x5000_940a;
        const BTRFS_IOC_RM_DEV_V2: u32 = 0x5000_943a;
        const BTRFS_IOC_DEV_REPLACE: u32 = 0xca28_9435;
        const BTRFS_IOC_BALANCE_V2: u32 = 0xc400_9420;
        const BTRFS_DEVICE_SPEC_BY_ID: u64 = 1 << 3;
        let admin_err = |e: Error| match e {
            Error::Unsupported(_) => OpError::Quiet(libc::EOPNOTSUPP),
            Error::Invalid(_) => OpError::Quiet(libc::EINVAL),
            Error::NoSpace(_) => OpError::Quiet(libc::ENOSPC),
            Error::NotFound(_) => OpError::Quiet(libc::ENOENT),
            e => fs_err(e),
        };
        // A NUL-terminated path in `in_data[at..at + max]`.
        let name_at = |at: usize, max: usize| -> String {
            let name = in_data
                .get(at..(at + max).min(in_data.len()))
                .unwrap_or_default();
            let name = &name[..name.iter().position(|&c| c == 0).unwrap_or(name.len())];
            String::from_utf8_lossy(name).into_owned()
        };
        // The devid a path (as given at mount, or any path to the same file) or `missing`
        // names.
        let devid_named = |name: &str| -> Result<u64, OpError> {
            let devs = self.fs.devices().map_err(fs_err)?;
            let canon = |p: &str| std::fs::canonicalize(p).ok();
            let found = if name == "missing" {
                devs.iter().find(|d| d.path.is_none())
            } else {
                devs.iter().find(|d| {
                    d.path
                        .as_deref()
                        .is_some_and(|p| p == name || canon(p) == canon(name))
                })
            };
            found.map(|d| d.devid).ok_or(OpError::Quiet(libc::ENOENT))
        };
        // A device to add, opened by the mount (a new member: nothing else may hold it).
        let open_target = |name: &str| -> Result<_, OpError> {
            crate::cmd::device::open_new(std::path::Path::new(name)).map_err(|e| {
                log::error!("{}", e.0);
                OpError::Quiet(libc::EBUSY)
            })
        };
        if matches!(
            cmd,
            BTRFS_IOC_RESIZE
                | BTRFS_IOC_ADD_DEV
                | BTRFS_IOC_RM_DEV_V2
                | BTRFS_IOC_DEV_REPLACE
                | BTRFS_IOC_BALANCE_V2
        ) {
            if uid != 0 {
                return Err(Errno::from_i32(libc::EPERM));
            }
            return self.change("device or balance ioctl", node, || {
                if cmd == BTRFS_IOC_RESIZE {
                    // struct btrfs_ioctl_vol_args: fd (8 bytes), then "[devid:]size".
                    let spec = name_at(8, 4088);
                    let done = crate::cmd::filesystem::resize_on(&self.fs, &spec, &mut |m| {
                        log::info!("{m}")
                    })
                    .map_err(|e| {
                        // The reason goes to the mount's log (the request carries no text).
                        log::error!("resize ({spec}): {}", e.0);
                        OpError::Quiet(libc::EINVAL)
                    })?;
                    log::info!("{done}");
                    return Ok(Vec::new());
                }
                if cmd == BTRFS_IOC_ADD_DEV {
                    // struct btrfs_ioctl_vol_args: fd (8 bytes), then the path.
                    let name = name_at(8, 4088);
                    let dev = open_target(&name)?;
                    self.fs.add_device(dev, &name).map_err(admin_err)?;
                    return Ok(Vec::new());
                }
                if cmd == BTRFS_IOC_DEV_REPLACE {
                    // struct btrfs_ioctl_dev_replace_args: cmd, result, then the start
                    // parameters: srcdevid, the read mode, srcdev_name and tgtdev_name (1025
                    // bytes each).
                    let word = |o: usize| -> Option<u64> {
                        Some(u64::from_le_bytes(in_data.get(o..o + 8)?.try_into().ok()?))
                    };
                    if word(0) != Some(0) {
                        // Only START: the replace has ended by the time it returns, so there
                        // is nothing to poll or cancel.
                        return Err(OpError::Quiet(libc::EOPNOTSUPP));
                    }
                    let src = match word(16).ok_or(OpError::Quiet(libc::EINVAL))? {
                        0 => devid_named(&name_at(32, 1025))?,
                        id => id,
                    };
                    let target = name_at(32 + 1025, 1025);
                    let dev = open_target(&target)?;
                    self.fs
                        .replace_device(src, dev, &target, &mut |m| log::info!("{m}"))
                        .map_err(admin_err)?;
                    let mut out = in_data.to_vec();
                    out.resize(out_size as usize, 0);
                    // result: BTRFS_IOCTL_DEV_REPLACE_RESULT_NO_ERROR.
                    if let Some(result) = out.get_mut(8..16) {
                        result.fill(0);
                    }
                    return Ok(out);
                }
                if cmd == BTRFS_IOC_BALANCE_V2 {
                    let req = butter::inode::balance::BalanceRequest::from_ioctl_args(in_data)
                        .map_err(|_| OpError::Quiet(libc::EINVAL))?;
                    let report = self
                        .fs
                        .balance(Some(&req), &mut |m| log::info!("{m}"), &mut |_, _| false)
                        .map_err(admin_err)?;
                    let mut out = req.to_ioctl_args(Some(&report));
                    out.truncate(out_size as usize);
                    return Ok(out);
                }
                let u64_at = |o: usize| -> Option<u64> {
                    Some(u64::from_le_bytes(in_data.get(o..o + 8)?.try_into().ok()?))
                };
                let flags = u64_at(16).ok_or(OpError::Quiet(libc::EINVAL))?;
                let devid = if flags & BTRFS_DEVICE_SPEC_BY_ID != 0 {
                    u64_at(56).ok_or(OpError::Quiet(libc::EINVAL))?
                } else {
                    devid_named(&name_at(56, 4040))?
                };
                self.fs
                    .remove_device(devid, &mut |m| log::info!("{m}"))
                    .map_err(admin_err)?;
                Ok(Vec::new())
            });
        }
        const FS_IOC_GETFLAGS: u32 = 0x8008_6601;
        const FS_IOC_SETFLAGS: u32 = 0x4008_6602;
        const FS_IOC32_GETFLAGS: u32 = 0x8004_6601;
        const FS_IOC32_SETFLAGS: u32 = 0x4004_6602;
        const FS_IOC_FSGETXATTR: u32 = 0x801c_581f;
        const FS_IOC_FSSETXATTR: u32 = 0x401c_5820;
        const FSXATTR_SIZE: usize = 28;
        use butter::inode::flags as fl;
        let word =
            |d: &[u8]| -> Option<u32> { Some(u32::from_le_bytes(d.get(..4)?.try_into().ok()?)) };
        let set_err = |e: Error| match e {
            Error::Unsupported(_) => OpError::Quiet(libc::EOPNOTSUPP),
            Error::Invalid(_) => OpError::Quiet(libc::EINVAL),
            e => fs_err(e),
        };
        match cmd {
            FS_IOC_GETFLAGS | FS_IOC32_GETFLAGS => self.guard("getflags", node, || {
                let f = self.fs.get_fsflags(self.inode(node)?)?;
                let n = (out_size as usize).min(8);
                Ok(u64::from(f).to_le_bytes()[..n].to_vec())
            }),
            FS_IOC_SETFLAGS | FS_IOC32_SETFLAGS => self.change("setflags", node, || {
                let f = word(in_data).ok_or(OpError::Quiet(libc::EINVAL))?;
                self.fs.set_fsflags(self.inode(node)?, f).map_err(set_err)?;
                self.forget_attrs(node);
                Ok(Vec::new())
            }),
            FS_IOC_FSGETXATTR => self.guard("fsgetxattr", node, || {
                let f = self.fs.get_fsflags(self.inode(node)?)?;
                let mut out = vec![0u8; FSXATTR_SIZE];
                out[..4].copy_from_slice(&fl::fsflags_to_xflags(f).to_le_bytes());
                out.truncate(out_size as usize);
                Ok(out)
            }),
            FS_IOC_FSSETXATTR => self.change("fssetxattr", node, || {
                if in_data.len() < 16 {
                    return Err(OpError::Quiet(libc::EINVAL));
                }
                let x = word(in_data).ok_or(OpError::Quiet(libc::EINVAL))?;
                // extsize, projid, cowextsize: btrfs has none of them.
                let extra = [4usize, 12, 16]
                    .iter()
                    .any(|&o| word(&in_data[o.min(in_data.len())..]).is_some_and(|v| v != 0));
                let mapped = fl::xflags_to_fsflags(x).filter(|_| !extra);
                let mapped = mapped.ok_or(OpError::Quiet(libc::EOPNOTSUPP))?;
                let common = fl::FS_IMMUTABLE_FL
                    | fl::FS_APPEND_FL
                    | fl::FS_SYNC_FL
                    | fl::FS_NOATIME_FL
                    | fl::FS_NODUMP_FL;
                self.fs
                    .set_fsflags_masked(self.inode(node)?, mapped, common)
                    .map_err(set_err)?;
                self.forget_attrs(node);
                Ok(Vec::new())
            }),
            _ => Err(Errno::from_i32(libc::ENOTTY)),
        }
    }

    pub(crate) fn fallocate(
        &self,
        c: &Caller,
        node: u64,
        offset: u64,
        length: u64,
        mode: i32,
    ) -> Result<(), Errno> {
        // An fallocate at the file's end is served in memory by the engine (delayed
        // preallocation), beside other files' changes.
        self.change("fallocate", node, || {
            let known =
                libc::FALLOC_FL_KEEP_SIZE | libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_ZERO_RANGE;
            if mode & !known != 0 || mode < 0 {
                return Err(OpError::Quiet(libc::EOPNOTSUPP));
            }
            let i = self.inode(node)?;
            let side = self
                .fs
                .fallocate_as(c, i, mode as u32, offset, length)
                .map_err(|e| match e {
                    Error::Unsupported(_) => OpError::Quiet(libc::EOPNOTSUPP),
                    e => fs_err(e),
                })?;
            self.after(node, side);
            Ok(())
        })
    }

    pub(crate) fn lseek(&self, node: u64, offset: i64, whence: i32) -> Result<i64, Errno> {
        self.guard("lseek", node, || {
            let what = match whence {
                libc::SEEK_DATA => Seek::Data,
                libc::SEEK_HOLE => Seek::Hole,
                _ => return Err(OpError::Quiet(libc::EINVAL)),
            };
            let offset = u64::try_from(offset).map_err(|_| OpError::Quiet(libc::ENXIO))?;
            let at = self
                .fs
                .seek_data_hole(self.inode(node)?, offset, what)?
                .ok_or(OpError::Quiet(libc::ENXIO))?;
            i64::try_from(at).map_err(|_| OpError::Quiet(libc::EOVERFLOW))
        })
    }

    /// Cloned where the engine can, copied otherwise; the reply counts bytes in 32 bits.
    pub(crate) fn copy_file_range(
        &self,
        c: &Caller,
        (node_in, offset_in): (u64, u64),
        (node_out, offset_out): (u64, u64),
        len: u64,
    ) -> Result<u32, Errno> {
        self.change("copy_file_range", node_in, || {
            let src = self.inode(node_in)?;
            let dst = self.inode(node_out)?;
            let (n, side) = self
                .fs
                .copy_file_range_as(c, src, offset_in, dst, offset_out, len.min(1 << 30))
                .map_err(fs_err)?;
            self.after(node_out, side);
            Ok(n as u32)
        })
    }

    /// With default_permissions the kernel checks modes itself and does not ask; this only
    /// refuses writing on a read-only mount.
    pub(crate) fn access(&self, mask: i32) -> Result<(), Errno> {
        if mask & libc::W_OK != 0 && !self.writable {
            Err(Errno::from_i32(libc::EROFS))
        } else {
            Ok(())
        }
    }
}
