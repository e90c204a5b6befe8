//! B-tree search and iteration (read side).
//!
//! A [`Path`] records, for each level from the leaf (0) up to the root, the block and the slot
//! the search went through. [`search_slot`] keeps the classic contract: `Ok(true)` when the key
//! was found (leaf slot points at it), `Ok(false)` when it was not (leaf slot is where it would be
//! inserted, possibly `nritems`), `Err` on I/O or corruption.
//!
//! Bounds against damaged trees: every child must be exactly one level below its parent, so a
//! descent is at most 8 blocks deep and pointer cycles cannot recurse; iteration checks that keys
//! keep increasing across leaves, so a subtree linked twice ends the walk with an error.

pub(crate) mod build;
pub mod cow;
pub mod cow_ctx;
pub mod extent_record;
pub mod ops;
#[cfg(test)]
mod ops_model_tests;

use crate::error::{Error, Location, Result};
use crate::format::*;
use crate::io::device::BlockDevice;
use crate::io::disk_io::{Disk, Expect, Readahead, TreeBlock};
use std::sync::Arc;

/// Where a tree starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Root {
    /// Tree id (root objectid), used as the expected owner and in error messages.
    pub id: u64,
    pub bytenr: u64,
    pub level: u8,
    pub generation: u64,
}

impl Root {
    /// The root tree's root, as superblock `sb` names it.
    pub(crate) fn of_root_tree(sb: &crate::format::superblock::Superblock) -> Root {
        Root {
            id: ROOT_TREE_OBJECTID,
            bytenr: sb.root,
            level: sb.root_level,
            generation: sb.generation,
        }
    }
}

/// The blocks and slots from the root down to a leaf.
#[derive(Debug, Clone)]
pub(crate) struct Path {
    /// `nodes[level] = (block, slot)`; `nodes[0]` is the leaf.
    pub nodes: Vec<(Arc<TreeBlock>, usize)>,
    pub root: Root,
    pub readahead: Readahead,
    last_ra_parent: u64,
}

impl Path {
    pub(crate) fn leaf(&self) -> &Arc<TreeBlock> {
        &self.nodes[0].0
    }
    pub(crate) fn slot(&self) -> usize {
        self.nodes[0].1
    }
    /// The item the path points at, if the slot is inside the leaf.
    pub(crate) fn item(&self) -> Option<ItemRef> {
        let (b, s) = &self.nodes[0];
        (*s < b.nritems()).then(|| ItemRef {
            key: b.key(*s),
            block: b.clone(),
            slot: *s,
        })
    }
}

/// A leaf item: the block that holds it and its slot.
#[derive(Debug, Clone)]
pub(crate) struct ItemRef {
    pub key: Key,
    pub block: Arc<TreeBlock>,
    pub slot: usize,
}

impl ItemRef {
    pub(crate) fn data(&self) -> &[u8] {
        self.block.item_data(self.slot)
    }
    pub(crate) fn loc(&self) -> Location {
        self.block.loc(Some(self.slot))
    }
    /// Adds this item's location to a corruption error from an item decoder. An error that
    /// already names a tree block (raised while reading another block on behalf of this item,
    /// e.g. a csum tree leaf during a file read) keeps its own location.
    pub(crate) fn annotate(&self, e: Error) -> Error {
        match e {
            Error::Corrupt { loc, reason } if loc.bytenr.is_none() => {
                let what = loc.what.clone();
                let mut l = self.loc();
                l.what = what;
                Error::Corrupt {
                    loc: Box::new(l),
                    reason,
                }
            }
            // "unsupported: compression 7" alone does not say which file extent it is.
            Error::Unsupported(m) => Error::Unsupported(format!("{m} ({})", self.loc())),
            e => e,
        }
    }
}

/// Index of the last key `<= key` in a node (0 if `key` is smaller than every key).
pub(crate) fn node_slot(b: &TreeBlock, key: &Key) -> usize {
    let (mut lo, mut hi) = (0usize, b.nritems());
    while lo < hi {
        let mid = (lo + hi) / 2;
        if b.key(mid) <= *key {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo.saturating_sub(1)
}

/// Leaf binary search: (found, slot), the slot where `key` is or would be inserted.
pub(crate) fn leaf_slot(b: &TreeBlock, key: &Key) -> (bool, usize) {
    let (mut lo, mut hi) = (0usize, b.nritems());
    while lo < hi {
        let mid = (lo + hi) / 2;
        match b.key(mid).cmp(key) {
            std::cmp::Ordering::Less => lo = mid + 1,
            std::cmp::Ordering::Greater => hi = mid,
            std::cmp::Ordering::Equal => return (true, mid),
        }
    }
    (false, lo)
}

fn child_expect(root: &Root, parent: &TreeBlock, slot: usize) -> (u64, Expect) {
    let p = parent.ptr(slot);
    (
        p.blockptr,
        Expect {
            owner: Some(root.id),
            level: Some(parent.level() - 1),
            generation: Some(p.generation),
            first_key: Some(p.key),
        },
    )
}

/// Checks that a block's keys stay below `upper`, the key its parent (or the nearest ancestor
/// with a next slot) gives the next block: a pointer to a block of another part of the tree
/// (linked twice, or out of order) breaks it even when the first key matches.
fn check_upper(root: &Root, b: &TreeBlock, upper: Option<Key>) -> Result<()> {
    let (Some(upper), Some(last)) = (upper, b.nritems().checked_sub(1)) else {
        return Ok(());
    };
    let k = b.key(last);
    if k >= upper {
        return Err(Error::corrupt(
            Location::block(Some(root.id), b.bytenr),
            format!(
                "keys reach {k}, not below {upper}, the key the parent gives the next block \
                 (tree blocks linked out of order or twice)"
            ),
        ));
    }
    Ok(())
}

/// The upper bound of a child, from the path's (block, slot) pairs from its parent upward:
/// the key after the slot of the first of them that has one.
fn upper_of<'a>(mut above: impl Iterator<Item = &'a (Arc<TreeBlock>, usize)>) -> Option<Key> {
    above
        .find(|(b, s)| s + 1 < b.nritems())
        .map(|(b, s)| b.key(s + 1))
}

fn read_root(disk: &Disk, root: &Root) -> Result<Arc<TreeBlock>> {
    if root.level >= MAX_LEVEL {
        return Err(Error::corrupt(
            Location::block(Some(root.id), root.bytenr),
            format!("root level {}", root.level),
        ));
    }
    disk.read_tree_block(
        root.bytenr,
        &Expect {
            owner: Some(root.id),
            level: Some(root.level),
            generation: Some(root.generation),
            first_key: None,
        },
    )
}

/// Searches `root` for `key`. See the module docs for the return contract.
pub(crate) fn search_slot(
    disk: &Arc<Disk>,
    root: &Root,
    key: &Key,
    ra: Readahead,
) -> Result<(Path, bool)> {
    let mut block = read_root(disk, root)?;
    let mut nodes: Vec<Option<(Arc<TreeBlock>, usize)>> = vec![None; root.level as usize + 1];
    loop {
        let level = block.level() as usize;
        if block.is_leaf() {
            let (found, slot) = leaf_slot(&block, key);
            nodes[0] = Some((block, slot));
            let nodes = nodes
                .into_iter()
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| {
                    Error::corrupt(
                        Location::block(Some(root.id), root.bytenr),
                        "tree levels are not contiguous",
                    )
                })?;
            return Ok((
                Path {
                    nodes,
                    root: *root,
                    readahead: ra,
                    last_ra_parent: 0,
                },
                found,
            ));
        }
        let slot = node_slot(&block, key);
        let (child, expect) = child_expect(root, &block, slot);
        nodes[level] = Some((block.clone(), slot));
        let upper = upper_of(nodes[level..].iter().flatten());
        block = disk.read_tree_block(child, &expect)?;
        check_upper(root, &block, upper)?;
    }
}

/// Issues readahead for the path's level-1 parent according to the mode.
fn do_readahead(disk: &Arc<Disk>, path: &mut Path, leaf_was_cached: bool) {
    if path.nodes.len() < 2 {
        return;
    }
    let mode = path.readahead;
    let (parent, slot) = &path.nodes[1];
    match mode {
        // Back reads ahead in prev_leaf.
        Readahead::None | Readahead::Back => {}
        Readahead::Forward => {
            // Only when we had to go to disk, and only for nearby leaves.
            if leaf_was_cached || path.last_ra_parent == parent.bytenr {
                return;
            }
            let cur = parent.ptr(*slot).blockptr;
            let mut list = Vec::new();
            for s in slot + 1..parent.nritems() {
                let (b, e) = child_expect(&path.root, parent, s);
                if b.abs_diff(cur) > 1 << 20 || list.len() >= 16 {
                    break;
                }
                list.push((b, e));
            }
            path.last_ra_parent = parent.bytenr;
            disk.readahead(&list);
        }
        Readahead::ForwardAlways => {
            // Every remaining sibling leaf regardless of distance or cache state, plus the next
            // node one level up (one at a time), so a whole-tree walk never waits on a read.
            if path.last_ra_parent == parent.bytenr {
                return;
            }
            let mut list: Vec<_> = (slot + 1..parent.nritems())
                .map(|s| child_expect(&path.root, parent, s))
                .collect();
            for lvl in 2..path.nodes.len() {
                let (n, s) = &path.nodes[lvl];
                if s + 1 < n.nritems() {
                    list.push(child_expect(&path.root, n, s + 1));
                    break;
                }
            }
            path.last_ra_parent = parent.bytenr;
            disk.readahead(&list);
        }
    }
}

/// Moves the path to the first slot of the next leaf. Returns false at the end of the tree.
pub(crate) fn next_leaf(disk: &Arc<Disk>, path: &mut Path) -> Result<bool> {
    let mut level = 1;
    while level < path.nodes.len() {
        let (b, s) = &path.nodes[level];
        if s + 1 < b.nritems() {
            break;
        }
        level += 1;
    }
    if level >= path.nodes.len() {
        return Ok(false);
    }
    path.nodes[level].1 += 1;
    let mut cached = true;
    while level > 0 {
        let (parent, slot) = path.nodes[level].clone();
        let (child, expect) = child_expect(&path.root, &parent, slot);
        cached &= disk.is_cached(child);
        let b = disk.read_tree_block(child, &expect)?;
        check_upper(&path.root, &b, upper_of(path.nodes[level..].iter()))?;
        level -= 1;
        path.nodes[level] = (b, 0);
    }
    do_readahead(disk, path, cached);
    Ok(true)
}

/// Moves the path to the last slot of the previous leaf. Returns false at the start.
pub(crate) fn prev_leaf(disk: &Arc<Disk>, path: &mut Path) -> Result<bool> {
    let mut level = 1;
    while level < path.nodes.len() && path.nodes[level].1 == 0 {
        level += 1;
    }
    if level >= path.nodes.len() {
        return Ok(false);
    }
    path.nodes[level].1 -= 1;
    while level > 0 {
        let (parent, slot) = path.nodes[level].clone();
        let (child, expect) = child_expect(&path.root, &parent, slot);
        let b = disk.read_tree_block(child, &expect)?;
        check_upper(&path.root, &b, upper_of(path.nodes[level..].iter()))?;
        level -= 1;
        let last = b.nritems().saturating_sub(1);
        path.nodes[level] = (b, last);
    }
    if path.readahead == Readahead::Back && path.nodes.len() > 1 {
        // Walking backwards: queue the preceding nearby siblings of the new leaf.
        let (parent, slot) = &path.nodes[1];
        if path.last_ra_parent != parent.bytenr {
            let cur = parent.ptr(*slot).blockptr;
            let list: Vec<_> = (0..*slot)
                .rev()
                .map(|s| child_expect(&path.root, parent, s))
                .take_while(|(b, _)| b.abs_diff(cur) <= 1 << 20)
                .take(16)
                .collect();
            path.last_ra_parent = parent.bytenr;
            disk.readahead(&list);
        }
    }
    Ok(true)
}

/// Advances to the next item (across leaves). Returns false at the end of the tree.
pub(crate) fn next_item(disk: &Arc<Disk>, path: &mut Path) -> Result<bool> {
    path.nodes[0].1 += 1;
    while path.nodes[0].1 >= path.nodes[0].0.nritems() {
        if !next_leaf(disk, path)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Steps to the previous item (across leaves). Returns false at the start of the tree.
pub(crate) fn prev_item(disk: &Arc<Disk>, path: &mut Path) -> Result<bool> {
    loop {
        if path.nodes[0].1 > 0 {
            path.nodes[0].1 -= 1;
            if path.nodes[0].1 < path.nodes[0].0.nritems() {
                return Ok(true);
            }
            continue;
        }
        if !prev_leaf(disk, path)? {
            return Ok(false);
        }
        if path.nodes[0].0.nritems() > 0 {
            return Ok(true);
        }
    }
}

/// Exact lookup of one item.
pub(crate) fn lookup(disk: &Arc<Disk>, root: &Root, key: &Key) -> Result<Option<ItemRef>> {
    let (path, found) = search_slot(disk, root, key, Readahead::None)?;
    Ok(if found { path.item() } else { None })
}

/// The item with the greatest key `<= key`, if any.
pub(crate) fn lookup_le(disk: &Arc<Disk>, root: &Root, key: &Key) -> Result<Option<ItemRef>> {
    let (mut path, found) = search_slot(disk, root, key, Readahead::None)?;
    if found {
        return Ok(path.item());
    }
    if prev_item(disk, &mut path)? {
        Ok(path.item())
    } else {
        Ok(None)
    }
}

/// Iterates items in key order from a start key, checking keys strictly increase.
pub(crate) struct TreeIter {
    disk: Arc<Disk>,
    path: Option<Path>,
    started: bool,
    last: Option<Key>,
    end: Key,
}

impl TreeIter {
    /// Iterates every item with key >= `start`.
    pub(crate) fn new(disk: Arc<Disk>, root: Root, start: Key, ra: Readahead) -> Result<TreeIter> {
        Self::range(disk, root, start, Key::MAX, ra)
    }

    /// Iterates items with `start <= key <= end` (both inclusive).
    pub(crate) fn range(
        disk: Arc<Disk>,
        root: Root,
        start: Key,
        end: Key,
        ra: Readahead,
    ) -> Result<TreeIter> {
        let (mut path, _) = search_slot(&disk, &root, &start, ra)?;
        // A whole-tree walk starts reading ahead at once; short range reads (one inode's items)
        // only read ahead when they cross into a leaf that had to come from disk.
        if ra == Readahead::ForwardAlways {
            do_readahead(&disk, &mut path, false);
        }
        Ok(TreeIter {
            disk,
            path: Some(path),
            started: false,
            last: None,
            end,
        })
    }

    /// The blocks from the root down to the leaf of the item [`TreeIter::next_item`] gave
    /// last (None once the iteration ended).
    pub(crate) fn path(&self) -> Option<&Path> {
        self.path.as_ref()
    }

    pub(crate) fn next_item(&mut self) -> Result<Option<ItemRef>> {
        let Some(path) = self.path.as_mut() else {
            return Ok(None);
        };
        let more = if !self.started {
            self.started = true;
            if path.slot() < path.leaf().nritems() {
                true
            } else {
                path.nodes[0].1 = path.leaf().nritems().saturating_sub(1);
                if path.leaf().nritems() == 0 {
                    next_leaf(&self.disk, path)? && {
                        while path.leaf().nritems() == 0 {
                            if !next_leaf(&self.disk, path)? {
                                self.path = None;
                                return Ok(None);
                            }
                        }
                        true
                    }
                } else {
                    next_item(&self.disk, path)?
                }
            }
        } else {
            next_item(&self.disk, path)?
        };
        if !more {
            self.path = None;
            return Ok(None);
        }
        let Some(item) = path.item() else {
            self.path = None;
            return Ok(None);
        };
        if item.key > self.end {
            self.path = None;
            return Ok(None);
        }
        if let Some(last) = self.last {
            if item.key <= last {
                let e = Error::corrupt(
                    item.loc(),
                    format!("key does not follow previous key {last} (tree blocks linked out of order or twice)"),
                );
                self.path = None;
                return Err(e);
            }
        }
        self.last = Some(item.key);
        Ok(Some(item))
    }
}

/// Opens the metadata layer of a device: the superblock, then the chunk tree (through the
/// system chunks the superblock carries), so that every logical address maps.
#[cfg(any(test, feature = "internals"))]
pub(crate) fn open_disk(dev: Arc<dyn BlockDevice>) -> Result<Arc<Disk>> {
    open_disk_set(vec![("the image".to_string(), dev)], false)
}

/// [`open_disk`] over the devices of a filesystem of one or more (each named for messages,
/// the image named first): every device the chunk tree names must be given, unless
/// `degraded`; then the missing ones are kept as missing and reads rebuild or use other
/// copies where the profiles allow.
pub(crate) fn open_disk_set(
    given: Vec<(String, Arc<dyn BlockDevice>)>,
    degraded: bool,
) -> Result<Arc<Disk>> {
    open_disk_set_with(given, degraded, false)
}

/// [`open_disk_set`]; `any_count`: a superblock num_devices other than the number of devices
/// the chunk tree lists is let through, when every listed device is given (for a repair,
/// which mends the count).
pub(crate) fn open_disk_set_with(
    given: Vec<(String, Arc<dyn BlockDevice>)>,
    degraded: bool,
    any_count: bool,
) -> Result<Arc<Disk>> {
    let disk = Disk::open_sys_chunks(given)?;
    if let Err(e) = load_chunk_tree(&disk) {
        let (have, want) = (disk.devices.len() as u64, disk.sb.num_devices);
        if have < want && !degraded {
            // The chunk tree lives (partly) on devices not given: say that, not the read.
            return Err(Error::NotFound(format!(
                "the filesystem has {want} devices and {} {} missing (the chunk tree cannot \
                 be read without them: {e}); give the others with --device PATH (-o \
                 device=PATH when mounting), or open it degraded with --degraded (-o degraded)",
                want - have,
                if want - have == 1 { "is" } else { "are" },
            )));
        }
        return Err(e);
    }
    match_dev_items(disk, degraded, any_count)
}

/// Matches the devices given against the chunk tree's DEV_ITEMs: each given device must be
/// one of them (by devid and device UUID); one not given is missing, an error unless
/// `degraded`. A degraded open names the chunks that lost data. Returns the disk with the
/// missing devices in its set.
fn match_dev_items(disk: Arc<Disk>, degraded: bool, any_count: bool) -> Result<Arc<Disk>> {
    if disk.devices.len() == 1 && disk.sb.num_devices == 1 {
        // One device of a filesystem of one: nothing to match (a damaged device item is the
        // checker's to report).
        return Ok(disk);
    }
    let root = Root {
        id: CHUNK_TREE_OBJECTID,
        bytenr: disk.sb.chunk_root,
        level: disk.sb.chunk_root_level,
        generation: disk.sb.chunk_root_generation,
    };
    let mut items = Vec::new();
    let mut it = TreeIter::new(
        disk.clone(),
        root,
        Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, 0),
        Readahead::None,
    )?;
    while let Some(item) = it.next_item()? {
        if item.key.objectid != DEV_ITEMS_OBJECTID || item.key.ty != DEV_ITEM_KEY {
            break;
        }
        let d =
            crate::format::superblock::DevItem::parse(item.data()).map_err(|e| item.annotate(e))?;
        items.push(d);
    }
    drop(it);
    let all_given = items.len() == disk.devices.len();
    if items.len() as u64 != disk.sb.num_devices && !(any_count && all_given) {
        // The kernel refuses this mismatch too.
        return Err(Error::corrupt(
            Location::what("superblock"),
            format!(
                "num_devices says the filesystem has {} devices, but the chunk tree lists {}",
                disk.sb.num_devices,
                items.len()
            ),
        ));
    }
    let devices = disk.devices.clone();
    for m in disk.devices.members() {
        match items.iter().find(|d| d.devid == m.devid) {
            None => {
                return Err(Error::Invalid(format!(
                    "{} says it is device {} of the filesystem, which has no such device \
                     (it was removed from it); leave it out",
                    m.name, m.devid
                )))
            }
            Some(d) if d.uuid != m.uuid => {
                return Err(Error::Invalid(format!(
                    "{} says it is device {} (uuid {}), but the filesystem's device {} is uuid {} \
                     (it was replaced); give the device that replaced it",
                    m.name,
                    m.devid,
                    fmt_uuid(&m.uuid),
                    d.devid,
                    fmt_uuid(&d.uuid)
                )))
            }
            Some(_) => {}
        }
    }
    let missing: Vec<&crate::format::superblock::DevItem> = items
        .iter()
        .filter(|d| disk.devices.member(d.devid).is_none())
        .collect();
    if missing.is_empty() {
        return Ok(disk);
    }
    let names: Vec<String> = missing
        .iter()
        .map(|d| format!("device {} (uuid {})", d.devid, fmt_uuid(&d.uuid)))
        .collect();
    if !degraded {
        return Err(Error::NotFound(format!(
            "the filesystem has {} devices and {} {} missing: {}; give the others with \
             --device PATH (-o device=PATH when mounting), or open it degraded with \
             --degraded (-o degraded)",
            items.len(),
            missing.len(),
            if missing.len() == 1 { "is" } else { "are" },
            names.join(", ")
        )));
    }
    log::warn!("opening degraded: missing {}", names.join(", "));
    for d in &missing {
        devices.insert(crate::io::volumes::Member {
            devid: d.devid,
            uuid: d.uuid,
            name: format!("missing device {}", d.devid),
            dev: None,
            failed: Default::default(),
        });
    }
    let lost = crate::io::volumes::chunks_beyond_repair(&disk.chunk_map(), &devices);
    if !lost.is_empty() {
        log::warn!(
            "{} chunks lost more stripes than their profile can rebuild (the first at logical {}): \
             what they hold cannot be read",
            lost.len(),
            lost[0]
        );
    }
    Ok(disk.with_devices(devices))
}

/// The metadata layer of `running` as superblock `sb` (not yet written) describes it: the
/// same devices, `sb`'s roots, and the blocks `running`'s transaction changed read from its
/// overlay (nothing of them need be written yet).
pub(crate) fn open_disk_as(
    running: &Disk,
    sb: crate::format::superblock::Superblock,
) -> Result<Arc<Disk>> {
    let disk = Disk::assemble(running.devices.clone(), sb)?;
    disk.overlay_share(running);
    load_chunk_tree(&disk)?;
    Ok(disk)
}

/// Reads every CHUNK_ITEM of the chunk tree into the disk's chunk map.
fn load_chunk_tree(disk: &Arc<Disk>) -> Result<()> {
    let root = Root {
        id: CHUNK_TREE_OBJECTID,
        bytenr: disk.sb.chunk_root,
        level: disk.sb.chunk_root_level,
        generation: disk.sb.chunk_root_generation,
    };
    let mut found = Vec::new();
    let mut it = TreeIter::new(
        disk.clone(),
        root,
        Key::new(FIRST_CHUNK_TREE_OBJECTID, CHUNK_ITEM_KEY, 0),
        Readahead::Forward,
    )?;
    while let Some(item) = it.next_item()? {
        if item.key.ty != CHUNK_ITEM_KEY {
            continue;
        }
        let (chunk, _) =
            crate::format::items::ChunkItem::parse(item.data()).map_err(|e| item.annotate(e))?;
        found.push((item.key, chunk, item.loc()));
    }
    for (key, chunk, loc) in found {
        disk.insert_chunk(key.offset, chunk)
            .map_err(|r| Error::corrupt(loc, r))?;
    }
    Ok(())
}
