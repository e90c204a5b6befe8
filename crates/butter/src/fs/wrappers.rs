//! The inode layer's operations for every caller of the library (the CLI tools, tests, a
//! program of its own), each under its own passage of the gate, as crate::fs::ops says:
//! shared for reads (waiting only for the inode's writes where one inode is read), exclusive
//! for changes (through the inode passage of the file whose data changes), a write stepping
//! out for its data I/O. Each does what the inode layer's method of the same name does.

use super::ops::Renamed;
use super::Fs;
use crate::error::Result;
use crate::format::compress::Precompressed;
use crate::format::items::{InodeItem, RootItem};
use crate::gate::{held_here, Held};
use crate::ids::Inode;
use crate::inode::namespace::{Owner, SetAttr};
use crate::inode::read::{Stat, SubvolInfo};
use crate::inode::seek::{ExtentShare, ExtentUse, FileRanges};
use crate::inode::statfs::{ChunkAllocation, SpaceUsage};
use crate::io::disk_io::Disk;
use std::sync::Arc;

impl Fs {
    pub fn default_subvolume(&self) -> u64 {
        self.core.default_subvolume()
    }

    pub fn is_writable(&self) -> bool {
        self.core.is_writable()
    }

    pub fn label(&self) -> String {
        self.core.label()
    }

    pub fn root_inode(&self) -> Inode {
        self.core.root_inode()
    }

    pub fn sectorsize(&self) -> u32 {
        self.core.sectorsize()
    }

    pub fn stopped(&self) -> Option<String> {
        self.core.stopped()
    }

    pub fn list_subvolumes(&self) -> Result<Vec<SubvolInfo>> {
        self.reading(None, |c| c.list_subvolumes())
    }

    pub fn space_usage(&self) -> Result<Vec<SpaceUsage>> {
        self.reading(None, |c| c.space_usage())
    }

    pub fn find_root_item(&self, id: u64) -> Result<Option<RootItem>> {
        self.reading(None, |c| c.find_root_item(id))
    }

    pub fn qgroup_usage(&self, id: u64) -> Result<Option<[u64; 4]>> {
        self.reading(None, |c| c.qgroup_usage(id))
    }

    pub fn received_uuid(&self, id: u64) -> Result<Option<[u8; 16]>> {
        self.reading(None, |c| c.received_uuid(id))
    }

    pub fn subvol_is_readonly(&self, id: u64) -> Result<bool> {
        self.reading(None, |c| c.subvol_is_readonly(id))
    }

    pub fn subvol_root_inode(&self, id: u64) -> Result<Inode> {
        self.reading(None, |c| c.subvol_root_inode(id))
    }

    pub fn resolve_in(&self, start: Inode, path: &[u8]) -> Result<Inode> {
        self.reading_as_is(|c| c.resolve_in(start, path))
    }

    pub fn xattrs(&self, ino: Inode) -> Result<Vec<(Vec<u8>, Vec<u8>)>> {
        self.reading_as_is(|c| c.xattrs(ino))
    }

    pub fn stat(&self, ino: Inode) -> Result<Stat> {
        self.reading(Some(ino), |c| c.stat(ino))
    }

    pub fn extent_sharing(&self, ino: Inode) -> Result<Vec<ExtentShare>> {
        self.reading(Some(ino), |c| c.extent_sharing(ino))
    }

    pub fn extent_usage(&self, ino: Inode) -> Result<Vec<ExtentUse>> {
        self.reading(Some(ino), |c| c.extent_usage(ino))
    }

    pub fn file_ranges(&self, ino: Inode, size: u64, merge_gap: u64) -> Result<FileRanges> {
        self.reading(Some(ino), |c| c.file_ranges(ino, size, merge_gap))
    }

    pub fn clear_received_uuid(&self, id: u64) -> Result<()> {
        self.changing("clear_received_uuid", None, |c| c.clear_received_uuid(id))
    }

    pub fn clone_range(
        &self,
        src: Inode,
        src_off: u64,
        dst: Inode,
        dst_off: u64,
        len: u64,
    ) -> Result<u64> {
        self.changing("clone_range", Some(dst), |c| {
            c.clone_range(src, src_off, dst, dst_off, len)
        })
    }

    pub fn copy_file_range(
        &self,
        src: Inode,
        src_off: u64,
        dst: Inode,
        dst_off: u64,
        len: u64,
    ) -> Result<u64> {
        self.changing("copy_file_range", Some(dst), |c| {
            c.copy_file_range(src, src_off, dst, dst_off, len)
        })
    }

    pub fn create(&self, dir: Inode, name: &[u8], perm: u32, owner: Owner) -> Result<Inode> {
        self.changing("create", None, |c| c.create(dir, name, perm, owner))
    }

    pub fn create_snapshot(
        &self,
        src: u64,
        dir: Inode,
        name: &[u8],
        readonly: bool,
        uuid: Option<[u8; 16]>,
    ) -> Result<Inode> {
        self.changing("create_snapshot", None, |c| {
            c.create_snapshot(src, dir, name, readonly, uuid)
        })
    }

    pub fn create_subvolume(
        &self,
        dir: Inode,
        name: &[u8],
        perm: u32,
        owner: Owner,
        uuid: Option<[u8; 16]>,
    ) -> Result<Inode> {
        self.changing("create_subvolume", None, |c| {
            c.create_subvolume(dir, name, perm, owner, uuid)
        })
    }

    pub fn delete_subvolume(&self, dir: Inode, name: &[u8]) -> Result<u64> {
        self.changing("delete_subvolume", None, |c| c.delete_subvolume(dir, name))
    }

    pub fn delete_subvolume_by_id(&self, id: u64) -> Result<()> {
        self.changing("delete_subvolume_by_id", None, |c| {
            c.delete_subvolume_by_id(id)
        })
    }

    pub fn mkdir(&self, dir: Inode, name: &[u8], perm: u32, owner: Owner) -> Result<Inode> {
        self.changing("mkdir", None, |c| c.mkdir(dir, name, perm, owner))
    }

    pub fn mknod(
        &self,
        dir: Inode,
        name: &[u8],
        mode: u32,
        rdev: u64,
        owner: Owner,
    ) -> Result<Inode> {
        self.changing("mknod", None, |c| c.mknod(dir, name, mode, rdev, owner))
    }

    pub fn removexattr(&self, ino: Inode, name: &[u8]) -> Result<()> {
        self.changing("removexattr", None, |c| c.removexattr(ino, name))
    }

    pub fn rmdir(&self, dir: Inode, name: &[u8]) -> Result<()> {
        self.changing("rmdir", None, |c| c.rmdir(dir, name))
    }

    pub fn set_data_flags(&self, ino: Inode, nodatacow: bool, nodatasum: bool) -> Result<()> {
        self.changing("set_data_flags", Some(ino), |c| {
            c.set_data_flags(ino, nodatacow, nodatasum)
        })
    }

    pub fn set_default_subvolume(&self, id: u64) -> Result<()> {
        self.changing("set_default_subvolume", None, |c| {
            c.set_default_subvolume(id)
        })
    }

    pub fn set_fsflags(&self, ino: Inode, fsflags: u32) -> Result<()> {
        self.changing("set_fsflags", None, |c| c.set_fsflags(ino, fsflags))
    }

    pub fn set_label(&self, label: &str) -> Result<()> {
        self.changing("set_label", None, |c| c.set_label(label))
    }

    pub fn set_subvolume_readonly(&self, id: u64, readonly: bool) -> Result<()> {
        self.changing("set_subvolume_readonly", None, |c| {
            c.set_subvolume_readonly(id, readonly)
        })
    }

    pub fn setattr(&self, ino: Inode, a: &SetAttr) -> Result<crate::inode::read::Stat> {
        self.changing("setattr", Some(ino), |c| c.setattr(ino, a))
    }

    pub fn setxattr(&self, ino: Inode, name: &[u8], value: &[u8], flags: u32) -> Result<()> {
        self.changing("setxattr", None, |c| c.setxattr(ino, name, value, flags))
    }

    pub fn shrink_to_fit(&self) -> Result<u64> {
        self.changing("shrink_to_fit", None, |c| c.shrink_to_fit())
    }

    pub fn symlink(&self, dir: Inode, name: &[u8], target: &[u8], owner: Owner) -> Result<Inode> {
        self.changing("symlink", None, |c| c.symlink(dir, name, target, owner))
    }

    pub fn unlink(&self, dir: Inode, name: &[u8]) -> Result<()> {
        self.changing("unlink", None, |c| c.unlink(dir, name))
    }

    pub fn write(&self, ino: Inode, offset: u64, data: &[u8]) -> Result<usize> {
        self.writing(ino, |c| c.write(ino, offset, data))
    }

    pub fn write_precompressed(
        &self,
        ino: Inode,
        offset: u64,
        data: &[u8],
        ahead: &Precompressed,
    ) -> Result<usize> {
        self.writing(ino, |c| c.write_precompressed(ino, offset, data, ahead))
    }

    /// Commits after the running changes ([`Fs::gated_commit`]).
    pub fn commit(&self) -> Result<()> {
        if held_here() == Held::Exclusive {
            return self.core.commit();
        }
        self.gated_commit()
    }

    /// fsync(2) of `ino` ([`Fs::gated_fsync`]).
    pub fn fsync(&self, ino: Inode, datasync: bool) -> Result<()> {
        if held_here() == Held::Exclusive {
            return self.core.fsync(ino, datasync);
        }
        self.gated_fsync(ino)
    }

    /// truncate(2) ([`Fs::gated_truncate`]).
    pub fn truncate(&self, ino: Inode, size: u64) -> Result<()> {
        if held_here() != Held::None {
            return self.changing("truncate", Some(ino), |c| c.truncate(ino, size));
        }
        self.gated_truncate(ino, size)
    }

    /// fallocate(2) ([`Fs::gated_fallocate`]).
    pub fn fallocate(&self, ino: Inode, mode: u32, offset: u64, len: u64) -> Result<()> {
        if held_here() != Held::None {
            return self.changing("fallocate", Some(ino), |c| {
                c.fallocate(ino, mode, offset, len)
            });
        }
        self.gated_fallocate(ino, mode, offset, len)
    }

    /// A new name `name` in `dir` for `ino`; returns `ino`'s item after.
    pub fn link(&self, ino: Inode, dir: Inode, name: &[u8]) -> Result<InodeItem> {
        self.changing("link", None, |c| {
            c.link(ino, dir, name)?;
            self.item_of(c, ino)
        })
    }

    /// rename(2) with `flags` (RENAME_NOREPLACE, RENAME_EXCHANGE); returns the entries it
    /// moved and replaced.
    pub fn rename(
        &self,
        from_dir: Inode,
        from: &[u8],
        to_dir: Inode,
        to: &[u8],
        flags: u32,
    ) -> Result<Renamed> {
        self.changing("rename", None, |c| {
            let moved = c.lookup(from_dir, from)?;
            let replaced = c.lookup(to_dir, to)?;
            c.rename(from_dir, from, to_dir, to, flags)?;
            Ok(Renamed { moved, replaced })
        })
    }

    /// The device and its trees, for the tools that read blocks themselves (dump-tree, the
    /// checker); nothing holds a passage while they read.
    pub fn disk(&self) -> &Arc<Disk> {
        self.core.disk()
    }

    /// Where the chunks are.
    pub fn chunk_allocations(&self) -> Vec<ChunkAllocation> {
        let _g = (held_here() == Held::None).then(|| self.read_gate());
        self.core.chunk_allocations()
    }

    /// The devices of the filesystem, as its chunk tree lists them (`filesystem show`).
    pub fn devices(&self) -> Result<Vec<crate::inode::scrub::DeviceInfo>> {
        self.reading(None, |c| c.devices())
    }

    /// Sets the size device `devid` has in the filesystem (grow, an image file extended
    /// first, a block device up to its length; or shrink, relocating the block groups past
    /// the new end, an image file cut there after) and commits; returns the new size.
    pub fn resize_device(
        &self,
        devid: u64,
        size: u64,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64> {
        self.changing("resize_device", None, |c| {
            c.resize_device(devid, size, progress)
        })
    }

    /// Adds `dev` (`name`: how messages and [`Fs::devices`] name it, a path) to the
    /// filesystem as its next device and commits; returns its devid. New chunks may use its
    /// space from then on (nothing is moved onto it: that is a balance).
    pub fn add_device(
        &self,
        dev: Arc<dyn crate::io::device::BlockDevice>,
        name: &str,
    ) -> Result<u64> {
        self.changing("add_device", None, |c| c.add_device(dev, name))
    }

    /// Removes device `devid`: its block groups are relocated to the other devices first,
    /// then its item goes (committed) and its superblocks are wiped.
    pub fn remove_device(&self, devid: u64, progress: &mut dyn FnMut(&str)) -> Result<()> {
        self.changing("remove_device", None, |c| {
            c.remove_device_relocating(devid, progress)
        })
    }

    /// Replaces device `src` (present, or missing on a degraded filesystem) by `dev` (named
    /// `name`): `dev` is added, then `src` removed with its block groups relocated; returns
    /// the new device's devid (the kernel's replace keeps the old one).
    pub fn replace_device(
        &self,
        src: u64,
        dev: Arc<dyn crate::io::device::BlockDevice>,
        name: &str,
        progress: &mut dyn FnMut(&str),
    ) -> Result<u64> {
        self.changing("replace_device", None, |c| {
            c.replace_device(src, dev, name, progress)
        })
    }

    /// The balance that was interrupted (paused) on the filesystem, if any: by butter or by
    /// the kernel.
    pub fn paused_balance(&self) -> Result<Option<crate::inode::balance::BalanceRequest>> {
        self.reading(None, |c| c.paused_balance())
    }

    /// Runs the balance `request` (kept in the filesystem until it ends), or with `None`
    /// resumes the paused one. `stop(done, total)` is asked before each block group; true
    /// pauses (to resume later).
    pub fn balance(
        &self,
        request: Option<&crate::inode::balance::BalanceRequest>,
        progress: &mut dyn FnMut(&str),
        stop: &mut dyn FnMut(usize, usize) -> bool,
    ) -> Result<crate::inode::balance::BalanceReport> {
        self.changing("balance", None, |c| c.balance(request, progress, stop))
    }

    /// Drops an interrupted balance; whether there was one.
    pub fn cancel_balance(&self) -> Result<bool> {
        self.changing("cancel_balance", None, |c| c.cancel_balance())
    }

    /// Every block group with its use and stripes (the filesystem must be open read-write).
    pub fn block_groups(&self) -> Result<Vec<crate::inode::statfs::BlockGroupInfo>> {
        self.changing("block_groups", None, |c| c.block_groups())
    }

    /// Removes the empty block groups starting at `starts` (their chunks, dev extents and
    /// items) in a transaction of their own, as balance does with `usage=0`; refused for a
    /// group in use or the last of its kind.
    pub fn remove_empty_block_groups(&self, starts: &[u64]) -> Result<()> {
        self.changing("remove_empty_block_groups", None, |c| {
            c.remove_empty_block_groups(starts)
        })
    }

    /// Relocates the block groups at `starts` (their extents and tree blocks copied elsewhere,
    /// every reference changed), each in transactions of its own, and removes each once empty.
    /// `after_each` runs after each group is gone.
    pub fn relocate_block_groups(
        &self,
        starts: &[u64],
        progress: &mut dyn FnMut(&str),
        after_each: &mut dyn FnMut(u64) -> Result<()>,
    ) -> Result<crate::transaction::relocate::RelocStats> {
        self.changing("relocate_block_groups", None, |c| {
            c.relocate_block_groups(starts, progress, after_each)
        })
    }

    /// Shrinks device `devid` as far as relocation can (see
    /// [`crate::inode::core::Core::shrink_device_to_min`]) and commits (an image file is cut
    /// at the new end); returns its new size.
    pub fn shrink_device_to_min(&self, devid: u64, progress: &mut dyn FnMut(&str)) -> Result<u64> {
        self.changing("shrink_device_to_min", None, |c| {
            c.shrink_device_to_min(devid, progress)
        })
    }

    /// The smallest size device `devid` can be resized to (where its last chunk ends).
    pub fn device_min_size(&self, devid: u64) -> Result<u64> {
        self.changing("device_min_size", None, |c| c.device_min_size(devid))
    }

    /// Scrubs every copy and parity block of every extent (crate::inode::scrub); `repair`
    /// rewrites what is bad from a good copy (the filesystem must be open read-write).
    pub fn scrub(
        &self,
        repair: bool,
        progress: &mut dyn FnMut(&str),
    ) -> Result<crate::inode::scrub::ScrubReport> {
        if repair && self.core.writer.is_none() {
            return Err(crate::error::Error::ReadOnly);
        }
        self.reading(None, |c| c.scrub(repair, progress))
    }

    /// The checker over the whole filesystem (crate::check), under a read's passage.
    pub fn check(
        &self,
        opts: crate::check::Options,
        progress: &mut dyn FnMut(&str),
    ) -> Result<crate::check::Report> {
        self.reading(None, |c| crate::check::check_with(c, opts, progress))
    }
}
