//! `butter rescue`: btrfs-progs' rescue commands, each checked before it writes: the
//! checker runs on the filesystem as the change leaves it, and the change is written only
//! when that finds no problem the filesystem did not have before.

use super::{Fs, OpenOpts};
use crate::check::{repair, Options, Report};
use crate::error::{Error, Result};
use crate::format::superblock::Superblock;
use crate::format::{SUPER_INFO_SIZE, SUPER_MIRROR_MAX};
use crate::io::device::BlockDevice;
use std::sync::Arc;

/// The devices of a filesystem, each with a name for messages (the image first).
type Given = Vec<(String, Arc<dyn BlockDevice>)>;

/// The image and the other devices at `paths`, each opened read-write as the only writer.
fn open_all(paths: &[&std::path::Path]) -> Result<Given> {
    paths
        .iter()
        .map(|p| Ok((p.display().to_string(), super::open_one(p, true)?)))
        .collect()
}

/// The raw bytes of `dev`'s superblock copy at `at`.
fn raw_copy(dev: &dyn BlockDevice, at: u64) -> Result<Vec<u8>> {
    let mut raw = vec![0u8; SUPER_INFO_SIZE];
    dev.read_at(&mut raw, at)
        .map_err(|e| Error::io("reading a superblock copy", at, e))?;
    Ok(raw)
}

/// Refuses a change whose result has a problem `before` did not have.
fn no_new_problems(before: &Report, after: &Report) -> Result<()> {
    let (new, _) = repair::judge(before, after);
    match new.first() {
        None => Ok(()),
        Some(first) => Err(Error::Invalid(format!(
            "nothing was written: the result would have {} problem(s) the filesystem does not \
             have now, the first: {first}",
            new.len()
        ))),
    }
}

impl Fs {
    /// `btrfs rescue fix-device-size` on a filesystem open read-write (with
    /// [`super::RwOptions::untouched`]): each device's size in its item rounded down to whole
    /// sectors, and the superblock's total the sum of them, in one transaction written only
    /// when the checker finds no new problem in the result. Returns false when nothing
    /// needed fixing (nothing is written).
    pub fn fix_device_size(&self) -> Result<bool> {
        self.rescue_change("fix_device_size", |c| {
            c.op(false, repair::align_device_sizes)
        })
    }

    /// `btrfs rescue clear-uuid-tree` on a filesystem open read-write (with
    /// [`super::RwOptions::untouched`]): the uuid tree is deleted (the kernel builds it again
    /// from the subvolumes at its next mount), in one transaction written only when the
    /// checker finds no new problem in the result. Returns false when there was none.
    pub fn clear_uuid_tree(&self) -> Result<bool> {
        self.rescue_change("clear_uuid_tree", |c| {
            c.op(false, |w| {
                repair::drop_private_tree(w, crate::format::UUID_TREE_OBJECTID)
            })
        })
    }

    /// `btrfs rescue clear-space-cache v1|v2` on a filesystem open read-write (with
    /// [`super::RwOptions::untouched`]): `version` 1 deletes the v1 cache (its inodes and
    /// headers; the superblock's cache generation says none), 2 the free space tree (a kernel
    /// mount with `-o space_cache=v2` builds it again; refused with a block group tree), in one
    /// transaction written only when the checker finds no new problem in the result.
    /// Returns false when there was nothing to clear.
    pub fn clear_space_cache(&self, version: u8) -> Result<bool> {
        match version {
            1 => self.rescue_change("clear_space_cache", |c| {
                c.op(false, repair::clear_space_cache_v1)
            }),
            2 => self.rescue_change("clear_space_cache", |c| {
                c.op(false, repair::clear_space_cache_v2)
            }),
            v => Err(Error::Invalid(format!(
                "space cache version {v}: it is v1 or v2"
            ))),
        }
    }

    /// One rescue change (`change` returns whether it changed anything) in a transaction
    /// committed only when the checker finds no new problem in its result.
    pub(super) fn rescue_change(
        &self,
        name: &'static str,
        change: impl FnOnce(&crate::inode::core::Core) -> Result<bool>,
    ) -> Result<bool> {
        let before = self.check(Options::default(), &mut |_| {})?;
        let mut refused = None;
        let r = self.changing(name, None, |c| {
            if !change(c)? {
                return Ok(false);
            }
            repair::touch_root_tree(c)?;
            c.commit_verified(|sb| {
                let after = Fs::candidate(&c.disk, sb)?.check(Options::default(), &mut |_| {})?;
                no_new_problems(&before, &after).inspect_err(|e| refused = Some(e.to_string()))
            })?;
            Ok(true)
        });
        match (r, refused) {
            (Err(_), Some(why)) => Err(Error::Invalid(why)),
            (r, _) => r,
        }
    }

    /// `btrfs rescue zero-log`: drops an unreplayed fsync log (what was fsynced since the last
    /// commit is lost): every device's superblock no longer names it; nothing else changes
    /// (the log's blocks were never counted as used). Checked first: the filesystem without
    /// its log has no problem it has with it. Returns false when there was no log.
    pub fn zero_log(paths: &[&std::path::Path]) -> Result<bool> {
        let given = open_all(paths)?;
        let with_log = Fs::open_device_set(given.clone(), OpenOpts::default());
        if with_log
            .as_ref()
            .is_ok_and(|fs| fs.core.disk.sb.log_root == 0)
        {
            return Ok(false);
        }
        let without = Fs::open_device_set(given.clone(), OpenOpts::nologreplay())?;
        if without.core.disk.sb.log_root == 0 {
            return Ok(false);
        }
        let after = without.check(Options::default(), &mut |_| {})?;
        // A log that cannot be replayed makes the open fail: then anything is better.
        if let Ok(fs) = &with_log {
            let before = fs.check(Options::default(), &mut |_| {})?;
            no_new_problems(&before, &after)?;
        }
        drop((with_log, without));
        for (name, dev) in &given {
            let mut sb = crate::io::disk_io::read_superblock(dev.as_ref())?;
            let raw = raw_copy(dev.as_ref(), sb.bytenr)?;
            sb.log_root = 0;
            sb.log_root_level = 0;
            crate::io::super_io::write_all(
                dev.as_ref(),
                &sb,
                &raw,
                crate::io::super_io::Order::PrimaryLast,
            )
            .map_err(|e| Error::Invalid(format!("{name}: {e}")))?;
            dev.flush()
                .map_err(|e| Error::io("flushing the superblocks", 0, e))?;
        }
        Ok(true)
    }

    /// `btrfs rescue super-recover`: every superblock copy of every device rewritten from the
    /// newest good one of that device, where a copy is damaged, missing or older. Checked
    /// first: the filesystem opens from the copy kept. Returns how many copies were
    /// rewritten.
    pub fn super_recover(paths: &[&std::path::Path]) -> Result<usize> {
        let given = open_all(paths)?;
        let fs = Fs::open_device_set(given.clone(), OpenOpts::default())?;
        let report = fs.check(Options::default(), &mut |_| {})?;
        if report
            .findings
            .iter()
            .any(|f| f.kind == crate::check::FindingKind::TreeBlockUnreadable)
        {
            return Err(Error::Invalid(
                "nothing was written: the filesystem its newest superblock names has \
                 unreadable trees, so no copy is known good"
                    .into(),
            ));
        }
        drop(fs);
        let mut rewritten = 0;
        for (name, dev) in &given {
            let best: Superblock = crate::io::disk_io::read_superblock(dev.as_ref())?;
            let raw = raw_copy(dev.as_ref(), best.bytenr)?;
            let mut stale = Vec::new();
            for m in 0..SUPER_MIRROR_MAX {
                let at = crate::format::super_offset(m);
                if at + SUPER_INFO_SIZE as u64 > dev.len().min(best.dev_item.total_bytes) {
                    break;
                }
                let good = raw_copy(dev.as_ref(), at)
                    .and_then(|b| Superblock::parse(&b, at))
                    .is_ok_and(|s| s.generation == best.generation && s.fsid == best.fsid);
                if !good {
                    stale.push(at);
                }
            }
            if stale.is_empty() {
                continue;
            }
            log::info!("{name}: rewriting superblock copies at {stale:?}");
            crate::io::super_io::write_all(
                dev.as_ref(),
                &best,
                &raw,
                crate::io::super_io::Order::PrimaryLast,
            )
            .map_err(|e| Error::Invalid(format!("{name}: {e}")))?;
            dev.flush()
                .map_err(|e| Error::io("flushing the superblocks", 0, e))?;
            rewritten += stale.len();
        }
        Ok(rewritten)
    }
}
