//! Free space: `alloc` (block groups, the allocator, pinned and held space, chunk allocation)
//! and `free_space_tree` (the on-disk free space tree, kept in step at every commit).

pub mod alloc;
pub mod free_space_tree;
