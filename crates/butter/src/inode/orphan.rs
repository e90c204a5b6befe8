//! Orphans: inodes unlinked while open. They are deleted at the last close
//! (crate::inode::namespace) or, when the writer stopped first, at the next read-write open.

use crate::ctree::TreeIter;
use crate::error::{Error, Result};
use crate::format::*;
use crate::ids::Inode;
use crate::inode::core::Core;
use crate::io::disk_io::Readahead;

impl Core {
    /// Deletes the inodes with no links that ORPHAN items name, in every writable subvolume
    /// (a read-only snapshot keeps what it holds). Returns how many were deleted.
    pub(crate) fn clean_orphans(&self) -> Result<usize> {
        let mut roots = vec![FS_TREE_OBJECTID];
        roots.extend(self.list_subvolumes()?.iter().map(|s| s.id));
        let mut deleted = 0;
        for root in roots {
            let mut it = TreeIter::new(
                self.disk.clone(),
                self.subvol_root(root)?,
                Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, 0),
                Readahead::None,
            )?;
            let mut inos = Vec::new();
            while let Some(i) = it.next_item()? {
                if i.key.objectid != ORPHAN_OBJECTID || i.key.ty != ORPHAN_ITEM_KEY {
                    break;
                }
                inos.push(i.key.offset);
            }
            for ino in inos {
                let inode = Inode { root, ino };
                if self.inode_item(inode).is_ok_and(|it| it.nlink == 0) {
                    match self.release_orphan(inode) {
                        Ok(()) => deleted += 1,
                        Err(Error::ReadOnlySubvol(_)) => break,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Ok(deleted)
    }
}
