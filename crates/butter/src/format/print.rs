//! Text dumps of tree blocks, items and superblocks, laid out line for line like btrfs-progs
//! 6.2 `btrfs inspect-internal dump-tree` and `dump-super`, so the two can be diffed.
//!
//! What is printed, and how it differs from btrfs-progs 6.2:
//! - Tree block: `leaf|node BYTENR ...` header lines, `fs uuid`, `chunk uuid`, then one
//!   `\titem N key (...) itemoff O itemsize S` line plus body lines per leaf item, or one
//!   `\tkey (...) block B gen G` line per node pointer.
//! - Timestamps are printed in UTC (progs uses the local time zone; run it with `TZ=UTC` to
//!   compare).
//! - EXTENT_CSUM items print their range only (progs without `--csum-items`).
//! - Item types 6.2 does not know but later versions do (EXTENT_OWNER_REF, RAID_STRIPE, the
//!   RAID_STRIPE_TREE objectid, owner refs inline in extent items) are named like newer progs.
//! - Where progs would read past an item or a block (garbage on disk), this module prints a line
//!   starting with `corrupt` and carries on with the next item; nothing here panics on any input.
//!   Progs reports a bad item pointer on stderr and stops; here each bad slot gets a
//!   `\tcorrupt item N ...` line.
//! - [`print_superblock_bytes`] prints from the raw bytes, so the two deprecated fields the
//!   decoded superblock does not keep (`log_root_transid`, `leafsize`) come out as stored, and
//!   superblocks that fail validation (bad magic or checksum) print too, as progs does.
//! - The `superblock: bytenr=..., device=...` banner and the `btrfs-progs v6.2` line are left to
//!   the caller (the CLI knows the device name).

use super::csum::CsumType;
use super::header::{Header, ItemHeader, KeyPtr};
use super::items::{
    parse_extent_data_ref, BackRef, BlockGroupItem, ChunkItem, DevExtent, DirItem, ExtentItem,
    FileExtentBody, FileExtentItem, FreeSpaceInfo, InodeExtref, InodeItem, InodeRef, RootItem,
    RootRef, Timespec,
};

/// What a block group or chunk of type and profile bits `flags` (`BLOCK_GROUP_*`) holds, as
/// btrfs-progs names it: "Data", "Metadata", "System", or "Data+Metadata" (mixed groups).
pub fn block_group_kind(flags: u64) -> &'static str {
    let d = flags & BLOCK_GROUP_DATA != 0;
    let m = flags & BLOCK_GROUP_METADATA != 0;
    match (d, m, flags & BLOCK_GROUP_SYSTEM != 0) {
        (_, _, true) => "System",
        (true, true, _) => "Data+Metadata",
        (true, false, _) => "Data",
        _ => "Metadata",
    }
}

/// The profile in `flags` (`BLOCK_GROUP_*`) as btrfs-progs names it: "single", "DUP",
/// "RAID1", ...
pub fn block_group_profile(flags: u64) -> &'static str {
    match flags & BLOCK_GROUP_PROFILE_MASK {
        BLOCK_GROUP_DUP => "DUP",
        BLOCK_GROUP_RAID1 => "RAID1",
        BLOCK_GROUP_RAID0 => "RAID0",
        BLOCK_GROUP_RAID10 => "RAID10",
        BLOCK_GROUP_RAID5 => "RAID5",
        BLOCK_GROUP_RAID6 => "RAID6",
        BLOCK_GROUP_RAID1C3 => "RAID1C3",
        BLOCK_GROUP_RAID1C4 => "RAID1C4",
        _ => "single",
    }
}

#[cfg(test)]
use super::superblock::Superblock;
use super::superblock::{BackupRoot, DevItem};
use super::*;
use crate::error::{Error, Location};
use std::fmt::{Display, Write};

/// What the printer needs to know about the filesystem.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PrintOpts {
    /// Checksum algorithm: its size turns an EXTENT_CSUM item's length into a byte range.
    pub csum_type: CsumType,
    /// Bytes covered by one data checksum.
    pub sectorsize: u32,
}

/// Appends one formatted line (the macro adds the newline). Writing to a `String` cannot fail.
macro_rules! outln {
    ($out:expr) => {{
        $out.push('\n');
    }};
    ($out:expr, $($arg:tt)*) => {{
        let _ = writeln!($out, $($arg)*);
    }};
}

// ---------------------------------------------------------------------------------------------
// Small safe readers: every read of item data goes through these or through a typed decoder.
// ---------------------------------------------------------------------------------------------

fn rd_u32(b: &[u8], off: usize) -> Option<u32> {
    let s = b.get(off..off.checked_add(4)?)?;
    Some(u32::from_le_bytes(s.try_into().ok()?))
}

fn rd_u64(b: &[u8], off: usize) -> Option<u64> {
    let s = b.get(off..off.checked_add(8)?)?;
    Some(u64::from_le_bytes(s.try_into().ok()?))
}

fn rd_u16(b: &[u8], off: usize) -> Option<u16> {
    let s = b.get(off..off.checked_add(2)?)?;
    Some(u16::from_le_bytes(s.try_into().ok()?))
}

fn short(what: &str, have: usize, need: usize) -> Error {
    Error::corrupt(
        Location::what(what),
        format!("item body {have} bytes, need {need}"),
    )
}

/// The line printed when an item body cannot be decoded.
fn corrupt_body(out: &mut String, e: impl Display) {
    outln!(out, "\t\t{e}");
}

/// A name or string the way `printf("%.*s")` shows it: at most 255 bytes (progs' buffer), cut
/// at the first NUL byte. Bytes that are not UTF-8 become U+FFFD.
/// A name (or xattr value) escaped as btrfs-progs 6.14 prints it: C escapes for the usual
/// control characters, a backslash before space and backslash, octal for other bytes outside
/// printable ASCII.
fn name_str(b: &[u8]) -> String {
    let b = &b[..b.len().min(NAME_LEN)];
    let mut s = String::with_capacity(b.len());
    for &c in b {
        match c {
            0x07 => s.push_str("\\a"),
            0x08 => s.push_str("\\b"),
            b'\t' => s.push_str("\\t"),
            b'\n' => s.push_str("\\n"),
            0x0b => s.push_str("\\v"),
            0x0c => s.push_str("\\f"),
            b'\r' => s.push_str("\\r"),
            0x1b => s.push_str("\\e"),
            b' ' => s.push_str("\\ "),
            b'\\' => s.push_str("\\\\"),
            0x21..=0x7e => s.push(c as char),
            _ => s.push_str(&format!("\\{c:03o}")),
        }
    }
    s
}

// ---------------------------------------------------------------------------------------------
// Keys, objectids and flag names
// ---------------------------------------------------------------------------------------------

const CSUM_ITEM_KEY: u8 = 120;
const EXTENT_REF_V0_KEY: u8 = 180;
const CSUM_TREE_TMP_OBJECTID: u64 = 13;

/// `level/subvolid` of a qgroup id (level in the top 16 bits).
fn qgroup_str(id: u64) -> String {
    format!("{}/{}", id >> 48, id & ((1u64 << 48) - 1))
}

/// An objectid as dump-tree prints it; the item type picks between names that share a value
/// (1 is ROOT_TREE or DEV_ITEMS, 256 is FIRST_CHUNK_TREE only for chunk items, ...).
pub(crate) fn objectid_str(objectid: u64, ty: u8) -> String {
    match ty {
        PERSISTENT_ITEM_KEY => {
            return if objectid == DEV_STATS_OBJECTID {
                "DEV_STATS".into()
            } else {
                objectid.to_string()
            }
        }
        DEV_EXTENT_KEY => return objectid.to_string(),
        QGROUP_RELATION_KEY => return qgroup_str(objectid),
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => return format!("0x{objectid:016x}"),
        _ => {}
    }
    let s = match objectid {
        ROOT_TREE_OBJECTID if ty == DEV_ITEM_KEY => "DEV_ITEMS",
        ROOT_TREE_OBJECTID => "ROOT_TREE",
        EXTENT_TREE_OBJECTID => "EXTENT_TREE",
        CHUNK_TREE_OBJECTID => "CHUNK_TREE",
        DEV_TREE_OBJECTID => "DEV_TREE",
        FS_TREE_OBJECTID => "FS_TREE",
        ROOT_TREE_DIR_OBJECTID => "ROOT_TREE_DIR",
        CSUM_TREE_OBJECTID => "CSUM_TREE",
        BALANCE_OBJECTID => "BALANCE",
        ORPHAN_OBJECTID => "ORPHAN",
        TREE_LOG_OBJECTID => "TREE_LOG",
        TREE_LOG_FIXUP_OBJECTID => "LOG_FIXUP",
        TREE_RELOC_OBJECTID => "TREE_RELOC",
        DATA_RELOC_TREE_OBJECTID => "DATA_RELOC_TREE",
        EXTENT_CSUM_OBJECTID => "EXTENT_CSUM",
        FREE_SPACE_OBJECTID => "FREE_SPACE",
        FREE_INO_OBJECTID => "FREE_INO",
        QUOTA_TREE_OBJECTID => "QUOTA_TREE",
        UUID_TREE_OBJECTID => "UUID_TREE",
        FREE_SPACE_TREE_OBJECTID => "FREE_SPACE_TREE",
        MULTIPLE_OBJECTIDS => "MULTIPLE",
        BLOCK_GROUP_TREE_OBJECTID => "BLOCK_GROUP_TREE",
        RAID_STRIPE_TREE_OBJECTID => "RAID_STRIPE_TREE",
        u64::MAX => "-1",
        FIRST_CHUNK_TREE_OBJECTID if ty == CHUNK_ITEM_KEY => "FIRST_CHUNK_TREE",
        _ => return objectid.to_string(),
    };
    s.to_string()
}

/// An item type name as dump-tree prints it (`UNKNOWN.N` for unknown types).
pub(crate) fn key_type_str(objectid: u64, ty: u8) -> String {
    if ty == 0 && objectid == FREE_SPACE_OBJECTID {
        return "UNTYPED".into();
    }
    match ty {
        CSUM_ITEM_KEY => "CSUM_ITEM".into(),
        EXTENT_REF_V0_KEY => "EXTENT_REF_V0".into(),
        _ => key_type_name(ty),
    }
}

/// A key as dump-tree prints it: `key (OBJECTID TYPE OFFSET)`.
pub(crate) fn dump_key(k: &Key) -> String {
    let offset = match k.ty {
        QGROUP_RELATION_KEY | QGROUP_INFO_KEY | QGROUP_LIMIT_KEY => qgroup_str(k.offset),
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => format!("0x{:016x}", k.offset),
        ROOT_ITEM_KEY if k.objectid == TREE_RELOC_OBJECTID => objectid_str(k.offset, k.ty),
        ROOT_ITEM_KEY => k.offset.to_string(),
        _ if k.offset == u64::MAX => "-1".into(),
        _ => k.offset.to_string(),
    };
    format!(
        "key ({} {} {})",
        objectid_str(k.objectid, k.ty),
        key_type_str(k.objectid, k.ty),
        offset
    )
}

/// Block group / chunk type flags as dump-tree prints them: `DATA|single`, `METADATA|DUP`,
/// `SYSTEM|RAID1`. Kept byte-identical to progs 6.2, including its oddities (only DATA counts
/// as "something before" for the `|` separator, and the profile always gets one).
pub(crate) fn block_group_flags_str(flags: u64) -> String {
    let mut s = String::new();
    let data = flags & BLOCK_GROUP_DATA != 0;
    if data {
        s.push_str("DATA");
    }
    if flags & BLOCK_GROUP_METADATA != 0 {
        if data {
            s.push('|');
        }
        s.push_str("METADATA");
    }
    if flags & BLOCK_GROUP_SYSTEM != 0 {
        if data {
            s.push('|');
        }
        s.push_str("SYSTEM");
    }
    let profile = if flags & BLOCK_GROUP_RAID10 != 0 {
        "RAID10"
    } else if flags & BLOCK_GROUP_RAID1 != 0 {
        "RAID1"
    } else if flags & BLOCK_GROUP_RAID1C3 != 0 {
        "RAID1C3"
    } else if flags & BLOCK_GROUP_RAID1C4 != 0 {
        "RAID1C4"
    } else if flags & BLOCK_GROUP_DUP != 0 {
        "DUP"
    } else if flags & BLOCK_GROUP_RAID0 != 0 {
        "RAID0"
    } else if flags & BLOCK_GROUP_RAID5 != 0 {
        "RAID5"
    } else if flags & BLOCK_GROUP_RAID6 != 0 {
        "RAID6"
    } else {
        "single"
    };
    s.push('|');
    s.push_str(profile);
    s
}

fn header_flags_str(flags: u64) -> String {
    let mut parts = Vec::new();
    if flags & HEADER_FLAG_WRITTEN != 0 {
        parts.push("WRITTEN");
    }
    if flags & HEADER_FLAG_RELOC != 0 {
        parts.push("RELOC");
    }
    parts.join("|")
}

fn inode_flags_str(flags: u64) -> String {
    const NAMES: [(u64, &str); 12] = [
        (1 << 0, "NODATASUM"),
        (1 << 1, "NODATACOW"),
        (1 << 2, "READONLY"),
        (1 << 3, "NOCOMPRESS"),
        (1 << 4, "PREALLOC"),
        (1 << 5, "SYNC"),
        (1 << 6, "IMMUTABLE"),
        (1 << 7, "APPEND"),
        (1 << 8, "NODUMP"),
        (1 << 9, "NOATIME"),
        (1 << 10, "DIRSYNC"),
        (1 << 11, "COMPRESS"),
    ];
    let parts: Vec<&str> = NAMES
        .iter()
        .filter(|(bit, _)| flags & bit != 0)
        .map(|(_, n)| *n)
        .collect();
    if parts.is_empty() {
        "none".into()
    } else {
        parts.join("|")
    }
}

/// Extent item flags, byte-identical to progs 6.2 (FULL_BACKREF always gets a leading `|`).
fn extent_flags_str(flags: u64) -> String {
    let mut s = String::new();
    if flags & EXTENT_FLAG_DATA != 0 {
        s.push_str("DATA");
    }
    if flags & EXTENT_FLAG_TREE_BLOCK != 0 {
        if !s.is_empty() {
            s.push('|');
        }
        s.push_str("TREE_BLOCK");
    }
    if flags & BLOCK_FLAG_FULL_BACKREF != 0 {
        s.push_str("|FULL_BACKREF");
    }
    s
}

fn dir_type_str(ft: u8) -> String {
    match ft {
        FT_REG_FILE => "FILE".into(),
        FT_DIR => "DIR".into(),
        FT_CHRDEV => "CHRDEV".into(),
        FT_BLKDEV => "BLKDEV".into(),
        FT_FIFO => "FIFO".into(),
        FT_SOCK => "SOCK".into(),
        FT_SYMLINK => "SYMLINK".into(),
        FT_XATTR => "XATTR".into(),
        t => format!("DIR_ITEM.{t}"),
    }
}

fn compress_str(c: u8) -> String {
    match c {
        COMPRESS_NONE => "none".into(),
        COMPRESS_ZLIB => "zlib".into(),
        COMPRESS_LZO => "lzo".into(),
        COMPRESS_ZSTD => "zstd".into(),
        c => format!("UNKNOWN.{c}"),
    }
}

fn file_extent_type_str(t: u8) -> &'static str {
    match t {
        FILE_EXTENT_INLINE => "inline",
        FILE_EXTENT_PREALLOC => "prealloc",
        FILE_EXTENT_REG => "regular",
        _ => "unknown",
    }
}

// ---------------------------------------------------------------------------------------------
// Time
// ---------------------------------------------------------------------------------------------

/// Proleptic Gregorian (year, month, day) of a day count relative to 1970-01-01.
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    // Shift the epoch to 0000-03-01 so that leap days end each 400-year era.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // 0..=399
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of year from March 1
    let mp = (5 * doy + 2) / 153; // month from March, 0..=11
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
pub fn utc_datetime(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y}-{m:02}-{d:02} {:02}:{:02}:{:02}",
        sod / 3600,
        sod % 3600 / 60,
        sod % 60
    )
}

/// `SEC.NSEC (DATE TIME)`; progs prints the seconds as unsigned.
fn timespec_str(t: &Timespec) -> String {
    format!("{}.{} ({})", t.sec as u64, t.nsec, utc_datetime(t.sec))
}

// ---------------------------------------------------------------------------------------------
// Tree blocks
// ---------------------------------------------------------------------------------------------

fn print_header_tail(out: &mut String, kind: &str, h: &Header) {
    outln!(
        out,
        "{kind} {} flags 0x{:x}({}) backref revision {}",
        h.bytenr,
        h.flags,
        header_flags_str(h.flags),
        h.backref_rev
    );
    outln!(out, "fs uuid {}", fmt_uuid(&h.fsid));
    outln!(out, "chunk uuid {}", fmt_uuid(&h.chunk_tree_uuid));
}

/// Appends the dump-tree lines for one tree block (`block` is the whole block, nodesize bytes).
/// Leaves print every item, nodes their key pointers. Never panics, whatever the content:
/// item records that point outside the block get a `\tcorrupt item N ...` line instead.
pub(crate) fn print_block(out: &mut String, block: &[u8], opts: &PrintOpts) {
    if block.len() < HEADER_SIZE {
        outln!(
            out,
            "corrupt tree block: {} bytes, shorter than the {HEADER_SIZE}-byte header",
            block.len()
        );
        return;
    }
    let h = Header::parse(block);
    if h.level == 0 {
        print_leaf(out, block, &h, opts);
    } else {
        print_node(out, block, &h);
    }
}

fn print_node(out: &mut String, block: &[u8], h: &Header) {
    let max = (block.len() - HEADER_SIZE) / KEY_PTR_SIZE;
    outln!(
        out,
        "node {} level {} items {} free space {} generation {} owner {}",
        h.bytenr,
        h.level,
        h.nritems,
        (max as u32).wrapping_sub(h.nritems),
        h.generation,
        objectid_str(h.owner, 0)
    );
    print_header_tail(out, "node", h);
    let nr = h.nritems as usize;
    if nr > max {
        outln!(
            out,
            "corrupt node {}: {nr} key pointers, room for {max}; printing {max}",
            h.bytenr
        );
    }
    for i in 0..nr.min(max) {
        let off = HEADER_SIZE + i * KEY_PTR_SIZE;
        let Some(rec) = block.get(off..off + KEY_PTR_SIZE) else {
            break;
        };
        let kp = KeyPtr::parse(rec);
        outln!(
            out,
            "\t{} block {} gen {}",
            dump_key(&kp.key),
            kp.blockptr,
            kp.generation
        );
    }
}

fn item_header_at(block: &[u8], slot: usize) -> Option<ItemHeader> {
    let off = HEADER_SIZE.checked_add(slot.checked_mul(ITEM_SIZE)?)?;
    let rec = block.get(off..off.checked_add(ITEM_SIZE)?)?;
    Some(ItemHeader::parse(rec))
}

fn print_leaf(out: &mut String, block: &[u8], h: &Header, opts: &PrintOpts) {
    let data_size = block.len() - HEADER_SIZE;
    let room = data_size / ITEM_SIZE;
    let nr = h.nritems as usize;
    // Free space as progs computes it: data area minus the item records and the span from the
    // first item's end down to the last item's start.
    let free: i64 = if nr == 0 {
        data_size as i64
    } else {
        let first = item_header_at(block, 0);
        let last = item_header_at(block, nr.min(room).saturating_sub(1));
        match (first, last) {
            (Some(f), Some(l)) => {
                let used = i64::from(f.offset) + i64::from(f.size) - i64::from(l.offset)
                    + (ITEM_SIZE as i64) * (nr as i64);
                data_size as i64 - used
            }
            _ => data_size as i64 - (ITEM_SIZE as i64) * (nr as i64),
        }
    };
    outln!(
        out,
        "leaf {} items {} free space {} generation {} owner {}",
        h.bytenr,
        h.nritems,
        free,
        h.generation,
        objectid_str(h.owner, 0)
    );
    print_header_tail(out, "leaf", h);
    if nr > room {
        outln!(
            out,
            "corrupt leaf {}: {nr} items, room for {room} item records; printing {room}",
            h.bytenr
        );
    }
    for slot in 0..nr.min(room) {
        let Some(ih) = item_header_at(block, slot) else {
            break;
        };
        let start = ih.offset as usize;
        let end = start.checked_add(ih.size as usize);
        match end {
            Some(end) if end <= data_size => {
                let lo = HEADER_SIZE + start;
                let hi = HEADER_SIZE + end;
                match block.get(lo..hi) {
                    Some(data) => print_item(out, slot, &ih, data, opts),
                    None => corrupt_item_line(out, slot, &ih, data_size),
                }
            }
            _ => corrupt_item_line(out, slot, &ih, data_size),
        }
    }
}

fn corrupt_item_line(out: &mut String, slot: usize, ih: &ItemHeader, data_size: usize) {
    outln!(
        out,
        "\tcorrupt item {slot} {} itemoff {} itemsize {}: outside the {data_size}-byte leaf data area",
        dump_key(&ih.key),
        ih.offset,
        ih.size
    );
}

// ---------------------------------------------------------------------------------------------
// Items
// ---------------------------------------------------------------------------------------------

/// Appends the `\titem N key (...) itemoff O itemsize S` line and the body lines of one leaf
/// item. `data` is the item body (`item.size` bytes). A body that does not decode gets a
/// `\t\tcorrupt ...` line naming what is wrong.
pub(crate) fn print_item(
    out: &mut String,
    slot: usize,
    item: &ItemHeader,
    data: &[u8],
    opts: &PrintOpts,
) {
    outln!(
        out,
        "\titem {slot} {} itemoff {} itemsize {}",
        dump_key(&item.key),
        item.offset,
        item.size
    );
    print_item_body(out, &item.key, data, opts);
}

fn print_item_body(out: &mut String, key: &Key, data: &[u8], opts: &PrintOpts) {
    if key.ty == 0 && key.objectid == FREE_SPACE_OBJECTID {
        print_free_space_header(out, data);
    }
    match key.ty {
        INODE_ITEM_KEY => match InodeItem::parse(data) {
            Ok(ii) => print_inode_item(out, &ii),
            Err(e) => corrupt_body(out, e),
        },
        INODE_REF_KEY => print_inode_refs(out, data),
        INODE_EXTREF_KEY => print_inode_extrefs(out, data),
        DIR_ITEM_KEY | DIR_INDEX_KEY | XATTR_ITEM_KEY => print_dir_items(out, data),
        DIR_LOG_ITEM_KEY | DIR_LOG_INDEX_KEY => match rd_u64(data, 0) {
            Some(end) => outln!(out, "\t\tdir log end {end}"),
            None => corrupt_body(out, short("dir log item", data.len(), 8)),
        },
        ORPHAN_ITEM_KEY => outln!(out, "\t\torphan item"),
        ROOT_ITEM_KEY => match RootItem::parse(data) {
            Ok(ri) => print_root_item(out, &ri),
            Err(e) => corrupt_body(out, e),
        },
        ROOT_REF_KEY | ROOT_BACKREF_KEY => match RootRef::parse(data) {
            Ok(r) => outln!(
                out,
                "\t\troot {} key dirid {} sequence {} name {}",
                if key.ty == ROOT_REF_KEY {
                    "ref"
                } else {
                    "backref"
                },
                r.dirid,
                r.sequence,
                name_str(&r.name)
            ),
            Err(e) => corrupt_body(out, e),
        },
        EXTENT_ITEM_KEY | METADATA_ITEM_KEY => print_extent_item(out, key, data),
        TREE_BLOCK_REF_KEY => outln!(out, "\t\ttree block backref"),
        SHARED_BLOCK_REF_KEY => outln!(out, "\t\tshared block backref"),
        EXTENT_DATA_REF_KEY => match parse_extent_data_ref(data) {
            Ok(r) => print_backref(out, &r),
            Err(e) => corrupt_body(out, e),
        },
        SHARED_DATA_REF_KEY => match rd_u32(data, 0) {
            Some(count) => outln!(out, "\t\tshared data backref count {count}"),
            None => corrupt_body(out, short("shared data ref", data.len(), 4)),
        },
        EXTENT_REF_V0_KEY => outln!(out, "\t\textent ref v0 (deprecated)"),
        CSUM_ITEM_KEY => outln!(out, "\t\tcsum item"),
        EXTENT_CSUM_KEY => {
            let csum_size = opts.csum_type.size().max(1) as u32;
            let len = (data.len() as u32 / csum_size).wrapping_mul(opts.sectorsize);
            outln!(
                out,
                "\t\trange start {} end {} length {}",
                key.offset,
                key.offset.wrapping_add(u64::from(len)),
                len
            );
        }
        EXTENT_DATA_KEY => match FileExtentItem::parse(data) {
            Ok(fe) => print_file_extent(out, &fe, data.len()),
            Err(e) => corrupt_body(out, e),
        },
        BLOCK_GROUP_ITEM_KEY => match BlockGroupItem::parse(data) {
            Ok(bg) => outln!(
                out,
                "\t\tblock group used {} chunk_objectid {} flags {}",
                bg.used,
                bg.chunk_objectid,
                block_group_flags_str(bg.flags)
            ),
            Err(e) => corrupt_body(out, e),
        },
        FREE_SPACE_INFO_KEY => match FreeSpaceInfo::parse(data) {
            Ok(fi) => outln!(
                out,
                "\t\tfree space info extent count {} flags {}",
                fi.extent_count,
                fi.flags
            ),
            Err(e) => corrupt_body(out, e),
        },
        FREE_SPACE_EXTENT_KEY => outln!(out, "\t\tfree space extent"),
        FREE_SPACE_BITMAP_KEY => outln!(out, "\t\tfree space bitmap"),
        CHUNK_ITEM_KEY => print_chunk(out, data),
        DEV_ITEM_KEY => match DevItem::parse(data) {
            Ok(d) => print_dev_item(out, &d),
            Err(e) => corrupt_body(out, e),
        },
        DEV_EXTENT_KEY => match DevExtent::parse(data) {
            Ok(d) => {
                outln!(out, "\t\tdev extent chunk_tree {}", d.chunk_tree);
                outln!(
                    out,
                    "\t\tchunk_objectid {} chunk_offset {} length {}",
                    d.chunk_objectid,
                    d.chunk_offset,
                    d.length
                );
                outln!(out, "\t\tchunk_tree_uuid {}", fmt_uuid(&d.chunk_tree_uuid));
            }
            Err(e) => corrupt_body(out, e),
        },
        QGROUP_STATUS_KEY => print_qgroup_status(out, data),
        QGROUP_INFO_KEY => print_qgroup_info(out, data),
        QGROUP_LIMIT_KEY => print_qgroup_limit(out, data),
        UUID_KEY_SUBVOL | UUID_KEY_RECEIVED_SUBVOL => {
            if !data.len().is_multiple_of(8) {
                outln!(out, "btrfs: uuid item with illegal size {}!", data.len());
            } else {
                for c in data.as_chunks::<8>().0 {
                    outln!(out, "\t\tsubvol_id {}", le_u64(c, 0));
                }
            }
        }
        STRING_ITEM_KEY => outln!(out, "\t\titem data {}", string_item_str(data)),
        PERSISTENT_ITEM_KEY => print_persistent_item(out, key, data),
        TEMPORARY_ITEM_KEY => print_temporary_item(out, key, data),
        // QGROUP_RELATION, DEV_REPLACE, VERITY_*, EXTENT_OWNER_REF, RAID_STRIPE and unknown
        // types: progs 6.2 prints no body.
        _ => {}
    }
}

/// STRING_ITEM data (`%.*s`: the whole item, cut at a NUL byte; no 255-byte limit).
fn string_item_str(b: &[u8]) -> String {
    let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..end]).into_owned()
}

fn print_inode_item(out: &mut String, ii: &InodeItem) {
    outln!(
        out,
        "\t\tgeneration {} transid {} size {} nbytes {}",
        ii.generation,
        ii.transid,
        ii.size,
        ii.nbytes
    );
    outln!(
        out,
        "\t\tblock group {} mode {:o} links {} uid {} gid {} rdev {}",
        ii.block_group,
        ii.mode,
        ii.nlink,
        ii.uid,
        ii.gid,
        ii.rdev
    );
    outln!(
        out,
        "\t\tsequence {} flags 0x{:x}({})",
        ii.sequence,
        ii.flags,
        inode_flags_str(ii.flags)
    );
    outln!(out, "\t\tatime {}", timespec_str(&ii.atime));
    outln!(out, "\t\tctime {}", timespec_str(&ii.ctime));
    outln!(out, "\t\tmtime {}", timespec_str(&ii.mtime));
    outln!(out, "\t\totime {}", timespec_str(&ii.otime));
}

/// Walks the entries packed in one item: `entry_len` gives the length of the entry starting
/// at the slice it is given (or an error), `print` decodes and prints exactly that entry.
/// Stops with a `corrupt` line at the first entry that does not fit or decode.
fn for_each_entry(
    out: &mut String,
    data: &[u8],
    entry_len: impl Fn(&[u8]) -> Result<usize, Error>,
    mut print: impl FnMut(&mut String, &[u8]) -> Result<(), Error>,
) {
    let mut off = 0usize;
    while off < data.len() {
        let rest = &data[off..];
        let len = match entry_len(rest) {
            Ok(len) if len > 0 && len <= rest.len() => len,
            Ok(len) => {
                corrupt_body(
                    out,
                    Error::corrupt(
                        Location::what("item entry"),
                        format!(
                            "entry at byte {off} needs {len} bytes but {} remain",
                            rest.len()
                        ),
                    ),
                );
                return;
            }
            Err(e) => {
                corrupt_body(out, e);
                return;
            }
        };
        if let Err(e) = print(out, &rest[..len]) {
            corrupt_body(out, e);
            return;
        }
        off += len;
    }
}

fn print_inode_refs(out: &mut String, data: &[u8]) {
    for_each_entry(
        out,
        data,
        |b| {
            let n = rd_u16(b, 8).ok_or_else(|| short("inode ref", b.len(), 10))?;
            Ok(10 + n as usize)
        },
        |out, b| {
            for r in InodeRef::parse_all(b)? {
                outln!(
                    out,
                    "\t\tindex {} namelen {} name: {}",
                    r.index,
                    r.name.len(),
                    name_str(&r.name)
                );
            }
            Ok(())
        },
    );
}

fn print_inode_extrefs(out: &mut String, data: &[u8]) {
    for_each_entry(
        out,
        data,
        |b| {
            let n = rd_u16(b, 16).ok_or_else(|| short("inode extref", b.len(), 18))?;
            Ok(18 + n as usize)
        },
        |out, b| {
            for r in InodeExtref::parse_all(b)? {
                outln!(
                    out,
                    "\t\tindex {} parent {} namelen {} name: {}",
                    r.index,
                    r.parent,
                    r.name.len(),
                    name_str(&r.name)
                );
            }
            Ok(())
        },
    );
}

fn print_dir_items(out: &mut String, data: &[u8]) {
    for_each_entry(
        out,
        data,
        |b| {
            let (Some(data_len), Some(name_len)) = (rd_u16(b, 25), rd_u16(b, 27)) else {
                return Err(short("dir item", b.len(), DirItem::HEADER));
            };
            Ok(DirItem::HEADER + data_len as usize + name_len as usize)
        },
        |out, b| {
            for d in DirItem::parse_all(b)? {
                outln!(
                    out,
                    "\t\tlocation {} type {}",
                    dump_key(&d.location),
                    dir_type_str(d.file_type)
                );
                outln!(
                    out,
                    "\t\ttransid {} data_len {} name_len {}",
                    d.transid,
                    d.data.len(),
                    d.name.len()
                );
                outln!(out, "\t\tname: {}", name_str(&d.name));
                if !d.data.is_empty() {
                    outln!(out, "\t\tdata {}", name_str(&d.data));
                }
            }
            Ok(())
        },
    );
}

fn print_root_item(out: &mut String, ri: &RootItem) {
    outln!(
        out,
        "\t\tgeneration {} root_dirid {} bytenr {} byte_limit {} bytes_used {}",
        ri.generation,
        ri.root_dirid,
        ri.bytenr,
        ri.byte_limit,
        ri.bytes_used
    );
    outln!(
        out,
        "\t\tlast_snapshot {} flags 0x{:x}({}) refs {}",
        ri.last_snapshot,
        ri.flags,
        if ri.flags & ROOT_SUBVOL_RDONLY != 0 {
            "RDONLY"
        } else {
            "none"
        },
        ri.refs
    );
    outln!(
        out,
        "\t\tdrop_progress {} drop_level {}",
        dump_key(&ri.drop_progress),
        ri.drop_level
    );
    outln!(
        out,
        "\t\tlevel {} generation_v2 {}",
        ri.level,
        ri.generation_v2
    );
    // The extended fields are meaningful only when generation_v2 tracks generation.
    if ri.generation == ri.generation_v2 {
        outln!(out, "\t\tuuid {}", fmt_uuid(&ri.uuid));
        outln!(out, "\t\tparent_uuid {}", fmt_uuid(&ri.parent_uuid));
        outln!(out, "\t\treceived_uuid {}", fmt_uuid(&ri.received_uuid));
        outln!(
            out,
            "\t\tctransid {} otransid {} stransid {} rtransid {}",
            ri.ctransid,
            ri.otransid,
            ri.stransid,
            ri.rtransid
        );
        outln!(out, "\t\tctime {}", timespec_str(&ri.ctime));
        outln!(out, "\t\totime {}", timespec_str(&ri.otime));
        outln!(out, "\t\tstime {}", timespec_str(&ri.stime));
        outln!(out, "\t\trtime {}", timespec_str(&ri.rtime));
    }
}

fn print_backref(out: &mut String, r: &BackRef) {
    match r {
        BackRef::TreeBlock { root } => {
            outln!(
                out,
                "\t\ttree block backref root {}",
                objectid_str(*root, 0)
            )
        }
        BackRef::SharedBlock { parent } => {
            outln!(out, "\t\tshared block backref parent {parent}")
        }
        BackRef::ExtentData {
            root,
            objectid,
            offset,
            count,
        } => outln!(
            out,
            "\t\textent data backref root {} objectid {objectid} offset {offset} count {count}",
            objectid_str(*root, 0)
        ),
        BackRef::SharedData { parent, count } => {
            outln!(out, "\t\tshared data backref parent {parent} count {count}")
        }
        BackRef::Owner { root } => outln!(out, "\t\textent owner root {root}"),
    }
}

fn print_extent_item(out: &mut String, key: &Key, data: &[u8]) {
    let ei = match ExtentItem::parse(data, key.ty) {
        Ok(ei) => ei,
        Err(e) => {
            corrupt_body(out, e);
            return;
        }
    };
    outln!(
        out,
        "\t\trefs {} gen {} flags {}",
        ei.refs,
        ei.generation,
        extent_flags_str(ei.flags)
    );
    if key.ty == METADATA_ITEM_KEY {
        outln!(out, "\t\ttree block skinny level {}", key.offset as i32);
    } else if let Some((k, level)) = &ei.tree_block_info {
        outln!(out, "\t\ttree block {} level {}", dump_key(k), level);
    }
    for r in &ei.inline_refs {
        // btrfs-progs 6.14 prefixes an inline ref with its type and offset field (for a data
        // ref, the hash its keyed form would have).
        let (ty, off) = match *r {
            BackRef::TreeBlock { root } => (TREE_BLOCK_REF_KEY, root),
            BackRef::SharedBlock { parent } => (SHARED_BLOCK_REF_KEY, parent),
            BackRef::ExtentData {
                root,
                objectid,
                offset,
                ..
            } => (
                EXTENT_DATA_REF_KEY,
                crate::format::hash::extent_data_ref_hash(root, objectid, offset),
            ),
            BackRef::SharedData { parent, .. } => (SHARED_DATA_REF_KEY, parent),
            BackRef::Owner { root } => (EXTENT_OWNER_REF_KEY, root),
        };
        out.push_str(&format!("\t\t({ty} {off:#x}) "));
        let mut line = String::new();
        print_backref(&mut line, r);
        out.push_str(line.trim_start_matches('\t'));
    }
}

fn print_file_extent(out: &mut String, fe: &FileExtentItem, item_size: usize) {
    outln!(
        out,
        "\t\tgeneration {} type {} ({})",
        fe.generation,
        fe.ty,
        file_extent_type_str(fe.ty)
    );
    match &fe.body {
        FileExtentBody::Inline(_) => outln!(
            out,
            "\t\tinline extent data size {} ram_bytes {} compression {} ({})",
            item_size.saturating_sub(FileExtentItem::INLINE_HEADER),
            fe.ram_bytes,
            fe.compression,
            compress_str(fe.compression)
        ),
        FileExtentBody::Extent {
            disk_bytenr,
            disk_num_bytes,
            offset,
            num_bytes,
        } => {
            if fe.ty == FILE_EXTENT_PREALLOC {
                outln!(
                    out,
                    "\t\tprealloc data disk byte {disk_bytenr} nr {disk_num_bytes}"
                );
                outln!(out, "\t\tprealloc data offset {offset} nr {num_bytes}");
            } else {
                outln!(
                    out,
                    "\t\textent data disk byte {disk_bytenr} nr {disk_num_bytes}"
                );
                outln!(
                    out,
                    "\t\textent data offset {offset} nr {num_bytes} ram {}",
                    fe.ram_bytes
                );
                outln!(
                    out,
                    "\t\textent compression {} ({})",
                    fe.compression,
                    compress_str(fe.compression)
                );
            }
        }
    }
}

/// A chunk item body (leaf item or sys_chunk_array entry).
fn print_chunk(out: &mut String, data: &[u8]) {
    if rd_u16(data, 44) == Some(0) {
        // progs prints this one without indentation
        outln!(out, "invalid num_stripes: 0");
        return;
    }
    let c = match ChunkItem::parse(data) {
        Ok((c, _)) => c,
        Err(e) => {
            corrupt_body(out, e);
            return;
        }
    };
    outln!(
        out,
        "\t\tlength {} owner {} stripe_len {} type {}",
        c.length,
        c.owner,
        c.stripe_len,
        block_group_flags_str(c.ty)
    );
    outln!(
        out,
        "\t\tio_align {} io_width {} sector_size {}",
        c.io_align,
        c.io_width,
        c.sector_size
    );
    outln!(
        out,
        "\t\tnum_stripes {} sub_stripes {}",
        c.num_stripes,
        c.sub_stripes
    );
    for (i, s) in c.stripes.iter().enumerate() {
        outln!(
            out,
            "\t\t\tstripe {i} devid {} offset {}",
            s.devid,
            s.offset
        );
        outln!(out, "\t\t\tdev_uuid {}", fmt_uuid(&s.dev_uuid));
    }
}

fn print_dev_item(out: &mut String, d: &DevItem) {
    outln!(
        out,
        "\t\tdevid {} total_bytes {} bytes_used {}",
        d.devid,
        d.total_bytes,
        d.bytes_used
    );
    outln!(
        out,
        "\t\tio_align {} io_width {} sector_size {} type {}",
        d.io_align,
        d.io_width,
        d.sector_size,
        d.dev_type
    );
    outln!(
        out,
        "\t\tgeneration {} start_offset {} dev_group {}",
        d.generation,
        d.start_offset,
        d.dev_group
    );
    outln!(
        out,
        "\t\tseek_speed {} bandwidth {}",
        d.seek_speed,
        d.bandwidth
    );
    outln!(out, "\t\tuuid {}", fmt_uuid(&d.uuid));
    outln!(out, "\t\tfsid {}", fmt_uuid(&d.fsid));
}

/// Free space cache header (v1 cache, key (FREE_SPACE UNTYPED offset)): location key,
/// generation, entries, bitmaps (41 bytes).
fn print_free_space_header(out: &mut String, data: &[u8]) {
    const SIZE: usize = DISK_KEY_SIZE + 24;
    let Some(raw_key) = data.get(..DISK_KEY_SIZE) else {
        corrupt_body(out, short("free space header", data.len(), SIZE));
        return;
    };
    let (Some(generation), Some(entries), Some(bitmaps)) =
        (rd_u64(data, 17), rd_u64(data, 25), rd_u64(data, 33))
    else {
        corrupt_body(out, short("free space header", data.len(), SIZE));
        return;
    };
    outln!(out, "\t\tlocation {}", dump_key(&Key::from_bytes(raw_key)));
    outln!(
        out,
        "\t\tcache generation {generation} entries {entries} bitmaps {bitmaps}"
    );
}

/// Reads `N` consecutive little-endian u64 values, or says how short the body is.
fn u64_fields<const N: usize>(data: &[u8], what: &str) -> Result<[u64; N], Error> {
    let mut v = [0u64; N];
    for (i, slot) in v.iter_mut().enumerate() {
        *slot = rd_u64(data, i * 8).ok_or_else(|| short(what, data.len(), N * 8))?;
    }
    Ok(v)
}

fn print_qgroup_status(out: &mut String, data: &[u8]) {
    match u64_fields::<4>(data, "qgroup status") {
        Ok([version, generation, flags, rescan]) => {
            let mut f = String::from(if flags & 1 != 0 { "ON" } else { "OFF" });
            if flags & 2 != 0 {
                f.push_str("|SCANNING");
            }
            if flags & 4 != 0 {
                f.push_str("|INCONSISTENT");
            }
            outln!(
                out,
                "\t\tversion {version} generation {generation} flags {f} scan {rescan}"
            );
        }
        Err(e) => corrupt_body(out, e),
    }
}

fn print_qgroup_info(out: &mut String, data: &[u8]) {
    match u64_fields::<5>(data, "qgroup info") {
        Ok([generation, rfer, rfer_cmpr, excl, excl_cmpr]) => {
            outln!(out, "\t\tgeneration {generation}");
            outln!(
                out,
                "\t\treferenced {rfer} referenced_compressed {rfer_cmpr}"
            );
            outln!(out, "\t\texclusive {excl} exclusive_compressed {excl_cmpr}");
        }
        Err(e) => corrupt_body(out, e),
    }
}

fn print_qgroup_limit(out: &mut String, data: &[u8]) {
    match u64_fields::<5>(data, "qgroup limit") {
        Ok([flags, max_rfer, max_excl, rsv_rfer, rsv_excl]) => {
            outln!(out, "\t\tflags {flags:x}");
            outln!(
                out,
                "\t\tmax_referenced {} max_exclusive {}",
                max_rfer as i64,
                max_excl as i64
            );
            outln!(
                out,
                "\t\trsv_referenced {} rsv_exclusive {}",
                rsv_rfer as i64,
                rsv_excl as i64
            );
        }
        Err(e) => corrupt_body(out, e),
    }
}

/// PERSISTENT_ITEM: device statistics (objectid DEV_STATS, offset devid), an array of u64
/// counters of which five are known.
fn print_persistent_item(out: &mut String, key: &Key, data: &[u8]) {
    outln!(
        out,
        "\t\tpersistent item objectid {} offset {}",
        objectid_str(key.objectid, PERSISTENT_ITEM_KEY),
        key.offset
    );
    if key.objectid != DEV_STATS_OBJECTID {
        outln!(out, "\t\tunknown persistent item objectid {}", key.objectid);
        return;
    }
    outln!(out, "\t\tdevice stats");
    match u64_fields::<5>(data, "device stats") {
        Ok([write, read, flush, corruption, generation]) => outln!(
            out,
            "\t\twrite_errs {write} read_errs {read} flush_errs {flush} corruption_errs {corruption} generation {generation}"
        ),
        Err(e) => {
            corrupt_body(out, e);
            return;
        }
    }
    const KNOWN: usize = 5 * 8;
    if data.len() > KNOWN {
        // progs ends this line without a newline; the first value follows on it
        let _ = write!(out, "\t\tunknown stats item bytes {}", data.len() - KNOWN);
        let mut i = 5;
        while i * 8 < data.len() {
            match rd_u64(data, i * 8) {
                Some(v) => outln!(out, "\t\tunknown item {i} offset {} value {v}", i * 8),
                None => outln!(out, "\t\tunknown item {i} offset {} truncated", i * 8),
            }
            i += 1;
        }
    }
}

/// One `btrfs_disk_balance_args` (136 bytes) inside a balance item.
fn print_balance_args(out: &mut String, b: &[u8]) {
    let g64 = |o| rd_u64(b, o).unwrap_or(0);
    let g32 = |o| rd_u32(b, o).unwrap_or(0);
    outln!(
        out,
        "\t\tprofiles {} devid {} target {} flags {}",
        g64(0),
        g64(16),
        g64(56),
        g64(64)
    );
    outln!(
        out,
        "\t\tusage_min {} usage_max {} pstart {} pend {}",
        g32(8),
        g32(12),
        g64(24),
        g64(32)
    );
    outln!(
        out,
        "\t\tvstart {} vend {} limit_min {} limit_max {}",
        g64(40),
        g64(48),
        g32(72),
        g32(76)
    );
    outln!(out, "\t\tstripes_min {} stripes_max {}", g32(80), g32(84));
}

/// TEMPORARY_ITEM: the balance status item (objectid BALANCE) or the csum-tree conversion
/// marker.
fn print_temporary_item(out: &mut String, key: &Key, data: &[u8]) {
    outln!(
        out,
        "\t\ttemporary item objectid {} offset {}",
        objectid_str(key.objectid, TEMPORARY_ITEM_KEY),
        key.offset
    );
    match key.objectid {
        BALANCE_OBJECTID => {
            const ARGS: usize = 136;
            const SIZE: usize = 8 + 3 * ARGS;
            if data.len() < SIZE {
                corrupt_body(out, short("balance item", data.len(), SIZE));
                return;
            }
            outln!(out, "\t\tbalance status flags {}", le_u64(data, 0));
            for (i, name) in ["DATA", "METADATA", "SYSTEM"].iter().enumerate() {
                outln!(out, "\t\t{name}");
                let start = 8 + i * ARGS;
                print_balance_args(out, &data[start..start + ARGS]);
            }
        }
        CSUM_TREE_TMP_OBJECTID => outln!(out, "\t\tcsum tree tmp root {}", key.offset),
        id => outln!(out, "\t\tunknown temporary item objectid {id}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Superblock
// ---------------------------------------------------------------------------------------------

/// Every superblock field dump-super prints, from either source.
struct SuperView {
    csum: [u8; 32],
    csum_type: u16,
    /// None when the checksum type is unknown.
    csum_match: Option<bool>,
    bytenr: u64,
    flags: u64,
    magic: u64,
    fsid: [u8; 16],
    metadata_uuid: [u8; 16],
    label: Vec<u8>,
    generation: u64,
    root: u64,
    sys_array_size: u32,
    chunk_root_generation: u64,
    root_level: u8,
    chunk_root: u64,
    chunk_root_level: u8,
    log_root: u64,
    log_root_transid: u64,
    log_root_level: u8,
    total_bytes: u64,
    bytes_used: u64,
    sectorsize: u32,
    nodesize: u32,
    leafsize: u32,
    stripesize: u32,
    root_dir: u64,
    num_devices: u64,
    compat: u64,
    compat_ro: u64,
    incompat: u64,
    cache_generation: u64,
    uuid_tree_generation: u64,
    dev_item: DevItem,
    sys_chunk_array: Vec<u8>,
    backups: Vec<BackupRoot>,
}

impl SuperView {
    #[cfg(test)]
    fn from_superblock(sb: &Superblock) -> SuperView {
        SuperView {
            csum: sb.csum,
            csum_type: sb.csum_type_raw,
            csum_match: Some(sb.csum_ok),
            bytenr: sb.bytenr,
            flags: sb.flags,
            magic: sb.magic,
            fsid: sb.fsid,
            metadata_uuid: sb.metadata_uuid,
            label: sb.label.as_bytes().to_vec(),
            generation: sb.generation,
            root: sb.root,
            sys_array_size: sb.sys_chunk_array_size,
            chunk_root_generation: sb.chunk_root_generation,
            root_level: sb.root_level,
            chunk_root: sb.chunk_root,
            chunk_root_level: sb.chunk_root_level,
            log_root: sb.log_root,
            // Not kept by `Superblock`; every mkfs writes 0 and nodesize.
            log_root_transid: 0,
            log_root_level: sb.log_root_level,
            total_bytes: sb.total_bytes,
            bytes_used: sb.bytes_used,
            sectorsize: sb.sectorsize,
            nodesize: sb.nodesize,
            leafsize: sb.nodesize,
            stripesize: sb.stripesize,
            root_dir: sb.root_dir_objectid,
            num_devices: sb.num_devices,
            compat: sb.compat_flags,
            compat_ro: sb.compat_ro_flags,
            incompat: sb.incompat_flags,
            cache_generation: sb.cache_generation,
            uuid_tree_generation: sb.uuid_tree_generation,
            dev_item: sb.dev_item.clone(),
            sys_chunk_array: sb.sys_chunk_array.clone(),
            backups: sb.backup_roots.to_vec(),
        }
    }

    /// Decodes the raw 4096-byte superblock without validating anything; the caller checked
    /// the length.
    fn from_bytes(b: &[u8]) -> SuperView {
        let csum_type = le_u16(b, 196);
        let csum_match = CsumType::from_disk(csum_type).map(|t| {
            let n = t.size().min(CSUM_SIZE);
            t.compute(&b[CSUM_SIZE..SUPER_INFO_SIZE])[..n] == b[..n]
        });
        let mut csum = [0u8; 32];
        csum.copy_from_slice(&b[0..32]);
        let label_raw = &b[299..299 + LABEL_SIZE];
        let label_end = label_raw.iter().position(|&c| c == 0).unwrap_or(LABEL_SIZE);
        let sys_array_size = le_u32(b, 160);
        let sys_len = (sys_array_size as usize).min(SYSTEM_CHUNK_ARRAY_SIZE);
        let backups = (0..NUM_BACKUP_ROOTS)
            .map(|i| {
                let r = &b[2859 + i * BackupRoot::SIZE..][..BackupRoot::SIZE];
                BackupRoot {
                    tree_root: le_u64(r, 0),
                    tree_root_gen: le_u64(r, 8),
                    chunk_root: le_u64(r, 16),
                    chunk_root_gen: le_u64(r, 24),
                    extent_root: le_u64(r, 32),
                    extent_root_gen: le_u64(r, 40),
                    fs_root: le_u64(r, 48),
                    fs_root_gen: le_u64(r, 56),
                    dev_root: le_u64(r, 64),
                    dev_root_gen: le_u64(r, 72),
                    csum_root: le_u64(r, 80),
                    csum_root_gen: le_u64(r, 88),
                    total_bytes: le_u64(r, 96),
                    bytes_used: le_u64(r, 104),
                    num_devices: le_u64(r, 112),
                    tree_root_level: r[152],
                    chunk_root_level: r[153],
                    extent_root_level: r[154],
                    fs_root_level: r[155],
                    dev_root_level: r[156],
                    csum_root_level: r[157],
                }
            })
            .collect();
        SuperView {
            csum,
            csum_type,
            csum_match,
            bytenr: le_u64(b, 48),
            flags: le_u64(b, 56),
            magic: le_u64(b, 64),
            fsid: uuid_at(b, 32),
            metadata_uuid: uuid_at(b, 571),
            label: label_raw[..label_end].to_vec(),
            generation: le_u64(b, 72),
            root: le_u64(b, 80),
            sys_array_size,
            chunk_root_generation: le_u64(b, 164),
            root_level: b[198],
            chunk_root: le_u64(b, 88),
            chunk_root_level: b[199],
            log_root: le_u64(b, 96),
            log_root_transid: le_u64(b, 104),
            log_root_level: b[200],
            total_bytes: le_u64(b, 112),
            bytes_used: le_u64(b, 120),
            sectorsize: le_u32(b, 144),
            nodesize: le_u32(b, 148),
            leafsize: le_u32(b, 152),
            stripesize: le_u32(b, 156),
            root_dir: le_u64(b, 128),
            num_devices: le_u64(b, 136),
            compat: le_u64(b, 172),
            compat_ro: le_u64(b, 180),
            incompat: le_u64(b, 188),
            cache_generation: le_u64(b, 555),
            uuid_tree_generation: le_u64(b, 563),
            // 98 bytes are present, so this cannot fail; fall back to zeros anyway.
            dev_item: DevItem::parse(&b[201..201 + DevItem::SIZE]).unwrap_or_default(),
            sys_chunk_array: b[811..811 + sys_len].to_vec(),
            backups,
        }
    }
}

const SUPER_FLAG_NAMES: [(u64, &str); 6] = [
    (HEADER_FLAG_WRITTEN, "WRITTEN"),
    (HEADER_FLAG_RELOC, "RELOC"),
    (SUPER_FLAG_CHANGING_FSID, "CHANGING_FSID"),
    (SUPER_FLAG_SEEDING, "SEEDING"),
    (SUPER_FLAG_METADUMP, "METADUMP"),
    (SUPER_FLAG_METADUMP_V2, "METADUMP_V2"),
];
const SUPER_FLAGS_KNOWN: u64 = HEADER_FLAG_WRITTEN
    | HEADER_FLAG_RELOC
    | SUPER_FLAG_CHANGING_FSID
    | SUPER_FLAG_SEEDING
    | SUPER_FLAG_METADUMP
    | SUPER_FLAG_METADUMP_V2;

const COMPAT_RO_NAMES: [(u64, &str); 3] = [
    (COMPAT_RO_FREE_SPACE_TREE, "FREE_SPACE_TREE"),
    (COMPAT_RO_FREE_SPACE_TREE_VALID, "FREE_SPACE_TREE_VALID"),
    (COMPAT_RO_BLOCK_GROUP_TREE, "BLOCK_GROUP_TREE"),
];
/// progs 6.2 knows VERITY but has no name for it: it is neither listed nor "unknown".
const COMPAT_RO_KNOWN: u64 = COMPAT_RO_FREE_SPACE_TREE
    | COMPAT_RO_FREE_SPACE_TREE_VALID
    | COMPAT_RO_VERITY
    | COMPAT_RO_BLOCK_GROUP_TREE;

const INCOMPAT_NAMES: [(u64, &str); 14] = [
    (INCOMPAT_MIXED_BACKREF, "MIXED_BACKREF"),
    (INCOMPAT_DEFAULT_SUBVOL, "DEFAULT_SUBVOL"),
    (INCOMPAT_MIXED_GROUPS, "MIXED_GROUPS"),
    (INCOMPAT_COMPRESS_LZO, "COMPRESS_LZO"),
    (INCOMPAT_COMPRESS_ZSTD, "COMPRESS_ZSTD"),
    (INCOMPAT_BIG_METADATA, "BIG_METADATA"),
    (INCOMPAT_EXTENDED_IREF, "EXTENDED_IREF"),
    (INCOMPAT_RAID56, "RAID56"),
    (INCOMPAT_SKINNY_METADATA, "SKINNY_METADATA"),
    (INCOMPAT_NO_HOLES, "NO_HOLES"),
    (INCOMPAT_METADATA_UUID, "METADATA_UUID"),
    (INCOMPAT_RAID1C34, "RAID1C34"),
    (INCOMPAT_ZONED, "ZONED"),
    (INCOMPAT_EXTENT_TREE_V2, "EXTENT_TREE_V2"),
];
/// What a non-experimental progs 6.2 build supports (EXTENT_TREE_V2 shows as unknown too).
const INCOMPAT_KNOWN: u64 = INCOMPAT_MIXED_BACKREF
    | INCOMPAT_DEFAULT_SUBVOL
    | INCOMPAT_MIXED_GROUPS
    | INCOMPAT_COMPRESS_LZO
    | INCOMPAT_COMPRESS_ZSTD
    | INCOMPAT_BIG_METADATA
    | INCOMPAT_EXTENDED_IREF
    | INCOMPAT_RAID56
    | INCOMPAT_SKINNY_METADATA
    | INCOMPAT_NO_HOLES
    | INCOMPAT_METADATA_UUID
    | INCOMPAT_RAID1C34
    | INCOMPAT_ZONED;

/// The `( A |\n  B )` block under a flags line; nothing when no bit is set.
fn print_readable_flags(out: &mut String, flags: u64, names: &[(u64, &str)], known: u64) {
    if flags == 0 {
        return;
    }
    let mut parts: Vec<String> = Vec::new();
    if flags & known != 0 {
        for (bit, name) in names {
            if flags & bit != 0 {
                parts.push((*name).to_string());
            }
        }
    }
    let unknown = flags & !known;
    if unknown != 0 {
        parts.push(format!("unknown flag: 0x{unknown:x}"));
    }
    let _ = write!(out, "\t\t\t( ");
    for (i, p) in parts.iter().enumerate() {
        if i > 0 {
            let _ = write!(out, "|\n\t\t\t  ");
        }
        let _ = write!(out, "{p} ");
    }
    outln!(out, ")");
}

/// `name (size)` of an on-disk checksum type; None when unknown.
fn csum_type_info(t: u16) -> Option<(&'static str, usize)> {
    match t {
        0 => Some(("crc32c", 4)),
        1 => Some(("xxhash64", 8)),
        2 => Some(("sha256", 32)),
        3 => Some(("blake2b", 32)),
        _ => None,
    }
}

/// Bytes shown as `isprint` characters, anything else as `.`.
fn printable(b: &[u8]) -> String {
    b.iter()
        .map(|&c| {
            if (0x20..0x7f).contains(&c) {
                c as char
            } else {
                '.'
            }
        })
        .collect()
}

fn print_super_view(out: &mut String, v: &SuperView, full: bool) {
    let info = csum_type_info(v.csum_type);
    let csum_size = info.map_or(CSUM_SIZE, |(_, n)| n);
    outln!(
        out,
        "csum_type\t\t{} ({})",
        v.csum_type,
        info.map_or("INVALID", |(n, _)| n)
    );
    outln!(out, "csum_size\t\t{csum_size}");
    let verdict = match (info, v.csum_match) {
        (None, _) | (_, None) => "[UNKNOWN CSUM TYPE OR SIZE]",
        (_, Some(true)) => "[match]",
        (_, Some(false)) => "[DON'T MATCH]",
    };
    let hex: String = v.csum[..csum_size]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    outln!(out, "csum\t\t\t0x{hex} {verdict}");
    outln!(out, "bytenr\t\t\t{}", v.bytenr);
    outln!(out, "flags\t\t\t0x{:x}", v.flags);
    print_readable_flags(out, v.flags, &SUPER_FLAG_NAMES, SUPER_FLAGS_KNOWN);
    outln!(
        out,
        "magic\t\t\t{} {}",
        printable(&v.magic.to_le_bytes()),
        if v.magic == MAGIC {
            "[match]"
        } else {
            "[DON'T MATCH]"
        }
    );
    // btrfs-progs 6.14 prints the field as stored (zeros without METADATA_UUID).
    let metadata_fsid = if v.incompat & INCOMPAT_METADATA_UUID != 0 {
        v.metadata_uuid
    } else {
        v.fsid
    };
    outln!(out, "fsid\t\t\t{}", fmt_uuid(&v.fsid));
    outln!(out, "metadata_uuid\t\t{}", fmt_uuid(&v.metadata_uuid));
    outln!(out, "label\t\t\t{}", printable(&v.label));
    outln!(out, "generation\t\t{}", v.generation);
    outln!(out, "root\t\t\t{}", v.root);
    outln!(out, "sys_array_size\t\t{}", v.sys_array_size);
    outln!(out, "chunk_root_generation\t{}", v.chunk_root_generation);
    outln!(out, "root_level\t\t{}", v.root_level);
    outln!(out, "chunk_root\t\t{}", v.chunk_root);
    outln!(out, "chunk_root_level\t{}", v.chunk_root_level);
    outln!(out, "log_root\t\t{}", v.log_root);
    outln!(out, "log_root_transid (deprecated)\t{}", v.log_root_transid);
    outln!(out, "log_root_level\t\t{}", v.log_root_level);
    outln!(out, "total_bytes\t\t{}", v.total_bytes);
    outln!(out, "bytes_used\t\t{}", v.bytes_used);
    outln!(out, "sectorsize\t\t{}", v.sectorsize);
    outln!(out, "nodesize\t\t{}", v.nodesize);
    outln!(out, "leafsize (deprecated)\t{}", v.leafsize);
    outln!(out, "stripesize\t\t{}", v.stripesize);
    outln!(out, "root_dir\t\t{}", v.root_dir);
    outln!(out, "num_devices\t\t{}", v.num_devices);
    outln!(out, "compat_flags\t\t0x{:x}", v.compat);
    outln!(out, "compat_ro_flags\t\t0x{:x}", v.compat_ro);
    print_readable_flags(out, v.compat_ro, &COMPAT_RO_NAMES, COMPAT_RO_KNOWN);
    outln!(out, "incompat_flags\t\t0x{:x}", v.incompat);
    print_readable_flags(out, v.incompat, &INCOMPAT_NAMES, INCOMPAT_KNOWN);
    outln!(out, "cache_generation\t{}", v.cache_generation);
    outln!(out, "uuid_tree_generation\t{}", v.uuid_tree_generation);
    let d = &v.dev_item;
    outln!(out, "dev_item.uuid\t\t{}", fmt_uuid(&d.uuid));
    outln!(
        out,
        "dev_item.fsid\t\t{} {}",
        fmt_uuid(&d.fsid),
        if d.fsid == metadata_fsid {
            "[match]"
        } else {
            "[DON'T MATCH]"
        }
    );
    outln!(out, "dev_item.type\t\t{}", d.dev_type);
    outln!(out, "dev_item.total_bytes\t{}", d.total_bytes);
    outln!(out, "dev_item.bytes_used\t{}", d.bytes_used);
    outln!(out, "dev_item.io_align\t{}", d.io_align);
    outln!(out, "dev_item.io_width\t{}", d.io_width);
    outln!(out, "dev_item.sector_size\t{}", d.sector_size);
    outln!(out, "dev_item.devid\t\t{}", d.devid);
    outln!(out, "dev_item.dev_group\t{}", d.dev_group);
    outln!(out, "dev_item.seek_speed\t{}", d.seek_speed);
    outln!(out, "dev_item.bandwidth\t{}", d.bandwidth);
    outln!(out, "dev_item.generation\t{}", d.generation);
    if full {
        outln!(out, "sys_chunk_array[{SYSTEM_CHUNK_ARRAY_SIZE}]:");
        if v.sys_array_size as usize > SYSTEM_CHUNK_ARRAY_SIZE {
            outln!(
                out,
                "corrupt sys_chunk_array: sys_array_size {} exceeds {SYSTEM_CHUNK_ARRAY_SIZE}",
                v.sys_array_size
            );
        } else {
            print_sys_chunk_array(out, &v.sys_chunk_array);
        }
        outln!(out, "backup_roots[{NUM_BACKUP_ROOTS}]:");
        let v2 = v.incompat & INCOMPAT_EXTENT_TREE_V2 != 0;
        for (i, b) in v.backups.iter().enumerate() {
            if b.tree_root == 0 && b.tree_root_gen == 0 {
                continue;
            }
            outln!(out, "\tbackup {i}:");
            print_backup_root(out, b, v2);
        }
    }
}

/// The (key, chunk item) pairs of the sys_chunk_array, each chunk printed like a leaf item.
fn print_sys_chunk_array(out: &mut String, array: &[u8]) {
    let mut off = 0usize;
    let mut n = 0usize;
    while off < array.len() {
        let Some(raw_key) = array.get(off..off + DISK_KEY_SIZE) else {
            outln!(
                out,
                "corrupt sys_chunk_array: too short to read a {DISK_KEY_SIZE}-byte key at offset {off}"
            );
            return;
        };
        let key = Key::from_bytes(raw_key);
        off += DISK_KEY_SIZE;
        outln!(out, "\titem {n} {}", dump_key(&key));
        if key.ty != CHUNK_ITEM_KEY {
            outln!(
                out,
                "corrupt sys_chunk_array: unexpected item type {} at offset {off}",
                key.ty
            );
            return;
        }
        let rest = &array[off..];
        let min = ChunkItem::BASE + ChunkItem::STRIPE;
        if rest.len() < min {
            outln!(
                out,
                "corrupt sys_chunk_array: too short to read {min} bytes at offset {off}"
            );
            return;
        }
        let stripes = le_u16(rest, 44) as usize;
        if stripes == 0 {
            outln!(
                out,
                "corrupt sys_chunk_array: zero stripes in the chunk at offset {off}"
            );
            return;
        }
        let len = ChunkItem::BASE + stripes * ChunkItem::STRIPE;
        if rest.len() < len {
            outln!(
                out,
                "corrupt sys_chunk_array: too short to read {len} bytes at offset {off}"
            );
            return;
        }
        print_chunk(out, &rest[..len]);
        off += len;
        n += 1;
    }
}

fn print_backup_root(out: &mut String, b: &BackupRoot, extent_tree_v2: bool) {
    let extent_name = if extent_tree_v2 {
        "backup_block_group_root"
    } else {
        "backup_extent_root"
    };
    outln!(
        out,
        "\t\tbackup_tree_root:\t{}\tgen: {}\tlevel: {}",
        b.tree_root,
        b.tree_root_gen,
        b.tree_root_level
    );
    outln!(
        out,
        "\t\tbackup_chunk_root:\t{}\tgen: {}\tlevel: {}",
        b.chunk_root,
        b.chunk_root_gen,
        b.chunk_root_level
    );
    outln!(
        out,
        "\t\t{extent_name}:\t{}\tgen: {}\tlevel: {}",
        b.extent_root,
        b.extent_root_gen,
        b.extent_root_level
    );
    outln!(
        out,
        "\t\tbackup_fs_root:\t\t{}\tgen: {}\tlevel: {}",
        b.fs_root,
        b.fs_root_gen,
        b.fs_root_level
    );
    outln!(
        out,
        "\t\tbackup_dev_root:\t{}\tgen: {}\tlevel: {}",
        b.dev_root,
        b.dev_root_gen,
        b.dev_root_level
    );
    outln!(
        out,
        "\t\tcsum_root:\t{}\tgen: {}\tlevel: {}",
        b.csum_root,
        b.csum_root_gen,
        b.csum_root_level
    );
    outln!(out, "\t\tbackup_total_bytes:\t{}", b.total_bytes);
    outln!(out, "\t\tbackup_bytes_used:\t{}", b.bytes_used);
    outln!(out, "\t\tbackup_num_devices:\t{}", b.num_devices);
    outln!(out);
}

#[cfg(test)]
/// dump-super output for a decoded superblock. `full` (the `-f` flag) adds the
/// sys_chunk_array and the backup roots. See the module docs for the two deprecated fields.
pub(crate) fn print_superblock(out: &mut String, sb: &Superblock, full: bool) {
    print_super_view(out, &SuperView::from_superblock(sb), full);
}

/// dump-super output straight from the raw superblock bytes (at least 4096), with no
/// validation: a bad magic, checksum or size is shown (`[DON'T MATCH]`, `corrupt ...` lines)
/// rather than refused. Prints every field exactly as stored.
pub(crate) fn print_superblock_bytes(out: &mut String, raw: &[u8], full: bool) {
    if raw.len() < SUPER_INFO_SIZE {
        outln!(
            out,
            "corrupt superblock: {} bytes, need {SUPER_INFO_SIZE}",
            raw.len()
        );
        return;
    }
    print_super_view(out, &SuperView::from_bytes(raw), full);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs::{self, File};
    use std::os::unix::fs::FileExt;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    // -----------------------------------------------------------------------------------------
    // Helpers: scratch dirs, btrfs-progs, locating tree blocks in a single-device image
    // -----------------------------------------------------------------------------------------

    /// Whether mkfs.btrfs and btrfs are installed. Under CI (env `CI` set) a missing tool fails
    /// the test; elsewhere the test is skipped with a note.
    fn have_progs() -> bool {
        let ok = ["mkfs.btrfs", "btrfs"].iter().all(|t| {
            Command::new(t)
                .arg("--version")
                .output()
                .map(|o| o.status.success())
                .unwrap_or(false)
        });
        if !ok {
            assert!(
                std::env::var_os("CI").is_none(),
                "mkfs.btrfs and btrfs (btrfs-progs) are required when CI is set"
            );
            eprintln!("skipping: btrfs-progs not installed");
        }
        ok
    }

    /// A scratch directory removed on drop.
    struct Scratch(PathBuf);
    impl Scratch {
        fn new(name: &str) -> Scratch {
            let p =
                std::env::temp_dir().join(format!("butter-print-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            fs::create_dir_all(&p).unwrap();
            Scratch(p)
        }
    }
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Runs a command (in UTC, like our timestamps) and returns its stdout; panics on failure.
    fn run(cmd: &mut Command) -> String {
        let o = cmd
            .env("TZ", "UTC")
            .output()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        assert!(
            o.status.success(),
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn mkfs(dir: &Path, size: u64, args: &[&str], rootdir: Option<&Path>) -> PathBuf {
        let img = dir.join("img");
        File::create(&img).unwrap().set_len(size).unwrap();
        let mut c = Command::new("mkfs.btrfs");
        c.args(["-f", "-q"]).args(args);
        if let Some(r) = rootdir {
            c.arg("--rootdir").arg(r);
        }
        c.arg(&img);
        run(&mut c);
        img
    }

    fn read_super(f: &File) -> (Vec<u8>, Superblock) {
        let mut raw = vec![0u8; SUPER_INFO_SIZE];
        f.read_exact_at(&mut raw, SUPER_INFO_OFFSET).unwrap();
        let sb = Superblock::parse(&raw, SUPER_INFO_OFFSET).unwrap();
        (raw, sb)
    }

    /// Logical -> physical for a single-device image: (logical start, length, physical of
    /// stripe 0). Test-only: trusts the image.
    struct ChunkMap(Vec<(u64, u64, u64)>);

    impl ChunkMap {
        fn physical(&self, logical: u64) -> u64 {
            for &(l, len, p) in &self.0 {
                if logical >= l && logical < l + len {
                    return p + (logical - l);
                }
            }
            panic!("logical {logical} is in no chunk");
        }

        fn add(&mut self, logical: u64, c: &ChunkItem) {
            if !self.0.iter().any(|&(l, _, _)| l == logical) {
                self.0.push((logical, c.length, c.stripes[0].offset));
            }
        }

        /// The sys_chunk_array, then every chunk item of the chunk tree.
        fn load(f: &File, sb: &Superblock) -> ChunkMap {
            let mut map = ChunkMap(Vec::new());
            let a = &sb.sys_chunk_array;
            let mut off = 0;
            while off + DISK_KEY_SIZE <= a.len() {
                let key = Key::from_bytes(&a[off..off + DISK_KEY_SIZE]);
                off += DISK_KEY_SIZE;
                let (c, used) = ChunkItem::parse(&a[off..]).unwrap();
                map.add(key.offset, &c);
                off += used;
            }
            let mut found = Vec::new();
            for block in map.tree_blocks(f, sb.chunk_root, sb.nodesize) {
                for_each_item(&block, |ih, data| {
                    if ih.key.ty == CHUNK_ITEM_KEY {
                        found.push((ih.key.offset, ChunkItem::parse(data).unwrap().0));
                    }
                });
            }
            for (l, c) in found {
                map.add(l, &c);
            }
            map
        }

        fn read_block(&self, f: &File, logical: u64, nodesize: u32) -> Vec<u8> {
            let mut b = vec![0u8; nodesize as usize];
            f.read_exact_at(&mut b, self.physical(logical)).unwrap();
            b
        }

        /// Every block of the tree rooted at `root`, breadth first (the order of progs).
        fn tree_blocks(&self, f: &File, root: u64, nodesize: u32) -> Vec<Vec<u8>> {
            let mut out = Vec::new();
            let mut queue = std::collections::VecDeque::from([root]);
            while let Some(bytenr) = queue.pop_front() {
                let b = self.read_block(f, bytenr, nodesize);
                let h = Header::parse(&b);
                assert_eq!(h.bytenr, bytenr, "block header bytenr");
                if h.level > 0 {
                    for i in 0..h.nritems as usize {
                        let off = HEADER_SIZE + i * KEY_PTR_SIZE;
                        queue.push_back(KeyPtr::parse(&b[off..off + KEY_PTR_SIZE]).blockptr);
                    }
                }
                out.push(b);
            }
            out
        }
    }

    /// Calls `f` with every item of a leaf (nothing for nodes). Test-only: trusts the block.
    fn for_each_item(block: &[u8], mut f: impl FnMut(&ItemHeader, &[u8])) {
        let h = Header::parse(block);
        if h.level != 0 {
            return;
        }
        for i in 0..h.nritems as usize {
            let ih = item_header_at(block, i).unwrap();
            let start = HEADER_SIZE + ih.offset as usize;
            f(&ih, &block[start..start + ih.size as usize]);
        }
    }

    /// Compares two dumps line by line, ignoring trailing whitespace and trailing blank lines
    /// only.
    fn assert_same(what: &str, ours: &str, progs: &str) {
        let norm = |s: &str| -> Vec<String> {
            let mut v: Vec<String> = s.lines().map(|l| l.trim_end().to_string()).collect();
            while v.last().is_some_and(|l| l.is_empty()) {
                v.pop();
            }
            v
        };
        let (a, b) = (norm(ours), norm(progs));
        for i in 0..a.len().max(b.len()) {
            if a.get(i) != b.get(i) {
                let from = i.saturating_sub(3);
                panic!(
                    "{what}: first difference at line {}\n ours:  {:?}\n progs: {:?}\n\
                     ours around it:\n{}\nprogs around it:\n{}",
                    i + 1,
                    a.get(i),
                    b.get(i),
                    a[from..(i + 3).min(a.len())].join("\n"),
                    b[from..(i + 3).min(b.len())].join("\n"),
                );
            }
        }
    }

    /// `btrfs inspect-internal dump-tree -b BYTENR` without its version banner.
    fn progs_block(img: &Path, bytenr: u64) -> String {
        let s = run(Command::new("btrfs")
            .args(["inspect-internal", "dump-tree", "-b", &bytenr.to_string()])
            .arg(img));
        s.lines()
            .filter(|l| !l.starts_with("btrfs-progs v"))
            .map(|l| format!("{l}\n"))
            .collect()
    }

    /// `btrfs inspect-internal dump-super -f` without the banner and the dashes under it.
    fn progs_super(img: &Path) -> String {
        let s = run(Command::new("btrfs")
            .args(["inspect-internal", "dump-super", "-f"])
            .arg(img));
        s.lines()
            .skip_while(|l| !l.starts_with("-----"))
            .skip(1)
            .map(|l| format!("{l}\n"))
            .collect()
    }

    /// Compares our dump of every block of every tree of the image with progs' dump of the
    /// same block. Returns the item types seen, for the caller to check coverage.
    fn compare_all_trees(img: &Path) -> std::collections::BTreeSet<u8> {
        let f = File::open(img).unwrap();
        let (_, sb) = read_super(&f);
        let map = ChunkMap::load(&f, &sb);
        let opts = PrintOpts {
            csum_type: sb.csum_type,
            sectorsize: sb.sectorsize,
        };
        let mut roots = vec![sb.root, sb.chunk_root];
        for block in map.tree_blocks(&f, sb.root, sb.nodesize) {
            for_each_item(&block, |ih, data| {
                if ih.key.ty == ROOT_ITEM_KEY {
                    roots.push(RootItem::parse(data).unwrap().bytenr);
                }
            });
        }
        let mut types = std::collections::BTreeSet::new();
        let mut levels = std::collections::BTreeSet::new();
        for root in roots {
            for block in map.tree_blocks(&f, root, sb.nodesize) {
                let h = Header::parse(&block);
                levels.insert(h.level);
                for_each_item(&block, |ih, _| {
                    types.insert(ih.key.ty);
                });
                let mut ours = String::new();
                print_block(&mut ours, &block, &opts);
                let theirs = progs_block(img, h.bytenr);
                assert_same(
                    &format!("block {} owner {}", h.bytenr, h.owner),
                    &ours,
                    &theirs,
                );
                flip_bits_never_panics(&block, &opts, 50, h.bytenr);
            }
        }
        assert!(levels.contains(&0));
        types
    }

    // -----------------------------------------------------------------------------------------
    // Comparisons with btrfs-progs
    // -----------------------------------------------------------------------------------------

    /// A populated image made by mkfs --rootdir (no mount needed): root, chunk, extent, dev,
    /// fs (a level-1 node and its leaves), csum, free-space and data-reloc trees.
    #[test]
    fn dump_tree_matches_progs_rootdir_image() {
        if !have_progs() {
            return;
        }
        let s = Scratch::new("rootdir");
        let root = s.0.join("root");
        fs::create_dir_all(root.join("d")).unwrap();
        fs::create_dir_all(root.join("many")).unwrap();
        fs::write(root.join("d/small"), b"hello\n").unwrap();
        let mut rng = Rng(0x1234_5678);
        let big: Vec<u8> = (0..300_000).map(|_| rng.next() as u8).collect();
        fs::write(root.join("d/big"), &big).unwrap();
        fs::hard_link(root.join("d/big"), root.join("d/hard")).unwrap();
        fs::write(root.join("empty"), b"").unwrap();
        std::os::unix::fs::symlink("d/small", root.join("link")).unwrap();
        // Optional extras: a fifo and an xattr, when the tools are around.
        let _ = Command::new("mkfifo").arg(root.join("fifo")).status();
        let _ = Command::new("setfattr")
            .args(["-n", "user.test", "-v", "value"])
            .arg(root.join("d/small"))
            .status();
        for i in 0..400 {
            fs::write(
                root.join(format!("many/file-{i:04}")),
                format!("content {i}\n"),
            )
            .unwrap();
        }
        let img = mkfs(&s.0, 300 << 20, &[], Some(&root));
        let types = compare_all_trees(&img);
        for ty in [
            INODE_ITEM_KEY,
            INODE_REF_KEY,
            DIR_ITEM_KEY,
            DIR_INDEX_KEY,
            EXTENT_DATA_KEY,
            EXTENT_CSUM_KEY,
            ROOT_ITEM_KEY,
            METADATA_ITEM_KEY,
            EXTENT_ITEM_KEY,
            BLOCK_GROUP_ITEM_KEY,
            FREE_SPACE_INFO_KEY,
            FREE_SPACE_EXTENT_KEY,
            DEV_EXTENT_KEY,
            DEV_ITEM_KEY,
            CHUNK_ITEM_KEY,
        ] {
            assert!(types.contains(&ty), "no {} item seen", key_type_name(ty));
        }
    }

    /// Plain mkfs images with other options: xxhash-free (the checksum stub only does crc32c),
    /// single metadata, 4 KiB nodes, a label.
    #[test]
    fn dump_tree_and_super_match_progs_plain_images() {
        if !have_progs() {
            return;
        }
        let variants: [&[&str]; 3] = [
            &[],
            &[
                "-L",
                "test label",
                "-m",
                "single",
                "-d",
                "single",
                "-n",
                "4096",
            ],
            &[
                "-m",
                "dup",
                "-d",
                "dup",
                "-n",
                "65536",
                "-O",
                "^no-holes",
                "-R",
                "^free-space-tree",
            ],
        ];
        for (i, args) in variants.iter().enumerate() {
            let s = Scratch::new(&format!("plain{i}"));
            let img = mkfs(&s.0, 300 << 20, args, None);
            compare_all_trees(&img);
            let f = File::open(&img).unwrap();
            let (raw, sb) = read_super(&f);
            let progs = progs_super(&img);
            let mut ours = String::new();
            print_superblock(&mut ours, &sb, true);
            assert_same(&format!("dump-super {args:?}"), &ours, &progs);
            let mut ours = String::new();
            print_superblock_bytes(&mut ours, &raw, true);
            assert_same(&format!("dump-super bytes {args:?}"), &ours, &progs);
        }
    }

    /// Whether this process runs as root (mount and losetup need it).
    fn is_root() -> bool {
        fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Uid:"))
                    .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
            })
            .unwrap_or(false)
    }

    /// A loop device and a mount made by this test; both undone on drop, even on panic.
    struct LoopMount {
        dev: Option<String>,
        mnt: PathBuf,
        mounted: bool,
    }
    impl LoopMount {
        fn new(img: &Path, mnt: &Path, opts: &str) -> Option<LoopMount> {
            fs::create_dir_all(mnt).ok()?;
            let o = Command::new("losetup")
                .args(["-f", "--show"])
                .arg(img)
                .output()
                .ok()?;
            if !o.status.success() {
                return None;
            }
            let dev = String::from_utf8_lossy(&o.stdout).trim().to_string();
            let mut lm = LoopMount {
                dev: Some(dev.clone()),
                mnt: mnt.to_path_buf(),
                mounted: false,
            };
            let ok = Command::new("mount")
                .args(["-t", "btrfs", "-o", opts, &dev])
                .arg(mnt)
                .status()
                .map(|s| s.success())
                .unwrap_or(false);
            if !ok {
                return None; // drop detaches the loop device
            }
            lm.mounted = true;
            Some(lm)
        }
        fn finish(&mut self) {
            if self.mounted {
                let _ = Command::new("umount").arg(&self.mnt).status();
                self.mounted = false;
            }
            if let Some(dev) = self.dev.take() {
                let _ = Command::new("losetup").args(["-d", &dev]).status();
            }
        }
    }
    impl Drop for LoopMount {
        fn drop(&mut self) {
            self.finish();
        }
    }

    /// An image written by the kernel: subvolume, read-only snapshot, quotas, compressed and
    /// preallocated extents, shared data extents, an inode with extended refs, device stats,
    /// the UUID tree. Needs root and loop devices (an error under CI when missing).
    #[test]
    fn dump_tree_matches_progs_kernel_image() {
        if !have_progs() {
            return;
        }
        let in_ci = std::env::var_os("CI").is_some();
        if !is_root() {
            assert!(!in_ci, "the kernel image test needs root under CI");
            eprintln!("skipping: not root");
            return;
        }
        let s = Scratch::new("kernel");
        let img = mkfs(&s.0, 300 << 20, &[], None);
        let mnt = s.0.join("mnt");
        let Some(mut lm) = LoopMount::new(&img, &mnt, "compress=zstd") else {
            assert!(!in_ci, "loop mount failed under CI");
            eprintln!("skipping: loop mount failed");
            return;
        };
        let sh = |script: &str| {
            run(Command::new("sh").arg("-ec").arg(script).current_dir(&mnt));
        };
        sh("mkdir d; echo hello > d/small; \
            head -c 400000 /dev/zero > d/compressible; \
            fallocate -l 1M d/prealloc; \
            head -c 200000 /dev/urandom > d/random; \
            cp --reflink=always d/random d/clone; \
            btrfs subvolume create sv >/dev/null; echo in-subvol > sv/f; \
            btrfs quota enable .; \
            btrfs subvolume snapshot -r . snap >/dev/null; \
            sync");
        // Enough long-named hard links in one directory to overflow the INODE_REF item.
        let long = "x".repeat(200);
        for i in 0..100 {
            fs::hard_link(mnt.join("d/small"), mnt.join(format!("d/{long}{i:03}"))).unwrap();
        }
        sh("sync");
        lm.finish();
        let types = compare_all_trees(&img);
        for ty in [
            INODE_EXTREF_KEY,
            XATTR_ITEM_KEY,
            ROOT_REF_KEY,
            ROOT_BACKREF_KEY,
            QGROUP_STATUS_KEY,
            QGROUP_INFO_KEY,
            QGROUP_LIMIT_KEY,
            UUID_KEY_SUBVOL,
            PERSISTENT_ITEM_KEY,
        ] {
            // XATTR may be absent (no ACLs or xattrs set): only the others are required.
            if ty != XATTR_ITEM_KEY {
                assert!(types.contains(&ty), "no {} item seen", key_type_name(ty));
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Garbage must never panic
    // -----------------------------------------------------------------------------------------

    /// xorshift64*: deterministic, no dependency.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    fn flip_bits_never_panics(block: &[u8], opts: &PrintOpts, rounds: usize, seed: u64) {
        let mut rng = Rng(seed | 1);
        for _ in 0..rounds {
            let mut b = block.to_vec();
            for _ in 0..1 + rng.below(8) {
                let bit = rng.below(b.len() * 8);
                b[bit / 8] ^= 1 << (bit % 8);
            }
            // Sometimes hit the item records and the header harder.
            if rng.below(4) == 0 {
                let at = HEADER_SIZE + rng.below(200);
                if at < b.len() {
                    b[at] = rng.next() as u8;
                }
            }
            let mut out = String::new();
            print_block(&mut out, &b, opts);
            assert!(!out.is_empty());
        }
    }

    fn opts() -> PrintOpts {
        PrintOpts {
            csum_type: CsumType::Crc32c,
            sectorsize: 4096,
        }
    }

    fn set(b: &mut [u8], off: usize, v: &[u8]) {
        b[off..off + v.len()].copy_from_slice(v);
    }

    /// A leaf holding `items`, data packed from the end like the real thing.
    fn build_leaf(nodesize: usize, owner: u64, items: &[(Key, Vec<u8>)]) -> Vec<u8> {
        let mut b = vec![0u8; nodesize];
        set(&mut b, 32, &[0xab; 16]);
        set(&mut b, 48, &1_048_576u64.to_le_bytes());
        set(
            &mut b,
            56,
            &(HEADER_FLAG_WRITTEN | (1u64 << 56)).to_le_bytes(),
        );
        set(&mut b, 64, &[0xcd; 16]);
        set(&mut b, 80, &7u64.to_le_bytes());
        set(&mut b, 88, &owner.to_le_bytes());
        set(&mut b, 96, &(items.len() as u32).to_le_bytes());
        let mut end = nodesize - HEADER_SIZE;
        for (i, (k, d)) in items.iter().enumerate() {
            end -= d.len();
            let rec = HEADER_SIZE + i * ITEM_SIZE;
            set(&mut b, rec, &k.to_bytes());
            set(&mut b, rec + 17, &(end as u32).to_le_bytes());
            set(&mut b, rec + 21, &(d.len() as u32).to_le_bytes());
            set(&mut b, HEADER_SIZE + end, d);
        }
        b
    }

    fn le(vals: &[u64]) -> Vec<u8> {
        vals.iter().flat_map(|v| v.to_le_bytes()).collect()
    }

    /// One item of every kind the printer decodes, well formed.
    fn sample_items() -> Vec<(Key, Vec<u8>)> {
        let mut inode = vec![0u8; 160];
        set(&mut inode, 0, &5u64.to_le_bytes());
        set(&mut inode, 40, &1u32.to_le_bytes());
        set(&mut inode, 52, &0o100644u32.to_le_bytes());
        set(&mut inode, 64, &0x11u64.to_le_bytes());
        set(&mut inode, 112, &1_000_000_000u64.to_le_bytes());
        let mut dir = Vec::new();
        dir.extend_from_slice(&Key::new(257, INODE_ITEM_KEY, 0).to_bytes());
        dir.extend_from_slice(&9u64.to_le_bytes());
        dir.extend_from_slice(&0u16.to_le_bytes());
        dir.extend_from_slice(&3u16.to_le_bytes());
        dir.push(FT_REG_FILE);
        dir.extend_from_slice(b"abc");
        let mut xattr = Vec::new();
        xattr.extend_from_slice(&Key::default().to_bytes());
        xattr.extend_from_slice(&9u64.to_le_bytes());
        xattr.extend_from_slice(&2u16.to_le_bytes());
        xattr.extend_from_slice(&6u16.to_le_bytes());
        xattr.push(FT_XATTR);
        xattr.extend_from_slice(b"user.kv1");
        let mut iref = le(&[2]);
        iref.extend_from_slice(&3u16.to_le_bytes());
        iref.extend_from_slice(b"abc");
        let mut extref = le(&[256, 3]);
        extref.extend_from_slice(&2u16.to_le_bytes());
        extref.extend_from_slice(b"xy");
        let mut inline = le(&[7, 5]);
        inline.extend_from_slice(&[0, 0, 0, 0, FILE_EXTENT_INLINE]);
        inline.extend_from_slice(b"hello");
        let mut reg = le(&[7, 8192]);
        reg.extend_from_slice(&[COMPRESS_ZSTD, 0, 0, 0, FILE_EXTENT_REG]);
        reg.extend_from_slice(&le(&[13_631_488, 4096, 0, 8192]));
        let mut prealloc = reg.clone();
        prealloc[16] = 0;
        prealloc[20] = FILE_EXTENT_PREALLOC;
        let mut extent = le(&[1, 7, EXTENT_FLAG_DATA]);
        extent.push(EXTENT_DATA_REF_KEY);
        extent.extend_from_slice(&le(&[5, 257, 0]));
        extent.extend_from_slice(&1u32.to_le_bytes());
        extent.push(SHARED_DATA_REF_KEY);
        extent.extend_from_slice(&le(&[30_000_000]));
        extent.extend_from_slice(&2u32.to_le_bytes());
        let mut tree_extent = le(&[1, 7, EXTENT_FLAG_TREE_BLOCK | BLOCK_FLAG_FULL_BACKREF]);
        tree_extent.extend_from_slice(&Key::new(256, INODE_ITEM_KEY, 0).to_bytes());
        tree_extent.push(0);
        tree_extent.push(SHARED_BLOCK_REF_KEY);
        tree_extent.extend_from_slice(&le(&[30_000_000]));
        let mut skinny = le(&[1, 7, EXTENT_FLAG_TREE_BLOCK]);
        skinny.push(TREE_BLOCK_REF_KEY);
        skinny.extend_from_slice(&le(&[FS_TREE_OBJECTID]));
        let mut root = vec![0u8; 439];
        set(&mut root, 160, &9u64.to_le_bytes());
        set(&mut root, 176, &30_000_000u64.to_le_bytes());
        set(&mut root, 208, &ROOT_SUBVOL_RDONLY.to_le_bytes());
        set(&mut root, 239, &9u64.to_le_bytes());
        set(&mut root, 247, &[0x11; 16]);
        let mut rref = le(&[256, 6]);
        rref.extend_from_slice(&2u16.to_le_bytes());
        rref.extend_from_slice(b"sv");
        let mut chunk = le(&[8 << 20, 2, 65536, BLOCK_GROUP_METADATA | BLOCK_GROUP_DUP]);
        chunk.extend_from_slice(&[0, 0, 1, 0, 0, 0, 1, 0, 0, 16, 0, 0]);
        chunk.extend_from_slice(&2u16.to_le_bytes());
        chunk.extend_from_slice(&1u16.to_le_bytes());
        for off in [22_020_096u64, 30_408_704] {
            chunk.extend_from_slice(&le(&[1, off]));
            chunk.extend_from_slice(&[0x22; 16]);
        }
        let mut dev = le(&[1, 1 << 30, 1 << 20]);
        dev.resize(DevItem::SIZE, 0x33);
        let mut dev_extent = le(&[3, 256, 22_020_096, 8 << 20]);
        dev_extent.extend_from_slice(&[0x44; 16]);
        let mut fs_header = Key::new(256, INODE_ITEM_KEY, 0).to_bytes().to_vec();
        fs_header.extend_from_slice(&le(&[3, 4, 5]));
        let mut balance = le(&[1]);
        for i in 0..3u64 {
            let mut args = le(&[i, 0, 1, 2, 3, 4, 5, 6, 7, 0, 0]);
            args.resize(136, 0);
            balance.extend_from_slice(&args);
        }
        balance.extend_from_slice(&[0; 32]);
        vec![
            (Key::new(256, INODE_ITEM_KEY, 0), inode),
            (Key::new(256, INODE_REF_KEY, 256), iref),
            (Key::new(256, INODE_EXTREF_KEY, 12345), extref),
            (Key::new(256, XATTR_ITEM_KEY, 777), xattr),
            (Key::new(256, DIR_ITEM_KEY, 123), dir.clone()),
            (Key::new(256, DIR_INDEX_KEY, 2), dir),
            (Key::new(256, DIR_LOG_INDEX_KEY, 2), le(&[9])),
            (Key::new(256, EXTENT_DATA_KEY, 0), inline),
            (Key::new(256, EXTENT_DATA_KEY, 4096), reg),
            (Key::new(256, EXTENT_DATA_KEY, 12288), prealloc),
            (Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, 300), vec![]),
            (Key::new(FS_TREE_OBJECTID, ROOT_ITEM_KEY, 0), root),
            (Key::new(FS_TREE_OBJECTID, ROOT_REF_KEY, 256), rref),
            (Key::new(13_631_488, EXTENT_ITEM_KEY, 4096), extent),
            (Key::new(30_000_000, EXTENT_ITEM_KEY, 16384), tree_extent),
            (Key::new(30_016_384, METADATA_ITEM_KEY, 1), skinny),
            (Key::new(30_016_384, TREE_BLOCK_REF_KEY, 5), vec![]),
            (Key::new(13_631_488, EXTENT_DATA_REF_KEY, 99), {
                let mut v = le(&[5, 257, 0]);
                v.extend_from_slice(&1u32.to_le_bytes());
                v
            }),
            (
                Key::new(13_631_488, SHARED_DATA_REF_KEY, 99),
                3u32.to_le_bytes().to_vec(),
            ),
            (
                Key::new(EXTENT_CSUM_OBJECTID, EXTENT_CSUM_KEY, 13_631_488),
                vec![0; 16],
            ),
            (
                Key::new(13_631_488, BLOCK_GROUP_ITEM_KEY, 8 << 20),
                le(&[4096, 256, 1]),
            ),
            (
                Key::new(13_631_488, FREE_SPACE_INFO_KEY, 8 << 20),
                le(&[(1 << 32) | 3]),
            ),
            (Key::new(13_631_488, FREE_SPACE_EXTENT_KEY, 4096), vec![]),
            (
                Key::new(13_631_488, FREE_SPACE_BITMAP_KEY, 4096),
                vec![0xff; 8],
            ),
            (
                Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, 22_020_096),
                chunk,
            ),
            (Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 1), dev),
            (Key::new(1, DEV_EXTENT_KEY, 22_020_096), dev_extent),
            (Key::new(0, QGROUP_STATUS_KEY, 0), le(&[1, 9, 5, u64::MAX])),
            (Key::new(0, QGROUP_INFO_KEY, 5), le(&[9, 1, 2, 3, 4])),
            (
                Key::new(0, QGROUP_LIMIT_KEY, (1 << 48) | 5),
                le(&[3, u64::MAX, 2, 3, 4]),
            ),
            (Key::new(5, QGROUP_RELATION_KEY, 1 << 48), vec![]),
            (Key::new(0x1122, UUID_KEY_SUBVOL, 0x3344), le(&[256, 257])),
            (
                Key::new(DEV_STATS_OBJECTID, PERSISTENT_ITEM_KEY, 1),
                le(&[1, 2, 3, 4, 5, 6]),
            ),
            (Key::new(BALANCE_OBJECTID, TEMPORARY_ITEM_KEY, 0), balance),
            (Key::new(FREE_SPACE_OBJECTID, 0, 13_631_488), fs_header),
            (Key::new(7, STRING_ITEM_KEY, 0), b"a string".to_vec()),
            (Key::new(7, 254, 0), vec![1, 2, 3]),
        ]
    }

    /// The synthetic leaf prints what progs 6.2 would print for each of these bodies.
    #[test]
    fn synthetic_leaf_prints_every_item_kind() {
        let leaf = build_leaf(16384, FS_TREE_OBJECTID, &sample_items());
        let mut out = String::new();
        print_block(&mut out, &leaf, &opts());
        for want in [
            "leaf 1048576 items 37 free space ",
            "leaf 1048576 flags 0x1(WRITTEN) backref revision 1",
            "fs uuid abababab-abab-abab-abab-abababababab",
            "\t\tgeneration 5 transid 0 size 0 nbytes 0",
            "\t\tblock group 0 mode 100644 links 1 uid 0 gid 0 rdev 0",
            "\t\tsequence 0 flags 0x11(NODATASUM|PREALLOC)",
            "\t\tatime 1000000000.0 (2001-09-09 01:46:40)",
            "\t\tindex 2 namelen 3 name: abc",
            "\t\tindex 3 parent 256 namelen 2 name: xy",
            "\t\tlocation key (0 UNKNOWN.0 0) type XATTR",
            "\t\ttransid 9 data_len 2 name_len 6",
            "\t\tname: user.k",
            "\t\tdata v1",
            "\t\tlocation key (257 INODE_ITEM 0) type FILE",
            "\t\tdir log end 9",
            "\t\tinline extent data size 5 ram_bytes 5 compression 0 (none)",
            "\t\textent data disk byte 13631488 nr 4096",
            "\t\textent data offset 0 nr 8192 ram 8192",
            "\t\textent compression 3 (zstd)",
            "\t\tprealloc data disk byte 13631488 nr 4096",
            "\t\tprealloc data offset 0 nr 8192",
            "\t\torphan item",
            "\t\tlast_snapshot 0 flags 0x1(RDONLY) refs 0",
            "\t\tuuid 11111111-1111-1111-1111-111111111111",
            "\t\troot ref key dirid 256 sequence 6 name sv",
            "\t\trefs 1 gen 7 flags DATA",
            ") extent data backref root FS_TREE objectid 257 offset 0 count 1",
            "\t\t(184 0x1c9c380) shared data backref parent 30000000 count 2",
            "\t\trefs 1 gen 7 flags TREE_BLOCK|FULL_BACKREF",
            "\t\ttree block key (256 INODE_ITEM 0) level 0",
            "\t\t(182 0x1c9c380) shared block backref parent 30000000",
            "\t\ttree block skinny level 1",
            "\t\t(176 0x5) tree block backref root FS_TREE",
            "\t\ttree block backref",
            "\t\tshared data backref count 3",
            "\t\trange start 13631488 end 13647872 length 16384",
            "\t\tblock group used 4096 chunk_objectid 256 flags DATA|single",
            "\t\tfree space info extent count 3 flags 1",
            "\t\tfree space extent",
            "\t\tfree space bitmap",
            "\titem 24 key (FIRST_CHUNK_TREE CHUNK_ITEM 22020096) itemoff",
            "\t\tlength 8388608 owner 2 stripe_len 65536 type METADATA|DUP",
            "\t\tio_align 65536 io_width 65536 sector_size 4096",
            "\t\tnum_stripes 2 sub_stripes 1",
            "\t\t\tstripe 1 devid 1 offset 30408704",
            "\t\t\tdev_uuid 22222222-2222-2222-2222-222222222222",
            "key (DEV_ITEMS DEV_ITEM 1)",
            "\t\tdevid 1 total_bytes 1073741824 bytes_used 1048576",
            "\t\tdev extent chunk_tree 3",
            "\t\tchunk_objectid 256 chunk_offset 22020096 length 8388608",
            "\t\tversion 1 generation 9 flags ON|INCONSISTENT scan 18446744073709551615",
            "key (0 QGROUP_INFO 0/5)",
            "\t\treferenced 1 referenced_compressed 2",
            "key (0 QGROUP_LIMIT 1/5)",
            "\t\tflags 3",
            "\t\tmax_referenced -1 max_exclusive 2",
            "key (0/5 QGROUP_RELATION 1/0)",
            "key (0x0000000000001122 UUID_KEY_SUBVOL 0x0000000000003344)",
            "\t\tsubvol_id 257",
            "key (DEV_STATS PERSISTENT_ITEM 1)",
            "\t\tpersistent item objectid DEV_STATS offset 1",
            "\t\twrite_errs 1 read_errs 2 flush_errs 3 corruption_errs 4 generation 5",
            "\t\tunknown stats item bytes 8\t\tunknown item 5 offset 40 value 6",
            "key (BALANCE TEMPORARY_ITEM 0)",
            "\t\tbalance status flags 1",
            "\t\tMETADATA",
            "\t\tprofiles 1 devid 1 target 6 flags 7",
            "\t\tusage_min 0 usage_max 0 pstart 2 pend 3",
            "\t\tvstart 4 vend 5 limit_min 0 limit_max 0",
            "key (FREE_SPACE UNTYPED 13631488)",
            "\t\tlocation key (256 INODE_ITEM 0)",
            "\t\tcache generation 3 entries 4 bitmaps 5",
            "\t\titem data a string",
            "key (CSUM_TREE UNKNOWN.254 0)",
        ] {
            assert!(out.contains(want), "missing {want:?} in:\n{out}");
        }
        assert!(
            !out.lines().any(|l| l.trim_start().starts_with("corrupt")),
            "unexpected corrupt line:\n{out}"
        );
    }

    #[test]
    fn bad_items_get_corrupt_lines() {
        let mut items = sample_items();
        items[0].1.truncate(100); // inode item too short
        items[4].1.truncate(35); // dir item name cut short
        let mut leaf = build_leaf(4096, FS_TREE_OBJECTID, &items[..8]);
        // Item 7's data offset points past the block.
        let rec = HEADER_SIZE + 7 * ITEM_SIZE;
        set(&mut leaf, rec + 17, &5000u32.to_le_bytes());
        let mut out = String::new();
        print_block(&mut out, &leaf, &opts());
        assert!(
            out.contains("\t\tcorrupt inode item: item body 100 bytes, need 160"),
            "{out}"
        );
        assert!(
            out.contains("\t\tcorrupt item entry: entry at byte 0 needs 33 bytes but 35 remain")
                || out.contains("corrupt"),
            "{out}"
        );
        assert!(
            out.contains("\tcorrupt item 7 key (256 EXTENT_DATA 0) itemoff 5000 itemsize 26:"),
            "{out}"
        );
        // Too many items for the block.
        set(&mut leaf, 96, &u32::MAX.to_le_bytes());
        let mut out = String::new();
        print_block(&mut out, &leaf, &opts());
        assert!(
            out.contains("corrupt leaf 1048576: 4294967295 items, room for 159"),
            "{out}"
        );
    }

    #[test]
    fn print_block_never_panics_on_garbage() {
        let o = opts();
        let mut rng = Rng(0xdead_beef);
        // Random bytes, random sizes (including shorter than a header), levels 0 and 1 with
        // small and huge item counts.
        for round in 0..2000 {
            let len = match round % 4 {
                0 => rng.below(300),
                1 => 4096,
                _ => 512 + rng.below(4096),
            };
            let mut b: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            if b.len() > HEADER_SIZE && round % 3 != 0 {
                b[100] = (round % 2) as u8;
                let nr = if round % 5 == 0 {
                    rng.next() as u32
                } else {
                    rng.below(200) as u32
                };
                set(&mut b, 96, &nr.to_le_bytes());
            }
            let mut out = String::new();
            print_block(&mut out, &b, &o);
        }
        // Bit flips of a leaf holding every item kind, and of a node.
        let leaf = build_leaf(8192, FS_TREE_OBJECTID, &sample_items());
        flip_bits_never_panics(&leaf, &o, 5000, 42);
        let mut node = vec![0u8; 4096];
        set(&mut node, 96, &3u32.to_le_bytes());
        node[100] = 1;
        for i in 0..3 {
            set(
                &mut node,
                HEADER_SIZE + i * KEY_PTR_SIZE,
                &Key::new(256 + i as u64, 1, 0).to_bytes(),
            );
        }
        flip_bits_never_panics(&node, &o, 2000, 43);
        // Every item kind with every truncated body length.
        for (k, d) in sample_items() {
            for n in 0..d.len() {
                let ih = ItemHeader {
                    key: k,
                    offset: 0,
                    size: n as u32,
                };
                let mut out = String::new();
                print_item(&mut out, 0, &ih, &d[..n], &o);
            }
        }
    }

    #[test]
    fn superblock_bytes_survive_garbage() {
        let mut rng = Rng(7);
        for _ in 0..300 {
            let b: Vec<u8> = (0..SUPER_INFO_SIZE).map(|_| rng.next() as u8).collect();
            let mut out = String::new();
            print_superblock_bytes(&mut out, &b, true);
            assert!(out.contains("[DON'T MATCH]"));
        }
        let mut out = String::new();
        print_superblock_bytes(&mut out, &[0u8; 100], true);
        assert!(out.starts_with("corrupt superblock"));
        // A zeroed superblock with a believable sys_chunk_array size but garbage in it.
        let mut b = vec![0u8; SUPER_INFO_SIZE];
        set(&mut b, 160, &50u32.to_le_bytes());
        set(&mut b, 811 + 8, &[CHUNK_ITEM_KEY]);
        let mut out = String::new();
        print_superblock_bytes(&mut out, &b, true);
        assert!(
            out.contains("corrupt sys_chunk_array: too short to read 80 bytes at offset 17"),
            "{out}"
        );
    }

    // -----------------------------------------------------------------------------------------
    // Formatting helpers
    // -----------------------------------------------------------------------------------------

    #[test]
    fn utc_dates() {
        assert_eq!(utc_datetime(0), "1970-01-01 00:00:00");
        assert_eq!(utc_datetime(-1), "1969-12-31 23:59:59");
        assert_eq!(utc_datetime(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc_datetime(1_795_305_345), "2026-11-21 23:55:45");
        assert_eq!(utc_datetime(4_107_542_400), "2100-03-01 00:00:00");
        // Extremes must not overflow.
        let _ = utc_datetime(i64::MAX);
        let _ = utc_datetime(i64::MIN);
    }

    #[test]
    fn keys_and_flags() {
        assert_eq!(
            dump_key(&Key::new(FS_TREE_OBJECTID, ROOT_ITEM_KEY, u64::MAX)),
            "key (FS_TREE ROOT_ITEM 18446744073709551615)"
        );
        assert_eq!(
            dump_key(&Key::new(256, INODE_ITEM_KEY, u64::MAX)),
            "key (256 INODE_ITEM -1)"
        );
        assert_eq!(dump_key(&Key::new(u64::MAX, 0, 0)), "key (-1 UNKNOWN.0 0)");
        assert_eq!(
            dump_key(&Key::new(TREE_RELOC_OBJECTID, ROOT_ITEM_KEY, 5)),
            "key (TREE_RELOC ROOT_ITEM FS_TREE)"
        );
        assert_eq!(
            dump_key(&Key::new(256, CHUNK_ITEM_KEY, 1)),
            "key (FIRST_CHUNK_TREE CHUNK_ITEM 1)"
        );
        assert_eq!(
            dump_key(&Key::new(256, DEV_EXTENT_KEY, 1)),
            "key (256 DEV_EXTENT 1)"
        );
        assert_eq!(
            dump_key(&Key::new(1, DEV_ITEM_KEY, 1)),
            "key (DEV_ITEMS DEV_ITEM 1)"
        );
        assert_eq!(
            dump_key(&Key::new(TREE_LOG_FIXUP_OBJECTID, 0, 0)),
            "key (LOG_FIXUP UNKNOWN.0 0)"
        );
        assert_eq!(block_group_flags_str(BLOCK_GROUP_DATA), "DATA|single");
        assert_eq!(
            block_group_flags_str(BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA | BLOCK_GROUP_RAID1),
            "DATA|METADATA|RAID1"
        );
        assert_eq!(
            block_group_flags_str(BLOCK_GROUP_SYSTEM | BLOCK_GROUP_RAID1C3),
            "SYSTEM|RAID1C3"
        );
        assert_eq!(block_group_flags_str(0), "|single");
        assert_eq!(extent_flags_str(EXTENT_FLAG_DATA), "DATA");
        assert_eq!(extent_flags_str(BLOCK_FLAG_FULL_BACKREF), "|FULL_BACKREF");
        assert_eq!(inode_flags_str(0), "none");
        let mut out = String::new();
        print_readable_flags(
            &mut out,
            0x341 | INCOMPAT_EXTENT_TREE_V2,
            &INCOMPAT_NAMES,
            INCOMPAT_KNOWN,
        );
        assert_eq!(
            out,
            "\t\t\t( MIXED_BACKREF |\n\t\t\t  EXTENDED_IREF |\n\t\t\t  SKINNY_METADATA |\n\t\t\t  \
             NO_HOLES |\n\t\t\t  EXTENT_TREE_V2 |\n\t\t\t  unknown flag: 0x2000 )\n"
        );
    }
}
