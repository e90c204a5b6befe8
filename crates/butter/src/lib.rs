//! butter: a userspace read-write implementation of btrfs.
//!
//! Layers, each using only the ones listed before it:
//! `format` (pure on-disk structures) -> `device` -> `volumes` (chunk mapping) ->
//! `disk_io` (validated tree-block reads, cache, readahead) -> `ctree` (B-tree search and
//! iteration) -> `fs` (the filesystem facade used by the CLI and the FUSE front end).

pub mod error;
pub mod format;

pub use error::{Error, Location, Result};
pub mod alloc;
pub mod check;
pub mod cow;
pub mod ctree;
pub mod ctree_ops;
mod cow_ctx;
mod delayed_refs;
pub mod device;
pub mod disk_io;
pub mod extent_io;
mod extent_record;
pub mod extent_tree;
pub mod file_write;
pub mod free_space_tree;
pub mod fs;
pub mod fs_seek;
pub mod fs_stat;
pub mod fs_write;
pub mod gate;
pub mod ids;
pub mod inode_flags;
pub mod log_state;
pub mod log_write;
pub mod mkfs;
pub mod ordered;
pub mod subvol;
pub mod transaction;
pub mod tree_log;
pub mod volumes;
