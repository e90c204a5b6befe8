//! The one superblock writer. The commit, the fsync log commit and mkfs all write their
//! superblock copies here: a decoded [`Superblock`] encoded over the bytes the filesystem was
//! opened with ([`Superblock::encode_over`]), so fields butter does not decode stay as they
//! were, each copy with its own `bytenr` and checksum.

use crate::error::{Error, Result};
use crate::format::superblock::DevItem;
use crate::format::superblock::Superblock;
use crate::format::{super_offset, SUPER_INFO_SIZE, SUPER_MIRROR_MAX};
use crate::io::device::BlockDevice;
use crate::io::volumes::Devices;
use std::collections::BTreeMap;

/// `sb` as device `devid` carries it: with that device's own item.
fn for_device(sb: &Superblock, items: &BTreeMap<u64, DevItem>, devid: u64) -> Superblock {
    let mut s = sb.clone();
    if let Some(item) = items.get(&devid) {
        s.dev_item = item.clone();
    }
    s
}

/// [`write_all`] on every present device, each copy with that device's item from `items`
/// (the primary's is `sb.dev_item` when `items` lacks it); every device written and
/// flushed in turn.
pub(crate) fn write_all_devices(
    devices: &Devices,
    items: &BTreeMap<u64, DevItem>,
    sb: &Superblock,
    base: &[u8],
    order: Order,
) -> Result<()> {
    // The kernel's rule: the commit stands while one device took its superblocks.
    devices.on_each(|devid, dev| {
        write_all(dev.as_ref(), &for_device(sb, items, devid), base, order).map(|_| ())
    })
}

/// [`write_all`] on one device that is not (yet) in the open set, with its item from
/// `items` (a device just added).
pub(crate) fn write_all_device(
    dev: &dyn crate::io::device::BlockDevice,
    devid: u64,
    items: &BTreeMap<u64, DevItem>,
    sb: &Superblock,
    base: &[u8],
    order: Order,
) -> Result<()> {
    write_all(dev, &for_device(sb, items, devid), base, order).map(|_| ())
}

/// Zeroes the magic of every superblock copy on `dev` (a device removed from its
/// filesystem), then flushes.
pub(crate) fn wipe(dev: &dyn crate::io::device::BlockDevice) -> Result<()> {
    for off in (0..crate::format::SUPER_MIRROR_MAX).map(crate::format::super_offset) {
        if off + SUPER_INFO_SIZE as u64 <= dev.len() {
            dev.write_at(&[0u8; 8], off + 64)
                .map_err(|e| Error::io("wiping a removed device's superblock", off, e))?;
        }
    }
    dev.flush()
        .map_err(|e| Error::io("flushing a removed device", 0, e))
}

/// [`write_primary`] on every present device (the caller flushes them all).
pub(crate) fn write_primary_devices(
    devices: &Devices,
    items: &BTreeMap<u64, DevItem>,
    sb: &Superblock,
    base: &[u8],
) -> Result<()> {
    devices.on_each(|devid, dev| write_primary(dev.as_ref(), &for_device(sb, items, devid), base))
}

/// Byte offsets of the copies a filesystem of `total_bytes` on a device of `dev_len` bytes
/// has: each mirror (64 KiB, 64 MiB, 256 GiB) that fits inside both.
pub(crate) fn copy_offsets(total_bytes: u64, dev_len: u64) -> Vec<u64> {
    (0..SUPER_MIRROR_MAX)
        .map(super_offset)
        .take_while(|&off| off + SUPER_INFO_SIZE as u64 <= total_bytes.min(dev_len))
        .collect()
}

fn write_copy(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    base: &[u8],
    off: u64,
    what: &str,
) -> Result<()> {
    let mut copy = sb.clone();
    copy.bytenr = off;
    dev.write_at(&copy.encode_over(base), off)
        .map_err(|e| Error::io(what.to_string(), off, e))
}

/// In which order [`write_all`] writes the copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Order {
    /// The primary first, as the kernel's commit writes them (a commit's crash tests hold
    /// this order).
    PrimaryFirst,
    /// The mirrors first, the primary last: a new filesystem that mkfs did not finish has no
    /// valid primary.
    PrimaryLast,
}

/// Writes every copy of `sb` that fits (see [`copy_offsets`]; the filesystem's size is
/// `sb.dev_item.total_bytes`) in `order`, then flushes. Returns the offsets written, in
/// ascending order.
pub(crate) fn write_all(
    dev: &dyn BlockDevice,
    sb: &Superblock,
    base: &[u8],
    order: Order,
) -> Result<Vec<u64>> {
    let offsets = copy_offsets(sb.dev_item.total_bytes, dev.len());
    let mut copies: Vec<(usize, u64)> = offsets.iter().copied().enumerate().collect();
    if order == Order::PrimaryLast {
        copies.reverse();
    }
    for (i, off) in copies {
        write_copy(dev, sb, base, off, &format!("writing superblock copy {i}"))?;
    }
    dev.flush()
        .map_err(|e| Error::io("flushing the superblocks", 0, e))?;
    Ok(offsets)
}

/// Writes the primary copy of `sb` only (an fsync log commit: the mirrors keep the committed
/// state, as the kernel leaves them). The caller flushes, in order with its other writes.
pub(crate) fn write_primary(dev: &dyn BlockDevice, sb: &Superblock, base: &[u8]) -> Result<()> {
    write_copy(
        dev,
        sb,
        base,
        super_offset(0),
        "writing the superblock of an fsync log",
    )
}
