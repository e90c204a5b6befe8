//! Numeric constants of the btrfs on-disk format (objectids, item types, flags).
//! Values are facts from the format documentation (btrfs_tree.h / On-disk-format.rst).

pub(crate) use crate::ids::BLOCK_GROUP_TREE_OBJECTID;
pub(crate) use crate::ids::CHUNK_TREE_OBJECTID;
pub(crate) use crate::ids::CSUM_TREE_OBJECTID;
pub(crate) use crate::ids::DATA_RELOC_TREE_OBJECTID;
pub(crate) use crate::ids::DEV_TREE_OBJECTID;
pub(crate) use crate::ids::EXTENT_TREE_OBJECTID;
pub(crate) use crate::ids::FREE_SPACE_TREE_OBJECTID;
pub use crate::ids::FS_TREE_OBJECTID;
pub(crate) use crate::ids::QUOTA_TREE_OBJECTID;
pub(crate) use crate::ids::ROOT_TREE_OBJECTID;
pub(crate) use crate::ids::TREE_LOG_OBJECTID;
pub(crate) use crate::ids::UUID_TREE_OBJECTID;

// ---- tree and special objectids ----
pub(crate) const ROOT_TREE_DIR_OBJECTID: u64 = 6;
pub(crate) const RAID_STRIPE_TREE_OBJECTID: u64 = 12;
pub(crate) const DEV_STATS_OBJECTID: u64 = 0;
pub(crate) const BALANCE_OBJECTID: u64 = -4i64 as u64;
pub(crate) const ORPHAN_OBJECTID: u64 = -5i64 as u64;
pub(crate) const TREE_LOG_FIXUP_OBJECTID: u64 = -7i64 as u64;
pub(crate) const TREE_RELOC_OBJECTID: u64 = -8i64 as u64;
pub(crate) const EXTENT_CSUM_OBJECTID: u64 = -10i64 as u64;
pub(crate) const FREE_SPACE_OBJECTID: u64 = -11i64 as u64;
pub(crate) const FREE_INO_OBJECTID: u64 = -12i64 as u64;
pub(crate) const MULTIPLE_OBJECTIDS: u64 = -255i64 as u64;
pub const FIRST_FREE_OBJECTID: u64 = 256;
pub(crate) const LAST_FREE_OBJECTID: u64 = -256i64 as u64;
pub(crate) const FIRST_CHUNK_TREE_OBJECTID: u64 = 256;
pub(crate) const DEV_ITEMS_OBJECTID: u64 = 1;

// ---- item types ----
pub(crate) const INODE_ITEM_KEY: u8 = 1;
pub(crate) const INODE_REF_KEY: u8 = 12;
pub(crate) const INODE_EXTREF_KEY: u8 = 13;
pub(crate) const XATTR_ITEM_KEY: u8 = 24;
pub(crate) const VERITY_DESC_ITEM_KEY: u8 = 36;
pub(crate) const VERITY_MERKLE_ITEM_KEY: u8 = 37;
pub(crate) const ORPHAN_ITEM_KEY: u8 = 48;
pub(crate) const DIR_LOG_ITEM_KEY: u8 = 60;
pub(crate) const DIR_LOG_INDEX_KEY: u8 = 72;
pub(crate) const DIR_ITEM_KEY: u8 = 84;
pub(crate) const DIR_INDEX_KEY: u8 = 96;
pub(crate) const EXTENT_DATA_KEY: u8 = 108;
pub(crate) const EXTENT_CSUM_KEY: u8 = 128;
pub(crate) const ROOT_ITEM_KEY: u8 = 132;
pub(crate) const ROOT_BACKREF_KEY: u8 = 144;
pub(crate) const ROOT_REF_KEY: u8 = 156;
pub(crate) const EXTENT_ITEM_KEY: u8 = 168;
pub(crate) const METADATA_ITEM_KEY: u8 = 169;
pub(crate) const EXTENT_OWNER_REF_KEY: u8 = 172;
pub(crate) const TREE_BLOCK_REF_KEY: u8 = 176;
pub(crate) const EXTENT_DATA_REF_KEY: u8 = 178;
pub(crate) const SHARED_BLOCK_REF_KEY: u8 = 182;
pub(crate) const SHARED_DATA_REF_KEY: u8 = 184;
pub(crate) const BLOCK_GROUP_ITEM_KEY: u8 = 192;
pub(crate) const FREE_SPACE_INFO_KEY: u8 = 198;
pub(crate) const FREE_SPACE_EXTENT_KEY: u8 = 199;
pub(crate) const FREE_SPACE_BITMAP_KEY: u8 = 200;
pub(crate) const DEV_EXTENT_KEY: u8 = 204;
pub(crate) const DEV_ITEM_KEY: u8 = 216;
pub(crate) const CHUNK_ITEM_KEY: u8 = 228;
pub(crate) const RAID_STRIPE_KEY: u8 = 230;
pub(crate) const QGROUP_STATUS_KEY: u8 = 240;
pub(crate) const QGROUP_INFO_KEY: u8 = 242;
pub(crate) const QGROUP_LIMIT_KEY: u8 = 244;
pub(crate) const QGROUP_RELATION_KEY: u8 = 246;

/// QGROUP_STATUS flags.
pub(crate) const QGROUP_STATUS_FLAG_ON: u64 = 1 << 0;
pub(crate) const QGROUP_STATUS_FLAG_INCONSISTENT: u64 = 1 << 2;
pub(crate) const TEMPORARY_ITEM_KEY: u8 = 248;
pub(crate) const PERSISTENT_ITEM_KEY: u8 = 249;
pub(crate) const DEV_REPLACE_KEY: u8 = 250;
pub(crate) const UUID_KEY_SUBVOL: u8 = 251;
pub(crate) const UUID_KEY_RECEIVED_SUBVOL: u8 = 252;
pub(crate) const STRING_ITEM_KEY: u8 = 253;

// ---- block group / chunk type flags ----
pub(crate) const BLOCK_GROUP_DATA: u64 = 1 << 0;
pub(crate) const BLOCK_GROUP_SYSTEM: u64 = 1 << 1;
pub(crate) const BLOCK_GROUP_METADATA: u64 = 1 << 2;
pub(crate) const BLOCK_GROUP_RAID0: u64 = 1 << 3;
pub(crate) const BLOCK_GROUP_RAID1: u64 = 1 << 4;
pub(crate) const BLOCK_GROUP_DUP: u64 = 1 << 5;
pub(crate) const BLOCK_GROUP_RAID10: u64 = 1 << 6;
pub(crate) const BLOCK_GROUP_RAID5: u64 = 1 << 7;
pub(crate) const BLOCK_GROUP_RAID6: u64 = 1 << 8;
pub(crate) const BLOCK_GROUP_RAID1C3: u64 = 1 << 9;
pub(crate) const BLOCK_GROUP_RAID1C4: u64 = 1 << 10;
pub(crate) const BLOCK_GROUP_PROFILE_MASK: u64 = BLOCK_GROUP_RAID0
    | BLOCK_GROUP_RAID1
    | BLOCK_GROUP_DUP
    | BLOCK_GROUP_RAID10
    | BLOCK_GROUP_RAID5
    | BLOCK_GROUP_RAID6
    | BLOCK_GROUP_RAID1C3
    | BLOCK_GROUP_RAID1C4;

// ---- superblock feature flags ----
pub(crate) const INCOMPAT_MIXED_BACKREF: u64 = 1 << 0;
pub(crate) const INCOMPAT_DEFAULT_SUBVOL: u64 = 1 << 1;
pub(crate) const INCOMPAT_MIXED_GROUPS: u64 = 1 << 2;
pub(crate) const INCOMPAT_COMPRESS_LZO: u64 = 1 << 3;
pub(crate) const INCOMPAT_COMPRESS_ZSTD: u64 = 1 << 4;
pub(crate) const INCOMPAT_BIG_METADATA: u64 = 1 << 5;
pub(crate) const INCOMPAT_EXTENDED_IREF: u64 = 1 << 6;
pub(crate) const INCOMPAT_RAID56: u64 = 1 << 7;
pub(crate) const INCOMPAT_SKINNY_METADATA: u64 = 1 << 8;
pub(crate) const INCOMPAT_NO_HOLES: u64 = 1 << 9;
pub(crate) const INCOMPAT_METADATA_UUID: u64 = 1 << 10;
pub(crate) const INCOMPAT_RAID1C34: u64 = 1 << 11;
pub(crate) const INCOMPAT_ZONED: u64 = 1 << 12;
pub(crate) const INCOMPAT_EXTENT_TREE_V2: u64 = 1 << 13;
pub(crate) const INCOMPAT_RAID_STRIPE_TREE: u64 = 1 << 14;
pub(crate) const INCOMPAT_SIMPLE_QUOTA: u64 = 1 << 16;
pub(crate) const COMPAT_RO_FREE_SPACE_TREE: u64 = 1 << 0;
pub(crate) const COMPAT_RO_FREE_SPACE_TREE_VALID: u64 = 1 << 1;
pub(crate) const COMPAT_RO_VERITY: u64 = 1 << 2;
pub(crate) const COMPAT_RO_BLOCK_GROUP_TREE: u64 = 1 << 3;

// ---- superblock flags (beside the header flags WRITTEN and RELOC) ----
pub(crate) const SUPER_FLAG_SEEDING: u64 = 1 << 32;
pub(crate) const SUPER_FLAG_METADUMP: u64 = 1 << 33;
pub(crate) const SUPER_FLAG_METADUMP_V2: u64 = 1 << 34;
pub(crate) const SUPER_FLAG_CHANGING_FSID: u64 = 1 << 35;
pub(crate) const SUPER_FLAG_CHANGING_FSID_V2: u64 = 1 << 36;
pub(crate) const SUPER_FLAG_CHANGING_BG_TREE: u64 = 1 << 38;
/// Either of the two checksum conversion flags (data 39, metadata 40).
pub(crate) const SUPER_FLAG_CHANGING_CSUM: u64 = (1 << 39) | (1 << 40);

// (Which feature bits butter reads and writes: crate::format::features.)

// ---- extent item flags ----
pub(crate) const EXTENT_FLAG_DATA: u64 = 1 << 0;
pub(crate) const EXTENT_FLAG_TREE_BLOCK: u64 = 1 << 1;
pub(crate) const BLOCK_FLAG_FULL_BACKREF: u64 = 1 << 8;

// ---- header flags ----
pub(crate) const HEADER_FLAG_WRITTEN: u64 = 1 << 0;
pub(crate) const HEADER_FLAG_RELOC: u64 = 1 << 1;
pub(crate) const MIXED_BACKREF_REV: u64 = 1;

// ---- file extent types and compression ----
pub(crate) const FILE_EXTENT_INLINE: u8 = 0;
pub(crate) const FILE_EXTENT_REG: u8 = 1;
pub(crate) const FILE_EXTENT_PREALLOC: u8 = 2;
pub(crate) const COMPRESS_NONE: u8 = 0;
pub(crate) const COMPRESS_ZLIB: u8 = 1;
pub(crate) const COMPRESS_LZO: u8 = 2;
pub(crate) const COMPRESS_ZSTD: u8 = 3;

// ---- directory entry file types (FT_*) ----
pub(crate) const FT_UNKNOWN: u8 = 0;
pub(crate) const FT_REG_FILE: u8 = 1;
pub(crate) const FT_DIR: u8 = 2;
pub(crate) const FT_CHRDEV: u8 = 3;
pub(crate) const FT_BLKDEV: u8 = 4;
pub(crate) const FT_FIFO: u8 = 5;
pub(crate) const FT_SOCK: u8 = 6;
pub(crate) const FT_SYMLINK: u8 = 7;
pub(crate) const FT_XATTR: u8 = 8;

// ---- root item flags ----
pub const ROOT_SUBVOL_RDONLY: u64 = 1 << 0;

// ---- inode flags ----
pub(crate) const INODE_NODATASUM: u64 = 1 << 0;
pub(crate) const INODE_NODATACOW: u64 = 1 << 1;
pub(crate) const INODE_NOCOMPRESS: u64 = 1 << 3;
pub(crate) const INODE_PREALLOC: u64 = 1 << 4;
pub(crate) const INODE_SYNC: u64 = 1 << 5;
pub(crate) const INODE_IMMUTABLE: u64 = 1 << 6;
pub(crate) const INODE_APPEND: u64 = 1 << 7;
pub(crate) const INODE_NODUMP: u64 = 1 << 8;
pub(crate) const INODE_NOATIME: u64 = 1 << 9;
pub(crate) const INODE_DIRSYNC: u64 = 1 << 10;
pub(crate) const INODE_COMPRESS: u64 = 1 << 11;
/// In the inode embedded in a ROOT_ITEM: the item is of the current format (the kernel
/// clears the root flags of an item without it, read-only included).
pub(crate) const INODE_ROOT_ITEM_INIT: u64 = 1 << 31;

// ---- free space info flags ----
pub(crate) const FREE_SPACE_USING_BITMAPS: u32 = 1 << 0;

// ---- sizes ----
pub(crate) const SUPER_INFO_OFFSET: u64 = 65536;
pub(crate) const SUPER_INFO_SIZE: usize = 4096;
pub(crate) const SUPER_MIRROR_MAX: usize = 3;
pub(crate) const SUPER_MIRROR_SHIFT: u32 = 12;
pub(crate) const MAGIC: u64 = 0x4D5F_5366_5248_425F; // "_BHRfS_M"
/// The magic of a filesystem still being made ("!BHRfS_M", as mkfs.btrfs writes it while it
/// fills an image): no reader takes it for a filesystem.
pub(crate) const MAGIC_TEMPORARY: u64 = 0x4D5F_5366_5248_4221;
pub(crate) const CSUM_SIZE: usize = 32;
pub(crate) const LABEL_SIZE: usize = 256;
pub(crate) const SYSTEM_CHUNK_ARRAY_SIZE: usize = 2048;
pub(crate) const NUM_BACKUP_ROOTS: usize = 4;
pub(crate) const HEADER_SIZE: usize = 101;
pub(crate) const ITEM_SIZE: usize = 25;
pub(crate) const KEY_PTR_SIZE: usize = 33;
pub(crate) const DISK_KEY_SIZE: usize = 17;
pub(crate) const MAX_LEVEL: u8 = 8;
pub(crate) const NAME_LEN: usize = 255;
pub(crate) const STRIPE_LEN: u64 = 65536;

/// Byte offset of superblock copy `mirror` (0, 1, 2): 64 KiB, 64 MiB, 256 GiB.
pub(crate) fn super_offset(mirror: usize) -> u64 {
    if mirror == 0 {
        SUPER_INFO_OFFSET
    } else {
        (16 * 1024) << (SUPER_MIRROR_SHIFT * mirror as u32)
    }
}
