//! Encoders: the items the write engine stores, the inverse of the decoders in
//! [`super::items`] (round trips are tested below).

use super::items::*;
use super::*;

fn put_u16(b: &mut Vec<u8>, v: u16) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut Vec<u8>, v: u32) {
    b.extend_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut Vec<u8>, v: u64) {
    b.extend_from_slice(&v.to_le_bytes());
}

impl DirItem {
    /// Appends one entry (dir item, dir index or xattr) to `b`.
    pub(crate) fn write(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&self.location.to_bytes());
        put_u64(b, self.transid);
        put_u16(b, self.data.len() as u16);
        put_u16(b, self.name.len() as u16);
        b.push(self.file_type);
        b.extend_from_slice(&self.name);
        b.extend_from_slice(&self.data);
    }
}

impl InodeRef {
    pub(crate) fn write(&self, b: &mut Vec<u8>) {
        put_u64(b, self.index);
        put_u16(b, self.name.len() as u16);
        b.extend_from_slice(&self.name);
    }
    pub(crate) fn encoded_len(&self) -> usize {
        10 + self.name.len()
    }
}

impl InodeExtref {
    pub(crate) fn write(&self, b: &mut Vec<u8>) {
        put_u64(b, self.parent);
        put_u64(b, self.index);
        put_u16(b, self.name.len() as u16);
        b.extend_from_slice(&self.name);
    }
}

impl BackRef {
    /// The inline type byte.
    pub(crate) fn type_key(&self) -> u8 {
        match self {
            BackRef::TreeBlock { .. } => TREE_BLOCK_REF_KEY,
            BackRef::SharedBlock { .. } => SHARED_BLOCK_REF_KEY,
            BackRef::ExtentData { .. } => EXTENT_DATA_REF_KEY,
            BackRef::SharedData { .. } => SHARED_DATA_REF_KEY,
            BackRef::Owner { .. } => EXTENT_OWNER_REF_KEY,
        }
    }
    /// The offset this reference has as a keyed item (and its order among inline refs).
    pub(crate) fn key_offset(&self) -> u64 {
        match self {
            BackRef::TreeBlock { root } => *root,
            BackRef::SharedBlock { parent } => *parent,
            BackRef::ExtentData {
                root,
                objectid,
                offset,
                ..
            } => hash::extent_data_ref_hash(*root, *objectid, *offset),
            BackRef::SharedData { parent, .. } => *parent,
            BackRef::Owner { root } => *root,
        }
    }
    /// Size inline (type byte included).
    pub(crate) fn inline_len(&self) -> usize {
        1 + match self {
            BackRef::ExtentData { .. } => 28,
            BackRef::SharedData { .. } => 12,
            _ => 8,
        }
    }
    /// Body without the type byte (inline), or the keyed item's body.
    pub(crate) fn write_body(&self, b: &mut Vec<u8>) {
        match self {
            BackRef::TreeBlock { root } | BackRef::Owner { root } => put_u64(b, *root),
            BackRef::SharedBlock { parent } => put_u64(b, *parent),
            BackRef::ExtentData {
                root,
                objectid,
                offset,
                count,
            } => {
                put_u64(b, *root);
                put_u64(b, *objectid);
                put_u64(b, *offset);
                put_u32(b, *count);
            }
            BackRef::SharedData { parent, count } => {
                put_u64(b, *parent);
                put_u32(b, *count);
            }
        }
    }
    /// Body of the keyed item form (TREE_BLOCK_REF and SHARED_BLOCK_REF items are empty;
    /// SHARED_DATA_REF holds only the count).
    pub(crate) fn keyed_body(&self) -> Vec<u8> {
        let mut b = Vec::new();
        match self {
            BackRef::TreeBlock { .. } | BackRef::SharedBlock { .. } | BackRef::Owner { .. } => {}
            BackRef::ExtentData { .. } => self.write_body(&mut b),
            BackRef::SharedData { count, .. } => put_u32(&mut b, *count),
        }
        b
    }
}

/// Patches the fields of a ROOT_ITEM body the write engine changes.
pub(crate) fn patch_root_item(b: &mut [u8], bytenr: u64, level: u8, generation: u64) {
    b[160..168].copy_from_slice(&generation.to_le_bytes());
    b[176..184].copy_from_slice(&bytenr.to_le_bytes());
    b[238] = level;
    if b.len() >= RootItem::SIZE {
        b[239..247].copy_from_slice(&generation.to_le_bytes());
    }
}

/// Patches a subvolume's ROOT_ITEM body for a commit that changed the subvolume: its
/// `ctransid` (the transid of its last change), in the extended root item only.
pub(crate) fn patch_root_ctransid(b: &mut [u8], transid: u64) {
    if b.len() >= RootItem::SIZE {
        b[295..303].copy_from_slice(&transid.to_le_bytes());
    }
}

/// The `flags` of a QGROUP_STATUS item body (`None` when it is too short to hold them).
pub(crate) fn qgroup_status_flags(b: &[u8]) -> Option<u64> {
    (b.len() >= 32).then(|| le_u64(b, 16))
}

/// Patches a QGROUP_STATUS item body: its `generation` and `flags` (the body has at least
/// 32 bytes: version, generation, flags, rescan progress).
pub(crate) fn patch_qgroup_status(b: &mut [u8], generation: u64, flags: u64) {
    b[8..16].copy_from_slice(&generation.to_le_bytes());
    b[16..24].copy_from_slice(&flags.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let i = InodeItem {
            generation: 1,
            transid: 2,
            size: 3,
            nbytes: 4,
            block_group: 0,
            nlink: 5,
            uid: 6,
            gid: 7,
            mode: 0o100644,
            rdev: 8,
            flags: 9,
            sequence: 10,
            atime: Timespec { sec: -1, nsec: 5 },
            ctime: Timespec { sec: 11, nsec: 12 },
            mtime: Timespec { sec: 13, nsec: 14 },
            otime: Timespec { sec: 15, nsec: 16 },
        };
        let b = i.to_bytes();
        assert_eq!(b.len(), InodeItem::SIZE);
        assert_eq!(InodeItem::parse(&b).unwrap(), i);

        let d = DirItem {
            location: Key::new(257, INODE_ITEM_KEY, 0),
            transid: 7,
            file_type: FT_REG_FILE,
            name: b"hello".to_vec(),
            data: vec![],
        };
        let mut b = d.to_bytes();
        let x = DirItem {
            name: b"user.x".to_vec(),
            data: b"value".to_vec(),
            ..d.clone()
        };
        x.write(&mut b);
        assert_eq!(DirItem::parse_all(&b).unwrap(), vec![d, x]);

        let fe = FileExtentItem {
            generation: 3,
            ram_bytes: 8192,
            compression: 0,
            encryption: 0,
            other_encoding: 0,
            ty: FILE_EXTENT_REG,
            body: FileExtentBody::Extent {
                disk_bytenr: 1 << 20,
                disk_num_bytes: 8192,
                offset: 0,
                num_bytes: 8192,
            },
        };
        assert_eq!(FileExtentItem::parse(&fe.to_bytes()).unwrap(), fe);

        let e = ExtentItem {
            refs: 3,
            generation: 9,
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
                    parent: 1 << 20,
                    count: 1,
                },
            ],
        };
        assert_eq!(
            ExtentItem::parse(&e.to_bytes(), EXTENT_ITEM_KEY).unwrap(),
            e
        );
        let c = ChunkItem {
            length: 1 << 30,
            owner: 2,
            stripe_len: 65536,
            ty: BLOCK_GROUP_DATA,
            io_align: 65536,
            io_width: 65536,
            sector_size: 4096,
            num_stripes: 1,
            sub_stripes: 1,
            stripes: vec![Stripe {
                devid: 1,
                offset: 1 << 20,
                dev_uuid: [7; 16],
            }],
        };
        assert_eq!(ChunkItem::parse(&c.to_bytes()).unwrap().0, c);
    }
}
