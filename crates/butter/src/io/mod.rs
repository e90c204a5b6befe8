//! Getting bytes to and from the device: `device` (block devices: image files), `nbd` (a
//! device on another machine, through the Network Block Device protocol), `ram` (a
//! device in memory with fault injection, for tests: `internals` feature), `super_io` (the one
//! superblock writer), `volumes` (the chunk map from logical addresses to device copies),
//! `disk_io` (validated tree-block reads, the block cache, readahead, logical writes).

pub mod device;
pub mod disk_io;
pub mod nbd;
pub(crate) mod raid56;
#[cfg(any(test, feature = "internals"))]
pub(crate) mod ram;
pub(crate) mod super_io;
pub mod volumes;
