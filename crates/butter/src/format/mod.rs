//! The btrfs on-disk format: keys, superblock, tree block header, items, checksums, name
//! hashes and compression codecs. Pure: no I/O.
//!
//! Decoders here take byte slices read from disk and never trust them: every length is checked
//! before a field is read, and a short or inconsistent record is a [`crate::Error::Corrupt`].

pub mod compress;
pub mod consts;
pub mod csum;
pub mod encode;
pub mod features;
pub mod hash;
pub mod header;
pub mod items;
pub mod key;
pub mod print;
pub mod send_stream;
pub mod superblock;

pub(crate) use crate::ids::tree_name;
pub use consts::*;
pub(crate) use key::key_type_name;
pub(crate) use key::objectid_name;
pub use key::Key;

/// Little-endian u16 at `off`. The caller has checked `off + 2 <= b.len()`.
#[inline]
pub(crate) fn le_u16(b: &[u8], off: usize) -> u16 {
    let mut a = [0u8; 2];
    a.copy_from_slice(&b[off..off + 2]);
    u16::from_le_bytes(a)
}
/// Little-endian u32 at `off`. The caller has checked the length.
#[inline]
pub(crate) fn le_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
/// Little-endian u64 at `off`. The caller has checked the length.
#[inline]
pub(crate) fn le_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}
/// 16 bytes at `off` (uuids). The caller has checked the length.
#[inline]
pub(crate) fn uuid_at(b: &[u8], off: usize) -> [u8; 16] {
    let mut a = [0u8; 16];
    a.copy_from_slice(&b[off..off + 16]);
    a
}

/// Formats a uuid the usual 8-4-4-4-12 way.
pub fn fmt_uuid(u: &[u8; 16]) -> String {
    let h: Vec<String> = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        h[0..4].concat(),
        h[4..6].concat(),
        h[6..8].concat(),
        h[8..10].concat(),
        h[10..16].concat()
    )
}
