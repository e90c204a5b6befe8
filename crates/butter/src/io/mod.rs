//! Getting bytes to and from the device: `device` (block devices: image files, RAM with fault
//! injection), `super_io` (the one superblock writer), `volumes` (the chunk map from logical addresses to device copies), `disk_io`
//! (validated tree-block reads, the block cache, readahead, logical writes).

pub mod device;
pub mod disk_io;
pub(crate) mod super_io;
pub mod volumes;
