//! Phases 2 and 3: the extent tree's items against the blocks and file extents found: metadata
//! back references and counts, data back references and counts.

use super::*;
use std::collections::BTreeSet;

impl Checker<'_> {
    pub(super) fn extent_root(&self) -> Option<Root> {
        self.trees
            .iter()
            .find(|r| r.id == EXTENT_TREE_OBJECTID)
            .copied()
    }

    pub(super) fn load_extents(&mut self) -> Result<()> {
        let Some(root) = self.extent_root() else {
            self.report.add(
                Severity::Fatal,
                FindingKind::RootItemBad,
                Location::what("root tree"),
                "no extent tree root item".into(),
            );
            return Ok(());
        };
        let nodesize = self.fs.disk.nodesize() as u64;
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(EXTENT_TREE_OBJECTID));
                return Ok(());
            }
        };
        let mut cur: Option<u64> = None;
        loop {
            let item = match it.next_item() {
                Ok(Some(i)) => i,
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(EXTENT_TREE_OBJECTID));
                    break;
                }
            };
            let k = item.key;
            let loc = item_loc(&item, EXTENT_TREE_OBJECTID);
            match k.ty {
                EXTENT_ITEM_KEY | METADATA_ITEM_KEY => match ExtentItem::parse(item.data(), k.ty) {
                    Ok(ei) => {
                        let order: Vec<(u8, std::cmp::Reverse<u64>)> = ei
                            .inline_refs
                            .iter()
                            .map(|r| (r.type_key(), std::cmp::Reverse(r.key_offset())))
                            .collect();
                        if order.windows(2).any(|w| w[0] >= w[1]) {
                            self.report.err_fix(
                                FindingKind::InlineRefOrder,
                                loc.clone(),
                                format!(
                                    "inline references out of order (type, offset): {:?}",
                                    order.iter().map(|(t, o)| (*t, o.0)).collect::<Vec<_>>()
                                ),
                                Fix::SortInlineRefs { key: k },
                            );
                        }
                        let len = if k.ty == METADATA_ITEM_KEY {
                            nodesize
                        } else {
                            k.offset
                        };
                        let gen_limit = self.sb.generation.saturating_add(1);
                        if ei.generation == 0 || ei.generation > gen_limit {
                            self.report.err_fix(
                                FindingKind::GenerationInvalid,
                                loc.clone(),
                                format!(
                                    "extent {}: generation {}, valid is 1..={gen_limit} (superblock generation + 1)",
                                    k.objectid, ei.generation
                                ),
                                Fix::ExtentGeneration {
                                    key: k,
                                    generation: gen_limit - 1,
                                },
                            );
                        }
                        let level = if k.ty == METADATA_ITEM_KEY {
                            Some(k.offset)
                        } else {
                            ei.tree_block_info.map(|(_, l)| l as u64)
                        };
                        self.extents.insert(
                            k.objectid,
                            ExtentRec {
                                len,
                                refs: ei.refs,
                                flags: ei.flags,
                                level,
                                refs_list: ei.inline_refs,
                                loc,
                            },
                        );
                        cur = Some(k.objectid);
                    }
                    Err(e) => {
                        cur = None;
                        self.report
                            .err(FindingKind::ExtentItemBad, loc, e.to_string())
                    }
                },
                TREE_BLOCK_REF_KEY | SHARED_BLOCK_REF_KEY | EXTENT_DATA_REF_KEY
                | SHARED_DATA_REF_KEY => {
                    let r = match k.ty {
                        TREE_BLOCK_REF_KEY => Ok(BackRef::TreeBlock { root: k.offset }),
                        SHARED_BLOCK_REF_KEY => Ok(BackRef::SharedBlock { parent: k.offset }),
                        EXTENT_DATA_REF_KEY => parse_extent_data_ref(item.data()),
                        _ => {
                            let d = item.data();
                            if d.len() < 4 {
                                Err(Error::corrupt(loc.clone(), "shared data ref too short"))
                            } else {
                                Ok(BackRef::SharedData {
                                    parent: k.offset,
                                    count: le_u32(d, 0),
                                })
                            }
                        }
                    };
                    match (r, cur.and_then(|c| (c == k.objectid).then_some(c))) {
                        (Ok(r), Some(c)) => {
                            if let Some(e) = self.extents.get_mut(&c) {
                                e.refs_list.push(r);
                            }
                        }
                        (Ok(_), None) => self.report.err(
                            FindingKind::ExtentItemBad,
                            loc,
                            "back reference without an extent item before it".into(),
                        ),
                        (Err(e), _) => {
                            self.report
                                .err(FindingKind::ExtentItemBad, loc, e.to_string())
                        }
                    }
                }
                _ => {}
            }
        }
        Ok(())
    }

    pub(super) fn phase_metadata_refs(&mut self) {
        let newer = self.newer_roots();
        self.stale_root_items = !newer.is_empty();
        let mut bytenrs: Vec<u64> = self.blocks.keys().copied().collect();
        bytenrs.sort_unstable();
        for b in bytenrs {
            let Some(rec) = self.blocks.get(&b) else {
                continue;
            };
            let bloc = Location::block(Some(rec.owner), b);
            // The chunk tree's blocks are accounted like any other tree block.
            let Some(ext) = self.extents.get(&b) else {
                let fix = match rec.reach.iter().find_map(|t| newer.get(t)) {
                    Some(fix) => Some(fix.clone()),
                    None => (!self.stale_root_items).then(|| Fix::ExtentRefs {
                        bytenr: b,
                        len: self.fs.disk.nodesize() as u64,
                        level: Some(rec.level),
                        refs: self.block_refs(b),
                    }),
                };
                self.report.err_maybe_fix(
                    FindingKind::MetadataExtentMissing,
                    bloc,
                    format!("tree block {b} (level {}) has no extent item", rec.level),
                    fix,
                );
                continue;
            };
            if ext.flags & EXTENT_FLAG_TREE_BLOCK == 0 {
                self.report.err(
                    FindingKind::MetadataExtentMissing,
                    ext.loc.clone(),
                    format!("extent item of tree block {b} lacks the TREE_BLOCK flag"),
                );
                continue;
            }
            if let Some(l) = ext.level.filter(|l| *l != rec.level as u64) {
                let msg = format!(
                    "tree block {b}: its extent item says level {l}, the block is level {}",
                    rec.level
                );
                match ext.loc.key {
                    Some(key) => self.report.err_fix(
                        FindingKind::MetadataLevelMismatch,
                        ext.loc.clone(),
                        msg,
                        Fix::MetadataLevel {
                            key,
                            level: rec.level,
                        },
                    ),
                    None => {
                        self.report
                            .err(FindingKind::MetadataLevelMismatch, ext.loc.clone(), msg)
                    }
                }
            }
            let mut tree_refs = HashSet::default();
            let mut shared_refs = HashSet::default();
            let mut n = 0u64;
            for r in &ext.refs_list {
                match r {
                    BackRef::TreeBlock { root } => {
                        n += 1;
                        tree_refs.insert(*root);
                        if !rec.reach.iter().any(|t| tag_tree(*t) == *root) {
                            self.report.err(
                                FindingKind::MetadataBackrefExtra,
                                ext.loc.clone(),
                                format!("tree block {b}: TREE_BLOCK_REF root {root}, but that tree does not reach the block"),
                            );
                        }
                    }
                    BackRef::SharedBlock { parent } => {
                        n += 1;
                        shared_refs.insert(*parent);
                        // The root block of a relocation tree is its own parent.
                        let ok = rec.edges.iter().any(|e| match e {
                            Edge::Node { parent: p, .. } => p == parent,
                            Edge::Root(t) => is_reloc_tag(*t) && *parent == b,
                        });
                        if !ok {
                            self.report.err(
                                FindingKind::MetadataBackrefExtra,
                                ext.loc.clone(),
                                format!("tree block {b}: SHARED_BLOCK_REF parent {parent}, but that block does not point here"),
                            );
                        }
                    }
                    _ => {}
                }
            }
            if n != ext.refs {
                self.report.err(
                    FindingKind::ExtentRefsMismatch,
                    ext.loc.clone(),
                    format!("tree block {b}: refs {} but {n} back references", ext.refs),
                );
            }
            for e in &rec.edges {
                let explained = match e {
                    Edge::Root(t) => {
                        tree_refs.contains(&tag_tree(*t))
                            || (is_reloc_tag(*t) && shared_refs.contains(&b))
                    }
                    Edge::Node { parent, .. } => {
                        shared_refs.contains(parent)
                            || self.blocks.get(parent).is_some_and(|p| {
                                p.reach.iter().any(|t| tree_refs.contains(&tag_tree(*t)))
                            })
                    }
                };
                if !explained {
                    let (what, loc) = match e {
                        Edge::Root(t) => (format!("root of {}", tag_name(*t)), bloc.clone()),
                        Edge::Node { parent, slot } => (
                            format!("pointer in block {parent} slot {slot}"),
                            Location::block(self.blocks.get(parent).map(|p| p.owner), *parent)
                                .with_slot(*slot),
                        ),
                    };
                    self.report.err(
                        FindingKind::MetadataBackrefMissing,
                        loc,
                        format!("tree block {b} is reached as {what}, but its extent item (block {:?} slot {:?}) has no back reference for it", ext.loc.bytenr, ext.loc.slot),
                    );
                }
            }
        }
        let mut metadata = 0;
        for (b, e) in &self.extents {
            if e.flags & EXTENT_FLAG_TREE_BLOCK == 0 {
                continue;
            }
            metadata += 1;
            if !self.blocks.contains_key(b) {
                let fix = match tree_ref_of(e).and_then(|t| newer.get(&t)) {
                    Some(fix) => Some(fix.clone()),
                    None => (newer.is_empty()).then(|| Fix::ExtentRefs {
                        bytenr: *b,
                        len: e.len,
                        level: e.level.and_then(|l| u8::try_from(l).ok()),
                        refs: Vec::new(),
                    }),
                };
                self.report.err_maybe_fix(
                    FindingKind::OrphanMetadataExtent,
                    e.loc.clone(),
                    format!("metadata extent {b} names a block no tree reaches"),
                    fix,
                );
            }
        }
        self.report.counts.metadata_extents = metadata;
    }

    pub(super) fn phase_data_refs(&mut self) {
        self.report.counts.file_extents = self.file_exts.len() as u64;
        let mut want: BTreeMap<u64, BTreeMap<DataRefKey, u64>> = BTreeMap::new();
        // File extents naming an address with no extent item: (bytenr, length) -> where.
        let mut missing: BTreeMap<(u64, u64), Vec<MissingRef>> = BTreeMap::new();
        for fe in &self.file_exts {
            let ext = self.extents.get(&fe.disk_bytenr);
            if ext.is_none() {
                missing
                    .entry((fe.disk_bytenr, fe.disk_num_bytes))
                    .or_default()
                    .push((
                        fe.loc.clone(),
                        format!(
                            "file extent of inode {} at {} points at {} ({} bytes), which has no extent item",
                            fe.ino, fe.file_off, fe.disk_bytenr, fe.disk_num_bytes
                        ),
                        DataRefKey::Data {
                            root: fe.owner,
                            ino: fe.ino,
                            offset: fe.file_off.wrapping_sub(fe.offset),
                        },
                        fe.owner,
                    ));
            }
            if let Some(ext) =
                ext.filter(|e| e.flags & EXTENT_FLAG_DATA == 0 || fe.disk_num_bytes != e.len)
            {
                self.report.err(
                    FindingKind::DataExtentMissing,
                    fe.loc.clone(),
                    format!(
                        "file extent of inode {} at {} names {} length {}, but the extent item there has length {} flags {:#x}",
                        fe.ino, fe.file_off, fe.disk_bytenr, fe.disk_num_bytes, ext.len, ext.flags
                    ),
                );
                continue;
            }
            let full = self
                .extents
                .get(&fe.leaf)
                .is_some_and(|l| l.flags & BLOCK_FLAG_FULL_BACKREF != 0);
            let k = if full {
                DataRefKey::Shared { parent: fe.leaf }
            } else {
                DataRefKey::Data {
                    root: fe.owner,
                    ino: fe.ino,
                    offset: fe.file_off.wrapping_sub(fe.offset),
                }
            };
            *want
                .entry(fe.disk_bytenr)
                .or_default()
                .entry(k)
                .or_default() += 1;
        }
        let haves: BTreeMap<u64, BTreeMap<DataRefKey, u64>> = self
            .extents
            .iter()
            .filter(|(_, e)| e.flags & EXTENT_FLAG_DATA != 0)
            .map(|(b, e)| (*b, data_backrefs(e)))
            .collect();
        // Data extents no file extent uses whose one back reference (count 1) names a file
        // extent item that points elsewhere: (that reference, length) -> the extent.
        let mut unused: HashMap<(DataRefKey, u64), Vec<u64>> = HashMap::default();
        for (b, have) in &haves {
            if want.contains_key(b) {
                continue;
            }
            if let ([(k, 1)], Some(e)) = (
                have.iter()
                    .map(|(k, n)| (*k, *n))
                    .collect::<Vec<_>>()
                    .as_slice(),
                self.extents.get(b),
            ) {
                unused.entry((*k, e.len)).or_default().push(*b);
            }
        }
        // The extent a damaged file extent address should name, when one such extent fits.
        let mut repointed: HashMap<u64, Fix> = HashMap::default();
        let ss = self.fs.disk.sectorsize() as u64;
        for (&(b, len), places) in &missing {
            // Only an address no data extent could have: one off the sector grid or outside
            // every data chunk (an item moved off its extent looks the same otherwise, and
            // then the item is what was damaged).
            let impossible = !b.is_multiple_of(ss)
                || !self.fs.disk.chunk_map().lookup(b).is_some_and(|c| {
                    c.item.ty & BLOCK_GROUP_DATA != 0
                        && b.saturating_add(len) <= c.logical + c.item.length
                });
            let paired = match places.as_slice() {
                [(loc, _, k, owner)] if impossible => {
                    match (unused.get(&(*k, len)).map(Vec::as_slice), loc.key) {
                        (Some([e]), Some(key)) if !self.stale_root_items => {
                            let fix = Fix::FileExtentBytenr {
                                root: *owner,
                                key,
                                bytenr: *e,
                            };
                            repointed.insert(*e, fix.clone());
                            Some(fix)
                        }
                        _ => None,
                    }
                }
                _ => None,
            };
            // Else one item to make, when every file extent naming the address agrees on its
            // length.
            let agreed = missing.range((b, 0)..=(b, u64::MAX)).count() == 1;
            let fix = paired.or_else(|| {
                (agreed && !self.stale_root_items).then(|| Fix::ExtentRefs {
                    bytenr: b,
                    len,
                    level: None,
                    refs: data_refs(want.get(&b)),
                })
            });
            for (loc, msg, _, _) in places {
                self.report.err_maybe_fix(
                    FindingKind::DataExtentMissing,
                    loc.clone(),
                    msg.clone(),
                    fix.clone(),
                );
            }
        }
        // File ranges each inode's file extent items cover: (tree, inode) -> (start, end).
        let mut covered: HashMap<(u64, u64), Vec<(u64, u64)>> = HashMap::default();
        for fe in &self.file_exts {
            covered
                .entry((fe.owner, fe.ino))
                .or_default()
                .push((fe.file_off, fe.file_off.saturating_add(fe.num_bytes)));
        }
        let mut data = 0;
        for (b, ext) in &self.extents {
            if ext.flags & EXTENT_FLAG_DATA == 0 {
                continue;
            }
            data += 1;
            let empty = BTreeMap::new();
            let have = haves.get(b).unwrap_or(&empty);
            let total = have.values().fold(0u64, |a, v| a.saturating_add(*v));
            if total != ext.refs {
                self.report.err(
                    FindingKind::ExtentRefsMismatch,
                    ext.loc.clone(),
                    format!(
                        "data extent {b}: refs {} but back references count {total}",
                        ext.refs
                    ),
                );
            }
            let w = want.get(b).unwrap_or(&empty);
            let mut fix = (!self.stale_root_items).then(|| Fix::ExtentRefs {
                bytenr: *b,
                len: ext.len,
                level: None,
                refs: data_refs(Some(w)),
            });
            if let Some(f) = repointed.get(b) {
                fix = Some(f.clone());
            }
            // One back reference more than the items using it, for a file range no item
            // covers: the item that used it is given back (the whole extent, uncompressed).
            let off: Vec<&DataRefKey> = w
                .keys()
                .chain(have.keys())
                .filter(|k| w.get(*k).copied().unwrap_or(0) != have.get(*k).copied().unwrap_or(0))
                .collect();
            if let [DataRefKey::Data { root, ino, offset }] = off.as_slice() {
                let surplus = have.get(off[0]).copied().unwrap_or(0)
                    == w.get(off[0]).copied().unwrap_or(0) + 1;
                let plain = !self
                    .file_exts
                    .iter()
                    .any(|fe| fe.disk_bytenr == *b && fe.compressed);
                let free = covered.get(&(*root, *ino)).is_none_or(|v| {
                    v.iter()
                        .all(|(s, e)| *e <= *offset || *s >= offset.saturating_add(ext.len))
                });
                if surplus && plain && free && !self.stale_root_items {
                    let f = Fix::RestoreFileExtent {
                        root: *root,
                        ino: *ino,
                        offset: *offset,
                        bytenr: *b,
                        len: ext.len,
                    };
                    self.restorable.insert((*root, *ino, *offset), f.clone());
                    fix = Some(f);
                }
            }
            if w.is_empty() {
                self.report.err_maybe_fix(
                    FindingKind::OrphanDataExtent,
                    ext.loc.clone(),
                    format!(
                        "data extent {b} ({} bytes): no file extent item references it",
                        ext.len
                    ),
                    fix,
                );
                continue;
            }
            let keys: HashSet<&DataRefKey> = w.keys().chain(have.keys()).collect();
            let mut keys: Vec<&DataRefKey> = keys.into_iter().collect();
            keys.sort();
            for k in keys {
                let a = w.get(k).copied().unwrap_or(0);
                let h = have.get(k).copied().unwrap_or(0);
                if a != h {
                    self.report.err_maybe_fix(
                        FindingKind::DataBackrefMismatch,
                        ext.loc.clone(),
                        format!("data extent {b}: back reference {k:?} counts {h}, file extent items found {a}"),
                        fix.clone(),
                    );
                }
            }
        }
        self.report.counts.data_extents = data;
    }
}

/// A file extent item naming an address with no extent item: where it is, the finding's
/// message, the back reference it makes, and its tree.
type MissingRef = (Location, String, DataRefKey, u64);

/// The back references a data extent's file extent items call for.
fn data_refs(want: Option<&BTreeMap<DataRefKey, u64>>) -> Vec<(ExtentRef, u64)> {
    want.into_iter()
        .flatten()
        .map(|(k, n)| {
            let r = match *k {
                DataRefKey::Data { root, ino, offset } => ExtentRef::Data { root, ino, offset },
                DataRefKey::Shared { parent } => ExtentRef::SharedData(parent),
            };
            (r, *n)
        })
        .collect()
}

/// The tree of a tree block extent whose only back reference is a TREE_BLOCK_REF.
fn tree_ref_of(e: &ExtentRec) -> Option<u64> {
    match e.refs_list.as_slice() {
        [BackRef::TreeBlock { root }] => Some(*root),
        _ => None,
    }
}

impl Checker<'_> {
    /// Trees whose root item was left behind: the root block it names has no extent item,
    /// and the extent tree has one, reached by no tree, for a newer block the tree owns
    /// (each such tree: the newest such block, as a [`Fix::RootBlock`]).
    fn newer_roots(&self) -> HashMap<u64, Fix> {
        let mut out: HashMap<u64, Fix> = HashMap::default();
        for (b, e) in &self.extents {
            if e.flags & EXTENT_FLAG_TREE_BLOCK == 0 || self.blocks.contains_key(b) {
                continue;
            }
            let Some(root) = tree_ref_of(e) else { continue };
            let Some(t) = self.trees.iter().find(|t| t.id == root) else {
                continue;
            };
            if self.extents.contains_key(&t.bytenr) {
                continue;
            }
            let expect = Expect {
                owner: Some(root),
                ..Default::default()
            };
            let Ok(blk) = self.fs.disk.read_tree_block(*b, &expect) else {
                continue;
            };
            let generation = blk.header.generation;
            let newest = match out.get(&root) {
                Some(Fix::RootBlock { generation: g, .. }) => generation > *g,
                _ => true,
            };
            if generation > t.generation && newest {
                out.insert(
                    root,
                    Fix::RootBlock {
                        root,
                        bytenr: *b,
                        level: blk.level(),
                        generation,
                    },
                );
            }
        }
        out
    }

    /// The back references tree block `b` is reached by: from a tree's root pointer its
    /// tree's; from a parent whose extent has FULL_BACKREF the parent's address; from another
    /// parent its owner's.
    fn block_refs(&self, b: u64) -> Vec<(ExtentRef, u64)> {
        let mut refs = BTreeSet::new();
        if let Some(rec) = self.blocks.get(&b) {
            for e in &rec.edges {
                refs.insert(match *e {
                    Edge::Root(t) if is_reloc_tag(t) => ExtentRef::SharedBlock(b),
                    Edge::Root(t) => ExtentRef::Tree(t),
                    Edge::Node { parent, .. } => {
                        let full = self
                            .extents
                            .get(&parent)
                            .is_some_and(|x| x.flags & BLOCK_FLAG_FULL_BACKREF != 0);
                        match self.blocks.get(&parent) {
                            Some(p) if !full => ExtentRef::Tree(p.owner),
                            _ => ExtentRef::SharedBlock(parent),
                        }
                    }
                });
            }
        }
        refs.into_iter().map(|r| (r, 1)).collect()
    }
}

/// A data extent's back references as counts per reference.
fn data_backrefs(e: &ExtentRec) -> BTreeMap<DataRefKey, u64> {
    let mut have: BTreeMap<DataRefKey, u64> = BTreeMap::new();
    for r in &e.refs_list {
        match r {
            BackRef::ExtentData {
                root,
                objectid,
                offset,
                count,
            } => {
                *have
                    .entry(DataRefKey::Data {
                        root: *root,
                        ino: *objectid,
                        offset: *offset,
                    })
                    .or_default() += *count as u64
            }
            BackRef::SharedData { parent, count } => {
                *have
                    .entry(DataRefKey::Shared { parent: *parent })
                    .or_default() += *count as u64
            }
            _ => {}
        }
    }
    have
}
