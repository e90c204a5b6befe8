//! Phase 5: the fs trees: inodes (nlink, sizes, nbytes), directory entries and their
//! indexes, inode refs, file extent cover, and the subvolumes' root refs.

use super::*;
use crate::inode::namespace::mode_to_ft;

/// What one fs tree holds for one inode, gathered in the collection pass of
/// `Checker::check_fs_tree` and cross-checked after it.
#[derive(Default)]
struct Ino {
    item: Option<(InodeItem, Place)>,
    names: u64,
    /// (parent, index, name, loc)
    refs: Vec<(u64, u64, Vec<u8>, Place)>,
    dir_items: Vec<(Vec<u8>, Key, Place)>,
    /// (index, name, target, place, entry type)
    dir_index: Vec<(u64, Vec<u8>, Key, Place, u8)>,
    nbytes: u64,
    first_loc: Option<Place>,
    /// (logical, length, regular, compressed, file offset, location)
    extents: Vec<(u64, u64, bool, bool, u64, Place)>,
    /// First file offset with an extent item and where the last item ends.
    file_start: Option<u64>,
    file_end: Option<u64>,
    /// Start of the first gap between extent items, and where the item after it starts.
    first_gap: Option<u64>,
    first_gap_end: Option<u64>,
    overlaps: Vec<(Place, String)>,
    /// Uncompressed inline extents whose ram_bytes is not their data's length: (key, place,
    /// ram_bytes, data length).
    bad_inline: Vec<(Key, Place, u64, u64)>,
}

impl Ino {
    /// Records one item of this inode (key `k`, body `data`, found at `loc`) by its kind;
    /// kinds not cross-checked are skipped. `Err` says why the item does not decode.
    fn add_item(
        &mut self,
        k: Key,
        data: &[u8],
        loc: &Place,
        ss: u64,
    ) -> std::result::Result<(), String> {
        match k.ty {
            INODE_ITEM_KEY => {
                self.item = Some((InodeItem::parse(data).map_err(|e| e.to_string())?, *loc))
            }
            INODE_REF_KEY | INODE_EXTREF_KEY => self.add_names(k, data, loc)?,
            DIR_ITEM_KEY | DIR_INDEX_KEY => self.add_dir_entries(k, data, loc)?,
            EXTENT_DATA_KEY => self.add_file_extent(k, data, loc, ss)?,
            _ => {}
        }
        Ok(())
    }

    /// An INODE_REF (parent in the key offset) or INODE_EXTREF (parent in each entry): each
    /// name counts toward the link count and is kept for the directory cross-check.
    fn add_names(&mut self, k: Key, data: &[u8], loc: &Place) -> std::result::Result<(), String> {
        if k.ty == INODE_REF_KEY {
            for r in InodeRef::parse_all(data).map_err(|e| e.to_string())? {
                self.names += 1;
                self.refs.push((k.offset, r.index, r.name, *loc));
            }
        } else {
            for r in InodeExtref::parse_all(data).map_err(|e| e.to_string())? {
                self.names += 1;
                self.refs.push((r.parent, r.index, r.name, *loc));
            }
        }
        Ok(())
    }

    /// A DIR_ITEM (each name must hash to the key offset) or DIR_INDEX (the index in the key
    /// offset) of this directory, kept for the item/index and entry/ref cross-checks.
    fn add_dir_entries(
        &mut self,
        k: Key,
        data: &[u8],
        loc: &Place,
    ) -> std::result::Result<(), String> {
        if k.ty == DIR_ITEM_KEY {
            for d in DirItem::parse_all(data).map_err(|e| e.to_string())? {
                if name_hash(&d.name) != k.offset {
                    return Err(format!(
                        "dir item name {:?} does not hash to the key offset",
                        String::from_utf8_lossy(&d.name)
                    ));
                }
                self.dir_items.push((d.name, d.location, *loc));
            }
        } else {
            for d in DirItem::parse_all(data).map_err(|e| e.to_string())? {
                self.dir_index
                    .push((k.offset, d.name, d.location, *loc, d.file_type));
            }
        }
        Ok(())
    }

    /// A file extent item: tracks the file range covered so far (overlaps and the first gap,
    /// items coming in offset order), the bytes it accounts for in nbytes, and the disk range
    /// its csums must cover.
    fn add_file_extent(
        &mut self,
        k: Key,
        data: &[u8],
        loc: &Place,
        ss: u64,
    ) -> std::result::Result<(), String> {
        let fe = FileExtentItem::parse(data).map_err(|e| e.to_string())?;
        // Uncompressed inline data is as long as it is, whatever ram_bytes says.
        let inline_bytes = match &fe.body {
            FileExtentBody::Inline(d) if fe.compression == COMPRESS_NONE => {
                let n = d.len() as u64;
                if n != fe.ram_bytes {
                    self.bad_inline.push((k, *loc, fe.ram_bytes, n));
                }
                n
            }
            _ => fe.ram_bytes,
        };
        // The file range the item covers: inline data to the end of its sector.
        let len = match fe.body {
            FileExtentBody::Inline(_) => inline_bytes.div_ceil(ss).saturating_mul(ss),
            FileExtentBody::Extent { num_bytes, .. } => num_bytes,
        };
        match self.file_end {
            None => self.file_start = Some(k.offset),
            Some(end) if k.offset < end => self.overlaps.push((
                *loc,
                format!(
                    "inode {}: file extent at {} starts before the previous one ends at {end}",
                    k.objectid, k.offset
                ),
            )),
            Some(end) if k.offset > end => {
                if self.first_gap.is_none() {
                    self.first_gap = Some(end);
                    self.first_gap_end = Some(k.offset);
                }
            }
            Some(_) => {}
        }
        self.file_end = Some(k.offset.saturating_add(len));
        match fe.body {
            FileExtentBody::Inline(_) => self.nbytes = self.nbytes.saturating_add(inline_bytes),
            FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset,
                num_bytes,
            } => {
                if disk_bytenr != 0 {
                    self.nbytes = self.nbytes.saturating_add(num_bytes);
                    // Csums cover what the item uses: the whole extent when
                    // compressed, else [offset, offset + num_bytes) of it (the
                    // rest may be preallocated space never written).
                    let range = if fe.compression != COMPRESS_NONE {
                        (disk_bytenr, disk_num_bytes)
                    } else {
                        (disk_bytenr.saturating_add(offset), num_bytes)
                    };
                    self.extents.push((
                        range.0,
                        range.1,
                        fe.ty == FILE_EXTENT_REG,
                        fe.compression != COMPRESS_NONE,
                        k.offset,
                        *loc,
                    ));
                }
            }
        }
        Ok(())
    }
}

impl Checker<'_> {
    /// Returns the (logical, length) ranges of regular extents that must have csums.
    pub(super) fn phase_fs_trees(&mut self) -> Result<Vec<(u64, u64, Location)>> {
        let mut csum = BTreeMap::new();
        let trees: Vec<Root> = self
            .trees
            .iter()
            .filter(|r| is_fs_tree(r.id) && !self.dropping.contains(&r.id))
            .copied()
            .collect();
        for root in trees {
            self.check_fs_tree(root, &mut csum);
        }
        self.check_space_cache_inodes();
        self.check_root_refs();
        self.check_qgroups();
        Ok(csum.into_iter().map(|((b, l), loc)| (b, l, loc)).collect())
    }

    /// The v1 free space cache's inodes (inode items of the root tree, from the first free
    /// objectid on) are regular files of mode 0600, as every tool writes them.
    fn check_space_cache_inodes(&mut self) {
        let Some(root) = self.tree(ROOT_TREE_OBJECTID) else {
            return;
        };
        let items = self.collect_items(root, |k| {
            k.ty == INODE_ITEM_KEY
                && (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&k.objectid)
        });
        for item in items {
            let Ok(ii) = InodeItem::parse(item.data()) else {
                continue;
            };
            const MODE: u32 = 0o100600;
            if ii.mode != MODE {
                self.report.err_fix(
                    FindingKind::InodeModeBad,
                    item_loc(&item, ROOT_TREE_OBJECTID),
                    format!(
                        "free space cache inode {}: mode {:o}, not a regular file of mode 0600",
                        item.key.objectid, ii.mode
                    ),
                    Fix::InodeMode {
                        root: ROOT_TREE_OBJECTID,
                        ino: item.key.objectid,
                        mode: MODE,
                    },
                );
            }
        }
    }

    /// ROOT_REF and ROOT_BACKREF come in pairs (same parent, child, directory, index, name);
    /// each ROOT_REF has its directory entry in the parent tree and each subvolume entry its
    /// ROOT_REF; a live subvolume has a ROOT_BACKREF.
    fn check_root_refs(&mut self) {
        // (parent, child, directory, index, name): what a ref, its backref and the directory
        // entry must agree on.
        type RefKey<'k> = (u64, u64, u64, u64, &'k [u8]);
        let key = |r: &RootRefRec| -> (u64, u64, u64, u64, Vec<u8>) {
            (
                r.parent,
                r.child,
                r.rr.dirid,
                r.rr.sequence,
                r.rr.name.clone(),
            )
        };
        let refs: HashSet<_> = self.root_refs.iter().map(key).collect();
        let backrefs: HashSet<_> = self.root_backrefs.iter().map(key).collect();
        let entries: HashSet<RefKey> = self
            .subvol_entries
            .iter()
            .map(|e| (e.tree, e.child, e.dir, e.index, e.name.as_slice()))
            .collect();
        let checked: HashSet<u64> = self.trees.iter().map(|t| t.id).collect();
        let desc = |r: &RootRefRec| {
            format!(
                "subvolume {} in tree {} directory {} index {} name {:?}",
                r.child,
                r.parent,
                r.rr.dirid,
                r.rr.sequence,
                String::from_utf8_lossy(&r.rr.name)
            )
        };
        // The missing half of a pair is made again where the parent's directory entry
        // confirms it.
        let mate = |r: &RootRefRec, backref: bool| {
            let e: RefKey = (r.parent, r.child, r.rr.dirid, r.rr.sequence, &r.rr.name);
            entries.contains(&e).then(|| Fix::RootRef {
                parent: r.parent,
                child: r.child,
                dirid: r.rr.dirid,
                sequence: r.rr.sequence,
                name: r.rr.name.clone(),
                backref,
            })
        };
        for r in &self.root_refs {
            if !backrefs.contains(&key(r)) {
                self.report.err_maybe_fix(
                    FindingKind::RootRefWithoutBackref,
                    r.loc.clone(),
                    format!("ROOT_REF for {} has no matching ROOT_BACKREF", desc(r)),
                    mate(r, true),
                );
            }
            // Its directory entry, when the parent tree was checked.
            let e: RefKey = (r.parent, r.child, r.rr.dirid, r.rr.sequence, &r.rr.name);
            if checked.contains(&r.parent) && !entries.contains(&e) {
                self.report.err(
                    FindingKind::SubvolEntryMismatch,
                    r.loc.clone(),
                    format!(
                        "ROOT_REF for {}: the parent tree has no such DIR_INDEX",
                        desc(r)
                    ),
                );
            }
        }
        for b in &self.root_backrefs {
            if !refs.contains(&key(b)) {
                self.report.err_maybe_fix(
                    FindingKind::RootBackrefWithoutRef,
                    b.loc.clone(),
                    format!("ROOT_BACKREF for {} has no matching ROOT_REF", desc(b)),
                    mate(b, false),
                );
            }
        }
        for e in &self.subvol_entries {
            // A snapshot keeps the entries of subvolumes nested in its source, without a
            // ROOT_REF (they show as empty directories): fine when the subvolume predates the
            // snapshot.
            let copied_by_snapshot =
                match (self.root_items.get(&e.tree), self.root_items.get(&e.child)) {
                    (Some((snap, _)), Some((child, _))) => {
                        snap.parent_uuid != [0u8; 16] && child.otransid <= snap.otransid
                    }
                    _ => false,
                };
            if copied_by_snapshot
                || refs.contains(&(e.tree, e.child, e.dir, e.index, e.name.clone()))
            {
                continue;
            }
            // With a ROOT_BACKREF from this tree the ROOT_REF is missing for sure; without one
            // the entry may be a stale copy in a snapshot made by a kernel that recorded no
            // parent uuid (`btrfs check` does not look at such entries): a warning.
            let backref = self
                .root_backrefs
                .iter()
                .any(|b| b.parent == e.tree && b.child == e.child);
            self.report.add(
                if backref {
                    Severity::Error
                } else {
                    Severity::Warning
                },
                FindingKind::SubvolEntryMismatch,
                e.loc.clone(),
                format!(
                    "tree {} directory {} DIR_INDEX {} {:?} names subvolume {}, which has no matching ROOT_REF{}",
                    e.tree,
                    e.dir,
                    e.index,
                    String::from_utf8_lossy(&e.name),
                    e.child,
                    if backref { "" } else { " (a stale entry copied by a snapshot?)" }
                ),
            );
        }
        let with_backref: HashSet<u64> = self.root_backrefs.iter().map(|b| b.child).collect();
        for (id, (ri, rloc)) in &self.root_items {
            if !(FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(id)
                || ri.refs == 0
                || ri.drop_progress.objectid != 0
                || ri.drop_level != 0
            {
                continue;
            }
            if !with_backref.contains(id) {
                self.report.err(
                    FindingKind::SubvolUnreferenced,
                    rloc.clone(),
                    format!("subvolume {id} has refs {} but no ROOT_BACKREF", ri.refs),
                );
            }
        }
    }

    /// One fs tree: gathers each inode's items in one pass, then cross-checks them: the root
    /// directory, then per inode its own fields, its file extents and counts, its data extents'
    /// csum needs, and its directory entries and names against each other.
    fn check_fs_tree(&mut self, root: Root, csum: &mut BTreeMap<(u64, u64), Location>) {
        let tid = root.id;
        let Some((inodes, orphans)) = self.collect_fs_inodes(root) else {
            return;
        };
        self.report.counts.inodes += inodes.len() as u64;
        // Inodes some directory entry names (a name there, even without its INODE_REF), with
        // the entry type a DIR_INDEX gives them.
        let mut named: HashMap<u64, u8> = HashMap::default();
        for i in inodes.values() {
            for d in i.dir_items.iter().filter(|d| d.1.ty == INODE_ITEM_KEY) {
                named.entry(d.1.objectid).or_insert(FT_UNKNOWN);
            }
            for d in i.dir_index.iter().filter(|d| d.2.ty == INODE_ITEM_KEY) {
                named.insert(d.2.objectid, d.4);
            }
        }
        self.check_root_dir(root, &inodes);
        // Every DIR_INDEX naming an inode: (directory, index, inode, name), so each inode ref
        // finds its entry in one lookup, however large its directory.
        let index_of: HashSet<(u64, u64, u64, &[u8])> = inodes
            .iter()
            .flat_map(|(&dir, i)| {
                i.dir_index
                    .iter()
                    .filter(|d| d.2.ty == INODE_ITEM_KEY)
                    .map(move |d| (dir, d.0, d.2.objectid, d.1.as_slice()))
            })
            .collect();
        // Directory entries by (dir, index) and (dir, name).
        for (&n, ino) in &inodes {
            let Some((ii, iloc)) = &ino.item else {
                let loc: Location = ino.first_loc.map(Location::from).unwrap_or_default();
                let msg = format!("tree {tid}: items for inode {n}, which has no INODE_ITEM");
                // A new inode item from what the other items say, where it has a name.
                let names: u64 = ino.dir_items.iter().map(|d| d.0.len() as u64).sum::<u64>()
                    + ino.dir_index.iter().map(|d| d.1.len() as u64).sum::<u64>();
                let is_dir = n == FIRST_FREE_OBJECTID
                    || !ino.dir_items.is_empty()
                    || !ino.dir_index.is_empty();
                match u32::try_from(ino.names) {
                    Ok(nlink) if nlink > 0 && (is_dir || ino.overlaps.is_empty()) => {
                        self.report.err_fix(
                            FindingKind::DanglingInode,
                            loc,
                            msg,
                            Fix::RecreateInode {
                                root: tid,
                                ino: n,
                                mode: if is_dir { 0o40755 } else { 0o100644 },
                                size: if is_dir {
                                    names
                                } else {
                                    ino.file_end.unwrap_or(0)
                                },
                                nbytes: if is_dir { 0 } else { ino.nbytes },
                                nlink: if is_dir { 1 } else { nlink },
                            },
                        )
                    }
                    _ => self.report.err(FindingKind::DanglingInode, loc, msg),
                }
                continue;
            };
            if !mode_valid(ii.mode) {
                let mode = guessed_mode(n, ino, ii.mode, named.get(&n).copied());
                self.report.err_fix(
                    FindingKind::InodeModeBad,
                    *iloc,
                    format!(
                        "inode {n}: mode {:o} has no valid file type (its items say {:o})",
                        ii.mode, mode
                    ),
                    Fix::InodeMode {
                        root: tid,
                        ino: n,
                        mode,
                    },
                );
            }
            if !self.check_inode_fields(tid, n, ii, iloc, &orphans, ino.names) {
                // Unlinked, its deletion pending (perhaps half done): names, sizes and
                // entries are not checked; its extents still are, through the extent tree.
                continue;
            }
            self.check_file_extent_cover(tid, n, ino, ii, iloc);
            for (key, loc, ram, len) in &ino.bad_inline {
                self.report.err_fix(
                    FindingKind::InlineRamBytesMismatch,
                    *loc,
                    format!(
                        "inode {n}: inline extent at {} holds {len} bytes uncompressed but says ram_bytes {ram}",
                        key.offset
                    ),
                    Fix::InlineRamBytes {
                        root: tid,
                        key: *key,
                        ram_bytes: *len,
                    },
                );
            }
            self.check_inode_counts(tid, n, ino, ii, iloc, named.contains_key(&n));
            if ii.mode & 0o170000 == 0o100000 {
                self.note_data_extents(tid, n, ino, ii, iloc, csum);
            }
            self.check_dir_items_indexed(tid, n, ino, &inodes);
            self.check_dir_index_targets(tid, n, ino, &inodes);
            self.check_inode_refs(tid, n, ino, &inodes, &index_of);
        }
    }

    /// Collection phase of [`Self::check_fs_tree`]: one pass over the tree gathering each
    /// inode's items into an [`Ino`] (items that do not decode are reported here) and the
    /// inodes with an ORPHAN_ITEM. `None` when the tree cannot be read at all.
    fn collect_fs_inodes(&mut self, root: Root) -> Option<(BTreeMap<u64, Ino>, HashSet<u64>)> {
        let tid = root.id;
        let ss = self.fs.disk.sectorsize() as u64;
        let mut inodes: BTreeMap<u64, Ino> = BTreeMap::new();
        // Inodes with an ORPHAN_ITEM: unlinked, their deletion pending.
        let mut orphans: HashSet<u64> = HashSet::default();
        let mut it = match TreeIter::new(self.fs.disk.clone(), root, Key::MIN, Readahead::None) {
            Ok(it) => it,
            Err(e) => {
                self.unreadable(e, Some(tid));
                return None;
            }
        };
        loop {
            let item = match it.next_item() {
                Ok(Some(i)) => i,
                Ok(None) => break,
                Err(e) => {
                    self.unreadable(e, Some(tid));
                    break;
                }
            };
            let k = item.key;
            if k.objectid == ORPHAN_OBJECTID && k.ty == ORPHAN_ITEM_KEY {
                orphans.insert(k.offset);
                continue;
            }
            if k.objectid == FREE_INO_OBJECTID && k.ty == INODE_ITEM_KEY {
                self.report.err_fix(
                    FindingKind::FsItemBad,
                    item_loc(&item, tid),
                    format!("tree {tid}: the deprecated free inode cache (inode_cache mount option, removed in Linux 5.11) is still there"),
                    Fix::DropInodeCache { root: tid },
                );
                continue;
            }
            if k.objectid < FIRST_FREE_OBJECTID || k.objectid > LAST_FREE_OBJECTID {
                continue; // free space cache inodes of the root tree, ...
            }
            let loc = Place::of(&item, tid);
            let ino = inodes.entry(k.objectid).or_default();
            if ino.first_loc.is_none() {
                ino.first_loc = Some(loc);
            }
            if let Err(msg) = ino.add_item(k, item.data(), &loc, ss) {
                // A DIR_ITEM that decodes but names what does not hash to its key goes (a
                // name it held that has an INODE_REF is made again from the ref).
                let misfiled = k.ty == DIR_ITEM_KEY && DirItem::parse_all(item.data()).is_ok();
                let fix = misfiled.then_some(Fix::DeleteItem { tree: tid, key: k });
                self.report
                    .err_maybe_fix(FindingKind::FsItemBad, loc, msg, fix);
            }
        }
        Some((inodes, orphans))
    }

    /// The tree's first inode must exist and be a directory.
    fn check_root_dir(&mut self, root: Root, inodes: &BTreeMap<u64, Ino>) {
        let tid = root.id;
        let root_dir_ok = inodes
            .get(&FIRST_FREE_OBJECTID)
            .and_then(|i| i.item.as_ref())
            .is_some_and(|(ii, _)| ii.mode & 0o170000 == 0o040000);
        if !root_dir_ok {
            self.report.err(
                FindingKind::DanglingInode,
                Location {
                    tree: Some(tid),
                    bytenr: Some(root.bytenr),
                    ..Default::default()
                },
                format!("tree {tid}: no root directory (inode {FIRST_FREE_OBJECTID} is missing or not a directory)"),
            );
        }
    }

    /// The inode item's own fields: generations not past the next transaction, no
    /// IMMUTABLE/APPEND on a symlink, a directory's single link, and an ORPHAN_ITEM for an
    /// unlinked inode. Returns false for an unlinked inode, whose other checks are skipped.
    fn check_inode_fields(
        &mut self,
        tid: u64,
        n: u64,
        ii: &InodeItem,
        iloc: &Place,
        orphans: &HashSet<u64>,
        names: u64,
    ) -> bool {
        let gen_limit = self.sb.generation.saturating_add(1);
        let is_dir = ii.mode & 0o170000 == 0o040000;
        let is_lnk = ii.mode & 0o170000 == 0o120000;
        if ii.generation > gen_limit || ii.transid > gen_limit {
            // The damaged one takes the other's value where that one is valid, else the
            // superblock's generation.
            let sb_gen = gen_limit - 1;
            let ok = |g: u64| g <= gen_limit;
            let generation = if ok(ii.generation) {
                ii.generation
            } else if ok(ii.transid) {
                ii.transid
            } else {
                sb_gen
            };
            let transid = if ok(ii.transid) { ii.transid } else { sb_gen };
            self.report.err_fix(
                FindingKind::GenerationInvalid,
                *iloc,
                format!(
                    "inode {n}: generation {} transid {}, but the superblock generation is {sb_gen} (at most one more is valid)",
                    ii.generation,
                    ii.transid,
                ),
                Fix::InodeGenerations {
                    root: tid,
                    ino: n,
                    generation,
                    transid,
                },
            );
        }
        if is_lnk && ii.flags & (INODE_IMMUTABLE | INODE_APPEND) != 0 {
            self.report.err(
                FindingKind::InodeFlagsBad,
                *iloc,
                format!(
                    "inode {n}: a symlink with flags {:#x} (IMMUTABLE/APPEND cannot be set on symlinks)",
                    ii.flags
                ),
            );
        }
        if is_dir && ii.nlink >= 2 {
            self.report.err_fix(
                FindingKind::NlinkMismatch,
                *iloc,
                format!(
                    "directory {n}: nlink {} (a directory has one link)",
                    ii.nlink
                ),
                Fix::InodeNlink {
                    root: tid,
                    ino: n,
                    nlink: 1,
                },
            );
        }
        if ii.nlink == 0 {
            if !orphans.contains(&n) {
                // With names, nlink is what was damaged; without, the inode was unlinked
                // and its ORPHAN_ITEM lost: given one, the next mount frees it.
                let fix = match u32::try_from(names) {
                    Ok(0) => Fix::OrphanItem { root: tid, ino: n },
                    Ok(k) => Fix::InodeNlink {
                        root: tid,
                        ino: n,
                        nlink: if is_dir { 1 } else { k },
                    },
                    Err(_) => Fix::OrphanItem { root: tid, ino: n },
                };
                self.report.err_fix(
                    FindingKind::NlinkMismatch,
                    *iloc,
                    format!("inode {n}: nlink 0 but no ORPHAN_ITEM"),
                    fix,
                );
            }
            return false;
        }
        true
    }

    /// The file extent items of a linked inode: overlaps found while collecting, and (without
    /// NO_HOLES) a file or symlink range up to isize that no item covers.
    fn check_file_extent_cover(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        ii: &InodeItem,
        iloc: &Place,
    ) {
        let no_holes = self.sb.has_incompat(INCOMPAT_NO_HOLES);
        let is_reg = ii.mode & 0o170000 == 0o100000;
        let is_lnk = ii.mode & 0o170000 == 0o120000;
        for (loc, msg) in &ino.overlaps {
            self.report
                .err(FindingKind::FileExtentOverlap, *loc, msg.clone());
        }
        // Without NO_HOLES every byte up to isize has an extent item (holes included).
        if !no_holes && (is_reg || is_lnk) && ii.nlink > 0 && ii.size > 0 {
            let end = ino.file_end.unwrap_or(0);
            // The first range no item covers: [start, end).
            let ss = self.fs.disk.sectorsize() as u64;
            let eof = ii.size.div_ceil(ss).saturating_mul(ss);
            let gap = match (ino.file_start, ino.first_gap, ino.first_gap_end) {
                (None, _, _) => Some((0, eof)),
                (Some(s), _, _) if s != 0 => Some((0, s)),
                (_, Some(g), Some(ge)) if g < ii.size => Some((g, ge)),
                _ => (end < ii.size).then_some((end, eof)),
            };
            if let Some((g, ge)) = gap {
                // The item a data extent's unused back reference gives back where it fits,
                // else a hole (inline data has no room for one).
                let fix = match self.restorable.get(&(tid, n, g)) {
                    Some(f @ Fix::RestoreFileExtent { len, .. }) if g + len <= ge => {
                        Some(f.clone())
                    }
                    _ => (is_reg && ge > g).then_some(Fix::FileExtentHole {
                        root: tid,
                        ino: n,
                        offset: g,
                        len: ge - g,
                    }),
                };
                self.report.err_maybe_fix(
                    FindingKind::FileExtentGap,
                    *iloc,
                    format!(
                        "inode {n}: size {} but no file extent item (not even a hole) covers offset {g}, and the filesystem has no NO_HOLES",
                        ii.size
                    ),
                    fix,
                );
            }
        }
    }

    /// The inode item's counts against its items: nlink against its INODE_REF/EXTREF names,
    /// a directory's isize against its entries' names, a file's or symlink's nbytes against
    /// its extents.
    fn check_inode_counts(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        ii: &InodeItem,
        iloc: &Place,
        named: bool,
    ) {
        let is_dir = ii.mode & 0o170000 == 0o040000;
        let is_reg = ii.mode & 0o170000 == 0o100000;
        // nlink: the subvolume root directory has a ".." ref; directories have nlink 1.
        if ii.nlink as u64 != ino.names {
            let msg = format!(
                "inode {n}: nlink {} but {} INODE_REF/EXTREF names",
                ii.nlink, ino.names
            );
            match u32::try_from(ino.names) {
                // A name count of 0 needs the inode gone or attached: not a field to set.
                Ok(nlink) if nlink > 0 => self.report.err_fix(
                    FindingKind::NlinkMismatch,
                    *iloc,
                    msg,
                    Fix::InodeNlink {
                        root: tid,
                        ino: n,
                        nlink,
                    },
                ),
                // No name and no entry naming it: the inode goes to lost+found.
                Ok(0) if !named && n != FIRST_FREE_OBJECTID => self.report.err_fix(
                    FindingKind::NlinkMismatch,
                    *iloc,
                    msg,
                    Fix::LostAndFound {
                        root: tid,
                        ino: n,
                        file_type: entry_type(n, ino, ii),
                    },
                ),
                _ => self.report.err(FindingKind::NlinkMismatch, *iloc, msg),
            }
        }
        if is_dir {
            let sum: u64 = ino.dir_items.iter().map(|d| d.0.len() as u64).sum::<u64>()
                + ino.dir_index.iter().map(|d| d.1.len() as u64).sum::<u64>();
            if ii.size != sum {
                self.report.err_fix(
                    FindingKind::DirSizeMismatch,
                    *iloc,
                    format!(
                        "directory {n}: isize {} but its DIR_ITEM and DIR_INDEX names total {sum} bytes",
                        ii.size
                    ),
                    Fix::InodeSize {
                        root: tid,
                        ino: n,
                        size: sum,
                    },
                );
            }
        }
        if (is_reg || ii.mode & 0o170000 == 0o120000) && ii.nbytes != ino.nbytes {
            self.report.err_fix(
                FindingKind::NbytesMismatch,
                *iloc,
                format!(
                    "inode {n}: nbytes {} but its extents account for {}",
                    ii.nbytes, ino.nbytes
                ),
                Fix::InodeNbytes {
                    root: tid,
                    ino: n,
                    nbytes: ino.nbytes,
                },
            );
        }
    }

    /// A regular file's data extents: the ranges that must have csums go to `csum`, NODATASUM
    /// ranges to the later check that they have none; a compressed extent in a NODATASUM inode
    /// is reported.
    fn note_data_extents(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        ii: &InodeItem,
        iloc: &Place,
        csum: &mut BTreeMap<(u64, u64), Location>,
    ) {
        let nodatasum = ii.flags & INODE_NODATASUM != 0;
        for (b, l, reg, compressed, foff, floc) in &ino.extents {
            // Compressed data always has csums, whatever the inode's flags say.
            if *reg && (!nodatasum || *compressed) {
                csum.entry((*b, *l)).or_insert_with(|| iloc.into());
            }
            if *reg && nodatasum && !*compressed {
                self.nodatasum.push(NodatasumRange {
                    logical: *b,
                    len: *l,
                    tree: tid,
                    ino: n,
                    file_off: *foff,
                    loc: floc.into(),
                });
            }
            if *compressed && nodatasum {
                self.report.err(
                    FindingKind::FsItemBad,
                    *floc,
                    format!("inode {n}: compressed extent at {b} in a NODATASUM inode (compression needs csums)"),
                );
            }
        }
    }

    /// Each DIR_ITEM of directory `n` has a DIR_INDEX with the same name and target.
    fn check_dir_items_indexed(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        inodes: &BTreeMap<u64, Ino>,
    ) {
        // (name, target) of every DIR_INDEX: one lookup per DIR_ITEM, however large the
        // directory.
        let indexed: HashSet<(&[u8], &Key)> = ino
            .dir_index
            .iter()
            .map(|(_, nm, lk, _, _)| (nm.as_slice(), lk))
            .collect();
        for (name, loc_key, dloc) in &ino.dir_items {
            if !indexed.contains(&(name.as_slice(), loc_key)) {
                // The target's ref gives the index; without one, an item holding only this
                // name goes.
                let fix = dir_entry_fix(tid, n, name, None, loc_key, inodes).or_else(|| {
                    let alone = ino.dir_items.iter().filter(|d| d.2.key == dloc.key).count() == 1;
                    Some(dloc.key)
                        .filter(|_| alone && loc_key.ty == INODE_ITEM_KEY)
                        .map(|key| Fix::DeleteItem { tree: tid, key })
                });
                self.report.err_maybe_fix(
                    FindingKind::DirItemWithoutIndex,
                    *dloc,
                    format!(
                        "directory {n}: DIR_ITEM {:?} -> {loc_key} has no DIR_INDEX",
                        String::from_utf8_lossy(name)
                    ),
                    fix,
                );
            }
        }
    }

    /// Each DIR_INDEX of directory `n` has its DIR_ITEM, and points either at a subvolume whose
    /// tree exists (recorded for the ROOT_REF check) or at an existing inode with a matching
    /// INODE_REF/EXTREF.
    fn check_dir_index_targets(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        inodes: &BTreeMap<u64, Ino>,
    ) {
        let items: HashSet<(&[u8], &Key)> = ino
            .dir_items
            .iter()
            .map(|(nm, lk, _)| (nm.as_slice(), lk))
            .collect();
        for (idx, name, loc_key, dloc, _) in &ino.dir_index {
            let nm = String::from_utf8_lossy(name);
            if !items.contains(&(name.as_slice(), loc_key)) {
                let fix = dir_entry_fix(tid, n, name, Some(*idx), loc_key, inodes).or_else(|| {
                    Some(dloc.key)
                        .filter(|_| loc_key.ty == INODE_ITEM_KEY)
                        .map(|key| Fix::DeleteItem { tree: tid, key })
                });
                self.report.err_maybe_fix(
                    FindingKind::DirIndexWithoutItem,
                    *dloc,
                    format!("directory {n}: DIR_INDEX {idx} {nm:?} -> {loc_key} has no DIR_ITEM"),
                    fix,
                );
            }
            if loc_key.ty == ROOT_ITEM_KEY {
                self.subvol_entries.push(SubvolEntry {
                    tree: tid,
                    dir: n,
                    index: *idx,
                    name: name.clone(),
                    child: loc_key.objectid,
                    loc: dloc.into(),
                });
                // A subvolume entry: the subvolume's tree must exist.
                if !self.trees.iter().any(|r| r.id == loc_key.objectid) {
                    self.report.err(
                        FindingKind::DanglingInode,
                        *dloc,
                        format!(
                            "directory {n}: DIR_INDEX {idx} {nm:?} -> subvolume {}, which has no tree",
                            loc_key.objectid
                        ),
                    );
                }
                continue;
            }
            if loc_key.ty != INODE_ITEM_KEY {
                self.report.err(
                    FindingKind::FsItemBad,
                    *dloc,
                    format!("directory {n}: DIR_INDEX {idx} {nm:?} -> {loc_key}, neither an inode nor a subvolume"),
                );
                continue;
            }
            match inodes.get(&loc_key.objectid) {
                Some(t) if t.item.is_some() => {
                    if !t
                        .refs
                        .iter()
                        .any(|(p, i, nm2, _)| *p == n && i == idx && nm2 == name)
                    {
                        self.report.err_maybe_fix(
                            FindingKind::DirEntryWithoutInodeRef,
                            *dloc,
                            format!("directory {n}: DIR_INDEX {idx} {nm:?} -> inode {}, which has no INODE_REF/EXTREF with that parent, index and name", loc_key.objectid),
                            Some(dloc.key).map(|key| Fix::DeleteItem { tree: tid, key }),
                        );
                    }
                }
                _ => self.report.err(
                    FindingKind::DanglingInode,
                    *dloc,
                    format!(
                        "directory {n}: DIR_INDEX {idx} {nm:?} -> inode {}, which does not exist",
                        loc_key.objectid
                    ),
                ),
            }
        }
    }

    /// Each INODE_REF/EXTREF name of inode `n` has the DIR_INDEX in its parent directory that
    /// points back at it (the ".." ref of a subvolume root directory excepted).
    fn check_inode_refs(
        &mut self,
        tid: u64,
        n: u64,
        ino: &Ino,
        inodes: &BTreeMap<u64, Ino>,
        index_of: &HashSet<(u64, u64, u64, &[u8])>,
    ) {
        for (parent, idx, name, rloc) in &ino.refs {
            if *parent == n {
                continue; // the ".." ref of a subvolume root directory
            }
            let ok = index_of.contains(&(*parent, *idx, n, name.as_slice()));
            if !ok {
                let parent_is_dir = inodes.get(parent).is_some_and(|p| p.item.is_some());
                let kind = if parent_is_dir {
                    FindingKind::InodeRefWithoutDirIndex
                } else {
                    FindingKind::DanglingInode
                };
                let fix =
                    ino.item
                        .as_ref()
                        .filter(|_| parent_is_dir)
                        .map(|(ii, _)| Fix::DirEntry {
                            root: tid,
                            dir: *parent,
                            index: *idx,
                            name: name.clone(),
                            ino: n,
                            file_type: entry_type(n, ino, ii),
                        });
                self.report.err_maybe_fix(
                    kind,
                    *rloc,
                    format!(
                        "inode {n}: ref {:?} in directory {parent} index {idx} has no DIR_INDEX ({parent} DIR_INDEX {idx})",
                        String::from_utf8_lossy(name)
                    ),
                    fix,
                );
            }
        }
    }
}

/// Whether an inode's mode is one a file can have: a valid file type and no bits above it.
fn mode_valid(mode: u32) -> bool {
    mode_to_ft(mode) != FT_UNKNOWN && mode <= 0o177777
}

/// The mode an inode whose mode `mode` is not valid gets: its permission bits, and the type
/// of a directory where it has entries (or is the root directory), else the type a
/// directory entry naming it gives (`entry`), else a regular file's.
fn guessed_mode(n: u64, ino: &Ino, mode: u32, entry: Option<u8>) -> u32 {
    let perm = mode & 0o7777;
    if n == FIRST_FREE_OBJECTID || !ino.dir_items.is_empty() || !ino.dir_index.is_empty() {
        return 0o40000 | perm;
    }
    perm | match entry {
        Some(FT_SYMLINK) => 0o120000,
        Some(FT_CHRDEV) => 0o20000,
        Some(FT_BLKDEV) => 0o60000,
        Some(FT_FIFO) => 0o10000,
        Some(FT_SOCK) => 0o140000,
        _ => 0o100000,
    }
}

/// The directory entry type of inode `n`: its mode's, or where that is not valid, the one
/// [`guessed_mode`] gives it.
fn entry_type(n: u64, ino: &Ino, ii: &InodeItem) -> u8 {
    if mode_valid(ii.mode) {
        mode_to_ft(ii.mode)
    } else {
        mode_to_ft(guessed_mode(n, ino, ii.mode, None))
    }
}

/// [`Fix::DirEntry`] for the entry `name` -> `target` of directory `dir`, when the target
/// inode has an INODE_REF/EXTREF for that name there (at `index`, when given).
fn dir_entry_fix(
    tid: u64,
    dir: u64,
    name: &[u8],
    index: Option<u64>,
    target: &Key,
    inodes: &BTreeMap<u64, Ino>,
) -> Option<Fix> {
    if target.ty != INODE_ITEM_KEY {
        return None;
    }
    let t = inodes.get(&target.objectid)?;
    let (ii, _) = t.item.as_ref()?;
    let (_, idx, _, _) = t
        .refs
        .iter()
        .find(|(p, i, nm, _)| *p == dir && nm == name && index.is_none_or(|x| x == *i))?;
    Some(Fix::DirEntry {
        root: tid,
        dir,
        index: *idx,
        name: name.to_vec(),
        ino: target.objectid,
        file_type: entry_type(target.objectid, t, ii),
    })
}
