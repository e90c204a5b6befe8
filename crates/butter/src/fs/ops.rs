//! The operations front ends call. Each takes its own passage through the gate
//! (crate::gate) and judges its own failure there, so a caller never picks a lock, holds
//! one across calls, or gets a lock rule wrong:
//!
//! - reads of one inode (attributes, data, link target, flags, holes) wait only for that
//!   inode's writes in progress ([`Fs::read_gate_on`]); reads of names and xattrs for none
//!   (pending writes never change them); listings and whole-filesystem reads for all;
//! - changes pass exclusively; those that may take an inode's range locks (truncate,
//!   fallocate, a write through another call, the end of an unlinked file) through its inode
//!   passage first; writes step out of the gate while their data goes to the device;
//! - a change's failure goes to its guard, which decides whether changes stop.
//!
//! An operation called by a thread that already holds the gate (the engine itself, or a test
//! that took a passage on purpose) runs under that passage instead of waiting for itself.
//!
//! The `*_as` operations apply the POSIX rules the kernel's VFS leaves to a FUSE server
//! (crate::fs::posix) for a [`Caller`], in the same passage as the change.

use super::acl;
use super::posix::{self, Caller};
use super::Fs;
use crate::error::{Error, Result};
use crate::format::items::InodeItem;
use crate::gate::Held;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::inode::namespace::{Owner, SetAttr};
use crate::inode::read::DirEntry;
use crate::inode::seek::Seek;
use crate::inode::statfs::StatFs;

/// Entries read from the trees per step of [`Fs::readdir_with`].
const READDIR_BATCH: usize = 128;

/// Where a write goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum At {
    Offset(u64),
    /// At the file's end (O_APPEND), as it is when the write runs.
    End,
}

/// What kind of inode [`Fs::create_node`] makes.
#[derive(Debug, Clone, Copy)]
pub enum NewKind<'a> {
    /// A regular file, device, FIFO or socket (the type bits of the mode say which).
    Node {
        rdev: u64,
    },
    Dir,
    Symlink {
        target: &'a [u8],
    },
}

/// A new inode for [`Fs::create_node`]: what the caller asked for, before the POSIX rules.
#[derive(Debug, Clone, Copy)]
pub struct NewNode<'a> {
    pub kind: NewKind<'a>,
    /// Type and permission bits as asked (for a directory, the permission bits only).
    pub mode: u32,
    /// The caller's umask, applied here when ACLs are enforced (the kernel applies it
    /// otherwise, and a default ACL replaces it).
    pub umask: u32,
    pub owner: Owner,
    /// Held open for a handle (released with [`Fs::release`]), as an open with O_CREAT.
    pub open: bool,
}

/// Where a listing ends ([`Fs::readdir_with`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirEnd {
    /// At this entry index (the directory's last when the listing began).
    At(u64),
    /// At the directory's last entry now (a listing from the start).
    Now,
}

/// What a rename moved: the entry renamed and the one it replaced (or exchanged with).
#[derive(Debug, Clone, Default)]
pub struct Renamed {
    pub moved: Option<DirEntry>,
    pub replaced: Option<DirEntry>,
}

/// What an `*_as` change did besides itself: the mode changed under the rules (set-id bits
/// cleared), which a front end caching attributes must drop.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Side {
    pub mode_changed: bool,
}

// ---------------------------------------------------------------------------------------------
// Passages

impl Fs {
    /// `f` under a shared passage: for `only`'s reads when given (its writes in progress
    /// complete first), else for any read (every pending write completes first).
    pub(super) fn reading<T>(
        &self,
        only: Option<Inode>,
        f: impl FnOnce(&Core) -> Result<T>,
    ) -> Result<T> {
        if crate::gate::held_here() != Held::None {
            return f(&self.core);
        }
        let _g = match only {
            Some(ino) => self.read_gate_on(ino),
            None => self.read_gate(),
        };
        f(&self.core)
    }

    /// `f` under a shared passage that completes nothing: reads of names and xattrs.
    pub(super) fn reading_as_is<T>(&self, f: impl FnOnce(&Core) -> Result<T>) -> Result<T> {
        if crate::gate::held_here() != Held::None {
            return f(&self.core);
        }
        let _g = self.core.gate.read();
        f(&self.core)
    }

    /// `f` as a change (through `on`'s inode passage when given), its failure judged by the
    /// guard. `ReadOnly` when opened read-only, `Aborted` once changes stopped.
    pub(super) fn changing<T>(
        &self,
        what: &str,
        on: Option<Inode>,
        f: impl FnOnce(&Core) -> Result<T>,
    ) -> Result<T> {
        self.change_through(what, f, || match on {
            Some(ino) => self.change_gate_on(ino),
            None => self.change_gate(),
        })
    }

    /// [`Fs::changing`] for a write to `ino`, which steps out of the gate for its data I/O.
    pub(super) fn writing<T>(&self, ino: Inode, f: impl FnOnce(&Core) -> Result<T>) -> Result<T> {
        self.change_through("write", f, || self.write_gate(ino))
    }

    /// `f` through the change passage `take` gives, or under the exclusive passage this
    /// thread holds already.
    fn change_through<'a, T>(
        &'a self,
        what: &str,
        f: impl FnOnce(&Core) -> Result<T>,
        take: impl FnOnce() -> Result<crate::gate::GateChange<'a>>,
    ) -> Result<T> {
        match crate::gate::held_here() {
            Held::Exclusive => f(&self.core),
            Held::Shared => Err(Error::Invalid(format!(
                "{what}: a change asked for under a read's passage (an engine bug)"
            ))),
            Held::None => {
                let r = {
                    let g = take()?;
                    g.settle(what, f(&self.core))
                };
                self.commit_if_dirty();
                r
            }
        }
    }

    /// The inode item, noted for the set-id rules.
    pub(super) fn item_of(&self, core: &Core, ino: Inode) -> Result<InodeItem> {
        let item = core.inode_item(ino)?;
        self.remembered.note_mode(ino, item.mode);
        Ok(item)
    }
}

// ---------------------------------------------------------------------------------------------
// Reads

impl Fs {
    /// The inode item as a reader sees it (pending writes of the inode completed).
    pub fn inode_item(&self, ino: Inode) -> Result<InodeItem> {
        self.reading(Some(ino), |c| self.item_of(c, ino))
    }

    /// `name` in directory `dir`.
    pub fn lookup(&self, dir: Inode, name: &[u8]) -> Result<Option<DirEntry>> {
        self.reading_as_is(|c| c.lookup(dir, name))
    }

    /// `name` in `dir` and its inode item: the name without waiting for any write, then the
    /// item waiting only for the target's writes.
    pub fn lookup_item(&self, dir: Inode, name: &[u8]) -> Result<Option<(DirEntry, InodeItem)>> {
        let Some(e) = self.lookup(dir, name)? else {
            return Ok(None);
        };
        let item = self.inode_item(e.target)?;
        Ok(Some((e, item)))
    }

    /// Up to `max` entries of `dir` with an index above `after`.
    pub fn readdir(&self, dir: Inode, after: u64, max: usize) -> Result<Vec<DirEntry>> {
        self.reading(None, |c| c.readdir(dir, after, max))
    }

    /// The entries of `dir` with an index above `after` and up to `end` (entries added
    /// since a listing began are not part of it), in order, each with its inode item when
    /// `items` (else `None`), given to `each` until it returns true (full) or the listing
    /// ends: one passage for the whole step. Returns the end used (for [`DirEnd::Now`],
    /// the index of the directory's last entry now).
    pub fn readdir_with(
        &self,
        dir: Inode,
        after: u64,
        end: DirEnd,
        items: bool,
        each: &mut dyn FnMut(&DirEntry, Option<&InodeItem>) -> Result<bool>,
    ) -> Result<u64> {
        self.reading(None, |c| {
            let end = match end {
                DirEnd::At(e) => e,
                DirEnd::Now => c.last_dir_index(dir)?,
            };
            let mut after = after;
            loop {
                let batch = c.readdir(dir, after, READDIR_BATCH)?;
                if batch.is_empty() {
                    return Ok(end);
                }
                for e in &batch {
                    after = e.index;
                    if e.index > end {
                        return Ok(end);
                    }
                    let item = if items {
                        Some(self.item_of(c, e.target)?)
                    } else {
                        None
                    };
                    if each(e, item.as_ref())? {
                        return Ok(end);
                    }
                }
            }
        })
    }

    /// Up to `len` bytes of `ino` from `offset`.
    pub fn read(&self, ino: Inode, offset: u64, len: usize) -> Result<Vec<u8>> {
        self.reading(Some(ino), |c| c.read(ino, offset, len))
    }

    pub fn readlink(&self, ino: Inode) -> Result<Vec<u8>> {
        self.reading(Some(ino), |c| c.readlink(ino))
    }

    pub fn getxattr(&self, ino: Inode, name: &[u8]) -> Result<Option<Vec<u8>>> {
        self.reading_as_is(|c| c.getxattr(ino, name))
    }

    pub fn listxattr(&self, ino: Inode) -> Result<Vec<Vec<u8>>> {
        self.reading_as_is(|c| c.listxattr(ino))
    }

    /// SEEK_DATA / SEEK_HOLE from `offset` (`None`: none before the end).
    pub fn seek_data_hole(&self, ino: Inode, offset: u64, what: Seek) -> Result<Option<u64>> {
        self.reading(Some(ino), |c| c.seek_data_hole(ino, offset, what))
    }

    /// The inode's flags as chattr/lsattr see them (FS_*_FL).
    pub fn get_fsflags(&self, ino: Inode) -> Result<u32> {
        self.reading(Some(ino), |c| c.get_fsflags(ino))
    }

    /// Space as statfs(2) reports it. Data freed since the last commit comes back at a
    /// commit; a read-write filesystem with some commits first, as `sync; df` does on the
    /// kernel's btrfs.
    pub fn statfs(&self) -> Result<StatFs> {
        let s = self.reading(None, |c| c.statfs())?;
        if s.pinned == 0 || !self.core.is_writable() || crate::gate::held_here() != Held::None {
            return Ok(s);
        }
        if let Err(e) = self.gated_commit() {
            log::error!("statfs: committing the space freed since the last commit: {e}");
            return Ok(s);
        }
        self.reading(None, |c| c.statfs())
    }
}

// ---------------------------------------------------------------------------------------------
// Opening and closing

impl Fs {
    /// Opens `ino` for a front end's handle (released with [`Fs::release`]): for writing
    /// when `write`, refused on a read-only subvolume (`ReadOnlySubvol`) or an immutable or
    /// (without `append`) append-only file (`NotPermitted`); with `trunc`, the file is cut to
    /// nothing by `who` under the POSIX rules. `NotFound` when the inode is gone (unlinked
    /// after the caller found it, with nothing holding it). Returns its item.
    pub fn open_file(
        &self,
        who: &dyn Caller,
        ino: Inode,
        write: bool,
        append: bool,
        trunc: bool,
    ) -> Result<(InodeItem, Side)> {
        let run = |c: &Core| {
            if write || trunc {
                c.check_open_for_write(ino, append, trunc)?;
            }
            let mut item = self.item_of(c, ino)?;
            let mut side = Side::default();
            if trunc {
                side = self.kill_for_change(c, who, ino)?;
                if item.size != 0 {
                    c.truncate(ino, 0)?;
                }
                if side.mode_changed || item.size != 0 {
                    item = self.item_of(c, ino)?;
                }
            }
            c.note_open(ino);
            Ok((item, side))
        };
        if write || trunc {
            self.changing("open", Some(ino), run)
        } else {
            self.reading(Some(ino), run)
        }
    }

    /// Opens directory `dir` for a listing: the index of its last entry now. Held open: a
    /// removed directory stays until its release, as on the kernel's filesystems.
    pub fn open_dir(&self, dir: Inode) -> Result<u64> {
        self.reading(None, |c| {
            let last = c.last_dir_index(dir)?;
            c.note_open(dir);
            Ok(last)
        })
    }

    /// Holds `ino` open without a handle (a front end's lookup reference): an unlinked file
    /// stays until the matching [`Fs::release`].
    pub fn hold(&self, ino: Inode) {
        self.core.note_open(ino);
    }
}

// ---------------------------------------------------------------------------------------------
// Changes with the POSIX rules

impl Fs {
    /// Whether ACLs are enforced: new inodes inherit their directory's default ACL (or get
    /// the umask), setting an access ACL sets the mode bits, chmod updates the ACL's mask.
    /// Off by default (ACL xattrs are stored as given); a FUSE mount whose kernel enforces
    /// ACLs turns it on.
    pub fn enforce_acls(&self, on: bool) {
        self.acls.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    fn acls(&self) -> bool {
        self.acls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Set-id bits and capabilities a change of `ino`'s data by `who` clears, cleared.
    fn kill_for_change(&self, c: &Core, who: &dyn Caller, ino: Inode) -> Result<Side> {
        self.kill_caps(c, ino)?;
        if !self.remembered.may_have_setid(ino) {
            return Ok(Side::default());
        }
        let item = c.inode_item(ino)?;
        let kill = posix::killed_by_change(who, item.mode, item.gid);
        self.set_mode(c, ino, item.mode, kill)
    }

    /// Clears `kill` from `ino`'s `mode`.
    fn set_mode(&self, c: &Core, ino: Inode, mode: u32, kill: u32) -> Result<Side> {
        if kill == 0 {
            return Ok(Side::default());
        }
        self.put_mode(c, ino, mode & 0o7777 & !kill)
    }

    /// Sets `ino`'s permission and set-id bits to `mode`, noted for the set-id rules.
    fn put_mode(&self, c: &Core, ino: Inode, mode: u32) -> Result<Side> {
        c.setattr(
            ino,
            &SetAttr {
                mode: Some(mode),
                ..Default::default()
            },
        )?;
        self.remembered.note_mode(ino, mode);
        Ok(Side { mode_changed: true })
    }

    /// Removes `security.capability` from `ino` if it has one.
    fn kill_caps(&self, c: &Core, ino: Inode) -> Result<()> {
        // Known to have none: the usual write, with nothing to look up or note.
        let has = match self.remembered.caps(ino) {
            Some(false) => return Ok(()),
            Some(true) => true,
            None => c.getxattr(ino, posix::CAPS)?.is_some(),
        };
        if has {
            match c.removexattr(ino, posix::CAPS) {
                Ok(()) | Err(Error::NoXattr(_)) => {}
                Err(e) => return Err(e),
            }
        }
        self.remembered.note_caps(ino, false);
        Ok(())
    }

    /// Creates `name` in `dir` as POSIX says: the owner as given, with the group (and for a
    /// directory the set-group-id bit) of a set-group-id directory; with ACLs enforced, the
    /// directory's default ACL (inherited as the access ACL, and as the default ACL of a new
    /// directory) or else the umask. Returns the new inode and its item.
    pub fn create_node(
        &self,
        dir: Inode,
        name: &[u8],
        new: &NewNode<'_>,
    ) -> Result<(Inode, InodeItem)> {
        self.changing("create", None, |c| {
            let d = c.inode_item(dir)?;
            let mut owner = new.owner;
            let mut mode = match new.kind {
                NewKind::Dir => posix::S_IFDIR | (new.mode & 0o7777),
                NewKind::Symlink { .. } => posix::S_IFLNK | 0o777,
                NewKind::Node { .. } => new.mode,
            };
            if d.mode & posix::S_ISGID != 0 {
                owner.gid = d.gid;
                if matches!(new.kind, NewKind::Dir) {
                    mode |= posix::S_ISGID;
                }
            }
            let acls = self.acls();
            let default_acl = if acls {
                c.getxattr(dir, acl::DEFAULT)?.and_then(|v| acl::parse(&v))
            } else {
                None
            };
            let mut access_acl = None;
            match (&default_acl, new.kind) {
                (_, NewKind::Symlink { .. }) => {}
                (Some(def), _) => {
                    let (a, m) = acl::inherit(def, mode);
                    mode = m;
                    if !acl::mode_of(&a).1 {
                        access_acl = Some(acl::encode(&a));
                    }
                }
                (None, _) if acls => mode &= !(new.umask & 0o777),
                (None, _) => {}
            }
            let ino = match new.kind {
                NewKind::Dir => c.mkdir(dir, name, mode & 0o7777, owner)?,
                NewKind::Symlink { target } => c.symlink(dir, name, target, owner)?,
                NewKind::Node { rdev } => c.mknod(dir, name, mode, rdev, owner)?,
            };
            if let Some(v) = access_acl {
                c.setxattr(ino, acl::ACCESS, &v, 0)?;
            }
            if let (Some(def), NewKind::Dir) = (&default_acl, new.kind) {
                c.setxattr(ino, acl::DEFAULT, &acl::encode(def), 0)?;
            }
            self.remembered.note_caps(ino, false);
            if new.open {
                c.note_open(ino);
            }
            Ok((ino, self.item_of(c, ino)?))
        })
    }

    /// setattr(2) by `who` under the POSIX rules: a chmod's set-group-id bit as the kernel
    /// judges it, a size change clearing set-id bits and capabilities as a write does, a
    /// chown clearing them as the kernel's chown does, and with ACLs enforced a chmod
    /// carried into the access ACL. Returns the item after.
    pub fn setattr_as(
        &self,
        who: &dyn Caller,
        ino: Inode,
        a: &SetAttr,
    ) -> Result<(InodeItem, Side)> {
        self.changing("setattr", Some(ino), |c| {
            let mut a = a.clone();
            let mut side = Side::default();
            let old = if a.mode.is_some() || a.uid.is_some() || a.gid.is_some() {
                Some(c.inode_item(ino)?)
            } else {
                None
            };
            if let (Some(m), Some(old)) = (a.mode, old.as_ref()) {
                // The kernel clears the bits a change kills with a setattr of the mode
                // without them: that passes as it is. A chmod is judged as the kernel's
                // setattr_copy judges it.
                let killed = old.mode & 0o7777 & !posix::killed_by_change(who, old.mode, old.gid);
                if !(m & 0o7777 == killed && killed != old.mode & 0o7777) {
                    a.mode = Some(posix::chmod_mode(who, m, a.gid.unwrap_or(old.gid)));
                }
            }
            if a.size.is_some() && a.mode.is_none() {
                side = self.kill_for_change(c, who, ino)?;
            }
            if a.uid.is_some() || a.gid.is_some() {
                self.kill_caps(c, ino)?;
                if let (None, Some(old)) = (a.mode, old.as_ref()) {
                    let kill = posix::killed_by_chown(old.mode);
                    if kill != 0 {
                        a.mode = Some(old.mode & 0o7777 & !kill);
                        side.mode_changed = true;
                    }
                }
            }
            c.setattr(ino, &a)?;
            if let (Some(m), true) = (a.mode, self.acls()) {
                if let Some(mut entries) =
                    c.getxattr(ino, acl::ACCESS)?.and_then(|v| acl::parse(&v))
                {
                    acl::chmod(&mut entries, m);
                    c.setxattr(ino, acl::ACCESS, &acl::encode(&entries), 0)?;
                }
            }
            Ok((self.item_of(c, ino)?, side))
        })
    }

    /// A write by `who`: set-id bits and capabilities cleared as the rules say, then the
    /// data at `at`. Returns the bytes written.
    pub fn write_as(
        &self,
        who: &dyn Caller,
        ino: Inode,
        at: At,
        data: &[u8],
    ) -> Result<(usize, Side)> {
        self.writing(ino, |c| {
            let side = self.kill_for_change(c, who, ino)?;
            let offset = match at {
                At::Offset(o) => o,
                At::End => c.inode_item(ino)?.size,
            };
            Ok((c.write(ino, offset, data)?, side))
        })
    }

    /// fallocate(2) by `who`: as [`Fs::fallocate`] (in memory at the file's end where it
    /// can), the set-id bits and capabilities cleared first as the rules say. `Unsupported`
    /// for a mode btrfs has not.
    pub fn fallocate_as(
        &self,
        who: &dyn Caller,
        ino: Inode,
        mode: u32,
        offset: u64,
        len: u64,
    ) -> Result<Side> {
        if !self.remembered.may_have_setid(ino)
            && self.remembered.caps(ino) == Some(false)
            && self.fallocate_in_memory_gated(ino, mode, offset, len)
        {
            return Ok(Side::default());
        }
        self.changing("fallocate", Some(ino), |c| {
            let side = self.kill_for_change(c, who, ino)?;
            c.fallocate(ino, mode, offset, len)?;
            Ok(side)
        })
    }

    /// copy_file_range(2) by `who`: cloned where it can, copied otherwise; the target's set-id
    /// bits and capabilities cleared first. Returns the bytes copied.
    pub fn copy_file_range_as(
        &self,
        who: &dyn Caller,
        src: Inode,
        src_off: u64,
        dst: Inode,
        dst_off: u64,
        len: u64,
    ) -> Result<(u64, Side)> {
        self.changing("copy_file_range", Some(dst), |c| {
            let side = self.kill_for_change(c, who, dst)?;
            Ok((c.copy_file_range(src, src_off, dst, dst_off, len)?, side))
        })
    }

    /// setxattr(2) by `who`. With ACLs enforced, an access ACL sets the mode's permission
    /// bits (and is not stored when the mode says all of it) and a chmod's set-group-id rule
    /// applies; a default ACL goes on directories only (`NotPermitted` elsewhere, as EACCES)
    /// and must parse (`Invalid`).
    pub fn setxattr_as(
        &self,
        who: &dyn Caller,
        ino: Inode,
        name: &[u8],
        value: &[u8],
        flags: u32,
    ) -> Result<Side> {
        self.changing("setxattr", None, |c| {
            if name == posix::CAPS {
                self.remembered.note_caps(ino, true);
            }
            if !self.acls() || (name != acl::ACCESS && name != acl::DEFAULT) {
                c.setxattr(ino, name, value, flags)?;
                return Ok(Side::default());
            }
            let entries =
                acl::parse(value).ok_or_else(|| Error::Invalid("malformed POSIX ACL".into()))?;
            let item = c.inode_item(ino)?;
            if name == acl::DEFAULT {
                if item.mode & posix::S_IFMT != posix::S_IFDIR {
                    return Err(Error::AccessDenied(format!(
                        "inode {}: a default ACL is only for directories",
                        ino.ino
                    )));
                }
                c.setxattr(ino, name, value, flags)?;
                return Ok(Side::default());
            }
            let (bits, equiv) = acl::mode_of(&entries);
            if equiv {
                if c.getxattr(ino, acl::ACCESS)?.is_some() {
                    c.removexattr(ino, acl::ACCESS)?;
                } else if flags & 2 != 0 {
                    return Err(Error::NoXattr(format!(
                        "inode {}: no access ACL to replace",
                        ino.ino
                    )));
                }
            } else {
                c.setxattr(ino, acl::ACCESS, value, flags)?;
            }
            // As a chmod: set-group-id goes unless the caller is in the file's group.
            let mode = posix::chmod_mode(who, (item.mode & 0o7000) | bits, item.gid);
            if mode != item.mode & 0o7777 {
                return self.put_mode(c, ino, mode);
            }
            Ok(Side::default())
        })
    }

    /// Sets the inode flags in `mask` to those of `flags` (FS_*_FL), keeping the others.
    pub fn set_fsflags_masked(&self, ino: Inode, flags: u32, mask: u32) -> Result<()> {
        self.changing("setflags", None, |c| {
            let old = c.get_fsflags(ino)?;
            c.set_fsflags(ino, (old & !mask) | (flags & mask))
        })
    }
}
