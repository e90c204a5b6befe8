//! Send: a read-only snapshot as a send stream (versions 1 and 2), in full or as the changes
//! from a parent snapshot, for `btrfs receive` or `butter receive`.
//!
//! A full send walks the snapshot's tree once in key order, reading ahead along the whole
//! tree (FORWARD_ALWAYS, seed 004), and sends each inode in inode order as the kernel does:
//! created under an orphan name (`o<ino>-<gen>-0`), renamed to its first name, linked to the
//! others, then its xattrs, its data (writes, clones of extents the receiver already has, with
//! `--compressed-data` compressed extents as they are), its owner, mode and times. Directory
//! times go out at the end, once every entry is in.
//!
//! An incremental send compares the parent's tree with the snapshot's, item by item, and
//! changes the receiver's copy of the parent into the snapshot in three passes over the
//! changed inodes: first every name that goes away is dropped (a file's extra names
//! unlinked, a deleted directory or a moved inode renamed to an orphan name, or renamed
//! straight to its new place when that is free and outside itself); then new inodes are made
//! under orphan names; then every inode gets its new names, orphans renamed into place, and
//! deleted directories, empty by then, are removed. The namespace model (`names`) gives each
//! command a path valid at its point of the stream, which is what makes renames into former
//! descendants, swapped names and reused inode numbers come out right. Then each changed
//! inode's xattrs, data (only the extents that differ, holes punched where data was),
//! owner, mode and times, and the times of every directory touched.

mod clone;
mod names;
mod tree;

use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::send_stream::{attr, cmd, StreamWriter};
use crate::format::*;
use crate::fs::Fs;
use crate::ids::Inode;
use crate::io::disk_io::Readahead;
use names::{dir_id, Id, Names, ROOT_ID};
use std::collections::{BTreeSet, HashSet, VecDeque};
use std::io::Write;
use tree::{InodeInfo, Snap};

/// How a send runs.
#[derive(Debug, Clone)]
pub struct SendOptions {
    /// Stream version: 1, or 2 (FALLOCATE, ENCODED_WRITE, larger writes).
    pub proto: u32,
    /// Send compressed extents as they are (ENCODED_WRITE; version 2 only).
    pub compressed_data: bool,
    /// Send no file data: UPDATE_EXTENT commands say which ranges changed.
    pub no_data: bool,
    /// The parent snapshot for an incremental send.
    pub parent: Option<u64>,
    /// Snapshots the receiver has too, whose extents may be cloned.
    pub clone_sources: Vec<u64>,
    /// Read ahead along the whole tree in a full send (FORWARD_ALWAYS); off: only where a
    /// walk reaches a leaf that had to be read (FORWARD).
    pub readahead_always: bool,
    /// Leave out the stream header (a later subvolume of a multi-subvolume send).
    pub omit_header: bool,
    /// Leave out the END command (all but the last subvolume of one).
    pub omit_end: bool,
}

impl Default for SendOptions {
    fn default() -> Self {
        SendOptions {
            proto: 1,
            compressed_data: false,
            no_data: false,
            parent: None,
            clone_sources: Vec::new(),
            readahead_always: true,
            omit_header: false,
            omit_end: false,
        }
    }
}

/// How far a send has come.
#[derive(Debug, Clone, Copy, Default)]
pub struct SendProgress {
    /// Bytes of stream written.
    pub bytes: u64,
    /// Commands written.
    pub commands: u64,
}

/// The block cache a send keeps.
const SEND_CACHE: u64 = 64 << 20;

/// Directories whose times may wait for the end of the stream (the kernel's bound).
const DIR_TIMES_KEPT: usize = 64;

/// The xattr that chown and chmod drop, set after them.
const CAPABILITY: &[u8] = b"security.capability";

/// The most file data one WRITE carries: 48 KiB in version 1 (the kernel's read size), 128
/// KiB from version 2 on.
fn write_chunk(proto: u32) -> u64 {
    if proto >= 2 {
        128 << 10
    } else {
        48 << 10
    }
}

/// Sends subvolume `id` (a read-only snapshot) to `out` as one stream: header, commands, END.
pub fn send(
    fs: &Fs,
    id: u64,
    opts: &SendOptions,
    out: &mut dyn Write,
    progress: &mut dyn FnMut(&SendProgress),
) -> Result<SendProgress> {
    if !(1..=2).contains(&opts.proto) {
        return Err(Error::Invalid(format!(
            "send stream version {} (butter sends versions 1 and 2)",
            opts.proto
        )));
    }
    if opts.compressed_data && opts.proto < 2 {
        return Err(Error::Invalid(
            "compressed data needs stream version 2 (--proto 2)".into(),
        ));
    }
    // A send reads most blocks once: a small cache keeps its memory bounded whatever the
    // snapshot's size.
    fs.core().disk().limit_cache(SEND_CACHE);
    let snap = readonly_snap(fs, id, "the subvolume to send")?;
    let parent = match opts.parent {
        Some(p) => Some(readonly_snap(fs, p, "the parent")?),
        None => None,
    };
    let mut clones = Vec::new();
    for c in &opts.clone_sources {
        clones.push(readonly_snap(fs, *c, "a clone source")?);
    }
    let w = StreamWriter::new(out, opts.proto, !opts.omit_header)?;
    let mut s = Sender {
        fs,
        snap: &snap,
        parent: parent.as_ref(),
        clones: &clones,
        opts,
        w,
        names: Names::new(fs, parent.as_ref()),
        orphans: HashSet::new(),
        dir_times: VecDeque::new(),
        cur_ino: 0,
        changed: BTreeSet::new(),
        orphan_ops: false,
        progress,
    };
    match &parent {
        None => s.full()?,
        Some(p) => s.incremental(p)?,
    }
    if !opts.omit_end {
        s.w.begin(cmd::END);
        s.w.end_cmd()?;
    }
    s.w.flush()?;
    let (bytes, commands) = s.w.written();
    let p = SendProgress { bytes, commands };
    (s.progress)(&p);
    Ok(p)
}

/// Whether the parent's items already map `[off, off + len)` of the file to the same bytes
/// of the same extent, written in the same transaction (so a changed item, e.g. split by a
/// write elsewhere, does not resend data the receiver has).
fn unchanged_extent(olds: &[(u64, FileExtentItem)], off: u64, fe: &FileExtentItem) -> bool {
    let FileExtentBody::Extent {
        disk_bytenr,
        offset,
        num_bytes,
        ..
    } = fe.body
    else {
        return false;
    };
    if disk_bytenr == 0 || fe.ty != FILE_EXTENT_REG {
        return false;
    }
    olds.iter().any(|(o, f)| {
        let FileExtentBody::Extent {
            disk_bytenr: b,
            offset: eo,
            num_bytes: n,
            ..
        } = f.body
        else {
            return false;
        };
        f.ty == FILE_EXTENT_REG
            && b == disk_bytenr
            && f.generation == fe.generation
            && *o <= off
            && off.saturating_add(num_bytes) <= o.saturating_add(n)
            && eo.checked_add(off - o) == Some(offset)
    })
}

fn readonly_snap(fs: &Fs, id: u64, what: &str) -> Result<Snap> {
    if id != FS_TREE_OBJECTID && !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
        return Err(Error::Invalid(format!("{id} is not a subvolume id")));
    }
    let snap = Snap::open(fs, id)?;
    if snap.item.flags & ROOT_SUBVOL_RDONLY == 0 {
        return Err(Error::Invalid(format!(
            "{what} (subvolume {id}) is not read-only; send takes read-only snapshots only \
             (make one with `butter subvolume snapshot -r`)"
        )));
    }
    Ok(snap)
}

struct Sender<'a, W: Write> {
    fs: &'a Fs,
    snap: &'a Snap,
    parent: Option<&'a Snap>,
    clones: &'a [Snap],
    opts: &'a SendOptions,
    w: StreamWriter<W>,
    names: Names<'a>,
    /// Inodes now under an orphan name.
    orphans: HashSet<Id>,
    /// Directories whose times are owed, least recently touched first.
    dir_times: VecDeque<Id>,
    /// The inode being sent (parents of its names up to it get their times cached).
    cur_ino: u64,
    /// Inodes that differ from the parent (incremental sends).
    changed: BTreeSet<u64>,
    /// Whether orphan names came and went in the root (its times are owed then).
    orphan_ops: bool,
    progress: &'a mut dyn FnMut(&SendProgress),
}

impl<W: Write> Sender<'_, W> {
    fn id(info: &InodeInfo) -> Id {
        dir_id(info.ino, info.gen())
    }

    /// The ids (with this snapshot's generations) of an inode's names' directories.
    fn wanted_names(&mut self, info: &InodeInfo, snap: &Snap) -> Result<Vec<(Id, Vec<u8>)>> {
        let mut out = Vec::new();
        for (dir, name) in &info.names {
            let gen = if *dir == FIRST_FREE_OBJECTID {
                0
            } else {
                self.gen_in(snap, *dir)?
            };
            out.push((dir_id(*dir, gen), name.clone()));
        }
        Ok(out)
    }

    /// The generation of inode `ino` in `snap`.
    fn gen_in(&self, snap: &Snap, ino: u64) -> Result<u64> {
        let it = crate::ctree::lookup(
            self.fs.core().disk(),
            &snap.root,
            &Key::new(ino, INODE_ITEM_KEY, 0),
        )?
        .ok_or_else(|| {
            Error::corrupt(
                crate::error::Location::what(format!("inode {ino}")).with_tree(snap.id),
                "a name's directory has no inode item",
            )
        })?;
        Ok(InodeItem::parse(it.data())
            .map_err(|e| it.annotate(e))?
            .generation)
    }

    fn tick(&mut self) {
        let (bytes, commands) = self.w.written();
        if commands.is_multiple_of(256) {
            (self.progress)(&SendProgress { bytes, commands });
        }
    }

    fn rename_cmd(&mut self, from: &[u8], to: &[u8]) -> Result<()> {
        self.w
            .begin(cmd::RENAME)
            .attr(attr::PATH, from)
            .attr(attr::PATH_TO, to);
        self.w.end_cmd()
    }

    fn path_cmd(&mut self, kind: u16, path: &[u8]) -> Result<()> {
        self.w.begin(kind).attr(attr::PATH, path);
        self.w.end_cmd()?;
        self.tick();
        Ok(())
    }

    // ---------------------------------------------------------------------------------
    // Full send
    // ---------------------------------------------------------------------------------

    fn full(&mut self) -> Result<()> {
        let name = self.subvol_name()?;
        self.w
            .begin(cmd::SUBVOL)
            .attr(attr::PATH, &name)
            .attr(attr::UUID, &self.snap.item.uuid)
            .u64(attr::CTRANSID, self.snap.item.ctransid);
        self.w.end_cmd()?;
        let ra = if self.opts.readahead_always {
            Readahead::ForwardAlways
        } else {
            Readahead::Forward
        };
        let mut it = crate::ctree::TreeIter::new(
            self.fs.core().disk().clone(),
            self.snap.root,
            Key::new(FIRST_FREE_OBJECTID, 0, 0),
            ra,
        )?;
        // The inode being read: its number, its items so far, and once its first extent
        // came, the inode itself (begun: made, named, xattrs sent) and its data's end.
        let mut cur: Option<(u64, tree::InodeBuilder)> = None;
        let mut begun: Option<(InodeInfo, u64)> = None;
        // An inode with no names (unlinked while open when the snapshot was taken).
        let mut skip: Option<u64> = None;
        while let Some(item) = it.next_item()? {
            let ino = item.key.objectid;
            if ino > LAST_FREE_OBJECTID {
                break;
            }
            if skip == Some(ino) {
                continue;
            }
            if cur.as_ref().is_some_and(|(c, _)| *c != ino) {
                self.full_finish(cur.take(), begun.take())?;
            }
            let (_, b) = cur.get_or_insert_with(|| (ino, tree::InodeBuilder::default()));
            if b.take(&item)? {
                continue;
            }
            if item.key.ty != EXTENT_DATA_KEY {
                continue;
            }
            if begun.is_none() {
                let (i, b) = cur.take().unwrap_or_default();
                let info = b.build(i, self.snap.id)?.ok_or_else(|| {
                    Error::corrupt(item.loc(), "file extents of an inode without an inode item")
                })?;
                if info.item.nlink == 0 {
                    skip = Some(i);
                    continue;
                }
                self.begin_new(&info)?;
                begun = Some((info, 0));
                cur = Some((i, tree::InodeBuilder::default()));
            }
            let fe = FileExtentItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            if let Some((info, end)) = begun.as_mut() {
                let info = info.clone();
                let e = self.extent(&info, item.key.offset, &fe)?;
                *end = (*end).max(e);
            }
        }
        self.full_finish(cur.take(), begun.take())?;
        self.flush_dir_times()
    }

    /// The end of one inode of a full send: begun now if it had no extents, then its size,
    /// owner, mode and times.
    fn full_finish(
        &mut self,
        cur: Option<(u64, tree::InodeBuilder)>,
        begun: Option<(InodeInfo, u64)>,
    ) -> Result<()> {
        let (info, end) = match begun {
            Some(b) => b,
            None => {
                let Some((ino, b)) = cur else {
                    return Ok(());
                };
                let Some(info) = b.build(ino, self.snap.id)? else {
                    return Ok(());
                };
                if info.item.nlink == 0 {
                    return Ok(());
                }
                self.begin_new(&info)?;
                (info, 0)
            }
        };
        if info.kind() == 0o100000 && info.item.size > end {
            let p = self.names.path(Self::id(&info))?;
            self.w
                .begin(cmd::TRUNCATE)
                .attr(attr::PATH, &p)
                .u64(attr::SIZE, info.item.size);
            self.w.end_cmd()?;
        }
        self.finish_attrs(None, &info)?;
        // A finished file's names are the snapshot's from now on; only directories (which
        // paths go through) stay in the model, so its size follows the directories.
        if !info.is_dir() {
            self.names.forget(Self::id(&info));
        }
        Ok(())
    }

    fn subvol_name(&self) -> Result<Vec<u8>> {
        let subs = self.fs.core().list_subvolumes()?;
        let path = subs
            .iter()
            .find(|s| s.id == self.snap.id)
            .map(|s| s.path.clone())
            .unwrap_or_default();
        let name = path.rsplit(|&b| b == b'/').next().unwrap_or_default();
        if name.is_empty() {
            return Err(Error::Invalid(format!(
                "subvolume {} has no name to send it under",
                self.snap.id
            )));
        }
        Ok(name.to_vec())
    }

    /// A new inode: made (unless made earlier as a directory some name needed), named, and
    /// its xattrs set.
    fn begin_new(&mut self, info: &InodeInfo) -> Result<()> {
        self.cur_ino = info.ino;
        let id = Self::id(info);
        if info.ino == FIRST_FREE_OBJECTID {
            // The root exists with the subvolume; it gets its owner and mode now.
            return self.set_xattrs(None, info);
        }
        if !self.names.exists(id)? {
            self.create_orphan(info)?;
        }
        let want = self.wanted_names(info, self.snap)?;
        for (dir, _) in &want {
            self.ensure_dir(*dir)?;
        }
        self.give_names(id, &want)?;
        self.set_xattrs(None, info)
    }

    /// Makes sure directory `dir` exists on the receiver (made under its orphan name when a
    /// name needs it before its turn).
    fn ensure_dir(&mut self, dir: Id) -> Result<()> {
        if self.names.exists(dir)? {
            return Ok(());
        }
        let info = tree::inode_info(self.fs, self.snap, dir.0)?.ok_or_else(|| {
            Error::corrupt(
                crate::error::Location::what(format!("inode {}", dir.0)).with_tree(self.snap.id),
                "a name's directory has no inode item",
            )
        })?;
        self.create_orphan(&info)
    }

    /// Makes `info` under its orphan name in the root.
    fn create_orphan(&mut self, info: &InodeInfo) -> Result<()> {
        let id = Self::id(info);
        let name = self.names.orphan_name(id)?;
        let kind = match info.kind() {
            0o100000 => cmd::MKFILE,
            0o040000 => cmd::MKDIR,
            0o120000 => cmd::SYMLINK,
            0o010000 => cmd::MKFIFO,
            0o140000 => cmd::MKSOCK,
            0o020000 | 0o060000 => cmd::MKNOD,
            k => {
                return Err(Error::corrupt(
                    crate::error::Location::what(format!("inode {}", info.ino))
                        .with_tree(self.snap.id),
                    format!("mode {k:o} is no file type"),
                ))
            }
        };
        let target = if kind == cmd::SYMLINK {
            self.fs.readlink(Inode {
                root: self.snap.id,
                ino: info.ino,
            })?
        } else {
            Vec::new()
        };
        self.w.begin(kind).attr(attr::PATH, &name);
        match kind {
            cmd::MKNOD | cmd::MKFIFO | cmd::MKSOCK => {
                self.w
                    .u64(attr::INO, info.ino)
                    .u64(
                        attr::RDEV,
                        u64::from(crate::format::items::rdev_to_user(info.item.rdev)),
                    )
                    .u64(attr::MODE, u64::from(info.item.mode));
            }
            cmd::SYMLINK => {
                self.w
                    .u64(attr::INO, info.ino)
                    .attr(attr::PATH_LINK, &target);
            }
            _ => {
                self.w.u64(attr::INO, info.ino);
            }
        }
        self.w.end_cmd()?;
        self.tick();
        self.names.set(id, vec![(ROOT_ID, name)])?;
        self.orphans.insert(id);
        self.orphan_ops = true;
        Ok(())
    }

    /// Gives `id` every name of `want` it lacks: its orphan name renamed to the first, links
    /// for the rest; a name some other inode holds is first taken from it (that inode goes
    /// to its orphan name). Orphan names left over go.
    fn give_names(&mut self, id: Id, want: &[(Id, Vec<u8>)]) -> Result<()> {
        for (dir, name) in want {
            let have = self.names.names(id)?;
            if have.iter().any(|(d, n)| d == dir && n == name) {
                continue;
            }
            if let Some(other) = self.names.taken_by(*dir, name)? {
                if other != id {
                    self.orphanize(other, *dir, name)?;
                }
            }
            let to = self.names.join(*dir, name)?;
            let mut have = self.names.names(id)?;
            if self.orphans.contains(&id) {
                let from = self.names.path(id)?;
                self.rename_cmd(&from, &to)?;
                have.retain(|(d, n)| !(*d == ROOT_ID && self.orphan_named(id, n)));
                self.orphans.remove(&id);
            } else {
                let from = self.names.path(id)?;
                self.w
                    .begin(cmd::LINK)
                    .attr(attr::PATH, &to)
                    .attr(attr::PATH_LINK, &from);
                self.w.end_cmd()?;
            }
            self.tick();
            have.push((*dir, name.clone()));
            self.names.set(id, have)?;
            self.touch_dir(*dir);
        }
        Ok(())
    }

    /// Whether `name` is an orphan name of `id`.
    fn orphan_named(&self, id: Id, name: &[u8]) -> bool {
        let prefix = format!("o{}-{}-", id.0, id.1);
        name.starts_with(prefix.as_bytes())
    }

    /// Takes `name` in `dir` from `other`: renamed to its orphan name when it is the only
    /// name it has, unlinked otherwise.
    fn orphanize(&mut self, other: Id, dir: Id, name: &[u8]) -> Result<()> {
        let have = self.names.names(other)?;
        let path = self.names.join(dir, name)?;
        let rest: Vec<(Id, Vec<u8>)> = have
            .iter()
            .filter(|(d, n)| !(*d == dir && n == name))
            .cloned()
            .collect();
        if rest.is_empty() {
            let oname = self.names.orphan_name(other)?;
            let to = self.names.join(ROOT_ID, &oname)?;
            self.rename_cmd(&path, &to)?;
            self.names.set(other, vec![(ROOT_ID, oname)])?;
            self.orphans.insert(other);
            self.orphan_ops = true;
        } else {
            self.path_cmd(cmd::UNLINK, &path)?;
            self.names.set(other, rest)?;
        }
        self.touch_dir(dir);
        Ok(())
    }

    // ---------------------------------------------------------------------------------
    // Incremental send
    // ---------------------------------------------------------------------------------

    fn incremental(&mut self, parent: &Snap) -> Result<()> {
        let name = self.subvol_name()?;
        let (puuid, pctransid) = if parent.item.received_uuid != [0; 16] {
            (parent.item.received_uuid, parent.item.stransid)
        } else {
            (parent.item.uuid, parent.item.ctransid)
        };
        self.w
            .begin(cmd::SNAPSHOT)
            .attr(attr::PATH, &name)
            .attr(attr::UUID, &self.snap.item.uuid)
            .u64(attr::CTRANSID, self.snap.item.ctransid)
            .attr(attr::CLONE_UUID, &puuid)
            .u64(attr::CLONE_CTRANSID, pctransid);
        self.w.end_cmd()?;
        self.changed = tree::changed_inodes(self.fs, parent, self.snap)?;
        // Each pass reads the old and new forms of the changed inodes again (the blocks are
        // cached): memory holds the list of changed inode numbers, not the inodes.
        let changed: Vec<u64> = self.changed.iter().copied().collect();
        let fs = self.fs;
        let snap = self.snap;
        let pairs = || {
            changed.iter().map(
                move |&ino| -> Result<(Option<InodeInfo>, Option<InodeInfo>)> {
                    let old = tree::inode_info(fs, parent, ino)?.filter(|i| i.item.nlink > 0);
                    let new = tree::inode_info(fs, snap, ino)?.filter(|i| i.item.nlink > 0);
                    Ok((old, new))
                },
            )
        };
        // No command may run before its inode's turn comes in pass 3 and 4.
        self.cur_ino = u64::MAX;
        let same = |o: &InodeInfo, n: &InodeInfo| o.gen() == n.gen() && o.kind() == n.kind();
        let mut deleted_dirs = Vec::new();
        // Pass 1: names that go away.
        for pair in pairs() {
            let (old, new) = pair?;
            let Some(o) = old else { continue };
            if o.ino == FIRST_FREE_OBJECTID {
                continue;
            }
            let oid = Self::id(&o);
            match &new {
                Some(n) if same(&o, n) => {
                    let want = self.wanted_names(n, self.snap)?;
                    self.drop_names(oid, &want)?;
                }
                _ => {
                    if o.is_dir() {
                        self.orphan(oid)?;
                        deleted_dirs.push(oid);
                    } else {
                        let names = self.names.names(oid)?;
                        self.unlink_names(&names)?;
                        self.names.set(oid, Vec::new())?;
                    }
                }
            }
        }
        // Pass 2: new inodes, under orphan names.
        for pair in pairs() {
            let (old, new) = pair?;
            let Some(n) = new else { continue };
            if n.ino == FIRST_FREE_OBJECTID || old.as_ref().is_some_and(|o| same(o, &n)) {
                continue;
            }
            self.create_orphan(&n)?;
        }
        // Pass 3: every new name; then the deleted directories, empty now, go.
        for pair in pairs() {
            let (_, new) = pair?;
            let Some(n) = new else { continue };
            if n.ino == FIRST_FREE_OBJECTID {
                continue;
            }
            let id = Self::id(&n);
            let want = self.wanted_names(&n, self.snap)?;
            self.give_names(id, &want)?;
        }
        for id in deleted_dirs {
            let p = self.names.path(id)?;
            self.path_cmd(cmd::RMDIR, &p)?;
            self.names.set(id, Vec::new())?;
            self.orphans.remove(&id);
        }
        // Every name is the snapshot's now: the model starts over from the snapshot.
        self.names = Names::new(self.fs, Some(self.snap));
        self.orphans.clear();
        // Pass 4: contents, owners, modes, times.
        for pair in pairs() {
            let (old, new) = pair?;
            let Some(n) = new else { continue };
            self.cur_ino = n.ino;
            let old = old.as_ref().filter(|o| same(o, &n));
            self.set_xattrs(old, &n)?;
            if n.kind() == 0o100000 {
                self.file_changes(old, &n)?;
            }
            self.finish_attrs(old, &n)?;
        }
        self.flush_dir_times()
    }

    /// Takes from `id` the names it has that `want` lacks: unlinked while it keeps another
    /// it has now; else renamed straight to its one new name when that is free and not
    /// inside itself, or to its orphan name.
    fn drop_names(&mut self, id: Id, want: &[(Id, Vec<u8>)]) -> Result<()> {
        let have = self.names.names(id)?;
        let removed: Vec<(Id, Vec<u8>)> =
            have.iter().filter(|e| !want.contains(e)).cloned().collect();
        if removed.is_empty() {
            return Ok(());
        }
        let kept: Vec<(Id, Vec<u8>)> = have.iter().filter(|e| want.contains(e)).cloned().collect();
        if !kept.is_empty() {
            self.unlink_names(&removed)?;
            return self.names.set(id, kept);
        }
        let added: Vec<(Id, Vec<u8>)> =
            want.iter().filter(|e| !have.contains(e)).cloned().collect();
        // The others first: one name stays to carry the inode.
        self.unlink_names(&removed[1..])?;
        self.names.set(id, vec![removed[0].clone()])?;
        if let [(dir, name)] = added.as_slice() {
            if self.names.exists(*dir)?
                && self.names.taken_by(*dir, name)?.is_none()
                && !self.names.is_within(*dir, id)?
            {
                let from = self.names.path(id)?;
                let to = self.names.join(*dir, name)?;
                self.rename_cmd(&from, &to)?;
                self.tick();
                self.touch_dir(removed[0].0);
                self.touch_dir(*dir);
                return self.names.set(id, vec![(*dir, name.clone())]);
            }
        }
        self.orphan(id)
    }

    /// UNLINK for each of `names` (directory, name) on the receiver now; the model is the
    /// caller's to update.
    fn unlink_names(&mut self, names: &[(Id, Vec<u8>)]) -> Result<()> {
        for (dir, name) in names {
            let p = self.names.join(*dir, name)?;
            self.path_cmd(cmd::UNLINK, &p)?;
            self.touch_dir(*dir);
        }
        Ok(())
    }

    /// Renames `id` (one name) to its orphan name in the root.
    fn orphan(&mut self, id: Id) -> Result<()> {
        let have = self.names.names(id)?;
        let Some((dir, _)) = have.first().cloned() else {
            return Ok(());
        };
        let from = self.names.path(id)?;
        let oname = self.names.orphan_name(id)?;
        let to = self.names.join(ROOT_ID, &oname)?;
        self.rename_cmd(&from, &to)?;
        self.tick();
        self.touch_dir(dir);
        self.orphan_ops = true;
        self.names.set(id, vec![(ROOT_ID, oname)])?;
        self.orphans.insert(id);
        Ok(())
    }

    /// The data of a changed regular file: new file (every extent) or the extents that
    /// differ from the parent's, holes punched where the parent had data, then the size.
    fn file_changes(&mut self, old: Option<&InodeInfo>, new: &InodeInfo) -> Result<()> {
        let news = tree::file_extents(self.fs, self.snap, new.ino)?;
        let Some(old) = old else {
            let mut end = 0;
            for (off, fe) in &news {
                end = end.max(self.extent(new, *off, fe)?);
            }
            if new.item.size != end {
                self.truncate(new, new.item.size)?;
            }
            return Ok(());
        };
        let parent = self
            .parent
            .ok_or_else(|| Error::Internal("send: no parent".into()))?;
        let olds = tree::file_extents(self.fs, parent, old.ino)?;
        let size = new.item.size;
        // A file that shrank is cut first: a clone of a source's partial last sector must
        // end at the receiver's end of the file when it runs.
        if size < old.item.size {
            self.truncate(new, size)?;
        }
        let mut end = 0;
        for (off, fe) in &news {
            if *off >= size {
                break;
            }
            if olds.iter().any(|(o, f)| o == off && f == fe) || unchanged_extent(&olds, *off, fe) {
                continue;
            }
            end = end.max(self.extent(new, *off, fe)?);
        }
        // Holes: ranges the parent had data in, within both sizes, that hold none now.
        let data = |list: &[(u64, FileExtentItem)], limit: u64| -> Vec<(u64, u64)> {
            let ss = self.fs.core().sectorsize() as u64;
            let mut v = Vec::new();
            for (off, fe) in list {
                let len = match &fe.body {
                    FileExtentBody::Inline(_) => fe.ram_bytes.div_ceil(ss) * ss,
                    FileExtentBody::Extent {
                        disk_bytenr,
                        num_bytes,
                        ..
                    } => {
                        if *disk_bytenr == 0 || fe.ty == FILE_EXTENT_PREALLOC {
                            0
                        } else {
                            *num_bytes
                        }
                    }
                };
                let e = off.saturating_add(len).min(limit);
                if e > *off {
                    v.push((*off, e));
                }
            }
            v
        };
        let limit = size.min(old.item.size);
        let now = data(&news, limit);
        let before = data(&olds, limit);
        for (s, e) in before {
            // The parts of [s, e) no current data range covers.
            let mut at = s;
            for (ns, ne) in &now {
                if *ne <= at || *ns >= e {
                    continue;
                }
                if *ns > at {
                    self.punch(new, at, ns.min(&e) - at)?;
                }
                at = at.max(*ne);
            }
            if at < e {
                self.punch(new, at, e - at)?;
            }
        }
        if size > old.item.size && end != size {
            self.truncate(new, size)?;
        }
        Ok(())
    }

    fn truncate(&mut self, info: &InodeInfo, size: u64) -> Result<()> {
        let p = self.names.path(Self::id(info))?;
        self.w
            .begin(cmd::TRUNCATE)
            .attr(attr::PATH, &p)
            .u64(attr::SIZE, size);
        self.w.end_cmd()?;
        self.tick();
        Ok(())
    }

    /// Zeros where the parent had data: FALLOCATE punching a hole (version 2), zero WRITEs
    /// (version 1).
    fn punch(&mut self, info: &InodeInfo, off: u64, len: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let p = self.names.path(Self::id(info))?;
        if self.opts.no_data {
            self.w
                .begin(cmd::UPDATE_EXTENT)
                .attr(attr::PATH, &p)
                .u64(attr::FILE_OFFSET, off)
                .u64(attr::SIZE, len);
            self.w.end_cmd()?;
        } else if self.w.version() >= 2 {
            self.w
                .begin(cmd::FALLOCATE)
                .attr(attr::PATH, &p)
                .u32(attr::FALLOCATE_MODE, 3)
                .u64(attr::FILE_OFFSET, off)
                .u64(attr::SIZE, len);
            self.w.end_cmd()?;
        } else {
            let chunk = write_chunk(1);
            let zeros = vec![0u8; chunk as usize];
            let mut at = off;
            while at < off + len {
                let n = (off + len - at).min(chunk) as usize;
                self.w
                    .begin(cmd::WRITE)
                    .attr(attr::PATH, &p)
                    .u64(attr::FILE_OFFSET, at)
                    .data(&zeros[..n]);
                self.w.end_cmd()?;
                at += n as u64;
            }
        }
        self.tick();
        Ok(())
    }

    // ---------------------------------------------------------------------------------
    // Contents of one inode
    // ---------------------------------------------------------------------------------

    /// xattrs: set where new or changed, removed where gone.
    fn set_xattrs(&mut self, old: Option<&InodeInfo>, new: &InodeInfo) -> Result<()> {
        let empty = Vec::new();
        let before = old.map(|o| &o.xattrs).unwrap_or(&empty);
        if before == &new.xattrs {
            return Ok(());
        }
        let path = self.names.path(Self::id(new))?;
        for (name, value) in &new.xattrs {
            if name == CAPABILITY || before.iter().any(|(n, v)| n == name && v == value) {
                continue;
            }
            self.w
                .begin(cmd::SET_XATTR)
                .attr(attr::PATH, &path)
                .attr(attr::XATTR_NAME, name)
                .attr(attr::XATTR_DATA, value);
            self.w.end_cmd()?;
            self.tick();
        }
        for (name, _) in before {
            if !new.xattrs.iter().any(|(n, _)| n == name) {
                self.w
                    .begin(cmd::REMOVE_XATTR)
                    .attr(attr::PATH, &path)
                    .attr(attr::XATTR_NAME, name);
                self.w.end_cmd()?;
                self.tick();
            }
        }
        Ok(())
    }

    /// Owner, mode and (for all but directories, whose times go at the end) times.
    fn finish_attrs(&mut self, old: Option<&InodeInfo>, new: &InodeInfo) -> Result<()> {
        let id = Self::id(new);
        let path = self.names.path(id)?;
        let i = &new.item;
        if old.is_none_or(|o| o.item.uid != i.uid || o.item.gid != i.gid) {
            self.w
                .begin(cmd::CHOWN)
                .attr(attr::PATH, &path)
                .u64(attr::UID, u64::from(i.uid))
                .u64(attr::GID, u64::from(i.gid));
            self.w.end_cmd()?;
        }
        if new.kind() != 0o120000 && old.is_none_or(|o| o.item.mode != i.mode) {
            self.w
                .begin(cmd::CHMOD)
                .attr(attr::PATH, &path)
                .u64(attr::MODE, u64::from(i.mode & 0o7777));
            self.w.end_cmd()?;
        }
        if let Some(o) = old {
            if self.w.version() >= 2 && new.kind() != 0o120000 && o.item.flags != i.flags {
                self.w
                    .begin(cmd::FILEATTR)
                    .attr(attr::PATH, &path)
                    .u64(attr::FILEATTR, i.flags);
                self.w.end_cmd()?;
            }
        }
        // After chown and chmod, which drop it.
        if let Some((name, value)) = new.xattrs.iter().find(|(n, _)| n == CAPABILITY) {
            let before = old.and_then(|o| o.xattrs.iter().find(|(n, _)| n == CAPABILITY));
            if before.is_none_or(|(_, v)| v != value)
                || old.is_some_and(|o| {
                    o.item.uid != i.uid || o.item.gid != i.gid || o.item.mode != i.mode
                })
            {
                self.w
                    .begin(cmd::SET_XATTR)
                    .attr(attr::PATH, &path)
                    .attr(attr::XATTR_NAME, name)
                    .attr(attr::XATTR_DATA, value);
                self.w.end_cmd()?;
            }
        }
        if new.is_dir() && i.size > 0 {
            self.cache_dir_times(id)?;
        } else {
            self.utimes(&path, i)?;
        }
        self.tick();
        self.trim_dir_times()
    }

    fn utimes(&mut self, path: &[u8], i: &InodeItem) -> Result<()> {
        self.w
            .begin(cmd::UTIMES)
            .attr(attr::PATH, path)
            .time(attr::ATIME, i.atime.sec, i.atime.nsec)
            .time(attr::MTIME, i.mtime.sec, i.mtime.nsec)
            .time(attr::CTIME, i.ctime.sec, i.ctime.nsec);
        if self.w.version() >= 2 {
            self.w.time(attr::OTIME, i.otime.sec, i.otime.nsec);
        }
        self.w.end_cmd()
    }

    /// A name came or went in directory `dir`: its times are owed, if it is already on
    /// the receiver in its final form (a directory after the current inode gets them at
    /// its own turn).
    fn touch_dir(&mut self, dir: Id) {
        if dir.0 <= self.cur_ino || self.parent.is_some() {
            let _ = self.cache_dir_times(dir);
        }
    }

    /// Owes `dir` its times: to the most recently touched end of the list.
    fn cache_dir_times(&mut self, dir: Id) -> Result<()> {
        self.dir_times.retain(|d| *d != dir);
        self.dir_times.push_back(dir);
        Ok(())
    }

    /// Pays the times of the least recently touched directories beyond the list's bound.
    fn trim_dir_times(&mut self) -> Result<()> {
        while self.dir_times.len() > DIR_TIMES_KEPT {
            if let Some(id) = self.dir_times.pop_front() {
                self.dir_utimes(id)?;
            }
        }
        Ok(())
    }

    /// Times of every directory still owed them, most recently touched first.
    fn flush_dir_times(&mut self) -> Result<()> {
        if self.orphan_ops && !self.dir_times.contains(&ROOT_ID) {
            self.dir_times.push_front(ROOT_ID);
        }
        while let Some(id) = self.dir_times.pop_back() {
            self.dir_utimes(id)?;
        }
        Ok(())
    }

    /// UTIMES for directory `id` with the snapshot's times (nothing when it is gone).
    fn dir_utimes(&mut self, id: Id) -> Result<()> {
        let Some(info) = tree::inode_info(self.fs, self.snap, id.0)? else {
            return Ok(());
        };
        if id != ROOT_ID && info.gen() != id.1 {
            return Ok(()); // a directory of the parent that is gone
        }
        let path = self.names.path(id)?;
        self.utimes(&path, &info.item)?;
        self.tick();
        Ok(())
    }

    /// Sends the extent item `fe` at file offset `off` of `info` (a new inode, or one whose
    /// item there changed). Returns the file offset its data reaches (0 for none).
    fn extent(&mut self, info: &InodeInfo, off: u64, fe: &FileExtentItem) -> Result<u64> {
        let size = info.item.size;
        // A symlink's target went with its SYMLINK command.
        if off >= size || info.kind() != 0o100000 {
            return Ok(0);
        }
        let id = Self::id(info);
        let len = match &fe.body {
            FileExtentBody::Inline(_) => fe.ram_bytes,
            FileExtentBody::Extent {
                disk_bytenr,
                num_bytes,
                ..
            } => {
                if *disk_bytenr == 0 || fe.ty == FILE_EXTENT_PREALLOC {
                    return Ok(0);
                }
                *num_bytes
            }
        }
        .min(size - off);
        if len == 0 {
            return Ok(0);
        }
        let path = self.names.path(id)?;
        if let FileExtentBody::Extent {
            disk_bytenr,
            offset: eoff,
            ..
        } = fe.body
        {
            let wanted = clone::Wanted {
                bytenr: disk_bytenr,
                extent_offset: eoff,
                len,
            };
            if self.try_clone(info, &path, off, &wanted)? {
                return Ok(off + len);
            }
        }
        if self.opts.no_data {
            self.w
                .begin(cmd::UPDATE_EXTENT)
                .attr(attr::PATH, &path)
                .u64(attr::FILE_OFFSET, off)
                .u64(attr::SIZE, len);
            self.w.end_cmd()?;
            self.tick();
            return Ok(off + len);
        }
        if let FileExtentBody::Extent {
            disk_bytenr,
            disk_num_bytes,
            offset: eoff,
            ..
        } = fe.body
        {
            if self.opts.compressed_data && fe.compression != COMPRESS_NONE && disk_num_bytes <= len
            {
                let raw = self.fs.core().read_verified(
                    Inode {
                        root: self.snap.id,
                        ino: info.ino,
                    },
                    off,
                    0,
                    disk_bytenr,
                    disk_num_bytes as usize,
                    info.item.flags & INODE_NODATASUM != 0,
                )?;
                self.encoded(
                    &path,
                    off,
                    len,
                    fe.ram_bytes,
                    eoff,
                    fe.compression,
                    &raw,
                    true,
                )?;
                return Ok(off + len);
            }
        }
        if let FileExtentBody::Inline(raw) = &fe.body {
            if self.opts.compressed_data
                && fe.compression != COMPRESS_NONE
                && raw.len() as u64 <= len
            {
                self.encoded(&path, off, len, fe.ram_bytes, 0, fe.compression, raw, false)?;
                return Ok(off + len);
            }
        }
        self.write_range(info.ino, &path, off, len)?;
        Ok(off + len)
    }

    /// WRITE commands with the file's bytes of `[off, off + len)`.
    fn write_range(&mut self, ino: u64, path: &[u8], off: u64, len: u64) -> Result<()> {
        let chunk = write_chunk(self.opts.proto);
        let mut at = off;
        let end = off + len;
        while at < end {
            let n = (end - at).min(chunk);
            let data = self.fs.read(
                Inode {
                    root: self.snap.id,
                    ino,
                },
                at,
                n as usize,
            )?;
            if data.len() as u64 != n {
                return Err(Error::Internal(format!(
                    "send: read {} of {n} bytes at {at} of inode {ino}",
                    data.len()
                )));
            }
            self.w
                .begin(cmd::WRITE)
                .attr(attr::PATH, path)
                .u64(attr::FILE_OFFSET, at)
                .data(&data);
            self.w.end_cmd()?;
            self.tick();
            at += n;
        }
        Ok(())
    }

    /// One ENCODED_WRITE: a compressed extent as it is.
    #[allow(clippy::too_many_arguments)]
    fn encoded(
        &mut self,
        path: &[u8],
        off: u64,
        len: u64,
        ram_bytes: u64,
        eoff: u64,
        compression: u8,
        raw: &[u8],
        regular: bool,
    ) -> Result<()> {
        let ss = self.fs.core().sectorsize() as u64;
        // The stream's codes: 1 zlib, 2 zstd, 3 + log2(sector / 4 KiB) lzo.
        let code: u32 = match compression {
            COMPRESS_ZLIB => 1,
            COMPRESS_ZSTD => 2,
            _ => 3 + (ss / 4096).max(1).trailing_zeros(),
        };
        self.w
            .begin(cmd::ENCODED_WRITE)
            .attr(attr::PATH, path)
            .u64(attr::FILE_OFFSET, off)
            .u64(attr::UNENCODED_FILE_LEN, len)
            .u64(attr::UNENCODED_LEN, ram_bytes)
            .u64(attr::UNENCODED_OFFSET, eoff)
            .u32(attr::COMPRESSION, code);
        if regular {
            self.w.u32(attr::ENCRYPTION, 0);
        }
        self.w.data(raw);
        self.w.end_cmd()?;
        self.tick();
        Ok(())
    }

    /// A CLONE of the wanted extent range from a file the receiver has, if there is one.
    fn try_clone(
        &mut self,
        info: &InodeInfo,
        path: &[u8],
        off: u64,
        w: &clone::Wanted,
    ) -> Result<bool> {
        let ss = self.fs.core().sectorsize() as u64;
        // Whole sectors only, or up to the end of the file.
        if !w.len.is_multiple_of(ss) && off + w.len != info.item.size {
            return Ok(false);
        }
        let mut snaps: Vec<&Snap> = vec![self.snap];
        if let Some(p) = self.parent {
            snaps.push(p);
        }
        snaps.extend(self.clones.iter());
        let cur = info.ino;
        let incremental = self.parent.is_some();
        let changed = &self.changed;
        // A file of this snapshot is on the receiver as the snapshot has it when the stream
        // is past it (inodes go in order, a file's extents too) or it did not change.
        let usable = |snap: usize, ino: u64, o: u64| -> bool {
            snap > 0
                || (ino == cur && o.saturating_add(w.len) <= off)
                || ino < cur
                || (incremental && !changed.contains(&ino))
        };
        let only_self = self.parent.is_none() && self.clones.is_empty();
        let Some(src) = clone::find(self.fs, &snaps, w, only_self, &usable)? else {
            return Ok(false);
        };
        let snap = snaps[src.snap];
        // As the kernel: a lone first sector is written, and a partial last sector is
        // cloned only from the end of one file to the end of the other.
        if w.len == ss && src.offset == 0 {
            return Ok(false);
        }
        if !w.len.is_multiple_of(ss) {
            let src_size = tree::inode_info(self.fs, snap, src.ino)?
                .map(|i| i.item.size)
                .unwrap_or(0);
            if src.offset.saturating_add(w.len) != src_size {
                return Ok(false);
            }
        }
        let src_path = if src.snap == 0 {
            match self.current_path(src.ino) {
                Ok(p) => p,
                // An inode the stream never sent (no names): not a source.
                Err(_) => return Ok(false),
            }
        } else {
            self.path_in(snap, src.ino)?
        };
        let (uuid, ctransid) = (snap.item.uuid, snap.item.ctransid);
        self.w
            .begin(cmd::CLONE)
            .u64(attr::FILE_OFFSET, off)
            .u64(attr::CLONE_LEN, w.len)
            .attr(attr::PATH, path)
            .attr(attr::CLONE_UUID, &uuid)
            .u64(attr::CLONE_CTRANSID, ctransid)
            .attr(attr::CLONE_PATH, &src_path)
            .u64(attr::CLONE_OFFSET, src.offset);
        self.w.end_cmd()?;
        self.tick();
        Ok(true)
    }

    /// The receiver's path now of inode `ino` of the snapshot, one the stream is past or
    /// that did not change: its first name in the snapshot, under its directory's path now.
    fn current_path(&mut self, ino: u64) -> Result<Vec<u8>> {
        let info = tree::inode_info(self.fs, self.snap, ino)?
            .filter(|i| i.item.nlink > 0)
            .ok_or_else(|| Error::Internal(format!("send: inode {ino} is not in the snapshot")))?;
        let Some((dir, name)) = info.names.first().cloned() else {
            return Err(Error::Internal(format!("send: inode {ino} has no name")));
        };
        let gen = if dir == FIRST_FREE_OBJECTID {
            0
        } else {
            self.gen_in(self.snap, dir)?
        };
        self.names.join(dir_id(dir, gen), &name)
    }

    /// The path of `ino` in `snap` as it is (a snapshot the receiver has unchanged).
    fn path_in(&self, snap: &Snap, ino: u64) -> Result<Vec<u8>> {
        self.fs
            .core()
            .inode_path_bytes(Inode { root: snap.id, ino })
    }
}
