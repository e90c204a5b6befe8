//! butter: a userspace read-write implementation of btrfs.
//!
//! Layers, each using only the ones listed before it:
//! `format` (pure on-disk structures) -> `device` -> `volumes` (chunk mapping) ->
//! `disk_io` (validated tree-block reads, cache, readahead) -> `ctree` (B-tree search and
//! iteration) -> `fs` (the filesystem facade used by the CLI and the FUSE front end).

pub mod error;
pub mod format;

pub use error::{Error, Location, Result};
pub mod check;
pub mod cow;
mod cow_ctx;
pub mod ctree;
pub mod ctree_ops;
mod delayed_refs;
pub mod extent_io;
mod extent_record;
pub mod extent_tree;
pub mod fs;
pub mod gate;
pub mod ids;
pub mod inode;
pub mod io;
pub mod log_state;
pub mod mkfs;
pub mod space;
pub mod transaction;
pub mod tree_log;
