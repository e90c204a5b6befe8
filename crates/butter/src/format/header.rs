//! The 101-byte tree block header and the item/pointer arrays that follow it.
//!
//! Leaf: header, then `nritems` 25-byte item records (key, le32 data offset relative to the end
//! of the header, le32 size), item data packed from the end of the block backwards.
//! Node: header, then `nritems` 33-byte key pointers (key, le64 blockptr, le64 generation).

use super::*;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Header {
    pub csum: [u8; 32],
    pub fsid: [u8; 16],
    pub bytenr: u64,
    /// Low 56 bits of the flags field.
    pub flags: u64,
    /// Top byte of the flags field (backref revision).
    pub backref_rev: u8,
    pub chunk_tree_uuid: [u8; 16],
    pub generation: u64,
    pub owner: u64,
    pub nritems: u32,
    pub level: u8,
}

impl Header {
    /// Decodes a header; the caller guarantees `b.len() >= HEADER_SIZE`.
    pub(crate) fn parse(b: &[u8]) -> Header {
        let mut csum = [0u8; 32];
        csum.copy_from_slice(&b[0..32]);
        let raw_flags = le_u64(b, 56);
        Header {
            csum,
            fsid: uuid_at(b, 32),
            bytenr: le_u64(b, 48),
            flags: raw_flags & ((1u64 << 56) - 1),
            backref_rev: (raw_flags >> 56) as u8,
            chunk_tree_uuid: uuid_at(b, 64),
            generation: le_u64(b, 80),
            owner: le_u64(b, 88),
            nritems: le_u32(b, 96),
            level: b[100],
        }
    }
}

/// A leaf item record (the 25-byte entry, not its data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ItemHeader {
    pub key: Key,
    /// Data offset relative to the end of the block header.
    pub offset: u32,
    pub size: u32,
}

impl ItemHeader {
    pub(crate) fn parse(b: &[u8]) -> ItemHeader {
        ItemHeader {
            key: Key::from_bytes(&b[0..17]),
            offset: le_u32(b, 17),
            size: le_u32(b, 21),
        }
    }
}

/// A node's key pointer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyPtr {
    pub key: Key,
    pub blockptr: u64,
    pub generation: u64,
}

impl KeyPtr {
    pub(crate) fn parse(b: &[u8]) -> KeyPtr {
        KeyPtr {
            key: Key::from_bytes(&b[0..17]),
            blockptr: le_u64(b, 17),
            generation: le_u64(b, 25),
        }
    }
}
