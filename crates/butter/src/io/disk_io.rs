//! Validated tree block reads, a block cache, data reads through the chunk map, and readahead.
//!
//! Every tree block is checked once when it is read (the "tree checker"): checksum, bytenr,
//! fsid, level, generation and first key against the parent pointer, item and pointer counts,
//! item offsets and sizes inside the block and packed without overlap, keys strictly
//! increasing. A block that fails on one copy is read from the next copy (DUP, RAID1). Code
//! above this layer may therefore index items of a [`TreeBlock`] without re-checking bounds.
//!
//! Readahead (seed 004): [`Readahead`] modes say how a tree walk asks for blocks ahead of it.
//! `Forward` reads ahead leaves physically close to the current one, only when the current leaf
//! had to be read from disk; `ForwardAlways` reads ahead every remaining sibling, nodes too, even
//! when the current block was cached — for operations that visit a whole tree in key order.

use crate::error::{Error, Location, Result};
use crate::format::header::{Header, ItemHeader, KeyPtr};
use crate::format::superblock::Superblock;
use crate::format::*;
use crate::io::device::BlockDevice;
use crate::io::volumes::{ChunkMap, Devices, Member, PhysCopy, Segment};
use rustc_hash::FxHashMap as HashMap;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// How a tree walk reads ahead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum Readahead {
    #[default]
    None,
    Back,
    Forward,
    /// Whole-tree walks in key order (full send, restore): always read ahead, nodes too.
    ForwardAlways,
}

/// What the parent pointer (or superblock/root item) says about a block we are about to read.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Expect {
    pub owner: Option<u64>,
    pub level: Option<u8>,
    pub generation: Option<u64>,
    pub first_key: Option<Key>,
}

/// A tree block that passed validation (or that the write engine built).
#[derive(Debug, Clone)]
pub(crate) struct TreeBlock {
    pub bytenr: u64,
    pub header: Header,
    pub data: Box<[u8]>,
}

impl TreeBlock {
    /// Wraps a block the write engine built or changed (its header is re-read from `data`).
    pub(crate) fn from_parts(bytenr: u64, data: Box<[u8]>) -> TreeBlock {
        let header = Header::parse(&data);
        TreeBlock {
            bytenr,
            header,
            data,
        }
    }
    pub(crate) fn nritems(&self) -> usize {
        self.header.nritems as usize
    }
    pub(crate) fn level(&self) -> u8 {
        self.header.level
    }
    pub(crate) fn is_leaf(&self) -> bool {
        self.header.level == 0
    }
    pub(crate) fn owner(&self) -> u64 {
        self.header.owner
    }
    /// Leaf item record `slot` (slot < nritems, leaf only).
    pub(crate) fn item(&self, slot: usize) -> ItemHeader {
        let off = HEADER_SIZE + slot * ITEM_SIZE;
        ItemHeader::parse(&self.data[off..off + ITEM_SIZE])
    }
    /// Body of leaf item `slot` (validated to lie in the block).
    pub(crate) fn item_data(&self, slot: usize) -> &[u8] {
        let it = self.item(slot);
        let start = HEADER_SIZE + it.offset as usize;
        &self.data[start..start + it.size as usize]
    }
    /// Node pointer `slot` (node only).
    pub(crate) fn ptr(&self, slot: usize) -> KeyPtr {
        let off = HEADER_SIZE + slot * KEY_PTR_SIZE;
        KeyPtr::parse(&self.data[off..off + KEY_PTR_SIZE])
    }
    /// Key at `slot`, leaf or node.
    pub(crate) fn key(&self, slot: usize) -> Key {
        let off = HEADER_SIZE
            + slot
                * if self.is_leaf() {
                    ITEM_SIZE
                } else {
                    KEY_PTR_SIZE
                };
        Key::from_bytes(&self.data[off..off + DISK_KEY_SIZE])
    }
    /// Location of this block (and optionally a slot) for error messages.
    pub(crate) fn loc(&self, slot: Option<usize>) -> Location {
        let mut l = Location::block(Some(self.header.owner), self.bytenr);
        if let Some(s) = slot {
            l.slot = Some(s);
            if s < self.nritems() {
                l.key = Some(self.key(s));
            }
        }
        l
    }
    /// Free bytes in a leaf (between the item array and the item data).
    pub(crate) fn leaf_free_space(&self) -> usize {
        let n = self.nritems();
        let data_start = if n == 0 {
            self.data.len() - HEADER_SIZE
        } else {
            self.item(n - 1).offset as usize
        };
        data_start.saturating_sub(n * ITEM_SIZE)
    }
}

/// Checks a leaf's item array: `n` records fit, item data is packed from the end of the block
/// with no gap or overlap (item 0 ends at the block end, each next item ends where the previous
/// one starts) and clear of the item array, and keys strictly increase. Returns the first key.
/// `data` is the whole block; `loc(slot)` names the block for errors. Shared by the reader's
/// tree checker and the write-side primitives ([`crate::ctree::ops`]).
pub(crate) fn check_leaf_items(
    data: &[u8],
    n: usize,
    loc: &dyn Fn(Option<usize>) -> Location,
) -> Result<Option<Key>> {
    let space = data.len().saturating_sub(HEADER_SIZE);
    if n.checked_mul(ITEM_SIZE).is_none_or(|s| s > space) {
        return Err(Error::corrupt(
            loc(None),
            format!("leaf claims {n} items, more than fit"),
        ));
    }
    let mut prev_key: Option<Key> = None;
    let mut first_key = None;
    let mut expected_end = space;
    for slot in 0..n {
        let off = HEADER_SIZE + slot * ITEM_SIZE;
        let it = ItemHeader::parse(&data[off..off + ITEM_SIZE]);
        let l = || loc(Some(slot)).with_key(it.key);
        let start = it.offset as usize;
        if start.checked_add(it.size as usize) != Some(expected_end) {
            return Err(Error::corrupt(
                l(),
                format!(
                    "item data [{start}, +{}) should end at {expected_end} (items must be packed)",
                    it.size
                ),
            ));
        }
        if start < n * ITEM_SIZE {
            return Err(Error::corrupt(
                l(),
                format!("item data offset {start} overlaps the item array"),
            ));
        }
        expected_end = start;
        if let Some(why) = key_in_order(&mut prev_key, &mut first_key, it.key) {
            return Err(Error::corrupt(l(), why));
        }
    }
    Ok(first_key)
}

/// One more key of a block's items or pointers, in slot order: what is wrong when it is not
/// greater than the one before; the first key is kept.
fn key_in_order(prev: &mut Option<Key>, first: &mut Option<Key>, key: Key) -> Option<String> {
    if let Some(p) = *prev {
        if key <= p {
            return Some(format!("key not greater than previous key {p}"));
        }
    }
    first.get_or_insert(key);
    *prev = Some(key);
    None
}

/// Validates a raw block. Pure, so the fuzz target can drive it directly.
pub(crate) fn check_tree_block(
    data: &[u8],
    bytenr: u64,
    nodesize: u32,
    csum_type: crate::format::csum::CsumType,
    fsid: &[u8; 16],
    expect: &Expect,
) -> Result<Header> {
    let loc = |slot: Option<usize>| {
        let mut l = Location::block(expect.owner, bytenr);
        l.slot = slot;
        l
    };
    let h = check_block_header(data, bytenr, nodesize, csum_type, fsid, expect, &loc)?;
    let n = h.nritems as usize;
    let first_key = if h.level == 0 {
        check_leaf_items(data, n, &loc)?
    } else {
        check_node_ptrs(data, n, bytenr, nodesize, h.generation, &loc)?
    };
    check_parent_expectations(expect, &h, first_key, &loc)?;
    Ok(h)
}

/// Header phase of [`check_tree_block`]: the block's size, its checksum, then the header
/// fields that must match where it was read from (address, fsid, level bound) and what the
/// parent pointer promised (level, generation). Returns the parsed header.
fn check_block_header(
    data: &[u8],
    bytenr: u64,
    nodesize: u32,
    csum_type: crate::format::csum::CsumType,
    fsid: &[u8; 16],
    expect: &Expect,
    loc: &dyn Fn(Option<usize>) -> Location,
) -> Result<Header> {
    if data.len() != nodesize as usize || data.len() < HEADER_SIZE {
        return Err(Error::corrupt(
            loc(None),
            format!("block is {} bytes, nodesize {nodesize}", data.len()),
        ));
    }
    let computed = csum_type.compute(&data[CSUM_SIZE..]);
    let n = csum_type.size();
    if computed[..n] != data[..n] {
        return Err(Error::bad_csum(
            loc(None),
            format!(
                "{} stored {} computed {}",
                csum_type.name(),
                superblock::hex(&data[..n]),
                superblock::hex(&computed[..n])
            ),
        ));
    }
    let h = Header::parse(data);
    if h.bytenr != bytenr {
        return Err(Error::corrupt(
            loc(None),
            format!("header bytenr {} does not match its address", h.bytenr),
        ));
    }
    if &h.fsid != fsid {
        return Err(Error::corrupt(
            loc(None),
            format!("fsid {} is not this filesystem's", fmt_uuid(&h.fsid)),
        ));
    }
    if h.level >= MAX_LEVEL {
        return Err(Error::corrupt(
            loc(None),
            format!("level {} >= {MAX_LEVEL}", h.level),
        ));
    }
    if let Some(l) = expect.level {
        if h.level != l {
            return Err(Error::corrupt(
                loc(None),
                format!("level {} but parent expects {l}", h.level),
            ));
        }
    }
    if let Some(g) = expect.generation {
        if h.generation != g {
            return Err(Error::corrupt(
                loc(None),
                format!(
                    "generation {} but parent pointer says {g} (stale or misdirected write)",
                    h.generation
                ),
            ));
        }
    }
    Ok(h)
}

/// Node phase of [`check_tree_block`]: an internal node's `n` key pointers must fit the block,
/// point at aligned blocks other than this one (`bytenr`), be no newer than the node's own
/// generation (`generation`), and have strictly increasing keys. Returns the first key.
fn check_node_ptrs(
    data: &[u8],
    n: usize,
    bytenr: u64,
    nodesize: u32,
    generation: u64,
    loc: &dyn Fn(Option<usize>) -> Location,
) -> Result<Option<Key>> {
    let space = nodesize as usize - HEADER_SIZE;
    let mut first_key = None;
    if n == 0 {
        return Err(Error::corrupt(loc(None), "node with no pointers"));
    }
    if n.checked_mul(KEY_PTR_SIZE).is_none_or(|s| s > space) {
        return Err(Error::corrupt(
            loc(None),
            format!("node claims {n} pointers, more than fit"),
        ));
    }
    let mut prev_key: Option<Key> = None;
    for slot in 0..n {
        let off = HEADER_SIZE + slot * KEY_PTR_SIZE;
        let p = KeyPtr::parse(&data[off..off + KEY_PTR_SIZE]);
        let l = || loc(Some(slot)).with_key(p.key);
        if p.blockptr == 0 || !p.blockptr.is_multiple_of(4096) {
            return Err(Error::corrupt(
                l(),
                format!("child pointer {} is not block aligned", p.blockptr),
            ));
        }
        if p.blockptr == bytenr {
            return Err(Error::corrupt(l(), "node points to itself"));
        }
        if p.generation > generation {
            return Err(Error::corrupt(
                l(),
                format!(
                    "child generation {} newer than the node's {}",
                    p.generation, generation
                ),
            ));
        }
        if let Some(why) = key_in_order(&mut prev_key, &mut first_key, p.key) {
            return Err(Error::corrupt(l(), why));
        }
    }
    Ok(first_key)
}

/// Final phase of [`check_tree_block`]: the block's first key (from its items or pointers)
/// must be the one the parent pointer names, and its owner must fit the reader's tree.
fn check_parent_expectations(
    expect: &Expect,
    h: &Header,
    first_key: Option<Key>,
    loc: &dyn Fn(Option<usize>) -> Location,
) -> Result<()> {
    match (expect.first_key, first_key) {
        (Some(want), Some(got)) if want != got => {
            return Err(Error::corrupt(
                loc(Some(0)),
                format!("first key {got} but parent pointer says {want}"),
            ));
        }
        // Only a root may be an empty leaf: a parent pointer always names a first key.
        (Some(want), None) => {
            return Err(Error::corrupt(
                loc(None),
                format!("empty leaf but parent pointer says its first key is {want}"),
            ));
        }
        _ => {}
    }
    if let Some(m) = owner_mismatch(expect, h) {
        return Err(Error::corrupt(loc(None), m));
    }
    Ok(())
}

/// Why a block's owner does not fit what its reader expects, if it does not.
fn owner_mismatch(expect: &Expect, h: &Header) -> Option<String> {
    let want = expect.owner?;
    // Log trees and relocation trees legitimately carry other owners; check fs trees loosely.
    let strict = want < FIRST_FREE_OBJECTID && want != TREE_LOG_OBJECTID;
    (strict && want != h.owner && h.flags & HEADER_FLAG_RELOC == 0).then(|| {
        format!(
            "owner {} but expected {}",
            objectid_name(h.owner),
            objectid_name(want)
        )
    })
}

/// A small bounded block cache (FIFO with second chance).
struct BlockCache {
    map: HashMap<u64, (Arc<TreeBlock>, bool)>,
    order: VecDeque<u64>,
    capacity: usize,
}

impl BlockCache {
    fn get(&mut self, bytenr: u64) -> Option<Arc<TreeBlock>> {
        let e = self.map.get_mut(&bytenr)?;
        e.1 = true;
        Some(e.0.clone())
    }
    fn insert(&mut self, b: Arc<TreeBlock>) {
        if self.map.contains_key(&b.bytenr) {
            return;
        }
        while self.map.len() >= self.capacity {
            let Some(victim) = self.order.pop_front() else {
                break;
            };
            match self.map.get_mut(&victim) {
                Some(e) if e.1 => {
                    e.1 = false;
                    self.order.push_back(victim);
                }
                Some(_) => {
                    self.map.remove(&victim);
                }
                None => {}
            }
        }
        self.order.push_back(b.bytenr);
        self.map.insert(b.bytenr, (b, false));
    }
}

/// Counters for tests and benchmarks.
#[derive(Debug, Default)]
pub struct IoStats {
    pub block_reads: AtomicU64,
    pub cache_hits: AtomicU64,
    /// Blocks the readahead thread read into the cache (it skips blocks a reader got first).
    pub readahead_blocks: AtomicU64,
    /// Blocks queued for readahead (not yet cached when asked for).
    pub readahead_queued: AtomicU64,
    pub data_bytes_read: AtomicU64,
}

/// What a scrub found on one device ([`Disk::scrub_range`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScrubCounts {
    /// Bytes of data and tree blocks read from the device.
    pub bytes: u64,
    /// Bytes of parity checked on the device.
    pub parity_bytes: u64,
    pub read_errors: u64,
    /// Sectors (data) or blocks (metadata) whose checksum or header did not match.
    pub csum_errors: u64,
    /// Parity blocks that did not match their data.
    pub parity_errors: u64,
    /// Errors rewritten from a good copy.
    pub corrected: u64,
    /// Errors a good copy could fix (a read-only scrub leaves them).
    pub correctable: u64,
    /// Errors no good copy could fix.
    pub uncorrectable: u64,
}

/// The metadata/data reader of one opened filesystem.
pub struct Disk {
    /// The devices, present and missing (see [`Devices`]).
    pub(crate) devices: Devices,
    /// The newest superblock of the devices (its `dev_item` is the primary device's).
    pub sb: Superblock,
    chunks: RwLock<ChunkMap>,
    cache: Mutex<BlockCache>,
    pub stats: IoStats,
    ra_tx: Mutex<Option<std::sync::mpsc::Sender<(u64, Expect)>>>,
    /// Blocks changed by the running transaction, not yet written. Reads see them first.
    overlay: RwLock<HashMap<u64, Arc<TreeBlock>>>,
    /// Held through each RAID5/6 read-modify-write of a full stripe.
    parity_lock: Mutex<()>,
    /// Open for writing: reads rewrite the bad copies they find ([`Disk::repair_copies`]).
    writable: std::sync::atomic::AtomicBool,
}

/// Whether the device holds btrfs at all: `Some(Error::NotBtrfs)` when no superblock copy that
/// fits on it (64 KiB, 64 MiB, 256 GiB) carries the btrfs magic, naming what the content looks
/// like; `None` when some copy has the magic (it may still be damaged).
pub(crate) fn probe_not_btrfs(dev: &dyn BlockDevice) -> Option<Error> {
    let len = dev.len();
    for m in 0..SUPER_MIRROR_MAX {
        let off = super_offset(m) + 64;
        if off + 8 > len {
            break;
        }
        let mut magic = [0u8; 8];
        match dev.read_at(&mut magic, off) {
            Ok(()) if u64::from_le_bytes(magic) == MAGIC => return None,
            Ok(()) if u64::from_le_bytes(magic) == MAGIC_TEMPORARY => {
                return Some(Error::NotBtrfs(format!(
                    "an unfinished filesystem: its making was interrupted (the superblock at \
                     byte {} says it is still being made), so it holds no usable filesystem; \
                     make it again with mkfs",
                    off - 64
                )))
            }
            Ok(()) => {}
            // Cannot tell: let the superblock read report the I/O error.
            Err(_) => return None,
        }
    }
    Some(Error::NotBtrfs(format!(
        "{} (no btrfs magic in any superblock copy within its {len} bytes)",
        describe_content(dev)
    )))
}

/// A short description of what a device that is not btrfs holds.
fn describe_content(dev: &dyn BlockDevice) -> String {
    let len = dev.len();
    if len == 0 {
        return "the file is empty".into();
    }
    let mut head = vec![0u8; len.min(4096) as usize];
    if dev.read_at(&mut head, 0).is_err() {
        return "unreadable at byte 0".into();
    }
    if head.len() >= 1082 && head[1080..1082] == [0x53, 0xEF] {
        return "it looks like ext2/ext3/ext4 (magic 0xEF53 at byte 1080)".into();
    }
    if head.starts_with(b"XFSB") {
        return "it looks like XFS (\"XFSB\" at byte 0)".into();
    }
    if len >= 4096 + 16 {
        let mut sw = [0u8; 10];
        if dev.read_at(&mut sw, 4096 - 10).is_ok()
            && (&sw == b"SWAPSPACE2" || &sw[..] == b"SWAP-SPACE")
        {
            return "it looks like Linux swap space".into();
        }
    }
    // All zeroes? Look at up to 256 MiB.
    const LIMIT: u64 = 256 << 20;
    let mut buf = vec![0u8; 1 << 20];
    let mut off = 0u64;
    let end = len.min(LIMIT);
    while off < end {
        let n = (end - off).min(buf.len() as u64) as usize;
        if dev.read_at(&mut buf[..n], off).is_err() {
            break;
        }
        if let Some(i) = buf[..n].iter().position(|&b| b != 0) {
            let at = off + i as u64;
            return format!("some other content (first non-zero byte at {at})");
        }
        off += n as u64;
    }
    if len > LIMIT {
        format!("the first {LIMIT} bytes are all zeroes")
    } else {
        "all zeroes".into()
    }
}

/// Reads every superblock copy that fits on the device and returns the valid one with the
/// newest generation, or the primary's error if none is valid. A device with no btrfs magic in
/// any copy is [`Error::NotBtrfs`].
pub fn read_superblock(dev: &dyn BlockDevice) -> Result<Superblock> {
    if let Some(e) = probe_not_btrfs(dev) {
        return Err(e);
    }
    let mut best: Option<Superblock> = None;
    let mut first_err = None;
    for m in 0..SUPER_MIRROR_MAX {
        let off = super_offset(m);
        if off + SUPER_INFO_SIZE as u64 > dev.len() {
            if m == 0 {
                return Err(Error::corrupt(
                    Location::what("superblock"),
                    format!(
                        "device is only {} bytes, too small for a btrfs superblock",
                        dev.len()
                    ),
                ));
            }
            break;
        }
        let mut buf = vec![0u8; SUPER_INFO_SIZE];
        let r = dev
            .read_at(&mut buf, off)
            .map_err(|e| Error::io("reading superblock", off, e))
            .and_then(|_| Superblock::parse(&buf, off));
        match r {
            Ok(sb) => {
                if best.as_ref().is_none_or(|b| sb.generation > b.generation) {
                    best = Some(sb);
                }
            }
            Err(e) => {
                if m == 0 {
                    log::warn!("primary superblock unusable ({e}); trying mirrors");
                }
                first_err.get_or_insert(e);
            }
        }
    }
    best.ok_or_else(|| {
        first_err.unwrap_or_else(|| Error::corrupt(Location::what("superblock"), "no copy found"))
    })
}

/// The devices given to open a filesystem, from their superblocks: each must carry the
/// filesystem's fsid (that of `read[newest]`), and no devid may come twice. The devices the
/// chunk tree names beyond these are added as missing by [`Disk::match_dev_items`].
fn gather_devices(
    read: &[(String, Arc<dyn BlockDevice>, Superblock)],
    newest: usize,
) -> Result<Devices> {
    let (first_name, first_dev, sb) = &read[newest];
    let devices = Devices::single(
        sb.dev_item.devid,
        sb.dev_item.uuid,
        first_name.clone(),
        first_dev.clone(),
    );
    for (i, (name, dev, other)) in read.iter().enumerate() {
        if i == newest {
            continue;
        }
        if other.fsid != sb.fsid {
            return Err(Error::Invalid(format!(
                "{name} belongs to another filesystem (fsid {}, not {} of {first_name}); \
                 give only the devices of one filesystem",
                fmt_uuid(&other.fsid),
                fmt_uuid(&sb.fsid)
            )));
        }
        let devid = other.dev_item.devid;
        if let Some(m) = devices.member(devid) {
            return Err(Error::Invalid(if m.uuid == other.dev_item.uuid {
                format!(
                    "{name} and {} are the same device of the filesystem (devid {devid}); \
                     give each device once",
                    m.name
                )
            } else {
                format!(
                    "{name} and {} both say they are device {devid} of the filesystem; \
                     one of them is a stale copy",
                    m.name
                )
            }));
        }
        if other.generation != sb.generation {
            log::warn!(
                "{name} (devid {devid}) was last written at generation {}, the filesystem at {}: \
                 it missed some commits",
                other.generation,
                sb.generation
            );
        }
        devices.insert(Member {
            devid,
            uuid: other.dev_item.uuid,
            name: name.clone(),
            dev: Some(dev.clone()),
            failed: Default::default(),
        });
    }
    Ok(devices)
}

impl Disk {
    /// Opens the metadata layer as far as the superblock takes it: the superblock and its
    /// sys_chunk_array, enough to read the chunk tree. [`crate::ctree::open_disk`] opens it
    /// whole, with the chunk tree loaded.
    pub(crate) fn open_sys_chunks(given: Vec<(String, Arc<dyn BlockDevice>)>) -> Result<Arc<Disk>> {
        let mut read = Vec::with_capacity(given.len());
        for (name, dev) in given {
            let sb = read_superblock(dev.as_ref()).map_err(|e| {
                if read.is_empty() {
                    e
                } else {
                    Error::Invalid(format!("{name}: {e}"))
                }
            })?;
            read.push((name, dev, sb));
        }
        let Some(newest) = (0..read.len()).max_by_key(|&i| (read[i].2.generation, usize::MAX - i))
        else {
            return Err(Error::Invalid("no device given".into()));
        };
        let sb = read[newest].2.clone();
        if let Some(why) = crate::format::features::refuse_read(&sb) {
            return Err(Error::Unsupported(why));
        }
        let devices = gather_devices(&read, newest)?;
        if sb.num_devices > 1 && devices.len() as u64 == 1 && read.len() == 1 {
            log::debug!("opening device {} of {}", sb.dev_item.devid, sb.num_devices);
        }
        Self::assemble(devices, sb)
    }

    /// The metadata layer over `devices` with superblock `sb`: the chunk map holds the
    /// system chunks of its sys_chunk_array (mkfs adds the others it writes through).
    pub(crate) fn assemble(devices: Devices, sb: Superblock) -> Result<Arc<Disk>> {
        let chunks = ChunkMap::from_sys_chunk_array(&sb.sys_chunk_array)?;
        let cache_blocks = ((256u64 << 20) / sb.nodesize as u64) as usize;
        Ok(Arc::new(Disk {
            devices,
            sb,
            chunks: RwLock::new(chunks),
            cache: Mutex::new(BlockCache {
                map: HashMap::default(),
                order: VecDeque::new(),
                capacity: cache_blocks,
            }),
            stats: IoStats::default(),
            ra_tx: Mutex::new(None),
            overlay: RwLock::new(HashMap::default()),
            parity_lock: Mutex::new(()),
            writable: Default::default(),
        }))
    }

    /// The same filesystem over another set of devices (the set completed from the chunk
    /// tree's device items): the superblock and chunk map carried over, the caches empty.
    pub(crate) fn with_devices(&self, devices: Devices) -> Arc<Disk> {
        Arc::new(Disk {
            devices,
            sb: self.sb.clone(),
            chunks: RwLock::new(self.chunk_map().clone()),
            cache: Mutex::new(BlockCache {
                map: HashMap::default(),
                order: VecDeque::new(),
                capacity: self
                    .cache
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .capacity,
            }),
            stats: IoStats::default(),
            ra_tx: Mutex::new(None),
            overlay: RwLock::new(HashMap::default()),
            parity_lock: Mutex::new(()),
            writable: Default::default(),
        })
    }

    /// The device the superblock in use came from: a single-device filesystem's only one.
    pub fn dev(&self) -> Arc<dyn BlockDevice> {
        self.devices.primary()
    }

    /// The devid of [`Disk::dev`].
    pub(crate) fn devid(&self) -> u64 {
        self.devices.primary_devid()
    }

    /// Bounds the block cache to at most `bytes` of tree blocks (never grows it): for a
    /// streaming walk (send) that reads each block about once.
    pub(crate) fn limit_cache(&self, bytes: u64) {
        let blocks = (bytes / self.sb.nodesize.max(1) as u64).max(64) as usize;
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        c.capacity = c.capacity.min(blocks);
    }

    pub(crate) fn nodesize(&self) -> u32 {
        self.sb.nodesize
    }
    pub(crate) fn sectorsize(&self) -> u32 {
        self.sb.sectorsize
    }

    pub(crate) fn chunk_map(&self) -> std::sync::RwLockReadGuard<'_, ChunkMap> {
        self.chunks.read().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a chunk read from the chunk tree to the chunk map (an error names the overlap).
    pub(crate) fn insert_chunk(
        &self,
        logical: u64,
        chunk: crate::format::items::ChunkItem,
    ) -> std::result::Result<(), String> {
        let mut map = self.chunks.write().unwrap_or_else(|e| e.into_inner());
        map.insert(logical, chunk)
    }

    /// The error for a range whose every copy is on a missing device.
    fn all_missing(&self, logical: u64, copies: &[PhysCopy]) -> Error {
        let mut ids: Vec<u64> = copies.iter().map(|c| c.devid).collect();
        ids.dedup();
        let ids: Vec<String> = ids.iter().map(|d| d.to_string()).collect();
        Error::io(
            format!(
                "reading logical {logical}: every copy is on a missing device (devid {})",
                ids.join(", ")
            ),
            0,
            std::io::Error::new(std::io::ErrorKind::NotFound, "device missing"),
        )
    }

    /// Reads `buf.len()` bytes at one physical place: `None` when its device is missing.
    fn read_phys(&self, c: PhysCopy, buf: &mut [u8]) -> Option<std::io::Result<()>> {
        Some(self.devices.get(c.devid)?.read_at(buf, c.physical))
    }

    /// A tree block that fails validation, mended where its own layout says what the damaged
    /// fields were: its header's generation (the parent pointer's, `expect.generation`) and,
    /// in a leaf, the items' data offsets (items are packed from the block's end in slot
    /// order, so each offset follows from the sizes). Only a block whose checksum matches
    /// its bytes is mended (a bit flipped anywhere else cannot be told apart); the result is
    /// resealed and must pass every check a read makes. `None`: it cannot be mended so.
    pub(crate) fn mend_tree_block(&self, bytenr: u64, expect: &Expect) -> Option<Box<[u8]>> {
        let ns = self.sb.nodesize as usize;
        let ct = self.sb.csum_type;
        let mut b = self.read_data(bytenr, ns, &|_, _| true).ok()??;
        if b.len() != ns || !ct.verify(&b[crate::format::csum::CSUM_SLOT..], &b[..ct.size()]) {
            return None;
        }
        if let Some(g) = expect.generation {
            b[80..88].copy_from_slice(&g.to_le_bytes());
        }
        let level = b[100];
        if level == 0 {
            let n = u32::from_le_bytes(b[96..100].try_into().ok()?) as usize;
            let data_area = ns.checked_sub(HEADER_SIZE)?;
            if n.checked_mul(ITEM_SIZE)? > data_area {
                return None;
            }
            let mut end = data_area;
            for i in 0..n {
                let h = HEADER_SIZE + i * ITEM_SIZE;
                let size = u32::from_le_bytes(b[h + 21..h + 25].try_into().ok()?) as usize;
                let off = end.checked_sub(size)?;
                if off < n * ITEM_SIZE {
                    return None;
                }
                b[h + 17..h + 21].copy_from_slice(&(off as u32).to_le_bytes());
                end = off;
            }
        }
        let sum = ct.compute(&b[crate::format::csum::CSUM_SLOT..]);
        b[..ct.size()].copy_from_slice(&sum[..ct.size()]);
        check_tree_block(
            &b,
            bytenr,
            self.sb.nodesize,
            ct,
            &self.sb.metadata_fsid(),
            expect,
        )
        .ok()?;
        Some(b.into_boxed_slice())
    }

    /// Puts a block in the cache of clean blocks (a mended one, see
    /// [`Disk::mend_tree_block`], which reads as it from then on).
    pub(crate) fn cache_put(&self, b: TreeBlock) {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache.map.remove(&b.bytenr);
        cache.insert(Arc::new(b));
    }

    /// Hints the devices that the tree blocks at these logical addresses will be read soon
    /// (the first copy of each, unless already cached here).
    pub(crate) fn will_need_blocks(&self, bytenrs: &[u64]) {
        let ns = self.sb.nodesize as u64;
        let map = self.chunk_map();
        for &b in bytenrs {
            if self.is_cached(b) {
                continue;
            }
            let Ok(segs) = map.segments(b, ns) else {
                continue;
            };
            for seg in &segs {
                if let Some(c) = seg.copies.first() {
                    if let Some(dev) = self.devices.get(c.devid) {
                        dev.will_need(c.physical, seg.len);
                    }
                }
            }
        }
    }

    /// Fills `buf` from one copy; false when its device is missing or the read fails.
    pub(crate) fn read_copy(&self, c: PhysCopy, buf: &mut [u8]) -> bool {
        matches!(self.read_phys(c, buf), Some(Ok(())))
    }

    /// The bytes of one segment that `accept` takes: each copy in turn, then (RAID5/6) the
    /// piece rebuilt from the rest of its full stripe, treating as lost first only what is
    /// missing or unreadable, then (RAID6) each other block as well. `Ok(None)`: some copy
    /// was read but none was accepted; `Err`: nothing could be read.
    fn read_segment(
        &self,
        what: &str,
        seg: &Segment,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>> {
        self.read_segment_as(what, seg, accept, true)
    }

    /// [`Disk::read_segment`]; `repair`: log and repair bad copies (off for the scrub, which
    /// counts and repairs them itself).
    fn read_segment_as(
        &self,
        what: &str,
        seg: &Segment,
        accept: &dyn Fn(&[u8]) -> bool,
        repair: bool,
    ) -> Result<Option<Vec<u8>>> {
        let len = seg.len as usize;
        let mut last_io = None;
        let mut read_any = false;
        // A copy on a present device failed (unreadable or rejected): worth a warning when
        // another source serves, unlike a copy on a device known to be missing.
        let mut bad_present = false;
        let mut bad_copies: Vec<PhysCopy> = Vec::new();
        for (i, c) in seg.copies.iter().enumerate() {
            let mut buf = vec![0u8; len];
            match self.read_phys(*c, &mut buf) {
                None => continue,
                Some(Err(e)) => {
                    bad_present = true;
                    bad_copies.push(*c);
                    last_io = Some(Error::io(
                        format!(
                            "reading {what} {} (copy {i}, devid {})",
                            seg.logical, c.devid
                        ),
                        c.physical,
                        e,
                    ))
                }
                Some(Ok(())) => {
                    read_any = true;
                    if accept(&buf) {
                        if bad_present && repair {
                            log::warn!(
                                "logical {}: an earlier copy was bad, read copy {i} (devid {})",
                                seg.logical,
                                c.devid
                            );
                            self.repair_copies(seg.logical, &bad_copies, &buf);
                        }
                        return Ok(Some(buf));
                    }
                    bad_present = true;
                    bad_copies.push(*c);
                }
            }
        }
        if let Some(fs) = &seg.parity {
            let mut blocks: Vec<Option<Vec<u8>>> = Vec::with_capacity(fs.blocks.len());
            for (j, c) in fs.blocks.iter().enumerate() {
                if j == fs.data_index {
                    blocks.push(None);
                    continue;
                }
                let mut buf = vec![0u8; len];
                blocks.push(match self.read_phys(*c, &mut buf) {
                    Some(Ok(())) => Some(buf),
                    _ => None,
                });
            }
            let try_rebuild = |lost_too: Option<usize>| -> Option<Vec<u8>> {
                let mut b = blocks.clone();
                if let Some(j) = lost_too {
                    b[j] = None;
                }
                if !crate::io::raid56::rebuild(&mut b, fs.nparity) {
                    return None;
                }
                b.swap_remove(fs.data_index)
            };
            let mut tries: Vec<Option<usize>> = vec![None];
            if fs.nparity == 2 {
                tries.extend(
                    (0..fs.blocks.len())
                        .filter(|&j| j != fs.data_index && blocks[j].is_some())
                        .map(Some),
                );
            }
            for t in tries {
                if let Some(buf) = try_rebuild(t) {
                    read_any = true;
                    if accept(&buf) {
                        if bad_present && repair {
                            log::warn!(
                                "logical {}: its copy was bad, rebuilt it from the parity of \
                                 its full stripe",
                                seg.logical
                            );
                            self.repair_copies(seg.logical, &bad_copies, &buf);
                        }
                        return Ok(Some(buf));
                    }
                }
            }
        }
        if read_any {
            return Ok(None);
        }
        Err(last_io.unwrap_or_else(|| self.all_missing(seg.logical, &seg.copies)))
    }

    /// Read repair: once a read found good bytes for a piece after bad copies of it, rewrites
    /// those copies with them, when the filesystem is open for writing (as the kernel's read
    /// repair does). A failed rewrite is only logged: the read itself succeeded.
    fn repair_copies(&self, logical: u64, bad: &[PhysCopy], good: &[u8]) {
        if bad.is_empty() || !self.writable.load(Ordering::Relaxed) {
            return;
        }
        for c in bad {
            let Some(dev) = self.devices.get(c.devid) else {
                continue;
            };
            match dev.write_at(good, c.physical) {
                Ok(()) => log::warn!(
                    "logical {logical}: rewrote the bad copy on device {} at byte {}",
                    c.devid,
                    c.physical
                ),
                Err(e) => log::warn!(
                    "logical {logical}: could not rewrite the bad copy on device {}: {e}",
                    c.devid
                ),
            }
        }
    }

    /// Marks the filesystem open for writing: reads repair the bad copies they find.
    pub(crate) fn set_writable(&self) {
        self.writable.store(true, Ordering::Relaxed);
    }

    /// Reads `len` bytes at a logical address in one chunk, accepting what `accept` takes of
    /// the whole range: for a range of several segments, each segment's first readable
    /// copy, then each other source of one segment at a time.
    fn read_logical(
        &self,
        what: &str,
        logical: u64,
        len: usize,
        accept: &dyn Fn(&[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>> {
        let segs = self.chunk_map().segments(logical, len as u64)?;
        if let [seg] = segs.as_slice() {
            return self.read_segment(what, seg, accept);
        }
        let mut out = Vec::with_capacity(len);
        for seg in &segs {
            match self.read_segment(what, seg, &|_| true)? {
                Some(b) => out.extend_from_slice(&b),
                None => return Ok(None),
            }
        }
        if accept(&out) {
            return Ok(Some(out));
        }
        let mut at = 0usize;
        for seg in &segs {
            let here = at..at + seg.len as usize;
            let before = out[here.clone()].to_vec();
            let whole = |piece: &[u8]| {
                if piece == before.as_slice() {
                    return false;
                }
                let mut all = out.clone();
                all[here.clone()].copy_from_slice(piece);
                accept(&all)
            };
            if let Some(b) = self.read_segment(what, seg, &whole)? {
                out[here].copy_from_slice(&b);
                return Ok(Some(out));
            }
            at += seg.len as usize;
        }
        Ok(None)
    }

    /// Reads a tree block, validating it; tries every copy before giving up.
    pub(crate) fn read_tree_block(&self, bytenr: u64, expect: &Expect) -> Result<Arc<TreeBlock>> {
        if let Some(b) = self.overlay_get(bytenr) {
            self.recheck(&b, expect)?;
            return Ok(b);
        }
        if let Some(b) = self.cache_get(bytenr) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            // A cached block was validated already; re-check what the new parent claims.
            self.recheck(&b, expect)?;
            return Ok(b);
        }
        let b = self.read_tree_block_uncached(bytenr, expect)?;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(b.clone());
        Ok(b)
    }

    /// A block of the running transaction, if `bytenr` is one.
    pub(crate) fn overlay_get(&self, bytenr: u64) -> Option<Arc<TreeBlock>> {
        self.overlay
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .get(&bytenr)
            .cloned()
    }

    /// Adds or replaces a block of the running transaction.
    pub(crate) fn overlay_put(&self, b: Arc<TreeBlock>) {
        self.overlay
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(b.bytenr, b);
    }

    /// Changes a block of the running transaction in place (copying it first if a reader
    /// still holds it). `None` if `bytenr` is not in the overlay.
    pub(crate) fn overlay_modify<R>(
        &self,
        bytenr: u64,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Option<R> {
        let mut ov = self.overlay.write().unwrap_or_else(|e| e.into_inner());
        let arc = ov.get_mut(&bytenr)?;
        let blk = Arc::make_mut(arc);
        let r = f(&mut blk.data);
        blk.header = Header::parse(&blk.data);
        Some(r)
    }

    /// Drops a block from the running transaction (it was freed before being written).
    pub(crate) fn overlay_remove(&self, bytenr: u64) -> Option<Arc<TreeBlock>> {
        self.overlay
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&bytenr)
    }

    /// How many blocks the running transaction holds: tree blocks changed since the last
    /// commit, all in memory until it.
    /// Puts every block of `other`'s overlay in this disk's: reads here see what `other`'s
    /// running transaction changed, none of it written (a commit's result, checked before
    /// it is written).
    pub(crate) fn overlay_share(&self, other: &Disk) {
        let theirs = other.overlay.read().unwrap_or_else(|e| e.into_inner());
        let mut ours = self.overlay.write().unwrap_or_else(|e| e.into_inner());
        for (k, b) in theirs.iter() {
            ours.insert(*k, b.clone());
        }
    }

    pub(crate) fn overlay_len(&self) -> usize {
        self.overlay.read().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Sizes the cache of clean tree blocks to `bytes` (at least 64 blocks); a smaller size
    /// takes effect as blocks come in.
    pub(crate) fn set_cache_bytes(&self, bytes: u64) {
        let blocks = (bytes / self.sb.nodesize.max(1) as u64).max(64) as usize;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .capacity = blocks;
    }

    /// Addresses of all blocks of the running transaction.
    pub(crate) fn overlay_addresses(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .overlay
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .keys()
            .copied()
            .collect();
        v.sort_unstable();
        v
    }

    /// After a commit wrote them: the overlay's blocks become ordinary cached blocks.
    pub(crate) fn overlay_retire(&self) {
        let blocks: Vec<Arc<TreeBlock>> = {
            let mut ov = self.overlay.write().unwrap_or_else(|e| e.into_inner());
            ov.drain().map(|(_, b)| b).collect()
        };
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        for b in blocks {
            cache.map.remove(&b.bytenr);
            cache.insert(b);
        }
    }

    /// Forgets a cached block whose space was freed (it may be reused for another block).
    pub(crate) fn cache_forget(&self, bytenr: u64) {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map
            .remove(&bytenr);
    }

    /// Writes `data` at a logical address (in one chunk) to every copy on every device; for
    /// RAID5/6, each piece with its full stripe's parity, read-modify-write: the other data
    /// blocks of the same bytes are read, P (and Q) recomputed, and all written, one full
    /// stripe at a time (so concurrent writers to one full stripe cannot interleave).
    pub(crate) fn write_logical(&self, logical: u64, data: &[u8]) -> Result<()> {
        let segs = self.chunk_map().segments(logical, data.len() as u64)?;
        let what = || format!("writing logical {logical}");
        for seg in &segs {
            let at = (seg.logical - logical) as usize;
            let piece = &data[at..at + seg.len as usize];
            let Some(fs) = &seg.parity else {
                // Every copy on every working device; a device that fails the write is
                // dropped (degraded) while another copy got the bytes.
                // A failed copy is tolerated only on a filesystem of several devices and when
                // a copy on another device took the bytes (DUP's two copies share a device).
                let mut wrote: Vec<u64> = Vec::new();
                let mut failed = Vec::new();
                for c in &seg.copies {
                    if let Some(dev) = self.devices.get(c.devid) {
                        match dev.write_at(piece, c.physical) {
                            Ok(()) => wrote.push(c.devid),
                            Err(e) => failed.push((*c, e)),
                        }
                    }
                }
                for (c, e) in failed {
                    if self.devices.len() < 2 || !wrote.iter().any(|&d| d != c.devid) {
                        return Err(Error::io(what(), c.physical, e));
                    }
                    self.devices
                        .mark_failed(c.devid, &format!("{}: {e}", what()));
                }
                if wrote.is_empty() {
                    return Err(self.all_missing(seg.logical, &seg.copies));
                }
                continue;
            };
            let _one_at_a_time = self.parity_lock.lock().unwrap_or_else(|e| e.into_inner());
            let nd = fs.blocks.len() - fs.nparity;
            let degraded = fs
                .blocks
                .iter()
                .any(|c| self.devices.get(c.devid).is_none());
            let mut blocks: Vec<Vec<u8>> = Vec::with_capacity(nd);
            if degraded {
                // A block of the row is on a missing device: the row as it is, rebuilt
                // from what is there, then this piece put in.
                let mut row: Vec<Option<Vec<u8>>> = fs
                    .blocks
                    .iter()
                    .map(|c| {
                        let mut b = vec![0u8; piece.len()];
                        matches!(self.read_phys(*c, &mut b), Some(Ok(()))).then_some(b)
                    })
                    .collect();
                if !crate::io::raid56::rebuild(&mut row, fs.nparity) {
                    return Err(self.all_missing(seg.logical, &fs.blocks));
                }
                for (j, b) in row.into_iter().take(nd).enumerate() {
                    blocks.push(if j == fs.data_index {
                        piece.to_vec()
                    } else {
                        b.unwrap_or_default()
                    });
                }
            } else {
                for (j, c) in fs.blocks[..nd].iter().enumerate() {
                    if j == fs.data_index {
                        blocks.push(piece.to_vec());
                        continue;
                    }
                    let mut b = vec![0u8; piece.len()];
                    match self.read_phys(*c, &mut b) {
                        Some(Ok(())) => blocks.push(b),
                        Some(Err(e)) => return Err(Error::io(what(), c.physical, e)),
                        None => return Err(self.all_missing(seg.logical, &[*c])),
                    }
                }
            }
            let refs: Vec<&[u8]> = blocks.iter().map(|b| &b[..]).collect();
            let (p, q) = crate::io::raid56::parity(&refs, fs.nparity == 2);
            let mut writes: Vec<(PhysCopy, &[u8])> = vec![(fs.blocks[fs.data_index], piece)];
            writes.push((fs.blocks[nd], &p));
            if let Some(q) = q.as_deref() {
                writes.push((fs.blocks[nd + 1], q));
            }
            let mut lost = fs
                .blocks
                .iter()
                .filter(|c| self.devices.get(c.devid).is_none())
                .count();
            for (c, bytes) in writes {
                let Some(dev) = self.devices.get(c.devid) else {
                    continue; // missing: the row is rebuilt without it
                };
                if let Err(e) = dev.write_at(bytes, c.physical) {
                    lost += 1;
                    if lost > fs.nparity || self.devices.len() < 2 {
                        return Err(Error::io(what(), c.physical, e));
                    }
                    self.devices
                        .mark_failed(c.devid, &format!("{}: {e}", what()));
                }
            }
        }
        Ok(())
    }

    /// Scrubs `[logical, logical + len)` (one extent, in one chunk): reads every copy on every
    /// present device and counts, per device, what `bad` finds wrong in it (`bad(at, bytes)`
    /// gives the number of bad units, sectors or blocks, of the piece at byte `at` of the
    /// range; 0: good). A bad or unreadable copy is rewritten from a good one (or, RAID5/6,
    /// from the data rebuilt through parity) when `repair`. Returns the rows of RAID5/6 full
    /// stripes the range covers, for [`Disk::scrub_parity`].
    pub(crate) fn scrub_range(
        &self,
        logical: u64,
        len: u64,
        bad: &dyn Fn(usize, &[u8]) -> u64,
        repair: bool,
        stats: &mut std::collections::BTreeMap<u64, ScrubCounts>,
    ) -> Result<Vec<Segment>> {
        let segs = self.chunk_map().segments(logical, len)?;
        let mut parity_rows = Vec::new();
        for seg in &segs {
            let at = (seg.logical - logical) as usize;
            let n = seg.len as usize;
            let mut good: Option<Vec<u8>> = None;
            let mut bad_copies: Vec<(PhysCopy, u64)> = Vec::new();
            for c in &seg.copies {
                let mut buf = vec![0u8; n];
                let st = stats.entry(c.devid).or_default();
                match self.read_phys(*c, &mut buf) {
                    None => {}
                    Some(Err(_)) => {
                        st.read_errors += 1;
                        bad_copies.push((*c, 1));
                    }
                    Some(Ok(())) => {
                        st.bytes += n as u64;
                        let b = bad(at, &buf);
                        if b == 0 {
                            good.get_or_insert(buf);
                        } else {
                            st.csum_errors += b;
                            bad_copies.push((*c, b));
                        }
                    }
                }
            }
            if good.is_none() && seg.parity.is_some() {
                // The data block is bad: what its full stripe rebuilds, if that checks out.
                let only_good = |b: &[u8]| bad(at, b) == 0;
                let rebuilt = self
                    .read_segment_as("data at logical", seg, &only_good, false)
                    .ok()
                    .flatten();
                good = rebuilt;
            }
            let mut left_bad = false;
            for (c, units) in bad_copies {
                let st = stats.entry(c.devid).or_default();
                match (&good, self.devices.get(c.devid)) {
                    (Some(g), Some(dev)) if repair => match dev.write_at(g, c.physical) {
                        Ok(()) => st.corrected += units,
                        Err(_) => {
                            st.uncorrectable += units;
                            left_bad = true;
                        }
                    },
                    (Some(_), _) => {
                        st.correctable += units;
                        left_bad = true;
                    }
                    (None, _) => {
                        st.uncorrectable += units;
                        left_bad = true;
                    }
                }
            }
            if seg.parity.is_some() {
                // A row whose data is still bad says nothing about its parity.
                let mut row = seg.clone();
                if left_bad {
                    row.len = 0;
                }
                parity_rows.push(row);
            }
        }
        Ok(parity_rows)
    }

    /// Checks the parity of the RAID5/6 rows `rows` (pieces of data blocks, see
    /// [`Disk::scrub_range`]): P (and Q) recomputed from the data blocks of the same bytes
    /// must be what the parity blocks hold; one that is not is counted against its device
    /// and, when `repair`, rewritten.
    pub(crate) fn scrub_parity(
        &self,
        rows: &[Segment],
        repair: bool,
        stats: &mut std::collections::BTreeMap<u64, ScrubCounts>,
    ) -> Result<()> {
        let mut done: std::collections::BTreeSet<(u64, u64, u64)> = Default::default();
        // Rows with bad data left (length 0, see scrub_range): their parity is not judged.
        let skip: Vec<(u64, u64)> = rows
            .iter()
            .filter(|r| r.len == 0)
            .filter_map(|r| {
                let fs = r.parity.as_ref()?;
                let p = fs.blocks[fs.blocks.len() - fs.nparity];
                Some((p.devid, p.physical))
            })
            .collect();
        for seg in rows {
            let Some(fs) = &seg.parity else { continue };
            let nd = fs.blocks.len() - fs.nparity;
            let key = (fs.blocks[nd].devid, fs.blocks[nd].physical, seg.len);
            if seg.len == 0 || !done.insert(key) {
                continue;
            }
            let (pd, pp) = (fs.blocks[nd].devid, fs.blocks[nd].physical);
            let stripe = |x: u64| x / (64 << 10);
            if skip
                .iter()
                .any(|&(d, p)| d == pd && stripe(p) == stripe(pp))
            {
                continue;
            }
            let n = seg.len as usize;
            let mut data = Vec::with_capacity(nd);
            for c in &fs.blocks[..nd] {
                let mut b = vec![0u8; n];
                match self.read_phys(*c, &mut b) {
                    Some(Ok(())) => data.push(b),
                    _ => break,
                }
            }
            if data.len() < nd {
                continue; // a data block is missing or unreadable: counted by its own scrub
            }
            let refs: Vec<&[u8]> = data.iter().map(|b| &b[..]).collect();
            let (p, q) = crate::io::raid56::parity(&refs, fs.nparity == 2);
            let want: Vec<(PhysCopy, Vec<u8>)> = std::iter::once((fs.blocks[nd], p))
                .chain(q.map(|q| (fs.blocks[nd + 1], q)))
                .collect();
            for (c, bytes) in want {
                let mut have = vec![0u8; n];
                let Some(r) = self.read_phys(c, &mut have) else {
                    continue;
                };
                let st = stats.entry(c.devid).or_default();
                st.parity_bytes += n as u64;
                if r.is_ok() && have == bytes {
                    continue;
                }
                if r.is_err() {
                    st.read_errors += 1;
                } else {
                    st.parity_errors += 1;
                }
                if repair {
                    let dev = self
                        .devices
                        .get(c.devid)
                        .ok_or_else(|| self.all_missing(seg.logical, &[c]))?;
                    match dev.write_at(&bytes, c.physical) {
                        Ok(()) => st.corrected += 1,
                        Err(_) => st.uncorrectable += 1,
                    }
                } else {
                    st.correctable += 1;
                }
            }
        }
        Ok(())
    }

    /// Makes every write so far durable on every present device (a write barrier: before a
    /// superblock points at what was written).
    pub(crate) fn flush_all(&self) -> std::io::Result<()> {
        self.devices.on_each(|_, d| d.flush())
    }

    /// Takes a chunk the write engine removed out of the logical-to-physical map.
    pub(crate) fn remove_chunk(&self, logical: u64) -> Option<crate::format::items::ChunkItem> {
        self.chunks
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .remove(logical)
    }

    /// Adds a chunk created by the write engine to the logical-to-physical map.
    pub(crate) fn add_chunk(
        &self,
        logical: u64,
        chunk: crate::format::items::ChunkItem,
    ) -> Result<()> {
        self.chunks
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .insert(logical, chunk)
            .map_err(|r| Error::Invalid(format!("new chunk at {logical}: {r}")))
    }

    fn cache_get(&self, bytenr: u64) -> Option<Arc<TreeBlock>> {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(bytenr)
    }

    /// Whether a block is in the cache (readahead uses this).
    pub(crate) fn is_cached(&self, bytenr: u64) -> bool {
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .map
            .contains_key(&bytenr)
    }

    fn recheck(&self, b: &TreeBlock, expect: &Expect) -> Result<()> {
        let loc = || Location::block(expect.owner, b.bytenr);
        // A block cached for one tree may be named by another's pointer (a damaged root).
        if let Some(m) = owner_mismatch(expect, &b.header) {
            return Err(Error::corrupt(loc(), m));
        }
        if let Some(l) = expect.level {
            if b.level() != l {
                return Err(Error::corrupt(
                    loc(),
                    format!("level {} but parent expects {l}", b.level()),
                ));
            }
        }
        if let Some(g) = expect.generation {
            if b.header.generation != g {
                return Err(Error::corrupt(
                    loc(),
                    format!(
                        "generation {} but parent pointer says {g}",
                        b.header.generation
                    ),
                ));
            }
        }
        if let Some(k) = expect.first_key {
            if b.nritems() == 0 {
                return Err(Error::corrupt(
                    loc(),
                    format!("empty leaf but parent pointer says its first key is {k}"),
                ));
            }
            if b.key(0) != k {
                return Err(Error::corrupt(
                    loc(),
                    format!("first key {} but parent pointer says {k}", b.key(0)),
                ));
            }
        }
        Ok(())
    }

    fn read_tree_block_uncached(&self, bytenr: u64, expect: &Expect) -> Result<Arc<TreeBlock>> {
        let ns = self.sb.nodesize;
        if !bytenr.is_multiple_of(self.sb.sectorsize as u64) {
            return Err(Error::corrupt(
                Location::block(expect.owner, bytenr),
                "tree block address not sector aligned",
            ));
        }
        let first_err = std::cell::RefCell::new(None);
        let header = std::cell::RefCell::new(None);
        let fsid = self.sb.metadata_fsid();
        let accept = |data: &[u8]| {
            self.stats.block_reads.fetch_add(1, Ordering::Relaxed);
            match check_tree_block(data, bytenr, ns, self.sb.csum_type, &fsid, expect) {
                Ok(h) => {
                    *header.borrow_mut() = Some(h);
                    true
                }
                Err(e) => {
                    first_err.borrow_mut().get_or_insert(e);
                    false
                }
            }
        };
        let got = self
            .read_logical("tree block", bytenr, ns as usize, &accept)
            .map_err(|e| e.in_block(expect.owner, bytenr))?;
        match (got, header.into_inner()) {
            (Some(data), Some(header)) => Ok(Arc::new(TreeBlock {
                bytenr,
                header,
                data: data.into_boxed_slice(),
            })),
            _ => Err(first_err.into_inner().unwrap_or_else(|| {
                Error::corrupt(Location::block(expect.owner, bytenr), "no copy")
            })),
        }
    }

    /// Reads `len` bytes of data at a logical address, from the copies (or, RAID5/6, the
    /// parity) that `verify` accepts: it is given each piece with its byte offset in the range
    /// and returns false on a checksum mismatch. `Ok(None)`: some piece has no accepted
    /// source.
    pub(crate) fn read_data(
        &self,
        logical: u64,
        len: usize,
        verify: &dyn Fn(usize, &[u8]) -> bool,
    ) -> Result<Option<Vec<u8>>> {
        let segs = self.chunk_map().segments(logical, len as u64)?;
        let mut out = Vec::with_capacity(len);
        for seg in &segs {
            let at = (seg.logical - logical) as usize;
            match self.read_segment("data at logical", seg, &|b| verify(at, b))? {
                Some(b) => out.extend_from_slice(&b),
                None => return Ok(None),
            }
        }
        self.stats
            .data_bytes_read
            .fetch_add(len as u64, Ordering::Relaxed);
        Ok(Some(out))
    }

    /// Queues blocks to be read into the cache by the readahead thread.
    pub(crate) fn readahead(self: &Arc<Self>, blocks: &[(u64, Expect)]) {
        let wanted: Vec<(u64, Expect)> = {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            let ov = self.overlay.read().unwrap_or_else(|e| e.into_inner());
            blocks
                .iter()
                .filter(|(b, _)| !cache.map.contains_key(b) && !ov.contains_key(b))
                .copied()
                .collect()
        };
        if wanted.is_empty() {
            return;
        }
        let blocks = &wanted[..];
        self.stats
            .readahead_queued
            .fetch_add(blocks.len() as u64, Ordering::Relaxed);
        let mut tx = self.ra_tx.lock().unwrap_or_else(|e| e.into_inner());
        if tx.is_none() {
            let (s, r) = std::sync::mpsc::channel::<(u64, Expect)>();
            let weak = Arc::downgrade(self);
            let spawned = std::thread::Builder::new()
                .name("butter-readahead".into())
                .spawn(move || {
                    while let Ok((bytenr, expect)) = r.recv() {
                        let Some(disk) = weak.upgrade() else { break };
                        if !disk.is_cached(bytenr) {
                            disk.stats.readahead_blocks.fetch_add(1, Ordering::Relaxed);
                            // Errors are reported when the walker reads the block itself.
                            let _ = disk.read_tree_block(bytenr, &expect);
                        }
                    }
                });
            if spawned.is_err() {
                return;
            }
            *tx = Some(s);
        }
        if let Some(s) = tx.as_ref() {
            for b in blocks {
                let _ = s.send(*b);
            }
        }
    }
}
