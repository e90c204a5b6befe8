//! Subvolumes and snapshots: new fs trees linked into a directory.
//!
//! A subvolume is a tree of its own (objectid >= 256 in the root tree) whose root directory is
//! inode 256. Creating one writes, as the kernel does:
//!
//! - the tree's first leaf: INODE_ITEM 256 (a directory, nlink 1) and INODE_REF 256 -> 256
//!   named "..", index 0;
//! - ROOT_ITEM (id, ROOT_ITEM, 0) in the root tree, whose embedded inode is the fixed
//!   placeholder (generation 1, size 3, nlink 1, nbytes = nodesize, mode 040755, flags
//!   ROOT_ITEM_INIT) and which carries a uuid, ctransid/otransid and ctime/otime;
//! - ROOT_REF (parent, ROOT_REF, id) and ROOT_BACKREF (id, ROOT_BACKREF, parent), both naming
//!   the directory, the entry's dir index and its name;
//! - DIR_ITEM and DIR_INDEX in the parent directory with location (id, ROOT_ITEM, 0);
//! - the uuid tree entry (uuid -> id).
//!
//! A snapshot copies the source tree's root block (owned by the new tree) and adds one
//! reference from the copy to each child block or data extent; the rest of the tree is shared
//! and copied on write later (see `cow`). Its ROOT_ITEM is a copy of the source's with key
//! offset = the transaction id, its own uuid, parent_uuid = the source's, otransid/otime now
//! and last_snapshot = the transaction on both sides; the directory entry's location is
//! (id, ROOT_ITEM, u64::MAX). The source is committed first, so every block of it predates the
//! snapshot's transaction and is copied before the source changes it again.

use crate::ctree::ops as ctree_ops;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::inode::namespace::{check_name, Owner};
use crate::io::disk_io::TreeBlock;
use crate::transaction::Writer;
use std::sync::Arc;

/// The uuid tree key for `uuid` with item type `ty`.
pub(crate) fn uuid_key(uuid: &[u8; 16], ty: u8) -> Key {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&uuid[..8]);
    b.copy_from_slice(&uuid[8..]);
    Key::new(u64::from_le_bytes(a), ty, u64::from_le_bytes(b))
}

impl Core {
    /// Whether the image has a uuid tree (mkfs.btrfs and butter mkfs make one; very old
    /// images may not, and the kernel builds it at mount then).
    fn has_uuid_tree(&self) -> Result<bool> {
        Ok(self.find_root_item(UUID_TREE_OBJECTID)?.is_some())
    }

    /// Adds `id` to the uuid tree under `uuid`.
    pub(crate) fn uuid_tree_add(
        &self,
        w: &mut Writer,
        uuid: &[u8; 16],
        ty: u8,
        id: u64,
    ) -> Result<()> {
        if !self.has_uuid_tree()? {
            return Ok(());
        }
        let key = uuid_key(uuid, ty);
        let mut body = w.read_item(UUID_TREE_OBJECTID, &key)?.unwrap_or_default();
        if body.len() % 8 != 0 {
            return Err(Error::corrupt(
                Location::what("uuid item")
                    .with_tree(UUID_TREE_OBJECTID)
                    .with_key(key),
                format!("size {} is not a multiple of 8", body.len()),
            ));
        }
        if body.chunks(8).any(|c| c == id.to_le_bytes()) {
            return Ok(());
        }
        body.extend_from_slice(&id.to_le_bytes());
        w.replace_item(UUID_TREE_OBJECTID, key, &body)
    }

    /// With quotas on, a new subvolume gets its level-0 qgroup (QGROUP_INFO and QGROUP_LIMIT
    /// items, as the kernel adds them). Its numbers start at zero: the commit marks the
    /// qgroup status inconsistent, so a rescan computes them.
    fn qgroup_add(&self, w: &mut Writer, id: u64) -> Result<()> {
        if self.find_root_item(QUOTA_TREE_OBJECTID)?.is_none() {
            return Ok(());
        }
        let mut info = [0u8; 40];
        info[..8].copy_from_slice(&w.transid.to_le_bytes());
        for (ty, body) in [(QGROUP_INFO_KEY, info), (QGROUP_LIMIT_KEY, [0u8; 40])] {
            let key = Key::new(0, ty, id);
            if w.read_item(QUOTA_TREE_OBJECTID, &key)?.is_none() {
                w.insert_item(QUOTA_TREE_OBJECTID, key, &body)?;
            }
        }
        Ok(())
    }

    /// Removes `id` from the uuid tree's entry for `uuid` (the item goes with its last id).
    pub(crate) fn uuid_tree_remove(
        &self,
        w: &mut Writer,
        uuid: &[u8; 16],
        ty: u8,
        id: u64,
    ) -> Result<()> {
        if !self.has_uuid_tree()? {
            return Ok(());
        }
        let key = uuid_key(uuid, ty);
        let Some(body) = w.read_item(UUID_TREE_OBJECTID, &key)? else {
            return Ok(());
        };
        let rest: Vec<u8> = body
            .chunks(8)
            .filter(|c| *c != id.to_le_bytes())
            .flatten()
            .copied()
            .collect();
        if rest.len() == body.len() {
            return Ok(());
        }
        if rest.is_empty() {
            w.delete_item(UUID_TREE_OBJECTID, &key)?;
            Ok(())
        } else {
            w.replace_item(UUID_TREE_OBJECTID, key, &rest)
        }
    }

    /// Checks that `dir/name` can be created and returns a new subvolume id.
    fn prepare_subvol_entry(&self, dir: Inode, name: &[u8]) -> Result<()> {
        check_name(name)?;
        self.require_dir(dir)?;
        self.require_dir_changeable(dir, true)?;
        if self.lookup(dir, name)?.is_some() {
            return Err(Error::Exists(String::from_utf8_lossy(name).into_owned()));
        }
        Ok(())
    }

    /// Links subvolume `id` as `dir/name`: the directory entry, ROOT_REF and ROOT_BACKREF.
    fn link_subvol(
        &self,
        w: &mut Writer,
        dir: Inode,
        name: &[u8],
        id: u64,
        location_offset: u64,
    ) -> Result<()> {
        let index = self.add_dir_items(
            w,
            dir,
            name,
            Key::new(id, ROOT_ITEM_KEY, location_offset),
            FT_DIR,
        )?;
        let rr = RootRef {
            dirid: dir.ino,
            sequence: index,
            name: name.to_vec(),
        }
        .to_bytes();
        w.insert_item(
            ROOT_TREE_OBJECTID,
            Key::new(dir.root, ROOT_REF_KEY, id),
            &rr,
        )?;
        w.insert_item(
            ROOT_TREE_OBJECTID,
            Key::new(id, ROOT_BACKREF_KEY, dir.root),
            &rr,
        )
    }

    /// A new id for a tree: one past the highest in the root tree (at least 256).
    fn new_tree_id(&self, w: &mut Writer) -> Result<u64> {
        let id = self.next_objectid(w, ROOT_TREE_OBJECTID)?;
        if id > LAST_FREE_OBJECTID {
            return Err(Error::NoSpace("subvolume ids exhausted".into()));
        }
        Ok(id)
    }

    /// Creates an empty subvolume `dir/name` whose root directory has permissions `perm` and
    /// owner `owner`. `uuid` is random when `None` (mkfs passes derived ones for
    /// reproducible images). Returns the new subvolume's root directory.
    pub(crate) fn create_subvolume(
        &self,
        dir: Inode,
        name: &[u8],
        perm: u32,
        owner: Owner,
        uuid: Option<[u8; 16]>,
    ) -> Result<Inode> {
        self.prepare_subvol_entry(dir, name)?;
        let uuid = match uuid {
            Some(u) => u,
            None => crate::mkfs::random_uuid()?,
        };
        let ns = self.disk.nodesize() as u64;
        self.op(true, |w| {
            let id = self.new_tree_id(w)?;
            let transid = w.transid;
            let t = Timespec::now();
            let bytenr = w.new_block(id, 0, Key::MIN)?;
            let item_key = Key::new(id, ROOT_ITEM_KEY, 0);
            w.add_new_tree(id, bytenr, 0, item_key, 0);
            let dir_item = InodeItem {
                generation: transid,
                transid,
                size: 0,
                nbytes: 0,
                block_group: 0,
                nlink: 1,
                uid: owner.uid,
                gid: owner.gid,
                mode: 0o040000 | (perm & 0o7777),
                rdev: 0,
                flags: 0,
                sequence: 0,
                atime: t,
                ctime: t,
                mtime: t,
                otime: t,
            };
            let dotdot = InodeRef {
                index: 0,
                name: b"..".to_vec(),
            }
            .to_bytes();
            w.insert_items(
                id,
                &[
                    (
                        Key::new(FIRST_FREE_OBJECTID, INODE_ITEM_KEY, 0),
                        &dir_item.to_bytes()[..],
                    ),
                    (
                        Key::new(FIRST_FREE_OBJECTID, INODE_REF_KEY, FIRST_FREE_OBJECTID),
                        &dotdot[..],
                    ),
                ],
            )?;
            let zero = Timespec { sec: 0, nsec: 0 };
            let ri = RootItem {
                inode: InodeItem {
                    generation: 1,
                    transid: 0,
                    size: 3,
                    nbytes: ns,
                    block_group: 0,
                    nlink: 1,
                    uid: 0,
                    gid: 0,
                    mode: 0o040755,
                    rdev: 0,
                    flags: INODE_ROOT_ITEM_INIT,
                    sequence: 0,
                    atime: zero,
                    ctime: zero,
                    mtime: zero,
                    otime: zero,
                },
                generation: transid,
                root_dirid: FIRST_FREE_OBJECTID,
                bytenr,
                byte_limit: 0,
                bytes_used: ns,
                last_snapshot: 0,
                flags: 0,
                refs: 1,
                drop_progress: Key::MIN,
                drop_level: 0,
                level: 0,
                generation_v2: transid,
                uuid,
                parent_uuid: [0; 16],
                received_uuid: [0; 16],
                ctransid: transid,
                otransid: transid,
                stransid: 0,
                rtransid: 0,
                ctime: t,
                otime: t,
                stime: zero,
                rtime: zero,
            };
            w.insert_item(ROOT_TREE_OBJECTID, item_key, &ri.to_bytes())?;
            self.link_subvol(w, dir, name, id, 0)?;
            self.uuid_tree_add(w, &uuid, UUID_KEY_SUBVOL, id)?;
            self.qgroup_add(w, id)?;
            Ok(Inode {
                root: id,
                ino: FIRST_FREE_OBJECTID,
            })
        })
    }

    /// Snapshots subvolume `src` as `dir/name` (read-only if `readonly`). Commits the running
    /// transaction first. Returns the snapshot's root directory.
    pub(crate) fn create_snapshot(
        &self,
        src: u64,
        dir: Inode,
        name: &[u8],
        readonly: bool,
        uuid: Option<[u8; 16]>,
    ) -> Result<Inode> {
        if !(src == FS_TREE_OBJECTID || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&src)) {
            return Err(Error::Invalid(format!("{src} is not a subvolume id")));
        }
        self.prepare_subvol_entry(dir, name)?;
        let uuid = match uuid {
            Some(u) => u,
            None => crate::mkfs::random_uuid()?,
        };
        self.commit()?;
        self.op(true, |w| {
            let src_key = w
                .tree_state(src)?
                .item_key
                .ok_or_else(|| Error::NotFound(format!("root item of subvolume {src}")))?;
            let src_root = w.current_root(src)?;
            let src_body = w
                .read_item(ROOT_TREE_OBJECTID, &src_key)?
                .ok_or_else(|| Error::NotFound(format!("root item of subvolume {src}")))?;
            let src_item = RootItem::parse(&src_body).map_err(|e| match e {
                Error::Corrupt { reason, .. } => Error::corrupt(
                    Location::what("root item")
                        .with_tree(ROOT_TREE_OBJECTID)
                        .with_key(src_key),
                    reason,
                ),
                e => e,
            })?;
            let id = self.new_tree_id(w)?;
            let transid = w.transid;
            let t = Timespec::now();

            // The copy of the source's root block, owned by the snapshot.
            let blk = w.block(
                src_root.bytenr,
                &crate::io::disk_io::Expect {
                    level: Some(src_root.level),
                    generation: Some(src_root.generation),
                    ..Default::default()
                },
            )?;
            let new = w.alloc_tree_block(id)?;
            let mut data = blk.data.clone();
            ctree_ops::set_bytenr(&mut data, new)?;
            ctree_ops::set_generation(&mut data, transid)?;
            ctree_ops::set_owner(&mut data, id)?;
            let flags = blk.header.flags & !(HEADER_FLAG_WRITTEN | HEADER_FLAG_RELOC);
            ctree_ops::set_flags(&mut data, flags)?;
            ctree_ops::set_backref_rev(&mut data, MIXED_BACKREF_REV as u8)?;
            let copy = Arc::new(TreeBlock::from_parts(new, data));
            let first = if copy.nritems() > 0 {
                copy.key(0)
            } else {
                Key::MIN
            };
            w.disk.overlay_put(copy.clone());
            w.refs.add_tree_ref(
                new,
                self.disk.nodesize() as u64,
                copy.level(),
                first,
                true,
                crate::ctree::cow::tree_ref(id),
                1,
            );
            w.change_child_refs(id, &copy, false, 1)?;

            // The source: blocks it has now are shared from here on.
            w.note_snapshot(src)?;
            w.update_item(ROOT_TREE_OBJECTID, &src_key, |b| {
                if b.len() >= 208 {
                    b[200..208].copy_from_slice(&transid.to_le_bytes());
                }
                Ok(())
            })?;

            let item_key = Key::new(id, ROOT_ITEM_KEY, transid);
            w.add_new_tree(id, new, copy.level(), item_key, transid);
            // The copy is of the current format whatever the source's (an old-format
            // source's flags do not count): without the mark the kernel would clear the
            // snapshot's read-only flag.
            let mut src_item = src_item;
            src_item.init_current_format();
            let src_flags = src_item.flags;
            let ri = RootItem {
                generation: transid,
                bytenr: new,
                level: copy.level(),
                last_snapshot: transid,
                flags: if readonly {
                    src_flags | ROOT_SUBVOL_RDONLY
                } else {
                    src_flags & !ROOT_SUBVOL_RDONLY
                },
                refs: 1,
                drop_progress: Key::MIN,
                drop_level: 0,
                generation_v2: transid,
                uuid,
                parent_uuid: src_item.uuid,
                received_uuid: [0; 16],
                otransid: transid,
                otime: t,
                stransid: 0,
                rtransid: 0,
                stime: Timespec { sec: 0, nsec: 0 },
                rtime: Timespec { sec: 0, nsec: 0 },
                ..src_item
            };
            w.insert_item(ROOT_TREE_OBJECTID, item_key, &ri.to_bytes())?;
            self.link_subvol(w, dir, name, id, u64::MAX)?;
            self.uuid_tree_add(w, &uuid, UUID_KEY_SUBVOL, id)?;
            self.qgroup_add(w, id)?;
            Ok(Inode {
                root: id,
                ino: src_item.root_dirid,
            })
        })
    }

    /// Makes subvolume `id` read-only or writable (the ROOT_ITEM's RDONLY flag), as the
    /// kernel's SUBVOL_SETFLAGS ioctl does: only the flag changes (no times, no transids;
    /// nothing at all when it already has the wanted state). A received subvolume keeps its
    /// received uuid: `btrfs property set -f` clears it afterwards
    /// ([`Core::clear_received_uuid`]).
    pub(crate) fn set_subvolume_readonly(&self, id: u64, readonly: bool) -> Result<()> {
        let item = self.subvol_item(id)?;
        // An old-format item is rewritten even when its flag already says so: the kernel
        // would clear the flag of such an item.
        if (item.flags & ROOT_SUBVOL_RDONLY != 0) == readonly
            && item.inode.flags & INODE_ROOT_ITEM_INIT != 0
        {
            return Ok(());
        }
        self.op(false, |w| {
            let key = self.root_item_key(w, id)?;
            w.update_item(ROOT_TREE_OBJECTID, &key, |b| {
                if b.len() < 216 {
                    return Err(Error::corrupt(
                        Location::what("root item")
                            .with_tree(ROOT_TREE_OBJECTID)
                            .with_key(key),
                        format!("{} bytes, too short for its flags", b.len()),
                    ));
                }
                // The kernel marks the item current when it sets the flag (so that it stays).
                RootItem::init_current_format_in(b);
                let mut f = [0u8; 8];
                f.copy_from_slice(&b[208..216]);
                let mut flags = u64::from_le_bytes(f);
                if readonly {
                    flags |= ROOT_SUBVOL_RDONLY;
                } else {
                    flags &= !ROOT_SUBVOL_RDONLY;
                }
                b[208..216].copy_from_slice(&flags.to_le_bytes());
                Ok(())
            })?;
            self.forget_subvol(id);
            Ok(())
        })
    }

    /// Makes subvolume `id` the default one, what a mount without `subvol=` shows (5 is the
    /// top level), as the kernel's DEFAULT_SUBVOL ioctl does: the root tree's "default"
    /// entry points at its root item, and the DEFAULT_SUBVOL incompat bit is set.
    pub(crate) fn set_default_subvolume(&self, id: u64) -> Result<()> {
        if id != FS_TREE_OBJECTID && !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) {
            return Err(Error::Invalid(format!("{id} is not a subvolume id")));
        }
        // NotFound when there is no such subvolume.
        self.subvol_root(id)?;
        let name: &[u8] = b"default";
        let key = Key::new(
            ROOT_TREE_DIR_OBJECTID,
            DIR_ITEM_KEY,
            crate::format::hash::name_hash(name),
        );
        let location = Key::new(id, ROOT_ITEM_KEY, 0);
        self.op(false, |w| {
            let mut found = false;
            w.update_item(ROOT_TREE_OBJECTID, &key, |b| {
                // The entries of one name hash, one after another; "default" is one of them.
                let mut off = 0;
                for d in DirItem::parse_all(b)? {
                    if d.name == name {
                        b[off..off + 17].copy_from_slice(&location.to_bytes());
                        found = true;
                    }
                    off += DirItem::HEADER + d.name.len() + d.data.len();
                }
                Ok(())
            })?;
            if !found {
                let entry = DirItem {
                    location,
                    transid: w.transid,
                    data: Vec::new(),
                    name: name.to_vec(),
                    file_type: FT_DIR,
                };
                let mut body = w.read_item(ROOT_TREE_OBJECTID, &key)?.unwrap_or_default();
                entry.write(&mut body);
                w.replace_item(ROOT_TREE_OBJECTID, key, &body)?;
            }
            w.sb.incompat_flags |= INCOMPAT_DEFAULT_SUBVOL;
            Ok(())
        })?;
        self.default_subvol
            .store(id, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// The received uuid of subvolume `id` (None when unset, as on anything not made by
    /// receive).
    pub(crate) fn received_uuid(&self, id: u64) -> Result<Option<[u8; 16]>> {
        let u = self.subvol_item(id)?.received_uuid;
        Ok((u != [0; 16]).then_some(u))
    }

    /// Subvolume `id`'s own quota group (0/id) as `btrfs subvolume show` reports it:
    /// `[referenced, exclusive, referenced limit, exclusive limit]` in bytes (a limit of 0 is
    /// none). None when quotas are off or the subvolume has no quota group.
    pub(crate) fn qgroup_usage(&self, id: u64) -> Result<Option<[u64; 4]>> {
        if self.find_root_item(QUOTA_TREE_OBJECTID)?.is_none() {
            return Ok(None);
        }
        let root = self.subvol_root(QUOTA_TREE_OBJECTID)?;
        let item = |ty: u8, len: usize| -> Result<Option<Vec<u8>>> {
            let key = Key::new(0, ty, id);
            match crate::ctree::lookup_le(&self.disk, &root, &key)? {
                Some(it) if it.key == key => {
                    if it.data().len() < len {
                        return Err(Error::corrupt(
                            it.loc(),
                            format!("quota item of {} bytes, not {len}", it.data().len()),
                        ));
                    }
                    Ok(Some(it.data().to_vec()))
                }
                _ => Ok(None),
            }
        };
        let Some(info) = item(QGROUP_INFO_KEY, 40)? else {
            return Ok(None);
        };
        let limit = item(QGROUP_LIMIT_KEY, 24)?.unwrap_or_else(|| vec![0; 24]);
        let flags = le_u64(&limit, 0);
        // Limit flags: bit 0 max referenced, bit 1 max exclusive.
        let max = |bit: u64, off: usize| {
            if flags & bit != 0 {
                le_u64(&limit, off)
            } else {
                0
            }
        };
        Ok(Some([
            le_u64(&info, 8),
            le_u64(&info, 24),
            max(1, 8),
            max(2, 16),
        ]))
    }

    /// What the kernel's SET_RECEIVED_SUBVOL ioctl does with an all-zero argument (`btrfs
    /// property set -f ... ro false` on a received subvolume): the subvolume must be
    /// writable (else EROFS); its uuid tree entry of type RECEIVED_SUBVOL goes, received_uuid,
    /// stransid and stime become zero, rtransid and rtime the running transaction and now.
    pub(crate) fn clear_received_uuid(&self, id: u64) -> Result<()> {
        self.require_rw_subvol(id)?;
        let old = self.subvol_item(id)?.received_uuid;
        self.op(false, |w| {
            let key = self.root_item_key(w, id)?;
            if old != [0; 16] {
                self.uuid_tree_remove(w, &old, UUID_KEY_RECEIVED_SUBVOL, id)?;
            }
            let transid = w.transid;
            let t = Timespec::now();
            w.update_item(ROOT_TREE_OBJECTID, &key, |b| {
                if b.len() < RootItem::SIZE {
                    // An old root item without the received fields: nothing to clear.
                    return Ok(());
                }
                b[279..295].fill(0);
                b[311..319].fill(0);
                b[319..327].copy_from_slice(&transid.to_le_bytes());
                b[351..363].fill(0);
                b[363..371].copy_from_slice(&t.sec.to_le_bytes());
                b[371..375].copy_from_slice(&t.nsec.to_le_bytes());
                Ok(())
            })?;
            self.forget_subvol(id);
            Ok(())
        })
    }

    /// The key of subvolume `id`'s ROOT_ITEM.
    pub(crate) fn root_item_key(&self, w: &mut Writer, id: u64) -> Result<Key> {
        w.tree_state(id)?
            .item_key
            .ok_or_else(|| Error::NotFound(format!("root item of subvolume {id}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_keys_match_the_kernel() {
        // e835c8f2-433d-4041-818a-64a53f3a586d as the kernel keys it (dump-tree of a
        // mkfs.btrfs image).
        let u = [
            0xe8, 0x35, 0xc8, 0xf2, 0x43, 0x3d, 0x40, 0x41, 0x81, 0x8a, 0x64, 0xa5, 0x3f, 0x3a,
            0x58, 0x6d,
        ];
        let k = uuid_key(&u, UUID_KEY_SUBVOL);
        assert_eq!(k.objectid, 0x41403d43f2c835e8);
        assert_eq!(k.offset, 0x6d583a3fa5648a81);
    }
}
