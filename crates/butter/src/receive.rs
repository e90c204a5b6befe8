//! Receive: a send stream (the kernel's `btrfs send` or butter's) applied to an image, with
//! no kernel and no root, as `btrfs receive` applies it to a mounted btrfs.
//!
//! Each subvolume of the stream starts with SUBVOL (a new, empty subvolume under the
//! destination directory) or SNAPSHOT (a writable snapshot of its parent, found through the
//! uuid tree by received uuid first, then by uuid, as `btrfs receive` looks). The commands
//! after it change that subvolume only, by paths from its root. At its END it gets the
//! sender's uuid as its received uuid, the sender's transaction as stransid, rtransid and
//! rtime from here, a RECEIVED_SUBVOL uuid entry (so a later incremental stream finds it),
//! and it becomes read-only; then the transaction commits.
//!
//! As `btrfs receive` does: new inodes start as root's with mode 0600 (directories 0700)
//! until the stream's chown and chmod; utimes sets atime and mtime (ctime is the time of the
//! change); FILEATTR is ignored; CLONE shares extents where the range allows (a reflink) and
//! copies otherwise; ENCODED_WRITE stores the compressed extent as it is where the file can
//! take one, and writes the decoded bytes otherwise.
//!
//! Nothing in the stream is trusted. Paths must be relative, without `.`, `..` or empty
//! components, and may not pass through a symlink, a non-directory or into another
//! subvolume; a clone's source must be the subvolume being received or one found by its
//! uuid. Damage to the stream itself (checksums, lengths, attributes) stops the receive at
//! once; a command that cannot be applied is an error naming the command's index, its byte
//! offset and its path, and counts toward the error limit. A subvolume with an error is
//! left writable and without a received uuid, so it is never taken for a complete copy.

use crate::error::{Error, Result};
use crate::format::compress::decompress;
use crate::format::items::Timespec;
use crate::format::send_stream::{attr, cmd, Command, StreamReader};
use crate::fs::Fs;
use crate::ids::Inode;
use crate::inode::encoded::EncodedExtent;
use crate::inode::namespace::{Owner, SetAttr};
use std::io::Read;

/// How a receive runs.
#[derive(Debug, Clone)]
pub struct ReceiveOptions {
    /// Stop at the first END command instead of reading further streams (`-e`).
    pub stop_at_end: bool,
    /// Stop after this many commands failed (`-E`); 0: never stop for failed commands.
    pub max_errors: u64,
}

impl Default for ReceiveOptions {
    fn default() -> Self {
        ReceiveOptions {
            stop_at_end: false,
            max_errors: 1,
        }
    }
}

/// How far a receive has come.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReceiveProgress {
    /// Bytes of the stream read.
    pub bytes: u64,
    /// Commands applied (or failed).
    pub commands: u64,
    /// File data written (WRITE, ENCODED_WRITE and CLONE lengths).
    pub data: u64,
}

/// One subvolume a receive made.
#[derive(Debug, Clone)]
pub struct ReceivedSubvol {
    /// Its name in the destination directory.
    pub name: String,
    /// Its subvolume id.
    pub id: u64,
    /// Whether it ended complete (read-only, with its received uuid).
    pub complete: bool,
}

/// What a receive did.
#[derive(Debug, Default)]
pub struct ReceiveReport {
    /// The subvolumes it made, in stream order.
    pub subvolumes: Vec<ReceivedSubvol>,
    /// The commands that could not be applied (fewer than the error limit).
    pub errors: Vec<String>,
    /// What stopped the receive before the end of the input: damage to the stream, an
    /// error of the image, the error limit's last command, or an input that is no stream.
    pub stopped: Option<Error>,
    /// Where it stopped.
    pub progress: ReceiveProgress,
}

/// The subvolume being received.
struct Current {
    name: String,
    /// Its root directory.
    root: Inode,
    /// The sender's uuid and transaction for it.
    uuid: [u8; 16],
    stransid: u64,
    /// Whether a command of it failed.
    failed: bool,
    /// Whether its END came.
    ended: bool,
}

struct Receiver<'a> {
    fs: &'a Fs,
    dir: Inode,
    cur: Option<Current>,
    report: ReceiveReport,
    /// The last path a WRITE or CLONE resolved, for the many writes of one file.
    last: Option<(Vec<u8>, Inode)>,
    /// Subvolumes found by uuid (the clones of a stream keep asking for the same few);
    /// emptied when a subvolume ends, since that adds a received uuid.
    by_uuid: std::collections::HashMap<[u8; 16], Option<u64>>,
    /// Data and commands at the last commit.
    committed: (u64, u64),
}

/// A long stream commits along the way, so the running transaction (and the memory its
/// changes hold) stays bounded: after this much file data or this many commands.
const COMMIT_DATA: u64 = 256 << 20;
const COMMIT_COMMANDS: u64 = 100_000;

/// Applies the send stream `input` to `fs`, making its subvolumes in directory `dir`.
/// `progress` is called after every command. The report says which subvolumes were made and
/// whether each is complete; `stopped` holds what ended the receive early, `errors` the
/// failed commands short of the error limit (either means the receive failed).
pub fn receive(
    fs: &Fs,
    dir: Inode,
    input: impl Read,
    opts: &ReceiveOptions,
    progress: &mut dyn FnMut(&ReceiveProgress),
) -> ReceiveReport {
    let mut r = Receiver {
        fs,
        dir,
        cur: None,
        report: ReceiveReport::default(),
        last: None,
        by_uuid: Default::default(),
        committed: (0, 0),
    };
    if let Err(e) = r.run(input, opts, progress) {
        r.record_unfinished();
        r.report.stopped = Some(e);
    }
    r.report
}

impl Receiver<'_> {
    fn run(
        &mut self,
        input: impl Read,
        opts: &ReceiveOptions,
        progress: &mut dyn FnMut(&ReceiveProgress),
    ) -> Result<()> {
        if !self.fs.core().is_writable() {
            return Err(Error::ReadOnly);
        }
        self.fs.core().require_dir(self.dir)?;
        // Receive works near the blocks it just wrote: a small cache keeps its memory
        // bounded whatever the stream's size.
        self.fs.core().disk().limit_cache(64 << 20);
        let mut s = StreamReader::new(input)?;
        while let Some(c) = s.next_command()? {
            let applied = self.apply(&c);
            self.report.progress.bytes = s.offset();
            self.report.progress.commands = c.index;
            if let Err(e) = applied {
                let fatal = matches!(
                    e,
                    Error::Io { .. }
                        | Error::Corrupt { .. }
                        | Error::BadChecksum { .. }
                        | Error::DataChecksum { .. }
                        | Error::Internal(_)
                        | Error::Aborted(_)
                        | Error::ReadOnly
                        | Error::NoSpace(_)
                        | Error::WriteLost(_)
                );
                let e = if fatal {
                    e
                } else {
                    Error::Invalid(format!(
                        "{}{}: {e}",
                        crate::format::send_stream::command_loc(c.index, c.kind, c.offset),
                        c.bytes(attr::PATH)
                            .map(|p| format!(", path \"{}\"", String::from_utf8_lossy(p)))
                            .unwrap_or_default()
                    ))
                };
                if let Some(cur) = &mut self.cur {
                    cur.failed = true;
                }
                let limit = opts.max_errors;
                if fatal || (limit > 0 && self.report.errors.len() as u64 + 1 >= limit) {
                    return Err(e);
                }
                log::error!("{e}");
                self.report.errors.push(e.to_string());
            }
            progress(&self.report.progress);
            let p = self.report.progress;
            if p.data - self.committed.0 >= COMMIT_DATA
                || p.commands - self.committed.1 >= COMMIT_COMMANDS
            {
                self.fs.core().commit()?;
                self.committed = (p.data, p.commands);
            }
            if c.kind == cmd::END {
                self.finish()?;
                if opts.stop_at_end {
                    break;
                }
            }
        }
        if self.cur.as_ref().is_some_and(|c| !c.ended) {
            return Err(Error::corrupt(
                crate::error::Location::what(format!("send stream at byte {}", s.offset())),
                "the stream ends before its end command (cut short?)",
            ));
        }
        Ok(())
    }

    fn cur(&self) -> Result<&Current> {
        self.cur.as_ref().filter(|c| !c.ended).ok_or_else(|| {
            Error::Invalid("a command outside a subvolume (before subvol or snapshot)".into())
        })
    }

    /// The root directory of the subvolume being received.
    fn root(&self) -> Result<Inode> {
        Ok(self.cur()?.root)
    }

    /// Ends the current subvolume: received and read-only when nothing of it failed.
    fn finish(&mut self) -> Result<()> {
        let Some(cur) = self.cur.as_mut() else {
            return Ok(());
        };
        if cur.ended {
            return Ok(());
        }
        cur.ended = true;
        self.by_uuid.clear();
        let (id, name, failed) = (cur.root.root, cur.name.clone(), cur.failed);
        if !failed {
            self.fs
                .core()
                .finish_received(id, &cur.uuid, cur.stransid)?;
        }
        self.fs.core().commit()?;
        self.report.subvolumes.push(ReceivedSubvol {
            name,
            id,
            complete: !failed,
        });
        Ok(())
    }

    /// Notes the current subvolume, cut short, in the report.
    fn record_unfinished(&mut self) {
        if let Some(cur) = self.cur.as_ref().filter(|c| !c.ended) {
            self.report.subvolumes.push(ReceivedSubvol {
                name: cur.name.clone(),
                id: cur.root.root,
                complete: false,
            });
        }
    }

    /// The components of a path of the stream (empty: the subvolume's root).
    fn components(path: &[u8]) -> Result<Vec<&[u8]>> {
        if path.is_empty() {
            return Ok(Vec::new());
        }
        if path[0] == b'/' {
            return Err(Error::Invalid("an absolute path".into()));
        }
        let parts: Vec<&[u8]> = path.split(|b| *b == b'/').collect();
        for p in &parts {
            if p.is_empty() || *p == b"." || *p == b".." {
                return Err(Error::Invalid(format!(
                    "a path with a \"{}\" component",
                    String::from_utf8_lossy(p)
                )));
            }
        }
        Ok(parts)
    }

    /// Walks `parts` from `root` (a subvolume's root directory): every step a directory of
    /// the same subvolume, and the last entry in it too.
    fn walk(&self, root: Inode, parts: &[&[u8]]) -> Result<Inode> {
        let mut at = root;
        for (i, p) in parts.iter().enumerate() {
            let e = self.fs.lookup(at, p)?.ok_or_else(|| {
                Error::NotFound(String::from_utf8_lossy(&parts[..=i].join(&b'/')).into_owned())
            })?;
            if e.target.root != root.root {
                return Err(Error::Invalid(format!(
                    "\"{}\" is another subvolume",
                    String::from_utf8_lossy(&parts[..=i].join(&b'/'))
                )));
            }
            if i + 1 < parts.len() && e.file_type != crate::format::FT_DIR {
                return Err(Error::Invalid(format!(
                    "\"{}\" is not a directory (a path may not pass through a symlink or a \
                     file)",
                    String::from_utf8_lossy(&parts[..=i].join(&b'/'))
                )));
            }
            at = e.target;
        }
        Ok(at)
    }

    /// The inode at attribute `ty`'s path in the subvolume being received.
    fn inode_at(&self, c: &Command, ty: u16) -> Result<Inode> {
        let parts = Self::components(c.bytes(ty)?)?;
        self.walk(self.root()?, &parts)
    }

    /// The file at attribute PATH, remembered for the next data command.
    fn file_at(&mut self, c: &Command) -> Result<Inode> {
        let path = c.bytes(attr::PATH)?;
        if let Some((p, ino)) = &self.last {
            if p.as_slice() == path {
                return Ok(*ino);
            }
        }
        let ino = self.inode_at(c, attr::PATH)?;
        self.last = Some((path.to_vec(), ino));
        Ok(ino)
    }

    /// The directory and the name of attribute `ty`'s path (which need not exist).
    fn parent_of<'c>(&self, c: &'c Command, ty: u16) -> Result<(Inode, &'c [u8])> {
        let parts = Self::components(c.bytes(ty)?)?;
        let Some((name, dirs)) = parts.split_last() else {
            return Err(Error::Invalid("the subvolume's root as a new name".into()));
        };
        Ok((self.walk(self.root()?, dirs)?, name))
    }

    /// The name of a new subvolume: one component.
    fn subvol_name(c: &Command) -> Result<&[u8]> {
        let path = c.bytes(attr::PATH)?;
        match Self::components(path)?.as_slice() {
            [one] => Ok(one),
            _ => Err(Error::Invalid(format!(
                "subvolume name \"{}\" is not one path component",
                String::from_utf8_lossy(path)
            ))),
        }
    }

    /// The subvolume the sender knew as `uuid`: received from it, else it itself.
    fn subvol_by_uuid(&mut self, uuid: &[u8; 16]) -> Result<Option<u64>> {
        if let Some(found) = self.by_uuid.get(uuid) {
            return Ok(*found);
        }
        let found = match self.fs.core().subvols_by_uuid(uuid, true)?.first() {
            Some(id) => Some(*id),
            None => self
                .fs
                .core()
                .subvols_by_uuid(uuid, false)?
                .first()
                .copied(),
        };
        self.by_uuid.insert(*uuid, found);
        Ok(found)
    }

    fn apply(&mut self, c: &Command) -> Result<()> {
        let root = Owner::default();
        match c.kind {
            cmd::SUBVOL | cmd::SNAPSHOT => {
                self.finish()?;
                self.last = None;
                let name = Self::subvol_name(c)?;
                let uuid = c.uuid_bytes(attr::UUID)?;
                let stransid = c.u64(attr::CTRANSID)?;
                let made = if c.kind == cmd::SUBVOL {
                    self.fs
                        .core()
                        .create_subvolume(self.dir, name, 0o755, root, None)
                } else {
                    let parent = c.uuid_bytes(attr::CLONE_UUID)?;
                    let id = self.subvol_by_uuid(&parent)?.ok_or_else(|| {
                        Error::NotFound(format!(
                            "the parent subvolume {} of this snapshot (receive the stream it \
                             was sent against first, or send in full)",
                            crate::format::fmt_uuid(&parent)
                        ))
                    })?;
                    self.fs
                        .core()
                        .create_snapshot(id, self.dir, name, false, None)
                };
                let root_dir = made.map_err(|e| match e {
                    Error::Exists(_) => Error::Exists(format!(
                        "\"{}\" in the destination directory (receive into another directory, \
                         or delete it first)",
                        String::from_utf8_lossy(name)
                    )),
                    e => e,
                })?;
                self.cur = Some(Current {
                    name: String::from_utf8_lossy(name).into_owned(),
                    root: root_dir,
                    uuid,
                    stransid,
                    failed: false,
                    ended: false,
                });
            }
            cmd::MKFILE | cmd::MKDIR | cmd::MKFIFO | cmd::MKSOCK => {
                let (dir, name) = self.parent_of(c, attr::PATH)?;
                let mode = match c.kind {
                    cmd::MKFILE => 0o100600,
                    cmd::MKDIR => 0o040700,
                    cmd::MKFIFO => 0o010600,
                    _ => 0o140600,
                };
                self.fs.core().mknod(dir, name, mode, 0, root)?;
            }
            cmd::MKNOD => {
                let (dir, name) = self.parent_of(c, attr::PATH)?;
                let mode = c.u64(attr::MODE)? as u32;
                if !matches!(mode & 0o170000, 0o020000 | 0o060000 | 0o010000 | 0o140000) {
                    return Err(Error::Invalid(format!("mknod with mode {mode:o}")));
                }
                // The stream has the userspace encoding (what stat(2) shows).
                let dev = c.u64(attr::RDEV)?;
                let dev = u32::try_from(dev)
                    .map_err(|_| Error::Invalid(format!("device number {dev:#x}")))?;
                let rdev = crate::format::items::rdev_from_user(dev);
                self.fs
                    .core()
                    .mknod(dir, name, mode & 0o177777, rdev, root)?;
            }
            cmd::SYMLINK => {
                let (dir, name) = self.parent_of(c, attr::PATH)?;
                self.fs
                    .core()
                    .symlink(dir, name, c.bytes(attr::PATH_LINK)?, root)?;
            }
            cmd::RENAME => {
                let (from_dir, from) = self.parent_of(c, attr::PATH)?;
                let (to_dir, to) = self.parent_of(c, attr::PATH_TO)?;
                self.last = None;
                self.fs.core().rename(from_dir, from, to_dir, to, 0)?;
            }
            cmd::LINK => {
                let target = self.inode_at(c, attr::PATH_LINK)?;
                let (dir, name) = self.parent_of(c, attr::PATH)?;
                self.fs.core().link(target, dir, name)?;
            }
            cmd::UNLINK | cmd::RMDIR => {
                let (dir, name) = self.parent_of(c, attr::PATH)?;
                self.last = None;
                if c.kind == cmd::UNLINK {
                    self.fs.core().unlink(dir, name)?;
                } else {
                    self.fs.core().rmdir(dir, name)?;
                }
            }
            cmd::SET_XATTR => {
                let ino = self.inode_at(c, attr::PATH)?;
                self.fs.core().setxattr(
                    ino,
                    c.bytes(attr::XATTR_NAME)?,
                    c.bytes(attr::XATTR_DATA)?,
                    0,
                )?;
            }
            cmd::REMOVE_XATTR => {
                let ino = self.inode_at(c, attr::PATH)?;
                self.fs
                    .core()
                    .removexattr(ino, c.bytes(attr::XATTR_NAME)?)?;
            }
            cmd::WRITE => {
                let ino = self.file_at(c)?;
                let data = c.bytes(attr::DATA)?;
                self.write_all(ino, c.u64(attr::FILE_OFFSET)?, data)?;
            }
            cmd::CLONE => self.clone(c)?,
            cmd::TRUNCATE => {
                let ino = self.file_at(c)?;
                self.fs.core().truncate(ino, c.u64(attr::SIZE)?)?;
            }
            cmd::CHMOD => {
                let ino = self.inode_at(c, attr::PATH)?;
                let mode = c.u64(attr::MODE)? as u32;
                self.fs.core().setattr(
                    ino,
                    &SetAttr {
                        mode: Some(mode & 0o7777),
                        ..Default::default()
                    },
                )?;
            }
            cmd::CHOWN => {
                let ino = self.inode_at(c, attr::PATH)?;
                let id = |ty| -> Result<u32> {
                    let v = c.u64(ty)?;
                    u32::try_from(v).map_err(|_| Error::Invalid(format!("owner id {v}")))
                };
                self.fs.core().setattr(
                    ino,
                    &SetAttr {
                        uid: Some(id(attr::UID)?),
                        gid: Some(id(attr::GID)?),
                        ..Default::default()
                    },
                )?;
            }
            cmd::UTIMES => {
                let ino = self.inode_at(c, attr::PATH)?;
                let time = |ty| -> Result<Timespec> {
                    let (sec, nsec) = c.timespec(ty)?;
                    if nsec >= 1_000_000_000 {
                        return Err(Error::Invalid(format!("{nsec} nanoseconds")));
                    }
                    Ok(Timespec { sec, nsec })
                };
                self.fs.core().setattr(
                    ino,
                    &SetAttr {
                        atime: Some(time(attr::ATIME)?),
                        mtime: Some(time(attr::MTIME)?),
                        ..Default::default()
                    },
                )?;
            }
            // END: the caller finishes the subvolume once the command is counted.
            cmd::END => {
                self.cur()?;
            }
            // UPDATE_EXTENT (a send with --no-data) and FILEATTR change nothing here, as in
            // btrfs receive.
            cmd::UPDATE_EXTENT | cmd::FILEATTR => {
                self.inode_at(c, attr::PATH)?;
            }
            cmd::FALLOCATE => {
                let ino = self.file_at(c)?;
                let mode = u32::try_from(c.u64(attr::FALLOCATE_MODE)?)
                    .map_err(|_| Error::Invalid("fallocate mode out of range".into()))?;
                self.fs.core().fallocate(
                    ino,
                    mode,
                    c.u64(attr::FILE_OFFSET)?,
                    c.u64(attr::SIZE)?,
                )?;
                self.report.progress.data =
                    self.report.progress.data.saturating_add(c.u64(attr::SIZE)?);
            }
            cmd::ENCODED_WRITE => self.encoded_write(c)?,
            cmd::ENABLE_VERITY => {
                return Err(Error::Unsupported(
                    "fs-verity (enable_verity): butter does not write verity data".into(),
                ))
            }
            k => return Err(Error::Invalid(format!("unknown command {k}"))),
        }
        Ok(())
    }

    fn write_all(&mut self, ino: Inode, offset: u64, data: &[u8]) -> Result<()> {
        let mut done = 0;
        while done < data.len() {
            let n = self
                .fs
                .core()
                .write(ino, offset + done as u64, &data[done..])?;
            if n == 0 {
                return Err(Error::Internal("a write took no bytes".into()));
            }
            done += n;
        }
        self.report.progress.data += data.len() as u64;
        Ok(())
    }

    fn clone(&mut self, c: &Command) -> Result<()> {
        let dst = self.file_at(c)?;
        let offset = c.u64(attr::FILE_OFFSET)?;
        let len = c.u64(attr::CLONE_LEN)?;
        let src_off = c.u64(attr::CLONE_OFFSET)?;
        let uuid = c.uuid_bytes(attr::CLONE_UUID)?;
        let cur = self.cur()?;
        let src_root = if uuid == cur.uuid {
            cur.root
        } else {
            let id = self.subvol_by_uuid(&uuid)?.ok_or_else(|| {
                Error::NotFound(format!(
                    "the clone source subvolume {} (not received here)",
                    crate::format::fmt_uuid(&uuid)
                ))
            })?;
            self.fs.core().subvol_root_inode(id)?
        };
        let parts = Self::components(c.bytes(attr::CLONE_PATH)?)?;
        let src = self.walk(src_root, &parts)?;
        let done = self
            .fs
            .core()
            .copy_file_range(src, src_off, dst, offset, len)?;
        if done < len {
            return Err(Error::Invalid(format!(
                "clone of {len} bytes from offset {src_off}: the source has only {done}"
            )));
        }
        self.report.progress.data = self.report.progress.data.saturating_add(len);
        Ok(())
    }

    fn encoded_write(&mut self, c: &Command) -> Result<()> {
        let ino = self.file_at(c)?;
        let offset = c.u64(attr::FILE_OFFSET)?;
        let data = c.bytes(attr::DATA)?;
        if c.u64_or(attr::ENCRYPTION, 0)? != 0 {
            return Err(Error::Unsupported("an encrypted extent".into()));
        }
        let ss = self.fs.core().sectorsize();
        // The stream's codes: 1 zlib, 2 zstd, 3 to 7 lzo in sectors of 4 KiB to 64 KiB.
        let compression = match c.u64_or(attr::COMPRESSION, 0)? {
            1 => crate::format::compress::COMPRESS_ZLIB,
            2 => crate::format::compress::COMPRESS_ZSTD,
            k @ 3..=7 if 4096u64 << (k - 3) == ss as u64 => crate::format::compress::COMPRESS_LZO,
            k => {
                return Err(Error::Unsupported(format!(
                    "encoded write with compression code {k} on sectors of {ss} bytes"
                )))
            }
        };
        let e = EncodedExtent {
            data,
            file_len: c.u64(attr::UNENCODED_FILE_LEN)?,
            decoded_len: c.u64(attr::UNENCODED_LEN)?,
            decoded_offset: c.u64(attr::UNENCODED_OFFSET)?,
            compression,
        };
        match self.fs.core().write_encoded(ino, offset, &e) {
            Err(Error::Unsupported(why)) => {
                log::debug!("encoded write at {offset} written decoded: {why}");
                if e.decoded_len > crate::inode::read::MAX_COMPRESSED {
                    return Err(Error::Invalid(format!(
                        "encoded write decoding to {} bytes",
                        e.decoded_len
                    )));
                }
                let plain = decompress(compression, data, e.decoded_len as usize, ss)
                    .map_err(|err| Error::Invalid(format!("encoded write: {err}")))?;
                let from = usize::try_from(e.decoded_offset).unwrap_or(usize::MAX);
                let to = from.saturating_add(usize::try_from(e.file_len).unwrap_or(usize::MAX));
                let bytes = plain.get(from..to).ok_or_else(|| {
                    Error::Invalid("encoded write: file bytes past the decoded extent".into())
                })?;
                self.write_all(ino, offset, bytes)?;
            }
            r => {
                r?;
                self.report.progress.data = self.report.progress.data.saturating_add(e.file_len);
            }
        }
        Ok(())
    }
}
