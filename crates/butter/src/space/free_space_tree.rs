//! The free space tree (tree 10) of one block group: decoding its items into free ranges and
//! encoding free ranges into the items the kernel would write. Pure: no I/O.
//!
//! # Format
//!
//! Each block group `[start, start + len)` owns a contiguous run of keys in the tree:
//!
//! * `(start, FREE_SPACE_INFO, len)`: 8 bytes, `extent_count` (le32) and `flags` (le32; bit 0
//!   `USING_BITMAPS`).
//! * then, without `USING_BITMAPS`, one `(free_start, FREE_SPACE_EXTENT, free_len)` item with an
//!   empty body per free extent. Free extents never touch: the kernel merges a new free range
//!   with its neighbours.
//! * or, with `USING_BITMAPS`, `(bitmap_start, FREE_SPACE_BITMAP, bitmap_len)` items tiling the
//!   whole group: one every [`bitmap_range`] bytes (`sectorsize * 2048`: 256 bytes of bitmap),
//!   the last one shorter when the group is not a multiple of that. The body holds one bit per
//!   sector (set = free), least significant bit first, `ceil(bitmap_len / sectorsize / 8)`
//!   bytes; bits past the item's range are zero.
//!
//! `extent_count` is the number of free extents (maximal runs of free sectors) in both formats;
//! in bitmap mode runs continue across bitmap item boundaries.
//!
//! # When the kernel switches formats
//!
//! [`thresholds`] gives `(high, low)` for a group: the number of 25-byte item headers that
//! take as much leaf space as the group's bitmaps (`ceil(len / bitmap_range)` items of
//! 25 + 256 bytes, divided by 25), and `high - 100` (0 when `high <= 100`). Whenever the kernel
//! changes a group's extent count it converts extents to bitmaps when the new count is above
//! `high`, and bitmaps to extents when it is below `low`; between the two the format stays
//! as it is. [`encode`] applies that rule once, given the current format.
//!
//! Ranges here are `(start, len)` in logical bytes; ends are exclusive.

use crate::error::{Error, Location, Result};
use crate::format::items::FreeSpaceInfo;
use crate::format::*;

/// Bytes in the body of a full FREE_SPACE_BITMAP item.
pub(crate) const BITMAP_BYTES: u64 = 256;
/// Sectors one full bitmap item covers.
pub(crate) const BITMAP_BITS: u64 = BITMAP_BYTES * 8;
/// The low threshold sits this many extents below the high one (when the high one is above it).
pub(crate) const THRESHOLD_GAP: u32 = 100;

/// The free space of one block group.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct BgFreeSpace {
    /// Logical start of the block group.
    pub start: u64,
    /// Length of the block group in bytes.
    pub len: u64,
    /// Free extents `(start, len)`: sorted, non-empty, inside the group, never touching.
    pub extents: Vec<(u64, u64)>,
}

impl BgFreeSpace {
    #[cfg(test)]
    /// A group with no free space.
    pub(crate) fn new(start: u64, len: u64) -> BgFreeSpace {
        BgFreeSpace {
            start,
            len,
            extents: Vec::new(),
        }
    }

    /// The free space left in `[start, start + len)` by the `used` ranges `(start, len)`, which
    /// may come in any order, overlap, or reach outside the group (the outside is ignored).
    pub(crate) fn from_used(
        start: u64,
        len: u64,
        used: impl IntoIterator<Item = (u64, u64)>,
    ) -> Self {
        let end = start.saturating_add(len);
        let mut used: Vec<(u64, u64)> = used
            .into_iter()
            .map(|(s, l)| (s.max(start), s.saturating_add(l).min(end)))
            .filter(|(s, e)| s < e)
            .collect();
        used.sort_unstable();
        let mut extents = Vec::new();
        let mut cur = start;
        for (s, e) in used {
            if s > cur {
                extents.push((cur, s - cur));
            }
            cur = cur.max(e);
        }
        if cur < end {
            extents.push((cur, end - cur));
        }
        BgFreeSpace {
            start,
            len,
            extents,
        }
    }

    /// End of the group (exclusive).
    pub(crate) fn end(&self) -> u64 {
        self.start.saturating_add(self.len)
    }

    /// Total free bytes.
    pub(crate) fn free_bytes(&self) -> u64 {
        self.extents
            .iter()
            .fold(0u64, |a, &(_, l)| a.saturating_add(l))
    }

    /// The same free space with the extents clipped to the group, sorted and merged.
    pub(crate) fn normalized(&self) -> BgFreeSpace {
        let end = self.end();
        let mut v: Vec<(u64, u64)> = self
            .extents
            .iter()
            .map(|&(s, l)| (s.max(self.start), s.saturating_add(l).min(end)))
            .filter(|(s, e)| s < e)
            .collect();
        v.sort_unstable();
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
        let mut last: Option<(u64, u64)> = None;
        for (s, e) in v {
            match last.as_mut() {
                Some((_, le)) if s <= *le => *le = (*le).max(e),
                _ => {
                    if let Some((ls, le)) = last {
                        out.push((ls, le - ls));
                    }
                    last = Some((s, e));
                }
            }
        }
        if let Some((ls, le)) = last {
            out.push((ls, le - ls));
        }
        BgFreeSpace {
            start: self.start,
            len: self.len,
            extents: out,
        }
    }
}

/// Bytes of a block group one full bitmap item covers: `sectorsize * 2048`.
pub(crate) fn bitmap_range(sectorsize: u32) -> u64 {
    sectorsize as u64 * BITMAP_BITS
}

/// Body size of a bitmap item covering `len` bytes: one bit per whole sector, rounded up to
/// bytes.
pub(crate) fn bitmap_body_len(len: u64, sectorsize: u32) -> u64 {
    (len / (sectorsize.max(1) as u64)).div_ceil(8)
}

/// `(bitmap_high_thresh, bitmap_low_thresh)` of a block group of `bg_len` bytes: a group in
/// extent format converts to bitmaps when its extent count goes above the first; a group in
/// bitmap format converts back when the count goes below the second.
pub(crate) fn thresholds(bg_len: u64, sectorsize: u32) -> (u32, u32) {
    let range = bitmap_range(sectorsize);
    if range == 0 {
        return (0, 0);
    }
    let bitmaps = bg_len.div_ceil(range);
    let header = ITEM_SIZE as u64;
    let high = bitmaps.saturating_mul(header + BITMAP_BYTES) / header;
    let high = u32::try_from(high).unwrap_or(u32::MAX);
    let low = high.saturating_sub(THRESHOLD_GAP);
    (high, low)
}

/// The format a group with `extent_count` free extents ends up in after the kernel's next
/// update, given its current format.
pub(crate) fn use_bitmaps(
    extent_count: u64,
    bg_len: u64,
    sectorsize: u32,
    currently_bitmaps: bool,
) -> bool {
    let (high, low) = thresholds(bg_len, sectorsize);
    if currently_bitmaps {
        extent_count >= low as u64
    } else {
        extent_count > high as u64
    }
}

/// A block group's free space items as found, before their extent count and flags are judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Decoded {
    /// The free space the EXTENT or BITMAP items describe.
    pub space: BgFreeSpace,
    /// The FREE_SPACE_INFO body as stored.
    pub info: FreeSpaceInfo,
    /// `Some(FREE_SPACE_EXTENT_KEY)` or `Some(FREE_SPACE_BITMAP_KEY)`: the type of the items
    /// after the info; `None` when there are none.
    pub item_type: Option<u8>,
}

impl Decoded {
    /// True when the info's flags say bitmaps.
    pub(crate) fn flag_bitmaps(&self) -> bool {
        self.info.flags & FREE_SPACE_USING_BITMAPS != 0
    }

    #[cfg(test)]
    /// Why the info disagrees with the items, if it does: unknown flag bits, a format flag that
    /// does not match the item type, or an extent count that is not the number of free extents.
    pub(crate) fn info_problem(&self) -> Option<String> {
        let unknown = self.info.flags & !FREE_SPACE_USING_BITMAPS;
        if unknown != 0 {
            return Some(format!(
                "free space info flags {:#x} has unknown bits {unknown:#x}",
                self.info.flags
            ));
        }
        if let Some(p) = self.flags_problem() {
            return Some(p);
        }
        self.count_problem()
    }

    /// The format flag disagrees with the type of the items.
    pub(crate) fn flags_problem(&self) -> Option<String> {
        match (self.flag_bitmaps(), self.item_type) {
            (true, Some(FREE_SPACE_EXTENT_KEY)) => Some(format!(
                "free space info flags {:#x} say bitmaps, but the group has FREE_SPACE_EXTENT items",
                self.info.flags
            )),
            (true, None) if self.space.len > 0 => Some(format!(
                "free space info flags {:#x} say bitmaps, but the group has no FREE_SPACE_BITMAP items",
                self.info.flags
            )),
            (false, Some(FREE_SPACE_BITMAP_KEY)) => Some(format!(
                "free space info flags {:#x} say extents, but the group has FREE_SPACE_BITMAP items",
                self.info.flags
            )),
            _ => None,
        }
    }

    /// The extent count is not the number of free extents.
    pub(crate) fn count_problem(&self) -> Option<String> {
        let n = self.space.extents.len() as u64;
        (self.info.extent_count as u64 != n).then(|| {
            format!(
                "free space info extent count {}, but the group has {n} free extents",
                self.info.extent_count
            )
        })
    }
}

fn fst_loc(bg_start: u64, key: Option<Key>) -> Location {
    Location {
        tree: Some(FREE_SPACE_TREE_OBJECTID),
        key,
        what: Some(format!("free space of block group {bg_start}")),
        ..Default::default()
    }
}

/// Decodes the items of one block group (`items` in key order: its FREE_SPACE_INFO first, then
/// its EXTENT or BITMAP items, nothing else) and checks their structure: keys inside the group,
/// sector aligned, in order, not overlapping; extents with empty bodies that do not touch;
/// bitmaps of the right size tiling the group with no bits past their range. The extent count
/// and flags are returned as stored, not judged (see [`Decoded::info_problem`]).
pub(crate) fn decode_items(
    items: &[(Key, &[u8])],
    bg_start: u64,
    bg_len: u64,
    sectorsize: u32,
) -> Result<Decoded> {
    let bad = |key: Option<Key>, msg: String| Err(Error::corrupt(fst_loc(bg_start, key), msg));
    let bg_end = check_group_geometry(bg_start, bg_len, sectorsize)?;
    let ss = sectorsize as u64;
    let (info, rest) = decode_info_item(items, bg_start, bg_len)?;
    let mut item_type = None;
    let mut extents: Vec<(u64, u64)> = Vec::new();
    // End of the previous EXTENT/BITMAP item (exclusive); the next one starts at or after it.
    let mut prev_end = bg_start;
    // Bitmap mode: the free run being built (start, end).
    let mut run: Option<(u64, u64)> = None;
    for (k, body) in rest {
        let k = *k;
        let e = check_item_key(k, &mut item_type, bg_start, bg_len, bg_end, ss)?;
        if k.ty == FREE_SPACE_EXTENT_KEY {
            decode_extent_item(k, body, bg_start, prev_end, &mut extents)?;
        } else {
            decode_bitmap_item(
                k,
                body,
                bg_start,
                prev_end,
                sectorsize,
                &mut run,
                &mut extents,
            )?;
        }
        prev_end = e;
    }
    if item_type == Some(FREE_SPACE_BITMAP_KEY) && prev_end != bg_end {
        let last = rest.last().map(|(k, _)| *k);
        return bad(
            last,
            format!("free space bitmaps end at {prev_end}, not at the block group end {bg_end}"),
        );
    }
    if let Some((rs, re)) = run {
        extents.push((rs, re - rs));
    }
    Ok(Decoded {
        space: BgFreeSpace {
            start: bg_start,
            len: bg_len,
            extents,
        },
        info,
        item_type,
    })
}

/// One free space tree item as [`decode_items`] takes it: key and body.
type FstItem<'b> = (Key, &'b [u8]);

/// First phase of [`decode_items`]: the sector size must be a power of two and the block group
/// sector aligned, its end not overflowing. Returns the group's end (exclusive).
fn check_group_geometry(bg_start: u64, bg_len: u64, sectorsize: u32) -> Result<u64> {
    let bad = |key: Option<Key>, msg: String| Err(Error::corrupt(fst_loc(bg_start, key), msg));
    if sectorsize == 0 || !sectorsize.is_power_of_two() {
        return bad(
            None,
            format!("sector size {sectorsize} is not a power of two"),
        );
    }
    let ss = sectorsize as u64;
    let Some(bg_end) = bg_start.checked_add(bg_len) else {
        return bad(None, format!("block group length {bg_len} overflows"));
    };
    if !bg_start.is_multiple_of(ss) || !bg_len.is_multiple_of(ss) {
        return bad(
            None,
            format!("block group {bg_start} length {bg_len} is not sector aligned"),
        );
    }
    Ok(bg_end)
}

/// Second phase of [`decode_items`]: the first item must be the group's FREE_SPACE_INFO with an
/// 8-byte body. Returns the parsed info and the items after it.
fn decode_info_item<'i, 'b>(
    items: &'i [FstItem<'b>],
    bg_start: u64,
    bg_len: u64,
) -> Result<(FreeSpaceInfo, &'i [FstItem<'b>])> {
    let bad = |key: Option<Key>, msg: String| Err(Error::corrupt(fst_loc(bg_start, key), msg));
    let info_key = Key::new(bg_start, FREE_SPACE_INFO_KEY, bg_len);
    let Some(((k0, body0), rest)) = items.split_first() else {
        return bad(None, "no FREE_SPACE_INFO item".into());
    };
    if *k0 != info_key {
        return bad(
            Some(*k0),
            format!("the first item is not FREE_SPACE_INFO {info_key}"),
        );
    }
    if body0.len() != 8 {
        return bad(
            Some(*k0),
            format!("free space info body is {} bytes, not 8", body0.len()),
        );
    }
    let info = FreeSpaceInfo::parse(body0).map_err(|e| match e {
        Error::Corrupt { reason, .. } => Error::corrupt(fst_loc(bg_start, Some(*k0)), reason),
        e => e,
    })?;
    Ok((info, rest))
}

/// Per-item key check of [`decode_items`]: the item is an EXTENT or BITMAP of the same type as
/// the group's earlier ones (`item_type`, set by the first), covering a non-empty, sector
/// aligned range inside the group. Returns the range's end (exclusive).
fn check_item_key(
    k: Key,
    item_type: &mut Option<u8>,
    bg_start: u64,
    bg_len: u64,
    bg_end: u64,
    ss: u64,
) -> Result<u64> {
    let bad = |key: Option<Key>, msg: String| Err(Error::corrupt(fst_loc(bg_start, key), msg));
    if k.ty != FREE_SPACE_EXTENT_KEY && k.ty != FREE_SPACE_BITMAP_KEY {
        return bad(
            Some(k),
            format!(
                "item of type {} among free space items",
                key_type_name(k.ty)
            ),
        );
    }
    match *item_type {
        None => *item_type = Some(k.ty),
        Some(t) if t != k.ty => {
            return bad(
                Some(k),
                "FREE_SPACE_EXTENT and FREE_SPACE_BITMAP items mixed in one block group".into(),
            )
        }
        _ => {}
    }
    let (s, l) = (k.objectid, k.offset);
    let e = match s.checked_add(l) {
        Some(e) if l > 0 && s >= bg_start && e <= bg_end => e,
        _ => {
            return bad(
                Some(k),
                format!("range {s}+{l} is empty or not inside the block group {bg_start}+{bg_len}"),
            )
        }
    };
    if !s.is_multiple_of(ss) || !l.is_multiple_of(ss) {
        return bad(
            Some(k),
            format!("range {s}+{l} is not aligned to the sector size {ss}"),
        );
    }
    Ok(e)
}

/// A FREE_SPACE_EXTENT item (key already checked): an empty body, starting past the previous
/// extent (`prev_end`) without touching it. Appends the extent to `extents`.
fn decode_extent_item(
    k: Key,
    body: &[u8],
    bg_start: u64,
    prev_end: u64,
    extents: &mut Vec<(u64, u64)>,
) -> Result<()> {
    let bad = |key: Option<Key>, msg: String| Err(Error::corrupt(fst_loc(bg_start, key), msg));
    let (s, l) = (k.objectid, k.offset);
    if !body.is_empty() {
        return bad(
            Some(k),
            format!("free space extent has a {}-byte body", body.len()),
        );
    }
    if s < prev_end || (s == prev_end && !extents.is_empty()) {
        return bad(
            Some(k),
            format!(
                "free space extent {s}+{l} overlaps or touches the previous one (ending at {prev_end})"
            ),
        );
    }
    extents.push((s, l));
    Ok(())
}

/// A FREE_SPACE_BITMAP item (key already checked): it starts where the previous bitmap (or the
/// group) ends, its body has one bit per sector and no bits past its range. Its set bits extend
/// the open `run` or close it into `extents`.
fn decode_bitmap_item(
    k: Key,
    body: &[u8],
    bg_start: u64,
    prev_end: u64,
    sectorsize: u32,
    run: &mut Option<(u64, u64)>,
    extents: &mut Vec<(u64, u64)>,
) -> Result<()> {
    let bad = |key: Option<Key>, msg: String| Err(Error::corrupt(fst_loc(bg_start, key), msg));
    let (s, l) = (k.objectid, k.offset);
    let ss = sectorsize as u64;
    if s != prev_end {
        return bad(
            Some(k),
            format!("free space bitmap starts at {s}, not at {prev_end} where the previous one (or the group) ends"),
        );
    }
    let want = bitmap_body_len(l, sectorsize);
    if body.len() as u64 != want {
        return bad(
            Some(k),
            format!(
                "free space bitmap of {l} bytes has a {}-byte body, not {want}",
                body.len()
            ),
        );
    }
    let nbits = l / ss;
    if !nbits.is_multiple_of(8) {
        if let Some(last) = body.last() {
            if last >> (nbits % 8) != 0 {
                return bad(
                    Some(k),
                    format!("free space bitmap has bits set past its {nbits} sectors"),
                );
            }
        }
    }
    bitmap_runs(body, nbits, s, ss, run, extents);
    Ok(())
}

/// Adds the set bits of one bitmap (first bit = sector at `start`) to the runs: `run` is the
/// run still open from the previous bitmap; closed runs go to `out`.
fn bitmap_runs(
    body: &[u8],
    nbits: u64,
    start: u64,
    ss: u64,
    run: &mut Option<(u64, u64)>,
    out: &mut Vec<(u64, u64)>,
) {
    let mut bit = 0u64;
    while bit < nbits {
        let byte = body.get((bit / 8) as usize).copied().unwrap_or(0);
        // Whole bytes of one value at a byte boundary go at once.
        if bit.is_multiple_of(8) && nbits - bit >= 8 && (byte == 0 || byte == 0xff) {
            let addr = start + bit * ss;
            if byte == 0xff {
                match run {
                    Some((_, re)) if *re == addr => *re = addr + 8 * ss,
                    _ => {
                        if let Some((rs, re)) = run.take() {
                            out.push((rs, re - rs));
                        }
                        *run = Some((addr, addr + 8 * ss));
                    }
                }
            } else if let Some((rs, re)) = run.take() {
                out.push((rs, re - rs));
            }
            bit += 8;
            continue;
        }
        let set = (byte >> (bit % 8)) & 1 != 0;
        let addr = start + bit * ss;
        if set {
            match run {
                Some((_, re)) if *re == addr => *re = addr + ss,
                _ => {
                    if let Some((rs, re)) = run.take() {
                        out.push((rs, re - rs));
                    }
                    *run = Some((addr, addr + ss));
                }
            }
        } else if let Some((rs, re)) = run.take() {
            out.push((rs, re - rs));
        }
        bit += 1;
    }
}

#[cfg(test)]
/// Decodes one block group's items (see [`decode_items`]) and also requires the info to agree
/// with them: known flags only, the format flag matching the item type, and the extent count
/// equal to the number of free extents. Returns the free space and whether it is in bitmaps.
pub(crate) fn decode(
    items: &[(Key, &[u8])],
    bg_start: u64,
    bg_len: u64,
    sectorsize: u32,
) -> Result<(BgFreeSpace, bool)> {
    let d = decode_items(items, bg_start, bg_len, sectorsize)?;
    if let Some(p) = d.info_problem() {
        let key = Key::new(bg_start, FREE_SPACE_INFO_KEY, bg_len);
        return Err(Error::corrupt(fst_loc(bg_start, Some(key)), p));
    }
    let bitmaps = d.flag_bitmaps();
    Ok((d.space, bitmaps))
}

/// The items, in key order and including FREE_SPACE_INFO, that describe `fs` in the format
/// the kernel would use given the group's current format (see [`use_bitmaps`]). Returns that
/// format (true = bitmaps) and the items. `fs` is normalized first (clipped, sorted, merged).
pub(crate) fn encode(
    fs: &BgFreeSpace,
    sectorsize: u32,
    currently_bitmaps: bool,
) -> (bool, Vec<(Key, Vec<u8>)>) {
    let fs = fs.normalized();
    let bitmaps = use_bitmaps(
        fs.extents.len() as u64,
        fs.len,
        sectorsize,
        currently_bitmaps,
    );
    (bitmaps, encode_normalized(&fs, sectorsize, bitmaps))
}

#[cfg(test)]
/// Like [`encode`] but in the format asked for, whatever the thresholds say.
pub(crate) fn encode_as(fs: &BgFreeSpace, sectorsize: u32, bitmaps: bool) -> Vec<(Key, Vec<u8>)> {
    encode_normalized(&fs.normalized(), sectorsize, bitmaps)
}

fn encode_normalized(fs: &BgFreeSpace, sectorsize: u32, bitmaps: bool) -> Vec<(Key, Vec<u8>)> {
    let count = u32::try_from(fs.extents.len()).unwrap_or(u32::MAX);
    let flags = if bitmaps { FREE_SPACE_USING_BITMAPS } else { 0 };
    let mut info = Vec::with_capacity(8);
    info.extend_from_slice(&count.to_le_bytes());
    info.extend_from_slice(&flags.to_le_bytes());
    let mut out = vec![(Key::new(fs.start, FREE_SPACE_INFO_KEY, fs.len), info)];
    if !bitmaps {
        out.extend(
            fs.extents
                .iter()
                .map(|&(s, l)| (Key::new(s, FREE_SPACE_EXTENT_KEY, l), Vec::new())),
        );
        return out;
    }
    let ss = sectorsize.max(1) as u64;
    let range = bitmap_range(sectorsize.max(1));
    let end = fs.end();
    let mut ext = fs.extents.iter().peekable();
    let mut i = fs.start;
    while i < end {
        let l = range.min(end - i);
        let mut body = vec![0u8; bitmap_body_len(l, sectorsize) as usize];
        let bend = i + l;
        // Extents are sorted: set the bits of those overlapping [i, bend).
        while let Some(&&(s, el)) = ext.peek() {
            if s >= bend {
                break;
            }
            let e = s + el;
            let first = (s.max(i) - i) / ss;
            let last = (e.min(bend) - i) / ss;
            for b in first..last {
                if let Some(byte) = body.get_mut((b / 8) as usize) {
                    *byte |= 1 << (b % 8);
                }
            }
            if e <= bend {
                ext.next();
            } else {
                break;
            }
        }
        out.push((Key::new(i, FREE_SPACE_BITMAP_KEY, l), body));
        i = bend;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn thresholds_from_the_format_rules() {
        // 4 KiB sectors: one bitmap covers 8 MiB; (bitmaps * 281) / 25, low = high - 100.
        assert_eq!(thresholds(8 * MIB, 4096), (11, 0));
        assert_eq!(thresholds(53_673_984, 4096), (78, 0)); // 7 bitmaps (mkfs metadata group)
        assert_eq!(thresholds(112 * MIB, 4096), (157, 57)); // 14 bitmaps
        assert_eq!(thresholds(256 * MIB, 4096), (359, 259));
        assert_eq!(thresholds(1024 * MIB, 4096), (1438, 1338));
        assert_eq!(thresholds(10 * 1024 * MIB, 4096), (14387, 14287));
        // A part bitmap counts as a whole one.
        assert_eq!(thresholds(8 * MIB + 4096, 4096), (22, 0));
        // 64 KiB sectors: one bitmap covers 128 MiB.
        assert_eq!(thresholds(1024 * MIB, 65536), (89, 0));
        assert_eq!(thresholds(0, 4096), (0, 0));
    }

    #[test]
    fn format_choice_has_hysteresis() {
        let len = 112 * MIB;
        assert!(!use_bitmaps(157, len, 4096, false));
        assert!(use_bitmaps(158, len, 4096, false));
        assert!(use_bitmaps(57, len, 4096, true));
        assert!(!use_bitmaps(56, len, 4096, true));
        assert!(use_bitmaps(100, len, 4096, true));
        assert!(!use_bitmaps(100, len, 4096, false));
    }

    #[test]
    fn bitmap_layout_and_bits() {
        let start = 13 * MIB;
        let len = 8 * MIB + 3 * 4096 * 8 + 4096; // one full bitmap and a 25-sector tail
        let fs = BgFreeSpace {
            start,
            len,
            extents: vec![
                (start, 4096),
                (start + 3 * 4096, 2 * 4096),
                // crosses the bitmap boundary
                (start + 8 * MIB - 4096, 3 * 4096),
                (start + len - 4096, 4096),
            ],
        };
        let items = encode_as(&fs, 4096, true);
        assert_eq!(items.len(), 3);
        assert_eq!(items[0].0, Key::new(start, FREE_SPACE_INFO_KEY, len));
        assert_eq!(items[0].1, [4, 0, 0, 0, 1, 0, 0, 0]);
        assert_eq!(items[1].0, Key::new(start, FREE_SPACE_BITMAP_KEY, 8 * MIB));
        assert_eq!(items[1].1.len(), 256);
        assert_eq!(items[1].1[0], 0b0001_1001);
        assert_eq!(items[1].1[255], 0b1000_0000);
        let tail = len - 8 * MIB;
        assert_eq!(
            items[2].0,
            Key::new(start + 8 * MIB, FREE_SPACE_BITMAP_KEY, tail)
        );
        assert_eq!(items[2].1.len(), 4); // 25 sectors
        assert_eq!(items[2].1, [0b0000_0011, 0, 0, 0b0000_0001]);
        let refs: Vec<(Key, &[u8])> = items.iter().map(|(k, b)| (*k, b.as_slice())).collect();
        let (back, bm) = decode(&refs, start, len, 4096).unwrap();
        assert!(bm);
        assert_eq!(back, fs);
    }

    fn as_refs(items: &[(Key, Vec<u8>)]) -> Vec<(Key, &[u8])> {
        items.iter().map(|(k, b)| (*k, b.as_slice())).collect()
    }

    #[test]
    fn decode_rejects_damage() {
        let start = 64 * MIB;
        let len = 16 * MIB;
        let fs = BgFreeSpace {
            start,
            len,
            extents: vec![(start, 8192), (start + 65536, 4096)],
        };
        let ext = encode_as(&fs, 4096, false);
        let bm = encode_as(&fs, 4096, true);
        let err = |items: Vec<(Key, Vec<u8>)>| {
            let e = decode(&as_refs(&items), start, len, 4096).unwrap_err();
            let Error::Corrupt { loc, reason } = &e else {
                panic!("{e}")
            };
            assert_eq!(loc.tree, Some(FREE_SPACE_TREE_OBJECTID));
            reason.clone()
        };
        // Missing info.
        assert!(err(ext[1..].to_vec()).contains("FREE_SPACE_INFO"));
        assert!(decode(&[], start, len, 4096).is_err());
        // Wrong count, unknown flag, flag not matching items.
        let mut v = ext.clone();
        v[0].1[0] = 3;
        assert!(err(v).contains("extent count 3"));
        let mut v = ext.clone();
        v[0].1[4] = 2;
        assert!(err(v).contains("unknown bits"));
        let mut v = ext.clone();
        v[0].1[4] = 1;
        assert!(err(v).contains("say bitmaps"));
        let mut v = bm.clone();
        v[0].1[4] = 0;
        assert!(err(v).contains("say extents"));
        // Touching or overlapping extents, outside the group, misaligned, with a body.
        let mut v = ext.clone();
        v[2].0 = Key::new(start + 8192, FREE_SPACE_EXTENT_KEY, 4096);
        assert!(err(v).contains("touches"));
        let mut v = ext.clone();
        v[2].0 = Key::new(start + len - 4096, FREE_SPACE_EXTENT_KEY, 8192);
        assert!(err(v).contains("not inside"));
        let mut v = ext.clone();
        v[2].0 = Key::new(start + 65536 + 512, FREE_SPACE_EXTENT_KEY, 4096);
        assert!(err(v).contains("aligned"));
        let mut v = ext.clone();
        v[2].1 = vec![0];
        assert!(err(v).contains("body"));
        // Bitmaps: short body, missing bitmap, stray bits, mixed types.
        let mut v = bm.clone();
        v[1].1.pop();
        assert!(err(v).contains("body"));
        let mut v = bm.clone();
        v.remove(2);
        assert!(err(v).contains("not at the block group end"));
        let mut v = bm.clone();
        v.remove(1);
        assert!(err(v).contains("not at"));
        let mut v = bm.clone();
        v.push((
            Key::new(start + len - 4096, FREE_SPACE_EXTENT_KEY, 4096),
            vec![],
        ));
        assert!(err(v).contains("mixed"));
        let mut v = ext.clone();
        v.push((Key::new(start + len, FREE_SPACE_INFO_KEY, 4096), vec![0; 8]));
        assert!(err(v).contains("FREE_SPACE_INFO among"));
    }

    #[test]
    fn stray_bits_past_a_short_bitmap() {
        let start = 0;
        let len = 5 * 4096;
        let fs = BgFreeSpace::new(start, len);
        let mut v = encode_as(&fs, 4096, true);
        assert_eq!(v[1].1, [0]);
        v[1].1[0] = 0b0010_0000;
        let e = decode_items(&as_refs(&v), start, len, 4096).unwrap_err();
        assert!(e.to_string().contains("past"), "{e}");
    }

    #[test]
    fn from_used_and_normalized() {
        let fs = BgFreeSpace::from_used(100, 100, [(150, 10), (90, 20), (155, 10), (195, 50)]);
        assert_eq!(fs.extents, vec![(110, 40), (165, 30)]);
        let n = BgFreeSpace {
            start: 0,
            len: 100,
            extents: vec![(50, 10), (0, 5), (5, 5), (58, 100)],
        }
        .normalized();
        assert_eq!(n.extents, vec![(0, 10), (50, 50)]);
        assert_eq!(n.free_bytes(), 60);
    }

    fn arb_space() -> impl Strategy<Value = (BgFreeSpace, u32)> {
        (
            prop_oneof![Just(4096u32), Just(512u32), Just(65536u32)],
            0u64..64,
            1u64..6000,
            proptest::collection::vec((0u64..6000, 1u64..40), 0..300),
        )
            .prop_map(|(ss, start_units, sectors, used)| {
                let ss64 = ss as u64;
                let start = start_units * 1024 * 1024 * 1024 / ss64 * ss64;
                let len = sectors * ss64;
                let used = used.into_iter().map(|(s, l)| (start + s * ss64, l * ss64));
                (BgFreeSpace::from_used(start, len, used), ss)
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        #[test]
        fn round_trip_both_formats((fs, ss) in arb_space(), cur in any::<bool>()) {
            for bitmaps in [false, true] {
                let items = encode_as(&fs, ss, bitmaps);
                let (back, bm) = decode(&as_refs(&items), fs.start, fs.len, ss).unwrap();
                prop_assert_eq!(bm, bitmaps);
                prop_assert_eq!(&back, &fs);
                // Keys strictly increase.
                prop_assert!(items.windows(2).all(|w| w[0].0 < w[1].0));
            }
            let (bm, items) = encode(&fs, ss, cur);
            prop_assert_eq!(bm, use_bitmaps(fs.extents.len() as u64, fs.len, ss, cur));
            let (back, bm2) = decode(&as_refs(&items), fs.start, fs.len, ss).unwrap();
            prop_assert_eq!(bm2, bm);
            prop_assert_eq!(back, fs);
        }

        #[test]
        fn decode_never_panics(
            (fs, ss) in arb_space(),
            bitmaps in any::<bool>(),
            flips in proptest::collection::vec((any::<usize>(), any::<usize>(), any::<u8>()), 1..4),
        ) {
            let mut items = encode_as(&fs, ss, bitmaps);
            for (i, off, v) in flips {
                let n = items.len();
                let it = &mut items[i % n];
                if it.1.is_empty() || off % 3 == 0 {
                    it.0.offset ^= v as u64 * ss as u64;
                } else {
                    let m = it.1.len();
                    it.1[off % m] ^= v;
                }
            }
            let _ = decode(&as_refs(&items), fs.start, fs.len, ss);
        }
    }
}
