//! What send reads from a snapshot: its inodes (item, names, xattrs), their file extents, and
//! which inodes differ between two snapshots.

use crate::ctree::{Root, TreeIter};
use crate::error::{Error, Result};
use crate::format::items::*;
use crate::format::*;
use crate::fs::Fs;
use crate::io::disk_io::Readahead;
use std::collections::BTreeSet;

/// A read-only snapshot taking part in a send: the one sent, the parent, a clone source.
#[derive(Debug, Clone)]
pub(crate) struct Snap {
    pub(crate) id: u64,
    pub(crate) root: Root,
    pub(crate) item: RootItem,
}

impl Snap {
    pub(crate) fn open(fs: &Fs, id: u64) -> Result<Snap> {
        let (root, item) = fs.core().subvol(id)?;
        Ok(Snap { id, root, item })
    }
}

/// One name of an inode: its directory and the name in it.
pub(crate) type Name = (u64, Vec<u8>);

/// An inode as send needs it.
#[derive(Debug, Clone)]
pub(crate) struct InodeInfo {
    pub(crate) ino: u64,
    pub(crate) item: InodeItem,
    /// Its names in key order: INODE_REF items by directory, each item's names in order,
    /// then INODE_EXTREF items.
    pub(crate) names: Vec<Name>,
    /// Its xattrs in key order (by name hash).
    pub(crate) xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl InodeInfo {
    pub(crate) fn kind(&self) -> u32 {
        self.item.mode & 0o170000
    }
    pub(crate) fn is_dir(&self) -> bool {
        self.kind() == 0o040000
    }
    pub(crate) fn gen(&self) -> u64 {
        self.item.generation
    }
}

/// Collects the items of one inode (from INODE_ITEM to its xattrs) into an [`InodeInfo`].
#[derive(Default)]
pub(crate) struct InodeBuilder {
    item: Option<InodeItem>,
    names: Vec<Name>,
    extrefs: Vec<Name>,
    xattrs: Vec<(Vec<u8>, Vec<u8>)>,
}

impl InodeBuilder {
    /// Takes one item of the inode; false when the item is not one of these kinds.
    pub(crate) fn take(&mut self, it: &crate::ctree::ItemRef) -> Result<bool> {
        match it.key.ty {
            INODE_ITEM_KEY => {
                self.item = Some(InodeItem::parse(it.data()).map_err(|e| it.annotate(e))?)
            }
            INODE_REF_KEY => {
                for r in InodeRef::parse_all(it.data()).map_err(|e| it.annotate(e))? {
                    self.names.push((it.key.offset, r.name));
                }
            }
            INODE_EXTREF_KEY => {
                for r in InodeExtref::parse_all(it.data()).map_err(|e| it.annotate(e))? {
                    self.extrefs.push((r.parent, r.name));
                }
            }
            XATTR_ITEM_KEY => {
                for d in DirItem::parse_all(it.data()).map_err(|e| it.annotate(e))? {
                    self.xattrs.push((d.name, d.data));
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    pub(crate) fn build(self, ino: u64, tree: u64) -> Result<Option<InodeInfo>> {
        let Some(item) = self.item else {
            if self.names.is_empty() && self.extrefs.is_empty() && self.xattrs.is_empty() {
                return Ok(None);
            }
            return Err(Error::corrupt(
                crate::error::Location::what(format!("inode {ino}")).with_tree(tree),
                "names or xattrs without an inode item",
            ));
        };
        let mut names = self.names;
        names.extend(self.extrefs);
        Ok(Some(InodeInfo {
            ino,
            item,
            names,
            xattrs: self.xattrs,
        }))
    }
}

/// The inode `ino` of `snap`, if it has one.
pub(crate) fn inode_info(fs: &Fs, snap: &Snap, ino: u64) -> Result<Option<InodeInfo>> {
    let mut it = TreeIter::range(
        fs.core().disk().clone(),
        snap.root,
        Key::new(ino, INODE_ITEM_KEY, 0),
        Key::new(ino, XATTR_ITEM_KEY, u64::MAX),
        Readahead::None,
    )?;
    let mut b = InodeBuilder::default();
    while let Some(item) = it.next_item()? {
        b.take(&item)?;
    }
    b.build(ino, snap.id)
}

/// The file extent items of `ino` in `snap`: (file offset, item), in order.
pub(crate) fn file_extents(fs: &Fs, snap: &Snap, ino: u64) -> Result<Vec<(u64, FileExtentItem)>> {
    let mut it = TreeIter::range(
        fs.core().disk().clone(),
        snap.root,
        Key::new(ino, EXTENT_DATA_KEY, 0),
        Key::new(ino, EXTENT_DATA_KEY, u64::MAX),
        Readahead::Forward,
    )?;
    let mut out = Vec::new();
    while let Some(item) = it.next_item()? {
        let fe = FileExtentItem::parse(item.data()).map_err(|e| item.annotate(e))?;
        out.push((item.key.offset, fe));
    }
    Ok(out)
}

/// Inodes whose items differ between `parent` and `snap` (present in one only, or with other
/// bytes), in inode order. Both trees are walked in key order side by side; leaves the two
/// share are compared item by item too (they are cheap: one read serves both).
pub(crate) fn changed_inodes(fs: &Fs, parent: &Snap, snap: &Snap) -> Result<BTreeSet<u64>> {
    let start = Key::new(FIRST_FREE_OBJECTID, 0, 0);
    let mut a = TreeIter::new(
        fs.core().disk().clone(),
        parent.root,
        start,
        Readahead::ForwardAlways,
    )?;
    let mut b = TreeIter::new(
        fs.core().disk().clone(),
        snap.root,
        start,
        Readahead::ForwardAlways,
    )?;
    let mut out = BTreeSet::new();
    let mut x = a.next_item()?;
    let mut y = b.next_item()?;
    let relevant = |ty: u8| {
        matches!(
            ty,
            INODE_ITEM_KEY
                | INODE_REF_KEY
                | INODE_EXTREF_KEY
                | XATTR_ITEM_KEY
                | DIR_ITEM_KEY
                | DIR_INDEX_KEY
                | EXTENT_DATA_KEY
        )
    };
    loop {
        match (&x, &y) {
            (None, None) => break,
            (Some(i), None) => {
                if relevant(i.key.ty) {
                    out.insert(i.key.objectid);
                }
                x = a.next_item()?;
            }
            (None, Some(j)) => {
                if relevant(j.key.ty) {
                    out.insert(j.key.objectid);
                }
                y = b.next_item()?;
            }
            (Some(i), Some(j)) => match i.key.cmp(&j.key) {
                std::cmp::Ordering::Less => {
                    if relevant(i.key.ty) {
                        out.insert(i.key.objectid);
                    }
                    x = a.next_item()?;
                }
                std::cmp::Ordering::Greater => {
                    if relevant(j.key.ty) {
                        out.insert(j.key.objectid);
                    }
                    y = b.next_item()?;
                }
                std::cmp::Ordering::Equal => {
                    if relevant(i.key.ty) && i.data() != j.data() {
                        out.insert(i.key.objectid);
                    }
                    x = a.next_item()?;
                    y = b.next_item()?;
                }
            },
        }
    }
    Ok(out)
}
