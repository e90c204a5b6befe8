//! `butter check --repair`: the checker's [`Fix`]es applied in one copy-on-write transaction,
//! committed only when the checker, run again on the new trees (still in memory) before
//! anything is written, finds strictly fewer problems and none it did not find before.
//! Otherwise nothing is written: the image stays exactly as it was.

use super::{ExtentRef, Finding, Fix, Report};
use crate::error::{Error, Result};
use crate::format::items::InodeItem;
use crate::format::*;
use crate::inode::core::Core;

/// The fixes `report` offers, each once, in the order found.
pub(crate) fn plan(report: &Report) -> Vec<Fix> {
    let mut out: Vec<Fix> = Vec::new();
    for f in report.findings.iter().filter_map(|f| f.fix.as_ref()) {
        if !out.contains(f) {
            out.push(f.clone());
        }
    }
    // Blocks mended first, alone: what the checker could not read hides what they hold,
    // so the other fixes are planned again in the next round, from the whole trees.
    if out.iter().any(|f| matches!(f, Fix::MendBlock { .. })) {
        out.retain(|f| matches!(f, Fix::MendBlock { .. }));
    }
    // A block that can be neither read nor mended may hold what the other fixes would
    // change or free (its children, the data its items name, the names and extents that
    // make other items look wrong): nothing is changed around it.
    if out.is_empty() || out.iter().any(|f| matches!(f, Fix::MendBlock { .. })) {
        return out;
    }
    if unreadable_block(report).is_some() {
        out.clear();
    }
    out
}

/// A tree block the checker could neither read nor mend, if any: while one is there the
/// repair changes nothing (see [`plan`]).
pub(crate) fn unreadable_block(report: &Report) -> Option<&Finding> {
    let mendable: std::collections::HashSet<u64> = report
        .findings
        .iter()
        .filter_map(|f| match f.fix {
            Some(Fix::MendBlock { bytenr, .. }) => Some(bytenr),
            _ => None,
        })
        .collect();
    report.findings.iter().find(|f| {
        f.kind == super::FindingKind::TreeBlockUnreadable
            && f.severity != super::Severity::Warning
            && !f.location.bytenr.is_some_and(|b| mendable.contains(&b))
    })
}

/// Applies `fixes` in the running transaction of `core` (open read-write, untouched since it
/// was opened). Block group counts go first, before any tree changes allocate.
pub(crate) fn apply(core: &Core, fixes: &[Fix]) -> Result<()> {
    // Extents the trees use but the extent tree lacks may look free to the allocator (where
    // free space is computed from the extent tree): taken out before anything is allocated.
    core.op(false, |w| {
        for f in fixes {
            if let Fix::ExtentRefs {
                bytenr, len, refs, ..
            } = f
            {
                if !refs.is_empty() {
                    w.allocator.reserve(*bytenr, *len);
                }
            }
        }
        Ok(())
    })?;
    touch_root_tree(core)?;
    core.op(false, |w| {
        let mut groups = false;
        for f in fixes {
            match f {
                Fix::BlockGroupUsed { start, used } => {
                    let mut found = false;
                    w.allocator.for_each(|g| {
                        if g.start == *start {
                            g.used = *used;
                            g.dirty = true;
                            found = true;
                        }
                    });
                    if !found {
                        return Err(Error::NotFound(format!("block group {start}")));
                    }
                    groups = true;
                }
                Fix::SuperBytesUsed => groups = true,
                Fix::NumDevices { count } => w.sb.num_devices = *count,
                Fix::DeviceSizes => {
                    align_device_sizes(w)?;
                }
                Fix::DevBytesUsed { devid, used } => {
                    let Some(item) = w.dev_items.get_mut(devid) else {
                        return Err(Error::NotFound(format!("device {devid}")));
                    };
                    item.bytes_used = *used;
                    let body = item.to_bytes();
                    w.replace_item(
                        CHUNK_TREE_OBJECTID,
                        Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, *devid),
                        &body,
                    )?;
                }
                Fix::RootBlock {
                    root,
                    bytenr,
                    level,
                    generation,
                } => w.replace_root(*root, *bytenr, *level, *generation)?,
                Fix::RootGeneration { root, generation } => {
                    let t = w.current_root(*root)?;
                    w.replace_root(*root, t.bytenr, t.level, *generation)?;
                }
                // refs (8 bytes), then the generation.
                Fix::ExtentGeneration { key, generation } => {
                    edit_item(w, EXTENT_TREE_OBJECTID, key, |b| put_u64(b, 8, *generation))?
                }
                _ => {}
            }
        }
        if groups {
            // The superblock's count follows the groups' (as the commit keeps it from here).
            let mut total = 0u64;
            w.allocator
                .for_each(|g| total = total.saturating_add(g.used));
            w.sb_bytes_used = total;
        }
        Ok(())
    })?;
    // Stray items go before entries are made (one may take a wrong entry's key).
    let (deletes, rest): (Vec<&Fix>, Vec<&Fix>) = fixes
        .iter()
        .partition(|f| matches!(f, Fix::DeleteItem { .. }));
    for f in deletes.into_iter().chain(rest) {
        match *f {
            Fix::DirEntry {
                root,
                dir,
                index,
                ref name,
                ino,
                file_type,
            } => core.op(false, |w| {
                restore_dir_entry(w, root, dir, index, name, ino, file_type)
            })?,
            Fix::LostAndFound {
                root,
                ino,
                file_type,
            } => to_lost_and_found(core, root, ino, file_type)?,
            Fix::DropInodeCache { root } => core.op(false, |w| drop_inode_cache(w, root))?,
            Fix::RootRef {
                parent,
                child,
                dirid,
                sequence,
                ref name,
                backref,
            } => core.op(false, |w| {
                let body = crate::format::items::RootRef {
                    dirid,
                    sequence,
                    name: name.clone(),
                }
                .to_bytes();
                let key = if backref {
                    Key::new(child, ROOT_BACKREF_KEY, parent)
                } else {
                    Key::new(parent, ROOT_REF_KEY, child)
                };
                w.replace_item(ROOT_TREE_OBJECTID, key, &body)
            })?,
            Fix::MendBlock {
                tree,
                bytenr,
                level,
                generation,
                key,
            } => core.op(false, |w| {
                let expect = crate::io::disk_io::Expect {
                    owner: None,
                    level: Some(level),
                    generation,
                    first_key: None,
                };
                let Some(m) = w.disk.mend_tree_block(bytenr, &expect) else {
                    return Err(Error::Invalid(format!(
                        "tree block {bytenr} cannot be mended"
                    )));
                };
                w.disk
                    .cache_put(crate::io::disk_io::TreeBlock::from_parts(bytenr, m));
                // Rewriting the first item below it as it is copies the path through it
                // into blocks of this transaction.
                let body = w.read_item(tree, &key)?.ok_or_else(|| {
                    Error::NotFound(format!("item {key} of tree {tree} below block {bytenr}"))
                })?;
                w.replace_item(tree, key, &body)
            })?,
            Fix::DevExtent {
                devid,
                offset,
                chunk_offset,
                length,
            } => core.op(false, |w| {
                let body = crate::format::items::DevExtent {
                    chunk_tree: CHUNK_TREE_OBJECTID,
                    chunk_objectid: FIRST_CHUNK_TREE_OBJECTID,
                    chunk_offset,
                    length,
                    chunk_tree_uuid: w.chunk_tree_uuid,
                }
                .to_bytes();
                w.replace_item(
                    DEV_TREE_OBJECTID,
                    Key::new(devid, DEV_EXTENT_KEY, offset),
                    &body,
                )
            })?,
            Fix::OrphanItem { root, ino } => core.op(false, |w| {
                w.insert_item(root, Key::new(ORPHAN_OBJECTID, ORPHAN_ITEM_KEY, ino), &[])
            })?,
            Fix::CopyRootBlock { root } => core.op(false, |w| {
                // Rewriting the tree's first item as it is copies the path to it, the root
                // block first, into blocks of this transaction.
                let t = w.current_root(root)?;
                let first = crate::ctree::TreeIter::new(
                    w.disk.clone(),
                    t,
                    Key::MIN,
                    crate::io::disk_io::Readahead::None,
                )?
                .next_item()?
                .map(|i| i.key);
                let Some(key) = first else {
                    return Err(Error::NotFound(format!("an item in tree {root}")));
                };
                w.copy_future_blocks = true;
                let r = edit_item(w, root, &key, |_| Ok(()));
                w.copy_future_blocks = false;
                r
            })?,
            // disk_bytenr: byte 21 of a regular file extent item.
            Fix::FileExtentBytenr { root, key, bytenr } => core.op(false, |w| {
                edit_item(w, root, &key, |b| put_u64(b, 21, bytenr))
            })?,
            Fix::RestoreFileExtent {
                root,
                ino,
                offset,
                bytenr,
                len,
            } => core.op(false, |w| {
                insert_file_extent(w, root, ino, offset, bytenr, len, len)
            })?,
            Fix::FileExtentHole {
                root,
                ino,
                offset,
                len,
            } => core.op(false, |w| {
                insert_file_extent(w, root, ino, offset, 0, 0, len)
            })?,
            Fix::InodeNlink { root, ino, nlink } => {
                set_inode(core, root, ino, |i| i.nlink = nlink)?
            }
            Fix::InodeSize { root, ino, size } => set_inode(core, root, ino, |i| i.size = size)?,
            Fix::InodeNbytes { root, ino, nbytes } => {
                set_inode(core, root, ino, |i| i.nbytes = nbytes)?
            }
            Fix::InodeMode { root, ino, mode } => set_inode(core, root, ino, |i| i.mode = mode)?,
            Fix::MetadataLevel { key, level } => core.op(false, |w| {
                if key.ty == METADATA_ITEM_KEY {
                    // A skinny item's level is its key's offset: the item moves.
                    let root = w.current_root(EXTENT_TREE_OBJECTID)?;
                    let Some(it) = crate::ctree::lookup(&w.disk, &root, &key)? else {
                        return Err(Error::NotFound(format!("extent item {key}")));
                    };
                    let body = it.data().to_vec();
                    drop(it);
                    w.delete_item(EXTENT_TREE_OBJECTID, &key)?;
                    w.insert_item(
                        EXTENT_TREE_OBJECTID,
                        Key::new(key.objectid, METADATA_ITEM_KEY, u64::from(level)),
                        &body,
                    )?;
                    return Ok(());
                }
                // refs, generation, flags (24 bytes), the first key (17), then the level.
                edit_item(w, EXTENT_TREE_OBJECTID, &key, |b| match b.get_mut(41) {
                    Some(l) => {
                        *l = level;
                        Ok(())
                    }
                    None => Err(Error::Invalid(format!("extent item {key} has no level"))),
                })
            })?,
            Fix::SortInlineRefs { key } => core.op(false, |w| {
                edit_item(w, EXTENT_TREE_OBJECTID, &key, |b| {
                    let mut ei = crate::format::items::ExtentItem::parse(b, key.ty)?;
                    ei.inline_refs
                        .sort_by_key(|r| (r.type_key(), std::cmp::Reverse(r.key_offset())));
                    put_same_size(b, &ei.to_bytes())
                })
            })?,
            Fix::RecreateInode {
                root,
                ino,
                mode,
                size,
                nbytes,
                nlink,
            } => core.op(false, |w| {
                let now = crate::format::items::Timespec::now();
                let item = InodeItem {
                    generation: w.transid,
                    transid: w.transid,
                    size,
                    nbytes,
                    nlink,
                    mode,
                    atime: now,
                    ctime: now,
                    mtime: now,
                    otime: now,
                    ..Default::default()
                };
                w.insert_item(root, Key::new(ino, INODE_ITEM_KEY, 0), &item.to_bytes())?;
                Ok(())
            })?,
            Fix::ExtentRefs {
                bytenr,
                len,
                level,
                ref refs,
            } => core.op(false, |w| set_extent_refs(w, bytenr, len, level, refs))?,
            Fix::DeleteItem { tree, key } => core.op(false, |w| {
                w.delete_item(tree, &key)?;
                Ok(())
            })?,
            Fix::InodeGenerations {
                root,
                ino,
                generation,
                transid,
            } => set_inode(core, root, ino, |i| {
                i.generation = generation;
                i.transid = transid;
            })?,
            Fix::InlineRamBytes {
                root,
                key,
                ram_bytes,
            } => core.op(false, |w| {
                // generation (8 bytes), then ram_bytes.
                edit_item(w, root, &key, |b| put_u64(b, 8, ram_bytes))
            })?,
            Fix::BlockGroupUsed { .. }
            | Fix::QgroupsInconsistent
            | Fix::SuperBytesUsed
            | Fix::DeviceSizes
            | Fix::DevBytesUsed { .. }
            | Fix::RootGeneration { .. }
            | Fix::RootBlock { .. }
            | Fix::NumDevices { .. }
            | Fix::ExtentGeneration { .. } => {}
        }
    }
    Ok(())
}

/// Makes directory `dir`'s DIR_INDEX at `index` and its DIR_ITEM hold the entry `name` ->
/// inode `ino` (see [`Fix::DirEntry`]): a wrong index entry is replaced, a DIR_ITEM of other
/// names that hash alike gets this one beside them.
fn restore_dir_entry(
    w: &mut crate::transaction::Writer,
    root: u64,
    dir: u64,
    index: u64,
    name: &[u8],
    ino: u64,
    file_type: u8,
) -> Result<()> {
    use crate::format::items::DirItem;
    let entry = DirItem {
        location: Key::new(ino, INODE_ITEM_KEY, 0),
        transid: w.transid,
        file_type,
        name: name.to_vec(),
        data: Vec::new(),
    };
    let same = |d: &DirItem| d.name == name && d.location == entry.location;
    let ik = Key::new(dir, DIR_INDEX_KEY, index);
    match w.read_item(root, &ik)? {
        Some(b) if DirItem::parse_all(&b).is_ok_and(|v| v.len() == 1 && same(&v[0])) => {}
        _ => w.replace_item(root, ik, &entry.to_bytes())?,
    }
    let dk = Key::new(dir, DIR_ITEM_KEY, crate::format::hash::name_hash(name));
    let body = match w.read_item(root, &dk)? {
        None => entry.to_bytes(),
        Some(b) => match DirItem::parse_all(&b) {
            Ok(v) if v.iter().any(same) => return Ok(()),
            Ok(_) => {
                let mut b = b;
                entry.write(&mut b);
                b
            }
            Err(_) => entry.to_bytes(),
        },
    };
    w.replace_item(root, dk, &body)
}

/// Deletes tree `root`'s free inode cache (see [`Fix::DropInodeCache`]): every item of the
/// FREE_INO inode, dropping its data extents' references, and the FREE_SPACE header naming
/// it.
fn drop_inode_cache(w: &mut crate::transaction::Writer, root: u64) -> Result<()> {
    // The header of the cache's contents (a dir-item-like location key first).
    let header = Key::new(FREE_SPACE_OBJECTID, 0, 0);
    let names_cache = w
        .read_item(root, &header)?
        .is_some_and(|b| b.get(..8) == Some(&FREE_INO_OBJECTID.to_le_bytes()[..]));
    drop_inode_items(w, root, FREE_INO_OBJECTID)?;
    if names_cache {
        w.delete_item(root, &header)?;
    }
    Ok(())
}

/// Deletes every item of inode `ino` of tree `root`, dropping its file extents' data
/// references (a cache inode: nothing else names it).
fn drop_inode_items(w: &mut crate::transaction::Writer, root: u64, ino: u64) -> Result<()> {
    use crate::format::items::{FileExtentBody, FileExtentItem};
    use crate::space::delayed_refs::RefKey;
    let t = w.current_root(root)?;
    let mut it = crate::ctree::TreeIter::new(
        w.disk.clone(),
        t,
        Key::new(ino, 0, 0),
        crate::io::disk_io::Readahead::None,
    )?;
    let mut keys = Vec::new();
    let mut drops = Vec::new();
    while let Some(item) = it.next_item()? {
        let k = item.key;
        if k.objectid != ino {
            break;
        }
        if k.ty == EXTENT_DATA_KEY {
            let fe = FileExtentItem::parse(item.data()).map_err(|e| item.annotate(e))?;
            if let FileExtentBody::Extent {
                disk_bytenr,
                disk_num_bytes,
                offset,
                ..
            } = fe.body
            {
                if disk_bytenr != 0 {
                    let r = RefKey::Data {
                        root,
                        ino,
                        offset: k.offset.wrapping_sub(offset),
                    };
                    drops.push((disk_bytenr, disk_num_bytes, r));
                }
            }
        }
        keys.push(k);
    }
    drop(it);
    for k in keys {
        w.delete_item(root, &k)?;
    }
    for (b, len, r) in drops {
        w.refs.add_data_ref(b, len, false, r, -1);
    }
    Ok(())
}

/// Inserts a regular file extent item of inode `ino` at file `offset`: `num_bytes` of the
/// data extent at `bytenr` (`disk_len` bytes) from its start, or a hole (`bytenr` 0).
fn insert_file_extent(
    w: &mut crate::transaction::Writer,
    root: u64,
    ino: u64,
    offset: u64,
    bytenr: u64,
    disk_len: u64,
    num_bytes: u64,
) -> Result<()> {
    use crate::format::items::{FileExtentBody, FileExtentItem};
    let item = FileExtentItem {
        generation: w.transid,
        ram_bytes: if bytenr == 0 { num_bytes } else { disk_len },
        compression: 0,
        encryption: 0,
        other_encoding: 0,
        ty: FILE_EXTENT_REG,
        body: FileExtentBody::Extent {
            disk_bytenr: bytenr,
            disk_num_bytes: disk_len,
            offset: 0,
            num_bytes,
        },
    };
    w.insert_item(
        root,
        Key::new(ino, EXTENT_DATA_KEY, offset),
        &item.to_bytes(),
    )
}

/// Links inode `ino` of tree `root` into the tree's lost+found directory (made when there is
/// none) under its number (see [`Fix::LostAndFound`]).
fn to_lost_and_found(core: &Core, root: u64, ino: u64, file_type: u8) -> Result<()> {
    use crate::ids::Inode;
    let top = Inode {
        root,
        ino: FIRST_FREE_OBJECTID,
    };
    const LOST: &[u8] = b"lost+found";
    let found = core.lookup(top, LOST)?;
    let lost = match found {
        Some(e) if e.file_type == FT_DIR => Some(e.target),
        Some(_) => {
            return Err(Error::Exists(
                "lost+found is there and is not a directory".into(),
            ))
        }
        None => None,
    };
    // The first free name of its number, its number with a suffix after that.
    let mut name = ino.to_string();
    if let Some(dir) = lost {
        let mut n = 1;
        while core.lookup(dir, name.as_bytes())?.is_some() {
            name = format!("{ino}.{n}");
            n += 1;
        }
    }
    let target = Inode { root, ino };
    core.op(false, |w| {
        let dir = match lost {
            Some(d) => d,
            None => {
                let (d, _) = core.new_inode(
                    w,
                    top,
                    0o40700,
                    0,
                    crate::inode::namespace::Owner::default(),
                )?;
                core.add_entry(w, top, LOST, d, FT_DIR)?;
                d
            }
        };
        core.add_entry(w, dir, name.as_bytes(), target, file_type)?;
        let key = Key::new(ino, INODE_ITEM_KEY, 0);
        edit_item(w, root, &key, |b| {
            let mut item = InodeItem::parse(b)?;
            item.nlink = 1;
            put_same_size(b, &item.to_bytes())
        })
    })
}

/// Queues the reference changes that give the extent at `bytenr` exactly `refs` (see
/// [`Fix::ExtentRefs`]); the commit applies them as it applies every change's, making or
/// deleting the item and keeping the block group's used bytes and free space in step. An
/// item there that cannot be read goes first.
pub(crate) fn set_extent_refs(
    w: &mut crate::transaction::Writer,
    bytenr: u64,
    len: u64,
    level: Option<u8>,
    refs: &[(ExtentRef, u64)],
) -> Result<()> {
    use crate::space::delayed_refs::RefKey;
    use std::collections::BTreeMap;
    let root = w.current_root(EXTENT_TREE_OBJECTID)?;
    let have = match crate::ctree::extent_record::read_extent_record_counted(&w.disk, root, bytenr)
    {
        Ok(Some((rec, stored))) => {
            let total: u64 = rec.refs.values().sum();
            if total != stored {
                // The item's count (its first 8 bytes) made its references' total
                // first, so that the commit can change them.
                edit_item(w, EXTENT_TREE_OBJECTID, &rec.key, |b| put_u64(b, 0, total))?;
            }
            Some(rec)
        }
        Ok(None) => None,
        // An item that cannot be read goes (the checker did not count it in its
        // group's used bytes either), and a new one is made.
        Err(Error::Corrupt { .. }) => {
            delete_extent_items(w, bytenr)?;
            None
        }
        Err(e) => return Err(e),
    };
    let want: BTreeMap<RefKey, u64> = refs
        .iter()
        .map(|(r, n)| {
            let k = match *r {
                ExtentRef::Tree(root) => RefKey::TreeBlock(root),
                ExtentRef::SharedBlock(parent) => RefKey::SharedBlock(parent),
                ExtentRef::Data { root, ino, offset } => RefKey::Data { root, ino, offset },
                ExtentRef::SharedData(parent) => RefKey::SharedData(parent),
            };
            (k, *n)
        })
        .collect();
    let is_new = have.is_none();
    if is_new && want.is_empty() {
        return Ok(());
    }
    let have = have.map(|h| h.refs).unwrap_or_default();
    // A new tree block item takes the block's generation (not the repair's) and, when not
    // skinny, its first key.
    let (first_key, generation) = match level {
        Some(_) if is_new => {
            let b = w.disk.read_tree_block(bytenr, &Default::default())?;
            let key = if b.nritems() == 0 {
                Key::MIN
            } else if b.is_leaf() {
                b.item(0).key
            } else {
                b.key(0)
            };
            (key, Some(b.header.generation))
        }
        _ => (Key::MIN, None),
    };
    let keys: std::collections::BTreeSet<RefKey> =
        want.keys().chain(have.keys()).copied().collect();
    for k in keys {
        let delta =
            want.get(&k).copied().unwrap_or(0) as i64 - have.get(&k).copied().unwrap_or(0) as i64;
        if delta == 0 {
            continue;
        }
        match level {
            Some(l) => w
                .refs
                .add_tree_ref(bytenr, len, l, first_key, is_new, k, delta),
            None => w.refs.add_data_ref(bytenr, len, is_new, k, delta),
        }
    }
    if let Some(g) = generation {
        w.refs.set_generation(bytenr, g);
    }
    Ok(())
}

/// Deletes every extent tree item of the extent at `bytenr` (its item and keyed references).
fn delete_extent_items(w: &mut crate::transaction::Writer, bytenr: u64) -> Result<()> {
    let root = w.current_root(EXTENT_TREE_OBJECTID)?;
    let mut keys = Vec::new();
    let mut it = crate::ctree::TreeIter::new(
        w.disk.clone(),
        root,
        Key::new(bytenr, 0, 0),
        crate::io::disk_io::Readahead::None,
    )?;
    while let Some(item) = it.next_item()? {
        if item.key.objectid != bytenr {
            break;
        }
        if matches!(
            item.key.ty,
            EXTENT_ITEM_KEY
                | METADATA_ITEM_KEY
                | TREE_BLOCK_REF_KEY
                | SHARED_BLOCK_REF_KEY
                | EXTENT_DATA_REF_KEY
                | SHARED_DATA_REF_KEY
        ) {
            keys.push(item.key);
        }
    }
    drop(it);
    for k in keys {
        w.delete_item(EXTENT_TREE_OBJECTID, &k)?;
    }
    Ok(())
}

/// Each device's size rounded down to whole sectors (and to the device's length), the same
/// in its chunk tree item and in its superblock copy, and the superblock's total their sum
/// (`btrfs rescue fix-device-size`). Returns whether anything changed.
pub(crate) fn align_device_sizes(w: &mut crate::transaction::Writer) -> Result<bool> {
    let sector = u64::from(w.disk.sectorsize());
    let chunk_root = w.current_root(CHUNK_TREE_OBJECTID)?;
    let devids: Vec<u64> = w.dev_items.keys().copied().collect();
    let mut changed = false;
    for devid in devids {
        let key = Key::new(DEV_ITEMS_OBJECTID, DEV_ITEM_KEY, devid);
        let in_tree = crate::ctree::lookup(&w.disk, &chunk_root, &key)?
            .map(|it| crate::format::superblock::DevItem::parse(it.data()))
            .transpose()?;
        let Some(in_tree) = in_tree else { continue };
        let held = w.dev_items.get(&devid).map_or(0, |d| d.total_bytes);
        let len = w.disk.devices.get(devid).map_or(u64::MAX, |d| d.len());
        let want = held.min(in_tree.total_bytes).min(len) / sector * sector;
        if want != in_tree.total_bytes || want != held {
            if let Some(item) = w.dev_items.get_mut(&devid) {
                item.total_bytes = want;
            }
            let mut body = in_tree.clone();
            body.total_bytes = want;
            w.replace_item(CHUNK_TREE_OBJECTID, key, &body.to_bytes())?;
            changed = true;
        }
    }
    let sum: u64 = w.dev_items.values().map(|i| i.total_bytes).sum();
    if w.sb.total_bytes != sum {
        w.sb.total_bytes = sum;
        changed = true;
    }
    Ok(changed)
}

/// Deletes tree `id` whole: its root item, and a reference from each of its blocks (a tree
/// no other shares, as the uuid tree). Returns false when there is no such tree.
pub(crate) fn drop_private_tree(w: &mut crate::transaction::Writer, id: u64) -> Result<bool> {
    let root_tree = w.current_root(ROOT_TREE_OBJECTID)?;
    let found =
        crate::ctree::lookup_le(&w.disk, &root_tree, &Key::new(id, ROOT_ITEM_KEY, u64::MAX))?
            .map(|it| it.key)
            .filter(|k| k.objectid == id && k.ty == ROOT_ITEM_KEY);
    let Some(item_key) = found else {
        return Ok(false);
    };
    drop_tree_blocks(w, id)?;
    w.delete_item(ROOT_TREE_OBJECTID, &item_key)?;
    w.trees.remove(&id);
    w.live
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&id);
    Ok(true)
}

/// Deletes the v1 free space cache (`btrfs rescue clear-space-cache v1`): each block
/// group's FREE_SPACE header in the root tree, the cache inode it names with its items and
/// its data's references, and the superblock's cache generation set to "none" (the kernel
/// then ignores any cache). Returns whether there was anything.
pub(crate) fn clear_space_cache_v1(w: &mut crate::transaction::Writer) -> Result<bool> {
    let root = w.current_root(ROOT_TREE_OBJECTID)?;
    let mut it = crate::ctree::TreeIter::new(
        w.disk.clone(),
        root,
        Key::new(FREE_SPACE_OBJECTID, 0, 0),
        crate::io::disk_io::Readahead::None,
    )?;
    // Headers and the inodes they name (a header starts with the inode's location key).
    let mut headers = Vec::new();
    let mut inodes = std::collections::BTreeSet::new();
    while let Some(item) = it.next_item()? {
        if item.key.objectid != FREE_SPACE_OBJECTID {
            break;
        }
        if let Some(b) = item.data().get(..8) {
            inodes.insert(crate::format::le_u64(b, 0));
        }
        headers.push(item.key);
    }
    drop(it);
    let any = !headers.is_empty() || w.sb.cache_generation != u64::MAX;
    for k in headers {
        w.delete_item(ROOT_TREE_OBJECTID, &k)?;
    }
    for ino in inodes {
        drop_inode_items(w, ROOT_TREE_OBJECTID, ino)?;
    }
    w.sb.cache_generation = u64::MAX;
    Ok(any)
}

/// Deletes the free space tree (`btrfs rescue clear-space-cache v2`): the tree and the
/// superblock's flags for it (a kernel mount with `-o space_cache=v2` builds it
/// again). Refused where
/// the block group tree needs it. Returns whether there was one.
pub(crate) fn clear_space_cache_v2(w: &mut crate::transaction::Writer) -> Result<bool> {
    if w.sb.has_compat_ro(COMPAT_RO_BLOCK_GROUP_TREE) {
        return Err(Error::Unsupported(
            "the free space tree cannot go: this filesystem's block group tree needs it".into(),
        ));
    }
    if !w.sb.has_compat_ro(COMPAT_RO_FREE_SPACE_TREE) {
        return Ok(false);
    }
    w.sb.compat_ro_flags &= !(COMPAT_RO_FREE_SPACE_TREE | COMPAT_RO_FREE_SPACE_TREE_VALID);
    drop_private_tree(w, FREE_SPACE_TREE_OBJECTID)?;
    Ok(true)
}

/// Empties tree `id` (one no other tree shares): its blocks' references go, and an empty
/// leaf becomes its root.
pub(crate) fn reset_private_tree(w: &mut crate::transaction::Writer, id: u64) -> Result<()> {
    drop_tree_blocks(w, id)?;
    let leaf = w.new_block(id, 0, Key::MIN)?;
    w.set_root(id, leaf, 0)
}

/// Queues the loss of tree `id`'s reference from each of its blocks.
fn drop_tree_blocks(w: &mut crate::transaction::Writer, id: u64) -> Result<()> {
    let root = w.current_root(id)?;
    let ns = w.disk.nodesize() as u64;
    let mut todo = vec![(root.bytenr, root.level, root.generation)];
    while let Some((bytenr, level, generation)) = todo.pop() {
        let b = w.disk.read_tree_block(
            bytenr,
            &crate::io::disk_io::Expect {
                owner: None,
                level: Some(level),
                generation: Some(generation),
                first_key: None,
            },
        )?;
        if !b.is_leaf() {
            for slot in 0..b.nritems() {
                let p = b.ptr(slot);
                todo.push((p.blockptr, level - 1, p.generation));
            }
        }
        let first = if b.nritems() == 0 {
            Key::MIN
        } else if b.is_leaf() {
            b.item(0).key
        } else {
            b.key(0)
        };
        w.refs.add_tree_ref(
            bytenr,
            ns,
            level,
            first,
            false,
            crate::space::delayed_refs::RefKey::TreeBlock(id),
            -1,
        );
    }
    Ok(())
}

/// Rewrites the top-level subvolume's root item as it is, so that the commit writes a new
/// root tree block: a superblock of a new generation must name a root tree of that
/// generation, also when the change touches no tree (the superblock's counts alone).
pub(crate) fn touch_root_tree(core: &Core) -> Result<()> {
    core.op(false, |w| {
        let key = core.root_item_key(w, FS_TREE_OBJECTID)?;
        w.update_item(ROOT_TREE_OBJECTID, &key, |_| Ok(()))?;
        Ok(())
    })
}

/// Changes one field of inode `ino`'s item in tree `root`, in the running transaction.
fn set_inode(core: &Core, root: u64, ino: u64, set: impl FnOnce(&mut InodeItem)) -> Result<()> {
    core.op(false, |w| {
        let key = Key::new(ino, INODE_ITEM_KEY, 0);
        edit_item(w, root, &key, |b| {
            let mut item = InodeItem::parse(b)?;
            set(&mut item);
            put_same_size(b, &item.to_bytes())
        })
    })
}

/// Changes item `key` of `tree` in place with `edit`; an error names it when it is gone.
fn edit_item(
    w: &mut crate::transaction::Writer,
    tree: u64,
    key: &Key,
    edit: impl FnOnce(&mut [u8]) -> Result<()>,
) -> Result<()> {
    if w.update_item(tree, key, edit)? {
        Ok(())
    } else {
        Err(Error::NotFound(format!("item {key} of tree {tree}")))
    }
}

/// Writes `v` at byte `at` of an item's body, which must be long enough.
fn put_u64(b: &mut [u8], at: usize, v: u64) -> Result<()> {
    let len = b.len();
    match b.get_mut(at..at + 8) {
        Some(f) => {
            f.copy_from_slice(&v.to_le_bytes());
            Ok(())
        }
        None => Err(Error::Invalid(format!(
            "an item of {len} bytes has no field at {at}"
        ))),
    }
}

/// Replaces an item's body by `body`, re-encoded to the same size.
fn put_same_size(b: &mut [u8], body: &[u8]) -> Result<()> {
    if body.len() != b.len() {
        return Err(Error::Invalid(format!(
            "an item of {} bytes re-encodes to {}",
            b.len(),
            body.len()
        )));
    }
    b.copy_from_slice(body);
    Ok(())
}

/// The findings of `after` that `before` did not have (same kind, same place), and whether
/// `after` has strictly fewer findings: a repair's result is kept only with none new and
/// fewer in all.
pub(crate) fn judge<'a>(before: &Report, after: &'a Report) -> (Vec<&'a Finding>, bool) {
    let errors = |r: &Report| {
        r.findings
            .iter()
            .filter(|f| f.severity != super::Severity::Warning)
            .count()
    };
    let new: Vec<&Finding> = after
        .findings
        .iter()
        .filter(|f| f.severity != super::Severity::Warning)
        .filter(|f| {
            !before
                .findings
                .iter()
                .any(|b| b.kind == f.kind && same_place(&b.location, &f.location))
        })
        .collect();
    let fewer = errors(after) < errors(before);
    (new, fewer)
}

/// Two findings' places are the same item: the same tree and key (blocks move in a
/// copy-on-write transaction, so their addresses do not count), or the same description.
fn same_place(a: &crate::error::Location, b: &crate::error::Location) -> bool {
    if a.key.is_some() || b.key.is_some() {
        return a.tree == b.tree && a.key == b.key;
    }
    a.what == b.what && a.tree == b.tree
}
