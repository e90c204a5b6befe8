//! Inode flags (what `chattr`/`lsattr` show) and read-only subvolumes, as the kernel's btrfs
//! enforces them:
//!
//! - A subvolume whose ROOT_ITEM has the RDONLY flag refuses every change inside it
//!   ([`Error::ReadOnlySubvol`], EROFS at the FUSE edge); deleting or renaming its entry in a
//!   writable parent is a change of the parent, not of it.
//! - IMMUTABLE refuses changes of the inode and of names in it (a directory), APPEND refuses
//!   everything but appending (EPERM, as the VFS does for the kernel's filesystems).
//! - The FS_*_FL view: the kernel's mapping between btrfs inode flags and the flags of
//!   FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (fs/btrfs/ioctl.c), with its rules: NOCOW on a regular
//!   file changes only while it is empty (else it is accepted and ignored), NOCOW and
//!   compression exclude each other, the compression flag goes with the `btrfs.compression`
//!   property.
//! - New inodes inherit NOCOMPRESS/COMPRESS and NODATACOW (regular files also NODATASUM) from
//!   their directory.

use crate::error::{Error, Result};
use crate::format::items::InodeItem;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;

/// FS_IOC_GETFLAGS / FS_IOC_SETFLAGS flags btrfs knows (include/uapi/linux/fs.h).
pub(crate) const FS_COMPR_FL: u32 = 0x0000_0004;
pub const FS_SYNC_FL: u32 = 0x0000_0008;
pub const FS_IMMUTABLE_FL: u32 = 0x0000_0010;
pub const FS_APPEND_FL: u32 = 0x0000_0020;
pub const FS_NODUMP_FL: u32 = 0x0000_0040;
pub const FS_NOATIME_FL: u32 = 0x0000_0080;
pub(crate) const FS_NOCOMP_FL: u32 = 0x0000_0400;
pub(crate) const FS_DIRSYNC_FL: u32 = 0x0001_0000;
pub(crate) const FS_NOCOW_FL: u32 = 0x0080_0000;

/// FS_IOC_FSGETXATTR / FS_IOC_FSSETXATTR xflags that mean one of the flags above.
pub(crate) const FS_XFLAG_IMMUTABLE: u32 = 0x0000_0008;
pub(crate) const FS_XFLAG_APPEND: u32 = 0x0000_0010;
pub(crate) const FS_XFLAG_SYNC: u32 = 0x0000_0020;
pub(crate) const FS_XFLAG_NOATIME: u32 = 0x0000_0040;
pub(crate) const FS_XFLAG_NODUMP: u32 = 0x0000_0080;

/// The xattr that carries the compression property.
pub const COMPRESSION_PROP: &[u8] = b"btrfs.compression";

const SIMPLE: [(u64, u32); 6] = [
    (INODE_SYNC, FS_SYNC_FL),
    (INODE_IMMUTABLE, FS_IMMUTABLE_FL),
    (INODE_APPEND, FS_APPEND_FL),
    (INODE_NODUMP, FS_NODUMP_FL),
    (INODE_NOATIME, FS_NOATIME_FL),
    (INODE_DIRSYNC, FS_DIRSYNC_FL),
];

const XFLAGS: [(u32, u32); 5] = [
    (FS_XFLAG_IMMUTABLE, FS_IMMUTABLE_FL),
    (FS_XFLAG_APPEND, FS_APPEND_FL),
    (FS_XFLAG_SYNC, FS_SYNC_FL),
    (FS_XFLAG_NOATIME, FS_NOATIME_FL),
    (FS_XFLAG_NODUMP, FS_NODUMP_FL),
];

/// The FS_*_FL flags of btrfs inode flags (what lsattr shows).
pub(crate) fn inode_flags_to_fsflags(flags: u64) -> u32 {
    let mut f = 0;
    for (b, x) in SIMPLE {
        if flags & b != 0 {
            f |= x;
        }
    }
    if flags & INODE_NODATACOW != 0 {
        f |= FS_NOCOW_FL;
    }
    if flags & INODE_NOCOMPRESS != 0 {
        f |= FS_NOCOMP_FL;
    } else if flags & INODE_COMPRESS != 0 {
        f |= FS_COMPR_FL;
    }
    f
}

/// FS_XFLAG_* of FS_*_FL flags (the fsxattr view; flags without an xflag are left out).
pub fn fsflags_to_xflags(f: u32) -> u32 {
    XFLAGS
        .iter()
        .filter(|(_, fl)| f & fl != 0)
        .fold(0, |a, (x, _)| a | x)
}

/// FS_*_FL flags of FS_XFLAG_* (None: an xflag btrfs does not have).
pub fn xflags_to_fsflags(x: u32) -> Option<u32> {
    let known = XFLAGS.iter().fold(0, |a, (x, _)| a | x);
    if x & !known != 0 {
        return None;
    }
    Some(
        XFLAGS
            .iter()
            .filter(|(xf, _)| x & xf != 0)
            .fold(0, |a, (_, f)| a | f),
    )
}

/// The flags a new inode of `mode` takes from its directory's flags (btrfs_inherit_iflags).
pub(crate) fn inherited_flags(dir_flags: u64, mode: u32) -> u64 {
    let mut f = 0;
    if dir_flags & INODE_NOCOMPRESS != 0 {
        f |= INODE_NOCOMPRESS;
    } else if dir_flags & INODE_COMPRESS != 0 {
        f |= INODE_COMPRESS;
    }
    if dir_flags & INODE_NODATACOW != 0 {
        f |= INODE_NODATACOW;
        if mode & 0o170000 == 0o100000 {
            f |= INODE_NODATASUM;
        }
    }
    f
}

/// Refuses changing an immutable or append-only inode (EPERM).
pub(crate) fn require_changeable(item: &InodeItem, ino: Inode) -> Result<()> {
    if item.flags & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
        return Err(Error::NotPermitted(format!(
            "inode {} is {}",
            ino.ino,
            if item.flags & INODE_IMMUTABLE != 0 {
                "immutable"
            } else {
                "append-only"
            }
        )));
    }
    Ok(())
}

impl Core {
    /// Whether subvolume `id` is read-only (its root item's RDONLY flag).
    pub(crate) fn subvol_is_readonly(&self, id: u64) -> Result<bool> {
        Ok(self.subvol_item(id)?.flags & ROOT_SUBVOL_RDONLY != 0)
    }

    /// Refuses a change inside a read-only subvolume, as the kernel does (EROFS).
    pub(crate) fn require_rw_subvol(&self, root: u64) -> Result<()> {
        if self.subvol_is_readonly(root)? {
            return Err(Error::ReadOnlySubvol(format!(
                "subvolume {root} is read-only (btrfs property set ... ro false makes it \
                 writable)"
            )));
        }
        Ok(())
    }

    /// Refuses changes of `ino` itself: read-only subvolume (EROFS), immutable or
    /// append-only inode (EPERM).
    pub(crate) fn require_inode_changeable(&self, ino: Inode) -> Result<InodeItem> {
        self.require_rw_subvol(ino.root)?;
        let item = self.inode_item(ino)?;
        require_changeable(&item, ino)?;
        Ok(item)
    }

    /// Refuses changes of the names in directory `dir`: read-only subvolume (EROFS),
    /// immutable or append-only directory (EPERM; the kernel lets an append-only directory
    /// gain names but not lose them: `adding` says which).
    pub(crate) fn require_dir_changeable(&self, dir: Inode, adding: bool) -> Result<()> {
        self.require_rw_subvol(dir.root)?;
        let item = self.inode_item(dir)?;
        if item.flags & INODE_IMMUTABLE != 0 || (!adding && item.flags & INODE_APPEND != 0) {
            return require_changeable(&item, dir);
        }
        Ok(())
    }

    /// What an open for writing must pass (the kernel's may_open and btrfs_permission):
    /// EROFS in a read-only subvolume; EPERM for an immutable inode, and for an append-only
    /// one opened without O_APPEND or with O_TRUNC.
    pub(crate) fn check_open_for_write(&self, ino: Inode, append: bool, trunc: bool) -> Result<()> {
        let item = self.inode_item(ino)?;
        let t = item.mode & 0o170000;
        if matches!(t, 0o100000 | 0o040000 | 0o120000) {
            self.require_rw_subvol(ino.root)?;
        }
        if item.flags & INODE_IMMUTABLE != 0
            || (item.flags & INODE_APPEND != 0 && (!append || trunc))
        {
            return require_changeable(&item, ino);
        }
        Ok(())
    }

    /// FS_IOC_GETFLAGS: the inode's flags as FS_*_FL.
    pub(crate) fn get_fsflags(&self, ino: Inode) -> Result<u32> {
        Ok(inode_flags_to_fsflags(self.inode_item(ino)?.flags))
    }

    /// FS_IOC_SETFLAGS, as btrfs_fileattr_set does it: unknown flags EOPNOTSUPP, conflicting
    /// ones EINVAL; flags other types cannot have are dropped; NOCOW of a regular file
    /// changes only while the file is empty; the compression flags set or remove the
    /// `btrfs.compression` property. The caller checks the privilege (CAP_LINUX_IMMUTABLE for
    /// IMMUTABLE/APPEND, ownership).
    pub(crate) fn set_fsflags(&self, ino: Inode, fsflags: u32) -> Result<()> {
        self.require_rw_subvol(ino.root)?;
        let item = self.inode_item(ino)?;
        let t = item.mode & 0o170000;
        let fsflags = match t {
            0o040000 => fsflags,
            0o100000 => fsflags & !FS_DIRSYNC_FL,
            _ => fsflags & (FS_NODUMP_FL | FS_NOATIME_FL),
        };
        let old = inode_flags_to_fsflags(item.flags);
        let known = FS_IMMUTABLE_FL
            | FS_APPEND_FL
            | FS_NOATIME_FL
            | FS_NODUMP_FL
            | FS_SYNC_FL
            | FS_DIRSYNC_FL
            | FS_NOCOMP_FL
            | FS_COMPR_FL
            | FS_NOCOW_FL;
        if fsflags & !known != 0 {
            return Err(Error::Unsupported(format!(
                "inode flags {:#x}",
                fsflags & !known
            )));
        }
        let bad = (fsflags & FS_COMPR_FL != 0
            && (fsflags & FS_NOCOMP_FL != 0 || fsflags & FS_NOCOW_FL != 0))
            || (old & FS_NOCOW_FL != 0 && fsflags & (FS_COMPR_FL | FS_NOCOMP_FL) != 0)
            || (fsflags & FS_NOCOW_FL != 0 && old & (FS_COMPR_FL | FS_NOCOMP_FL) != 0);
        if bad {
            return Err(Error::Invalid(
                "nocow and compression flags exclude each other".into(),
            ));
        }
        let mut f = item.flags;
        for (b, x) in SIMPLE {
            if fsflags & x != 0 {
                f |= b;
            } else {
                f &= !b;
            }
        }
        if t == 0o100000 {
            // Checksums can only go while no extent exists; otherwise the flag keeps telling
            // how the data really is, and the request is ignored.
            if item.size == 0 {
                if fsflags & FS_NOCOW_FL != 0 {
                    f |= INODE_NODATACOW | INODE_NODATASUM;
                } else {
                    f &= !(INODE_NODATACOW | INODE_NODATASUM);
                }
            }
        } else if fsflags & FS_NOCOW_FL != 0 {
            f |= INODE_NODATACOW;
        } else {
            f &= !INODE_NODATACOW;
        }
        let prop: Option<&[u8]> = if fsflags & FS_NOCOMP_FL != 0 {
            f &= !INODE_COMPRESS;
            f |= INODE_NOCOMPRESS;
            None
        } else if fsflags & FS_COMPR_FL != 0 {
            f |= INODE_COMPRESS;
            f &= !INODE_NOCOMPRESS;
            // The kernel names the mount's compression, zlib when it has none.
            Some(self.compress.map(|c| c.name()).unwrap_or("zlib").as_bytes())
        } else {
            f &= !(INODE_COMPRESS | INODE_NOCOMPRESS);
            None
        };
        match prop {
            Some(v) => self.setxattr_raw(ino, COMPRESSION_PROP, v, 0)?,
            None => {
                if self.getxattr(ino, COMPRESSION_PROP)?.is_some() {
                    self.removexattr_raw(ino, COMPRESSION_PROP)?;
                }
            }
        }
        self.op(false, |w| {
            let mut it = self.inode_item(ino)?;
            it.flags = f;
            Self::touch(w, &mut it, false);
            self.write_inode(w, ino, &it)
        })
    }

    /// The `btrfs.compression` property set (`Some`) or removed (`None`), as the kernel's
    /// property handler does: `zlib`, `lzo`, `zstd` (with `:LEVEL`) set the compress flag
    /// and clear NOCOMPRESS; `no` and `none` set NOCOMPRESS; an empty value or removal drops
    /// the property and both flags. Anything else is refused (EINVAL).
    pub(crate) fn set_compression_property(
        &self,
        ino: Inode,
        value: Option<&[u8]>,
        xflags: u32,
    ) -> Result<()> {
        let value = value.filter(|v| !v.is_empty());
        let parsed = match value {
            Some(v) => Some(crate::format::compress::Compression::parse(
                &String::from_utf8_lossy(v),
            )?),
            None => None,
        };
        match value {
            Some(v) => self.setxattr_raw(ino, COMPRESSION_PROP, v, xflags)?,
            None => {
                if self.getxattr(ino, COMPRESSION_PROP)?.is_some() {
                    self.removexattr_raw(ino, COMPRESSION_PROP)?;
                }
            }
        }
        self.op(false, |w| {
            let mut it = self.inode_item(ino)?;
            match parsed {
                Some(Some(_)) => {
                    it.flags |= INODE_COMPRESS;
                    it.flags &= !INODE_NOCOMPRESS;
                }
                Some(None) => {
                    it.flags |= INODE_NOCOMPRESS;
                    it.flags &= !INODE_COMPRESS;
                }
                None => it.flags &= !(INODE_COMPRESS | INODE_NOCOMPRESS),
            }
            Self::touch(w, &mut it, false);
            self.write_inode(w, ino, &it)
        })
    }

    /// Marks `ino` NODATACOW and/or NODATASUM, as `mkfs.btrfs --inode-flags` does (a
    /// NODATACOW regular file has no checksums either, as with `chattr +C`). A regular file
    /// must still be empty: its data is written the way the flags say.
    pub(crate) fn set_data_flags(
        &self,
        ino: Inode,
        nodatacow: bool,
        nodatasum: bool,
    ) -> Result<()> {
        let item = self.require_inode_changeable(ino)?;
        let regular = item.mode & 0o170000 == 0o100000;
        if regular && item.size > 0 {
            return Err(Error::Invalid(format!(
                "inode {} holds data: NODATACOW and NODATASUM are set on empty files only",
                ino.ino
            )));
        }
        let mut add = 0;
        if nodatacow {
            add |= INODE_NODATACOW;
            if regular {
                add |= INODE_NODATASUM;
            }
        }
        if nodatasum {
            add |= INODE_NODATASUM;
        }
        if add == 0 || item.flags & add == add {
            return Ok(());
        }
        self.op(false, |w| {
            let mut it = self.inode_item(ino)?;
            it.flags |= add;
            Self::touch(w, &mut it, false);
            self.write_inode(w, ino, &it)
        })
    }
}
