//! Typed decoders for item bodies. Each `parse` checks the body length first and returns a
//! `Corrupt` error (the caller adds tree/block/slot/key) when the body is short or inconsistent.

use super::*;
use crate::error::{Error, Location, Result};

fn short(what: &str, have: usize, need: usize) -> Error {
    Error::corrupt(
        Location::what(what),
        format!("item body {have} bytes, need {need}"),
    )
}

fn need(b: &[u8], n: usize, what: &str) -> Result<()> {
    if b.len() < n {
        Err(short(what, b.len(), n))
    } else {
        Ok(())
    }
}

/// Seconds and nanoseconds (12 bytes on disk).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timespec {
    pub sec: i64,
    pub nsec: u32,
}

impl Timespec {
    pub fn parse(b: &[u8]) -> Timespec {
        Timespec {
            sec: le_u64(b, 0) as i64,
            nsec: le_u32(b, 8),
        }
    }
}

/// INODE_ITEM (160 bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InodeItem {
    pub generation: u64,
    pub transid: u64,
    pub size: u64,
    pub nbytes: u64,
    pub block_group: u64,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    pub rdev: u64,
    pub flags: u64,
    pub sequence: u64,
    pub atime: Timespec,
    pub ctime: Timespec,
    pub mtime: Timespec,
    pub otime: Timespec,
}

impl InodeItem {
    pub const SIZE: usize = 160;
    pub fn parse(b: &[u8]) -> Result<InodeItem> {
        need(b, Self::SIZE, "inode item")?;
        Ok(InodeItem {
            generation: le_u64(b, 0),
            transid: le_u64(b, 8),
            size: le_u64(b, 16),
            nbytes: le_u64(b, 24),
            block_group: le_u64(b, 32),
            nlink: le_u32(b, 40),
            uid: le_u32(b, 44),
            gid: le_u32(b, 48),
            mode: le_u32(b, 52),
            rdev: le_u64(b, 56),
            flags: le_u64(b, 64),
            sequence: le_u64(b, 72),
            atime: Timespec::parse(&b[112..]),
            ctime: Timespec::parse(&b[124..]),
            mtime: Timespec::parse(&b[136..]),
            otime: Timespec::parse(&b[148..]),
        })
    }
}

/// One entry of a DIR_ITEM / DIR_INDEX / XATTR_ITEM body (an item may pack several, for hash
/// collisions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DirItem {
    pub location: Key,
    pub transid: u64,
    pub file_type: u8,
    pub name: Vec<u8>,
    /// xattr value (empty for directory entries).
    pub data: Vec<u8>,
}

impl DirItem {
    pub const HEADER: usize = 30;
    /// Decodes every entry packed in one item body. `max_data` bounds xattr values.
    pub fn parse_all(b: &[u8]) -> Result<Vec<DirItem>> {
        let mut out = Vec::new();
        let mut off = 0usize;
        while off < b.len() {
            let rest = &b[off..];
            need(rest, Self::HEADER, "dir item")?;
            let data_len = le_u16(rest, 25) as usize;
            let name_len = le_u16(rest, 27) as usize;
            if name_len == 0 {
                return Err(Error::corrupt(Location::what("dir item"), "empty name"));
            }
            let total = Self::HEADER + name_len + data_len;
            if rest.len() < total {
                return Err(Error::corrupt(
                    Location::what("dir item"),
                    format!(
                        "entry at byte {off} needs {total} bytes (name {name_len}, data {data_len}) but {} remain",
                        rest.len()
                    ),
                ));
            }
            out.push(DirItem {
                location: Key::from_bytes(&rest[0..17]),
                transid: le_u64(rest, 17),
                file_type: rest[29],
                name: rest[30..30 + name_len].to_vec(),
                data: rest[30 + name_len..total].to_vec(),
            });
            off += total;
        }
        Ok(out)
    }
}

/// One name in an INODE_REF body (the key's offset is the parent directory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeRef {
    pub index: u64,
    pub name: Vec<u8>,
}

impl InodeRef {
    pub fn parse_all(b: &[u8]) -> Result<Vec<InodeRef>> {
        let mut out = Vec::new();
        let mut off = 0;
        while off < b.len() {
            let rest = &b[off..];
            need(rest, 10, "inode ref")?;
            let len = le_u16(rest, 8) as usize;
            need(rest, 10 + len, "inode ref name")?;
            out.push(InodeRef {
                index: le_u64(rest, 0),
                name: rest[10..10 + len].to_vec(),
            });
            off += 10 + len;
        }
        Ok(out)
    }
}

/// One name in an INODE_EXTREF body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeExtref {
    pub parent: u64,
    pub index: u64,
    pub name: Vec<u8>,
}

impl InodeExtref {
    pub fn parse_all(b: &[u8]) -> Result<Vec<InodeExtref>> {
        let mut out = Vec::new();
        let mut off = 0;
        while off < b.len() {
            let rest = &b[off..];
            need(rest, 18, "inode extref")?;
            let len = le_u16(rest, 16) as usize;
            need(rest, 18 + len, "inode extref name")?;
            out.push(InodeExtref {
                parent: le_u64(rest, 0),
                index: le_u64(rest, 8),
                name: rest[18..18 + len].to_vec(),
            });
            off += 18 + len;
        }
        Ok(out)
    }
}

/// EXTENT_DATA body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileExtentItem {
    pub generation: u64,
    pub ram_bytes: u64,
    pub compression: u8,
    pub encryption: u8,
    pub other_encoding: u16,
    pub ty: u8,
    pub body: FileExtentBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FileExtentBody {
    /// Data stored in the item; possibly compressed (then ram_bytes is the decoded length).
    Inline(Vec<u8>),
    /// REG or PREALLOC: a reference into a data extent. `disk_bytenr == 0` is a hole.
    Extent {
        disk_bytenr: u64,
        disk_num_bytes: u64,
        offset: u64,
        num_bytes: u64,
    },
}

impl FileExtentItem {
    pub const INLINE_HEADER: usize = 21;
    pub const SIZE: usize = 53;
    pub fn parse(b: &[u8]) -> Result<FileExtentItem> {
        need(b, Self::INLINE_HEADER, "file extent")?;
        let ty = b[20];
        let body = match ty {
            FILE_EXTENT_INLINE => FileExtentBody::Inline(b[21..].to_vec()),
            FILE_EXTENT_REG | FILE_EXTENT_PREALLOC => {
                need(b, Self::SIZE, "file extent")?;
                FileExtentBody::Extent {
                    disk_bytenr: le_u64(b, 21),
                    disk_num_bytes: le_u64(b, 29),
                    offset: le_u64(b, 37),
                    num_bytes: le_u64(b, 45),
                }
            }
            t => {
                return Err(Error::corrupt(
                    Location::what("file extent"),
                    format!("unknown type {t}"),
                ))
            }
        };
        Ok(FileExtentItem {
            generation: le_u64(b, 0),
            ram_bytes: le_u64(b, 8),
            compression: b[16],
            encryption: b[17],
            other_encoding: le_u16(b, 18),
            ty,
            body,
        })
    }
}

/// ROOT_ITEM body (439 bytes; old images may have the 239-byte form without v2 fields).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RootItem {
    pub inode: InodeItem,
    pub generation: u64,
    pub root_dirid: u64,
    pub bytenr: u64,
    pub byte_limit: u64,
    pub bytes_used: u64,
    pub last_snapshot: u64,
    pub flags: u64,
    pub refs: u32,
    pub drop_progress: Key,
    pub drop_level: u8,
    pub level: u8,
    pub generation_v2: u64,
    pub uuid: [u8; 16],
    pub parent_uuid: [u8; 16],
    pub received_uuid: [u8; 16],
    pub ctransid: u64,
    pub otransid: u64,
    pub stransid: u64,
    pub rtransid: u64,
    pub ctime: Timespec,
    pub otime: Timespec,
    pub stime: Timespec,
    pub rtime: Timespec,
}

impl RootItem {
    pub const SIZE: usize = 439;
    pub const LEGACY_SIZE: usize = 239;
    pub fn parse(b: &[u8]) -> Result<RootItem> {
        need(b, Self::LEGACY_SIZE, "root item")?;
        let mut r = RootItem {
            inode: InodeItem::parse(&b[0..160])?,
            generation: le_u64(b, 160),
            root_dirid: le_u64(b, 168),
            bytenr: le_u64(b, 176),
            byte_limit: le_u64(b, 184),
            bytes_used: le_u64(b, 192),
            last_snapshot: le_u64(b, 200),
            flags: le_u64(b, 208),
            refs: le_u32(b, 216),
            drop_progress: Key::from_bytes(&b[220..237]),
            drop_level: b[237],
            level: b[238],
            ..Default::default()
        };
        if b.len() >= Self::SIZE {
            r.generation_v2 = le_u64(b, 239);
            r.uuid = uuid_at(b, 247);
            r.parent_uuid = uuid_at(b, 263);
            r.received_uuid = uuid_at(b, 279);
            r.ctransid = le_u64(b, 295);
            r.otransid = le_u64(b, 303);
            r.stransid = le_u64(b, 311);
            r.rtransid = le_u64(b, 319);
            r.ctime = Timespec::parse(&b[327..]);
            r.otime = Timespec::parse(&b[339..]);
            r.stime = Timespec::parse(&b[351..]);
            r.rtime = Timespec::parse(&b[363..]);
        }
        if r.level >= MAX_LEVEL {
            return Err(Error::corrupt(
                Location::what("root item"),
                format!("level {} >= {MAX_LEVEL}", r.level),
            ));
        }
        Ok(r)
    }
}

/// ROOT_REF / ROOT_BACKREF body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootRef {
    pub dirid: u64,
    pub sequence: u64,
    pub name: Vec<u8>,
}

impl RootRef {
    pub fn parse(b: &[u8]) -> Result<RootRef> {
        need(b, 18, "root ref")?;
        let len = le_u16(b, 16) as usize;
        need(b, 18 + len, "root ref name")?;
        Ok(RootRef {
            dirid: le_u64(b, 0),
            sequence: le_u64(b, 8),
            name: b[18..18 + len].to_vec(),
        })
    }
}

/// A chunk stripe (32 bytes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stripe {
    pub devid: u64,
    pub offset: u64,
    pub dev_uuid: [u8; 16],
}

/// CHUNK_ITEM body (48 bytes + 32 per stripe). The key offset is the logical start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkItem {
    pub length: u64,
    pub owner: u64,
    pub stripe_len: u64,
    pub ty: u64,
    pub io_align: u32,
    pub io_width: u32,
    pub sector_size: u32,
    pub num_stripes: u16,
    pub sub_stripes: u16,
    pub stripes: Vec<Stripe>,
}

impl ChunkItem {
    pub const BASE: usize = 48;
    pub const STRIPE: usize = 32;
    /// Decodes a chunk item; returns it and the number of bytes it used.
    pub fn parse(b: &[u8]) -> Result<(ChunkItem, usize)> {
        need(b, Self::BASE, "chunk item")?;
        let num_stripes = le_u16(b, 44);
        if num_stripes == 0 {
            return Err(Error::corrupt(Location::what("chunk item"), "zero stripes"));
        }
        let total = Self::BASE + num_stripes as usize * Self::STRIPE;
        need(b, total, "chunk item stripes")?;
        let stripes = (0..num_stripes as usize)
            .map(|i| {
                let s = &b[Self::BASE + i * Self::STRIPE..];
                Stripe {
                    devid: le_u64(s, 0),
                    offset: le_u64(s, 8),
                    dev_uuid: uuid_at(s, 16),
                }
            })
            .collect();
        Ok((
            ChunkItem {
                length: le_u64(b, 0),
                owner: le_u64(b, 8),
                stripe_len: le_u64(b, 16),
                ty: le_u64(b, 24),
                io_align: le_u32(b, 32),
                io_width: le_u32(b, 36),
                sector_size: le_u32(b, 40),
                num_stripes,
                sub_stripes: le_u16(b, 46),
                stripes,
            },
            total,
        ))
    }
}

/// BLOCK_GROUP_ITEM body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGroupItem {
    pub used: u64,
    pub chunk_objectid: u64,
    pub flags: u64,
}

impl BlockGroupItem {
    pub const SIZE: usize = 24;
    pub fn parse(b: &[u8]) -> Result<BlockGroupItem> {
        need(b, Self::SIZE, "block group item")?;
        Ok(BlockGroupItem {
            used: le_u64(b, 0),
            chunk_objectid: le_u64(b, 8),
            flags: le_u64(b, 16),
        })
    }
}

/// DEV_EXTENT body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevExtent {
    pub chunk_tree: u64,
    pub chunk_objectid: u64,
    pub chunk_offset: u64,
    pub length: u64,
    pub chunk_tree_uuid: [u8; 16],
}

impl DevExtent {
    pub const SIZE: usize = 48;
    pub fn parse(b: &[u8]) -> Result<DevExtent> {
        need(b, Self::SIZE, "dev extent")?;
        Ok(DevExtent {
            chunk_tree: le_u64(b, 0),
            chunk_objectid: le_u64(b, 8),
            chunk_offset: le_u64(b, 16),
            length: le_u64(b, 24),
            chunk_tree_uuid: uuid_at(b, 32),
        })
    }
}

/// FREE_SPACE_INFO body.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FreeSpaceInfo {
    pub extent_count: u32,
    pub flags: u32,
}

impl FreeSpaceInfo {
    pub fn parse(b: &[u8]) -> Result<FreeSpaceInfo> {
        need(b, 8, "free space info")?;
        Ok(FreeSpaceInfo {
            extent_count: le_u32(b, 0),
            flags: le_u32(b, 4),
        })
    }
}

/// A back reference found inline in an extent item or as its own keyed item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackRef {
    TreeBlock {
        root: u64,
    },
    SharedBlock {
        parent: u64,
    },
    ExtentData {
        root: u64,
        objectid: u64,
        offset: u64,
        count: u32,
    },
    SharedData {
        parent: u64,
        count: u32,
    },
    /// EXTENT_OWNER_REF (simple quotas).
    Owner {
        root: u64,
    },
}

/// EXTENT_ITEM / METADATA_ITEM body with its inline references.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtentItem {
    pub refs: u64,
    pub generation: u64,
    pub flags: u64,
    /// For non-skinny tree block extents: first key and level of the block.
    pub tree_block_info: Option<(Key, u8)>,
    pub inline_refs: Vec<BackRef>,
}

impl ExtentItem {
    /// `key_ty` says EXTENT_ITEM or METADATA_ITEM (skinny: no tree block info).
    pub fn parse(b: &[u8], key_ty: u8) -> Result<ExtentItem> {
        let what = "extent item";
        need(b, 24, what)?;
        let flags = le_u64(b, 16);
        let mut off = 24;
        let mut tree_block_info = None;
        if flags & EXTENT_FLAG_TREE_BLOCK != 0 && key_ty == EXTENT_ITEM_KEY {
            need(b, off + 18, what)?;
            tree_block_info = Some((Key::from_bytes(&b[off..off + 17]), b[off + 17]));
            off += 18;
        }
        let mut inline_refs = Vec::new();
        while off < b.len() {
            let t = b[off];
            let r = &b[off + 1..];
            let (r, used) = match t {
                TREE_BLOCK_REF_KEY => {
                    need(r, 8, what)?;
                    (BackRef::TreeBlock { root: le_u64(r, 0) }, 8)
                }
                SHARED_BLOCK_REF_KEY => {
                    need(r, 8, what)?;
                    (
                        BackRef::SharedBlock {
                            parent: le_u64(r, 0),
                        },
                        8,
                    )
                }
                EXTENT_DATA_REF_KEY => {
                    need(r, 28, what)?;
                    (
                        BackRef::ExtentData {
                            root: le_u64(r, 0),
                            objectid: le_u64(r, 8),
                            offset: le_u64(r, 16),
                            count: le_u32(r, 24),
                        },
                        28,
                    )
                }
                SHARED_DATA_REF_KEY => {
                    need(r, 12, what)?;
                    (
                        BackRef::SharedData {
                            parent: le_u64(r, 0),
                            count: le_u32(r, 8),
                        },
                        12,
                    )
                }
                EXTENT_OWNER_REF_KEY => {
                    need(r, 8, what)?;
                    (BackRef::Owner { root: le_u64(r, 0) }, 8)
                }
                t => {
                    return Err(Error::corrupt(
                        Location::what(what),
                        format!("unknown inline ref type {t} at byte {off}"),
                    ))
                }
            };
            inline_refs.push(r);
            off += 1 + used;
        }
        Ok(ExtentItem {
            refs: le_u64(b, 0),
            generation: le_u64(b, 8),
            flags,
            tree_block_info,
            inline_refs,
        })
    }
}

/// EXTENT_DATA_REF keyed item body.
pub fn parse_extent_data_ref(b: &[u8]) -> Result<BackRef> {
    need(b, 28, "extent data ref")?;
    Ok(BackRef::ExtentData {
        root: le_u64(b, 0),
        objectid: le_u64(b, 8),
        offset: le_u64(b, 16),
        count: le_u32(b, 24),
    })
}

/// Mode bits of a directory entry type (FT_*), for readdir.
pub fn ft_to_mode(ft: u8) -> u32 {
    match ft {
        FT_REG_FILE => 0o100000,
        FT_DIR => 0o040000,
        FT_CHRDEV => 0o020000,
        FT_BLKDEV => 0o060000,
        FT_FIFO => 0o010000,
        FT_SOCK => 0o140000,
        FT_SYMLINK => 0o120000,
        _ => 0,
    }
}
