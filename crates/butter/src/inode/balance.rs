//! Balance and device removal offline: the block groups a balance's filters select (the
//! kernel's filters, in a BALANCE_ITEM) relocated one by one
//! ([`crate::transaction::relocate`]), new chunks in the profile a conversion asks for; a
//! device emptied the same way before it is removed.
//!
//! The BALANCE_ITEM is written (and committed) before the first group moves and deleted with
//! the commit after the last, as the kernel does: an interrupted balance is found at the next
//! open and resumes with the same filters (`butter balance resume`, or the kernel at mount).

use crate::error::{Error, Result};
use crate::format::items::{BalanceArgs, BalanceItem};
use crate::format::*;
use crate::inode::core::Core;
use crate::inode::statfs::BlockGroupInfo;
use crate::transaction::relocate::RelocStats;

/// The filters of a balance for one block group type, as the kernel's: each that is set
/// narrows the selection. Profiles are block group profile bits, 0 for single.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BalanceFilters {
    /// `profiles=`: groups of one of these profiles.
    pub profiles: Option<Vec<u64>>,
    /// `usage=`: groups used from the first percent to below the second (`usage=N` is
    /// `(0, N)`; 0 percent below 1 takes the empty ones).
    pub usage: Option<(u64, u64)>,
    /// `devid=`: groups with a stripe on that device.
    pub devid: Option<u64>,
    /// `drange=`: a stripe (on `devid`'s device, if given) overlapping these bytes.
    pub drange: Option<(u64, u64)>,
    /// `vrange=`: the group's logical range overlapping these bytes.
    pub vrange: Option<(u64, u64)>,
    /// `limit=`: from the first to the second number of groups (`limit=N` is `(0, N)`).
    pub limit: Option<(u64, u64)>,
    /// `stripes=`: groups with from the first to the second number of stripes.
    pub stripes: Option<(u32, u32)>,
    /// `convert=`: the profile the groups are rewritten in.
    pub convert: Option<u64>,
    /// `soft`: with `convert`, groups already in the target profile are left alone.
    pub soft: bool,
}

/// A balance: which block group types it takes, each with its filters, and whether it may
/// reduce metadata redundancy (`--force`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BalanceRequest {
    pub data: Option<BalanceFilters>,
    pub metadata: Option<BalanceFilters>,
    pub system: Option<BalanceFilters>,
    pub force: bool,
}

fn profile_to_args(p: u64) -> u64 {
    if p & BLOCK_GROUP_PROFILE_MASK == 0 {
        BalanceArgs::SINGLE
    } else {
        p & BLOCK_GROUP_PROFILE_MASK
    }
}

fn profile_from_args(p: u64) -> u64 {
    p & BLOCK_GROUP_PROFILE_MASK
}

fn range_to_args(r: (u64, u64), single: u64, range: u64) -> (u64, u64) {
    if r.0 == 0 {
        (r.1, single)
    } else {
        (
            (r.0 & 0xffff_ffff) | (r.1.min(u32::MAX as u64) << 32),
            range,
        )
    }
}

impl BalanceFilters {
    fn to_args(&self) -> BalanceArgs {
        let mut a = BalanceArgs::default();
        if let Some(ps) = &self.profiles {
            a.profiles = ps.iter().fold(0, |m, &p| m | profile_to_args(p));
            a.flags |= BalanceArgs::PROFILES;
        }
        if let Some(u) = self.usage {
            let (v, f) = range_to_args(u, BalanceArgs::USAGE, BalanceArgs::USAGE_RANGE);
            a.usage = v;
            a.flags |= f;
        }
        if let Some(d) = self.devid {
            a.devid = d;
            a.flags |= BalanceArgs::DEVID;
        }
        if let Some((s, e)) = self.drange {
            (a.pstart, a.pend) = (s, e);
            a.flags |= BalanceArgs::DRANGE;
        }
        if let Some((s, e)) = self.vrange {
            (a.vstart, a.vend) = (s, e);
            a.flags |= BalanceArgs::VRANGE;
        }
        if let Some(l) = self.limit {
            let (v, f) = range_to_args(l, BalanceArgs::LIMIT, BalanceArgs::LIMIT_RANGE);
            a.limit = v;
            a.flags |= f;
        }
        if let Some((lo, hi)) = self.stripes {
            (a.stripes_min, a.stripes_max) = (lo, hi);
            a.flags |= BalanceArgs::STRIPES_RANGE;
        }
        if let Some(p) = self.convert {
            a.target = profile_to_args(p);
            a.flags |= BalanceArgs::CONVERT;
        }
        if self.soft {
            a.flags |= BalanceArgs::SOFT;
        }
        a
    }

    fn from_args(a: &BalanceArgs) -> BalanceFilters {
        let f = a.flags;
        let on = |bit: u64| f & bit != 0;
        BalanceFilters {
            profiles: on(BalanceArgs::PROFILES).then(|| {
                (0..64)
                    .map(|b| 1u64 << b)
                    .filter(|b| a.profiles & b != 0)
                    .map(profile_from_args)
                    .collect()
            }),
            usage: on(BalanceArgs::USAGE | BalanceArgs::USAGE_RANGE).then(|| a.usage_range()),
            devid: on(BalanceArgs::DEVID).then_some(a.devid),
            drange: on(BalanceArgs::DRANGE).then_some((a.pstart, a.pend)),
            vrange: on(BalanceArgs::VRANGE).then_some((a.vstart, a.vend)),
            limit: on(BalanceArgs::LIMIT | BalanceArgs::LIMIT_RANGE).then(|| a.limit_range()),
            stripes: on(BalanceArgs::STRIPES_RANGE).then_some((a.stripes_min, a.stripes_max)),
            convert: on(BalanceArgs::CONVERT).then_some(profile_from_args(a.target)),
            soft: on(BalanceArgs::SOFT),
        }
    }
}

impl BalanceRequest {
    pub(crate) fn to_item(&self) -> BalanceItem {
        let mut it = BalanceItem::default();
        if let Some(f) = &self.data {
            it.data = f.to_args();
            it.flags |= BalanceItem::DATA;
        }
        if let Some(f) = &self.metadata {
            it.meta = f.to_args();
            it.flags |= BalanceItem::METADATA;
        }
        if let Some(f) = &self.system {
            it.sys = f.to_args();
            it.flags |= BalanceItem::SYSTEM;
        }
        if self.force {
            it.flags |= BalanceItem::FORCE;
        }
        it
    }

    pub(crate) fn from_item(it: &BalanceItem) -> BalanceRequest {
        let take =
            |bit: u64, a: &BalanceArgs| (it.flags & bit != 0).then(|| BalanceFilters::from_args(a));
        BalanceRequest {
            data: take(BalanceItem::DATA, &it.data),
            metadata: take(BalanceItem::METADATA, &it.meta),
            system: take(BalanceItem::SYSTEM, &it.sys),
            force: it.flags & BalanceItem::FORCE != 0,
        }
    }
}

/// The kernel's balance ioctl argument (struct btrfs_ioctl_balance_args, 1024 bytes): flags,
/// state, the three types' args as the BALANCE_ITEM has them, then the progress counters.
const IOCTL_ARGS_SIZE: usize = 1024;
const IOCTL_STAT: usize = 16 + 3 * BalanceArgs::SIZE;

impl BalanceRequest {
    /// The request a `BTRFS_IOC_BALANCE_V2` argument carries.
    pub fn from_ioctl_args(b: &[u8]) -> Result<BalanceRequest> {
        if b.len() < IOCTL_STAT {
            return Err(Error::Invalid(format!(
                "a balance ioctl argument of {} bytes (at least {IOCTL_STAT})",
                b.len()
            )));
        }
        let it = BalanceItem {
            flags: le_u64(b, 0),
            data: BalanceArgs::parse(&b[16..])?,
            meta: BalanceArgs::parse(&b[16 + BalanceArgs::SIZE..])?,
            sys: BalanceArgs::parse(&b[16 + 2 * BalanceArgs::SIZE..])?,
        };
        Ok(BalanceRequest::from_item(&it))
    }

    /// The `BTRFS_IOC_BALANCE_V2` argument for this request; with `report`, its progress
    /// counters (expected, considered, completed) filled as the kernel fills them.
    pub fn to_ioctl_args(&self, report: Option<&BalanceReport>) -> Vec<u8> {
        let it = self.to_item();
        let mut b = vec![0u8; IOCTL_ARGS_SIZE];
        b[..8].copy_from_slice(&it.flags.to_le_bytes());
        it.data.write(&mut b[16..]);
        it.meta.write(&mut b[16 + BalanceArgs::SIZE..]);
        it.sys.write(&mut b[16 + 2 * BalanceArgs::SIZE..]);
        if let Some(r) = report {
            for (i, v) in [r.relocated, r.considered, r.relocated]
                .into_iter()
                .enumerate()
            {
                b[IOCTL_STAT + 8 * i..IOCTL_STAT + 8 * i + 8]
                    .copy_from_slice(&(v as u64).to_le_bytes());
            }
        }
        b
    }
}

/// What a balance did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BalanceReport {
    /// Block groups there were when it started, and those it relocated.
    pub considered: usize,
    pub relocated: usize,
    pub moved: RelocStats,
}

fn balance_key() -> Key {
    Key::new(BALANCE_OBJECTID, TEMPORARY_ITEM_KEY, 0)
}

const TYPE_MASK: u64 = BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM;

/// A profile as balance args spell it (single has its own bit).
fn args_profile(flags: u64) -> u64 {
    match flags & BLOCK_GROUP_PROFILE_MASK {
        0 => BalanceArgs::SINGLE,
        p => p,
    }
}

/// Whether a profile keeps data when a device (or a copy) is lost.
fn redundant(profile: u64) -> bool {
    let a = crate::io::volumes::raid_attr(profile & BLOCK_GROUP_PROFILE_MASK);
    a.ncopies >= 2 || crate::io::volumes::nparity(profile) >= 1
}

/// Whether the filters of `args` take group `g` (the kernel's rules, limit aside).
fn filters_take(args: &BalanceArgs, g: &BlockGroupInfo) -> bool {
    let f = args.flags;
    if f & BalanceArgs::PROFILES != 0 && args.profiles & args_profile(g.flags) == 0 {
        return false;
    }
    if f & (BalanceArgs::USAGE | BalanceArgs::USAGE_RANGE) != 0 {
        let (lo, hi) = args.usage_range();
        let of = |p: u64| (g.len as u128 * p.min(100) as u128 / 100) as u64;
        let min = of(lo);
        let max = match hi {
            0 => 1,
            h if h > 100 => g.len + 1,
            h => of(h),
        };
        if g.used < min || g.used >= max {
            return false;
        }
    }
    if f & BalanceArgs::DEVID != 0 && !g.stripes.iter().any(|s| s.0 == args.devid) {
        return false;
    }
    if f & BalanceArgs::DRANGE != 0
        && !g.stripes.iter().any(|&(d, off, len)| {
            (f & BalanceArgs::DEVID == 0 || d == args.devid)
                && off < args.pend
                && args.pstart < off + len
        })
    {
        return false;
    }
    if f & BalanceArgs::VRANGE != 0 && !(g.start < args.vend && args.vstart < g.start + g.len) {
        return false;
    }
    if f & BalanceArgs::STRIPES_RANGE != 0 {
        let n = g.stripes.len() as u32;
        if n < args.stripes_min || n > args.stripes_max {
            return false;
        }
    }
    if f & BalanceArgs::CONVERT != 0
        && f & BalanceArgs::SOFT != 0
        && args_profile(g.flags) == args.target
    {
        return false;
    }
    true
}

impl Core {
    /// The balance that was interrupted (paused) on this filesystem, if there is one.
    pub(crate) fn paused_balance(&self) -> Result<Option<BalanceRequest>> {
        Ok(self
            .balance_item()?
            .map(|it| BalanceRequest::from_item(&it)))
    }

    /// The BALANCE_ITEM of an interrupted balance, if there is one.
    pub(crate) fn balance_item(&self) -> Result<Option<BalanceItem>> {
        let item = match &self.writer {
            Some(_) => self.op(false, |w| w.read_item(ROOT_TREE_OBJECTID, &balance_key()))?,
            None => crate::ctree::lookup(&self.disk, &self.tree_root(), &balance_key())?
                .map(|it| it.data().to_vec()),
        };
        item.map(|b| BalanceItem::parse(&b).map_err(|e| e.in_block(Some(ROOT_TREE_OBJECTID), 0)))
            .transpose()
    }

    /// The block groups `item`'s filters select, in the order a balance takes them (the
    /// kernel's: from the highest address down), each type's `limit` applied.
    pub(crate) fn balance_selection(&self, item: &BalanceItem) -> Result<Vec<BlockGroupInfo>> {
        let mut groups = self.block_groups()?;
        groups.sort_by_key(|g| std::cmp::Reverse(g.start));
        let mut out = Vec::new();
        for ty in [BLOCK_GROUP_DATA, BLOCK_GROUP_METADATA, BLOCK_GROUP_SYSTEM] {
            let Some(args) = item.args_for(ty) else {
                continue;
            };
            let taken: Vec<&BlockGroupInfo> = groups
                .iter()
                .filter(|g| g.flags & TYPE_MASK == ty && filters_take(args, g))
                .collect();
            let (lo, hi) = if args.flags & (BalanceArgs::LIMIT | BalanceArgs::LIMIT_RANGE) != 0 {
                args.limit_range()
            } else {
                (0, u64::MAX)
            };
            if (taken.len() as u64) < lo {
                continue;
            }
            out.extend(
                taken
                    .into_iter()
                    .take(hi.min(usize::MAX as u64) as usize)
                    .cloned(),
            );
        }
        Ok(out)
    }

    /// Refuses a balance the devices cannot do, or one that would reduce the redundancy of
    /// metadata or system chunks without the force flag (as the kernel does).
    fn balance_validate(&self, item: &BalanceItem) -> Result<()> {
        let groups = self.block_groups()?;
        let ndevs = self.op(false, |w| Ok(w.dev_items.len()))?;
        for (ty, name) in [
            (BLOCK_GROUP_DATA, "data"),
            (BLOCK_GROUP_METADATA, "metadata"),
            (BLOCK_GROUP_SYSTEM, "system"),
        ] {
            let Some(args) = item.args_for(ty) else {
                continue;
            };
            if args.flags & BalanceArgs::CONVERT == 0 {
                continue;
            }
            let target = args.target & !BalanceArgs::SINGLE;
            if args.target.count_ones() != 1 || target & !BLOCK_GROUP_PROFILE_MASK != 0 {
                return Err(Error::Invalid(format!(
                    "balance: invalid {name} convert target {:#x}",
                    args.target
                )));
            }
            let min = crate::io::volumes::raid_attr(target).devs_min;
            if ndevs < min {
                return Err(Error::Invalid(format!(
                    "cannot convert {name} to {}: it needs {min} devices and the filesystem \
                     has {ndevs}; add a device first (`butter device add`)",
                    crate::io::volumes::profile_name(target)
                )));
            }
            let reducing = ty != BLOCK_GROUP_DATA
                && !redundant(target)
                && groups
                    .iter()
                    .any(|g| g.flags & TYPE_MASK == ty && redundant(g.flags));
            if reducing && item.flags & BalanceItem::FORCE == 0 {
                return Err(Error::Invalid(format!(
                    "converting {name} to {} reduces its redundancy: give --force if you \
                     want this",
                    crate::io::volumes::profile_name(target)
                )));
            }
        }
        Ok(())
    }

    /// Runs a balance: `item`'s filters select block groups, each is relocated (new chunks in
    /// the converted profile where the filters convert) and removed. With `resume`, the
    /// interrupted balance's own item is used and `item` is ignored. `stop` is asked after
    /// each group: true pauses the balance (its item stays, to resume later).
    pub(crate) fn balance(
        &self,
        request: Option<&BalanceRequest>,
        progress: &mut dyn FnMut(&str),
        stop: &mut dyn FnMut(usize, usize) -> bool,
    ) -> Result<BalanceReport> {
        let item = request.map(BalanceRequest::to_item);
        let existing = self.balance_item()?;
        let item = match (existing, item) {
            (Some(_), Some(_)) => {
                return Err(Error::Invalid(
                    "a balance was interrupted on this filesystem: `butter balance resume` \
                     continues it, `butter balance cancel` drops it"
                        .into(),
                ))
            }
            (None, None) => return Err(Error::NotFound("no balance to resume".into())),
            (Some(it), None) => it,
            (None, Some(it)) => {
                self.balance_validate(&it)?;
                self.commit()?;
                self.op(false, |w| {
                    w.begin_qgroup_neutral();
                    w.replace_item(ROOT_TREE_OBJECTID, balance_key(), &it.encode())
                })?;
                self.commit()?;
                it
            }
        };
        let considered = self.block_groups()?.len();
        let chosen = self.balance_selection(&item)?;
        let mut report = BalanceReport {
            considered,
            ..BalanceReport::default()
        };
        // Converted types: new chunks in the target profile, and nothing new goes into the
        // groups still to convert.
        // Converted types: new chunks in the target profile, and nothing new goes into the
        // groups still to convert nor into any other group of another profile (the kernel
        // allocates only in the target profile during a conversion).
        let all = self.block_groups()?;
        let mut ro: Vec<u64> = Vec::new();
        for g in &all {
            let Some(args) = item.args_for(g.flags & TYPE_MASK) else {
                continue;
            };
            if args.flags & BalanceArgs::CONVERT == 0 {
                continue;
            }
            if chosen.iter().any(|c| c.start == g.start) || args_profile(g.flags) != args.target {
                ro.push(g.start);
            }
        }
        self.op(false, |w| {
            for ty in [BLOCK_GROUP_DATA, BLOCK_GROUP_METADATA, BLOCK_GROUP_SYSTEM] {
                if let Some(args) = item.args_for(ty) {
                    if args.flags & BalanceArgs::CONVERT != 0 {
                        w.chunk_profile
                            .insert(ty, args.target & !BalanceArgs::SINGLE);
                    }
                }
            }
            w.ensure_tree_room(&ro)
        })?;
        self.commit()?;
        self.op(false, |w| {
            for &s in &ro {
                w.allocator.set_readonly(s, true);
            }
            Ok(())
        })?;
        let total = chosen.len();
        let mut done = 0usize;
        let mut paused = false;
        let mut r: Result<()> = Ok(());
        for g in &chosen {
            if stop(done, total) {
                paused = true;
                break;
            }
            progress(&format!(
                "relocating block group {} of {total}: {} {} at {} ({} MiB used)",
                done + 1,
                crate::format::print::block_group_kind(g.flags),
                crate::format::print::block_group_profile(g.flags),
                g.start,
                g.used >> 20
            ));
            match self.relocate_block_groups(&[g.start], progress, &mut |_| Ok(())) {
                Ok(st) => {
                    report.moved.data_extents += st.data_extents;
                    report.moved.data_bytes += st.data_bytes;
                    report.moved.tree_blocks += st.tree_blocks;
                    report.moved.file_extents += st.file_extents;
                    done += 1;
                }
                Err(e) => {
                    r = Err(e);
                    break;
                }
            }
        }
        report.relocated = done;
        let _ = self.op(false, |w| {
            w.chunk_profile.clear();
            for &s in &ro {
                w.allocator.set_readonly(s, false);
            }
            Ok(())
        });
        r?;
        if !paused {
            self.op(false, |w| {
                w.begin_qgroup_neutral();
                w.delete_item(ROOT_TREE_OBJECTID, &balance_key())?;
                Ok(())
            })?;
        }
        self.commit()?;
        Ok(report)
    }

    /// Drops an interrupted balance (its BALANCE_ITEM); what it moved stays moved.
    pub(crate) fn cancel_balance(&self) -> Result<bool> {
        if self.balance_item()?.is_none() {
            return Ok(false);
        }
        self.op(false, |w| {
            w.delete_item(ROOT_TREE_OBJECTID, &balance_key())?;
            Ok(())
        })?;
        self.commit()?;
        Ok(true)
    }

    /// Removes device `devid`: every block group with a stripe on it is relocated to the
    /// other devices (none of its space is used for new chunks meanwhile), then its item goes
    /// and its superblocks are wiped. Refused first where the devices left could not hold a
    /// profile the filesystem uses.
    pub(crate) fn remove_device_relocating(
        &self,
        devid: u64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<()> {
        self.op(false, |w| w.check_remove_device(devid))?;
        let on: Vec<u64> = self
            .block_groups()?
            .into_iter()
            .filter(|g| g.stripes.iter().any(|s| s.0 == devid))
            .map(|g| g.start)
            .collect();
        if !on.is_empty() {
            self.op(false, |w| {
                w.chunk_limit.insert(devid, 0);
                w.ensure_tree_room(&on)
            })?;
            self.commit()?;
            self.op(false, |w| {
                for &s in &on {
                    w.allocator.set_readonly(s, true);
                }
                Ok(())
            })?;
            let r = self.relocate_block_groups(&on, progress, &mut |_| Ok(()));
            let _ = self.op(false, |w| {
                w.chunk_limit.remove(&devid);
                for &s in &on {
                    w.allocator.set_readonly(s, false);
                }
                Ok(())
            });
            r?;
        }
        self.remove_device(devid)
    }

    /// Replaces device `src` (present or missing) by `dev`: `dev` joins as a new device (the
    /// next devid, committed), then `src` is removed, its block groups relocated (onto `dev`
    /// where the profiles put them). Refused before anything is written where `src` is not
    /// a device of the filesystem. Returns the new devid.
    pub(crate) fn replace_device(
        &self,
        src: u64,
        dev: std::sync::Arc<dyn crate::io::device::BlockDevice>,
        name: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64> {
        self.op(false, |w| {
            if w.dev_items.contains_key(&src) {
                Ok(())
            } else {
                Err(crate::error::Error::Invalid(format!(
                    "the filesystem has no device {src}"
                )))
            }
        })?;
        let new = self.add_device(dev, name)?;
        progress(&format!(
            "added {name} as device {new}; moving device {src} onto it"
        ));
        self.remove_device_relocating(src, progress).map_err(|e| {
            crate::error::Error::Invalid(format!(
                "device {new} ({name}) was added, but moving device {src} onto it failed: {e}; \
                 removing device {src} tries again"
            ))
        })?;
        Ok(new)
    }
}
