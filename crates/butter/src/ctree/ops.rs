//! In-memory mutation primitives on tree block buffers: the byte-level half of the COW B-tree.
//!
//! The COW B-tree (in `ctree`) finds a path, COWs the blocks on it and then calls these
//! functions on the copies. Everything here is pure: no I/O, no block allocation (the caller
//! hands in every buffer, including the empty right-hand block of a split), no transactions,
//! no reference counting. A buffer is exactly one tree block of `nodesize` bytes.
//!
//! # Layout (offsets in bytes)
//!
//! ```text
//! header (101): csum[32] fsid[16] bytenr u64 flags u64 chunk_tree_uuid[16] generation u64
//!               owner u64 nritems u32 level u8          (all little endian; flags: the top
//!                                                        byte is the backref revision)
//! leaf (level 0):
//!   [101 .. 101 + 25*n)   item records: key (17) | data offset le32 | data size le32
//!   [.. data_start)       free space
//!   [data_start .. end)   item data, packed backwards from the end of the block
//! node (level 1..7):
//!   [101 .. 101 + 33*n)   key pointers: key (17) | blockptr le64 | generation le64
//!   [.. end)              free space
//! ```
//!
//! A leaf item's data offset is relative to the end of the header (byte 101), so the data of
//! an item lies at block bytes `[101 + offset, 101 + offset + size)`. Write `space = nodesize -
//! 101`, `off(i)`/`size(i)` for item `i`, `n` for nritems.
//!
//! # Invariants every function here keeps (and checks when a view is made)
//!
//! - Leaf data is packed with no gaps, in slot order, from the end: `off(0) + size(0) ==
//!   space` and `off(i) + size(i) == off(i - 1)`. So item data forms one contiguous run
//!   `[data_start, space)` with `data_start = off(n - 1)` (or `space` when `n == 0`), and the
//!   data of any run of slots `[a, b)` is one contiguous range `[off(b - 1), end(a))` where
//!   `end(a) = off(a - 1)` (or `space` for `a == 0`).
//! - The item array does not reach the data: `25 * n <= data_start`; a leaf's free space is
//!   `data_start - 25 * n` bytes (a node's is `space / 33 - n` pointers).
//! - Keys are strictly increasing by slot, in leaves and in nodes.
//! - Bytes a primitive frees (vacated records, vacated data) are zeroed, and the data area a
//!   primitive creates (a new item, the tail an extend adds) is zeroed, so nothing stale is
//!   written to disk. Free space that was already dirty when the block was read stays as it was.
//! - Header fields other than `nritems` (and `level` on init) are never changed by the item and
//!   pointer primitives; the caller sets bytenr, generation, owner, flags through the setters.
//!
//! These are the layout rules the tree checker ([`crate::io::disk_io::check_tree_block`]) enforces,
//! and the ones the kernel's tree checker enforces. Rebuilt from their items alone, the leaves
//! and nodes of mkfs.btrfs images come out byte for byte the same, apart from stale bytes
//! mkfs leaves in some blocks' free space (see `ctree/ops_model_tests.rs`).
//!
//! # Views and errors
//!
//! [`LeafMut`] and [`NodeMut`] are views over `&mut [u8]`. Making one validates the whole
//! layout (O(n)): a buffer of the wrong size or level is [`Error::Invalid`], an inconsistent
//! layout (counts, offsets, sizes, key order) is [`Error::Corrupt`] with the block's location.
//! After that the view's own methods keep the invariants, and it hands out no raw mutable access
//! to the header's layout fields or the records, so indexing inside cannot fail. A request that
//! cannot be met (does not fit, slot out of range, keys out of order) is [`Error::Invalid`] whose
//! text names the block and slot; on any error nothing has been changed.
//!
//! Moving items between siblings ([`push_leaf_left`], [`push_leaf_right`], [`split_leaf`],
//! [`merge_leaves`] and the node equivalents) returns the right block's first key afterwards,
//! which the caller writes into the parent's key pointer. [`LeafMut::plan_split`] chooses a split
//! point that makes room for an insert or extend, including the case where the grown item must
//! sit alone in a leaf of its own. [`finalize`] re-checks the layout and stores the checksum.

use crate::error::{Error, Location, Result};
use crate::format::csum::CsumType;
use crate::format::header::Header;
#[cfg(test)]
use crate::format::header::{ItemHeader, KeyPtr};
use crate::format::{
    le_u32, le_u64, Key, CSUM_SIZE, DISK_KEY_SIZE, HEADER_SIZE, ITEM_SIZE, KEY_PTR_SIZE, MAX_LEVEL,
    MIXED_BACKREF_REV,
};
use std::ops::Range;

/// Largest tree block btrfs allows (and the largest buffer these primitives accept).
pub(crate) const MAX_NODESIZE: usize = 65536;

// Header field offsets.
const OFF_FSID: usize = 32;
const OFF_BYTENR: usize = 48;
const OFF_FLAGS: usize = 56;
const OFF_CHUNK_TREE_UUID: usize = 64;
const OFF_GENERATION: usize = 80;
const OFF_OWNER: usize = 88;
const OFF_NRITEMS: usize = 96;
const OFF_LEVEL: usize = 100;

/// Bits of the header flags word that hold flags; the top byte is the backref revision.
const FLAGS_MASK: u64 = (1u64 << 56) - 1;

/// Largest data size of one leaf item in a block of `nodesize` bytes (the item alone in a leaf).
pub(crate) const fn max_item_size(nodesize: usize) -> usize {
    nodesize.saturating_sub(HEADER_SIZE + ITEM_SIZE)
}

/// Most key pointers a node of `nodesize` bytes holds.
pub(crate) const fn max_node_ptrs(nodesize: usize) -> usize {
    nodesize.saturating_sub(HEADER_SIZE) / KEY_PTR_SIZE
}

// ---------------------------------------------------------------------------------------------
// Raw header access
// ---------------------------------------------------------------------------------------------

fn put_u64(buf: &mut [u8], off: usize, v: u64) {
    buf[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(buf: &mut [u8], off: usize, v: u32) {
    buf[off..off + 4].copy_from_slice(&v.to_le_bytes());
}

fn need_header(buf: &[u8]) -> Result<()> {
    if buf.len() < HEADER_SIZE {
        return Err(Error::Internal(format!(
            "tree block buffer of {} bytes is shorter than the {HEADER_SIZE}-byte header",
            buf.len()
        )));
    }
    Ok(())
}

/// Where a block is, from its own header, for error messages. `buf` holds a whole header.
fn header_loc(buf: &[u8]) -> Location {
    Location::block(Some(le_u64(buf, OFF_OWNER)), le_u64(buf, OFF_BYTENR))
}

/// A block edit the engine should never ask for (a slot out of range, an item that does not
/// fit, a block of the wrong shape): an engine bug, `Internal`, which stops changes.
fn misuse(loc: Location, reason: impl std::fmt::Display) -> Error {
    Error::Internal(format!("{loc}: {reason}"))
}

/// Decodes the header of a buffer (at least [`HEADER_SIZE`] bytes).
pub(crate) fn read_header(buf: &[u8]) -> Result<Header> {
    need_header(buf)?;
    Ok(Header::parse(buf))
}

/// Sets the logical address the block claims to live at.
pub(crate) fn set_bytenr(buf: &mut [u8], bytenr: u64) -> Result<()> {
    need_header(buf)?;
    put_u64(buf, OFF_BYTENR, bytenr);
    Ok(())
}

/// Sets the transaction generation that wrote the block.
pub(crate) fn set_generation(buf: &mut [u8], generation: u64) -> Result<()> {
    need_header(buf)?;
    put_u64(buf, OFF_GENERATION, generation);
    Ok(())
}

/// Sets the owner (tree id) of the block.
pub(crate) fn set_owner(buf: &mut [u8], owner: u64) -> Result<()> {
    need_header(buf)?;
    put_u64(buf, OFF_OWNER, owner);
    Ok(())
}

/// Sets the low 56 flag bits (`HEADER_FLAG_WRITTEN`, `HEADER_FLAG_RELOC`), keeping the backref
/// revision. Flags with any of the top 8 bits set are [`Error::Invalid`].
pub(crate) fn set_flags(buf: &mut [u8], flags: u64) -> Result<()> {
    need_header(buf)?;
    if flags & !FLAGS_MASK != 0 {
        return Err(misuse(
            header_loc(buf),
            format!("flags {flags:#x} reach into the backref revision byte"),
        ));
    }
    let old = le_u64(buf, OFF_FLAGS);
    put_u64(buf, OFF_FLAGS, (old & !FLAGS_MASK) | flags);
    Ok(())
}

/// Sets the backref revision (top byte of the flags word; 1 = mixed backrefs).
pub(crate) fn set_backref_rev(buf: &mut [u8], rev: u8) -> Result<()> {
    need_header(buf)?;
    let old = le_u64(buf, OFF_FLAGS);
    put_u64(buf, OFF_FLAGS, (old & FLAGS_MASK) | ((rev as u64) << 56));
    Ok(())
}

#[cfg(test)]
/// Sets the item/pointer count of a raw buffer. This changes the layout: a view made afterwards
/// re-validates it. Prefer the view methods, which keep the count right.
pub(crate) fn set_nritems(buf: &mut [u8], nritems: u32) -> Result<()> {
    need_header(buf)?;
    put_u32(buf, OFF_NRITEMS, nritems);
    Ok(())
}

/// Header fields of a new block. `Default` gives zeros, no flags and backref revision 1
/// (mixed backrefs, what every current filesystem uses).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NewHeader {
    pub bytenr: u64,
    pub owner: u64,
    pub generation: u64,
    pub fsid: [u8; 16],
    pub chunk_tree_uuid: [u8; 16],
    /// Low 56 flag bits.
    pub flags: u64,
    pub backref_rev: u8,
}

impl Default for NewHeader {
    fn default() -> Self {
        NewHeader {
            bytenr: 0,
            owner: 0,
            generation: 0,
            fsid: [0; 16],
            chunk_tree_uuid: [0; 16],
            flags: 0,
            backref_rev: MIXED_BACKREF_REV as u8,
        }
    }
}

fn check_block_len(buf: &[u8]) -> Result<()> {
    if buf.len() <= HEADER_SIZE || buf.len() > MAX_NODESIZE {
        return Err(Error::Internal(format!(
            "tree block buffer of {} bytes: must be more than {HEADER_SIZE} and at most \
             {MAX_NODESIZE}",
            buf.len()
        )));
    }
    Ok(())
}

/// Zeroes the whole buffer and writes a header for an empty block (`nritems` 0) at `level`.
/// The checksum is left zero until [`finalize`].
pub(crate) fn init_empty(buf: &mut [u8], level: u8, h: &NewHeader) -> Result<()> {
    check_block_len(buf)?;
    if level >= MAX_LEVEL {
        return Err(Error::Internal(format!(
            "new tree block at {}: level {level} >= {MAX_LEVEL}",
            h.bytenr
        )));
    }
    if h.flags & !FLAGS_MASK != 0 {
        return Err(Error::Internal(format!(
            "new tree block at {}: flags {:#x} reach into the backref revision byte",
            h.bytenr, h.flags
        )));
    }
    buf.fill(0);
    buf[OFF_FSID..OFF_FSID + 16].copy_from_slice(&h.fsid);
    put_u64(buf, OFF_BYTENR, h.bytenr);
    put_u64(buf, OFF_FLAGS, h.flags | ((h.backref_rev as u64) << 56));
    buf[OFF_CHUNK_TREE_UUID..OFF_CHUNK_TREE_UUID + 16].copy_from_slice(&h.chunk_tree_uuid);
    put_u64(buf, OFF_GENERATION, h.generation);
    put_u64(buf, OFF_OWNER, h.owner);
    put_u32(buf, OFF_NRITEMS, 0);
    buf[OFF_LEVEL] = level;
    Ok(())
}

/// Checks the layout of a whole block (leaf or node) as a view would, without making one.
/// A node with no pointers passes here (it is a legal intermediate state), although the tree
/// checker rejects it on disk.
pub(crate) fn check_layout(buf: &[u8]) -> Result<()> {
    check_block_len(buf)?;
    if buf[OFF_LEVEL] == 0 {
        validate_leaf(buf)
    } else {
        validate_node(buf)
    }
}

/// Checks the layout ([`check_layout`]) and stores the checksum of bytes `[32, nodesize)` in
/// the first 32 bytes (zero padded past the algorithm's size). A block whose layout is
/// inconsistent is refused, so a bug upstream never gets a valid checksum. Flags (for example
/// `HEADER_FLAG_WRITTEN`) are the caller's to set before.
pub(crate) fn finalize(buf: &mut [u8], csum_type: CsumType) -> Result<()> {
    check_layout(buf)?;
    let c = csum_type.compute(&buf[CSUM_SIZE..]);
    buf[..CSUM_SIZE].copy_from_slice(&c);
    Ok(())
}

fn validate_leaf(buf: &[u8]) -> Result<()> {
    check_block_len(buf)?;
    let loc = || header_loc(buf);
    if buf[OFF_LEVEL] != 0 {
        return Err(misuse(
            loc(),
            format!("level {} is not a leaf", buf[OFF_LEVEL]),
        ));
    }
    let n = le_u32(buf, OFF_NRITEMS) as usize;
    crate::io::disk_io::check_leaf_items(buf, n, &|slot| {
        let l = loc();
        match slot {
            Some(s) => l.with_slot(s),
            None => l,
        }
    })?;
    Ok(())
}

fn validate_node(buf: &[u8]) -> Result<()> {
    check_block_len(buf)?;
    let loc = || header_loc(buf);
    let level = buf[OFF_LEVEL];
    if level == 0 || level >= MAX_LEVEL {
        return Err(misuse(
            loc(),
            format!("level {level} is not a node level (1..{MAX_LEVEL})"),
        ));
    }
    let n = le_u32(buf, OFF_NRITEMS) as usize;
    if n > max_node_ptrs(buf.len()) {
        return Err(Error::corrupt(
            loc(),
            format!("node claims {n} pointers, more than fit"),
        ));
    }
    let mut prev: Option<Key> = None;
    for slot in 0..n {
        let rec = HEADER_SIZE + slot * KEY_PTR_SIZE;
        let key = Key::from_bytes(&buf[rec..rec + DISK_KEY_SIZE]);
        if let Some(p) = prev {
            if key <= p {
                return Err(Error::corrupt(
                    loc().with_slot(slot).with_key(key),
                    format!("key not greater than previous key {p}"),
                ));
            }
        }
        prev = Some(key);
    }
    Ok(())
}

/// Header setters shared by both views: they touch no layout field, so they cannot break the
/// view's invariants. Each view's engine callers use only some of them (the model tests use
/// all), hence the `dead_code` allowance on the generated methods.
macro_rules! header_setters {
    () => {
        /// The block's header.
        #[allow(dead_code)]
        pub(crate) fn header(&self) -> Header {
            Header::parse(self.buf)
        }
        /// The whole block.
        #[allow(dead_code)]
        pub(crate) fn as_bytes(&self) -> &[u8] {
            self.buf
        }
        /// Block size in bytes.
        #[allow(dead_code)]
        pub(crate) fn nodesize(&self) -> usize {
            self.buf.len()
        }
        /// Number of items (leaf) or pointers (node).
        #[allow(dead_code)]
        pub(crate) fn nritems(&self) -> usize {
            le_u32(self.buf, OFF_NRITEMS) as usize
        }
        #[allow(dead_code)]
        pub(crate) fn set_bytenr(&mut self, bytenr: u64) {
            put_u64(self.buf, OFF_BYTENR, bytenr);
        }
        #[allow(dead_code)]
        pub(crate) fn set_generation(&mut self, generation: u64) {
            put_u64(self.buf, OFF_GENERATION, generation);
        }
        #[allow(dead_code)]
        pub(crate) fn set_owner(&mut self, owner: u64) {
            put_u64(self.buf, OFF_OWNER, owner);
        }
        #[allow(dead_code)]
        pub(crate) fn set_fsid(&mut self, fsid: &[u8; 16]) {
            self.buf[OFF_FSID..OFF_FSID + 16].copy_from_slice(fsid);
        }
        #[allow(dead_code)]
        pub(crate) fn set_chunk_tree_uuid(&mut self, uuid: &[u8; 16]) {
            self.buf[OFF_CHUNK_TREE_UUID..OFF_CHUNK_TREE_UUID + 16].copy_from_slice(uuid);
        }
        /// See the free function [`set_flags`].
        #[allow(dead_code)]
        pub(crate) fn set_flags(&mut self, flags: u64) -> Result<()> {
            set_flags(self.buf, flags)
        }
        #[allow(dead_code)]
        pub(crate) fn set_backref_rev(&mut self, rev: u8) {
            let old = le_u64(self.buf, OFF_FLAGS);
            put_u64(
                self.buf,
                OFF_FLAGS,
                (old & FLAGS_MASK) | ((rev as u64) << 56),
            );
        }
        /// Stores the checksum; see the free function [`finalize`].
        #[allow(dead_code)]
        pub(crate) fn finalize(&mut self, csum_type: CsumType) -> Result<()> {
            finalize(self.buf, csum_type)
        }
        fn loc(&self) -> Location {
            header_loc(self.buf)
        }
        fn loc_slot(&self, slot: usize) -> Location {
            self.loc().with_slot(slot)
        }
        fn set_n(&mut self, n: usize) {
            put_u32(self.buf, OFF_NRITEMS, n as u32);
        }
    };
}

// ---------------------------------------------------------------------------------------------
// Leaves
// ---------------------------------------------------------------------------------------------

/// A mutable view of a leaf (level 0) whose layout has been validated.
#[derive(Debug)]
pub(crate) struct LeafMut<'a> {
    buf: &'a mut [u8],
}

/// What must grow in a leaf that has no room for it: see [`LeafMut::plan_split`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Growth {
    /// `items` new items, with `data_len` bytes of data in total, inserted together at the slot.
    Insert { items: usize, data_len: usize },
    /// The item at the slot grows by `extra` bytes of data.
    Extend { extra: usize },
}

/// How to make room in a leaf ([`LeafMut::plan_split`]). Slots are those of the leaf before
/// the split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeafSplit {
    /// The leaf has room already.
    NotNeeded,
    /// Move items `[at, n)` into one new, empty right leaf ([`split_leaf`]). The insert or
    /// extend then happens in the left leaf at the same slot when `into_right` is false, or in
    /// the right leaf at `slot - at` when it is true. Both leaves end up non-empty.
    One { at: usize, into_right: bool },
    /// No single split leaves room: the grown item must sit alone in a leaf. Use two new
    /// leaves, `middle` and `right`, placed after this one: `split_leaf(left, right, second)`,
    /// then `split_leaf(left, middle, first)`. For an insert `first == second == slot` and the
    /// new items go into the empty middle leaf at slot 0; for an extend `first == slot`,
    /// `second == slot + 1` and the item is slot 0 of the middle leaf.
    Two { first: usize, second: usize },
}

impl<'a> LeafMut<'a> {
    #[cfg(test)]
    /// Validates `buf` as a leaf and returns a view of it.
    pub(crate) fn new(buf: &'a mut [u8]) -> Result<LeafMut<'a>> {
        validate_leaf(buf)?;
        Ok(LeafMut { buf })
    }

    /// A view of a leaf whose layout is already known to be valid: a block read through
    /// `disk_io` (which checks every leaf it reads) or one these primitives built and changed
    /// since (they keep the invariants). Checks only the header (level, item count) instead of
    /// walking every item, which made each change of a full leaf cost O(items) in the write
    /// engine. Untrusted bytes go through [`LeafMut::new`]; [`finalize`] checks everything
    /// again before a block is written.
    pub(crate) fn trusted(buf: &'a mut [u8]) -> Result<LeafMut<'a>> {
        check_block_len(buf)?;
        if buf[OFF_LEVEL] != 0 {
            return Err(misuse(
                header_loc(buf),
                format!("level {} is not a leaf", buf[OFF_LEVEL]),
            ));
        }
        let n = le_u32(buf, OFF_NRITEMS) as usize;
        if n.checked_mul(ITEM_SIZE)
            .is_none_or(|s| s > buf.len() - HEADER_SIZE)
        {
            return Err(misuse(
                header_loc(buf),
                format!("leaf claims {n} items, more than fit"),
            ));
        }
        Ok(LeafMut { buf })
    }

    /// Initializes `buf` as an empty leaf ([`init_empty`] at level 0) and returns a view.
    pub(crate) fn init(buf: &'a mut [u8], h: &NewHeader) -> Result<LeafMut<'a>> {
        init_empty(buf, 0, h)?;
        Ok(LeafMut { buf })
    }

    header_setters!();

    // Internal accessors: valid while the invariants hold (slot < nritems).
    fn space(&self) -> usize {
        self.buf.len() - HEADER_SIZE
    }
    fn rec(slot: usize) -> usize {
        HEADER_SIZE + slot * ITEM_SIZE
    }
    fn off(&self, slot: usize) -> usize {
        le_u32(self.buf, Self::rec(slot) + DISK_KEY_SIZE) as usize
    }
    fn size(&self, slot: usize) -> usize {
        le_u32(self.buf, Self::rec(slot) + DISK_KEY_SIZE + 4) as usize
    }
    fn set_off(&mut self, slot: usize, off: usize) {
        put_u32(self.buf, Self::rec(slot) + DISK_KEY_SIZE, off as u32);
    }
    fn set_size(&mut self, slot: usize, size: usize) {
        put_u32(self.buf, Self::rec(slot) + DISK_KEY_SIZE + 4, size as u32);
    }
    fn key_at(&self, slot: usize) -> Key {
        let r = Self::rec(slot);
        Key::from_bytes(&self.buf[r..r + DISK_KEY_SIZE])
    }
    /// End (relative to the header) of item `slot`'s data; `slot` may equal nritems.
    fn data_end(&self, slot: usize) -> usize {
        if slot == 0 {
            self.space()
        } else {
            self.off(slot - 1)
        }
    }
    /// Start of the packed data run.
    fn data_start(&self) -> usize {
        self.data_end(self.nritems())
    }
    fn abs(rel: usize) -> usize {
        HEADER_SIZE + rel
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.nritems() {
            return Err(misuse(
                self.loc_slot(slot),
                format!("slot out of range, leaf has {} items", self.nritems()),
            ));
        }
        Ok(())
    }

    /// Free bytes between the item array and the item data.
    pub(crate) fn free_space(&self) -> usize {
        self.data_start() - self.nritems() * ITEM_SIZE
    }

    #[cfg(test)]
    /// Bytes used by the items of `slots` (records plus data); `slots` is half-open.
    pub(crate) fn used_bytes(&self, slots: Range<usize>) -> Result<usize> {
        let n = self.nritems();
        if slots.start > slots.end || slots.end > n {
            return Err(misuse(
                self.loc(),
                format!("slot range {slots:?} out of [0, {n})"),
            ));
        }
        if slots.is_empty() {
            return Ok(0);
        }
        Ok(self.data_end(slots.start) - self.off(slots.end - 1) + slots.len() * ITEM_SIZE)
    }

    #[cfg(test)]
    /// How many of the last items fit in `bytes` (records plus data): what a push to the right
    /// sibling can move when that sibling has `bytes` free.
    pub(crate) fn items_fitting_from_end(&self, bytes: usize) -> usize {
        let n = self.nritems();
        let mut used = 0;
        let mut count = 0;
        for slot in (0..n).rev() {
            used += self.size(slot) + ITEM_SIZE;
            if used > bytes {
                break;
            }
            count += 1;
        }
        count
    }

    #[cfg(test)]
    /// How many of the first items fit in `bytes`: what a push to the left sibling can move.
    pub(crate) fn items_fitting_from_start(&self, bytes: usize) -> usize {
        let n = self.nritems();
        let mut used = 0;
        let mut count = 0;
        for slot in 0..n {
            used += self.size(slot) + ITEM_SIZE;
            if used > bytes {
                break;
            }
            count += 1;
        }
        count
    }

    /// Key of item `slot`.
    pub(crate) fn key(&self, slot: usize) -> Result<Key> {
        self.check_slot(slot)?;
        Ok(self.key_at(slot))
    }

    /// First key, if the leaf has items.
    pub(crate) fn first_key(&self) -> Option<Key> {
        (self.nritems() > 0).then(|| self.key_at(0))
    }

    #[cfg(test)]
    /// Item record `slot` (key, data offset relative to the end of the header, size).
    pub(crate) fn item(&self, slot: usize) -> Result<ItemHeader> {
        self.check_slot(slot)?;
        let r = Self::rec(slot);
        Ok(ItemHeader::parse(&self.buf[r..r + ITEM_SIZE]))
    }

    #[cfg(test)]
    /// Data of item `slot`.
    pub(crate) fn item_data(&self, slot: usize) -> Result<&[u8]> {
        self.check_slot(slot)?;
        let o = Self::abs(self.off(slot));
        Ok(&self.buf[o..o + self.size(slot)])
    }

    /// Mutable data of item `slot`.
    pub(crate) fn item_data_mut(&mut self, slot: usize) -> Result<&mut [u8]> {
        self.check_slot(slot)?;
        let o = Self::abs(self.off(slot));
        let s = self.size(slot);
        Ok(&mut self.buf[o..o + s])
    }

    /// Checks that keys `first..=last` (already increasing among themselves) may sit at `slot`
    /// between the existing neighbours.
    fn check_fits_between(&self, slot: usize, first: Key, last: Key) -> Result<()> {
        if slot > 0 {
            let prev = self.key_at(slot - 1);
            if first <= prev {
                return Err(misuse(
                    self.loc_slot(slot).with_key(first),
                    format!("key not greater than the previous key {prev}"),
                ));
            }
        }
        if slot < self.nritems() {
            let next = self.key_at(slot);
            if last >= next {
                return Err(misuse(
                    self.loc_slot(slot).with_key(last),
                    format!("key not less than the next key {next}"),
                ));
            }
        }
        Ok(())
    }

    fn check_room(&self, slot: usize, what: &str, need: Option<usize>) -> Result<usize> {
        let free = self.free_space();
        match need {
            Some(need) if need <= free => Ok(need),
            Some(need) => Err(misuse(
                self.loc_slot(slot),
                format!("{what} needs {need} bytes, the leaf has {free} free"),
            )),
            None => Err(misuse(self.loc_slot(slot), format!("{what} is too large"))),
        }
    }

    /// Opens a gap of `count` records at `slot` and `data` bytes of data just before the data
    /// of the item now at `slot` (i.e. where items inserted at `slot` keep theirs). Moves the
    /// later items, fixes their offsets and the count. The caller has checked the room and
    /// writes the new records and data; returns the end of the gap's data (relative).
    fn open_gap(&mut self, slot: usize, count: usize, data: usize) -> usize {
        let n = self.nritems();
        let ds = self.data_start();
        let end = self.data_end(slot);
        if data > 0 {
            self.buf
                .copy_within(Self::abs(ds)..Self::abs(end), Self::abs(ds - data));
            for i in slot..n {
                let o = self.off(i);
                self.set_off(i, o - data);
            }
        }
        self.buf
            .copy_within(Self::rec(slot)..Self::rec(n), Self::rec(slot + count));
        self.set_n(n + count);
        end
    }

    /// Inserts one item with `data_len` bytes of zeroed data at `slot` (`slot <= nritems`) and
    /// returns its data for the caller to fill. The key must sort strictly between the
    /// neighbours.
    pub(crate) fn insert_item(
        &mut self,
        slot: usize,
        key: Key,
        data_len: usize,
    ) -> Result<&mut [u8]> {
        self.insert_items(slot, &[(key, data_len)])?;
        self.item_data_mut(slot)
    }

    /// Inserts items `(key, data_len)` at `slot, slot + 1, ...` with zeroed data. Keys must be
    /// strictly increasing and sort between the neighbours; all of them must fit.
    pub(crate) fn insert_items(&mut self, slot: usize, items: &[(Key, usize)]) -> Result<()> {
        let n = self.nritems();
        if slot > n {
            return Err(misuse(
                self.loc_slot(slot),
                format!("insert slot beyond the {n} items"),
            ));
        }
        let (Some(first), Some(last)) = (items.first(), items.last()) else {
            return Ok(());
        };
        for (i, w) in items.windows(2).enumerate() {
            if w[1].0 <= w[0].0 {
                return Err(misuse(
                    self.loc_slot(slot + i + 1).with_key(w[1].0),
                    format!("new keys not increasing (previous {})", w[0].0),
                ));
            }
        }
        self.check_fits_between(slot, first.0, last.0)?;
        let data = items
            .iter()
            .try_fold(0usize, |acc, (_, len)| acc.checked_add(*len));
        let need = data.and_then(|d| items.len().checked_mul(ITEM_SIZE)?.checked_add(d));
        self.check_room(slot, &format!("insert of {} items", items.len()), need)?;
        let data = data.unwrap_or(0);
        let end = self.open_gap(slot, items.len(), data);
        let mut cur = end;
        for (j, (key, len)) in items.iter().enumerate() {
            cur -= len;
            let r = Self::rec(slot + j);
            self.buf[r..r + DISK_KEY_SIZE].copy_from_slice(&key.to_bytes());
            self.set_off(slot + j, cur);
            self.set_size(slot + j, *len);
        }
        self.buf[Self::abs(end - data)..Self::abs(end)].fill(0);
        Ok(())
    }

    /// Deletes `count` items starting at `slot`; the data of the later items moves up to stay
    /// packed and the freed bytes are zeroed.
    pub(crate) fn delete_items(&mut self, slot: usize, count: usize) -> Result<()> {
        let n = self.nritems();
        if slot.checked_add(count).is_none_or(|e| e > n) {
            return Err(misuse(
                self.loc_slot(slot),
                format!("delete of {count} items beyond the {n} items"),
            ));
        }
        if count == 0 {
            return Ok(());
        }
        let ds = self.data_start();
        let end = self.data_end(slot);
        let last_start = self.off(slot + count - 1);
        let gone = end - last_start;
        if gone > 0 {
            self.buf
                .copy_within(Self::abs(ds)..Self::abs(last_start), Self::abs(ds + gone));
            for i in slot + count..n {
                let o = self.off(i);
                self.set_off(i, o + gone);
            }
        }
        self.buf
            .copy_within(Self::rec(slot + count)..Self::rec(n), Self::rec(slot));
        self.buf[Self::rec(n - count)..Self::rec(n)].fill(0);
        self.buf[Self::abs(ds)..Self::abs(ds + gone)].fill(0);
        self.set_n(n - count);
        Ok(())
    }

    /// Grows item `slot` by `extra` zeroed bytes at the end of its data.
    pub(crate) fn extend_item(&mut self, slot: usize, extra: usize) -> Result<()> {
        self.check_slot(slot)?;
        self.check_room(slot, &format!("extend by {extra} bytes"), Some(extra))?;
        if extra == 0 {
            return Ok(());
        }
        let n = self.nritems();
        let ds = self.data_start();
        let o = self.off(slot);
        let s = self.size(slot);
        // The item and everything after it move down; the item's end stays where it was.
        self.buf
            .copy_within(Self::abs(ds)..Self::abs(o + s), Self::abs(ds - extra));
        for i in slot..n {
            let oi = self.off(i);
            self.set_off(i, oi - extra);
        }
        self.set_size(slot, s + extra);
        self.buf[Self::abs(o + s - extra)..Self::abs(o + s)].fill(0);
        Ok(())
    }

    /// Shrinks item `slot` to `new_size` bytes. `from_end: true` cuts bytes off the end (keeps
    /// the first `new_size` bytes); `false` cuts them off the front (keeps the last `new_size`).
    pub(crate) fn truncate_item(
        &mut self,
        slot: usize,
        new_size: usize,
        from_end: bool,
    ) -> Result<()> {
        self.check_slot(slot)?;
        let s = self.size(slot);
        if new_size > s {
            return Err(misuse(
                self.loc_slot(slot).with_key(self.key_at(slot)),
                format!("truncate to {new_size} bytes of an item of {s} bytes"),
            ));
        }
        let cut = s - new_size;
        if cut == 0 {
            return Ok(());
        }
        let n = self.nritems();
        let ds = self.data_start();
        let o = self.off(slot);
        let keep_end = if from_end { o + new_size } else { o };
        self.buf
            .copy_within(Self::abs(ds)..Self::abs(keep_end), Self::abs(ds + cut));
        for i in slot..n {
            let oi = self.off(i);
            self.set_off(i, oi + cut);
        }
        self.set_size(slot, new_size);
        self.buf[Self::abs(ds)..Self::abs(ds + cut)].fill(0);
        Ok(())
    }

    /// Replaces the key of item `slot`; it must still sort strictly between the neighbours.
    pub(crate) fn set_key(&mut self, slot: usize, key: Key) -> Result<()> {
        self.check_slot(slot)?;
        if slot > 0 && key <= self.key_at(slot - 1) {
            return Err(misuse(
                self.loc_slot(slot).with_key(key),
                format!(
                    "key not greater than the previous key {}",
                    self.key_at(slot - 1)
                ),
            ));
        }
        if slot + 1 < self.nritems() && key >= self.key_at(slot + 1) {
            return Err(misuse(
                self.loc_slot(slot).with_key(key),
                format!("key not less than the next key {}", self.key_at(slot + 1)),
            ));
        }
        let r = Self::rec(slot);
        self.buf[r..r + DISK_KEY_SIZE].copy_from_slice(&key.to_bytes());
        Ok(())
    }

    /// Copies items `src[range]` into this leaf at `slot` (one data copy: a run of slots has
    /// one contiguous run of data). Checks order and room first; changes nothing on error.
    fn splice_in(&mut self, slot: usize, src: &LeafMut<'_>, range: Range<usize>) -> Result<()> {
        let count = range.len();
        if range.end > src.nritems() || slot > self.nritems() {
            return Err(misuse(
                self.loc_slot(slot),
                format!(
                    "moving items {range:?} of {} into a leaf of {}",
                    src.nritems(),
                    self.nritems()
                ),
            ));
        }
        if count == 0 {
            return Ok(());
        }
        self.check_fits_between(slot, src.key_at(range.start), src.key_at(range.end - 1))?;
        let src_end = src.data_end(range.start);
        let src_start = src.off(range.end - 1);
        let data = src_end - src_start;
        self.check_room(
            slot,
            &format!("moving {count} items"),
            Some(data + count * ITEM_SIZE),
        )?;
        let end = self.open_gap(slot, count, data);
        self.buf[Self::abs(end - data)..Self::abs(end)]
            .copy_from_slice(&src.buf[Self::abs(src_start)..Self::abs(src_end)]);
        self.buf[Self::rec(slot)..Self::rec(slot + count)]
            .copy_from_slice(&src.buf[Self::rec(range.start)..Self::rec(range.end)]);
        for i in slot..slot + count {
            let o = self.off(i);
            self.set_off(i, o + end - src_end);
        }
        Ok(())
    }

    /// Prefix sums of item footprints: `pre[i]` = bytes used by items `[0, i)`.
    fn prefix_used(&self) -> Vec<usize> {
        let n = self.nritems();
        let mut pre = Vec::with_capacity(n + 1);
        pre.push(0);
        for slot in 0..n {
            let last = pre.last().copied().unwrap_or(0);
            pre.push(last + self.size(slot) + ITEM_SIZE);
        }
        pre
    }

    /// Chooses how to split this leaf so that `growth` at `slot` fits.
    ///
    /// Appends (an insert at `slot == nritems`) leave this leaf as it is and put the new items
    /// alone in the right leaf, and inserts at slot 0 put them alone in the left leaf, so
    /// sequential inserts fill leaves completely; otherwise the split point that makes the
    /// fuller of the two leaves the least full is chosen. When no single split makes room,
    /// [`LeafSplit::Two`] gives the grown item a leaf of its own.
    ///
    /// Errors ([`Error::Invalid`]): slot out of range, or the grown item(s) would not fit even
    /// alone in an empty leaf.
    pub(crate) fn plan_split(&self, slot: usize, growth: Growth) -> Result<LeafSplit> {
        let n = self.nritems();
        let space = self.space();
        let (need, is_insert) = match growth {
            Growth::Insert { items, data_len } => {
                if slot > n {
                    return Err(misuse(
                        self.loc_slot(slot),
                        format!("insert slot beyond the {n} items"),
                    ));
                }
                let need = items
                    .checked_mul(ITEM_SIZE)
                    .and_then(|r| r.checked_add(data_len))
                    .filter(|&need| need <= space)
                    .ok_or_else(|| {
                        misuse(
                            self.loc_slot(slot),
                            format!(
                                "{items} new items with {data_len} bytes of data cannot fit in \
                                 a leaf of {} bytes",
                                self.buf.len()
                            ),
                        )
                    })?;
                (need, true)
            }
            Growth::Extend { extra } => {
                self.check_slot(slot)?;
                let alone = self.size(slot) + ITEM_SIZE;
                if extra > space - alone {
                    return Err(misuse(
                        self.loc_slot(slot).with_key(self.key_at(slot)),
                        format!(
                            "item of {} bytes grown by {extra} cannot fit in a leaf of {} bytes",
                            self.size(slot),
                            self.buf.len()
                        ),
                    ));
                }
                (extra, false)
            }
        };
        if need <= self.free_space() {
            return Ok(LeafSplit::NotNeeded);
        }
        let pre = self.prefix_used();
        let total = pre[n];
        // Sizes of (left, right) when items [at, n) move right and the growth goes left or right.
        let option = |at: usize, into_right: bool| -> Option<usize> {
            let (l, r) = if into_right {
                (pre[at], total - pre[at] + need)
            } else {
                (pre[at] + need, total - pre[at])
            };
            // The target must be on the chosen side; neither leaf may end up empty.
            let target_ok = if is_insert {
                if into_right {
                    at <= slot
                } else {
                    at >= slot
                }
            } else if into_right {
                at <= slot
            } else {
                at > slot
            };
            let left_items = at + usize::from(is_insert && !into_right);
            let right_items = n - at + usize::from(is_insert && into_right);
            (target_ok && left_items > 0 && right_items > 0 && l <= space && r <= space)
                .then_some(l.max(r))
        };
        if is_insert && n > 0 && slot == n && option(n, true).is_some() {
            return Ok(LeafSplit::One {
                at: n,
                into_right: true,
            });
        }
        if is_insert && n > 0 && slot == 0 && option(0, false).is_some() {
            return Ok(LeafSplit::One {
                at: 0,
                into_right: false,
            });
        }
        let mut best: Option<(usize, usize, bool)> = None;
        for at in 0..=n {
            for into_right in [false, true] {
                if let Some(score) = option(at, into_right) {
                    if best.is_none_or(|(s, _, _)| score < s) {
                        best = Some((score, at, into_right));
                    }
                }
            }
        }
        Ok(match best {
            Some((_, at, into_right)) => LeafSplit::One { at, into_right },
            None => LeafSplit::Two {
                first: slot,
                second: if is_insert { slot } else { slot + 1 },
            },
        })
    }
}

/// Moves the last `count` items of `left` to the front of `right`. `left`'s last key must be
/// below `right`'s first key and the items must fit in `right`'s free space. Returns `right`'s
/// first key afterwards (for the parent pointer); `None` only if `right` is still empty.
pub(crate) fn push_leaf_right(
    left: &mut LeafMut<'_>,
    right: &mut LeafMut<'_>,
    count: usize,
) -> Result<Option<Key>> {
    let nl = left.nritems();
    if count > nl {
        return Err(misuse(
            left.loc(),
            format!("push of {count} items right, the leaf has {nl}"),
        ));
    }
    right.splice_in(0, left, nl - count..nl)?;
    left.delete_items(nl - count, count)?;
    Ok(right.first_key())
}

/// Moves the first `count` items of `right` to the end of `left`. Returns `right`'s first key
/// afterwards, `None` when `right` is now empty (the caller removes it from the parent).
pub(crate) fn push_leaf_left(
    left: &mut LeafMut<'_>,
    right: &mut LeafMut<'_>,
    count: usize,
) -> Result<Option<Key>> {
    let nr = right.nritems();
    if count > nr {
        return Err(misuse(
            right.loc(),
            format!("push of {count} items left, the leaf has {nr}"),
        ));
    }
    let nl = left.nritems();
    left.splice_in(nl, right, 0..count)?;
    right.delete_items(0, count)?;
    Ok(right.first_key())
}

/// Moves items `[at, n)` of `left` into `right`, which must be empty (a freshly initialized
/// leaf). Returns `right`'s first key (`None` if `at == n`).
pub(crate) fn split_leaf(
    left: &mut LeafMut<'_>,
    right: &mut LeafMut<'_>,
    at: usize,
) -> Result<Option<Key>> {
    if right.nritems() != 0 {
        return Err(misuse(
            right.loc(),
            format!("split target has {} items, must be empty", right.nritems()),
        ));
    }
    let nl = left.nritems();
    if at > nl {
        return Err(misuse(
            left.loc_slot(at),
            format!("split point beyond the {nl} items"),
        ));
    }
    push_leaf_right(left, right, nl - at)
}

/// Moves every item of `right` into `left` when they fit; `right` is left empty for the caller
/// to free (and to remove from the parent).
pub(crate) fn merge_leaves(left: &mut LeafMut<'_>, right: &mut LeafMut<'_>) -> Result<()> {
    let nr = right.nritems();
    push_leaf_left(left, right, nr).map(|_| ())
}

// ---------------------------------------------------------------------------------------------
// Nodes
// ---------------------------------------------------------------------------------------------

/// A mutable view of an internal node (level 1 to 7) whose layout has been validated.
#[derive(Debug)]
pub(crate) struct NodeMut<'a> {
    buf: &'a mut [u8],
}

impl<'a> NodeMut<'a> {
    #[cfg(test)]
    /// Validates `buf` as a node and returns a view of it. A node with no pointers is accepted
    /// (a fresh split target); the tree checker rejects such a block on disk.
    pub(crate) fn new(buf: &'a mut [u8]) -> Result<NodeMut<'a>> {
        validate_node(buf)?;
        Ok(NodeMut { buf })
    }

    /// A view of a node already known to be valid (see [`LeafMut::trusted`]): checks the
    /// header only, not the order of every key.
    pub(crate) fn trusted(buf: &'a mut [u8]) -> Result<NodeMut<'a>> {
        check_block_len(buf)?;
        let level = buf[OFF_LEVEL];
        if level == 0 || level >= MAX_LEVEL {
            return Err(misuse(
                header_loc(buf),
                format!("level {level} is not a node level (1..{MAX_LEVEL})"),
            ));
        }
        let n = le_u32(buf, OFF_NRITEMS) as usize;
        if n > max_node_ptrs(buf.len()) {
            return Err(misuse(
                header_loc(buf),
                format!("node claims {n} pointers, more than fit"),
            ));
        }
        Ok(NodeMut { buf })
    }

    /// Initializes `buf` as an empty node at `level` (1..8) and returns a view.
    pub(crate) fn init(buf: &'a mut [u8], level: u8, h: &NewHeader) -> Result<NodeMut<'a>> {
        if level == 0 {
            return Err(Error::Internal(format!(
                "new node at {}: level 0 is a leaf",
                h.bytenr
            )));
        }
        init_empty(buf, level, h)?;
        Ok(NodeMut { buf })
    }

    header_setters!();

    fn rec(slot: usize) -> usize {
        HEADER_SIZE + slot * KEY_PTR_SIZE
    }
    fn key_at(&self, slot: usize) -> Key {
        let r = Self::rec(slot);
        Key::from_bytes(&self.buf[r..r + DISK_KEY_SIZE])
    }
    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.nritems() {
            return Err(misuse(
                self.loc_slot(slot),
                format!("slot out of range, node has {} pointers", self.nritems()),
            ));
        }
        Ok(())
    }

    /// The node's level (1..8).
    pub(crate) fn level(&self) -> u8 {
        self.buf[OFF_LEVEL]
    }

    /// Most pointers this node holds.
    pub(crate) fn max_ptrs(&self) -> usize {
        max_node_ptrs(self.buf.len())
    }

    /// Pointers that can still be added.
    pub(crate) fn free_ptrs(&self) -> usize {
        self.max_ptrs() - self.nritems()
    }

    #[cfg(test)]
    /// Key of pointer `slot`.
    pub(crate) fn key(&self, slot: usize) -> Result<Key> {
        self.check_slot(slot)?;
        Ok(self.key_at(slot))
    }

    /// First key, if the node has pointers.
    pub(crate) fn first_key(&self) -> Option<Key> {
        (self.nritems() > 0).then(|| self.key_at(0))
    }

    #[cfg(test)]
    /// Key pointer `slot`.
    pub(crate) fn ptr(&self, slot: usize) -> Result<KeyPtr> {
        self.check_slot(slot)?;
        let r = Self::rec(slot);
        Ok(KeyPtr::parse(&self.buf[r..r + KEY_PTR_SIZE]))
    }

    fn check_fits_between(&self, slot: usize, first: Key, last: Key) -> Result<()> {
        if slot > 0 {
            let prev = self.key_at(slot - 1);
            if first <= prev {
                return Err(misuse(
                    self.loc_slot(slot).with_key(first),
                    format!("key not greater than the previous key {prev}"),
                ));
            }
        }
        if slot < self.nritems() {
            let next = self.key_at(slot);
            if last >= next {
                return Err(misuse(
                    self.loc_slot(slot).with_key(last),
                    format!("key not less than the next key {next}"),
                ));
            }
        }
        Ok(())
    }

    fn check_room(&self, slot: usize, count: usize) -> Result<()> {
        if count > self.free_ptrs() {
            return Err(misuse(
                self.loc_slot(slot),
                format!(
                    "{count} pointers do not fit, the node has room for {}",
                    self.free_ptrs()
                ),
            ));
        }
        Ok(())
    }

    fn write_ptr(&mut self, slot: usize, key: &Key, blockptr: u64, generation: u64) {
        let r = Self::rec(slot);
        self.buf[r..r + DISK_KEY_SIZE].copy_from_slice(&key.to_bytes());
        put_u64(self.buf, r + DISK_KEY_SIZE, blockptr);
        put_u64(self.buf, r + DISK_KEY_SIZE + 8, generation);
    }

    /// Inserts a pointer at `slot` (`slot <= nritems`); the key must sort strictly between the
    /// neighbours and the node must have room.
    pub(crate) fn insert_ptr(
        &mut self,
        slot: usize,
        key: Key,
        blockptr: u64,
        generation: u64,
    ) -> Result<()> {
        let n = self.nritems();
        if slot > n {
            return Err(misuse(
                self.loc_slot(slot),
                format!("insert slot beyond the {n} pointers"),
            ));
        }
        self.check_room(slot, 1)?;
        self.check_fits_between(slot, key, key)?;
        self.buf
            .copy_within(Self::rec(slot)..Self::rec(n), Self::rec(slot + 1));
        self.write_ptr(slot, &key, blockptr, generation);
        self.set_n(n + 1);
        Ok(())
    }

    /// Deletes `count` pointers starting at `slot`; freed records are zeroed.
    pub(crate) fn delete_ptrs(&mut self, slot: usize, count: usize) -> Result<()> {
        let n = self.nritems();
        if slot.checked_add(count).is_none_or(|e| e > n) {
            return Err(misuse(
                self.loc_slot(slot),
                format!("delete of {count} pointers beyond the {n} pointers"),
            ));
        }
        self.buf
            .copy_within(Self::rec(slot + count)..Self::rec(n), Self::rec(slot));
        self.buf[Self::rec(n - count)..Self::rec(n)].fill(0);
        self.set_n(n - count);
        Ok(())
    }

    /// Points `slot` at another child block (after a COW), keeping its key.
    pub(crate) fn set_ptr(&mut self, slot: usize, blockptr: u64, generation: u64) -> Result<()> {
        self.check_slot(slot)?;
        let r = Self::rec(slot);
        put_u64(self.buf, r + DISK_KEY_SIZE, blockptr);
        put_u64(self.buf, r + DISK_KEY_SIZE + 8, generation);
        Ok(())
    }

    /// Replaces the key of pointer `slot` (when the child's first key changed); it must still
    /// sort strictly between the neighbours.
    pub(crate) fn set_key(&mut self, slot: usize, key: Key) -> Result<()> {
        self.check_slot(slot)?;
        if slot > 0 && key <= self.key_at(slot - 1) {
            return Err(misuse(
                self.loc_slot(slot).with_key(key),
                format!(
                    "key not greater than the previous key {}",
                    self.key_at(slot - 1)
                ),
            ));
        }
        if slot + 1 < self.nritems() && key >= self.key_at(slot + 1) {
            return Err(misuse(
                self.loc_slot(slot).with_key(key),
                format!("key not less than the next key {}", self.key_at(slot + 1)),
            ));
        }
        let r = Self::rec(slot);
        self.buf[r..r + DISK_KEY_SIZE].copy_from_slice(&key.to_bytes());
        Ok(())
    }

    fn splice_in(&mut self, slot: usize, src: &NodeMut<'_>, range: Range<usize>) -> Result<()> {
        let count = range.len();
        if range.end > src.nritems() || slot > self.nritems() {
            return Err(misuse(
                self.loc_slot(slot),
                format!(
                    "moving pointers {range:?} of {} into a node of {}",
                    src.nritems(),
                    self.nritems()
                ),
            ));
        }
        if count == 0 {
            return Ok(());
        }
        if src.level() != self.level() {
            return Err(misuse(
                self.loc(),
                format!(
                    "moving pointers from a level {} node into a level {} node",
                    src.level(),
                    self.level()
                ),
            ));
        }
        self.check_room(slot, count)?;
        self.check_fits_between(slot, src.key_at(range.start), src.key_at(range.end - 1))?;
        let n = self.nritems();
        self.buf
            .copy_within(Self::rec(slot)..Self::rec(n), Self::rec(slot + count));
        self.buf[Self::rec(slot)..Self::rec(slot + count)]
            .copy_from_slice(&src.buf[Self::rec(range.start)..Self::rec(range.end)]);
        self.set_n(n + count);
        Ok(())
    }
}

/// Moves the last `count` pointers of `left` to the front of `right` (same level). Returns
/// `right`'s first key afterwards.
pub(crate) fn push_node_right(
    left: &mut NodeMut<'_>,
    right: &mut NodeMut<'_>,
    count: usize,
) -> Result<Option<Key>> {
    let nl = left.nritems();
    if count > nl {
        return Err(misuse(
            left.loc(),
            format!("push of {count} pointers right, the node has {nl}"),
        ));
    }
    right.splice_in(0, left, nl - count..nl)?;
    left.delete_ptrs(nl - count, count)?;
    Ok(right.first_key())
}

/// Moves the first `count` pointers of `right` to the end of `left` (same level). Returns
/// `right`'s first key afterwards, `None` when it is now empty.
pub(crate) fn push_node_left(
    left: &mut NodeMut<'_>,
    right: &mut NodeMut<'_>,
    count: usize,
) -> Result<Option<Key>> {
    let nr = right.nritems();
    if count > nr {
        return Err(misuse(
            right.loc(),
            format!("push of {count} pointers left, the node has {nr}"),
        ));
    }
    let nl = left.nritems();
    left.splice_in(nl, right, 0..count)?;
    right.delete_ptrs(0, count)?;
    Ok(right.first_key())
}

/// Moves pointers `[at, n)` of `left` into the empty node `right` of the same level (the usual
/// split point is `n / 2`). Returns `right`'s first key.
pub(crate) fn split_node(
    left: &mut NodeMut<'_>,
    right: &mut NodeMut<'_>,
    at: usize,
) -> Result<Option<Key>> {
    if right.nritems() != 0 {
        return Err(misuse(
            right.loc(),
            format!(
                "split target has {} pointers, must be empty",
                right.nritems()
            ),
        ));
    }
    let nl = left.nritems();
    if at > nl {
        return Err(misuse(
            left.loc_slot(at),
            format!("split point beyond the {nl} pointers"),
        ));
    }
    push_node_right(left, right, nl - at)
}

/// Moves every pointer of `right` into `left` when they fit; `right` is left empty.
pub(crate) fn merge_nodes(left: &mut NodeMut<'_>, right: &mut NodeMut<'_>) -> Result<()> {
    let nr = right.nritems();
    push_node_left(left, right, nr).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(o: u64) -> Key {
        Key::new(o, 1, 0)
    }

    fn leaf_buf(len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        init_empty(
            &mut b,
            0,
            &NewHeader {
                bytenr: 4096,
                owner: 5,
                ..Default::default()
            },
        )
        .unwrap();
        b
    }

    #[test]
    fn insert_extend_truncate_keep_packing() {
        let mut b = leaf_buf(4096);
        let mut l = LeafMut::new(&mut b).unwrap();
        assert_eq!(l.free_space(), 4096 - HEADER_SIZE);
        l.insert_item(0, k(10), 4).unwrap().copy_from_slice(b"aaaa");
        l.insert_item(0, k(5), 2).unwrap().copy_from_slice(b"bb");
        l.insert_item(2, k(20), 3).unwrap().copy_from_slice(b"ccc");
        assert_eq!(l.item_data(0).unwrap(), b"bb");
        assert_eq!(l.item_data(1).unwrap(), b"aaaa");
        assert_eq!(l.item_data(2).unwrap(), b"ccc");
        l.extend_item(1, 2).unwrap();
        assert_eq!(l.item_data(1).unwrap(), b"aaaa\0\0");
        l.item_data_mut(1).unwrap()[4..].copy_from_slice(b"zz");
        l.truncate_item(1, 3, false).unwrap();
        assert_eq!(l.item_data(1).unwrap(), b"azz");
        l.truncate_item(1, 1, true).unwrap();
        assert_eq!(l.item_data(1).unwrap(), b"a");
        assert_eq!(l.item_data(0).unwrap(), b"bb");
        assert_eq!(l.item_data(2).unwrap(), b"ccc");
        l.delete_items(0, 2).unwrap();
        assert_eq!(l.nritems(), 1);
        assert_eq!(l.item_data(0).unwrap(), b"ccc");
        assert_eq!(l.free_space(), 4096 - HEADER_SIZE - ITEM_SIZE - 3);
        check_layout(&b).unwrap();
        // Everything outside the header, the one record and its data is zero.
        let used = HEADER_SIZE + ITEM_SIZE;
        assert!(b[used..4096 - 3].iter().all(|&x| x == 0));
    }

    #[test]
    fn bad_requests_change_nothing() {
        let mut b = leaf_buf(4096);
        let mut l = LeafMut::new(&mut b).unwrap();
        l.insert_item(0, k(10), 10).unwrap();
        l.insert_item(1, k(20), 10).unwrap();
        let before = l.as_bytes().to_vec();
        assert!(matches!(
            l.insert_item(1, k(10), 1),
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            l.insert_item(1, k(25), 1),
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            l.insert_item(3, k(30), 1),
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            l.insert_item(2, k(30), 4000),
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            l.insert_items(2, &[(k(30), 1), (k(30), 1)]),
            Err(Error::Internal(_))
        ));
        assert!(matches!(
            l.insert_items(2, &[(k(30), usize::MAX), (k(31), 2)]),
            Err(Error::Internal(_))
        ));
        assert!(matches!(l.delete_items(1, 2), Err(Error::Internal(_))));
        assert!(matches!(
            l.delete_items(usize::MAX, 2),
            Err(Error::Internal(_))
        ));
        assert!(matches!(l.extend_item(0, 5000), Err(Error::Internal(_))));
        assert!(matches!(
            l.truncate_item(0, 11, true),
            Err(Error::Internal(_))
        ));
        assert!(matches!(l.set_key(0, k(20)), Err(Error::Internal(_))));
        assert!(matches!(l.item_data(2), Err(Error::Internal(_))));
        assert_eq!(l.as_bytes(), &before[..]);
        let e = l.insert_item(1, k(10), 1).unwrap_err().to_string();
        assert!(e.contains("block 4096") && e.contains("slot 1"), "{e}");
    }

    #[test]
    fn views_refuse_bad_buffers_without_panicking() {
        // Too short, too long, wrong level.
        assert!(LeafMut::new(&mut [0u8; 50]).is_err());
        assert!(LeafMut::new(&mut vec![0u8; MAX_NODESIZE + 1]).is_err());
        let mut b = leaf_buf(4096);
        b[OFF_LEVEL] = 1;
        assert!(matches!(LeafMut::new(&mut b), Err(Error::Internal(_))));
        assert!(NodeMut::new(&mut b).is_ok());
        b[OFF_LEVEL] = 0;
        assert!(matches!(NodeMut::new(&mut b), Err(Error::Internal(_))));
        // Too many items; an item off the end; an unpacked item; keys out of order.
        let mut b = leaf_buf(4096);
        set_nritems(&mut b, 1000).unwrap();
        assert!(matches!(LeafMut::new(&mut b), Err(Error::Corrupt { .. })));
        let mut b = leaf_buf(4096);
        {
            let mut l = LeafMut::new(&mut b).unwrap();
            l.insert_item(0, k(1), 8).unwrap();
            l.insert_item(1, k(2), 8).unwrap();
        }
        let good = b.clone();
        put_u32(&mut b, HEADER_SIZE + DISK_KEY_SIZE, u32::MAX);
        assert!(matches!(LeafMut::new(&mut b), Err(Error::Corrupt { .. })));
        assert!(finalize(&mut b, CsumType::Crc32c).is_err());
        let mut b = good.clone();
        put_u32(&mut b, HEADER_SIZE + ITEM_SIZE + DISK_KEY_SIZE + 4, 7);
        assert!(matches!(LeafMut::new(&mut b), Err(Error::Corrupt { .. })));
        let mut b = good.clone();
        b[HEADER_SIZE + ITEM_SIZE..HEADER_SIZE + ITEM_SIZE + DISK_KEY_SIZE]
            .copy_from_slice(&k(0).to_bytes());
        let e = LeafMut::new(&mut b).unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }) && e.to_string().contains("slot 1"));
        // Arbitrary bytes never panic, whatever they claim.
        let mut x = 0x1234_5678_9abc_def0u64;
        for round in 0..2000 {
            let mut b = good.clone();
            for _ in 0..(1 + round % 8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let at = (x as usize >> 8) % 260;
                b[at] = x as u8;
            }
            if let Ok(mut l) = LeafMut::new(&mut b) {
                let n = l.nritems();
                let _ = l.insert_item(n, Key::MAX, 3);
                let _ = l.extend_item(0, 3);
                let _ = l.truncate_item(0, 1, false);
                let _ = l.delete_items(0, 1);
            }
            let _ = NodeMut::new(&mut b).map(|mut nd| nd.delete_ptrs(0, 1));
        }
    }

    #[test]
    fn split_plans() {
        // 4 items of 900 bytes in a 4 KiB leaf: (925 * 4 = 3700 of 3995 used).
        let mut b = leaf_buf(4096);
        let mut l = LeafMut::new(&mut b).unwrap();
        for i in 0..4 {
            l.insert_item(i, k(i as u64 * 10), 900).unwrap();
        }
        let ins = |data_len| Growth::Insert { items: 1, data_len };
        assert_eq!(l.plan_split(2, ins(200)).unwrap(), LeafSplit::NotNeeded);
        // Append: new item alone on the right; prepend: alone on the left.
        assert_eq!(
            l.plan_split(4, ins(1000)).unwrap(),
            LeafSplit::One {
                at: 4,
                into_right: true
            }
        );
        assert_eq!(
            l.plan_split(0, ins(1000)).unwrap(),
            LeafSplit::One {
                at: 0,
                into_right: false
            }
        );
        // In the middle: balanced.
        match l.plan_split(2, ins(1000)).unwrap() {
            LeafSplit::One { at: 2, .. } => {}
            p => panic!("{p:?}"),
        }
        // A huge item in the middle needs a leaf of its own.
        assert_eq!(
            l.plan_split(2, ins(3900)).unwrap(),
            LeafSplit::Two {
                first: 2,
                second: 2
            }
        );
        assert_eq!(
            l.plan_split(2, Growth::Extend { extra: 3000 }).unwrap(),
            LeafSplit::Two {
                first: 2,
                second: 3
            }
        );
        assert!(l.plan_split(2, ins(3971)).is_err());
        assert!(l.plan_split(2, ins(3970)).is_ok());
        assert!(l.plan_split(2, Growth::Extend { extra: 3071 }).is_err());
        assert!(l.plan_split(4, Growth::Extend { extra: 1 }).is_err());
    }
}
