//! Write operations of the filesystem facade: namespace changes (create, mkdir, mknod,
//! symlink, link, unlink, rmdir, rename), attributes and xattrs. File data lives in
//! [`crate::inode::file`].
//!
//! Every operation runs inside the running transaction of the [`Writer`]; nothing is durable
//! until [`Core::commit`]. Items are kept the way the kernel keeps them: DIR_ITEM (by name hash)
//! and DIR_INDEX (by sequence, from 2) per entry, INODE_REF per (inode, parent) with extended
//! refs when a ref item would be too large, directory i_size = 2 x the sum of name lengths,
//! directories with nlink 1, and inode transid / sequence / ctime updated on each change.

use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::io::disk_io::Disk;
use crate::transaction::Writer;
use std::sync::{Arc, MutexGuard};

/// Longest name btrfs accepts.
pub(crate) const NAME_MAX: usize = 255;
/// Most hard links to one inode (btrfs limit).
pub(crate) const LINK_MAX: u32 = 65535;
/// XATTR item type.
pub(crate) const FT_XATTR: u8 = 8;

/// Who creates a file: owner and group of the new inode.
#[derive(Debug, Clone, Copy, Default)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Attribute changes for [`Core::setattr`].
#[derive(Debug, Clone, Default)]
pub struct SetAttr {
    pub mode: Option<u32>,
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    pub size: Option<u64>,
    pub atime: Option<Timespec>,
    pub mtime: Option<Timespec>,
    pub ctime: Option<Timespec>,
    /// `atime` and `mtime` are the current time, not times of the caller's choosing
    /// (utimes with NULL): allowed on an append-only inode, as the kernel allows it.
    pub touch: bool,
}

/// rename(2) flags.
pub const RENAME_NOREPLACE: u32 = 1;
pub const RENAME_EXCHANGE: u32 = 2;

/// The directory entry type of an inode of `mode` (FT_UNKNOWN for no valid file type).
pub(crate) fn mode_to_ft(mode: u32) -> u8 {
    match mode & 0o170000 {
        0o100000 => FT_REG_FILE,
        0o040000 => FT_DIR,
        0o020000 => FT_CHRDEV,
        0o060000 => FT_BLKDEV,
        0o010000 => FT_FIFO,
        0o140000 => FT_SOCK,
        0o120000 => FT_SYMLINK,
        _ => FT_UNKNOWN,
    }
}

/// Rewrites an item that packs several entries (refs, dir items, xattrs) without entry `skip`;
/// deletes the item when that was its only entry.
pub(crate) fn rewrite_without<T>(
    w: &mut Writer,
    root: u64,
    key: Key,
    entries: &[T],
    skip: usize,
    write: impl Fn(&T, &mut Vec<u8>),
) -> Result<()> {
    if entries.len() <= 1 {
        w.delete_item(root, &key)?;
        return Ok(());
    }
    let mut body = Vec::new();
    for (i, e) in entries.iter().enumerate() {
        if i != skip {
            write(e, &mut body);
        }
    }
    w.replace_item(root, key, &body)
}

pub(crate) fn check_name(name: &[u8]) -> Result<()> {
    if name.is_empty() || name == b"." || name == b".." || name.contains(&b'/') || name.contains(&0)
    {
        return Err(Error::Invalid(format!(
            "bad file name {:?}",
            String::from_utf8_lossy(name)
        )));
    }
    if name.len() > NAME_MAX {
        return Err(Error::NameTooLong(format!("{} bytes", name.len())));
    }
    Ok(())
}

impl Core {
    pub(crate) fn is_writable(&self) -> bool {
        self.writer.is_some()
    }

    /// The write engine (locked), with every pending ordered extent completed
    /// (crate::inode::ordered): its holder sees the trees as every returned write left them.
    pub(crate) fn writer(&self) -> Result<MutexGuard<'_, Writer>> {
        let mut g = self.writer_keeping_ordered()?;
        if self.ordered.any_pending() {
            self.complete_ordered(&mut g)?;
        }
        if self.prealloc.has(None) {
            self.complete_preallocs(&mut g, None)?;
        }
        Ok(g)
    }

    /// The write engine (locked), pending ordered extents left as they are: for the fsync
    /// log, which logs them without waiting for their completion (fast fsync), and never
    /// commits without completing them.
    pub(crate) fn writer_keeping_ordered(&self) -> Result<MutexGuard<'_, Writer>> {
        let w = self.writer.as_ref().ok_or(Error::ReadOnly)?;
        let g = w.lock().unwrap_or_else(|e| e.into_inner());
        g.check_writable()?;
        Ok(g)
    }

    /// Completes every pending ordered extent now (crate::inode::ordered). A caller that keeps
    /// readers out while trees change (the FUSE mount) does this before letting them in.
    pub(crate) fn complete_ordered_extents(&self) -> Result<()> {
        if self.ordered.any_pending() {
            drop(self.writer()?);
        }
        Ok(())
    }

    /// [`Core::complete_ordered_extents`] for `ino` alone: its pending ordered extents and
    /// its delayed-allocation buffer go into the trees, other files' stay pending.
    pub(crate) fn complete_ordered_extents_of(&self, ino: Inode) -> Result<()> {
        if self.ordered.has_pending(ino) {
            let mut w = self.writer_keeping_ordered()?;
            self.complete_ordered_of(&mut w, ino)?;
        }
        Ok(())
    }

    /// Whether some write returned whose extent is not in the trees yet (crate::inode::ordered):
    /// reading the trees completes it first, see [`Core::complete_ordered_extents`].
    pub(crate) fn has_pending_ordered(&self) -> bool {
        self.ordered.any_pending()
    }

    /// Runs one filesystem operation in the running transaction. `grows` says it adds data
    /// or items (refused when space is nearly gone); deletions may use the reserve.
    pub(crate) fn op<R>(&self, grows: bool, f: impl FnOnce(&mut Writer) -> Result<R>) -> Result<R> {
        let w = self.writer()?;
        Self::run_op(w, grows, f)
    }

    /// [`Core::op`] for a change that touches no file with writes pending (a new inode in a
    /// directory: directories never have pending data): other files' ordered extents and
    /// delayed-allocation buffers stay pending, so a create does not wait for the completion
    /// of a stream of writes to another file. Everything is completed first when the change
    /// may need a chunk or a commit for space (a commit needs them all in the trees).
    pub(crate) fn op_beside_pending<R>(
        &self,
        grows: bool,
        f: impl FnOnce(&mut Writer) -> Result<R>,
    ) -> Result<R> {
        let mut w = self.writer_keeping_ordered()?;
        if self.ordered.any_pending() && !w.metadata_reserved() {
            self.complete_ordered(&mut w)?;
        }
        Self::run_op(w, grows, f)
    }

    fn run_op<R>(
        mut w: MutexGuard<'_, Writer>,
        grows: bool,
        f: impl FnOnce(&mut Writer) -> Result<R>,
    ) -> Result<R> {
        w.reserve_metadata(grows)?;
        let r = f(&mut w);
        if let Err(e) = &r {
            if e.stops_changes() {
                // The change may be half made: no more changes, no commit of it (the same
                // rule the gate's latch applies to a front end's operations).
                w.abort(e.to_string());
            }
        }
        r
    }

    /// Makes every change so far durable.
    pub(crate) fn commit(&self) -> Result<()> {
        let _l = self.log_sync.lock().unwrap_or_else(|e| e.into_inner());
        self.writer()?.commit()
    }

    /// [`Core::commit`], calling `trees_final` when the trees reached their final state in
    /// memory and only the writing is left (see [`Writer::commit_with`]). Other changes wait
    /// for the whole commit; reads may run again from `trees_final` on.
    pub(crate) fn commit_with(&self, trees_final: impl FnOnce()) -> Result<()> {
        let _l = self.log_sync.lock().unwrap_or_else(|e| e.into_inner());
        self.writer()?.commit_with(trees_final)
    }

    /// [`Core::commit`] through [`Writer::commit_verified`]: `verify` judges the new
    /// superblock before any copy of it is written.
    pub(crate) fn commit_verified(
        &self,
        verify: impl FnOnce(&crate::format::superblock::Superblock) -> Result<()>,
    ) -> Result<()> {
        let _l = self.log_sync.lock().unwrap_or_else(|e| e.into_inner());
        self.writer()?.commit_verified(verify)
    }

    /// The disk the filesystem lives on.
    pub(crate) fn disk(&self) -> &Arc<Disk> {
        &self.disk
    }

    /// The filesystem's sector size: the unit of file data, and of its checksums.
    pub(crate) fn sectorsize(&self) -> u32 {
        self.disk.sectorsize()
    }

    // ---------------------------------------------------------------------------------------
    // Helpers on inodes and directory entries
    // ---------------------------------------------------------------------------------------

    pub(crate) fn write_inode(&self, w: &mut Writer, ino: Inode, item: &InodeItem) -> Result<()> {
        let key = Key::new(ino.ino, INODE_ITEM_KEY, 0);
        let body = item.to_bytes();
        if !w.update_item(ino.root, &key, |b| {
            b.copy_from_slice(&body);
            Ok(())
        })? {
            return Err(Error::NotFound(format!(
                "inode {} in subvolume {}",
                ino.ino, ino.root
            )));
        }
        Ok(())
    }

    /// Bumps the change fields (transid, sequence, ctime) of an inode item.
    pub(crate) fn touch(w: &Writer, item: &mut InodeItem, mtime: bool) {
        Self::touch_at(w, item, mtime, Timespec::now())
    }

    /// [`Core::touch`] with the time of the change `t`.
    pub(crate) fn touch_at(w: &Writer, item: &mut InodeItem, mtime: bool, t: Timespec) {
        item.transid = w.transid;
        item.sequence += 1;
        item.ctime = t;
        if mtime {
            item.mtime = t;
        }
    }

    pub(crate) fn next_objectid(&self, w: &mut Writer, root: u64) -> Result<u64> {
        if let Some(n) = w.next_ino.get(&root) {
            let n = *n;
            w.next_ino.insert(root, n + 1);
            return Ok(n);
        }
        let r = w.current_root(root)?;
        let last = crate::ctree::lookup_le(
            &self.disk,
            &r,
            &Key::new(LAST_FREE_OBJECTID, u8::MAX, u64::MAX),
        )?;
        let mut n = last
            .map(|i| i.key.objectid + 1)
            .unwrap_or(FIRST_FREE_OBJECTID);
        if n < FIRST_FREE_OBJECTID {
            n = FIRST_FREE_OBJECTID;
        }
        if n > LAST_FREE_OBJECTID {
            return Err(Error::NoSpace(
                "inode numbers exhausted in this subvolume".into(),
            ));
        }
        w.next_ino.insert(root, n + 1);
        Ok(n)
    }

    fn next_dir_index(&self, w: &mut Writer, dir: Inode) -> Result<u64> {
        let k = (dir.root, dir.ino);
        if let Some(n) = w.next_index.get(&k) {
            let n = *n;
            w.next_index.insert(k, n + 1);
            return Ok(n);
        }
        let r = w.current_root(dir.root)?;
        let last =
            crate::ctree::lookup_le(&self.disk, &r, &Key::new(dir.ino, DIR_INDEX_KEY, u64::MAX))?;
        let n = match last {
            Some(i) if i.key.objectid == dir.ino && i.key.ty == DIR_INDEX_KEY => {
                (i.key.offset + 1).max(2)
            }
            _ => 2,
        };
        w.next_index.insert(k, n + 1);
        Ok(n)
    }

    /// Adds `name` -> `target` to directory `dir` (DIR_ITEM, DIR_INDEX, and the target's
    /// INODE_REF), and grows the directory. Returns the index.
    pub(crate) fn add_entry(
        &self,
        w: &mut Writer,
        dir: Inode,
        name: &[u8],
        target: Inode,
        ft: u8,
    ) -> Result<u64> {
        let index =
            self.add_dir_items(w, dir, name, Key::new(target.ino, INODE_ITEM_KEY, 0), ft)?;
        self.add_inode_ref(w, target, dir.ino, index, name)?;
        if ft != FT_DIR {
            w.log.note_new_name(target, dir, name);
        }
        Ok(index)
    }

    /// The directory side of a new entry: DIR_ITEM (appended to on a hash collision) and
    /// DIR_INDEX pointing at `location` (an inode, or a subvolume's ROOT_ITEM), and the
    /// directory's size and times. Returns the index.
    pub(crate) fn add_dir_items(
        &self,
        w: &mut Writer,
        dir: Inode,
        name: &[u8],
        location: Key,
        ft: u8,
    ) -> Result<u64> {
        let index = self.next_dir_index(w, dir)?;
        let di = DirItem {
            location,
            transid: w.transid,
            file_type: ft,
            name: name.to_vec(),
            data: Vec::new(),
        };
        let dkey = Key::new(dir.ino, DIR_ITEM_KEY, hash::name_hash(name));
        match w.read_item(dir.root, &dkey)? {
            Some(existing) => {
                let mut body = existing.clone();
                di.write(&mut body);
                let p = w.resize_item(dir.root, &dkey, body.len())?;
                let slot = p.slot();
                w.modify(p.leaf(), |buf| {
                    crate::ctree::ops::LeafMut::trusted(buf)?
                        .item_data_mut(slot)?
                        .copy_from_slice(&body);
                    Ok(())
                })?;
            }
            None => w.insert_item(dir.root, dkey, &di.to_bytes())?,
        }
        w.insert_item(
            dir.root,
            Key::new(dir.ino, DIR_INDEX_KEY, index),
            &di.to_bytes(),
        )?;
        let mut d = self.inode_item(dir)?;
        d.size += 2 * name.len() as u64;
        Self::touch(w, &mut d, true);
        self.write_inode(w, dir, &d)?;
        Ok(index)
    }

    fn add_inode_ref(
        &self,
        w: &mut Writer,
        ino: Inode,
        parent: u64,
        index: u64,
        name: &[u8],
    ) -> Result<()> {
        let r = InodeRef {
            index,
            name: name.to_vec(),
        };
        let key = Key::new(ino.ino, INODE_REF_KEY, parent);
        let max = crate::ctree::ops::max_item_size(self.disk.nodesize() as usize);
        match w.read_item(ino.root, &key)? {
            Some(existing) if existing.len() + r.encoded_len() <= max => {
                let mut body = existing;
                r.write(&mut body);
                let p = w.resize_item(ino.root, &key, body.len())?;
                let slot = p.slot();
                w.modify(p.leaf(), |buf| {
                    crate::ctree::ops::LeafMut::trusted(buf)?
                        .item_data_mut(slot)?
                        .copy_from_slice(&body);
                    Ok(())
                })
            }
            Some(_) => {
                if !self.disk.sb.has_incompat(INCOMPAT_EXTENDED_IREF) {
                    return Err(Error::TooManyLinks(format!("inode {}", ino.ino)));
                }
                let x = InodeExtref {
                    parent,
                    index,
                    name: name.to_vec(),
                };
                let xk = Key::new(ino.ino, INODE_EXTREF_KEY, hash::extref_hash(parent, name));
                let mut body = w.read_item(ino.root, &xk)?.unwrap_or_default();
                x.write(&mut body);
                w.replace_item(ino.root, xk, &body)
            }
            None => {
                let mut body = Vec::new();
                r.write(&mut body);
                w.insert_item(ino.root, key, &body)
            }
        }
    }

    /// Removes `ino`'s reference named `name` from `parent`. Returns its dir index.
    fn remove_inode_ref(
        &self,
        w: &mut Writer,
        ino: Inode,
        parent: u64,
        name: &[u8],
    ) -> Result<u64> {
        let key = Key::new(ino.ino, INODE_REF_KEY, parent);
        if let Some(body) = w.read_item(ino.root, &key)? {
            let refs = InodeRef::parse_all(&body)?;
            if let Some(pos) = refs.iter().position(|r| r.name == name) {
                let index = refs[pos].index;
                rewrite_without(w, ino.root, key, &refs, pos, InodeRef::write)?;
                return Ok(index);
            }
        }
        let xk = Key::new(ino.ino, INODE_EXTREF_KEY, hash::extref_hash(parent, name));
        if let Some(body) = w.read_item(ino.root, &xk)? {
            let refs = InodeExtref::parse_all(&body)?;
            if let Some(pos) = refs
                .iter()
                .position(|r| r.name == name && r.parent == parent)
            {
                let index = refs[pos].index;
                rewrite_without(w, ino.root, xk, &refs, pos, InodeExtref::write)?;
                return Ok(index);
            }
        }
        Err(Error::corrupt(
            crate::Location::what(format!(
                "inode {} ref {:?}",
                ino.ino,
                String::from_utf8_lossy(name)
            ))
            .with_tree(ino.root),
            "directory entry has no matching inode ref",
        ))
    }

    /// Removes the entry `name` from `dir` (DIR_ITEM entry, DIR_INDEX, INODE_REF) and shrinks
    /// the directory.
    fn remove_entry(&self, w: &mut Writer, dir: Inode, name: &[u8], target: Inode) -> Result<()> {
        w.log.note_removed(dir, target, name);
        let dkey = Key::new(dir.ino, DIR_ITEM_KEY, hash::name_hash(name));
        let body = w
            .read_item(dir.root, &dkey)?
            .ok_or_else(|| Error::NotFound(format!("{:?}", String::from_utf8_lossy(name))))?;
        let entries = DirItem::parse_all(&body)?;
        // Its names changed: a file's fsync logs `dir` too (crate::tree_log::write); a directory's
        // commits (logging it could bring the old name back next to a new one).
        if entries
            .iter()
            .any(|e| e.name == name && e.file_type == FT_DIR)
        {
            w.log.note_needs_commit(target);
        } else {
            w.log.note_name_change(target, Some(dir));
        }
        let pos = entries
            .iter()
            .position(|e| e.name == name)
            .ok_or_else(|| Error::NotFound(format!("{:?}", String::from_utf8_lossy(name))))?;
        rewrite_without(w, dir.root, dkey, &entries, pos, DirItem::write)?;
        let index = self.remove_inode_ref(w, target, dir.ino, name)?;
        // An index is never handed out twice in a mount, as the kernel's in-memory counter
        // never is: the removal may not be durable when a new entry is (an fsync of a file
        // created after it logs the file's index), and replay would find the index taken.
        let k = (dir.root, dir.ino);
        if !w.next_index.contains_key(&k) {
            // Counts from the tree as it still is (this entry included); `n` stays unused.
            let n = self.next_dir_index(w, dir)?;
            w.next_index.insert(k, n);
        }
        if let Some(next) = w.next_index.get_mut(&k) {
            *next = (*next).max(index + 1);
        }
        w.delete_item(dir.root, &Key::new(dir.ino, DIR_INDEX_KEY, index))?;
        let mut d = self.inode_item(dir)?;
        d.size = d.size.saturating_sub(2 * name.len() as u64);
        Self::touch(w, &mut d, true);
        self.write_inode(w, dir, &d)
    }

    pub(crate) fn new_inode(
        &self,
        w: &mut Writer,
        dir: Inode,
        mode: u32,
        rdev: u64,
        owner: Owner,
    ) -> Result<(Inode, InodeItem)> {
        let root = dir.root;
        let flags = crate::inode::flags::inherited_flags(self.inode_item(dir)?.flags, mode);
        let ino = self.next_objectid(w, root)?;
        let t = Timespec::now();
        let item = InodeItem {
            generation: w.transid,
            transid: w.transid,
            size: 0,
            nbytes: 0,
            block_group: 0,
            nlink: 1,
            uid: owner.uid,
            gid: owner.gid,
            mode,
            rdev,
            flags,
            sequence: 1,
            atime: t,
            ctime: t,
            mtime: t,
            otime: t,
        };
        w.insert_item(root, Key::new(ino, INODE_ITEM_KEY, 0), &item.to_bytes())?;
        // The compression property goes down to new inodes, as the kernel's inherits it.
        let prop = crate::inode::flags::COMPRESSION_PROP;
        if let Some(v) = self.getxattr(dir, prop)? {
            let mut body = Vec::new();
            DirItem {
                location: Key::new(0, 0, 0),
                transid: w.transid,
                file_type: FT_XATTR,
                name: prop.to_vec(),
                data: v,
            }
            .write(&mut body);
            w.insert_item(
                root,
                Key::new(ino, XATTR_ITEM_KEY, hash::name_hash(prop)),
                &body,
            )?;
        }
        Ok((Inode { root, ino }, item))
    }

    pub(crate) fn require_dir(&self, dir: Inode) -> Result<InodeItem> {
        let d = self.inode_item(dir)?;
        if d.mode & 0o170000 != 0o040000 {
            return Err(Error::NotDir(format!("inode {}", dir.ino)));
        }
        Ok(d)
    }

    // ---------------------------------------------------------------------------------------
    // Namespace operations
    // ---------------------------------------------------------------------------------------

    /// Creates a node of any type (regular file, directory, device, fifo, socket) in `dir`.
    pub(crate) fn mknod(
        &self,
        dir: Inode,
        name: &[u8],
        mode: u32,
        rdev: u64,
        owner: Owner,
    ) -> Result<Inode> {
        check_name(name)?;
        self.require_dir(dir)?;
        self.require_dir_changeable(dir, true)?;
        if self.lookup(dir, name)?.is_some() {
            return Err(Error::Exists(String::from_utf8_lossy(name).into_owned()));
        }
        let ft = mode_to_ft(mode);
        if ft == FT_UNKNOWN || ft == FT_SYMLINK {
            return Err(Error::Invalid(format!("mknod with mode {mode:o}")));
        }
        let rdev = if ft == FT_CHRDEV || ft == FT_BLKDEV {
            rdev
        } else {
            0
        };
        self.op_beside_pending(true, |w| {
            let (ino, _) = self.new_inode(w, dir, mode, rdev, owner)?;
            self.add_entry(w, dir, name, ino, ft)?;
            Ok(ino)
        })
    }

    pub(crate) fn create(&self, dir: Inode, name: &[u8], perm: u32, owner: Owner) -> Result<Inode> {
        self.mknod(dir, name, 0o100000 | (perm & 0o7777), 0, owner)
    }

    pub(crate) fn mkdir(&self, dir: Inode, name: &[u8], perm: u32, owner: Owner) -> Result<Inode> {
        self.mknod(dir, name, 0o040000 | (perm & 0o7777), 0, owner)
    }

    pub(crate) fn symlink(
        &self,
        dir: Inode,
        name: &[u8],
        target: &[u8],
        owner: Owner,
    ) -> Result<Inode> {
        check_name(name)?;
        self.require_dir(dir)?;
        self.require_dir_changeable(dir, true)?;
        if target.is_empty()
            || target.len() >= self.disk.sectorsize() as usize
            || target.len() > crate::inode::file::inline_limit(&self.disk)
        {
            return Err(Error::NameTooLong(format!(
                "symlink target of {} bytes",
                target.len()
            )));
        }
        if self.lookup(dir, name)?.is_some() {
            return Err(Error::Exists(String::from_utf8_lossy(name).into_owned()));
        }
        self.op(true, |w| {
            let (ino, mut item) = self.new_inode(w, dir, 0o120777, 0, owner)?;
            let fe = FileExtentItem {
                generation: w.transid,
                ram_bytes: target.len() as u64,
                compression: 0,
                encryption: 0,
                other_encoding: 0,
                ty: FILE_EXTENT_INLINE,
                body: FileExtentBody::Inline(target.to_vec()),
            };
            w.insert_item(
                dir.root,
                Key::new(ino.ino, EXTENT_DATA_KEY, 0),
                &fe.to_bytes(),
            )?;
            item.size = target.len() as u64;
            item.nbytes = target.len() as u64;
            self.write_inode(w, ino, &item)?;
            self.add_entry(w, dir, name, ino, FT_SYMLINK)?;
            Ok(ino)
        })
    }

    /// A new hard link `dir/name` to `ino`.
    pub(crate) fn link(&self, ino: Inode, dir: Inode, name: &[u8]) -> Result<()> {
        check_name(name)?;
        self.require_dir(dir)?;
        self.require_dir_changeable(dir, true)?;
        if ino.root != dir.root {
            return Err(Error::CrossSubvolume("hard link".into()));
        }
        let mut item = self.inode_item(ino)?;
        crate::inode::flags::require_changeable(&item, ino)?;
        if item.mode & 0o170000 == 0o040000 {
            return Err(Error::NotPermitted("hard link to a directory".into()));
        }
        if item.nlink >= LINK_MAX {
            return Err(Error::TooManyLinks(format!("inode {}", ino.ino)));
        }
        if self.lookup(dir, name)?.is_some() {
            return Err(Error::Exists(String::from_utf8_lossy(name).into_owned()));
        }
        self.op(true, |w| {
            w.log.note_name_change(ino, None);
            self.add_entry(w, dir, name, ino, mode_to_ft(item.mode))?;
            item.nlink += 1;
            Self::touch(w, &mut item, false);
            self.write_inode(w, ino, &item)
        })
    }

    /// Removes a non-directory entry; the inode goes when its last link does (or, if it is
    /// open, when [`Core::release_orphan`] is called: it is kept as an orphan until then).
    pub(crate) fn unlink(&self, dir: Inode, name: &[u8]) -> Result<()> {
        let e = self
            .lookup(dir, name)?
            .ok_or_else(|| Error::NotFound(String::from_utf8_lossy(name).into_owned()))?;
        if e.file_type == FT_DIR {
            return Err(Error::IsDir(String::from_utf8_lossy(name).into_owned()));
        }
        self.require_dir_changeable(dir, false)?;
        crate::inode::flags::require_changeable(&self.inode_item(e.target)?, e.target)?;
        self.op(false, |w| {
            self.remove_entry(w, dir, name, e.target)?;
            self.drop_link(w, e.target)
        })
    }

    /// One link of `ino` is gone: decrement nlink, delete the inode at zero (or orphan it,
    /// while a handle holds it open: a directory too, which then shows nlink 0 to fstat).
    fn drop_link(&self, w: &mut Writer, ino: Inode) -> Result<()> {
        let mut item = self.inode_item(ino)?;
        item.nlink = item.nlink.saturating_sub(1);
        Self::touch(w, &mut item, false);
        if item.nlink > 0 {
            return self.write_inode(w, ino, &item);
        }
        if self.open_count(ino) > 0 {
            self.write_inode(w, ino, &item)?;
            return w.insert_item(
                ino.root,
                Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, ino.ino),
                &[],
            );
        }
        self.delete_inode(w, ino)
    }

    /// An empty directory lost its name: deleted, or an orphan while a handle holds it.
    fn drop_dir(&self, w: &mut Writer, ino: Inode) -> Result<()> {
        // A directory has one link however many subdirectories it held.
        let mut it = self.inode_item(ino)?;
        if it.nlink != 1 {
            it.nlink = 1;
            self.write_inode(w, ino, &it)?;
        }
        self.drop_link(w, ino)
    }

    /// Deletes every item of an inode, dropping its data references.
    pub(crate) fn delete_inode(&self, w: &mut Writer, ino: Inode) -> Result<()> {
        // An inode number is never handed out twice in a mount, as the kernel's counter never
        // is: the deletion may not be durable when the new inode is (an fsync logs it), and
        // replay would merge the two. Counted from the tree as it still is; `n` stays unused.
        if !w.next_ino.contains_key(&ino.root) {
            let n = self.next_objectid(w, ino.root)?;
            w.next_ino.insert(ino.root, n);
        }
        self.truncate_extents(w, ino, 0)?;
        w.delete_range(
            ino.root,
            Key::new(ino.ino, 0, 0),
            Key::new(ino.ino, u8::MAX, u64::MAX),
        )?;
        w.delete_item(
            ino.root,
            &Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, ino.ino),
        )?;
        Ok(())
    }

    /// Open handles on an inode (files unlinked while open become orphans).
    fn open_count(&self, ino: Inode) -> u32 {
        self.open_files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ino)
            .copied()
            .unwrap_or(0)
    }

    /// Notes that `ino` is open (FUSE open/create).
    pub(crate) fn note_open(&self, ino: Inode) {
        *self
            .open_files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(ino)
            .or_insert(0) += 1;
    }

    /// The last handle on `ino` closed: delete it if it was unlinked.
    pub(crate) fn release_orphan(&self, ino: Inode) -> Result<()> {
        if self.note_closed(ino)? {
            self.delete_orphan(ino)?;
        }
        Ok(())
    }

    /// One handle on `ino` closed. Returns whether that was the last one of an unlinked inode
    /// (then [`Core::delete_orphan`] should follow). Changes nothing on disk, so a front end can
    /// run it without keeping readers out.
    pub(crate) fn note_closed(&self, ino: Inode) -> Result<bool> {
        {
            let mut m = self.open_files.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(c) = m.get_mut(&ino) {
                *c = c.saturating_sub(1);
                if *c > 0 {
                    return Ok(false);
                }
                m.remove(&ino);
            }
        }
        if !self.is_writable() {
            return Ok(false);
        }
        // The link count: pending writes of the file do not change it.
        Ok(matches!(self.inode_item_raw(ino), Ok(item) if item.nlink == 0))
    }

    /// Deletes an unlinked inode no handle holds (again checked here).
    pub(crate) fn delete_orphan(&self, ino: Inode) -> Result<()> {
        if self
            .open_files
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(&ino)
        {
            return Ok(());
        }
        match self.inode_item(ino) {
            Ok(item) if item.nlink == 0 => self.op(false, |w| self.delete_inode(w, ino)),
            _ => Ok(()),
        }
    }

    pub(crate) fn rmdir(&self, dir: Inode, name: &[u8]) -> Result<()> {
        let e = self
            .lookup(dir, name)?
            .ok_or_else(|| Error::NotFound(String::from_utf8_lossy(name).into_owned()))?;
        if e.file_type != FT_DIR {
            return Err(Error::NotDir(String::from_utf8_lossy(name).into_owned()));
        }
        self.require_dir_changeable(dir, false)?;
        if e.target.root != dir.root {
            // As on the kernel's btrfs since Linux 4.18: an empty subvolume (or snapshot)
            // goes with rmdir, deleted as `subvolume delete` deletes it.
            if self.inode_item(e.target)?.size != 0 {
                return Err(Error::NotEmpty(String::from_utf8_lossy(name).into_owned()));
            }
            return self.delete_subvolume(dir, name).map(|_| ());
        }
        let item = self.inode_item(e.target)?;
        crate::inode::flags::require_changeable(&item, e.target)?;
        if item.size != 0 {
            return Err(Error::NotEmpty(String::from_utf8_lossy(name).into_owned()));
        }
        self.op(false, |w| {
            self.remove_entry(w, dir, name, e.target)?;
            self.drop_dir(w, e.target)
        })
    }

    /// Whether `anc` is `ino` or one of its ancestors (directories only).
    fn is_ancestor(&self, anc: Inode, mut ino: Inode) -> Result<bool> {
        for _ in 0..4096 {
            if ino == anc {
                return Ok(true);
            }
            let root = self.subvol_root(ino.root)?;
            let it = crate::ctree::lookup_le(
                &self.disk,
                &root,
                &Key::new(ino.ino, INODE_REF_KEY, u64::MAX),
            )?;
            match it {
                Some(i) if i.key.objectid == ino.ino && i.key.ty == INODE_REF_KEY => {
                    if i.key.offset == ino.ino {
                        return Ok(false); // subvolume root
                    }
                    ino = Inode {
                        root: ino.root,
                        ino: i.key.offset,
                    };
                }
                _ => return Ok(false),
            }
        }
        Ok(false)
    }

    /// rename(2) with RENAME_NOREPLACE / RENAME_EXCHANGE.
    pub(crate) fn rename(
        &self,
        from_dir: Inode,
        from: &[u8],
        to_dir: Inode,
        to: &[u8],
        flags: u32,
    ) -> Result<()> {
        check_name(to)?;
        if flags & !(RENAME_NOREPLACE | RENAME_EXCHANGE) != 0
            || flags == RENAME_NOREPLACE | RENAME_EXCHANGE
        {
            return Err(Error::Invalid(format!("rename flags {flags:#x}")));
        }
        self.require_dir(from_dir)?;
        self.require_dir(to_dir)?;
        // Into or out of a read-only subvolume: EROFS before EXDEV, as the VFS checks the
        // directories' permission first.
        self.require_dir_changeable(from_dir, false)?;
        self.require_dir_changeable(to_dir, flags & RENAME_EXCHANGE == 0)?;
        if from_dir.root != to_dir.root {
            return Err(Error::CrossSubvolume("rename".into()));
        }
        let src = self
            .lookup(from_dir, from)?
            .ok_or_else(|| Error::NotFound(String::from_utf8_lossy(from).into_owned()))?;
        let dst = self.lookup(to_dir, to)?;
        if src.target.root != from_dir.root {
            return Err(Error::Unsupported("renaming a subvolume".into()));
        }
        crate::inode::flags::require_changeable(&self.inode_item(src.target)?, src.target)?;
        if let Some(d) = dst.as_ref().filter(|d| d.target.root == to_dir.root) {
            crate::inode::flags::require_changeable(&self.inode_item(d.target)?, d.target)?;
        }
        if flags & RENAME_EXCHANGE != 0 && dst.is_none() {
            return Err(Error::NotFound(String::from_utf8_lossy(to).into_owned()));
        }
        if flags & RENAME_NOREPLACE != 0 && dst.is_some() {
            return Err(Error::Exists(String::from_utf8_lossy(to).into_owned()));
        }
        if dst.as_ref().is_some_and(|d| d.target == src.target) {
            return Ok(()); // two names of one inode (or the same name): nothing to do
        }
        if src.file_type == FT_DIR && self.is_ancestor(src.target, to_dir)? {
            return Err(Error::Invalid("rename of a directory into itself".into()));
        }
        if flags & RENAME_EXCHANGE == 0 {
            if let Some(d) = &dst {
                if d.file_type == FT_DIR && self.is_ancestor(d.target, from_dir)? {
                    return Err(Error::NotEmpty(String::from_utf8_lossy(to).into_owned()));
                }
            }
        }
        if flags & RENAME_EXCHANGE != 0 {
            let dst =
                dst.ok_or_else(|| Error::NotFound(String::from_utf8_lossy(to).into_owned()))?;
            if dst.file_type == FT_DIR && self.is_ancestor(dst.target, from_dir)? {
                return Err(Error::Invalid(
                    "exchange would put a directory inside itself".into(),
                ));
            }
            if dst.target.root != to_dir.root {
                return Err(Error::Unsupported("exchanging a subvolume".into()));
            }
            return self.op(true, |w| {
                self.remove_entry(w, from_dir, from, src.target)?;
                self.remove_entry(w, to_dir, to, dst.target)?;
                self.add_entry(w, to_dir, to, src.target, src.file_type)?;
                self.add_entry(w, from_dir, from, dst.target, dst.file_type)?;
                for t in [src.target, dst.target] {
                    let mut it = self.inode_item(t)?;
                    Self::touch(w, &mut it, false);
                    self.write_inode(w, t, &it)?;
                }
                Ok(())
            });
        }
        if let Some(d) = &dst {
            if flags & RENAME_NOREPLACE != 0 {
                return Err(Error::Exists(String::from_utf8_lossy(to).into_owned()));
            }
            if d.target == src.target {
                return Ok(()); // same inode: nothing to do
            }
            let dst_is_dir = d.file_type == FT_DIR;
            if (src.file_type == FT_DIR) != dst_is_dir {
                return Err(if dst_is_dir {
                    Error::IsDir(String::from_utf8_lossy(to).into_owned())
                } else {
                    Error::NotDir(String::from_utf8_lossy(to).into_owned())
                });
            }
            if d.target.root != to_dir.root {
                return Err(Error::Unsupported("replacing a subvolume".into()));
            }
            if dst_is_dir && self.inode_item(d.target)?.size != 0 {
                return Err(Error::NotEmpty(String::from_utf8_lossy(to).into_owned()));
            }
        }
        self.op(true, |w| {
            if let Some(d) = &dst {
                self.remove_entry(w, to_dir, to, d.target)?;
                if d.file_type == FT_DIR {
                    self.drop_dir(w, d.target)?;
                } else {
                    self.drop_link(w, d.target)?;
                }
            }
            self.remove_entry(w, from_dir, from, src.target)?;
            self.add_entry(w, to_dir, to, src.target, src.file_type)?;
            let mut it = self.inode_item(src.target)?;
            Self::touch(w, &mut it, false);
            self.write_inode(w, src.target, &it)
        })
    }

    /// chmod / chown / utimes / truncate.
    pub(crate) fn setattr(&self, ino: Inode, a: &SetAttr) -> Result<crate::inode::read::Stat> {
        self.require_rw_subvol(ino.root)?;
        let item = self.inode_item(ino)?;
        let times = a.atime.is_some() || a.mtime.is_some();
        let attrs = a.mode.is_some() || a.uid.is_some() || a.gid.is_some() || a.size.is_some();
        if attrs || (times && !a.touch) {
            crate::inode::flags::require_changeable(&item, ino)?;
        }
        if times && item.flags & INODE_IMMUTABLE != 0 {
            crate::inode::flags::require_changeable(&item, ino)?;
        }
        if let Some(size) = a.size {
            self.truncate(ino, size)?;
        }
        self.op(false, |w| {
            let mut it = self.inode_item(ino)?;
            if let Some(m) = a.mode {
                it.mode = (it.mode & 0o170000) | (m & 0o7777);
            }
            if let Some(u) = a.uid {
                it.uid = u;
            }
            if let Some(g) = a.gid {
                it.gid = g;
            }
            Self::touch(w, &mut it, false);
            if let Some(t) = a.atime {
                it.atime = t;
            }
            if let Some(t) = a.mtime {
                it.mtime = t;
            }
            if let Some(t) = a.ctime {
                it.ctime = t;
            }
            self.write_inode(w, ino, &it)
        })?;
        self.stat(ino)
    }

    /// setxattr(2); `flags`: 1 = XATTR_CREATE, 2 = XATTR_REPLACE.
    pub(crate) fn setxattr(&self, ino: Inode, name: &[u8], value: &[u8], flags: u32) -> Result<()> {
        self.require_inode_changeable(ino)?;
        if name == crate::inode::flags::COMPRESSION_PROP {
            return self.set_compression_property(ino, Some(value), flags);
        }
        self.setxattr_raw(ino, name, value, flags)
    }

    /// [`Core::setxattr`] without the checks of the inode's flags and subvolume.
    pub(crate) fn setxattr_raw(
        &self,
        ino: Inode,
        name: &[u8],
        value: &[u8],
        flags: u32,
    ) -> Result<()> {
        if name.is_empty() || name.len() > NAME_MAX {
            return Err(Error::Range(format!("xattr name of {} bytes", name.len())));
        }
        let max = crate::ctree::ops::max_item_size(self.disk.nodesize() as usize);
        if DirItem::HEADER + name.len() + value.len() > max {
            return Err(Error::NoSpace(format!(
                "xattr value of {} bytes is too large for one item",
                value.len()
            )));
        }
        let exists = self.getxattr(ino, name)?.is_some();
        if flags & 1 != 0 && exists {
            return Err(Error::Exists(String::from_utf8_lossy(name).into_owned()));
        }
        if flags & 2 != 0 && !exists {
            return Err(Error::NoXattr(String::from_utf8_lossy(name).into_owned()));
        }
        self.op(true, |w| {
            let key = Key::new(ino.ino, XATTR_ITEM_KEY, hash::name_hash(name));
            let mut body = Vec::new();
            if let Some(old) = w.read_item(ino.root, &key)? {
                for e in DirItem::parse_all(&old)? {
                    if e.name != name {
                        e.write(&mut body);
                    }
                }
            }
            DirItem {
                location: Key::new(0, 0, 0),
                transid: w.transid,
                file_type: FT_XATTR,
                name: name.to_vec(),
                data: value.to_vec(),
            }
            .write(&mut body);
            if body.len() > max {
                return Err(Error::NoSpace("xattr hash bucket is full".into()));
            }
            w.replace_item(ino.root, key, &body)?;
            let mut it = self.inode_item(ino)?;
            Self::touch(w, &mut it, false);
            self.write_inode(w, ino, &it)
        })
    }

    pub(crate) fn removexattr(&self, ino: Inode, name: &[u8]) -> Result<()> {
        self.require_inode_changeable(ino)?;
        if name == crate::inode::flags::COMPRESSION_PROP {
            return self.set_compression_property(ino, None, 0);
        }
        self.removexattr_raw(ino, name)
    }

    /// [`Core::removexattr`] without the checks of the inode's flags and subvolume.
    pub(crate) fn removexattr_raw(&self, ino: Inode, name: &[u8]) -> Result<()> {
        if self.getxattr(ino, name)?.is_none() {
            return Err(Error::NoXattr(String::from_utf8_lossy(name).into_owned()));
        }
        self.op(false, |w| {
            let key = Key::new(ino.ino, XATTR_ITEM_KEY, hash::name_hash(name));
            let old = w.read_item(ino.root, &key)?.unwrap_or_default();
            let entries = DirItem::parse_all(&old)?;
            let pos = entries
                .iter()
                .position(|e| e.name == name)
                .ok_or_else(|| Error::NoXattr(String::from_utf8_lossy(name).into_owned()))?;
            rewrite_without(w, ino.root, key, &entries, pos, DirItem::write)?;
            let mut it = self.inode_item(ino)?;
            Self::touch(w, &mut it, false);
            self.write_inode(w, ino, &it)
        })
    }
}
