//! butter: a userspace read-write implementation of btrfs.
//!
//! Layers from the ground up; each uses only the ones above it in this list (held by
//! tests/layering.rs, which lists the files of each folder in order):
//! - `ids`: inodes, keys and tree ids, the names every layer uses;
//! - `error`: typed errors with the location of damage;
//! - `gate`: the reader/writer gate, inode passages and the abort latch;
//! - `extent_io`: the range-state tree (seed 000);
//! - `format`: the on-disk structures, checksums, name hashes, codecs, feature bits;
//! - `io`: block devices, the chunk map, validated tree-block reads and writes;
//! - `space`: block groups and the allocator, the free space tree, the delayed-ref queue;
//! - `ctree`: B-tree search and iteration, block editing, copy-on-write on a `CowCtx`;
//! - `transaction`: the running transaction, reference running, commit, the fsync log state;
//! - `mkfs`: making a filesystem;
//! - `inode`: files, directories and subvolumes on a `Core` of parts;
//! - `tree_log`: fsync through the log tree, and log replay;
//! - `check`: the checker;
//! - `inspect`: the on-disk structures as text (dump-super, dump-tree);
//! - `fs`: the facade the CLI and the FUSE front end use (`Fs`).

pub mod error;
pub mod format;

pub use error::{Error, Location, Result};
pub mod check;
pub mod ctree;
pub mod extent_io;
pub mod fs;
pub mod gate;
pub mod ids;
pub mod inode;
pub mod inspect;
pub mod io;
pub mod mkfs;
pub mod space;
pub mod transaction;
pub mod tree_log;
