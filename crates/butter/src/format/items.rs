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
    /// The current time, as inode times take it; `BUTTER_FIXED_TIME` (seconds) fixes it, for
    /// reproducible tests.
    pub(crate) fn now() -> Timespec {
        Self::fixed().unwrap_or_else(|| Self::of_system(std::time::SystemTime::now()))
    }

    /// The wall-clock time of `at`, a moment in the past (for a change whose stamp is
    /// written later; an Instant costs no environment lookup). The fixed time when one is
    /// set.
    pub(crate) fn of_instant(at: std::time::Instant) -> Timespec {
        Self::fixed().unwrap_or_else(|| {
            let now = std::time::SystemTime::now();
            Self::of_system(now.checked_sub(at.elapsed()).unwrap_or(now))
        })
    }

    /// `BUTTER_FIXED_TIME` (seconds), for reproducible images.
    fn fixed() -> Option<Timespec> {
        std::env::var("BUTTER_FIXED_TIME")
            .ok()
            .and_then(|v| v.parse::<i64>().ok())
            .map(|t| Timespec { sec: t, nsec: 0 })
    }

    fn of_system(t: std::time::SystemTime) -> Timespec {
        let d = t.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Timespec {
            sec: d.as_secs() as i64,
            nsec: d.subsec_nanos(),
        }
    }

    pub(crate) fn parse(b: &[u8]) -> Timespec {
        Timespec {
            sec: le_u64(b, 0) as i64,
            nsec: le_u32(b, 8),
        }
    }
}

/// The device number btrfs stores in an inode's `rdev` (the kernel's internal dev_t,
/// major << 20 | minor) from the userspace encoding of stat(2), mknod(2), FUSE and send
/// streams (12-bit major, 20-bit minor, split as `new_encode_dev` splits them).
pub fn rdev_from_user(dev: u32) -> u64 {
    let dev = u64::from(dev);
    let major = (dev & 0xfff00) >> 8;
    let minor = (dev & 0xff) | ((dev >> 12) & 0xfff00);
    (major << 20) | minor
}

/// The userspace encoding of a stored `rdev` (the inverse of [`rdev_from_user`]).
pub fn rdev_to_user(rdev: u64) -> u32 {
    let major = (rdev >> 20) & 0xfff;
    let minor = rdev & 0xf_ffff;
    ((minor & 0xff) | (major << 8) | ((minor & !0xff) << 12)) as u32
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
    pub(crate) const SIZE: usize = 160;
    pub(crate) fn parse(b: &[u8]) -> Result<InodeItem> {
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
pub(crate) struct DirItem {
    pub location: Key,
    pub transid: u64,
    pub file_type: u8,
    pub name: Vec<u8>,
    /// xattr value (empty for directory entries).
    pub data: Vec<u8>,
}

impl DirItem {
    pub(crate) const HEADER: usize = 30;
    /// Decodes every entry packed in one item body. `max_data` bounds xattr values.
    pub(crate) fn parse_all(b: &[u8]) -> Result<Vec<DirItem>> {
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
pub(crate) struct InodeRef {
    pub index: u64,
    pub name: Vec<u8>,
}

impl InodeRef {
    pub(crate) fn parse_all(b: &[u8]) -> Result<Vec<InodeRef>> {
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
pub(crate) struct InodeExtref {
    pub parent: u64,
    pub index: u64,
    pub name: Vec<u8>,
}

impl InodeExtref {
    pub(crate) fn parse_all(b: &[u8]) -> Result<Vec<InodeExtref>> {
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
pub(crate) struct FileExtentItem {
    pub generation: u64,
    pub ram_bytes: u64,
    pub compression: u8,
    pub encryption: u8,
    pub other_encoding: u16,
    pub ty: u8,
    pub body: FileExtentBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FileExtentBody {
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
    pub(crate) const INLINE_HEADER: usize = 21;
    pub(crate) const SIZE: usize = 53;
    pub(crate) fn parse(b: &[u8]) -> Result<FileExtentItem> {
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
    pub(crate) const SIZE: usize = 439;
    pub(crate) const LEGACY_SIZE: usize = 239;
    pub(crate) fn parse(b: &[u8]) -> Result<RootItem> {
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
pub(crate) struct RootRef {
    pub dirid: u64,
    pub sequence: u64,
    pub name: Vec<u8>,
}

impl RootRef {
    pub(crate) fn parse(b: &[u8]) -> Result<RootRef> {
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
pub(crate) struct Stripe {
    pub devid: u64,
    pub offset: u64,
    pub dev_uuid: [u8; 16],
}

/// CHUNK_ITEM body (48 bytes + 32 per stripe). The key offset is the logical start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChunkItem {
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
    pub(crate) const BASE: usize = 48;
    pub(crate) const STRIPE: usize = 32;
    /// Decodes a chunk item; returns it and the number of bytes it used.
    pub(crate) fn parse(b: &[u8]) -> Result<(ChunkItem, usize)> {
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
pub(crate) struct BlockGroupItem {
    pub used: u64,
    pub chunk_objectid: u64,
    pub flags: u64,
}

impl BlockGroupItem {
    pub(crate) const SIZE: usize = 24;
    pub(crate) fn parse(b: &[u8]) -> Result<BlockGroupItem> {
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
pub(crate) struct DevExtent {
    pub chunk_tree: u64,
    pub chunk_objectid: u64,
    pub chunk_offset: u64,
    pub length: u64,
    pub chunk_tree_uuid: [u8; 16],
}

impl DevExtent {
    pub(crate) const SIZE: usize = 48;
    pub(crate) fn parse(b: &[u8]) -> Result<DevExtent> {
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
pub(crate) struct FreeSpaceInfo {
    pub extent_count: u32,
    pub flags: u32,
}

impl FreeSpaceInfo {
    pub(crate) fn parse(b: &[u8]) -> Result<FreeSpaceInfo> {
        need(b, 8, "free space info")?;
        Ok(FreeSpaceInfo {
            extent_count: le_u32(b, 0),
            flags: le_u32(b, 4),
        })
    }
}

/// A back reference found inline in an extent item or as its own keyed item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum BackRef {
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
pub(crate) struct ExtentItem {
    pub refs: u64,
    pub generation: u64,
    pub flags: u64,
    /// For non-skinny tree block extents: first key and level of the block.
    pub tree_block_info: Option<(Key, u8)>,
    pub inline_refs: Vec<BackRef>,
}

impl ExtentItem {
    /// `key_ty` says EXTENT_ITEM or METADATA_ITEM (skinny: no tree block info).
    pub(crate) fn parse(b: &[u8], key_ty: u8) -> Result<ExtentItem> {
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
pub(crate) fn parse_extent_data_ref(b: &[u8]) -> Result<BackRef> {
    need(b, 28, "extent data ref")?;
    Ok(BackRef::ExtentData {
        root: le_u64(b, 0),
        objectid: le_u64(b, 8),
        offset: le_u64(b, 16),
        count: le_u32(b, 24),
    })
}

/// Mode bits of a directory entry type (FT_*), for readdir.
pub(crate) fn ft_to_mode(ft: u8) -> u32 {
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

// ---------------------------------------------------------------------------------------------
// Encoders: the inverse of the decoders above, for code that writes items (mkfs, the COW
// engine). Each produces exactly the bytes the kernel and btrfs-progs write for the same
// values; reserved fields are zero. `X::parse(&x.to_bytes())` gives back `x`.
// ---------------------------------------------------------------------------------------------

fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// A name length as the le16 every named item stores. Names longer than 65535 bytes cannot be
/// encoded; btrfs caps them at 255 ([`NAME_LEN`]) anyway, so the caller has refused them.
fn name_len16(name: &[u8]) -> u16 {
    u16::try_from(name.len()).unwrap_or(u16::MAX)
}

impl Timespec {
    pub(crate) const SIZE: usize = 12;
    /// The 12 on-disk bytes: le64 seconds, le32 nanoseconds.
    pub(crate) fn to_bytes(self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        put_u64(&mut b, 0, self.sec as u64);
        put_u32(&mut b, 8, self.nsec);
        b
    }
}

impl InodeItem {
    /// The 160-byte INODE_ITEM body (also the first 160 bytes of a ROOT_ITEM).
    pub(crate) fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        put_u64(&mut b, 0, self.generation);
        put_u64(&mut b, 8, self.transid);
        put_u64(&mut b, 16, self.size);
        put_u64(&mut b, 24, self.nbytes);
        put_u64(&mut b, 32, self.block_group);
        put_u32(&mut b, 40, self.nlink);
        put_u32(&mut b, 44, self.uid);
        put_u32(&mut b, 48, self.gid);
        put_u32(&mut b, 52, self.mode);
        put_u64(&mut b, 56, self.rdev);
        put_u64(&mut b, 64, self.flags);
        put_u64(&mut b, 72, self.sequence);
        // [80, 112): four reserved le64
        b[112..124].copy_from_slice(&self.atime.to_bytes());
        b[124..136].copy_from_slice(&self.ctime.to_bytes());
        b[136..148].copy_from_slice(&self.mtime.to_bytes());
        b[148..160].copy_from_slice(&self.otime.to_bytes());
        b
    }
}

impl DirItem {
    /// One DIR_ITEM / DIR_INDEX / XATTR_ITEM entry: location key, le64 transid, le16 data
    /// length, le16 name length, u8 type, name, data. Items holding several colliding names are
    /// the concatenation of their entries.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; Self::HEADER + self.name.len() + self.data.len()];
        b[0..17].copy_from_slice(&self.location.to_bytes());
        put_u64(&mut b, 17, self.transid);
        put_u16(&mut b, 25, name_len16(&self.data));
        put_u16(&mut b, 27, name_len16(&self.name));
        b[29] = self.file_type;
        b[30..30 + self.name.len()].copy_from_slice(&self.name);
        b[30 + self.name.len()..].copy_from_slice(&self.data);
        b
    }
}

impl InodeRef {
    /// One INODE_REF entry: le64 index, le16 name length, name.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; 10 + self.name.len()];
        put_u64(&mut b, 0, self.index);
        put_u16(&mut b, 8, name_len16(&self.name));
        b[10..].copy_from_slice(&self.name);
        b
    }
}

impl InodeExtref {
    #[cfg(test)]
    /// One INODE_EXTREF entry: le64 parent, le64 index, le16 name length, name.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; 18 + self.name.len()];
        put_u64(&mut b, 0, self.parent);
        put_u64(&mut b, 8, self.index);
        put_u16(&mut b, 16, name_len16(&self.name));
        b[18..].copy_from_slice(&self.name);
        b
    }
}

impl FileExtentItem {
    /// A new regular extent: all `len` bytes at `bytenr`, uncompressed, written in transaction
    /// `generation`.
    pub(crate) fn regular(generation: u64, bytenr: u64, len: u64) -> FileExtentItem {
        FileExtentItem {
            generation,
            ram_bytes: len,
            compression: 0,
            encryption: 0,
            other_encoding: 0,
            ty: FILE_EXTENT_REG,
            body: FileExtentBody::Extent {
                disk_bytenr: bytenr,
                disk_num_bytes: len,
                offset: 0,
                num_bytes: len,
            },
        }
    }

    /// An explicit hole of `len` bytes written in transaction `generation`.
    pub(crate) fn hole(generation: u64, len: u64) -> FileExtentItem {
        let mut fe = Self::regular(generation, 0, len);
        if let FileExtentBody::Extent { disk_num_bytes, .. } = &mut fe.body {
            *disk_num_bytes = 0;
        }
        fe
    }

    /// EXTENT_DATA body: 21-byte header, then the inline data or the four le64 of a regular or
    /// preallocated extent.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let tail = match &self.body {
            FileExtentBody::Inline(d) => d.len(),
            FileExtentBody::Extent { .. } => Self::SIZE - Self::INLINE_HEADER,
        };
        let mut b = vec![0u8; Self::INLINE_HEADER + tail];
        put_u64(&mut b, 0, self.generation);
        put_u64(&mut b, 8, self.ram_bytes);
        b[16] = self.compression;
        b[17] = self.encryption;
        put_u16(&mut b, 18, self.other_encoding);
        b[20] = self.ty;
        match &self.body {
            FileExtentBody::Inline(d) => b[21..].copy_from_slice(d),
            FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
            } => {
                put_u64(&mut b, 21, *disk_bytenr);
                put_u64(&mut b, 29, *disk_num_bytes);
                put_u64(&mut b, 37, *offset);
                put_u64(&mut b, 45, *num_bytes);
            }
        }
        b
    }
}

impl RootItem {
    /// Marks the item as of the current format (ROOT_ITEM_INIT in its embedded inode), as the
    /// kernel does before it changes one: an item without the mark is from a kernel that left
    /// its flags and byte limit uninitialised, so they are cleared first.
    pub(crate) fn init_current_format(&mut self) {
        if self.inode.flags & INODE_ROOT_ITEM_INIT == 0 {
            self.inode.flags |= INODE_ROOT_ITEM_INIT;
            self.flags = 0;
            self.byte_limit = 0;
        }
    }

    /// [`RootItem::init_current_format`] on an item's bytes as stored (which may be of an
    /// old, shorter size: at least the 216 bytes up to its flags).
    pub(crate) fn init_current_format_in(b: &mut [u8]) {
        let iflags = u64::from_le_bytes(b[64..72].try_into().unwrap_or_default());
        if iflags & INODE_ROOT_ITEM_INIT == 0 {
            put_u64(b, 64, iflags | INODE_ROOT_ITEM_INIT);
            put_u64(b, 184, 0);
            put_u64(b, 208, 0);
        }
    }

    /// The full 439-byte ROOT_ITEM body (with the v2 fields; the 64 reserved bytes at the end
    /// are zero).
    pub(crate) fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..160].copy_from_slice(&self.inode.to_bytes());
        put_u64(&mut b, 160, self.generation);
        put_u64(&mut b, 168, self.root_dirid);
        put_u64(&mut b, 176, self.bytenr);
        put_u64(&mut b, 184, self.byte_limit);
        put_u64(&mut b, 192, self.bytes_used);
        put_u64(&mut b, 200, self.last_snapshot);
        put_u64(&mut b, 208, self.flags);
        put_u32(&mut b, 216, self.refs);
        b[220..237].copy_from_slice(&self.drop_progress.to_bytes());
        b[237] = self.drop_level;
        b[238] = self.level;
        put_u64(&mut b, 239, self.generation_v2);
        b[247..263].copy_from_slice(&self.uuid);
        b[263..279].copy_from_slice(&self.parent_uuid);
        b[279..295].copy_from_slice(&self.received_uuid);
        put_u64(&mut b, 295, self.ctransid);
        put_u64(&mut b, 303, self.otransid);
        put_u64(&mut b, 311, self.stransid);
        put_u64(&mut b, 319, self.rtransid);
        b[327..339].copy_from_slice(&self.ctime.to_bytes());
        b[339..351].copy_from_slice(&self.otime.to_bytes());
        b[351..363].copy_from_slice(&self.stime.to_bytes());
        b[363..375].copy_from_slice(&self.rtime.to_bytes());
        b
    }
}

impl RootRef {
    /// ROOT_REF / ROOT_BACKREF body: le64 dirid, le64 sequence, le16 name length, name.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; 18 + self.name.len()];
        put_u64(&mut b, 0, self.dirid);
        put_u64(&mut b, 8, self.sequence);
        put_u16(&mut b, 16, name_len16(&self.name));
        b[18..].copy_from_slice(&self.name);
        b
    }
}

impl Stripe {
    /// The 32-byte stripe record: le64 devid, le64 physical offset, device uuid.
    pub(crate) fn to_bytes(&self) -> [u8; ChunkItem::STRIPE] {
        let mut b = [0u8; ChunkItem::STRIPE];
        put_u64(&mut b, 0, self.devid);
        put_u64(&mut b, 8, self.offset);
        b[16..32].copy_from_slice(&self.dev_uuid);
        b
    }
}

impl ChunkItem {
    /// CHUNK_ITEM body (also the form in the superblock's sys_chunk_array, after its key).
    /// `num_stripes` is written as `stripes.len()`.
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut b = vec![0u8; Self::BASE + self.stripes.len() * Self::STRIPE];
        put_u64(&mut b, 0, self.length);
        put_u64(&mut b, 8, self.owner);
        put_u64(&mut b, 16, self.stripe_len);
        put_u64(&mut b, 24, self.ty);
        put_u32(&mut b, 32, self.io_align);
        put_u32(&mut b, 36, self.io_width);
        put_u32(&mut b, 40, self.sector_size);
        put_u16(
            &mut b,
            44,
            u16::try_from(self.stripes.len()).unwrap_or(u16::MAX),
        );
        put_u16(&mut b, 46, self.sub_stripes);
        for (i, s) in self.stripes.iter().enumerate() {
            let o = Self::BASE + i * Self::STRIPE;
            b[o..o + Self::STRIPE].copy_from_slice(&s.to_bytes());
        }
        b
    }
}

impl BlockGroupItem {
    /// BLOCK_GROUP_ITEM body: le64 used, le64 chunk objectid, le64 flags.
    pub(crate) fn to_bytes(self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        put_u64(&mut b, 0, self.used);
        put_u64(&mut b, 8, self.chunk_objectid);
        put_u64(&mut b, 16, self.flags);
        b
    }
}

impl DevExtent {
    /// DEV_EXTENT body.
    pub(crate) fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        put_u64(&mut b, 0, self.chunk_tree);
        put_u64(&mut b, 8, self.chunk_objectid);
        put_u64(&mut b, 16, self.chunk_offset);
        put_u64(&mut b, 24, self.length);
        b[32..48].copy_from_slice(&self.chunk_tree_uuid);
        b
    }
}

impl FreeSpaceInfo {
    pub(crate) const SIZE: usize = 8;
    /// FREE_SPACE_INFO body: le32 extent count, le32 flags.
    pub(crate) fn to_bytes(self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        put_u32(&mut b, 0, self.extent_count);
        put_u32(&mut b, 4, self.flags);
        b
    }
}

impl BackRef {
    /// The inline form inside an extent item: the type byte, then the body.
    pub(crate) fn inline_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(29);
        match self {
            BackRef::TreeBlock { root } => {
                b.push(TREE_BLOCK_REF_KEY);
                b.extend_from_slice(&root.to_le_bytes());
            }
            BackRef::SharedBlock { parent } => {
                b.push(SHARED_BLOCK_REF_KEY);
                b.extend_from_slice(&parent.to_le_bytes());
            }
            BackRef::ExtentData {
                root,
                objectid,
                offset,
                count,
            } => {
                b.push(EXTENT_DATA_REF_KEY);
                b.extend_from_slice(&root.to_le_bytes());
                b.extend_from_slice(&objectid.to_le_bytes());
                b.extend_from_slice(&offset.to_le_bytes());
                b.extend_from_slice(&count.to_le_bytes());
            }
            BackRef::SharedData { parent, count } => {
                b.push(SHARED_DATA_REF_KEY);
                b.extend_from_slice(&parent.to_le_bytes());
                b.extend_from_slice(&count.to_le_bytes());
            }
            BackRef::Owner { root } => {
                b.push(EXTENT_OWNER_REF_KEY);
                b.extend_from_slice(&root.to_le_bytes());
            }
        }
        b
    }
}

impl ExtentItem {
    /// EXTENT_ITEM / METADATA_ITEM body: le64 refs, le64 generation, le64 flags, the tree
    /// block info (first key, level) when present (non-skinny tree blocks), then the inline
    /// references in the order given (the caller keeps btrfs's order: by type, then value).
    pub(crate) fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(24 + 18 + 9 * self.inline_refs.len());
        b.extend_from_slice(&self.refs.to_le_bytes());
        b.extend_from_slice(&self.generation.to_le_bytes());
        b.extend_from_slice(&self.flags.to_le_bytes());
        if let Some((key, level)) = &self.tree_block_info {
            b.extend_from_slice(&key.to_bytes());
            b.push(*level);
        }
        for r in &self.inline_refs {
            b.extend_from_slice(&r.inline_bytes());
        }
        b
    }
}

#[cfg(test)]
mod encode_tests {
    use super::*;

    #[test]
    fn rdev_encodings_round_trip() {
        // /dev/null is 1:3: stored (1 << 20) | 3, 0x103 in userspace.
        assert_eq!(rdev_to_user((1 << 20) | 3), 0x103);
        assert_eq!(rdev_from_user(0x103), (1 << 20) | 3);
        // Major 259, minor 0x12345: the minor's high bits move above the major.
        let stored = (259u64 << 20) | 0x12345;
        assert_eq!(rdev_from_user(rdev_to_user(stored)), stored);
    }

    fn ts(sec: i64, nsec: u32) -> Timespec {
        Timespec { sec, nsec }
    }

    fn inode() -> InodeItem {
        InodeItem {
            generation: 7,
            transid: 9,
            size: 12345,
            nbytes: 16384,
            block_group: 0,
            nlink: 2,
            uid: 1000,
            gid: 100,
            mode: 0o100644,
            rdev: 0,
            flags: INODE_NODATASUM,
            sequence: 3,
            atime: ts(1_700_000_000, 5),
            ctime: ts(1_700_000_001, 6),
            mtime: ts(1_700_000_002, 7),
            otime: ts(-1, 8),
        }
    }

    #[test]
    fn round_trips() {
        let i = inode();
        assert_eq!(InodeItem::parse(&i.to_bytes()).unwrap(), i);

        let d = DirItem {
            location: Key::new(257, INODE_ITEM_KEY, 0),
            transid: 4,
            file_type: FT_REG_FILE,
            name: b"hello".to_vec(),
            data: Vec::new(),
        };
        let x = DirItem {
            location: Key::default(),
            transid: 4,
            file_type: FT_XATTR,
            name: b"user.a".to_vec(),
            data: b"value".to_vec(),
        };
        let mut two = d.to_bytes();
        two.extend_from_slice(&x.to_bytes());
        assert_eq!(DirItem::parse_all(&two).unwrap(), vec![d, x]);

        let r = InodeRef {
            index: 2,
            name: b"..".to_vec(),
        };
        assert_eq!(InodeRef::parse_all(&r.to_bytes()).unwrap(), vec![r]);
        let e = InodeExtref {
            parent: 256,
            index: 3,
            name: b"x".repeat(200),
        };
        assert_eq!(InodeExtref::parse_all(&e.to_bytes()).unwrap(), vec![e]);

        for f in [
            FileExtentItem {
                generation: 5,
                ram_bytes: 3,
                compression: 0,
                encryption: 0,
                other_encoding: 0,
                ty: FILE_EXTENT_INLINE,
                body: FileExtentBody::Inline(b"abc".to_vec()),
            },
            FileExtentItem {
                generation: 5,
                ram_bytes: 8192,
                compression: COMPRESS_ZSTD,
                encryption: 0,
                other_encoding: 0,
                ty: FILE_EXTENT_REG,
                body: FileExtentBody::Extent {
                    disk_bytenr: 1 << 30,
                    disk_num_bytes: 4096,
                    offset: 0,
                    num_bytes: 8192,
                },
            },
        ] {
            assert_eq!(FileExtentItem::parse(&f.to_bytes()).unwrap(), f);
        }

        let ri = RootItem {
            inode: inode(),
            generation: 11,
            root_dirid: 256,
            bytenr: 30425088,
            byte_limit: 0,
            bytes_used: 16384,
            last_snapshot: 2,
            flags: ROOT_SUBVOL_RDONLY,
            refs: 1,
            drop_progress: Key::new(1, 2, 3),
            drop_level: 1,
            level: 2,
            generation_v2: 11,
            uuid: [1; 16],
            parent_uuid: [2; 16],
            received_uuid: [3; 16],
            ctransid: 4,
            otransid: 5,
            stransid: 6,
            rtransid: 7,
            ctime: ts(10, 1),
            otime: ts(11, 2),
            stime: ts(12, 3),
            rtime: ts(13, 4),
        };
        assert_eq!(RootItem::parse(&ri.to_bytes()).unwrap(), ri);

        let rr = RootRef {
            dirid: 256,
            sequence: 2,
            name: b"snap".to_vec(),
        };
        assert_eq!(RootRef::parse(&rr.to_bytes()).unwrap(), rr);

        let c = ChunkItem {
            length: 8 << 20,
            owner: EXTENT_TREE_OBJECTID,
            stripe_len: STRIPE_LEN,
            ty: BLOCK_GROUP_SYSTEM | BLOCK_GROUP_DUP,
            io_align: 65536,
            io_width: 65536,
            sector_size: 4096,
            num_stripes: 2,
            sub_stripes: 1,
            stripes: vec![
                Stripe {
                    devid: 1,
                    offset: 1 << 20,
                    dev_uuid: [9; 16],
                },
                Stripe {
                    devid: 1,
                    offset: 9 << 20,
                    dev_uuid: [9; 16],
                },
            ],
        };
        let cb = c.to_bytes();
        assert_eq!(cb.len(), 112);
        assert_eq!(ChunkItem::parse(&cb).unwrap(), (c, 112));

        let bg = BlockGroupItem {
            used: 16384,
            chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
            flags: BLOCK_GROUP_METADATA | BLOCK_GROUP_DUP,
        };
        assert_eq!(BlockGroupItem::parse(&bg.to_bytes()).unwrap(), bg);
        let de = DevExtent {
            chunk_tree: CHUNK_TREE_OBJECTID,
            chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
            chunk_offset: 1 << 20,
            length: 8 << 20,
            chunk_tree_uuid: [4; 16],
        };
        assert_eq!(DevExtent::parse(&de.to_bytes()).unwrap(), de);
        let fsi = FreeSpaceInfo {
            extent_count: 3,
            flags: FREE_SPACE_USING_BITMAPS,
        };
        assert_eq!(FreeSpaceInfo::parse(&fsi.to_bytes()).unwrap(), fsi);

        let skinny = ExtentItem {
            refs: 1,
            generation: 1,
            flags: EXTENT_FLAG_TREE_BLOCK,
            tree_block_info: None,
            inline_refs: vec![BackRef::TreeBlock { root: 5 }],
        };
        let sb = skinny.to_bytes();
        assert_eq!(sb.len(), 33);
        assert_eq!(ExtentItem::parse(&sb, METADATA_ITEM_KEY).unwrap(), skinny);
        let fat = ExtentItem {
            tree_block_info: Some((Key::new(256, INODE_ITEM_KEY, 0), 0)),
            ..skinny
        };
        let fb = fat.to_bytes();
        assert_eq!(fb.len(), 51);
        assert_eq!(ExtentItem::parse(&fb, EXTENT_ITEM_KEY).unwrap(), fat);
        let data = ExtentItem {
            refs: 4,
            generation: 8,
            flags: EXTENT_FLAG_DATA,
            tree_block_info: None,
            inline_refs: vec![
                BackRef::ExtentData {
                    root: 5,
                    objectid: 257,
                    offset: 0,
                    count: 2,
                },
                BackRef::SharedData {
                    parent: 1 << 22,
                    count: 1,
                },
                BackRef::Owner { root: 5 },
                BackRef::SharedBlock { parent: 1 << 23 },
            ],
        };
        assert_eq!(
            ExtentItem::parse(&data.to_bytes(), EXTENT_ITEM_KEY).unwrap(),
            data
        );
    }
}

/// One block group type's part of a BALANCE_ITEM (the kernel's disk balance args, 136 bytes):
/// the filters a balance applies and the profile it converts to. `usage` and `limit` hold a
/// single value or, with the `*_RANGE` flag, a minimum in the low and a maximum in the high
/// 32 bits; single is [`BalanceArgs::SINGLE`] in `profiles` and `target`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BalanceArgs {
    pub(crate) profiles: u64,
    pub(crate) usage: u64,
    pub(crate) devid: u64,
    pub(crate) pstart: u64,
    pub(crate) pend: u64,
    pub(crate) vstart: u64,
    pub(crate) vend: u64,
    pub(crate) target: u64,
    pub(crate) flags: u64,
    pub(crate) limit: u64,
    pub(crate) stripes_min: u32,
    pub(crate) stripes_max: u32,
}

impl BalanceArgs {
    pub(crate) const SIZE: usize = 136;
    /// The SINGLE profile, which has no block group bit (the kernel's AVAIL_ALLOC_BIT_SINGLE).
    pub(crate) const SINGLE: u64 = 1 << 48;
    pub(crate) const PROFILES: u64 = 1 << 0;
    pub(crate) const USAGE: u64 = 1 << 1;
    pub(crate) const DEVID: u64 = 1 << 2;
    pub(crate) const DRANGE: u64 = 1 << 3;
    pub(crate) const VRANGE: u64 = 1 << 4;
    pub(crate) const LIMIT: u64 = 1 << 5;
    pub(crate) const LIMIT_RANGE: u64 = 1 << 6;
    pub(crate) const STRIPES_RANGE: u64 = 1 << 7;
    pub(crate) const CONVERT: u64 = 1 << 8;
    pub(crate) const SOFT: u64 = 1 << 9;
    pub(crate) const USAGE_RANGE: u64 = 1 << 10;

    pub(crate) fn parse(b: &[u8]) -> Result<BalanceArgs> {
        need(b, Self::SIZE, "balance args")?;
        Ok(BalanceArgs {
            profiles: le_u64(b, 0),
            usage: le_u64(b, 8),
            devid: le_u64(b, 16),
            pstart: le_u64(b, 24),
            pend: le_u64(b, 32),
            vstart: le_u64(b, 40),
            vend: le_u64(b, 48),
            target: le_u64(b, 56),
            flags: le_u64(b, 64),
            limit: le_u64(b, 72),
            stripes_min: le_u32(b, 80),
            stripes_max: le_u32(b, 84),
        })
    }

    pub(crate) fn write(&self, b: &mut [u8]) {
        for (i, v) in [
            self.profiles,
            self.usage,
            self.devid,
            self.pstart,
            self.pend,
            self.vstart,
            self.vend,
            self.target,
            self.flags,
            self.limit,
        ]
        .into_iter()
        .enumerate()
        {
            put_u64(b, i * 8, v);
        }
        put_u32(b, 80, self.stripes_min);
        put_u32(b, 84, self.stripes_max);
    }

    /// `usage` as a percent range [min, max): `usage=N` is below N.
    pub(crate) fn usage_range(&self) -> (u64, u64) {
        if self.flags & Self::USAGE_RANGE != 0 {
            (self.usage & 0xffff_ffff, self.usage >> 32)
        } else {
            (0, self.usage)
        }
    }

    /// `limit` as a range of how many block groups to take.
    pub(crate) fn limit_range(&self) -> (u64, u64) {
        if self.flags & Self::LIMIT_RANGE != 0 {
            (self.limit & 0xffff_ffff, self.limit >> 32)
        } else {
            (0, self.limit)
        }
    }
}

/// BALANCE_ITEM (root tree, key BALANCE_OBJECTID / TEMPORARY_ITEM / 0): a balance in
/// progress, so that it resumes after an interruption (the kernel resumes it at mount).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct BalanceItem {
    /// BALANCE_* below.
    pub(crate) flags: u64,
    pub(crate) data: BalanceArgs,
    pub(crate) meta: BalanceArgs,
    pub(crate) sys: BalanceArgs,
}

impl BalanceItem {
    pub(crate) const SIZE: usize = 8 + 3 * BalanceArgs::SIZE + 32;
    pub(crate) const DATA: u64 = 1 << 0;
    pub(crate) const SYSTEM: u64 = 1 << 1;
    pub(crate) const METADATA: u64 = 1 << 2;
    pub(crate) const FORCE: u64 = 1 << 3;

    pub(crate) fn parse(b: &[u8]) -> Result<BalanceItem> {
        need(b, Self::SIZE, "balance item")?;
        Ok(BalanceItem {
            flags: le_u64(b, 0),
            data: BalanceArgs::parse(&b[8..])?,
            meta: BalanceArgs::parse(&b[8 + BalanceArgs::SIZE..])?,
            sys: BalanceArgs::parse(&b[8 + 2 * BalanceArgs::SIZE..])?,
        })
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; Self::SIZE];
        put_u64(&mut b, 0, self.flags);
        self.data.write(&mut b[8..]);
        self.meta.write(&mut b[8 + BalanceArgs::SIZE..]);
        self.sys.write(&mut b[8 + 2 * BalanceArgs::SIZE..]);
        b
    }

    /// The args for one block group type (a BLOCK_GROUP_* type bit), if the balance takes it.
    pub(crate) fn args_for(&self, ty: u64) -> Option<&BalanceArgs> {
        if ty & BLOCK_GROUP_DATA != 0 && self.flags & Self::DATA != 0 {
            Some(&self.data)
        } else if ty & BLOCK_GROUP_METADATA != 0 && self.flags & Self::METADATA != 0 {
            Some(&self.meta)
        } else if ty & BLOCK_GROUP_SYSTEM != 0 && self.flags & Self::SYSTEM != 0 {
            Some(&self.sys)
        } else {
            None
        }
    }
}
