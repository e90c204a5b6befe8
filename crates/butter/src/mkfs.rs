//! mkfs: writes a new, empty single-device btrfs filesystem.
//!
//! The result has the structure `mkfs.btrfs` 6.2 gives an empty filesystem, built directly in
//! its final state (mkfs.btrfs goes through several transactions and temporary chunks; here
//! every tree is written once, as one leaf, at generation 1):
//!
//! ```text
//! device:  [0, 1 MiB) reserved (superblock at 64 KiB)
//!          system chunk    SYSTEM   | profile of metadata   (4 MiB single, 8 MiB per DUP copy)
//!          metadata chunk  METADATA | metadata profile       (sizes below)
//!          data chunk      DATA     | data profile
//!          each chunk's logical address is the physical offset of its first copy; a DUP chunk's
//!          two copies lie one after the other.
//! system chunk:   the chunk tree leaf: DEV_ITEM, one CHUNK_ITEM per chunk
//! metadata chunk: root tree, extent tree, dev tree, fs tree, csum tree, uuid tree, free space
//!                 tree (when enabled), data reloc tree; one leaf each, in that order, from the
//!                 start of the chunk (skipping any block whose copy would touch the 64 KiB
//!                 around a superblock mirror)
//! root tree:      ROOT_ITEMs of every tree but the chunk tree and itself; (FS_TREE INODE_REF 6)
//!                 "default"; the root tree directory inode 6 with its ".." ref and the
//!                 "default" DIR_ITEM pointing at the fs tree
//! extent tree:    a BLOCK_GROUP_ITEM per chunk (`used` = its tree blocks), an extent item per
//!                 tree block (METADATA_ITEM with skinny metadata, else EXTENT_ITEM with the
//!                 block's first key and level) with one inline TREE_BLOCK_REF to its owner
//! dev tree:       a DEV_EXTENT per chunk copy
//! fs tree, data reloc tree: the root directory, inode 256, with its ".." INODE_REF
//! uuid tree:      the fs tree's uuid -> 5
//! free space tree: FREE_SPACE_INFO per block group and a FREE_SPACE_EXTENT per free range
//! superblock:     written at every mirror offset that fits (64 KiB, 64 MiB, 256 GiB), with the
//!                 system chunk in sys_chunk_array and backup root slot 0 filled
//! ```
//!
//! Chunk sizes follow what mkfs.btrfs 6.2 creates for the device size: single system 4 MiB,
//! single metadata and data 8 MiB; DUP system 8 MiB per copy; DUP metadata 256 MiB per copy
//! (1 GiB above 50 GiB) and DUP data 1 GiB per copy, both cut to a tenth of the device split
//! over the two copies when that is smaller, but never below 32 MiB (metadata) or 64 MiB
//! (data). The kernel allocates further chunks as the filesystem fills.
//!
//! Determinism: with [`MkfsOptions::time`] set (SOURCE_DATE_EPOCH) every uuid other than the
//! fsid is derived from the fsid by a hash, and every timestamp is that time, so the same
//! options and fsid give a byte-identical image. Without it the other uuids are random
//! (from /dev/urandom) and the time is now.
//!
//! Differences from mkfs.btrfs 6.2, on purpose: no holes on the device from temporary chunks
//! (chunks start at 1 MiB: system, metadata, data); the chunk tree is the first block of the
//! system chunk; every generation is 1 (mkfs.btrfs ends at 6 after its transactions); the
//! free space tree has no stale entries for removed block groups; non-skinny extent items
//! always carry the block's real first key; `uuid_tree_generation` is 1 (the uuid tree is
//! complete), where mkfs.btrfs leaves 0 and the kernel rescans the uuid tree at first mount.
//!
//! What is written: the first and the last 2 MiB of the filesystem are zeroed (as mkfs.btrfs
//! does, wiping old signatures), old btrfs superblock mirrors past the new filesystem's end
//! but inside the device are zeroed, then every copy of every tree block, a flush, the
//! superblock mirrors (the primary last) and a flush.

use crate::ctree::build;
use crate::ctree::ops::NewHeader;
use crate::error::{Error, Result};
use crate::format::csum::CsumType;
use crate::format::hash::name_hash;
use crate::format::items::*;
use crate::format::superblock::{BackupRoot, DevItem, Superblock};
use crate::format::*;
use crate::io::device::BlockDevice;

/// Items of a leaf to build, in key order.
type Items = Vec<(Key, Vec<u8>)>;
/// An internal node to build: (bytenr, owner, level, [(first key, child)]).
type NodeSpec = (u64, u64, u8, Vec<(Key, u64)>);

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const GIB: u64 = 1024 * MIB;

/// Generation of every block, root and the superblock.
pub(crate) const GENERATION: u64 = 1;
/// Bytes at the start of the device no chunk uses.
const RESERVED: u64 = MIB;
/// Bytes zeroed at each end of the filesystem.
const ZERO_BYTES: u64 = 2 * MIB;
/// Bytes around each superblock mirror that hold no tree block (the kernel excludes one
/// stripe, 64 KiB, at each mirror from allocation).
const SUPER_EXCLUDE: u64 = STRIPE_LEN;
/// Mode of the root directories: a directory, rwxr-xr-x.
const ROOT_DIR_MODE: u32 = 0o040755;

/// A block group profile.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Profile {
    /// One copy.
    Single,
    /// Two copies on the same device.
    Dup,
    /// Striped over the devices, no redundancy.
    Raid0,
    /// A copy on each of two devices.
    Raid1,
    /// A copy on each of three devices.
    Raid1c3,
    /// A copy on each of four devices.
    Raid1c4,
    /// Striped over mirrored pairs of devices.
    Raid10,
    /// Striped with one parity stripe.
    Raid5,
    /// Striped with two parity stripes (P and Q).
    Raid6,
}

impl Profile {
    /// Every profile, in the order mkfs.btrfs lists them.
    pub(crate) const ALL: [Profile; 9] = [
        Profile::Raid0,
        Profile::Raid1,
        Profile::Raid1c3,
        Profile::Raid1c4,
        Profile::Raid5,
        Profile::Raid6,
        Profile::Raid10,
        Profile::Single,
        Profile::Dup,
    ];

    /// The profile bits of a chunk type / block group flags (0 for single).
    pub(crate) fn flag(self) -> u64 {
        match self {
            Profile::Single => 0,
            Profile::Dup => BLOCK_GROUP_DUP,
            Profile::Raid0 => BLOCK_GROUP_RAID0,
            Profile::Raid1 => BLOCK_GROUP_RAID1,
            Profile::Raid1c3 => BLOCK_GROUP_RAID1C3,
            Profile::Raid1c4 => BLOCK_GROUP_RAID1C4,
            Profile::Raid10 => BLOCK_GROUP_RAID10,
            Profile::Raid5 => BLOCK_GROUP_RAID5,
            Profile::Raid6 => BLOCK_GROUP_RAID6,
        }
    }
    /// Number of copies (stripes) of a chunk on one device (single and DUP only).
    pub(crate) fn copies(self) -> u64 {
        match self {
            Profile::Dup => 2,
            _ => 1,
        }
    }
    /// The name mkfs.btrfs prints ("single", "DUP", "RAID1", ...).
    pub fn name(self) -> &'static str {
        match self {
            Profile::Single => "single",
            Profile::Dup => "DUP",
            Profile::Raid0 => "RAID0",
            Profile::Raid1 => "RAID1",
            Profile::Raid1c3 => "RAID1C3",
            Profile::Raid1c4 => "RAID1C4",
            Profile::Raid10 => "RAID10",
            Profile::Raid5 => "RAID5",
            Profile::Raid6 => "RAID6",
        }
    }
    /// The fewest devices a filesystem with this profile is made on (mkfs.btrfs's rule).
    pub fn min_devices(self) -> usize {
        crate::io::volumes::raid_attr(self.flag()).devs_min
    }
    /// Whether the one-device layout (the structure of mkfs.btrfs's own) makes it.
    fn one_device_layout(self) -> bool {
        matches!(self, Profile::Single | Profile::Dup)
    }
}

/// A profile named as mkfs.btrfs's -m/-d take it (any case).
impl std::str::FromStr for Profile {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Profile, String> {
        Profile::ALL
            .into_iter()
            .find(|p| p.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<String> = Profile::ALL
                    .iter()
                    .map(|p| p.name().to_ascii_lowercase())
                    .collect();
                format!("unknown profile `{s}` ({})", names.join(", "))
            })
    }
}

/// What to build. [`Default`] gives mkfs.btrfs 6.2's defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MkfsOptions {
    /// Bytes of the device the filesystem uses (0 = the whole device); rounded down to the
    /// sector size.
    pub size: u64,
    /// Tree block size in bytes: a power of two from the sector size (and 4096) to 65536.
    pub nodesize: u32,
    /// Data block size in bytes: a power of two from 4096 to 65536.
    pub sectorsize: u32,
    pub csum: CsumType,
    /// Profile of the metadata and system chunks.
    pub metadata: Profile,
    /// Profile of the data chunk.
    pub data: Profile,
    /// incompat NO_HOLES.
    pub no_holes: bool,
    /// incompat SKINNY_METADATA (METADATA_ITEM extent items).
    pub skinny_metadata: bool,
    /// compat_ro FREE_SPACE_TREE (+ _VALID) and the free space tree.
    pub free_space_tree: bool,
    /// compat_ro BLOCK_GROUP_TREE: block group items in a tree of their own (tree 11) rather
    /// than among the extent items; mkfs.btrfs's default since 6.19. Needs the free space tree
    /// and NO_HOLES (the kernel refuses it without them).
    pub block_group_tree: bool,
    /// At most 255 bytes, no NUL.
    pub label: String,
    /// The filesystem uuid; random when `None`.
    pub fsid: Option<[u8; 16]>,
    /// Seconds since the epoch for every timestamp (SOURCE_DATE_EPOCH); `None` = now. When
    /// set, the other uuids are derived from the fsid (see the module documentation).
    pub time: Option<u64>,
}

impl Default for MkfsOptions {
    fn default() -> Self {
        MkfsOptions {
            size: 0,
            nodesize: 16384,
            sectorsize: 4096,
            csum: CsumType::Crc32c,
            metadata: Profile::Dup,
            data: Profile::Single,
            no_holes: true,
            skinny_metadata: true,
            free_space_tree: true,
            block_group_tree: true,
            label: String::new(),
            fsid: None,
            time: None,
        }
    }
}

impl MkfsOptions {
    /// The superblock incompat flags these options give.
    pub(crate) fn incompat_flags(&self) -> u64 {
        let mut f = INCOMPAT_MIXED_BACKREF | INCOMPAT_EXTENDED_IREF;
        if self.skinny_metadata {
            f |= INCOMPAT_SKINNY_METADATA;
        }
        if self.no_holes {
            f |= INCOMPAT_NO_HOLES;
        }
        f
    }
    /// The superblock compat_ro flags these options give.
    pub(crate) fn compat_ro_flags(&self) -> u64 {
        let mut f = 0;
        if self.free_space_tree {
            f |= COMPAT_RO_FREE_SPACE_TREE | COMPAT_RO_FREE_SPACE_TREE_VALID;
        }
        if self.block_group_tree {
            f |= COMPAT_RO_BLOCK_GROUP_TREE;
        }
        f
    }
}

/// One stripe of a chunk: where on which device it lies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkStripe {
    pub devid: u64,
    /// Physical offset on the device.
    pub offset: u64,
}

/// One chunk of the new filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkInfo {
    /// Logical start (also the key offset of its CHUNK_ITEM and BLOCK_GROUP_ITEM).
    pub logical: u64,
    /// Logical length, bytes.
    pub length: u64,
    /// Bytes of each stripe on its device (its DEV_EXTENT): the length for single, DUP and
    /// the RAID1 family, a share of it for striped profiles.
    pub stripe_size: u64,
    /// Chunk type and profile bits (`BLOCK_GROUP_*`).
    pub flags: u64,
    /// Each stripe, in the chunk item's order.
    pub stripes: Vec<ChunkStripe>,
    /// Bytes of tree blocks in it.
    pub used: u64,
}

/// One device of the new filesystem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceReport {
    pub devid: u64,
    pub uuid: [u8; 16],
    /// Bytes of the device the filesystem uses (its DEV_ITEM's total_bytes).
    pub size: u64,
}

/// What [`mkfs`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MkfsReport {
    pub fsid: [u8; 16],
    /// The uuid of device 1.
    pub dev_uuid: [u8; 16],
    pub chunk_tree_uuid: [u8; 16],
    /// uuid of the top-level subvolume (fs tree, id 5).
    pub fs_tree_uuid: [u8; 16],
    pub label: String,
    /// Filesystem size: the devices' sizes summed (superblock total_bytes).
    pub total_bytes: u64,
    /// Bytes used by tree blocks (superblock bytes_used).
    pub bytes_used: u64,
    pub nodesize: u32,
    pub sectorsize: u32,
    pub csum: CsumType,
    pub incompat_flags: u64,
    pub compat_ro_flags: u64,
    /// The timestamp written into inodes and the fs tree root item, seconds.
    pub time: u64,
    /// System, metadata and data chunk, in that order.
    pub chunks: Vec<ChunkInfo>,
    /// Byte offsets of the superblock copies written on device 1.
    pub superblocks: Vec<u64>,
    /// The devices, by devid (1, 2, ... in the order given).
    pub devices: Vec<DeviceReport>,
}

impl MkfsReport {
    /// The features mkfs.btrfs 6.14's summary lists for this filesystem, in its order.
    pub fn feature_names(&self) -> Vec<&'static str> {
        let mut names = vec!["extref"];
        for (set, name) in [
            (
                self.incompat_flags & INCOMPAT_SKINNY_METADATA != 0,
                "skinny-metadata",
            ),
            (self.incompat_flags & INCOMPAT_NO_HOLES != 0, "no-holes"),
            (
                self.compat_ro_flags & COMPAT_RO_FREE_SPACE_TREE != 0,
                "free-space-tree",
            ),
            (
                self.compat_ro_flags & COMPAT_RO_BLOCK_GROUP_TREE != 0,
                "block-group-tree",
            ),
        ] {
            if set {
                names.push(name);
            }
        }
        names
    }
}

/// The smallest device mkfs accepts for these profiles: the thresholds mkfs.btrfs 6.2
/// enforces (45 MiB with single metadata and data, 64 MiB more for DUP metadata, 120 MiB more
/// for DUP data). The layout written here needs less; the rest is room to start writing.
pub fn min_device_size(metadata: Profile, data: Profile) -> u64 {
    let mut min = 45 * MIB;
    if metadata == Profile::Dup {
        min += 64 * MIB;
    }
    if data == Profile::Dup {
        min += 120 * MIB;
    }
    min
}

/// Per-copy size of a DUP chunk: `cap`, unless that is more than a tenth of the device; then
/// that tenth split over the copies (64 KiB aligned), but at least `min`.
fn dup_stripe_size(size: u64, cap: u64, min: u64) -> u64 {
    let tenth = size / 10;
    let s = if cap > tenth {
        (tenth / 2) / STRIPE_LEN * STRIPE_LEN
    } else {
        cap
    };
    s.max(min)
}

/// (type flags, per-copy length, copies) of the system, metadata and data chunks.
fn chunk_plan(size: u64, opts: &MkfsOptions) -> [(u64, u64, u64); 3] {
    let sys_len = match opts.metadata {
        Profile::Dup => 8 * MIB,
        _ => 4 * MIB,
    };
    let meta_len = match opts.metadata {
        Profile::Dup => {
            let cap = if size > 50 * GIB { GIB } else { 256 * MIB };
            dup_stripe_size(size, cap, 32 * MIB)
        }
        _ => 8 * MIB,
    };
    let data_len = match opts.data {
        Profile::Dup => dup_stripe_size(size, GIB, 64 * MIB),
        _ => 8 * MIB,
    };
    [
        (
            BLOCK_GROUP_SYSTEM | opts.metadata.flag(),
            sys_len,
            opts.metadata.copies(),
        ),
        (
            BLOCK_GROUP_METADATA | opts.metadata.flag(),
            meta_len,
            opts.metadata.copies(),
        ),
        (
            BLOCK_GROUP_DATA | opts.data.flag(),
            data_len,
            opts.data.copies(),
        ),
    ]
}

fn invalid(msg: impl Into<String>) -> Error {
    Error::Invalid(msg.into())
}

fn check_options(opts: &MkfsOptions) -> Result<()> {
    let ss = opts.sectorsize;
    if !ss.is_power_of_two() || !(4096..=65536).contains(&ss) {
        return Err(invalid(format!(
            "sector size {ss} must be a power of two from 4096 to 65536"
        )));
    }
    let ns = opts.nodesize;
    if !ns.is_power_of_two() || ns < ss || ns > 65536 {
        return Err(invalid(format!(
            "node size {ns} must be a power of two from the sector size ({ss}) to 65536"
        )));
    }
    if opts.label.len() >= LABEL_SIZE {
        return Err(invalid(format!(
            "label is {} bytes, at most {} allowed",
            opts.label.len(),
            LABEL_SIZE - 1
        )));
    }
    if opts.label.contains('\0') {
        return Err(invalid("label contains a NUL byte"));
    }
    if opts.block_group_tree && !(opts.free_space_tree && opts.no_holes) {
        // The kernel refuses to mount such a filesystem.
        return Err(invalid(
            "block-group-tree needs free-space-tree and no-holes: leave those on, or turn \
             block-group-tree off too (-O ^block-group-tree)",
        ));
    }
    Ok(())
}

/// Reads `n` random bytes from the kernel.
fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    use std::io::Read;
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|e| Error::io("reading /dev/urandom", 0, e))?;
    Ok(b)
}

/// Marks 16 bytes as a version 4 (random), RFC 4122 variant uuid.
fn as_uuid_v4(mut b: [u8; 16]) -> [u8; 16] {
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    b
}

/// A random version 4 uuid.
pub(crate) fn random_uuid() -> Result<[u8; 16]> {
    Ok(as_uuid_v4(random_bytes::<16>()?))
}

/// A uuid derived from the fsid for `purpose` (SHA-256 of a fixed prefix, the purpose and the
/// fsid, shaped as a version 4 uuid).
pub fn derived_uuid(fsid: &[u8; 16], purpose: &str) -> [u8; 16] {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"butter mkfs uuid\0");
    h.update(purpose.as_bytes());
    h.update([0u8]);
    h.update(fsid);
    let d = h.finalize();
    let mut b = [0u8; 16];
    b.copy_from_slice(&d[..16]);
    as_uuid_v4(b)
}

/// Names the filesystem signature found on `dev`, if any: a btrfs superblock at any mirror
/// offset inside the device, ext2/3/4, XFS, swap or LUKS. mkfs.btrfs refuses to overwrite such
/// a device without `-f`; the CLI does the same with this.
pub fn existing_signature(dev: &dyn BlockDevice) -> Result<Option<&'static str>> {
    let len = dev.len();
    let read = |off: u64, n: usize| -> Result<Option<Vec<u8>>> {
        if off.checked_add(n as u64).is_none_or(|end| end > len) {
            return Ok(None);
        }
        let mut b = vec![0u8; n];
        dev.read_at(&mut b, off)
            .map_err(|e| Error::io("reading an old signature", off, e))?;
        Ok(Some(b))
    };
    for m in 0..SUPER_MIRROR_MAX {
        if let Some(b) = read(super_offset(m) + 64, 8)? {
            if b == MAGIC.to_le_bytes() {
                return Ok(Some("btrfs"));
            }
        }
    }
    if let Some(b) = read(1024 + 56, 2)? {
        if b == [0x53, 0xef] {
            return Ok(Some("ext2/ext3/ext4"));
        }
    }
    if let Some(b) = read(0, 6)? {
        if &b[..4] == b"XFSB" {
            return Ok(Some("xfs"));
        }
        if b == b"LUKS\xba\xbe" {
            return Ok(Some("crypto_LUKS"));
        }
    }
    if let Some(b) = read(4096 - 10, 10)? {
        if &b == b"SWAPSPACE2" || &b == b"SWAP-SPACE" {
            return Ok(Some("swap"));
        }
    }
    Ok(None)
}

/// A tree block to write: its address, owner and items in key order.
struct Leaf {
    bytenr: u64,
    owner: u64,
    items: Vec<(Key, Vec<u8>)>,
}

impl Leaf {
    fn first_key(&self) -> Key {
        self.items.first().map(|(k, _)| *k).unwrap_or_default()
    }
}

/// Whether items fit in one leaf of `nodesize` bytes.
fn leaf_fits(items: &[(Key, Vec<u8>)], nodesize: u32) -> bool {
    let need: usize = items.iter().map(|(_, d)| d.len() + ITEM_SIZE).sum();
    need + HEADER_SIZE <= nodesize as usize
}

/// The INODE_ITEM mkfs.btrfs embeds in the ROOT_ITEMs of the trees it creates first
/// (generation 1, size 3, nbytes one block, one link, a directory).
fn root_item_inode(nodesize: u32) -> InodeItem {
    InodeItem {
        generation: GENERATION,
        size: 3,
        nbytes: u64::from(nodesize),
        nlink: 1,
        mode: ROOT_DIR_MODE,
        ..Default::default()
    }
}

fn root_item(bytenr: u64, nodesize: u32, root_dirid: u64, inode: InodeItem) -> RootItem {
    RootItem {
        inode,
        generation: GENERATION,
        root_dirid,
        bytenr,
        bytes_used: u64::from(nodesize),
        refs: 1,
        level: 0,
        generation_v2: GENERATION,
        ..Default::default()
    }
}

/// The root directory (inode 256) of a subvolume tree or the data reloc tree, with its ".."
/// reference to itself.
fn root_dir_items(inode: InodeItem) -> Vec<(Key, Vec<u8>)> {
    let dotdot = InodeRef {
        index: 0,
        name: b"..".to_vec(),
    };
    vec![
        (
            Key::new(FIRST_FREE_OBJECTID, INODE_ITEM_KEY, 0),
            inode.to_bytes().to_vec(),
        ),
        (
            Key::new(FIRST_FREE_OBJECTID, INODE_REF_KEY, FIRST_FREE_OBJECTID),
            dotdot.to_bytes(),
        ),
    ]
}

/// Writes a new filesystem onto `dev` (see the module documentation) and returns what it
/// made. Refuses (with [`Error::Invalid`]) bad sizes and options before writing anything;
/// does not look for an old filesystem (see [`existing_signature`]). Single and DUP only:
/// [`mkfs_devices`] makes the other profiles, and filesystems of several devices.
pub fn mkfs(dev: &dyn BlockDevice, opts: &MkfsOptions) -> Result<MkfsReport> {
    check_options(opts)?;
    if !(opts.metadata.one_device_layout() && opts.data.one_device_layout()) {
        return Err(invalid(format!(
            "{} metadata and {} data need mkfs_devices",
            opts.metadata.name(),
            opts.data.name()
        )));
    }
    let dev_len = dev.len();
    let size = checked_size(dev_len, opts)?;
    let ids = identities(opts, 1)?;
    let chunks = lay_out_chunks(size, opts)?;
    let mirrors = crate::io::super_io::copy_offsets(size, dev_len);
    let mut built = build(opts, &ids, chunks, &[size])?;
    write_image(
        dev,
        dev_len,
        size,
        &built.chunks,
        &built.encoded,
        &mirrors,
        &mut built.sb,
    )?;
    Ok(built.report(opts, &ids, mirrors))
}

/// Writes a new filesystem over `devs` (devid 1, 2, ... in this order) with any profile the
/// number of devices allows, as mkfs.btrfs does: every device gets its share of the system,
/// metadata and data chunks (placed as the kernel's allocator places them: the devices with
/// the most room first) and its superblocks. [`MkfsOptions::size`] is each device's size.
/// One device with single or DUP profiles gets exactly what [`mkfs`] writes.
pub fn mkfs_devices(
    devs: &[std::sync::Arc<dyn BlockDevice>],
    opts: &MkfsOptions,
) -> Result<MkfsReport> {
    check_options(opts)?;
    if devs.is_empty() {
        return Err(invalid("no device given"));
    }
    for (what, p) in [("metadata", opts.metadata), ("data", opts.data)] {
        if devs.len() < p.min_devices() {
            return Err(invalid(format!(
                "{} {what} needs at least {} devices, {} given",
                p.name(),
                p.min_devices(),
                devs.len()
            )));
        }
    }
    if devs.len() == 1 && opts.metadata.one_device_layout() && opts.data.one_device_layout() {
        return mkfs(devs[0].as_ref(), opts);
    }
    let mut sizes = Vec::with_capacity(devs.len());
    for (i, d) in devs.iter().enumerate() {
        let size = checked_size(d.len(), opts)
            .map_err(|e| invalid(format!("device {} of {}: {e}", i + 1, devs.len())))?;
        sizes.push(size);
    }
    let ids = identities(opts, devs.len())?;
    let chunks = lay_out_striped(&sizes, opts)?;
    let mut built = build(opts, &ids, chunks, &sizes)?;
    write_devices(devs, &sizes, &ids, opts, &mut built)?;
    let mirrors = crate::io::super_io::copy_offsets(sizes[0], devs[0].len());
    Ok(built.report(opts, &ids, mirrors))
}

/// Everything [`mkfs`] writes but the writing: the blocks, the chunks with their use, the
/// superblock (its dev_item that of device 1) and each device's item.
struct Built {
    chunks: Vec<ChunkInfo>,
    encoded: Vec<(u64, Vec<u8>)>,
    sb: Superblock,
    dev_items: Vec<DevItem>,
    bytes_used: u64,
}

impl Built {
    fn report(self, opts: &MkfsOptions, ids: &Identities, mirrors: Vec<u64>) -> MkfsReport {
        MkfsReport {
            fsid: ids.fsid,
            dev_uuid: ids.dev_uuids[0],
            chunk_tree_uuid: ids.chunk_tree_uuid,
            fs_tree_uuid: ids.fs_tree_uuid,
            label: opts.label.clone(),
            total_bytes: self.sb.total_bytes,
            bytes_used: self.bytes_used,
            nodesize: opts.nodesize,
            sectorsize: opts.sectorsize,
            csum: opts.csum,
            incompat_flags: opts.incompat_flags(),
            compat_ro_flags: opts.compat_ro_flags(),
            time: ids.time,
            chunks: self.chunks,
            superblocks: mirrors,
            devices: self
                .dev_items
                .iter()
                .map(|d| DeviceReport {
                    devid: d.devid,
                    uuid: d.uuid,
                    size: d.total_bytes,
                })
                .collect(),
        }
    }
}

/// The trees, blocks and superblock of a new filesystem laid out as `chunks` over devices
/// of `sizes` bytes (devid 1, 2, ...).
fn build(
    opts: &MkfsOptions,
    ids: &Identities,
    mut chunks: Vec<ChunkInfo>,
    sizes: &[u64],
) -> Result<Built> {
    let nodesize = opts.nodesize;
    let ns = u64::from(nodesize);
    let (sys, meta) = (0usize, 1usize);

    // ---- tree block addresses ----
    let excluded: Vec<Vec<(u64, u64)>> = chunks
        .iter()
        .map(|c| super_ranges(c, &chunk_item(c, ids, opts)))
        .collect();
    let mut alloc = BlockAlloc {
        next: [chunks[sys].logical, chunks[meta].logical],
        ns,
        excluded: [excluded[sys].clone(), excluded[meta].clone()],
    };
    let tb = place_tree_blocks(&mut alloc, &chunks, opts)?;
    let mut meta_blocks = tb.meta_blocks();

    // ---- chunk tree, dev tree, root tree ----
    let dev_items: Vec<DevItem> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| {
            let devid = i as u64 + 1;
            let bytes_used: u64 = chunks
                .iter()
                .map(|c| {
                    c.stripe_size * c.stripes.iter().filter(|s| s.devid == devid).count() as u64
                })
                .sum();
            DevItem {
                devid,
                total_bytes: size,
                bytes_used,
                io_align: opts.sectorsize,
                io_width: opts.sectorsize,
                sector_size: opts.sectorsize,
                dev_type: 0,
                generation: 0,
                start_offset: 0,
                dev_group: 0,
                seek_speed: 0,
                bandwidth: 0,
                uuid: ids.dev_uuids[i],
                fsid: ids.fsid,
            }
        })
        .collect();
    let (chunk_items, sys_chunk_array) = chunk_tree_items(&chunks, &dev_items, ids, opts)?;
    let dev_tree = dev_tree_items(&chunks, ids.chunk_tree_uuid);
    let root_items = root_tree_items(&tb, nodesize, ids.fs_tree_uuid, ids.now);

    // A root tree too big for one leaf (small nodes with every tree present) becomes a node
    // over two leaves, as mkfs.btrfs makes it; the leaves take the next metadata blocks.
    let root_leaves = if leaf_fits(&root_items, nodesize) {
        None
    } else {
        let pair = [alloc.alloc(&chunks, meta)?, alloc.alloc(&chunks, meta)?];
        meta_blocks.extend(pair);
        Some(pair)
    };
    chunks[sys].used = ns;
    chunks[meta].used = ns * meta_blocks.len() as u64;
    let bytes_used: u64 = chunks.iter().map(|c| c.used).sum();

    // ---- fs tree, data reloc tree, csum tree, uuid tree ----
    let fs_items = root_dir_items(InodeItem {
        generation: GENERATION,
        transid: 0,
        size: 0,
        nbytes: ns,
        nlink: 1,
        mode: ROOT_DIR_MODE,
        atime: ids.now,
        ctime: ids.now,
        mtime: ids.now,
        otime: ids.now,
        ..Default::default()
    });
    let reloc_items = root_dir_items(InodeItem {
        generation: GENERATION,
        transid: 0,
        size: 0,
        nbytes: 0,
        nlink: 1,
        mode: ROOT_DIR_MODE,
        atime: ids.now,
        ctime: ids.now,
        mtime: ids.now,
        otime: Timespec::default(),
        ..Default::default()
    });
    let uuid_items = uuid_tree_items(&ids.fs_tree_uuid);

    // ---- free space tree ----
    let fst_items = if tb.fst.is_some() {
        free_space_tree_items(&chunks, tb.chunk, &meta_blocks, ns)
    } else {
        Vec::new()
    };

    let mut leaves = vec![
        Leaf {
            bytenr: tb.chunk,
            owner: CHUNK_TREE_OBJECTID,
            items: chunk_items,
        },
        Leaf {
            bytenr: tb.dev,
            owner: DEV_TREE_OBJECTID,
            items: dev_tree,
        },
        Leaf {
            bytenr: tb.fs,
            owner: FS_TREE_OBJECTID,
            items: fs_items,
        },
        Leaf {
            bytenr: tb.csum,
            owner: CSUM_TREE_OBJECTID,
            items: Vec::new(),
        },
        Leaf {
            bytenr: tb.uuid,
            owner: UUID_TREE_OBJECTID,
            items: uuid_items,
        },
        Leaf {
            bytenr: tb.reloc,
            owner: DATA_RELOC_TREE_OBJECTID,
            items: reloc_items,
        },
    ];
    if let Some(b) = tb.fst {
        leaves.push(Leaf {
            bytenr: b,
            owner: FREE_SPACE_TREE_OBJECTID,
            items: fst_items,
        });
    }

    // Internal nodes: (bytenr, owner, level, [(first key, child)]).
    let mut nodes: Vec<NodeSpec> = Vec::new();
    root_tree_leaves(root_items, root_leaves, tb.root, &mut leaves, &mut nodes);

    // ---- block group items: in the block group tree, or among the extent items ----
    let bg_items = block_group_items(&chunks);
    let mut extent_items = Vec::new();
    match tb.bg {
        Some(b) => leaves.push(Leaf {
            bytenr: b,
            owner: BLOCK_GROUP_TREE_OBJECTID,
            items: bg_items,
        }),
        None => extent_items = bg_items,
    }

    // ---- extent tree ----
    let extent_items = extent_tree_items(&leaves, &nodes, extent_items, tb.extent, opts);
    leaves.push(Leaf {
        bytenr: tb.extent,
        owner: EXTENT_TREE_OBJECTID,
        items: extent_items,
    });

    let mut encoded = encode_blocks(&leaves, &nodes, opts, ids)?;
    let root_level = if root_leaves.is_some() { 1 } else { 0 };
    encoded.sort_by_key(|(b, _)| *b);

    // ---- superblock ----
    let total_bytes: u64 = sizes.iter().sum();
    let num_devices = sizes.len() as u64;
    let backup = BackupRoot {
        tree_root: tb.root,
        tree_root_gen: GENERATION,
        tree_root_level: root_level,
        chunk_root: tb.chunk,
        chunk_root_gen: GENERATION,
        extent_root: tb.extent,
        extent_root_gen: GENERATION,
        fs_root: tb.fs,
        fs_root_gen: GENERATION,
        dev_root: tb.dev,
        dev_root_gen: GENERATION,
        csum_root: tb.csum,
        csum_root_gen: GENERATION,
        total_bytes,
        bytes_used,
        num_devices,
        ..Default::default()
    };
    let sb = Superblock {
        csum: [0; 32],
        fsid: ids.fsid,
        bytenr: 0,
        flags: HEADER_FLAG_WRITTEN,
        magic: MAGIC,
        generation: GENERATION,
        root: tb.root,
        chunk_root: tb.chunk,
        log_root: 0,
        total_bytes,
        bytes_used,
        root_dir_objectid: ROOT_TREE_DIR_OBJECTID,
        num_devices,
        sectorsize: opts.sectorsize,
        nodesize,
        stripesize: opts.sectorsize,
        sys_chunk_array_size: sys_chunk_array.len() as u32,
        chunk_root_generation: GENERATION,
        compat_flags: 0,
        compat_ro_flags: opts.compat_ro_flags(),
        incompat_flags: opts.incompat_flags(),
        csum_type_raw: opts.csum.to_disk(),
        csum_type: opts.csum,
        root_level,
        chunk_root_level: 0,
        log_root_level: 0,
        dev_item: dev_items[0].clone(),
        label: opts.label.clone(),
        // v1 space cache: (u64)-1 tells the kernel there is none to trust; with the free
        // space tree mkfs.btrfs writes 0.
        cache_generation: if opts.free_space_tree { 0 } else { u64::MAX },
        uuid_tree_generation: GENERATION,
        metadata_uuid: [0; 16],
        nr_global_roots: 0,
        sys_chunk_array,
        backup_roots: [
            backup,
            BackupRoot::default(),
            BackupRoot::default(),
            BackupRoot::default(),
        ],
        csum_ok: true,
    };
    Ok(Built {
        chunks,
        encoded,
        sb,
        dev_items,
        bytes_used,
    })
}

/// Size phase of [`mkfs`]: the filesystem size (the device's unless given, not past it),
/// rounded down to whole sectors and at least the minimum for the profiles.
fn checked_size(dev_len: u64, opts: &MkfsOptions) -> Result<u64> {
    let size = if opts.size == 0 { dev_len } else { opts.size };
    if size > dev_len {
        return Err(invalid(format!(
            "size {size} is larger than the device ({dev_len} bytes)"
        )));
    }
    let sectorsize = u64::from(opts.sectorsize);
    let size = size / sectorsize * sectorsize;
    let min = min_device_size(opts.metadata, opts.data);
    if size < min {
        return Err(invalid(format!(
            "{size} bytes is too small for a btrfs filesystem with {} metadata and {} data: \
             the minimum is {min} bytes ({} MiB)",
            opts.metadata.name(),
            opts.data.name(),
            min / MIB
        )));
    }
    Ok(size)
}

/// The new filesystem's identities and creation time.
struct Identities {
    fsid: [u8; 16],
    /// Each device's uuid, devid 1 first.
    dev_uuids: Vec<[u8; 16]>,
    chunk_tree_uuid: [u8; 16],
    fs_tree_uuid: [u8; 16],
    /// Creation time in seconds, as reported.
    time: u64,
    /// Creation time as stored in inodes and the fs tree's root item.
    now: Timespec,
}

/// Identities phase of [`mkfs`]: the fsid (given or random) and the other uuids, derived
/// from the fsid when a fixed time makes the run reproducible, else random; the time.
fn identities(opts: &MkfsOptions, devices: usize) -> Result<Identities> {
    let fsid = match opts.fsid {
        Some(u) => u,
        None => random_uuid()?,
    };
    let uuid_for = |purpose: &str| -> Result<[u8; 16]> {
        if opts.time.is_some() {
            Ok(derived_uuid(&fsid, purpose))
        } else {
            random_uuid()
        }
    };
    let mut dev_uuids = vec![uuid_for("dev")?];
    for devid in 2..=devices {
        dev_uuids.push(uuid_for(&format!("dev {devid}"))?);
    }
    let chunk_tree_uuid = uuid_for("chunk tree")?;
    let fs_tree_uuid = uuid_for("fs tree")?;
    let time = match opts.time {
        Some(t) => t,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
    };
    let now = Timespec {
        sec: i64::try_from(time).unwrap_or(i64::MAX),
        nsec: 0,
    };
    Ok(Identities {
        fsid,
        dev_uuids,
        chunk_tree_uuid,
        fs_tree_uuid,
        time,
        now,
    })
}

/// Chunk layout phase of [`mkfs`]: the system, metadata and data chunks of [`chunk_plan`]
/// placed one after another from the reserved start, each copy of a chunk after the last.
fn lay_out_chunks(size: u64, opts: &MkfsOptions) -> Result<Vec<ChunkInfo>> {
    let mut chunks = Vec::new();
    let mut cursor = RESERVED;
    for (flags, length, copies) in chunk_plan(size, opts) {
        let stripes = (0..copies)
            .map(|i| ChunkStripe {
                devid: 1,
                offset: cursor + i * length,
            })
            .collect();
        chunks.push(ChunkInfo {
            logical: cursor,
            length,
            stripe_size: length,
            flags,
            stripes,
            used: 0,
        });
        cursor += length * copies;
    }
    if cursor > size {
        return Err(invalid(format!(
            "{size} bytes is too small for the chunks ({cursor} bytes)"
        )));
    }
    Ok(chunks)
}

/// Chunk layout phase of [`mkfs_devices`]: the system, metadata and data chunks over devices
/// of `sizes` bytes, each placed as the kernel's allocator places a chunk (the devices with
/// the most room first, as many as the profile takes), each device's stripes one after
/// another from the reserved start. Sizes follow mkfs.btrfs: per stripe 8 MiB system,
/// 256 MiB metadata (1 GiB above 50 GiB in all), 1 GiB data, a chunk at most 16 MiB
/// (system), one metadata stripe, or 10 GiB (data), and none above a tenth of the
/// filesystem; a chunk over that is cut to its limit shared among all its stripes. Single
/// chunks are those of one device (4 MiB system, 8 MiB metadata and data).
fn lay_out_striped(sizes: &[u64], opts: &MkfsOptions) -> Result<Vec<ChunkInfo>> {
    let total: u64 = sizes.iter().sum();
    let mut cursor = vec![RESERVED; sizes.len()];
    let mut logical = RESERVED;
    let mut chunks = Vec::new();
    for (kind, profile) in [
        (BLOCK_GROUP_SYSTEM, opts.metadata),
        (BLOCK_GROUP_METADATA, opts.metadata),
        (BLOCK_GROUP_DATA, opts.data),
    ] {
        let flags = kind | profile.flag();
        let attr = crate::io::volumes::raid_attr(flags);
        let per_dev = attr.dev_stripes as u64;
        // (device index, room for one stripe on it)
        let mut devs: Vec<(usize, u64)> = (0..sizes.len())
            .map(|i| {
                (
                    i,
                    (sizes[i] - cursor[i]) / per_dev / STRIPE_LEN * STRIPE_LEN,
                )
            })
            .filter(|&(_, room)| room > 0)
            .collect();
        devs.sort_by_key(|&(i, room)| (std::cmp::Reverse(room), i));
        let mut ndevs = devs.len();
        if attr.devs_max > 0 {
            ndevs = ndevs.min(attr.devs_max);
        }
        ndevs -= ndevs % attr.devs_increment;
        let kind_name = match kind {
            BLOCK_GROUP_SYSTEM => "system",
            BLOCK_GROUP_METADATA => "metadata",
            _ => "data",
        };
        if ndevs < attr.devs_min || ndevs == 0 {
            return Err(invalid(format!(
                "the devices are too small for a {} {kind_name} chunk: it needs room on {} \
                 devices, {} have it",
                profile.name(),
                attr.devs_min,
                devs.len()
            )));
        }
        devs.truncate(ndevs);
        let num_stripes = ndevs as u64 * per_dev;
        let data_stripes = crate::io::volumes::data_stripes(flags, num_stripes as usize) as u64;
        let mut stripe_size = if profile == Profile::Single {
            match kind {
                BLOCK_GROUP_SYSTEM => 4 * MIB,
                _ => 8 * MIB,
            }
        } else {
            let (stripe, max_chunk) = match kind {
                BLOCK_GROUP_SYSTEM => (8 * MIB, 16 * MIB),
                BLOCK_GROUP_METADATA if total > 50 * GIB => (GIB, GIB),
                BLOCK_GROUP_METADATA => (256 * MIB, 256 * MIB),
                _ => (GIB, 10 * GIB),
            };
            let max_chunk = max_chunk.min(total / 10);
            if stripe * data_stripes > max_chunk {
                max_chunk / num_stripes / STRIPE_LEN * STRIPE_LEN
            } else {
                stripe
            }
        };
        stripe_size = stripe_size.min(devs[ndevs - 1].1);
        if stripe_size < MIB {
            return Err(invalid(format!(
                "the devices are too small for a {} {kind_name} chunk ({} bytes left per \
                 stripe)",
                profile.name(),
                stripe_size
            )));
        }
        let mut stripes = Vec::with_capacity(num_stripes as usize);
        for &(i, _) in &devs {
            for _ in 0..per_dev {
                stripes.push(ChunkStripe {
                    devid: i as u64 + 1,
                    offset: cursor[i],
                });
                cursor[i] += stripe_size;
            }
        }
        let length = stripe_size * data_stripes;
        chunks.push(ChunkInfo {
            logical,
            length,
            stripe_size,
            flags,
            stripes,
            used: 0,
        });
        logical += length.div_ceil(MIB) * MIB;
    }
    Ok(chunks)
}

/// Writing phase of [`mkfs_devices`]: on every device zeros over its start and end and over
/// old superblock mirrors past its end; every tree block through the chunk map (each copy,
/// RAID5/6 parity with it); a flush of every device; then each device's superblock copies
/// with its own device item (the primary copies last) and a flush.
fn write_devices(
    devs: &[std::sync::Arc<dyn BlockDevice>],
    sizes: &[u64],
    ids: &Identities,
    opts: &MkfsOptions,
    built: &mut Built,
) -> Result<()> {
    use crate::io::volumes::{Devices, Member};
    for (i, (dev, &size)) in devs.iter().zip(sizes).enumerate() {
        wipe_ends(dev.as_ref(), dev.len(), size)
            .map_err(|e| invalid(format!("device {}: {e}", i + 1)))?;
    }
    let devices = Devices::single(1, ids.dev_uuids[0], "device 1".to_string(), devs[0].clone());
    for (i, dev) in devs.iter().enumerate().skip(1) {
        devices.insert(Member {
            devid: i as u64 + 1,
            uuid: ids.dev_uuids[i],
            name: format!("device {}", i + 1),
            dev: Some(dev.clone()),
            failed: Default::default(),
        });
    }
    let disk = crate::io::disk_io::Disk::assemble(devices, built.sb.clone())?;
    for c in &built.chunks[1..] {
        disk.add_chunk(c.logical, chunk_item(c, ids, opts))?;
    }
    for (bytenr, buf) in &built.encoded {
        disk.write_logical(*bytenr, buf)?;
    }
    // A failed copy on one device is no error to a filesystem in use (it goes on degraded);
    // a new one must have every copy.
    let failed = |disk: &crate::io::disk_io::Disk| {
        disk.devices
            .members()
            .into_iter()
            .find(|m| disk.devices.get(m.devid).is_none())
            .map(|m| m.devid)
    };
    if let Some(devid) = failed(&disk) {
        return Err(invalid(format!(
            "device {devid} failed a write of the new filesystem"
        )));
    }
    disk.flush_all()
        .map_err(|e| Error::io("flushing the tree blocks", 0, e))?;
    let items: std::collections::BTreeMap<u64, DevItem> = built
        .dev_items
        .iter()
        .map(|d| (d.devid, d.clone()))
        .collect();
    // Mirrors first, the primary copy last: an interrupted mkfs leaves no valid primary.
    crate::io::super_io::write_all_devices(
        &disk.devices,
        &items,
        &built.sb,
        &[0u8; SUPER_INFO_SIZE],
        crate::io::super_io::Order::PrimaryLast,
    )?;
    if let Some(devid) = failed(&disk) {
        return Err(invalid(format!(
            "device {devid} failed to take its superblocks"
        )));
    }
    Ok(())
}

/// Hands out tree blocks in order from the system (index 0) and metadata (index 1) chunks,
/// skipping any block that would overlap the logical ranges a superblock copy takes.
struct BlockAlloc {
    next: [u64; 2],
    ns: u64,
    /// The logical ranges of each chunk that hold a superblock copy ([`super_ranges`]).
    excluded: [Vec<(u64, u64)>; 2],
}

impl BlockAlloc {
    fn alloc(&mut self, chunks: &[ChunkInfo], which: usize) -> Result<u64> {
        let ns = self.ns;
        let c = &chunks[which];
        loop {
            let b = self.next[which];
            if b + ns > c.logical + c.length {
                return Err(invalid(format!(
                    "the chunk at {} ({} bytes) is too small for its tree blocks",
                    c.logical, c.length
                )));
            }
            self.next[which] += ns;
            let touches_mirror = self.excluded[which]
                .iter()
                .any(|&(l, len)| b < l + len && l < b + ns);
            if !touches_mirror {
                return Ok(b);
            }
        }
    }
}

/// The logical ranges of chunk `c` that the 64 KiB around each superblock mirror take, on
/// any of its stripes (for RAID5/6 a mirror in a parity unit takes its whole full stripe),
/// as the kernel leaves them out of the block group's free space.
fn super_ranges(c: &ChunkInfo, item: &ChunkItem) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    for m in (0..SUPER_MIRROR_MAX).map(super_offset) {
        for i in 0..c.stripes.len() {
            out.extend(crate::io::volumes::logical_ranges_of(
                item,
                c.logical,
                i,
                m,
                SUPER_EXCLUDE,
            ));
        }
    }
    out
}

/// The address of each tree's root block (the optional trees only when enabled).
struct TreeBlocks {
    chunk: u64,
    root: u64,
    extent: u64,
    dev: u64,
    fs: u64,
    csum: u64,
    uuid: u64,
    fst: Option<u64>,
    bg: Option<u64>,
    reloc: u64,
}

impl TreeBlocks {
    /// The blocks in the metadata chunk, in allocation order.
    fn meta_blocks(&self) -> Vec<u64> {
        [
            Some(self.root),
            Some(self.extent),
            Some(self.dev),
            Some(self.fs),
            Some(self.csum),
            Some(self.uuid),
            self.fst,
            self.bg,
            Some(self.reloc),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Tree block phase of [`mkfs`]: the chunk tree in the system chunk, every other tree in the
/// metadata chunk, in a fixed order (the addresses are part of the reproducible output).
fn place_tree_blocks(
    alloc: &mut BlockAlloc,
    chunks: &[ChunkInfo],
    opts: &MkfsOptions,
) -> Result<TreeBlocks> {
    let (sys, meta) = (0usize, 1usize);
    let chunk = alloc.alloc(chunks, sys)?;
    let root = alloc.alloc(chunks, meta)?;
    let extent = alloc.alloc(chunks, meta)?;
    let dev = alloc.alloc(chunks, meta)?;
    let fs = alloc.alloc(chunks, meta)?;
    let csum = alloc.alloc(chunks, meta)?;
    let uuid = alloc.alloc(chunks, meta)?;
    let fst = if opts.free_space_tree {
        Some(alloc.alloc(chunks, meta)?)
    } else {
        None
    };
    let bg = if opts.block_group_tree {
        Some(alloc.alloc(chunks, meta)?)
    } else {
        None
    };
    let reloc = alloc.alloc(chunks, meta)?;
    Ok(TreeBlocks {
        chunk,
        root,
        extent,
        dev,
        fs,
        csum,
        uuid,
        fst,
        bg,
        reloc,
    })
}

/// The CHUNK_ITEM of a chunk.
fn chunk_item(c: &ChunkInfo, ids: &Identities, opts: &MkfsOptions) -> ChunkItem {
    let attr = crate::io::volumes::raid_attr(c.flags);
    ChunkItem {
        length: c.length,
        owner: EXTENT_TREE_OBJECTID,
        stripe_len: STRIPE_LEN,
        ty: c.flags,
        io_align: STRIPE_LEN as u32,
        io_width: STRIPE_LEN as u32,
        sector_size: opts.sectorsize,
        num_stripes: c.stripes.len() as u16,
        sub_stripes: attr.sub_stripes as u16,
        stripes: c
            .stripes
            .iter()
            .map(|s| Stripe {
                devid: s.devid,
                offset: s.offset,
                dev_uuid: ids.dev_uuids[(s.devid - 1) as usize],
            })
            .collect(),
    }
}

/// Chunk tree phase of [`mkfs`]: the device items and one chunk item per chunk, and the
/// superblock's system chunk array (the system chunk's key and item).
fn chunk_tree_items(
    chunks: &[ChunkInfo],
    dev_items: &[DevItem],
    ids: &Identities,
    opts: &MkfsOptions,
) -> Result<(Items, Vec<u8>)> {
    let sys = 0usize;
    let mut chunk_items: Vec<(Key, Vec<u8>)> = dev_items
        .iter()
        .map(|d| {
            (
                Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, d.devid),
                d.to_bytes().to_vec(),
            )
        })
        .collect();
    for c in chunks {
        chunk_items.push((
            Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, c.logical),
            chunk_item(c, ids, opts).to_bytes(),
        ));
    }
    let mut sys_chunk_array = Key::new(
        FIRST_CHUNK_TREE_OBJECTID,
        CHUNK_ITEM_KEY,
        chunks[sys].logical,
    )
    .to_bytes()
    .to_vec();
    sys_chunk_array.extend_from_slice(&chunk_item(&chunks[sys], ids, opts).to_bytes());
    if sys_chunk_array.len() > SYSTEM_CHUNK_ARRAY_SIZE {
        return Err(invalid(format!(
            "a system chunk of {} stripes does not fit in the superblock ({} bytes, at most \
             {SYSTEM_CHUNK_ARRAY_SIZE}): use fewer devices or another metadata profile",
            chunks[sys].stripes.len(),
            sys_chunk_array.len()
        )));
    }
    Ok((chunk_items, sys_chunk_array))
}

/// Dev tree phase of [`mkfs`]: one dev extent per chunk stripe, in key order.
fn dev_tree_items(chunks: &[ChunkInfo], chunk_tree_uuid: [u8; 16]) -> Vec<(Key, Vec<u8>)> {
    let mut dev_items = Vec::new();
    for c in chunks {
        for s in &c.stripes {
            let de = DevExtent {
                chunk_tree: CHUNK_TREE_OBJECTID,
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
                chunk_offset: c.logical,
                length: c.stripe_size,
                chunk_tree_uuid,
            };
            dev_items.push((
                Key::new(s.devid, DEV_EXTENT_KEY, s.offset),
                de.to_bytes().to_vec(),
            ));
        }
    }
    dev_items.sort_by_key(|(k, _)| *k);
    dev_items
}

/// Root tree phase of [`mkfs`]: a root item per tree, and the root tree directory with its
/// "default" entry naming the fs tree.
fn root_tree_items(
    tb: &TreeBlocks,
    nodesize: u32,
    fs_tree_uuid: [u8; 16],
    now: Timespec,
) -> Vec<(Key, Vec<u8>)> {
    let ns = u64::from(nodesize);
    let ri_inode = root_item_inode(nodesize);
    // Subvolume trees (the top level, and the data reloc tree, which is one to the kernel)
    // carry ROOT_ITEM_INIT in their embedded inode, as mkfs.btrfs writes them: without it
    // the kernel takes the item for an old-format one and clears its flags (read-only too)
    // when it snapshots it.
    let mut fs_root_item = root_item(
        tb.fs,
        nodesize,
        FIRST_FREE_OBJECTID,
        InodeItem {
            flags: INODE_ROOT_ITEM_INIT,
            ..ri_inode.clone()
        },
    );
    fs_root_item.uuid = fs_tree_uuid;
    fs_root_item.ctime = now;
    fs_root_item.otime = now;
    let dir_inode = InodeItem {
        generation: GENERATION,
        transid: 0,
        size: 0,
        nbytes: ns,
        nlink: 1,
        mode: ROOT_DIR_MODE,
        atime: now,
        ctime: now,
        mtime: now,
        otime: now,
        ..Default::default()
    };
    let default_name = b"default".to_vec();
    let mut root_items: Vec<(Key, Vec<u8>)> = vec![
        (
            Key::new(EXTENT_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
            root_item(tb.extent, nodesize, 0, ri_inode.clone())
                .to_bytes()
                .to_vec(),
        ),
        (
            Key::new(DEV_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
            root_item(tb.dev, nodesize, 0, ri_inode.clone())
                .to_bytes()
                .to_vec(),
        ),
        (
            Key::new(FS_TREE_OBJECTID, INODE_REF_KEY, ROOT_TREE_DIR_OBJECTID),
            InodeRef {
                index: 0,
                name: default_name.clone(),
            }
            .to_bytes(),
        ),
        (
            Key::new(FS_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
            fs_root_item.to_bytes().to_vec(),
        ),
        (
            Key::new(ROOT_TREE_DIR_OBJECTID, INODE_ITEM_KEY, 0),
            dir_inode.to_bytes().to_vec(),
        ),
        (
            Key::new(
                ROOT_TREE_DIR_OBJECTID,
                INODE_REF_KEY,
                ROOT_TREE_DIR_OBJECTID,
            ),
            InodeRef {
                index: 0,
                name: b"..".to_vec(),
            }
            .to_bytes(),
        ),
        (
            Key::new(
                ROOT_TREE_DIR_OBJECTID,
                DIR_ITEM_KEY,
                name_hash(&default_name),
            ),
            DirItem {
                location: Key::new(FS_TREE_OBJECTID, ROOT_ITEM_KEY, u64::MAX),
                transid: 0,
                file_type: FT_DIR,
                name: default_name,
                data: Vec::new(),
            }
            .to_bytes(),
        ),
        (
            Key::new(CSUM_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
            root_item(tb.csum, nodesize, 0, ri_inode.clone())
                .to_bytes()
                .to_vec(),
        ),
        (
            Key::new(UUID_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
            root_item(tb.uuid, nodesize, 0, InodeItem::default())
                .to_bytes()
                .to_vec(),
        ),
    ];
    if let Some(b) = tb.fst {
        root_items.push((
            Key::new(FREE_SPACE_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
            root_item(b, nodesize, 0, ri_inode.clone())
                .to_bytes()
                .to_vec(),
        ));
    }
    if let Some(b) = tb.bg {
        root_items.push((
            Key::new(BLOCK_GROUP_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
            root_item(b, nodesize, 0, ri_inode.clone())
                .to_bytes()
                .to_vec(),
        ));
    }
    root_items.push((
        Key::new(DATA_RELOC_TREE_OBJECTID, ROOT_ITEM_KEY, 0),
        root_item(
            tb.reloc,
            nodesize,
            FIRST_FREE_OBJECTID,
            InodeItem {
                flags: INODE_ROOT_ITEM_INIT,
                ..InodeItem::default()
            },
        )
        .to_bytes()
        .to_vec(),
    ));
    root_items
}

/// Free space tree phase of [`mkfs`]: per chunk, its FREE_SPACE_INFO and one extent per
/// range between the tree blocks it holds (the chunk tree block in the system chunk, the
/// metadata blocks in the metadata chunk; the data chunk is all free).
fn free_space_tree_items(
    chunks: &[ChunkInfo],
    chunk_bytenr: u64,
    meta_blocks: &[u64],
    ns: u64,
) -> Vec<(Key, Vec<u8>)> {
    let mut fst_items = Vec::new();
    for (i, c) in chunks.iter().enumerate() {
        let mut used: Vec<u64> = match i {
            0 => vec![chunk_bytenr],
            1 => meta_blocks.to_vec(),
            _ => Vec::new(),
        };
        used.sort_unstable();
        let mut free = Vec::new();
        let mut at = c.logical;
        for b in used {
            if b > at {
                free.push((at, b - at));
            }
            at = b + ns;
        }
        if at < c.logical + c.length {
            free.push((at, c.logical + c.length - at));
        }
        let info = FreeSpaceInfo {
            extent_count: free.len() as u32,
            flags: 0,
        };
        fst_items.push((
            Key::new(c.logical, FREE_SPACE_INFO_KEY, c.length),
            info.to_bytes().to_vec(),
        ));
        for (s, l) in free {
            fst_items.push((Key::new(s, FREE_SPACE_EXTENT_KEY, l), Vec::new()));
        }
    }
    fst_items
}

/// Uuid tree phase of [`mkfs`]: the fs tree's uuid (split into the key's two halves) naming it.
fn uuid_tree_items(fs_tree_uuid: &[u8; 16]) -> Vec<(Key, Vec<u8>)> {
    let mut uuid_lo = [0u8; 8];
    let mut uuid_hi = [0u8; 8];
    uuid_lo.copy_from_slice(&fs_tree_uuid[..8]);
    uuid_hi.copy_from_slice(&fs_tree_uuid[8..]);
    vec![(
        Key::new(
            u64::from_le_bytes(uuid_lo),
            UUID_KEY_SUBVOL,
            u64::from_le_bytes(uuid_hi),
        ),
        FS_TREE_OBJECTID.to_le_bytes().to_vec(),
    )]
}

/// Root tree phase of [`mkfs`]: the root tree's items as one leaf at `root_bytenr`, or, when
/// they need two (`root_leaves`), split where half their bytes are, under a level-1 node
/// at `root_bytenr`.
fn root_tree_leaves(
    mut root_items: Vec<(Key, Vec<u8>)>,
    root_leaves: Option<[u64; 2]>,
    root_bytenr: u64,
    leaves: &mut Vec<Leaf>,
    nodes: &mut Vec<NodeSpec>,
) {
    match root_leaves {
        None => leaves.push(Leaf {
            bytenr: root_bytenr,
            owner: ROOT_TREE_OBJECTID,
            items: root_items,
        }),
        Some([a, b]) => {
            let total: usize = root_items.iter().map(|(_, d)| d.len() + ITEM_SIZE).sum();
            let mut acc = 0;
            let at = root_items
                .iter()
                .position(|(_, d)| {
                    acc += d.len() + ITEM_SIZE;
                    acc > total / 2
                })
                .unwrap_or(root_items.len() / 2)
                .max(1);
            let right = root_items.split_off(at);
            let (ka, kb) = (root_items[0].0, right[0].0);
            leaves.push(Leaf {
                bytenr: a,
                owner: ROOT_TREE_OBJECTID,
                items: root_items,
            });
            leaves.push(Leaf {
                bytenr: b,
                owner: ROOT_TREE_OBJECTID,
                items: right,
            });
            nodes.push((root_bytenr, ROOT_TREE_OBJECTID, 1, vec![(ka, a), (kb, b)]));
        }
    }
}

/// One block group item per chunk, with the bytes its tree blocks use.
fn block_group_items(chunks: &[ChunkInfo]) -> Vec<(Key, Vec<u8>)> {
    chunks
        .iter()
        .map(|c| {
            let bg = BlockGroupItem {
                used: c.used,
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
                flags: c.flags,
            };
            (
                Key::new(c.logical, BLOCK_GROUP_ITEM_KEY, c.length),
                bg.to_bytes().to_vec(),
            )
        })
        .collect()
}

/// Extent tree phase of [`mkfs`]: to the block group items already in `extent_items` (none
/// with a block group tree) it adds a tree block extent item for every leaf and node and
/// for the extent tree's own block, in key order.
fn extent_tree_items(
    leaves: &[Leaf],
    nodes: &[NodeSpec],
    mut extent_items: Vec<(Key, Vec<u8>)>,
    extent_bytenr: u64,
    opts: &MkfsOptions,
) -> Vec<(Key, Vec<u8>)> {
    let ns = u64::from(opts.nodesize);
    // Keys first: the extent tree's own extent item needs the extent tree's first key.
    let extent_key = |bytenr: u64, level: u8| {
        if opts.skinny_metadata {
            Key::new(bytenr, METADATA_ITEM_KEY, u64::from(level))
        } else {
            Key::new(bytenr, EXTENT_ITEM_KEY, ns)
        }
    };
    // Every tree block: (bytenr, owner, level, first key).
    let mut blocks: Vec<(u64, u64, u8, Key)> = leaves
        .iter()
        .map(|l| (l.bytenr, l.owner, 0, l.first_key()))
        .collect();
    blocks.extend(
        nodes
            .iter()
            .map(|(b, o, lvl, ptrs)| (*b, *o, *lvl, ptrs.first().map(|p| p.0).unwrap_or_default())),
    );
    let mut extent_keys: Vec<Key> = extent_items.iter().map(|(k, _)| *k).collect();
    extent_keys.extend(blocks.iter().map(|b| extent_key(b.0, b.2)));
    extent_keys.push(extent_key(extent_bytenr, 0));
    extent_keys.sort_unstable();
    let extent_first_key = extent_keys.first().copied().unwrap_or_default();
    blocks.push((extent_bytenr, EXTENT_TREE_OBJECTID, 0, extent_first_key));
    for &(bytenr, owner, level, first_key) in &blocks {
        let ei = ExtentItem {
            refs: 1,
            generation: GENERATION,
            flags: EXTENT_FLAG_TREE_BLOCK,
            tree_block_info: if opts.skinny_metadata {
                None
            } else {
                Some((first_key, level))
            },
            inline_refs: vec![BackRef::TreeBlock { root: owner }],
        };
        extent_items.push((extent_key(bytenr, level), ei.to_bytes()));
    }
    extent_items.sort_by_key(|(k, _)| *k);
    extent_items
}

/// Encoding phase of [`mkfs`]: every leaf, then every node, as a finished block with its
/// checksum, paired with its address.
fn encode_blocks(
    leaves: &[Leaf],
    nodes: &[NodeSpec],
    opts: &MkfsOptions,
    ids: &Identities,
) -> Result<Vec<(u64, Vec<u8>)>> {
    let ns = opts.nodesize as usize;
    let header = |bytenr: u64, owner: u64| NewHeader {
        bytenr,
        owner,
        generation: GENERATION,
        fsid: ids.fsid,
        chunk_tree_uuid: ids.chunk_tree_uuid,
        flags: HEADER_FLAG_WRITTEN,
        backref_rev: MIXED_BACKREF_REV as u8,
    };
    let mut encoded: Vec<(u64, Vec<u8>)> = Vec::with_capacity(leaves.len() + nodes.len());
    for l in leaves {
        let h = header(l.bytenr, l.owner);
        let buf = build::leaf(ns, &h, &l.items, opts.csum).map_err(|e| {
            invalid(format!(
                "the {} tree does not fit in one {ns}-byte leaf: {e}",
                tree_name(l.owner)
            ))
        })?;
        encoded.push((l.bytenr, buf));
    }
    for (bytenr, owner, level, ptrs) in nodes {
        let h = header(*bytenr, *owner);
        encoded.push((*bytenr, build::node(ns, *level, &h, ptrs, opts.csum)?));
    }
    Ok(encoded)
}

/// Zeros over the first and last 2 MiB of a device's `size` bytes, and over old btrfs
/// superblock mirrors past them that would still name an old filesystem.
fn wipe_ends(dev: &dyn BlockDevice, dev_len: u64, size: u64) -> Result<()> {
    let write = |what: &str, buf: &[u8], off: u64| -> Result<()> {
        dev.write_at(buf, off)
            .map_err(|e| Error::io(format!("writing {what}"), off, e))
    };
    let zeros = vec![0u8; ZERO_BYTES as usize];
    write(
        "zeros at the start",
        &zeros[..ZERO_BYTES.min(size) as usize],
        0,
    )?;
    let tail = size.saturating_sub(ZERO_BYTES);
    write("zeros at the end", &zeros[..(size - tail) as usize], tail)?;
    // Old superblock mirrors past the new end would still name the old filesystem.
    for m in 0..SUPER_MIRROR_MAX {
        let off = super_offset(m);
        if off >= size && off + SUPER_INFO_SIZE as u64 <= dev_len {
            let mut magic = [0u8; 8];
            dev.read_at(&mut magic, off + 64)
                .map_err(|e| Error::io("reading an old superblock mirror", off + 64, e))?;
            if magic == MAGIC.to_le_bytes() {
                write(
                    "zeros over an old superblock mirror",
                    &zeros[..SUPER_INFO_SIZE],
                    off,
                )?;
            }
        }
    }
    Ok(())
}

/// Writing phase of [`mkfs`]: zeros over the start and end of the filesystem and over old
/// superblock mirrors past its end, every tree block to each copy of its chunk, a flush,
/// then the superblock mirrors (the primary last) and a flush.
fn write_image(
    dev: &dyn BlockDevice,
    dev_len: u64,
    size: u64,
    chunks: &[ChunkInfo],
    encoded: &[(u64, Vec<u8>)],
    mirrors: &[u64],
    sb: &mut Superblock,
) -> Result<()> {
    let write = |what: &str, buf: &[u8], off: u64| -> Result<()> {
        dev.write_at(buf, off)
            .map_err(|e| Error::io(format!("writing {what}"), off, e))
    };
    wipe_ends(dev, dev_len, size)?;
    for (bytenr, buf) in encoded {
        let c = chunks
            .iter()
            .find(|c| c.logical <= *bytenr && *bytenr < c.logical + c.length)
            .ok_or_else(|| invalid(format!("tree block {bytenr} lies in no chunk")))?;
        for s in &c.stripes {
            write(
                &format!("tree block {bytenr}"),
                buf,
                s.offset + (bytenr - c.logical),
            )?;
        }
    }
    dev.flush()
        .map_err(|e| Error::io("flushing the tree blocks", 0, e))?;
    // Mirrors first, the primary copy last: an interrupted mkfs leaves no valid primary.
    let written = crate::io::super_io::write_all(
        dev,
        sb,
        &[0u8; SUPER_INFO_SIZE],
        crate::io::super_io::Order::PrimaryLast,
    )?;
    if written != mirrors {
        return Err(Error::Internal(format!(
            "superblock copies written at {written:?}, laid out at {mirrors:?}"
        )));
    }
    Ok(())
}

/// For tests: a fresh filesystem of `size` bytes on a RAM device (fixed fsid and time, so
/// runs are reproducible), opened read-write.
#[cfg(test)]
pub(crate) fn test_fs(size: u64) -> (std::sync::Arc<crate::internals::RamDevice>, crate::fs::Fs) {
    let dev = std::sync::Arc::new(crate::internals::RamDevice::new(vec![0u8; size as usize]));
    let opts = MkfsOptions {
        size,
        fsid: Some([7; 16]),
        time: Some(1_700_000_000),
        ..Default::default()
    };
    mkfs(dev.as_ref(), &opts).expect("mkfs on a RAM device");
    let fs = crate::fs::Fs::open_device_rw(dev.clone()).expect("open the new filesystem");
    (dev, fs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctree::{Root, TreeIter};
    use crate::fs::Fs;
    use crate::internals::{Faults, RamDevice};
    use crate::io::device::FileDevice;
    use crate::io::disk_io::{read_superblock, Readahead};
    use std::path::PathBuf;
    use std::sync::Arc;

    /// A sparse image file in the temp directory, removed on drop.
    struct TempImage(PathBuf);

    impl TempImage {
        fn new(name: &str, size: u64) -> TempImage {
            let p = std::env::temp_dir().join(format!(
                "butter-mkfs-unit-{}-{name}.img",
                std::process::id()
            ));
            let f = std::fs::File::create(&p).unwrap();
            f.set_len(size).unwrap();
            TempImage(p)
        }
        fn device(&self) -> FileDevice {
            FileDevice::open(&self.0, true).unwrap()
        }
    }

    impl Drop for TempImage {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn fixed(opts: MkfsOptions) -> MkfsOptions {
        MkfsOptions {
            fsid: Some([0x42; 16]),
            time: Some(1_700_000_000),
            ..opts
        }
    }

    /// Opens the image with butter's reader, checks the root directory is empty and runs the
    /// checker, which must find nothing at all.
    fn assert_opens_clean(dev: Arc<dyn BlockDevice>, what: &str) -> Fs {
        let fs = Fs::open_device(dev).unwrap_or_else(|e| panic!("{what}: open: {e}"));
        let root = fs.root_inode();
        let st = fs.stat(root).unwrap();
        assert!(st.is_dir(), "{what}: root is not a directory");
        assert_eq!(st.nlink, 1, "{what}");
        assert!(fs.readdir(root, 0, 0).unwrap().is_empty(), "{what}");
        let report = fs.check(Default::default(), &mut |_| {}).unwrap();
        assert!(
            report.findings.is_empty(),
            "{what}: butter check findings:\n{}",
            report
                .findings
                .iter()
                .map(|f| f.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
        assert_eq!(report.counts.block_groups, 3, "{what}");
        fs
    }

    /// Every item key of a tree, in order.
    fn keys(fs: &Fs, id: u64) -> Vec<Key> {
        let root = if id == ROOT_TREE_OBJECTID {
            fs.core().tree_root()
        } else {
            let ri = fs.find_root_item(id).unwrap().unwrap();
            Root {
                id,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            }
        };
        let mut it =
            TreeIter::range(fs.disk().clone(), root, Key::MIN, Key::MAX, Readahead::None).unwrap();
        let mut out = Vec::new();
        while let Some(item) = it.next_item().unwrap() {
            out.push(item.key);
        }
        out
    }

    #[test]
    fn defaults_match_mkfs_btrfs_structure() {
        let img = TempImage::new("defaults", 128 << 20);
        let dev = img.device();
        let r = mkfs(&dev, &fixed(MkfsOptions::default())).unwrap();
        assert_eq!(r.total_bytes, 128 << 20);
        assert_eq!(r.superblocks, vec![64 << 10, 64 << 20]);
        assert_eq!(r.incompat_flags, 0x341);
        // free space tree (+ valid) and block group tree, as mkfs.btrfs 6.19 makes by default
        assert_eq!(r.compat_ro_flags, 0xb);
        // mkfs.btrfs 6.2 on 128 MiB: system DUP 8 MiB, metadata DUP 32 MiB, data 8 MiB.
        let lens: Vec<(u64, u64, usize)> = r
            .chunks
            .iter()
            .map(|c| (c.flags, c.length, c.stripes.len()))
            .collect();
        assert_eq!(
            lens,
            vec![
                (BLOCK_GROUP_SYSTEM | BLOCK_GROUP_DUP, 8 << 20, 2),
                (BLOCK_GROUP_METADATA | BLOCK_GROUP_DUP, 32 << 20, 2),
                (BLOCK_GROUP_DATA, 8 << 20, 1),
            ]
        );
        // 10 tree blocks, like mkfs.btrfs -O block-group-tree: 163840 bytes.
        assert_eq!(r.bytes_used, 10 * 16384);

        let sb = read_superblock(&dev).unwrap();
        assert_eq!(sb.generation, 1);
        assert_eq!(sb.fsid, [0x42; 16]);
        assert_eq!(sb.incompat_flags, 0x341);
        assert_eq!(sb.bytes_used, 10 * 16384);
        assert_eq!(sb.dev_item.bytes_used, (16 + 64 + 8) << 20);
        assert_eq!(sb.sys_chunk_array.len(), 129);
        assert_eq!(sb.backup_roots[0].tree_root, sb.root);
        assert_eq!(sb.backup_roots[0].bytes_used, sb.bytes_used);
        // The mirror at 64 MiB is the same superblock but for bytenr (and so the checksum).
        let mut m = vec![0u8; SUPER_INFO_SIZE];
        dev.read_at(&mut m, 64 << 20).unwrap();
        let m = Superblock::parse(&m, 64 << 20).unwrap();
        assert_eq!((m.root, m.generation), (sb.root, sb.generation));

        let fs = assert_opens_clean(Arc::new(dev), "defaults");
        let ty = |id| keys(&fs, id).iter().map(|k| k.ty).collect::<Vec<_>>();
        assert_eq!(
            ty(ROOT_TREE_OBJECTID),
            vec![
                ROOT_ITEM_KEY,
                ROOT_ITEM_KEY,
                INODE_REF_KEY,
                ROOT_ITEM_KEY,
                INODE_ITEM_KEY,
                INODE_REF_KEY,
                DIR_ITEM_KEY,
                ROOT_ITEM_KEY,
                ROOT_ITEM_KEY,
                ROOT_ITEM_KEY,
                ROOT_ITEM_KEY,
                ROOT_ITEM_KEY
            ]
        );
        let ext = ty(EXTENT_TREE_OBJECTID);
        assert_eq!(ext.iter().filter(|&&t| t == METADATA_ITEM_KEY).count(), 10);
        assert!(!ext.contains(&BLOCK_GROUP_ITEM_KEY));
        assert_eq!(ty(BLOCK_GROUP_TREE_OBJECTID), vec![BLOCK_GROUP_ITEM_KEY; 3]);
        assert_eq!(ty(DEV_TREE_OBJECTID), vec![DEV_EXTENT_KEY; 5]);
        assert_eq!(ty(FS_TREE_OBJECTID), vec![INODE_ITEM_KEY, INODE_REF_KEY]);
        assert_eq!(
            ty(DATA_RELOC_TREE_OBJECTID),
            vec![INODE_ITEM_KEY, INODE_REF_KEY]
        );
        assert!(ty(CSUM_TREE_OBJECTID).is_empty());
        assert_eq!(ty(UUID_TREE_OBJECTID), vec![UUID_KEY_SUBVOL]);
        // Free space tree: system and metadata groups have their blocks at the start, so
        // one free extent each after them; the data group is all free.
        let fst = keys(&fs, FREE_SPACE_TREE_OBJECTID);
        let c = &r.chunks;
        assert_eq!(
            fst,
            vec![
                Key::new(c[0].logical, FREE_SPACE_INFO_KEY, 8 << 20),
                Key::new(
                    c[0].logical + 16384,
                    FREE_SPACE_EXTENT_KEY,
                    (8 << 20) - 16384
                ),
                Key::new(c[1].logical, FREE_SPACE_INFO_KEY, 32 << 20),
                Key::new(
                    c[1].logical + 9 * 16384,
                    FREE_SPACE_EXTENT_KEY,
                    (32 << 20) - 9 * 16384
                ),
                Key::new(c[2].logical, FREE_SPACE_INFO_KEY, 8 << 20),
                Key::new(c[2].logical, FREE_SPACE_EXTENT_KEY, 8 << 20),
            ]
        );
        let fs_ri = fs.find_root_item(FS_TREE_OBJECTID).unwrap().unwrap();
        assert_eq!(fs_ri.uuid, r.fs_tree_uuid);
        assert_eq!(fs_ri.otime.sec, 1_700_000_000);
        assert_eq!(fs.stat(fs.root_inode()).unwrap().mtime.sec, 1_700_000_000);
    }

    #[test]
    fn option_combinations_open_and_check_clean() {
        let cases: Vec<(&str, u64, MkfsOptions)> = vec![
            (
                "nodesize 4096",
                128 << 20,
                MkfsOptions {
                    nodesize: 4096,
                    ..Default::default()
                },
            ),
            (
                "xxhash",
                128 << 20,
                MkfsOptions {
                    csum: CsumType::Xxhash64,
                    ..Default::default()
                },
            ),
            (
                "sha256",
                128 << 20,
                MkfsOptions {
                    csum: CsumType::Sha256,
                    ..Default::default()
                },
            ),
            (
                "blake2 nodesize 64k",
                128 << 20,
                MkfsOptions {
                    csum: CsumType::Blake2b,
                    nodesize: 65536,
                    ..Default::default()
                },
            ),
            (
                "metadata single, data dup",
                256 << 20,
                MkfsOptions {
                    metadata: Profile::Single,
                    data: Profile::Dup,
                    ..Default::default()
                },
            ),
            (
                "no skinny metadata, no no-holes",
                128 << 20,
                MkfsOptions {
                    skinny_metadata: false,
                    no_holes: false,
                    block_group_tree: false,
                    label: "fat extents".into(),
                    ..Default::default()
                },
            ),
            (
                "no free space tree",
                128 << 20,
                MkfsOptions {
                    free_space_tree: false,
                    block_group_tree: false,
                    ..Default::default()
                },
            ),
            (
                "single/single at the minimum size",
                45 << 20,
                MkfsOptions {
                    metadata: Profile::Single,
                    data: Profile::Single,
                    ..Default::default()
                },
            ),
            (
                "dup/dup 2 GiB",
                2 << 30,
                MkfsOptions {
                    data: Profile::Dup,
                    ..Default::default()
                },
            ),
        ];
        for (i, (what, size, opts)) in cases.into_iter().enumerate() {
            let img = TempImage::new(&format!("combo{i}"), size);
            let dev = img.device();
            let r = mkfs(&dev, &fixed(opts.clone())).unwrap_or_else(|e| panic!("{what}: {e}"));
            let sb = read_superblock(&dev).unwrap();
            assert_eq!(sb.incompat_flags, opts.incompat_flags(), "{what}");
            assert_eq!(sb.compat_ro_flags, opts.compat_ro_flags(), "{what}");
            assert_eq!(sb.csum_type, opts.csum, "{what}");
            assert_eq!(sb.nodesize, opts.nodesize, "{what}");
            assert_eq!(sb.label, opts.label, "{what}");
            let fs = assert_opens_clean(Arc::new(dev), what);
            let ext = keys(&fs, EXTENT_TREE_OBJECTID);
            // A 4 KiB root tree with every tree in it is a node over two leaves.
            let split = if fs.core().tree_root().level > 0 {
                2
            } else {
                0
            };
            let blocks =
                8 + usize::from(opts.free_space_tree) + usize::from(opts.block_group_tree) + split;
            let want_ty = if opts.skinny_metadata {
                METADATA_ITEM_KEY
            } else {
                EXTENT_ITEM_KEY
            };
            assert_eq!(
                ext.iter().filter(|k| k.ty == want_ty).count(),
                blocks,
                "{what}"
            );
            assert_eq!(r.bytes_used, blocks as u64 * u64::from(opts.nodesize));
            assert_eq!(
                fs.find_root_item(FREE_SPACE_TREE_OBJECTID)
                    .unwrap()
                    .is_some(),
                opts.free_space_tree,
                "{what}"
            );
            for c in &r.chunks {
                let want = if c.flags & BLOCK_GROUP_DATA != 0 {
                    opts.data
                } else {
                    opts.metadata
                };
                assert_eq!(c.stripes.len() as u64, want.copies(), "{what}");
            }
        }
    }

    #[test]
    fn chunk_sizes_follow_mkfs_btrfs() {
        // (device size, metadata DUP per-copy length, data DUP per-copy length), as
        // mkfs.btrfs 6.2 makes them.
        for (size, meta, data) in [
            (128 << 20, 32 << 20, 64 << 20),
            (1 << 30, 53673984, 64 << 20),
            (2 << 30, 107347968, 107347968),
            (4 << 30, 256 << 20, 214695936),
            (9800 << 20, 256 << 20, 513802240),
            (10 << 30, 256 << 20, 1 << 30),
            (51 << 30, 1 << 30, 1 << 30),
        ] {
            let o = MkfsOptions {
                data: Profile::Dup,
                ..Default::default()
            };
            let p = chunk_plan(size, &o);
            assert_eq!((p[1].1, p[2].1), (meta, data), "size {size}");
        }
    }

    #[test]
    fn chunk_sizes_on_several_devices_follow_mkfs_btrfs() {
        // (profile, logical length of the system, metadata and data chunks) mkfs.btrfs 6.14
        // makes over four devices of 1 GiB each (-m P -d P).
        use Profile::*;
        for (p, sys, meta, data) in [
            (Raid0, 16 << 20, 256 << 20, 429391872),
            (Raid1, 8 << 20, 256 << 20, 214695936),
            (Raid1c3, 8 << 20, 256 << 20, 143130624),
            (Raid10, 16 << 20, 128 << 20, 214695936),
            (Raid5, 12 << 20, 192 << 20, 322043904),
            (Raid6, 16 << 20, 128 << 20, 214695936),
            (Dup, 8 << 20, 256 << 20, 214695936),
        ] {
            let o = MkfsOptions {
                metadata: p,
                data: p,
                ..Default::default()
            };
            let c = lay_out_striped(&[1 << 30; 4], &o).unwrap();
            let got: Vec<u64> = c.iter().map(|c| c.length).collect();
            assert_eq!(got, vec![sys, meta, data], "{}", p.name());
            let attr = crate::io::volumes::raid_attr(p.flag());
            for c in &c {
                let want = match attr.devs_max {
                    0 => 4 - 4 % attr.devs_increment,
                    m => m.min(4),
                } * attr.dev_stripes;
                assert_eq!(c.stripes.len(), want, "{} stripes", p.name());
            }
        }
        // Three devices of 1 GiB: RAID10 takes two of them (mkfs.btrfs: 153.56 MiB of data).
        let o = MkfsOptions {
            metadata: Raid10,
            data: Raid10,
            ..Default::default()
        };
        let c = lay_out_striped(&[1 << 30; 3], &o).unwrap();
        assert_eq!(c[2].length, 161021952);
        assert_eq!(c[2].stripes.len(), 2);
        // Devices with the most room first: the small one is left out of a RAID1 chunk
        // once the others have more room.
        let o = MkfsOptions {
            metadata: Raid1,
            data: Raid1,
            ..Default::default()
        };
        let c = lay_out_striped(&[300 << 20, 1 << 30, 1 << 30], &o).unwrap();
        assert!(c.iter().all(|c| c.stripes.iter().all(|s| s.devid != 1)));
    }

    #[test]
    fn several_ram_devices_open_clean_and_read_degraded() {
        use crate::internals::RamDevice;
        for (meta, data, n, lose) in [
            (Profile::Raid1, Profile::Raid0, 2, 0),
            (Profile::Raid1c3, Profile::Raid10, 4, 1),
            (Profile::Raid5, Profile::Raid5, 3, 1),
            (Profile::Raid6, Profile::Raid6, 4, 2),
        ] {
            let devs: Vec<Arc<RamDevice>> = (0..n)
                .map(|_| Arc::new(RamDevice::new(vec![0x5a; 200 << 20])))
                .collect();
            let set: Vec<Arc<dyn BlockDevice>> = devs
                .iter()
                .map(|d| d.clone() as Arc<dyn BlockDevice>)
                .collect();
            let opts = fixed(MkfsOptions {
                metadata: meta,
                data,
                ..Default::default()
            });
            let r = mkfs_devices(&set, &opts).unwrap();
            assert_eq!(r.devices.len(), n);
            assert_eq!(r.total_bytes, n as u64 * (200 << 20));
            let given = |keep: usize| -> Vec<(String, Arc<dyn BlockDevice>)> {
                set.iter()
                    .take(keep)
                    .enumerate()
                    .map(|(i, d)| (format!("dev{i}"), d.clone()))
                    .collect()
            };
            let what = format!("{} / {}", meta.name(), data.name());
            let clean = |fs: &Fs, what: &str| {
                let report = fs.check(Default::default(), &mut |_| {}).unwrap();
                assert!(
                    report.findings.is_empty(),
                    "{what}: {:?}",
                    report
                        .findings
                        .iter()
                        .map(|f| f.to_string())
                        .collect::<Vec<_>>()
                );
                assert_eq!(report.counts.block_groups, 3, "{what}");
            };
            let fs = Fs::open_device_set(given(n), crate::fs::OpenOpts::default()).unwrap();
            clean(&fs, &what);
            drop(fs);
            if lose > 0 {
                // Every tree block is readable from the copies or the parity left.
                let fs = Fs::open_device_set(
                    given(n - lose),
                    crate::fs::OpenOpts {
                        degraded: true,
                        ..Default::default()
                    },
                )
                .unwrap();
                clean(&fs, &format!("{what} degraded"));
            }
            // Too few devices for the profile: refused before a byte is written.
            if n > 1 {
                let before = devs[0].durable_bytes();
                let few = mkfs_devices(
                    &set[..1],
                    &MkfsOptions {
                        metadata: meta,
                        data: Profile::Raid1,
                        ..opts.clone()
                    },
                );
                assert!(matches!(few, Err(Error::Invalid(_))), "{what}: {few:?}");
                assert!(devs[0].durable_bytes() == before);
            }
        }
    }

    #[test]
    fn large_device_gets_three_superblocks() {
        let img = TempImage::new("large", 300 << 30);
        let dev = img.device();
        let r = mkfs(&dev, &fixed(MkfsOptions::default())).unwrap();
        assert_eq!(r.superblocks, vec![64 << 10, 64 << 20, 256 << 30]);
        assert_eq!(r.chunks[1].length, 1 << 30);
        let mut b = vec![0u8; SUPER_INFO_SIZE];
        dev.read_at(&mut b, 256 << 30).unwrap();
        assert_eq!(Superblock::parse(&b, 256 << 30).unwrap().fsid, [0x42; 16]);
        // The 64 MiB mirror lies inside the metadata chunk's first copy: no tree block there.
        let c = &r.chunks[1];
        let s0 = c.stripes[0].offset;
        assert!(s0 < 64 << 20 && 64 << 20 < s0 + c.length);
        assert_opens_clean(Arc::new(dev), "300 GiB");
    }

    #[test]
    fn ram_device_and_determinism() {
        let opts = fixed(MkfsOptions {
            metadata: Profile::Single,
            ..Default::default()
        });
        let size = 45 << 20;
        let a = Arc::new(RamDevice::new(vec![0u8; size]));
        let b = RamDevice::new(vec![0xaa; size]);
        let ra = mkfs(a.as_ref(), &opts).unwrap();
        let rb = mkfs(&b, &opts).unwrap();
        assert_eq!(ra, rb);
        // Same bytes wherever mkfs writes (b started as 0xaa garbage elsewhere).
        let (la, lb) = (a.durable_bytes(), b.durable_bytes());
        let mut written: Vec<(u64, u64)> = vec![(0, 2 << 20), (size as u64 - (2 << 20), 2 << 20)];
        written.extend(ra.chunks.iter().flat_map(|c| {
            let used = c.used;
            c.stripes.iter().map(move |s| (s.offset, used))
        }));
        for (off, len) in written {
            let r = off as usize..(off + len) as usize;
            assert!(la[r.clone()] == lb[r], "bytes at {off}+{len} differ");
        }
        assert_opens_clean(a, "ram device");

        // Another fsid: every uuid changes. No fixed time: random uuids, now.
        let c = RamDevice::new(vec![0u8; size]);
        let rc = mkfs(
            &c,
            &MkfsOptions {
                fsid: Some([0x43; 16]),
                ..opts.clone()
            },
        )
        .unwrap();
        assert_ne!(rc.dev_uuid, ra.dev_uuid);
        assert_ne!(rc.chunk_tree_uuid, ra.chunk_tree_uuid);
        assert_ne!(rc.fs_tree_uuid, ra.fs_tree_uuid);
        assert_ne!(c.durable_bytes(), la);
        let d = RamDevice::new(vec![0u8; size]);
        let rd = mkfs(
            &d,
            &MkfsOptions {
                time: None,
                ..opts.clone()
            },
        )
        .unwrap();
        assert_ne!(rd.dev_uuid, ra.dev_uuid);
        assert!(rd.time > 1_700_000_000);
        let e = RamDevice::new(vec![0u8; size]);
        let re = mkfs(&e, &MkfsOptions { fsid: None, ..opts }).unwrap();
        assert_ne!(re.fsid, ra.fsid);
        assert_eq!(re.fsid[6] >> 4, 4, "random fsid is a version 4 uuid");
    }

    #[test]
    fn refuses_bad_options_without_writing() {
        let dev = RamDevice::new(vec![0u8; 120 << 20]);
        let bad = [
            MkfsOptions {
                size: 100 << 20,
                ..Default::default()
            },
            MkfsOptions {
                size: 200 << 20,
                metadata: Profile::Single,
                ..Default::default()
            },
            MkfsOptions {
                data: Profile::Dup,
                ..Default::default()
            },
            MkfsOptions {
                nodesize: 12288,
                ..Default::default()
            },
            MkfsOptions {
                nodesize: 2048,
                sectorsize: 2048,
                ..Default::default()
            },
            MkfsOptions {
                nodesize: 4096,
                sectorsize: 8192,
                ..Default::default()
            },
            MkfsOptions {
                nodesize: 131072,
                ..Default::default()
            },
            MkfsOptions {
                label: "x".repeat(256),
                ..Default::default()
            },
            MkfsOptions {
                label: "a\0b".into(),
                ..Default::default()
            },
        ];
        for o in bad {
            match mkfs(&dev, &o) {
                Err(Error::Invalid(msg)) => assert!(!msg.is_empty()),
                other => panic!("{o:?} gave {other:?}"),
            }
        }
        assert_eq!(dev.write_count(), 0);
        let small = mkfs(
            &dev,
            &MkfsOptions {
                size: 100 << 20,
                ..Default::default()
            },
        );
        let msg = small.unwrap_err().to_string();
        assert!(msg.contains("minimum is 114294784 bytes"), "{msg}");
        // 255 bytes of label is fine.
        let r = mkfs(
            &dev,
            &MkfsOptions {
                label: "é".repeat(127),
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(read_superblock(&dev).unwrap().label, r.label);
    }

    #[test]
    fn signatures() {
        let dev = RamDevice::new(vec![0u8; 64 << 20]);
        assert_eq!(existing_signature(&dev).unwrap(), None);
        dev.write_at(&[0x53, 0xef], 1080).unwrap();
        assert_eq!(existing_signature(&dev).unwrap(), Some("ext2/ext3/ext4"));
        let dev = RamDevice::new(vec![0u8; 50 << 20]);
        mkfs(
            &dev,
            &MkfsOptions {
                metadata: Profile::Single,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(existing_signature(&dev).unwrap(), Some("btrfs"));
    }

    /// A failed write is an error, not a panic; the primary superblock is the last write, so
    /// a failure anywhere before it leaves no valid filesystem behind.
    #[test]
    fn write_failures() {
        let opts = MkfsOptions {
            metadata: Profile::Single,
            ..Default::default()
        };
        let probe = RamDevice::new(vec![0u8; 45 << 20]);
        mkfs(&probe, &opts).unwrap();
        let writes = probe.write_count();
        for at in 0..writes {
            let dev = RamDevice::new(vec![0u8; 45 << 20]);
            dev.set_faults(Faults {
                fail_write_at: Some(at),
                ..Default::default()
            });
            let e = mkfs(&dev, &opts).unwrap_err();
            assert!(matches!(e, Error::Io { .. }), "{e}");
            assert!(read_superblock(&dev).is_err(), "write {at} failed");
        }
        let dev = RamDevice::new(vec![0u8; 45 << 20]);
        dev.set_faults(Faults {
            fail_flush: true,
            ..Default::default()
        });
        assert!(matches!(mkfs(&dev, &opts), Err(Error::Io { .. })));
    }
}
