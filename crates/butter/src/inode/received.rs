//! Received subvolumes: finding a subvolume by its uuid or received uuid (what receive needs
//! for a snapshot's parent and a clone's source), and marking a subvolume received, as the
//! kernel's SET_RECEIVED_SUBVOL ioctl and `btrfs receive` do at the end of a stream.

use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::inode::core::Core;
use crate::inode::subvol::uuid_key;

impl Core {
    /// Subvolumes whose uuid (`received` false) or received uuid (`received` true) is `uuid`:
    /// from the uuid tree, each checked against its root item; without a uuid tree (very old
    /// images), from the root items themselves.
    pub(crate) fn subvols_by_uuid(&self, uuid: &[u8; 16], received: bool) -> Result<Vec<u64>> {
        if *uuid == [0; 16] {
            return Ok(Vec::new());
        }
        let matches = |ri: &RootItem| {
            ri.refs > 0
                && if received {
                    ri.received_uuid == *uuid
                } else {
                    ri.uuid == *uuid
                }
        };
        if self.find_root_item(UUID_TREE_OBJECTID)?.is_none() {
            return Ok(self
                .list_subvolumes()?
                .into_iter()
                .filter(|s| matches(&s.item))
                .map(|s| s.id)
                .collect());
        }
        let ty = if received {
            UUID_KEY_RECEIVED_SUBVOL
        } else {
            UUID_KEY_SUBVOL
        };
        let key = uuid_key(uuid, ty);
        let body = self
            .op(false, |w| w.read_item(UUID_TREE_OBJECTID, &key))?
            .unwrap_or_default();
        if body.len() % 8 != 0 {
            return Err(Error::corrupt(
                Location::what("uuid item")
                    .with_tree(UUID_TREE_OBJECTID)
                    .with_key(key),
                format!("size {} is not a multiple of 8", body.len()),
            ));
        }
        let mut out = Vec::new();
        for c in body.chunks(8) {
            let mut a = [0u8; 8];
            a.copy_from_slice(c);
            let id = u64::from_le_bytes(a);
            // An entry the uuid tree still has for a deleted or changed subvolume is skipped.
            if let Ok(ri) = self.subvol_item(id) {
                if matches(&ri) {
                    out.push(id);
                }
            }
        }
        Ok(out)
    }

    /// Marks subvolume `id` received from the subvolume `uuid` of the sender, as it was at
    /// the sender's transaction `stransid`, and makes it read-only: received_uuid and
    /// stransid as given, rtransid and rtime the running transaction and now, stime zero
    /// (what `btrfs receive` passes), the uuid tree's RECEIVED_SUBVOL entry moved to the new
    /// uuid, and the RDONLY flag set.
    pub(crate) fn finish_received(&self, id: u64, uuid: &[u8; 16], stransid: u64) -> Result<()> {
        let old = self.subvol_item(id)?.received_uuid;
        self.op(false, |w| {
            let key = self.root_item_key(w, id)?;
            if old != [0; 16] && old != *uuid {
                self.uuid_tree_remove(w, &old, UUID_KEY_RECEIVED_SUBVOL, id)?;
            }
            let transid = w.transid;
            let t = Timespec::now();
            w.update_item(ROOT_TREE_OBJECTID, &key, |b| {
                if b.len() < RootItem::SIZE {
                    return Err(Error::corrupt(
                        Location::what("root item")
                            .with_tree(ROOT_TREE_OBJECTID)
                            .with_key(key),
                        format!("{} bytes, too short for the received fields", b.len()),
                    ));
                }
                let mut ri = RootItem::parse(b)?;
                ri.received_uuid = *uuid;
                ri.stransid = stransid;
                ri.rtransid = transid;
                ri.stime = Timespec { sec: 0, nsec: 0 };
                ri.rtime = t;
                ri.init_current_format();
                ri.flags |= ROOT_SUBVOL_RDONLY;
                let enc = ri.to_bytes();
                b[..enc.len()].copy_from_slice(&enc);
                Ok(())
            })?;
            self.uuid_tree_add(w, uuid, UUID_KEY_RECEIVED_SUBVOL, id)?;
            self.forget_subvol(id);
            Ok(())
        })
    }
}
