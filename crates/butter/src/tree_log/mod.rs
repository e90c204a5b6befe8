//! The fsync log tree: `write` copies fsynced inodes into per-subvolume log trees and
//! commits them without a transaction commit (seed 003); `replay` applies a log left by a
//! power cut at the next read-write open (and reads one for the checker).

pub mod replay;
pub mod write;
