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
//! - `fs`: the facade the CLI and the FUSE front end use (`Fs`);
//! - `receive`: send streams applied to an image;
//! - `send`: read-only snapshots as send streams, in full or incremental;
//! - `internals`: for tests, benchmarks and fuzzing only (the `internals` feature): the RAM
//!   device with fault injection, tools that damage an image on purpose.

pub mod error;
pub mod format;

pub use error::Error;
pub use error::Location;
pub use error::Result;
pub mod check;
pub mod ctree;
pub mod extent_io;
pub mod fs;
pub mod gate;
pub mod ids;
pub mod inode;
pub mod inspect;
#[cfg(any(test, feature = "internals"))]
pub mod internals;
pub mod io;
pub mod mkfs;
pub mod receive;
pub mod send;
pub mod space;
pub mod transaction;
pub mod tree_log;

// The white-box suites in `tests/` (and the fuzz bodies they share with `fuzz/`) name the
// crate `butter`, as code outside it does; inside the crate that path also reaches
// `pub(crate)` items.
#[cfg(any(test, feature = "fuzzing"))]
extern crate self as butter;

/// The bodies of the libFuzzer targets in `fuzz/` (`cargo +nightly fuzz run tree_block`,
/// `open_image`, `receive_stream`), for the fuzz crate only: built with the `fuzzing` feature. The input formats
/// are described in `src/tests/corrupt_support/fuzz_logic.rs`; the test suite replays the same
/// bodies over the committed corpus (`src/tests/fuzz_regress.rs`).
#[cfg(feature = "fuzzing")]
pub mod fuzz {
    /// One `tree_block` run: the bytes as a tree block (checked, then read through every
    /// accessor and item decoder), a superblock and a sys_chunk_array. Panics only if the
    /// engine does.
    pub fn tree_block_one(data: &[u8]) {
        crate::tests::corrupt_support::fuzz_logic::tree_block_one(data);
    }

    /// One `open_image` run: the bytes as a sparse image, opened on a RAM device and walked in
    /// full with bounded reads. Panics only if the engine does.
    pub fn open_image_one(data: &[u8]) {
        crate::tests::corrupt_support::fuzz_logic::open_image_one(data);
    }

    /// One `receive_stream` run: the bytes as a send stream, dumped, then received into a
    /// fresh image on a RAM device, which must check clean afterwards. Panics only if the
    /// engine does or the image is left damaged.
    pub fn receive_stream_one(data: &[u8]) {
        crate::tests::corrupt_support::fuzz_logic::receive_stream_one(data);
    }
}

// The engine's white-box test suites (see `tests/mod.rs`); outside `cfg(test)` only the fuzz
// bodies are built, under the `fuzzing` feature.
#[cfg(any(test, feature = "fuzzing"))]
mod tests;
