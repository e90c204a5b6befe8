//! The superblock (4 KiB at 64 KiB, mirrors at 64 MiB and 256 GiB).
//!
//! Layout facts: checksum over bytes [32, 4096); `bytenr` records which copy this is, so each
//! copy's checksum differs. The sys_chunk_array (2048 bytes) holds the chunk items needed to read
//! the chunk tree. Four backup root records rotate through commits.

use super::csum::CsumType;
use super::*;
use crate::error::{Error, Location, Result};

/// The device item embedded in the superblock and stored in the chunk tree (98 bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DevItem {
    pub devid: u64,
    pub total_bytes: u64,
    pub bytes_used: u64,
    pub io_align: u32,
    pub io_width: u32,
    pub sector_size: u32,
    pub dev_type: u64,
    pub generation: u64,
    pub start_offset: u64,
    pub dev_group: u32,
    pub seek_speed: u8,
    pub bandwidth: u8,
    pub uuid: [u8; 16],
    pub fsid: [u8; 16],
}

impl DevItem {
    pub const SIZE: usize = 98;
    pub fn parse(b: &[u8]) -> Result<DevItem> {
        if b.len() < Self::SIZE {
            return Err(Error::corrupt(
                Location::what("dev item"),
                format!("{} bytes, need {}", b.len(), Self::SIZE),
            ));
        }
        Ok(DevItem {
            devid: le_u64(b, 0),
            total_bytes: le_u64(b, 8),
            bytes_used: le_u64(b, 16),
            io_align: le_u32(b, 24),
            io_width: le_u32(b, 28),
            sector_size: le_u32(b, 32),
            dev_type: le_u64(b, 36),
            generation: le_u64(b, 44),
            start_offset: le_u64(b, 52),
            dev_group: le_u32(b, 60),
            seek_speed: b[64],
            bandwidth: b[65],
            uuid: uuid_at(b, 66),
            fsid: uuid_at(b, 82),
        })
    }
}

/// One of the four rotating backup root records (168 bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackupRoot {
    pub tree_root: u64,
    pub tree_root_gen: u64,
    pub chunk_root: u64,
    pub chunk_root_gen: u64,
    pub extent_root: u64,
    pub extent_root_gen: u64,
    pub fs_root: u64,
    pub fs_root_gen: u64,
    pub dev_root: u64,
    pub dev_root_gen: u64,
    pub csum_root: u64,
    pub csum_root_gen: u64,
    pub total_bytes: u64,
    pub bytes_used: u64,
    pub num_devices: u64,
    pub tree_root_level: u8,
    pub chunk_root_level: u8,
    pub extent_root_level: u8,
    pub fs_root_level: u8,
    pub dev_root_level: u8,
    pub csum_root_level: u8,
}

impl BackupRoot {
    pub const SIZE: usize = 168;
    fn parse(b: &[u8]) -> BackupRoot {
        BackupRoot {
            tree_root: le_u64(b, 0),
            tree_root_gen: le_u64(b, 8),
            chunk_root: le_u64(b, 16),
            chunk_root_gen: le_u64(b, 24),
            extent_root: le_u64(b, 32),
            extent_root_gen: le_u64(b, 40),
            fs_root: le_u64(b, 48),
            fs_root_gen: le_u64(b, 56),
            dev_root: le_u64(b, 64),
            dev_root_gen: le_u64(b, 72),
            csum_root: le_u64(b, 80),
            csum_root_gen: le_u64(b, 88),
            total_bytes: le_u64(b, 96),
            bytes_used: le_u64(b, 104),
            num_devices: le_u64(b, 112),
            tree_root_level: b[152],
            chunk_root_level: b[153],
            extent_root_level: b[154],
            fs_root_level: b[155],
            dev_root_level: b[156],
            csum_root_level: b[157],
        }
    }
}

#[derive(Debug, Clone)]
pub struct Superblock {
    pub csum: [u8; 32],
    pub fsid: [u8; 16],
    pub bytenr: u64,
    pub flags: u64,
    pub magic: u64,
    pub generation: u64,
    pub root: u64,
    pub chunk_root: u64,
    pub log_root: u64,
    pub total_bytes: u64,
    pub bytes_used: u64,
    pub root_dir_objectid: u64,
    pub num_devices: u64,
    pub sectorsize: u32,
    pub nodesize: u32,
    pub stripesize: u32,
    pub sys_chunk_array_size: u32,
    pub chunk_root_generation: u64,
    pub compat_flags: u64,
    pub compat_ro_flags: u64,
    pub incompat_flags: u64,
    pub csum_type_raw: u16,
    pub csum_type: CsumType,
    pub root_level: u8,
    pub chunk_root_level: u8,
    pub log_root_level: u8,
    pub dev_item: DevItem,
    pub label: String,
    pub cache_generation: u64,
    pub uuid_tree_generation: u64,
    pub metadata_uuid: [u8; 16],
    pub nr_global_roots: u64,
    pub sys_chunk_array: Vec<u8>,
    pub backup_roots: [BackupRoot; NUM_BACKUP_ROOTS],
    /// Whether the stored checksum matched.
    pub csum_ok: bool,
}

impl Superblock {
    /// Decodes a superblock copy read from byte offset `expected_bytenr`.
    /// Checks magic, checksum, bytenr, sizes and level bounds; every failure is typed.
    pub fn parse(b: &[u8], expected_bytenr: u64) -> Result<Superblock> {
        let loc = || Location::what(format!("superblock at byte {expected_bytenr}"));
        if b.len() < SUPER_INFO_SIZE {
            return Err(Error::corrupt(loc(), format!("only {} bytes", b.len())));
        }
        let magic = le_u64(b, 64);
        if magic != MAGIC {
            return Err(Error::corrupt(loc(), format!("bad magic {magic:#018x}")));
        }
        let csum_type_raw = le_u16(b, 196);
        let csum_type = CsumType::from_disk(csum_type_raw).ok_or_else(|| {
            Error::corrupt(loc(), format!("unknown checksum type {csum_type_raw}"))
        })?;
        let mut csum = [0u8; 32];
        csum.copy_from_slice(&b[0..32]);
        let computed = csum_type.compute(&b[32..SUPER_INFO_SIZE]);
        let n = csum_type.size();
        let csum_ok = computed[..n] == csum[..n];
        if !csum_ok {
            return Err(Error::bad_csum(
                loc(),
                format!(
                    "{} stored {} computed {}",
                    csum_type.name(),
                    hex(&csum[..n]),
                    hex(&computed[..n])
                ),
            ));
        }
        let bytenr = le_u64(b, 48);
        if bytenr != expected_bytenr {
            return Err(Error::corrupt(loc(), format!("bytenr field says {bytenr}")));
        }
        let sectorsize = le_u32(b, 144);
        let nodesize = le_u32(b, 148);
        if !(4096..=65536).contains(&sectorsize) || !sectorsize.is_power_of_two() {
            return Err(Error::corrupt(
                loc(),
                format!("bad sectorsize {sectorsize}"),
            ));
        }
        if !(4096..=65536).contains(&nodesize)
            || !nodesize.is_power_of_two()
            || nodesize < sectorsize
        {
            return Err(Error::corrupt(loc(), format!("bad nodesize {nodesize}")));
        }
        let sys_chunk_array_size = le_u32(b, 160);
        if sys_chunk_array_size as usize > SYSTEM_CHUNK_ARRAY_SIZE {
            return Err(Error::corrupt(
                loc(),
                format!("sys_chunk_array_size {sys_chunk_array_size} > 2048"),
            ));
        }
        let root_level = b[198];
        let chunk_root_level = b[199];
        let log_root_level = b[200];
        for (name, l) in [
            ("root", root_level),
            ("chunk root", chunk_root_level),
            ("log root", log_root_level),
        ] {
            if l >= MAX_LEVEL {
                return Err(Error::corrupt(
                    loc(),
                    format!("{name} level {l} >= {MAX_LEVEL}"),
                ));
            }
        }
        let label_raw = &b[299..299 + LABEL_SIZE];
        let end = label_raw.iter().position(|&c| c == 0).unwrap_or(LABEL_SIZE);
        let label = String::from_utf8_lossy(&label_raw[..end]).into_owned();
        let backup_roots = std::array::from_fn(|i| {
            let off = 2859 + i * BackupRoot::SIZE;
            BackupRoot::parse(&b[off..off + BackupRoot::SIZE])
        });
        let sb = Superblock {
            csum,
            fsid: uuid_at(b, 32),
            bytenr,
            flags: le_u64(b, 56),
            magic,
            generation: le_u64(b, 72),
            root: le_u64(b, 80),
            chunk_root: le_u64(b, 88),
            log_root: le_u64(b, 96),
            total_bytes: le_u64(b, 112),
            bytes_used: le_u64(b, 120),
            root_dir_objectid: le_u64(b, 128),
            num_devices: le_u64(b, 136),
            sectorsize,
            nodesize,
            stripesize: le_u32(b, 156),
            sys_chunk_array_size,
            chunk_root_generation: le_u64(b, 164),
            compat_flags: le_u64(b, 172),
            compat_ro_flags: le_u64(b, 180),
            incompat_flags: le_u64(b, 188),
            csum_type_raw,
            csum_type,
            root_level,
            chunk_root_level,
            log_root_level,
            dev_item: DevItem::parse(&b[201..201 + DevItem::SIZE])?,
            label,
            cache_generation: le_u64(b, 555),
            uuid_tree_generation: le_u64(b, 563),
            metadata_uuid: uuid_at(b, 571),
            nr_global_roots: le_u64(b, 587),
            sys_chunk_array: b[811..811 + sys_chunk_array_size as usize].to_vec(),
            backup_roots,
            csum_ok,
        };
        Ok(sb)
    }

    /// The fsid tree blocks carry: metadata_uuid when that feature is on, else fsid.
    pub fn metadata_fsid(&self) -> [u8; 16] {
        if self.incompat_flags & INCOMPAT_METADATA_UUID != 0 {
            self.metadata_uuid
        } else {
            self.fsid
        }
    }

    pub fn has_incompat(&self, f: u64) -> bool {
        self.incompat_flags & f != 0
    }
    pub fn has_compat_ro(&self, f: u64) -> bool {
        self.compat_ro_flags & f != 0
    }
}

/// Lower-case hex of a byte slice.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
