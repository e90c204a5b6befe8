//! Free space and the references that free it: `alloc` (block groups, the allocator, pinned
//! and held space, chunk allocation), `free_space_tree` (the on-disk free space tree, kept in
//! step at every commit) and `delayed_refs` (the queue of reference changes a transaction
//! runs into the extent tree, data only).

pub mod alloc;
pub mod delayed_refs;
pub mod free_space_tree;
