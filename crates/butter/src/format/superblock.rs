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
    pub(crate) const SIZE: usize = 98;
    pub(crate) fn parse(b: &[u8]) -> Result<DevItem> {
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
    pub(crate) const SIZE: usize = 168;
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
    pub(crate) fn parse(b: &[u8], expected_bytenr: u64) -> Result<Superblock> {
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
    pub(crate) fn metadata_fsid(&self) -> [u8; 16] {
        if self.incompat_flags & INCOMPAT_METADATA_UUID != 0 {
            self.metadata_uuid
        } else {
            self.fsid
        }
    }

    pub(crate) fn has_incompat(&self, f: u64) -> bool {
        self.incompat_flags & f != 0
    }
    pub(crate) fn has_compat_ro(&self, f: u64) -> bool {
        self.compat_ro_flags & f != 0
    }
}

/// Lower-case hex of a byte slice.
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// Encoders (mkfs, commits): the inverse of the decoders above.
// ---------------------------------------------------------------------------------------------

fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

impl DevItem {
    /// The 98-byte device item (superblock copy and chunk tree DEV_ITEM body).
    pub(crate) fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        put_u64(&mut b, 0, self.devid);
        put_u64(&mut b, 8, self.total_bytes);
        put_u64(&mut b, 16, self.bytes_used);
        put_u32(&mut b, 24, self.io_align);
        put_u32(&mut b, 28, self.io_width);
        put_u32(&mut b, 32, self.sector_size);
        put_u64(&mut b, 36, self.dev_type);
        put_u64(&mut b, 44, self.generation);
        put_u64(&mut b, 52, self.start_offset);
        put_u32(&mut b, 60, self.dev_group);
        b[64] = self.seek_speed;
        b[65] = self.bandwidth;
        b[66..82].copy_from_slice(&self.uuid);
        b[82..98].copy_from_slice(&self.fsid);
        b
    }
}

impl BackupRoot {
    /// The 168-byte backup root record (the four unused le64 after `num_devices` and the
    /// padding after the levels are zero).
    pub(crate) fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        for (i, v) in [
            self.tree_root,
            self.tree_root_gen,
            self.chunk_root,
            self.chunk_root_gen,
            self.extent_root,
            self.extent_root_gen,
            self.fs_root,
            self.fs_root_gen,
            self.dev_root,
            self.dev_root_gen,
            self.csum_root,
            self.csum_root_gen,
            self.total_bytes,
            self.bytes_used,
            self.num_devices,
        ]
        .into_iter()
        .enumerate()
        {
            put_u64(&mut b, i * 8, v);
        }
        b[152] = self.tree_root_level;
        b[153] = self.chunk_root_level;
        b[154] = self.extent_root_level;
        b[155] = self.fs_root_level;
        b[156] = self.dev_root_level;
        b[157] = self.csum_root_level;
        b
    }
}

impl Superblock {
    /// Encodes the superblock copy for byte offset `self.bytenr`, checksummed with
    /// `self.csum_type` over bytes [32, 4096) (the `csum` and `csum_ok` fields are ignored),
    /// with every byte this struct does not carry written as mkfs.btrfs writes it on a
    /// filesystem without the features that use it: see [`Superblock::encode_over`] on zeros.
    #[cfg(test)]
    pub(crate) fn to_bytes(&self) -> [u8; SUPER_INFO_SIZE] {
        self.encode_over(&[0u8; SUPER_INFO_SIZE])
    }

    /// Encodes the superblock copy for byte offset `self.bytenr` over `base`, the bytes the
    /// superblock was read from: the fields this struct carries are written, and the bytes it
    /// does not carry (reserved space, the block group tree root fields of extent-tree-v2,
    /// fields of later versions) stay as `base` has them, so a superblock that butter reads
    /// and writes back loses nothing it does not know.
    ///
    /// The deprecated fields: `log_root_transid` is written 0 (no log names a transid), and
    /// `leafsize` stays as found, or is `nodesize` where `base` has none. The label is written
    /// when it differs from `base`'s (so a label that is not UTF-8 survives a commit), cut to
    /// 255 bytes; `sys_chunk_array` is cut to [`SYSTEM_CHUNK_ARRAY_SIZE`] bytes, zeros after
    /// it, and `sys_chunk_array_size` is the length kept.
    pub(crate) fn encode_over(&self, base: &[u8]) -> [u8; SUPER_INFO_SIZE] {
        let mut b = [0u8; SUPER_INFO_SIZE];
        let n = base.len().min(SUPER_INFO_SIZE);
        b[..n].copy_from_slice(&base[..n]);
        b[32..48].copy_from_slice(&self.fsid);
        put_u64(&mut b, 48, self.bytenr);
        put_u64(&mut b, 56, self.flags);
        put_u64(&mut b, 64, self.magic);
        put_u64(&mut b, 72, self.generation);
        put_u64(&mut b, 80, self.root);
        put_u64(&mut b, 88, self.chunk_root);
        put_u64(&mut b, 96, self.log_root);
        put_u64(&mut b, 104, 0); // log_root_transid (deprecated)
        put_u64(&mut b, 112, self.total_bytes);
        put_u64(&mut b, 120, self.bytes_used);
        put_u64(&mut b, 128, self.root_dir_objectid);
        put_u64(&mut b, 136, self.num_devices);
        put_u32(&mut b, 144, self.sectorsize);
        put_u32(&mut b, 148, self.nodesize);
        if le_u32(&b, 152) == 0 {
            put_u32(&mut b, 152, self.nodesize); // leafsize (deprecated) = nodesize
        }
        put_u32(&mut b, 156, self.stripesize);
        let arr_len = self.sys_chunk_array.len().min(SYSTEM_CHUNK_ARRAY_SIZE);
        put_u32(&mut b, 160, arr_len as u32);
        put_u64(&mut b, 164, self.chunk_root_generation);
        put_u64(&mut b, 172, self.compat_flags);
        put_u64(&mut b, 180, self.compat_ro_flags);
        put_u64(&mut b, 188, self.incompat_flags);
        b[196..198].copy_from_slice(&self.csum_type.to_disk().to_le_bytes());
        b[198] = self.root_level;
        b[199] = self.chunk_root_level;
        b[200] = self.log_root_level;
        b[201..201 + DevItem::SIZE].copy_from_slice(&self.dev_item.to_bytes());
        let label_field = &mut b[299..299 + LABEL_SIZE];
        let end = label_field
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(LABEL_SIZE);
        if String::from_utf8_lossy(&label_field[..end]) != self.label.as_str() {
            label_field.fill(0);
            let label = self.label.as_bytes();
            let n = label.len().min(LABEL_SIZE - 1);
            label_field[..n].copy_from_slice(&label[..n]);
        }
        put_u64(&mut b, 555, self.cache_generation);
        put_u64(&mut b, 563, self.uuid_tree_generation);
        b[571..587].copy_from_slice(&self.metadata_uuid);
        put_u64(&mut b, 587, self.nr_global_roots);
        b[811..811 + SYSTEM_CHUNK_ARRAY_SIZE].fill(0);
        b[811..811 + arr_len].copy_from_slice(&self.sys_chunk_array[..arr_len]);
        for (i, r) in self.backup_roots.iter().enumerate() {
            let off = 2859 + i * BackupRoot::SIZE;
            b[off..off + BackupRoot::SIZE].copy_from_slice(&r.to_bytes());
        }
        b[..32].fill(0);
        let c = self.csum_type.compute(&b[32..]);
        let n = self.csum_type.size();
        b[..n].copy_from_slice(&c[..n]);
        b
    }
}

#[cfg(test)]
mod encode_tests {
    use super::*;
    use crate::format::compress::oracle;

    /// Every superblock copy mkfs.btrfs writes re-encodes to the same bytes (apart from stale
    /// bytes past the sys_chunk_array), for each checksum type and with a label.
    #[test]
    fn mkfs_superblocks_reencode_identically() {
        if !oracle::mkfs_available() {
            return;
        }
        let scratch = oracle::Scratch::new("sb-encode");
        for (i, extra) in [
            &["--csum", "crc32c"][..],
            &["--csum", "xxhash", "-L", "a label"][..],
            &["--csum", "sha256", "-R", "^free-space-tree"][..],
            &["--csum", "blake2", "-n", "4096", "-m", "single"][..],
        ]
        .into_iter()
        .enumerate()
        {
            let img = scratch.image(&format!("{i}.img"), 300 << 20);
            oracle::mkfs(&img, extra);
            let bytes = std::fs::read(&img).unwrap();
            for mirror in 0..2 {
                let off = super_offset(mirror) as usize;
                let raw = &bytes[off..off + SUPER_INFO_SIZE];
                let sb = Superblock::parse(raw, off as u64).unwrap();
                // mkfs.btrfs leaves stale bytes past the end of the sys_chunk_array (from the
                // temporary chunks it removed); the encoder writes zeros there.
                let mut want = raw.to_vec();
                want[811 + sb.sys_chunk_array.len()..811 + SYSTEM_CHUNK_ARRAY_SIZE].fill(0);
                let c = sb.csum_type.compute(&want[32..]);
                want[..32].copy_from_slice(&c);
                let enc = sb.to_bytes();
                let diff: Vec<usize> = (0..SUPER_INFO_SIZE)
                    .filter(|&i| enc[i] != want[i])
                    .collect();
                assert!(
                    diff.is_empty(),
                    "{extra:?} mirror {mirror}: bytes differ at {diff:?}"
                );
            }
            std::fs::remove_file(&img).unwrap();
        }
    }
}
