//! The volume layer: the devices of a filesystem and the chunk map from logical addresses to
//! places on them.
//!
//! [`Devices`] is the set of devices the filesystem was opened with, keyed by devid, with the
//! ones its chunk tree names but nobody gave (a degraded open) kept as missing; devices
//! added or removed while open join or leave it once their change is committed.
//!
//! The superblock's sys_chunk_array holds the SYSTEM chunks needed to read the chunk tree; the
//! chunk tree then gives every chunk. A chunk maps `[logical, logical + length)` onto device
//! stripes by its profile:
//! - SINGLE: one copy. DUP: two copies on one device. RAID1, RAID1C3, RAID1C4: a copy on each
//!   of 2, 3 or 4 devices.
//! - RAID0: the range cut in `stripe_len` pieces (64 KiB), dealt round the stripes.
//! - RAID10: the same over pairs (`sub_stripes`) of mirrored stripes.
//! - RAID5, RAID6: pieces dealt round `num_stripes - 1` (or `- 2`) stripes per full stripe,
//!   with P (and Q) on the rest, the parity moving one stripe on with each full stripe.
//!
//! [`ChunkMap::segments`] cuts a logical range into the pieces that live in one place each,
//! with every copy of each and, for RAID5/6, the full stripe to rebuild it from.

use crate::error::{Error, Location, Result};
use crate::format::items::ChunkItem;
use crate::format::*;
use crate::io::device::BlockDevice;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

/// One device of an open filesystem.
#[derive(Clone)]
pub(crate) struct Member {
    pub(crate) devid: u64,
    /// The device's UUID (its superblock's `dev_item.uuid`, the chunk tree's DEV_ITEM).
    pub(crate) uuid: [u8; 16],
    /// How the user named it (a path), for messages.
    pub(crate) name: String,
    /// `None`: the chunk tree names this device but it was not given (degraded).
    pub(crate) dev: Option<Arc<dyn BlockDevice>>,
    /// The device failed a write or a flush while open: it is treated as missing from then
    /// on (the filesystem goes on degraded where the profiles allow, as the kernel's does).
    pub(crate) failed: Arc<std::sync::atomic::AtomicBool>,
}

/// The devices of an open filesystem, by devid. The set can change while open (a device
/// added or removed through a mount): readers take what they need as owned handles, so a
/// change never pulls a device from under a read in flight.
#[derive(Default)]
pub(crate) struct Devices {
    members: RwLock<BTreeMap<u64, Member>>,
    /// The device the superblock in use was read from (the image named first); another
    /// present device takes over when it is removed.
    primary: AtomicU64,
}

impl Clone for Devices {
    fn clone(&self) -> Devices {
        Devices {
            members: RwLock::new(self.read().clone()),
            primary: AtomicU64::new(self.primary_devid()),
        }
    }
}

impl Devices {
    /// A set of one device (every single-device filesystem).
    pub(crate) fn single(
        devid: u64,
        uuid: [u8; 16],
        name: String,
        dev: Arc<dyn BlockDevice>,
    ) -> Devices {
        let d = Devices {
            members: RwLock::new(BTreeMap::new()),
            primary: AtomicU64::new(devid),
        };
        d.insert(Member {
            devid,
            uuid,
            name,
            dev: Some(dev),
            failed: Default::default(),
        });
        d
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u64, Member>> {
        self.members.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a device (at open, or one added to the open filesystem once its item is
    /// committed); the caller has checked that its devid is new.
    pub(crate) fn insert(&self, m: Member) {
        self.members
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(m.devid, m);
    }

    /// Forgets device `devid` (removed from the filesystem, its removal committed). The
    /// primary role passes to the lowest present device when it was the primary.
    pub(crate) fn forget(&self, devid: u64) {
        let mut map = self.members.write().unwrap_or_else(|e| e.into_inner());
        map.remove(&devid);
        if self.primary.load(Ordering::Relaxed) == devid {
            if let Some(m) = map.values().find(|m| m.dev.is_some() && !m.is_failed()) {
                self.primary.store(m.devid, Ordering::Relaxed);
            }
        }
    }

    /// The device the superblock in use came from.
    pub(crate) fn primary(&self) -> Arc<dyn BlockDevice> {
        match self
            .read()
            .get(&self.primary_devid())
            .and_then(|m| m.dev.clone())
        {
            Some(d) => d,
            None => unreachable!("the primary device is always present"),
        }
    }

    pub(crate) fn primary_devid(&self) -> u64 {
        self.primary.load(Ordering::Relaxed)
    }

    /// Makes device `devid` (present) the primary: the one the filesystem is opened by from
    /// now on, before the old primary is removed.
    pub(crate) fn set_primary(&self, devid: u64) {
        self.primary.store(devid, Ordering::Relaxed);
    }

    /// Drops device `devid` from the writes (removed from the filesystem): treated as
    /// missing from now on, without the warning of a failure.
    pub(crate) fn mark_removed(&self, devid: u64) {
        if let Some(m) = self.read().get(&devid) {
            m.failed.store(true, Ordering::Relaxed);
        }
    }

    /// The present device `devid`, if it is one.
    pub(crate) fn get(&self, devid: u64) -> Option<Arc<dyn BlockDevice>> {
        let map = self.read();
        let m = map.get(&devid)?;
        if m.is_failed() {
            return None;
        }
        m.dev.clone()
    }

    /// Marks device `devid` failed (see [`Member::failed`]): from now on it is missing.
    pub(crate) fn mark_failed(&self, devid: u64, why: &str) {
        if let Some(m) = self.read().get(&devid) {
            if !m.failed.swap(true, Ordering::Relaxed) {
                log::error!(
                    "device {devid} ({}) failed: {why}; going on without it (degraded)",
                    m.name
                );
            }
        }
    }

    /// Runs `f` on every working device. A device whose `f` fails is dropped (marked failed)
    /// on a filesystem of several devices, and the whole succeeds while one device did (the
    /// kernel's rule for superblocks and flushes); on one device, or when every device
    /// failed, the first error is returned.
    pub(crate) fn on_each<E: std::fmt::Display>(
        &self,
        mut f: impl FnMut(u64, &Arc<dyn BlockDevice>) -> std::result::Result<(), E>,
    ) -> std::result::Result<(), E> {
        let members = self.members();
        let mut ok = 0;
        let mut first_err = None;
        for m in &members {
            let Some(dev) = self.get(m.devid) else {
                continue;
            };
            match f(m.devid, &dev) {
                Ok(()) => ok += 1,
                Err(e) => {
                    if members.len() > 1 {
                        self.mark_failed(m.devid, &e.to_string());
                    }
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) if ok == 0 || members.len() == 1 => Err(e),
            _ => Ok(()),
        }
    }

    /// How many devices are present and working.
    pub(crate) fn working(&self) -> usize {
        self.read()
            .values()
            .filter(|m| m.dev.is_some() && !m.is_failed())
            .count()
    }

    pub(crate) fn member(&self, devid: u64) -> Option<Member> {
        self.read().get(&devid).cloned()
    }

    /// Every device, present or missing, by devid (as the set is now).
    pub(crate) fn members(&self) -> Vec<Member> {
        self.read().values().cloned().collect()
    }

    pub(crate) fn len(&self) -> usize {
        self.read().len()
    }
}

impl Member {
    fn is_failed(&self) -> bool {
        self.failed.load(Ordering::Relaxed)
    }
}

/// One piece of a logical range that lives in one place per copy (see
/// [`ChunkMap::segments`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Segment {
    pub logical: u64,
    pub len: u64,
    /// Every copy of the piece (one for SINGLE, RAID0, RAID5 and RAID6).
    pub copies: Vec<PhysCopy>,
    /// RAID5/6: the same byte range of every stripe of the piece's full stripe, to rebuild it.
    pub parity: Option<FullStripe>,
}

/// The blocks of a RAID5/6 full stripe that sit beside one piece: data blocks in logical
/// order, then P, then Q.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FullStripe {
    pub blocks: Vec<PhysCopy>,
    /// Which of `blocks` is the piece's own.
    pub data_index: usize,
    pub nparity: usize,
}

/// How many stripes a profile's chunk with `num_stripes` stripes keeps for parity.
pub(crate) fn nparity(profile: u64) -> usize {
    match profile {
        BLOCK_GROUP_RAID5 => 1,
        BLOCK_GROUP_RAID6 => 2,
        _ => 0,
    }
}

/// The profile's name as btrfs prints it.
pub(crate) fn profile_name(ty: u64) -> &'static str {
    match ty & BLOCK_GROUP_PROFILE_MASK {
        0 => "single",
        BLOCK_GROUP_DUP => "DUP",
        BLOCK_GROUP_RAID0 => "RAID0",
        BLOCK_GROUP_RAID1 => "RAID1",
        BLOCK_GROUP_RAID1C3 => "RAID1C3",
        BLOCK_GROUP_RAID1C4 => "RAID1C4",
        BLOCK_GROUP_RAID10 => "RAID10",
        BLOCK_GROUP_RAID5 => "RAID5",
        BLOCK_GROUP_RAID6 => "RAID6",
        _ => "mixed profiles",
    }
}

/// What a profile asks of the devices a new chunk goes on (the kernel's table of RAID
/// attributes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RaidAttr {
    /// Fewest devices a chunk may use.
    pub devs_min: usize,
    /// Most devices a chunk may use (0: no limit).
    pub devs_max: usize,
    /// The number of devices used is a multiple of this.
    pub devs_increment: usize,
    /// Stripes per device (DUP: 2).
    pub dev_stripes: usize,
    /// Copies of each byte.
    pub ncopies: usize,
    pub nparity: usize,
    /// RAID10's mirrored pairs.
    pub sub_stripes: usize,
}

pub(crate) fn raid_attr(profile: u64) -> RaidAttr {
    let a =
        |devs_min, devs_max, devs_increment, dev_stripes, ncopies, nparity, sub_stripes| RaidAttr {
            devs_min,
            devs_max,
            devs_increment,
            dev_stripes,
            ncopies,
            nparity,
            sub_stripes,
        };
    match profile & BLOCK_GROUP_PROFILE_MASK {
        BLOCK_GROUP_RAID10 => a(2, 0, 2, 1, 2, 0, 2),
        BLOCK_GROUP_RAID1 => a(2, 2, 2, 1, 2, 0, 1),
        BLOCK_GROUP_RAID1C3 => a(3, 3, 3, 1, 3, 0, 1),
        BLOCK_GROUP_RAID1C4 => a(4, 4, 4, 1, 4, 0, 1),
        BLOCK_GROUP_DUP => a(1, 1, 1, 2, 2, 0, 1),
        BLOCK_GROUP_RAID0 => a(1, 0, 1, 1, 1, 0, 1),
        BLOCK_GROUP_RAID5 => a(2, 0, 1, 1, 1, 1, 1),
        BLOCK_GROUP_RAID6 => a(3, 0, 1, 1, 1, 2, 1),
        _ => a(1, 1, 1, 1, 1, 0, 1),
    }
}

/// How many stripes' worth of logical bytes a chunk of `num_stripes` stripes holds: its
/// length is this times the length of each stripe (a dev extent).
pub(crate) fn data_stripes(profile: u64, num_stripes: usize) -> usize {
    let a = raid_attr(profile);
    match profile & BLOCK_GROUP_PROFILE_MASK {
        BLOCK_GROUP_RAID0 => num_stripes,
        BLOCK_GROUP_RAID10 => num_stripes / 2,
        BLOCK_GROUP_RAID5 | BLOCK_GROUP_RAID6 => num_stripes.saturating_sub(a.nparity),
        _ => 1,
    }
    .max(1)
}

/// The length of each stripe (its dev extent) of a chunk.
pub(crate) fn stripe_size(item: &ChunkItem) -> u64 {
    item.length / data_stripes(item.ty, item.num_stripes as usize) as u64
}

/// The logical ranges of a chunk starting at `logical` that a physical byte range of stripe
/// `idx` holds or protects, whole `stripe_len` units (the kernel's reverse map): for a
/// parity unit of RAID5/6, the whole full stripe it protects.
pub(crate) fn logical_ranges_of(
    item: &ChunkItem,
    logical: u64,
    idx: usize,
    phys: u64,
    len: u64,
) -> Vec<(u64, u64)> {
    let Some(st) = item.stripes.get(idx) else {
        return Vec::new();
    };
    let size = stripe_size(item);
    let (lo, hi) = (phys.max(st.offset), (phys + len).min(st.offset + size));
    if lo >= hi {
        return Vec::new();
    }
    let profile = item.ty & BLOCK_GROUP_PROFILE_MASK;
    let sl = item.stripe_len.max(1);
    let n = item.stripes.len() as u64;
    let mut out = Vec::new();
    let first = (lo - st.offset) / sl;
    let last = (hi - 1 - st.offset) / sl;
    for unit in first..=last {
        let (s, span) = match profile {
            BLOCK_GROUP_RAID0 => (unit * n + idx as u64, 1),
            BLOCK_GROUP_RAID10 => {
                let sub = (item.sub_stripes as u64).max(1);
                (unit * (n / sub) + idx as u64 / sub, 1)
            }
            BLOCK_GROUP_RAID5 | BLOCK_GROUP_RAID6 => {
                let nd = n - nparity(profile) as u64;
                let j = (idx as u64 + n - unit % n) % n;
                if j < nd {
                    (unit * nd + j, 1)
                } else {
                    (unit * nd, nd)
                }
            }
            _ => {
                out.push((logical + unit * sl, sl));
                continue;
            }
        };
        out.push((logical + s * sl, span * sl));
    }
    out
}

/// How many of a chunk's stripes may be lost with every byte still readable.
pub(crate) fn tolerated_failures(profile: u64) -> usize {
    match profile {
        BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID10 | BLOCK_GROUP_RAID5 => 1,
        BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID6 => 2,
        BLOCK_GROUP_RAID1C4 => 3,
        _ => 0,
    }
}

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

    /// Takes the chunk at `logical` out of the map (a block group removed).
    pub(crate) fn remove(&mut self, logical: u64) -> Option<ChunkItem> {
        self.chunks.remove(&logical).map(|c| c.item)
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
        if profile.count_ones() > 1 {
            return Err(format!("chunk type {:#x} names several profiles", item.ty));
        }
        let want_stripes_min = match profile {
            BLOCK_GROUP_DUP | BLOCK_GROUP_RAID1 | BLOCK_GROUP_RAID10 | BLOCK_GROUP_RAID5 => 2,
            BLOCK_GROUP_RAID1C3 | BLOCK_GROUP_RAID6 => 3,
            BLOCK_GROUP_RAID1C4 => 4,
            _ => 1,
        };
        if (item.num_stripes as usize) < want_stripes_min
            || item.stripes.len() != item.num_stripes as usize
        {
            return Err(format!(
                "{} chunk with {} stripes",
                profile_name(profile),
                item.num_stripes
            ));
        }
        let striped = matches!(
            profile,
            BLOCK_GROUP_RAID0 | BLOCK_GROUP_RAID10 | BLOCK_GROUP_RAID5 | BLOCK_GROUP_RAID6
        );
        if striped && (item.stripe_len == 0 || !item.stripe_len.is_power_of_two()) {
            return Err(format!(
                "stripe length {} is not a power of two",
                item.stripe_len
            ));
        }
        if profile == BLOCK_GROUP_RAID10
            && (item.sub_stripes < 2 || !item.num_stripes.is_multiple_of(item.sub_stripes))
        {
            return Err(format!(
                "RAID10 chunk with {} stripes in groups of {}",
                item.num_stripes, item.sub_stripes
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
            // The same chunk from sys_chunk_array and the chunk tree. Fields that mean nothing
            // for its profile may differ (sub_stripes outside RAID10: old mkfs wrote 0 in one
            // and 1 in the other); the chunk tree's copy, inserted second, is kept.
            let same_map = |a: &ChunkItem, b: &ChunkItem| {
                a.length == b.length
                    && a.ty == b.ty
                    && a.stripe_len == b.stripe_len
                    && a.num_stripes == b.num_stripes
                    && (profile != BLOCK_GROUP_RAID10 || a.sub_stripes == b.sub_stripes)
                    && a.stripes.len() == b.stripes.len()
                    && a.stripes
                        .iter()
                        .zip(&b.stripes)
                        .all(|(x, y)| x.devid == y.devid && x.offset == y.offset)
            };
            if s == logical && same_map(&c.item, &item) {
                self.chunks.insert(logical, Chunk { logical, item });
                return Ok(());
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

    /// Every copy of `[logical, logical + len)`, a range in one piece (see
    /// [`ChunkMap::segments`]): for tests.
    #[cfg(any(test, feature = "internals"))]
    pub(crate) fn map(&self, logical: u64, len: u64) -> Result<Vec<PhysCopy>> {
        let segs = self.segments(logical, len)?;
        match segs.as_slice() {
            [one] => Ok(one.copies.clone()),
            _ => Err(Error::Invalid(format!(
                "logical {logical} length {len} spans several stripes"
            ))),
        }
    }

    /// Cuts `[logical, logical + len)`, which must lie in one chunk, into the pieces that lie
    /// in one place on each copy (see the module's description of the profiles).
    pub(crate) fn segments(&self, logical: u64, len: u64) -> Result<Vec<Segment>> {
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
        let item = &c.item;
        let profile = item.ty & BLOCK_GROUP_PROFILE_MASK;
        let at = |i: usize, phys: u64| PhysCopy {
            devid: item.stripes[i].devid,
            physical: item.stripes[i].offset + phys,
        };
        if !matches!(
            profile,
            BLOCK_GROUP_RAID0 | BLOCK_GROUP_RAID10 | BLOCK_GROUP_RAID5 | BLOCK_GROUP_RAID6
        ) {
            return Ok(vec![Segment {
                logical,
                len,
                copies: (0..item.stripes.len()).map(|i| at(i, off)).collect(),
                parity: None,
            }]);
        }
        let n = item.stripes.len() as u64;
        let sl = item.stripe_len;
        let mut out = Vec::new();
        let mut pos = off;
        let end = off + len;
        while pos < end {
            let s = pos / sl;
            let o = pos % sl;
            let piece = (sl - o).min(end - pos);
            let seg = |copies, parity| Segment {
                logical: c.logical + pos,
                len: piece,
                copies,
                parity,
            };
            out.push(match profile {
                BLOCK_GROUP_RAID0 => seg(vec![at((s % n) as usize, (s / n) * sl + o)], None),
                BLOCK_GROUP_RAID10 => {
                    let sub = item.sub_stripes as u64;
                    let groups = n / sub;
                    let first = (s % groups) * sub;
                    let phys = (s / groups) * sl + o;
                    seg(
                        (first..first + sub).map(|i| at(i as usize, phys)).collect(),
                        None,
                    )
                }
                _ => {
                    let np = nparity(profile) as u64;
                    let nd = n - np;
                    let full = s / nd;
                    let k = s % nd;
                    let rot = full % n;
                    let phys = full * sl + o;
                    let blocks: Vec<PhysCopy> =
                        (0..n).map(|j| at(((rot + j) % n) as usize, phys)).collect();
                    seg(
                        vec![blocks[k as usize]],
                        Some(FullStripe {
                            blocks,
                            data_index: k as usize,
                            nparity: np as usize,
                        }),
                    )
                }
            });
            pos += piece;
        }
        Ok(out)
    }
}

/// The chunks (their logical starts) with more stripes on missing devices than their profile
/// tolerates (see [`tolerated_failures`]; RAID10 counted as the kernel counts it, any two
/// stripes).
pub(crate) fn chunks_beyond_repair(map: &ChunkMap, devices: &Devices) -> Vec<u64> {
    map.chunks()
        .filter(|c| {
            let gone = c
                .item
                .stripes
                .iter()
                .filter(|s| devices.get(s.devid).is_none())
                .count();
            gone > tolerated_failures(c.item.ty & BLOCK_GROUP_PROFILE_MASK)
        })
        .map(|c| c.logical)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::items::Stripe;

    fn chunk(ty: u64, offsets: &[u64], length: u64) -> ChunkItem {
        ChunkItem {
            length,
            owner: 2,
            stripe_len: 65536,
            ty,
            io_align: 65536,
            io_width: 65536,
            sector_size: 4096,
            num_stripes: offsets.len() as u16,
            sub_stripes: 1,
            stripes: offsets
                .iter()
                .enumerate()
                .map(|(i, &o)| Stripe {
                    devid: i as u64 + 1,
                    offset: o,
                    dev_uuid: [0; 16],
                })
                .collect(),
        }
    }

    /// A superblock copy in a RAID6 chunk's data unit excludes that unit; in a parity unit,
    /// the whole full stripe it protects (as the kernel's reverse map gives it).
    #[test]
    fn reverse_map_of_a_raid6_chunk() {
        let c = chunk(
            BLOCK_GROUP_DATA | BLOCK_GROUP_RAID6,
            &[63963136, 42991616, 42991616, 42991616],
            128 << 20,
        );
        let at = |i| logical_ranges_of(&c, 0, i, 64 << 20, 4096);
        assert_eq!(at(0), vec![(96 * 65536, 65536)]);
        assert_eq!(at(1), vec![(737 * 65536, 65536)]);
        assert_eq!(at(2), vec![(736 * 65536, 2 * 65536)]);
        assert_eq!(at(3), vec![(736 * 65536, 2 * 65536)]);
    }
}
