//! Identities every layer names: an inode is a subvolume tree and a number in it; a key is
//! (objectid, type, offset), ordered in that order (its byte form and names are in
//! crate::format); trees are known by their root objectids.

/// An inode: the subvolume tree it lives in and its number there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Inode {
    pub root: u64,
    pub ino: u64,
}

/// A multiplicative hash of an inode, for spreading files over locks, shards and lanes (use
/// its high bits); only the spreading matters, and consecutive inode numbers spread well.
pub(crate) fn spread(root: u64, ino: u64) -> u64 {
    (ino ^ root.rotate_left(32)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

impl Inode {
    /// Which of `n` shards `self` falls in ([`spread`]'s high bits).
    pub(crate) fn shard(&self, n: usize) -> usize {
        (spread(self.root, self.ino) >> 32) as usize % n
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Key {
    pub objectid: u64,
    pub ty: u8,
    pub offset: u64,
}

impl Key {
    pub(crate) const MIN: Key = Key {
        objectid: 0,
        ty: 0,
        offset: 0,
    };
    pub(crate) const MAX: Key = Key {
        objectid: u64::MAX,
        ty: u8::MAX,
        offset: u64::MAX,
    };

    pub(crate) const fn new(objectid: u64, ty: u8, offset: u64) -> Key {
        Key {
            objectid,
            ty,
            offset,
        }
    }

    #[cfg(any(test, feature = "fuzzing"))]
    /// The smallest key strictly greater than this one.
    pub(crate) fn successor(&self) -> Option<Key> {
        if self.offset < u64::MAX {
            Some(Key {
                offset: self.offset + 1,
                ..*self
            })
        } else if self.ty < u8::MAX {
            Some(Key {
                ty: self.ty + 1,
                offset: 0,
                ..*self
            })
        } else if self.objectid < u64::MAX {
            Some(Key {
                objectid: self.objectid + 1,
                ty: 0,
                offset: 0,
            })
        } else {
            None
        }
    }
}

// Root objectids of the trees (re-exported by crate::format).
pub(crate) const ROOT_TREE_OBJECTID: u64 = 1;
pub(crate) const EXTENT_TREE_OBJECTID: u64 = 2;
pub(crate) const CHUNK_TREE_OBJECTID: u64 = 3;
pub(crate) const DEV_TREE_OBJECTID: u64 = 4;
pub const FS_TREE_OBJECTID: u64 = 5;
pub(crate) const CSUM_TREE_OBJECTID: u64 = 7;
pub(crate) const QUOTA_TREE_OBJECTID: u64 = 8;
pub(crate) const UUID_TREE_OBJECTID: u64 = 9;
pub(crate) const FREE_SPACE_TREE_OBJECTID: u64 = 10;
pub(crate) const BLOCK_GROUP_TREE_OBJECTID: u64 = 11;
pub(crate) const TREE_LOG_OBJECTID: u64 = -6i64 as u64;
pub(crate) const DATA_RELOC_TREE_OBJECTID: u64 = -9i64 as u64;

/// Human name of a tree by its root objectid.
pub(crate) fn tree_name(id: u64) -> String {
    match id {
        ROOT_TREE_OBJECTID => "root".into(),
        EXTENT_TREE_OBJECTID => "extent".into(),
        CHUNK_TREE_OBJECTID => "chunk".into(),
        DEV_TREE_OBJECTID => "dev".into(),
        FS_TREE_OBJECTID => "fs".into(),
        CSUM_TREE_OBJECTID => "csum".into(),
        QUOTA_TREE_OBJECTID => "quota".into(),
        UUID_TREE_OBJECTID => "uuid".into(),
        FREE_SPACE_TREE_OBJECTID => "free-space".into(),
        BLOCK_GROUP_TREE_OBJECTID => "block-group".into(),
        DATA_RELOC_TREE_OBJECTID => "data-reloc".into(),
        TREE_LOG_OBJECTID => "log".into(),
        id => format!("subvol {id}"),
    }
}
