//! The 17-byte btrfs key: (objectid u64, type u8, offset u64), ordered in that order.

use super::consts::*;
use std::fmt;

pub use crate::ids::Key;

impl Key {
    /// Decodes a disk key from exactly 17 bytes (caller checked the length).
    pub(crate) fn from_bytes(b: &[u8]) -> Key {
        Key {
            objectid: super::le_u64(b, 0),
            ty: b[8],
            offset: super::le_u64(b, 9),
        }
    }

    pub(crate) fn to_bytes(self) -> [u8; DISK_KEY_SIZE] {
        let mut out = [0u8; DISK_KEY_SIZE];
        out[0..8].copy_from_slice(&self.objectid.to_le_bytes());
        out[8] = self.ty;
        out[9..17].copy_from_slice(&self.offset.to_le_bytes());
        out
    }
}

/// Name of an item type as `btrfs inspect-internal dump-tree` prints it.
pub(crate) fn key_type_name(ty: u8) -> String {
    let s = match ty {
        INODE_ITEM_KEY => "INODE_ITEM",
        INODE_REF_KEY => "INODE_REF",
        INODE_EXTREF_KEY => "INODE_EXTREF",
        XATTR_ITEM_KEY => "XATTR_ITEM",
        VERITY_DESC_ITEM_KEY => "VERITY_DESC_ITEM",
        VERITY_MERKLE_ITEM_KEY => "VERITY_MERKLE_ITEM",
        ORPHAN_ITEM_KEY => "ORPHAN_ITEM",
        DIR_LOG_ITEM_KEY => "DIR_LOG_ITEM",
        DIR_LOG_INDEX_KEY => "DIR_LOG_INDEX",
        DIR_ITEM_KEY => "DIR_ITEM",
        DIR_INDEX_KEY => "DIR_INDEX",
        EXTENT_DATA_KEY => "EXTENT_DATA",
        EXTENT_CSUM_KEY => "EXTENT_CSUM",
        ROOT_ITEM_KEY => "ROOT_ITEM",
        ROOT_BACKREF_KEY => "ROOT_BACKREF",
        ROOT_REF_KEY => "ROOT_REF",
        EXTENT_ITEM_KEY => "EXTENT_ITEM",
        METADATA_ITEM_KEY => "METADATA_ITEM",
        EXTENT_OWNER_REF_KEY => "EXTENT_OWNER_REF",
        TREE_BLOCK_REF_KEY => "TREE_BLOCK_REF",
        EXTENT_DATA_REF_KEY => "EXTENT_DATA_REF",
        SHARED_BLOCK_REF_KEY => "SHARED_BLOCK_REF",
        SHARED_DATA_REF_KEY => "SHARED_DATA_REF",
        BLOCK_GROUP_ITEM_KEY => "BLOCK_GROUP_ITEM",
        FREE_SPACE_INFO_KEY => "FREE_SPACE_INFO",
        FREE_SPACE_EXTENT_KEY => "FREE_SPACE_EXTENT",
        FREE_SPACE_BITMAP_KEY => "FREE_SPACE_BITMAP",
        DEV_EXTENT_KEY => "DEV_EXTENT",
        DEV_ITEM_KEY => "DEV_ITEM",
        CHUNK_ITEM_KEY => "CHUNK_ITEM",
        RAID_STRIPE_KEY => "RAID_STRIPE",
        QGROUP_STATUS_KEY => "QGROUP_STATUS",
        QGROUP_INFO_KEY => "QGROUP_INFO",
        QGROUP_LIMIT_KEY => "QGROUP_LIMIT",
        QGROUP_RELATION_KEY => "QGROUP_RELATION",
        TEMPORARY_ITEM_KEY => "TEMPORARY_ITEM",
        PERSISTENT_ITEM_KEY => "PERSISTENT_ITEM",
        DEV_REPLACE_KEY => "DEV_REPLACE",
        UUID_KEY_SUBVOL => "UUID_KEY_SUBVOL",
        UUID_KEY_RECEIVED_SUBVOL => "UUID_KEY_RECEIVED_SUBVOL",
        STRING_ITEM_KEY => "STRING_ITEM",
        _ => return format!("UNKNOWN.{ty}"),
    };
    s.to_string()
}

/// Objectid as dump-tree prints it (special ids by name, others as numbers).
pub(crate) fn objectid_name(id: u64) -> String {
    super::print::objectid_str(id, 0)
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "({} {} {})",
            objectid_name(self.objectid),
            key_type_name(self.ty),
            self.offset
        )
    }
}
