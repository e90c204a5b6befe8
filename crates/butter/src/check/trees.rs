//! Phase 1: every tree reachable from the superblock reads and validates; each block is
//! visited once and every parent edge recorded.

use super::*;

impl Checker<'_> {
    pub(super) fn phase_trees(&mut self) -> Result<()> {
        let sb = self.sb.clone();
        let chunk = self.fs.live_root(CHUNK_TREE_OBJECTID).unwrap_or(Root {
            id: CHUNK_TREE_OBJECTID,
            bytenr: sb.chunk_root,
            level: sb.chunk_root_level,
            generation: sb.chunk_root_generation,
        });
        let tree_root = self.fs.tree_root();
        if sb.log_root != 0 {
            // Log tree blocks have no extent items; they are not walked.
            self.report.add(
                Severity::Warning,
                FindingKind::RootItemBad,
                Location::what("superblock log_root"),
                format!(
                    "the image has an unreplayed fsync log at {}; only its file extents' csums are checked",
                    sb.log_root
                ),
            );
        }
        self.walk(chunk, CHUNK_TREE_OBJECTID, None);
        self.walk(tree_root, ROOT_TREE_OBJECTID, None);
        // Every ROOT_ITEM in the root tree.
        let mut roots = Vec::new();
        match TreeIter::new(self.fs.disk.clone(), tree_root, Key::MIN, Readahead::None) {
            Ok(mut it) => loop {
                match it.next_item() {
                    Ok(Some(item)) => {
                        let k = item.key;
                        if k.ty == ROOT_REF_KEY || k.ty == ROOT_BACKREF_KEY {
                            let loc = item_loc(&item, ROOT_TREE_OBJECTID);
                            match RootRef::parse(item.data()) {
                                Ok(rr) if k.ty == ROOT_REF_KEY => self.root_refs.push(RootRefRec {
                                    parent: k.objectid,
                                    child: k.offset,
                                    rr,
                                    loc,
                                }),
                                Ok(rr) => self.root_backrefs.push(RootRefRec {
                                    parent: k.offset,
                                    child: k.objectid,
                                    rr,
                                    loc,
                                }),
                                Err(e) => {
                                    self.report
                                        .err(FindingKind::RootItemBad, loc, e.to_string())
                                }
                            }
                            continue;
                        }
                        if item.key.ty != ROOT_ITEM_KEY {
                            continue;
                        }
                        match RootItem::parse(item.data()) {
                            Ok(ri) => {
                                self.root_items.insert(
                                    item.key.objectid,
                                    (ri.clone(), item_loc(&item, ROOT_TREE_OBJECTID)),
                                );
                                roots.push((item.key.objectid, item.key.offset, ri))
                            }
                            Err(e) => self.report.err(
                                FindingKind::RootItemBad,
                                item_loc(&item, ROOT_TREE_OBJECTID),
                                e.to_string(),
                            ),
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.unreadable(e, Some(ROOT_TREE_OBJECTID));
                        break;
                    }
                }
            },
            Err(e) => self.unreadable(e, Some(ROOT_TREE_OBJECTID)),
        }
        for (id, offset, ri) in roots {
            if id == TREE_LOG_OBJECTID || ri.bytenr == 0 {
                continue;
            }
            // Making the extent tree again: its old blocks are not kept, so not walked.
            if self.rebuild && id == EXTENT_TREE_OBJECTID {
                continue;
            }
            let gen_limit = self.sb.generation.saturating_add(1);
            if ri.generation > gen_limit {
                let loc = self
                    .root_items
                    .get(&id)
                    .map(|r| r.1.clone())
                    .unwrap_or_else(|| Location::what(format!("root item of tree {id}")));
                let msg = format!(
                    "root {id}: generation {}, but the superblock generation is {}",
                    ri.generation,
                    gen_limit - 1
                );
                // The root block's own generation, where it reads and is valid; where it
                // reads with the same wrong generation, the block is copied (a copy gets the
                // repair's generation, and so does the root item).
                let block_gen = self
                    .fs
                    .disk
                    .read_tree_block(ri.bytenr, &crate::io::disk_io::Expect::default())
                    .ok()
                    .map(|b| b.header.generation);
                let fix = match block_gen {
                    Some(g) if (1..=gen_limit).contains(&g) => Some(Fix::RootGeneration {
                        root: id,
                        generation: g,
                    }),
                    Some(g) if g == ri.generation => Some(Fix::CopyRootBlock { root: id }),
                    _ => None,
                };
                self.report
                    .err_maybe_fix(FindingKind::GenerationInvalid, loc, msg, fix);
            }
            let root = Root {
                id,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            };
            // Each relocation tree (one per subvolume being relocated, all with objectid
            // TREE_RELOC) is a tree of its own for the one-path rule.
            let tag = if id == TREE_RELOC_OBJECTID {
                RELOC_TAG | (offset & !RELOC_TAG_MASK)
            } else {
                id
            };
            let subvolume =
                id == FS_TREE_OBJECTID || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id);
            if subvolume
                && ri.inode.flags & INODE_ROOT_ITEM_INIT == 0
                && (ri.flags != 0 || ri.byte_limit != 0)
            {
                // The kernel takes such an item for one from a kernel that left flags and
                // limit uninitialised, and clears them: a read-only snapshot turns writable.
                self.report.add(
                    Severity::Warning,
                    FindingKind::RootItemBad,
                    self.root_items
                        .get(&id)
                        .map(|r| r.1.clone())
                        .unwrap_or_else(|| Location::what(format!("root item of tree {id}"))),
                    format!(
                        "subvolume {id}: root item without the current-format mark \
                         (ROOT_ITEM_INIT): the kernel clears its flags {:#x}{} and byte limit \
                         {}; `butter property set IMAGE PATH ro true` (or false) rewrites it",
                        ri.flags,
                        if ri.flags & ROOT_SUBVOL_RDONLY != 0 {
                            " (read-only)"
                        } else {
                            ""
                        },
                        ri.byte_limit
                    ),
                );
            }
            if ri.drop_progress.objectid != 0 || ri.drop_level != 0 {
                // A tree being deleted: the subtrees left of drop_progress (at drop_level and
                // above) are already freed; the rest is still accounted in the extent tree.
                self.report.add(
                    Severity::Warning,
                    FindingKind::RootItemBad,
                    Location::what(format!("root item of tree {id}")),
                    format!(
                        "tree {id} is being deleted (drop progress {} level {}); only its remaining blocks are checked",
                        ri.drop_progress, ri.drop_level
                    ),
                );
                self.dropping.insert(id);
                self.walk(root, tag, Some(ri.drop_progress));
                continue;
            }
            self.walk(root, tag, None);
        }
        // Propagate reaching trees down, highest level first.
        let mut order: Vec<(u8, u64)> = self.blocks.iter().map(|(b, r)| (r.level, *b)).collect();
        order.sort_by(|a, b| b.cmp(a));
        for (_, b) in order {
            let (edges, mut reach) = match self.blocks.get(&b) {
                Some(r) => (r.edges.clone(), HashSet::default()),
                None => continue,
            };
            for e in edges {
                match e {
                    Edge::Root(t) => {
                        reach.insert(t);
                    }
                    Edge::Node { parent, .. } => {
                        if let Some(p) = self.blocks.get(&parent) {
                            reach.extend(p.reach.iter().copied());
                        }
                    }
                }
            }
            if let Some(r) = self.blocks.get_mut(&b) {
                r.reach = reach;
            }
        }
        // A tree reaches each of its blocks by one path only.
        let mut bytenrs: Vec<u64> = self.blocks.keys().copied().collect();
        bytenrs.sort_unstable();
        for b in bytenrs {
            let Some(rec) = self.blocks.get(&b) else {
                continue;
            };
            let mut per_tree: BTreeMap<u64, Vec<Edge>> = BTreeMap::new();
            for e in &rec.edges {
                match e {
                    Edge::Root(t) => per_tree.entry(*t).or_default().push(*e),
                    Edge::Node { parent, .. } => {
                        if let Some(p) = self.blocks.get(parent) {
                            for t in &p.reach {
                                per_tree.entry(*t).or_default().push(*e);
                            }
                        }
                    }
                }
            }
            let dups: Vec<String> = per_tree
                .iter()
                .filter(|(_, v)| v.len() > 1)
                .map(|(t, v)| format!("{} via {v:?}", tag_name(*t)))
                .collect();
            if !dups.is_empty() {
                let loc = Location::block(Some(rec.owner), b);
                self.report.err(
                    FindingKind::TreeBlockReferencedTwice,
                    loc,
                    format!("block {b} is reached more than once: {}", dups.join("; ")),
                );
            }
        }
        self.report.counts.tree_blocks = self.blocks.len() as u64;
        Ok(())
    }

    pub(super) fn unreadable(&mut self, e: Error, tree: Option<u64>) {
        let loc = match &e {
            Error::Corrupt { loc, .. } | Error::BadChecksum { loc, .. } => {
                let mut l = (**loc).clone();
                if l.tree.is_none() {
                    l.tree = tree;
                }
                l
            }
            _ => Location {
                tree,
                ..Default::default()
            },
        };
        self.report.add(
            Severity::Fatal,
            FindingKind::TreeBlockUnreadable,
            loc,
            e.to_string(),
        );
    }

    /// Depth-first walk of one tree; blocks already visited get the new edge only. `tag` names
    /// the tree in edges and reach sets (the tree id, or a [`RELOC_TAG`] for a relocation
    /// tree); with `drop`, subtrees entirely left of that key are skipped (already freed).
    fn walk(&mut self, root: Root, tag: u64, drop: Option<Key>) {
        self.report.counts.trees += 1;
        self.trees.push(root);
        let disk = self.fs.disk.clone();
        // (bytenr, edge, expect, end of the key range below the pointer)
        let mut stack = vec![(
            root.bytenr,
            Edge::Root(tag),
            None::<Key>,
            Expect {
                owner: None,
                level: Some(root.level),
                generation: Some(root.generation),
                first_key: None,
            },
        )];
        while let Some((bytenr, edge, end, expect)) = stack.pop() {
            if let Some(r) = self.blocks.get_mut(&bytenr) {
                if r.edges.contains(&edge) {
                    continue;
                }
                r.edges.push(edge);
                continue;
            }
            let b = match disk.read_tree_block(bytenr, &expect) {
                Ok(b) => b,
                Err(e) => {
                    let e = e.in_block(Some(root.id), bytenr);
                    self.unreadable(e, Some(root.id));
                    // Damage the block's own layout undoes: the repair reads it mended and
                    // copies it into the tree (every tree that reaches it gets its copy).
                    if let Some(m) = disk.mend_tree_block(bytenr, &expect) {
                        let mended = crate::io::disk_io::TreeBlock::from_parts(bytenr, m);
                        let key = if mended.nritems() == 0 {
                            None
                        } else if mended.is_leaf() {
                            Some(mended.item(0).key)
                        } else {
                            Some(mended.key(0))
                        };
                        if let (Some(key), Some(f)) = (key, self.report.findings.last_mut()) {
                            f.fix = Some(Fix::MendBlock {
                                tree: root.id,
                                bytenr,
                                level: mended.level(),
                                generation: expect.generation,
                                key,
                            });
                            // Reached, as far as the extent tree's references go.
                            self.blocks.insert(
                                bytenr,
                                BlockRec {
                                    owner: mended.owner(),
                                    level: mended.level(),
                                    edges: vec![edge],
                                    reach: HashSet::default(),
                                },
                            );
                        }
                    }
                    continue;
                }
            };
            self.blocks.insert(
                bytenr,
                BlockRec {
                    owner: b.owner(),
                    level: b.level(),
                    edges: vec![edge],
                    reach: HashSet::default(),
                },
            );
            if b.is_leaf() {
                // The root tree holds the v1 free space cache inodes and their extents.
                if is_fs_tree(root.id)
                    || is_fs_tree(b.owner())
                    || root.id == ROOT_TREE_OBJECTID
                    || root.id == TREE_RELOC_OBJECTID
                {
                    self.collect_file_extents(&b);
                }
                continue;
            }
            // The children are read next, depth first: the device starts on all of them.
            let children: Vec<u64> = (0..b.nritems()).map(|s| b.ptr(s).blockptr).collect();
            disk.will_need_blocks(&children);
            let mut seen = HashSet::default();
            for slot in 0..b.nritems() {
                let p = b.ptr(slot);
                if !seen.insert(p.blockptr) {
                    self.report.err(
                        FindingKind::TreeBlockDuplicatePointer,
                        b.loc(Some(slot)),
                        format!("node points at block {} twice", p.blockptr),
                    );
                    continue;
                }
                let child_end = if slot + 1 < b.nritems() {
                    Some(b.ptr(slot + 1).key)
                } else {
                    end
                };
                if let (Some(dp), Some(ce)) = (drop, child_end) {
                    if ce <= dp {
                        continue; // freed by the interrupted deletion
                    }
                }
                stack.push((
                    p.blockptr,
                    Edge::Node {
                        parent: bytenr,
                        slot,
                    },
                    child_end,
                    Expect {
                        // Owners are not checked here: shared blocks keep their first owner;
                        // the back references say which trees may hold a block (phase 2).
                        owner: None,
                        level: Some(b.level().saturating_sub(1)),
                        generation: Some(p.generation),
                        first_key: Some(p.key),
                    },
                ));
            }
        }
    }

    fn collect_file_extents(&mut self, b: &crate::io::disk_io::TreeBlock) {
        for slot in 0..b.nritems() {
            let key = b.key(slot);
            if key.ty != EXTENT_DATA_KEY {
                continue;
            }
            let Ok(fe) = FileExtentItem::parse(b.item_data(slot)) else {
                continue; // reported by phase 5
            };
            if let FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
            } = fe.body
            {
                if disk_bytenr == 0 {
                    continue;
                }
                self.file_exts.push(FileExtRef {
                    leaf: b.bytenr,
                    owner: b.owner(),
                    ino: key.objectid,
                    file_off: key.offset,
                    disk_bytenr,
                    disk_num_bytes,
                    offset,
                    num_bytes,
                    compressed: fe.compression != COMPRESS_NONE,
                    loc: b.loc(Some(slot)),
                });
            }
        }
    }

    /// Every item of a tree matching `want` (an unreadable block is reported and ends the walk).
    pub(super) fn collect_items(
        &mut self,
        root: Root,
        want: impl Fn(&Key) -> bool,
    ) -> Vec<ItemRef> {
        let mut out = Vec::new();
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(root.id));
                return out;
            }
        };
        loop {
            match it.next_item() {
                Ok(Some(item)) => {
                    if want(&item.key) {
                        out.push(item);
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(root.id));
                    break;
                }
            }
        }
        out
    }

    pub(super) fn tree(&self, id: u64) -> Option<Root> {
        self.trees.iter().find(|r| r.id == id).copied()
    }
}
