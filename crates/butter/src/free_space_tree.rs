//! Free space tree codec (placeholder until the full codec with bitmap conversion lands):
//! encodes a block group's free space as FREE_SPACE_INFO + FREE_SPACE_EXTENT items.

use crate::format::*;

pub struct BgFreeSpace {
    pub start: u64,
    pub len: u64,
    pub extents: Vec<(u64, u64)>,
}

/// Items for one block group, in key order: (uses bitmaps, items).
pub fn encode(
    fs: &BgFreeSpace,
    _sectorsize: u32,
    _currently_bitmaps: bool,
) -> (bool, Vec<(Key, Vec<u8>)>) {
    let mut out = Vec::with_capacity(fs.extents.len() + 1);
    let mut info = Vec::with_capacity(8);
    info.extend_from_slice(&(fs.extents.len() as u32).to_le_bytes());
    info.extend_from_slice(&0u32.to_le_bytes());
    out.push((Key::new(fs.start, FREE_SPACE_INFO_KEY, fs.len), info));
    for (s, l) in &fs.extents {
        out.push((Key::new(*s, FREE_SPACE_EXTENT_KEY, *l), Vec::new()));
    }
    (false, out)
}
