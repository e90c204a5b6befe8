//! Logical-to-physical mapping through chunks.
//!
//! The superblock's sys_chunk_array holds the SYSTEM chunks needed to read the chunk tree; the
//! chunk tree then gives every chunk. A chunk maps `[logical, logical + length)` onto one or more
//! device stripes. SINGLE: one copy. DUP: two copies on the same device. RAID1/RAID1C3/RAID1C4:
//! copies on (possibly) different devices. Striped profiles (RAID0/10/5/6) are not supported yet.

use crate::error::{Error, Location, Result};
use crate::format::items::ChunkItem;
use crate::format::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
pub(crate) struct Chunk {
    pub logical: u64,
    pub item: ChunkItem,
}

/// One physical copy of a logical range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PhysCopy {
    pub devid: u64,
    pub physical: u64,
}

#[derive(Debug, Clone, Default)]
pub(crate) struct ChunkMap {
    chunks: BTreeMap<u64, Chunk>,
}

impl ChunkMap {
    /// Decodes the superblock's sys_chunk_array (pairs of disk key + chunk item).
    pub(crate) fn from_sys_chunk_array(arr: &[u8]) -> Result<ChunkMap> {
        let mut map = ChunkMap::default();
        let mut off = 0usize;
        while off < arr.len() {
            let at = off;
            let loc = || Location::what(format!("sys_chunk_array byte {at}"));
            if arr.len() - off < DISK_KEY_SIZE {
                return Err(Error::corrupt(loc(), "truncated key"));
            }
            let key = Key::from_bytes(&arr[off..off + DISK_KEY_SIZE]);
            if key.ty != CHUNK_ITEM_KEY {
                return Err(Error::corrupt(
                    loc().with_key(key),
                    "entry is not a CHUNK_ITEM",
                ));
            }
            off += DISK_KEY_SIZE;
            let (item, used) = ChunkItem::parse(&arr[off..]).map_err(|e| match e {
                Error::Corrupt { reason, .. } => Error::corrupt(loc().with_key(key), reason),
                e => e,
            })?;
            off += used;
            map.insert(key.offset, item)
                .map_err(|r| Error::corrupt(loc().with_key(key), r))?;
        }
        Ok(map)
    }

    /// Adds a chunk after checking it. Returns a reason on failure.
    pub(crate) fn insert(
        &mut self,
        logical: u64,
        item: ChunkItem,
    ) -> std::result::Result<(), String> {
        if item.length == 0 {
            return Err("chunk length 0".into());
        }
        let end = logical
            .checked_add(item.length)
            .ok_or("chunk end overflows")?;
        let profile = item.ty & BLOCK_GROUP_PROFILE_MASK;
        let want_stripes_min = match profile {
            0 => 1,
            BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 => 2,
            BLOCK_GROUP_RAID1C3 => 3,
            BLOCK_GROUP_RAID1C4 => 4,
            _ => 1,
        };
        if (item.num_stripes as usize) < want_stripes_min {
            return Err(format!(
                "profile {profile:#x} with {} stripes",
                item.num_stripes
            ));
        }
        for (i, s) in item.stripes.iter().enumerate() {
            if s.offset.checked_add(item.length).is_none() {
                return Err(format!(
                    "stripe {i} physical offset {} + length {} overflows",
                    s.offset, item.length
                ));
            }
        }
        if let Some((&s, c)) = self.chunks.range(..end).next_back() {
            if s == logical && c.item == item {
                return Ok(()); // the same chunk from sys_chunk_array and the chunk tree
            }
            if s + c.item.length > logical {
                return Err(format!("chunk [{logical}, {end}) overlaps chunk at {s}"));
            }
        }
        self.chunks.insert(logical, Chunk { logical, item });
        Ok(())
    }

    pub(crate) fn chunks(&self) -> impl Iterator<Item = &Chunk> {
        self.chunks.values()
    }

    /// The chunk containing `logical`.
    pub(crate) fn lookup(&self, logical: u64) -> Option<&Chunk> {
        let (_, c) = self.chunks.range(..=logical).next_back()?;
        (logical < c.logical + c.item.length).then_some(c)
    }

    /// Every physical copy of `[logical, logical + len)`. The range must lie in one chunk.
    pub(crate) fn map(&self, logical: u64, len: u64) -> Result<Vec<PhysCopy>> {
        let loc = || Location::what(format!("logical {logical} length {len}"));
        let c = self
            .lookup(logical)
            .ok_or_else(|| Error::corrupt(loc(), "no chunk maps this address"))?;
        let off = logical - c.logical;
        if len > c.item.length - off {
            return Err(Error::corrupt(
                loc(),
                format!("range crosses the end of chunk {}", c.logical),
            ));
        }
        let profile = c.item.ty & BLOCK_GROUP_PROFILE_MASK;
        match profile {
            0 | BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID1C4 => {
                Ok(c.item
                    .stripes
                    .iter()
                    .map(|s| PhysCopy {
                        devid: s.devid,
                        physical: s.offset + off,
                    })
                    .collect())
            }
            p => Err(Error::Unsupported(format!(
                "chunk at {} uses striped profile {p:#x} (RAID0/10/5/6): not supported yet",
                c.logical
            ))),
        }
    }
}
