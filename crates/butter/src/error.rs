//! Typed errors for the whole engine.
//!
//! Corruption is reported with a [`Location`] naming what was being read (tree, block, slot,
//! key) so that a damaged image gives a message a person can act on. Errors become errno only at
//! the FUSE edge ([`Error::errno`]) and text only in the CLI.

use crate::ids::Key;
use std::fmt;

/// Where a problem was found. Every field is optional; display prints what is known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Location {
    /// Tree (root objectid) being read, if known.
    pub tree: Option<u64>,
    /// Logical address of the tree block, if any.
    pub bytenr: Option<u64>,
    /// Physical byte offset on the device, if known.
    pub physical: Option<u64>,
    /// Item or pointer slot within the block.
    pub slot: Option<usize>,
    /// Key of the item being decoded.
    pub key: Option<Key>,
    /// Free text: "superblock", "sys_chunk_array", "inode 257 offset 4096", ...
    pub what: Option<String>,
}

impl Location {
    pub fn what(s: impl Into<String>) -> Self {
        Location {
            what: Some(s.into()),
            ..Default::default()
        }
    }
    pub(crate) fn block(tree: Option<u64>, bytenr: u64) -> Self {
        Location {
            tree,
            bytenr: Some(bytenr),
            ..Default::default()
        }
    }
    pub(crate) fn with_slot(mut self, slot: usize) -> Self {
        self.slot = Some(slot);
        self
    }
    pub(crate) fn with_key(mut self, key: Key) -> Self {
        self.key = Some(key);
        self
    }
    pub(crate) fn with_tree(mut self, tree: u64) -> Self {
        self.tree = Some(tree);
        self
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts: Vec<String> = Vec::new();
        if let Some(w) = &self.what {
            parts.push(w.clone());
        }
        if let Some(t) = self.tree {
            parts.push(format!("tree {}", crate::ids::tree_name(t)));
        }
        if let Some(b) = self.bytenr {
            parts.push(format!("block {b}"));
        }
        if let Some(p) = self.physical {
            parts.push(format!("physical {p}"));
        }
        if let Some(s) = self.slot {
            parts.push(format!("slot {s}"));
        }
        if let Some(k) = &self.key {
            parts.push(format!("key {k}"));
        }
        if parts.is_empty() {
            write!(f, "unknown location")
        } else {
            write!(f, "{}", parts.join(" "))
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device failed an operation.
    #[error("I/O error {what} at byte {offset}: {source}")]
    Io {
        what: String,
        offset: u64,
        #[source]
        source: std::io::Error,
    },
    /// Something read from disk or a stream is inconsistent.
    #[error("corrupt {loc}: {reason}")]
    Corrupt { loc: Box<Location>, reason: String },
    /// A tree block's or superblock's checksum does not match (every copy tried).
    #[error("checksum mismatch {loc}: {reason}")]
    BadChecksum { loc: Box<Location>, reason: String },
    /// File data failed its checksum.
    #[error("data checksum mismatch: inode {ino} in tree {root}, file offset {file_offset}, logical {logical}")]
    DataChecksum {
        root: u64,
        ino: u64,
        file_offset: u64,
        logical: u64,
    },
    /// A feature of the image that butter does not handle.
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("not a directory: {0}")]
    NotDir(String),
    #[error("is a directory: {0}")]
    IsDir(String),
    /// A caller's mistake (an argument the operation cannot take: a mode mknod does not
    /// know, rename flags, a directory moved into itself): EINVAL. Damage on disk is
    /// `Corrupt`, a broken engine invariant `Internal`.
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("no data available (xattr): {0}")]
    NoXattr(String),
    #[error("result does not fit in the buffer: {0}")]
    Range(String),
    #[error("read-only filesystem")]
    ReadOnly,
    /// A change inside a read-only subvolume or snapshot (root item flag RDONLY): EROFS, as
    /// the kernel gives.
    #[error("read-only subvolume: {0}")]
    ReadOnlySubvol(String),
    #[error("already exists: {0}")]
    Exists(String),
    #[error("no space left on device: {0}")]
    NoSpace(String),
    #[error("directory not empty: {0}")]
    NotEmpty(String),
    #[error("name too long: {0}")]
    NameTooLong(String),
    #[error("too many links: {0}")]
    TooManyLinks(String),
    #[error("operation not permitted: {0}")]
    NotPermitted(String),
    /// Permission denied (EACCES), as the kernel's VFS answers it.
    #[error("permission denied: {0}")]
    AccessDenied(String),
    /// The filesystem hit an error while writing and turned read-only; the image keeps its
    /// last committed state.
    #[error("transaction aborted, filesystem is read-only until reopened: {0}")]
    Aborted(String),
    /// Appended data held in memory could not be written to the device: reported by the
    /// file's next fsync (EIO).
    #[error("appended data was lost: {0}; what was appended since the file's last fsync is not on the device (write it again)")]
    WriteLost(String),
    /// A hard link or rename between two subvolumes (EXDEV, as the kernel gives).
    #[error("cross-subvolume {0} (EXDEV)")]
    CrossSubvolume(String),
    /// An invariant of the engine itself broke (a bug in butter, not damage on disk): EIO,
    /// and the running transaction is aborted.
    #[error("internal error (a bug in butter): {0}")]
    Internal(String),
    /// No superblock copy that fits on the device has the btrfs magic: the image is not btrfs
    /// (not a damaged btrfs). The text says what it looks like (empty, zeroes, ext4, xfs...).
    #[error("not a btrfs filesystem: {0}")]
    NotBtrfs(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn corrupt(loc: Location, reason: impl Into<String>) -> Self {
        Error::Corrupt {
            loc: Box::new(loc),
            reason: reason.into(),
        }
    }
    pub(crate) fn bad_csum(loc: Location, reason: impl Into<String>) -> Self {
        Error::BadChecksum {
            loc: Box::new(loc),
            reason: reason.into(),
        }
    }
    pub(crate) fn io(what: impl Into<String>, offset: u64, source: std::io::Error) -> Self {
        Error::Io {
            what: what.into(),
            offset,
            source,
        }
    }
    /// Adds tree/block context to a corruption error raised by a lower layer.
    pub(crate) fn in_block(self, tree: Option<u64>, bytenr: u64) -> Self {
        match self {
            Error::Corrupt { mut loc, reason } => {
                if loc.tree.is_none() {
                    loc.tree = tree;
                }
                if loc.bytenr.is_none() {
                    loc.bytenr = Some(bytenr);
                }
                Error::Corrupt { loc, reason }
            }
            e => e,
        }
    }
    /// Maps to the errno the FUSE front end reports.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Io { .. } | Error::WriteLost(_) | Error::Internal(_) => libc_consts::EIO,
            Error::CrossSubvolume(_) => libc_consts::EXDEV,
            Error::Corrupt { .. } => libc_consts::EUCLEAN,
            Error::BadChecksum { .. } | Error::DataChecksum { .. } => libc_consts::EIO,
            Error::Unsupported(_) => libc_consts::EOPNOTSUPP,
            Error::NotFound(_) => libc_consts::ENOENT,
            Error::NotDir(_) => libc_consts::ENOTDIR,
            Error::IsDir(_) => libc_consts::EISDIR,
            Error::Invalid(_) | Error::NotBtrfs(_) => libc_consts::EINVAL,
            Error::NoXattr(_) => libc_consts::ENODATA,
            Error::Range(_) => libc_consts::ERANGE,
            Error::ReadOnly | Error::ReadOnlySubvol(_) | Error::Aborted(_) => libc_consts::EROFS,
            Error::Exists(_) => libc_consts::EEXIST,
            Error::NoSpace(_) => libc_consts::ENOSPC,
            Error::NotEmpty(_) => libc_consts::ENOTEMPTY,
            Error::NameTooLong(_) => libc_consts::ENAMETOOLONG,
            Error::TooManyLinks(_) => libc_consts::EMLINK,
            Error::NotPermitted(_) => libc_consts::EPERM,
            Error::AccessDenied(_) => libc_consts::EACCES,
        }
    }
}

/// Linux errno values (the engine does not depend on libc).
pub mod libc_consts {
    pub(crate) const EPERM: i32 = 1;
    pub(crate) const EACCES: i32 = 13;
    pub(crate) const ENOENT: i32 = 2;
    pub(crate) const EEXIST: i32 = 17;
    pub(crate) const ENOSPC: i32 = 28;
    pub(crate) const EXDEV: i32 = 18;
    pub(crate) const EMLINK: i32 = 31;
    pub(crate) const ENAMETOOLONG: i32 = 36;
    pub(crate) const ENOTEMPTY: i32 = 39;
    pub(crate) const EIO: i32 = 5;
    pub(crate) const ENOTDIR: i32 = 20;
    pub(crate) const EISDIR: i32 = 21;
    pub(crate) const EINVAL: i32 = 22;
    pub(crate) const EROFS: i32 = 30;
    pub(crate) const ERANGE: i32 = 34;
    pub(crate) const ENODATA: i32 = 61;
    pub(crate) const EOPNOTSUPP: i32 = 95;
    pub(crate) const EUCLEAN: i32 = 117;
}
impl Error {
    /// Whether a change that failed with this error may have left half of itself in the
    /// running transaction, so that nothing more may be changed or committed.
    pub fn stops_changes(&self) -> bool {
        matches!(
            self,
            Error::Io { .. }
                | Error::Corrupt { .. }
                | Error::BadChecksum { .. }
                | Error::Internal(_)
        )
    }
}
