//! Identities every layer names: an inode is a subvolume tree and a number in it.

/// An inode: the subvolume tree it lives in and its number there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Inode {
    pub root: u64,
    pub ino: u64,
}
