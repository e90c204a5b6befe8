//! Block-group upkeep: loading the block groups and their free space at open, and at each
//! commit rewriting the changed block group items (in the extent tree or the block group
//! tree) and their free space tree entries.

use super::chunk_alloc::exclude_supers;
use super::Writer;
use crate::ctree::TreeIter;
use crate::error::{Error, Location, Result};
use crate::format::items::*;
use crate::format::*;
use crate::io::disk_io::Readahead;
use crate::space::alloc::BlockGroup;
use std::collections::BTreeMap;

impl Writer {
    pub(super) fn load_block_groups(&mut self) -> Result<()> {
        let ns = self.disk.nodesize() as u64;
        let extent_root = self.current_root(EXTENT_TREE_OBJECTID)?;
        let mut groups: Vec<BlockGroup> = Vec::new();
        let mut used_ranges: Vec<(u64, u64)> = Vec::new();
        let mut group_item = |item: &crate::ctree::ItemRef| -> Result<()> {
            let bgi = BlockGroupItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            let mut bg = BlockGroup::new(item.key.objectid, item.key.offset, bgi.flags);
            bg.used = bgi.used;
            groups.push(bg);
            Ok(())
        };
        let bg_tree = self.block_group_tree();
        // With the groups in a tree of their own and a free space tree, an extent tree that
        // cannot be read leaves the free space to that tree (for a repair that makes the
        // extent tree again; every other open refuses it).
        let fallback = bg_tree != EXTENT_TREE_OBJECTID
            && self.disk.sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE);
        let unreadable = |e: Error| -> Result<String> {
            match e {
                Error::Corrupt { .. } | Error::Io { .. } if fallback => Ok(e.to_string()),
                Error::Corrupt { .. } | Error::Io { .. } => Err(Error::corrupt(
                    Location::what("extent tree").with_tree(EXTENT_TREE_OBJECTID),
                    format!(
                        "{e}; without {} butter cannot tell free space from used, so it cannot \
                         open the filesystem read-write (`butter restore` copies the files out)",
                        if bg_tree == EXTENT_TREE_OBJECTID {
                            "the extent tree (it holds the block groups here)"
                        } else {
                            "the extent tree or a free space tree"
                        }
                    ),
                )),
                e => Err(e),
            }
        };
        let mut it =
            match TreeIter::new(self.disk.clone(), extent_root, Key::MIN, Readahead::Forward) {
                Ok(it) => Some(it),
                Err(e) => {
                    self.extent_tree_unread = Some(unreadable(e)?);
                    None
                }
            };
        while let Some(walk) = it.as_mut() {
            let item = match walk.next_item() {
                Ok(Some(item)) => item,
                Ok(None) => break,
                Err(e) => {
                    self.extent_tree_unread = Some(unreadable(e)?);
                    used_ranges.clear();
                    break;
                }
            };
            match item.key.ty {
                BLOCK_GROUP_ITEM_KEY if bg_tree == EXTENT_TREE_OBJECTID => group_item(&item)?,
                EXTENT_ITEM_KEY => used_ranges.push((item.key.objectid, item.key.offset)),
                METADATA_ITEM_KEY => used_ranges.push((item.key.objectid, ns)),
                _ => {}
            }
        }
        if bg_tree != EXTENT_TREE_OBJECTID {
            // block-group-tree: the items live in a tree of their own (tree 11).
            let root = self.current_root(bg_tree)?;
            let mut it = TreeIter::new(self.disk.clone(), root, Key::MIN, Readahead::Forward)?;
            while let Some(item) = it.next_item()? {
                if item.key.ty == BLOCK_GROUP_ITEM_KEY {
                    group_item(&item)?;
                }
            }
        }
        let chunks: Vec<(u64, ChunkItem)> = self
            .disk
            .chunk_map()
            .chunks()
            .map(|c| (c.logical, c.item.clone()))
            .collect();
        let fst_free = match self.extent_tree_unread {
            Some(_) => Some(self.free_space_from_fst(&groups)?),
            None => None,
        };
        for mut bg in groups {
            if let Some(free) = &fst_free {
                // Used: what the free space tree does not list as free.
                let mut used = crate::space::alloc::RangeSet::new();
                let _ = used.add(bg.start, bg.len);
                for (s, l) in free.get(&bg.start).into_iter().flatten() {
                    used.remove(*s, *l);
                }
                used_ranges.extend(used.iter());
            }
            for (s, l) in &used_ranges {
                if *s + *l > bg.start && *s < bg.end() {
                    bg.free.remove(*s, *l);
                }
            }
            if let Some((_, ci)) = chunks.iter().find(|(l, _)| *l == bg.start) {
                exclude_supers(&mut bg, ci);
            }
            self.allocator.add_group(bg)?;
        }
        // Which groups the free space tree describes with bitmaps.
        if self.disk.sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE) {
            let root = self.current_root(FREE_SPACE_TREE_OBJECTID)?;
            let mut it = TreeIter::new(self.disk.clone(), root, Key::MIN, Readahead::Forward)?;
            while let Some(item) = it.next_item()? {
                if item.key.ty == FREE_SPACE_INFO_KEY {
                    let fsi = FreeSpaceInfo::parse(item.data()).map_err(|e| item.annotate(e))?;
                    let start = item.key.objectid;
                    self.allocator.with_group(start, |g| {
                        g.fst_bitmaps = fsi.flags & 1 != 0;
                    });
                }
            }
        }
        Ok(())
    }

    /// Each group's free extents as the free space tree lists them (the open of a filesystem
    /// whose extent tree cannot be read; see [`Writer::load_block_groups`]).
    fn free_space_from_fst(
        &mut self,
        groups: &[BlockGroup],
    ) -> Result<std::collections::BTreeMap<u64, Vec<(u64, u64)>>> {
        let root = self.current_root(FREE_SPACE_TREE_OBJECTID)?;
        let ss = self.disk.sectorsize();
        let mut out = std::collections::BTreeMap::new();
        for g in groups {
            let mut it = TreeIter::range(
                self.disk.clone(),
                root,
                Key::new(g.start, 0, 0),
                Key::new(g.end().saturating_sub(1), u8::MAX, u64::MAX),
                Readahead::Forward,
            )?;
            let mut items: Vec<(Key, Vec<u8>)> = Vec::new();
            while let Some(item) = it.next_item()? {
                if matches!(
                    item.key.ty,
                    FREE_SPACE_INFO_KEY | FREE_SPACE_EXTENT_KEY | FREE_SPACE_BITMAP_KEY
                ) && !(item.key.ty == FREE_SPACE_INFO_KEY && item.key.objectid != g.start)
                {
                    items.push((item.key, item.data().to_vec()));
                }
            }
            let refs: Vec<(Key, &[u8])> = items.iter().map(|(k, d)| (*k, d.as_slice())).collect();
            let d = crate::space::free_space_tree::decode_items(&refs, g.start, g.len, ss)?;
            out.insert(g.start, d.space.extents);
        }
        Ok(out)
    }

    /// The tree that holds the block group items: the extent tree, or with the
    /// block-group-tree feature (compat_ro bit 3) a tree of their own.
    pub(crate) fn block_group_tree(&self) -> u64 {
        if self.disk.sb.has_compat_ro(COMPAT_RO_BLOCK_GROUP_TREE) {
            BLOCK_GROUP_TREE_OBJECTID
        } else {
            EXTENT_TREE_OBJECTID
        }
    }

    /// Rewrites block group items and free space tree entries of dirty groups. Returns whether
    /// any tree changed.
    pub(super) fn update_block_groups(&mut self) -> Result<bool> {
        let mut changed = false;
        // The running superblock's flag: a transaction that removes the free space tree
        // (`butter rescue clear-space-cache v2`) writes no items into it.
        let fst = self.sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE);
        for start in self.allocator.starts() {
            let snap = self.allocator.with_group(start, |g| {
                let r = g.dirty.then(|| {
                    (
                        g.len,
                        g.flags,
                        g.used,
                        g.new,
                        g.on_disk_free(),
                        g.fst_bitmaps,
                    )
                });
                g.dirty = false;
                r
            });
            let Some(Some((len, flags, used, _new, free, bitmaps))) = snap else {
                continue;
            };
            let key = Key::new(start, BLOCK_GROUP_ITEM_KEY, len);
            let body = BlockGroupItem {
                used,
                chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
                flags,
            }
            .to_bytes();
            let tree = self.block_group_tree();
            if self.read_item(tree, &key)?.as_deref() != Some(&body[..]) {
                self.replace_item(tree, key, &body)?;
                changed = true;
            }
            if fst {
                let ss = self.disk.sectorsize();
                let fsp = crate::space::free_space_tree::BgFreeSpace {
                    start,
                    len,
                    extents: free.iter().collect(),
                };
                let (use_bitmaps, want) = crate::space::free_space_tree::encode(&fsp, ss, bitmaps);
                self.allocator
                    .with_group(start, |g| g.fst_bitmaps = use_bitmaps);
                changed |= self.sync_fst_items(start, len, want)?;
            }
        }
        Ok(changed)
    }

    /// Makes the free space tree items of one block group exactly `want`.
    pub(super) fn sync_fst_items(
        &mut self,
        start: u64,
        len: u64,
        want: Vec<(Key, Vec<u8>)>,
    ) -> Result<bool> {
        let root = self.current_root(FREE_SPACE_TREE_OBJECTID)?;
        let mut have: Vec<(Key, Vec<u8>)> = Vec::new();
        let mut it = TreeIter::new(
            self.disk.clone(),
            root,
            Key::new(start, 0, 0),
            Readahead::None,
        )?;
        while let Some(item) = it.next_item()? {
            if item.key.objectid >= start + len {
                break;
            }
            if matches!(
                item.key.ty,
                FREE_SPACE_INFO_KEY | FREE_SPACE_EXTENT_KEY | FREE_SPACE_BITMAP_KEY
            ) {
                have.push((item.key, item.data().to_vec()));
            }
        }
        if have == want {
            return Ok(false);
        }
        let want_map: BTreeMap<Key, Vec<u8>> = want.into_iter().collect();
        for (k, v) in &have {
            if want_map.get(k) != Some(v) {
                self.delete_item(FREE_SPACE_TREE_OBJECTID, k)?;
            }
        }
        let have_map: BTreeMap<Key, Vec<u8>> = have.into_iter().collect();
        for (k, v) in &want_map {
            if have_map.get(k) != Some(v) {
                self.insert_item(FREE_SPACE_TREE_OBJECTID, *k, v)?;
            }
        }
        Ok(true)
    }
}
