//! The inode layer: files, directories and subvolumes on (subvolume, inode) pairs, worked
//! on a [`core::Core`] of parts (the disk, the roots, the transaction, ordered extents, the
//! gate), not on the facade (crate::fs).
//!
//! - `core`: the parts, and the root lookups every operation starts from;
//! - `read`: reads (inodes, directories, xattrs, file data verified against checksums);
//! - `ordered`: range locks, ordered extents and delayed allocation of the writes in flight;
//! - `flags`: inode flags (chattr) and the properties stored as xattrs;
//! - `file`: file data writes, truncate, fallocate, hole punching;
//! - `namespace`: create, link, unlink, rename, setattr, xattrs;
//! - `seek`, `statfs`, `subvol`: SEEK_DATA/SEEK_HOLE, free space, subvolumes and snapshots;
//! - `encoded`: compressed extents stored as they come (receive's ENCODED_WRITE);
//! - `received`: subvolumes by uuid, and marking a subvolume received;
//! - `subvol_delete`: deleting a subvolume and dropping its tree, resumable across commits;
//! - `orphan`: inodes unlinked while open, deleted at the last close or the next open.

pub mod balance;
pub mod core;
pub(crate) mod encoded;
pub mod file;
pub mod flags;
pub mod namespace;
pub mod ordered;
pub mod orphan;
pub mod read;
pub(crate) mod received;
pub(crate) mod reflink;
pub mod scrub;
pub mod seek;
pub mod statfs;
pub mod subvol;
pub mod subvol_delete;
