//! The on-disk structures as text, for `butter dump-super` and `butter dump-tree`: laid out
//! like `btrfs inspect-internal dump-super` / `dump-tree` so the two compare line by line.
//!
//! Both read through the metadata layer only (superblock, chunk map, validated tree blocks), so
//! they print what a damaged image still holds: a block that fails validation gets an
//! `ERROR:` line and the walk goes on with the rest.

use crate::ctree::{Root, TreeIter};
use crate::error::{Error, Result};
use crate::format::items::RootItem;
use crate::format::print::{dump_key, print_block, print_superblock_bytes, PrintOpts};
use crate::format::*;
use crate::io::device::BlockDevice;
use crate::io::disk_io::{probe_not_btrfs, Disk, Expect, Readahead};
use std::collections::VecDeque;
use std::io::Write;
use std::sync::Arc;

/// What `dump-tree` prints.
#[derive(Debug, Clone, Default)]
pub struct DumpTreeOptions {
    /// Only this tree (see [`tree_id`]); `None`: every tree.
    pub tree: Option<u64>,
    /// Only these blocks (logical addresses); empty: whole trees.
    pub blocks: Vec<u64>,
    /// With `blocks`: also every block below each.
    pub follow: bool,
    /// Depth-first instead of breadth-first (nodes, then leaves) order.
    pub dfs: bool,
}

/// The tree a name stands for (`root`, `extent`, `chunk`, `dev`, `fs`, `csum`, `quota`,
/// `uuid`, `free-space`, `block-group`, `data-reloc`, with or without a `_tree` suffix), or a
/// number as it is.
pub fn tree_id(name: &str) -> Option<u64> {
    if let Ok(n) = name.parse::<u64>() {
        return Some(n);
    }
    let id = match name
        .to_ascii_lowercase()
        .trim_end_matches("_tree")
        .trim_end_matches("-tree")
    {
        "root" => ROOT_TREE_OBJECTID,
        "extent" => EXTENT_TREE_OBJECTID,
        "chunk" => CHUNK_TREE_OBJECTID,
        "dev" | "device" => DEV_TREE_OBJECTID,
        "fs" => FS_TREE_OBJECTID,
        "csum" | "checksum" => CSUM_TREE_OBJECTID,
        "quota" => QUOTA_TREE_OBJECTID,
        "uuid" => UUID_TREE_OBJECTID,
        "free-space" | "free_space" | "free space" => FREE_SPACE_TREE_OBJECTID,
        "block-group" | "block_group" => BLOCK_GROUP_TREE_OBJECTID,
        "data-reloc" | "data_reloc" => DATA_RELOC_TREE_OBJECTID,
        _ => return None,
    };
    Some(id)
}

/// The label dump-tree prints before a tree found through the root tree.
fn tree_label(id: u64) -> &'static str {
    match id {
        EXTENT_TREE_OBJECTID => "extent",
        DEV_TREE_OBJECTID => "device",
        FS_TREE_OBJECTID => "fs",
        CSUM_TREE_OBJECTID => "checksum",
        QUOTA_TREE_OBJECTID => "quota",
        UUID_TREE_OBJECTID => "uuid",
        FREE_SPACE_TREE_OBJECTID => "free space",
        BLOCK_GROUP_TREE_OBJECTID => "block group",
        DATA_RELOC_TREE_OBJECTID => "data reloc",
        TREE_LOG_OBJECTID => "log",
        TREE_RELOC_OBJECTID => "reloc",
        id if (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&id) => "file",
        _ => "",
    }
}

fn emit(out: &mut dyn Write, s: &str) -> Result<()> {
    out.write_all(s.as_bytes())
        .map_err(|e| Error::io("writing the dump", 0, e))
}

/// Prints superblock copy `mirror` (0: 64 KiB, 1: 64 MiB, 2: 256 GiB), or with `all` every
/// copy that fits on the device, each under a `superblock: bytenr=..., device=NAME` banner.
/// `full` adds the dev item, the sys_chunk_array and the backup roots.
pub fn dump_super(
    dev: &dyn BlockDevice,
    name: &str,
    mirror: usize,
    all: bool,
    full: bool,
    out: &mut dyn Write,
) -> Result<()> {
    if let Some(e) = probe_not_btrfs(dev) {
        return Err(e);
    }
    let mirrors: Vec<usize> = if all {
        (0..SUPER_MIRROR_MAX).collect()
    } else {
        vec![mirror]
    };
    let mut text = String::new();
    for m in mirrors {
        if m >= SUPER_MIRROR_MAX {
            return Err(Error::Invalid(format!(
                "superblock copy {m} does not exist (0, 1 or 2)"
            )));
        }
        let off = super_offset(m);
        if off + SUPER_INFO_SIZE as u64 > dev.len() {
            if all {
                continue;
            }
            return Err(Error::Invalid(format!(
                "the device is too small for superblock copy {m} at byte {off}"
            )));
        }
        let mut buf = vec![0u8; SUPER_INFO_SIZE];
        dev.read_at(&mut buf, off)
            .map_err(|e| Error::io("reading the superblock", off, e))?;
        text.push_str(&format!("superblock: bytenr={off}, device={name}\n"));
        text.push_str("---------------------------------------------------------\n");
        print_superblock_bytes(&mut text, &buf, full);
        text.push('\n');
    }
    emit(out, &text)
}

struct Dumper<'a> {
    disk: &'a Disk,
    opts: PrintOpts,
    dfs: bool,
    out: &'a mut dyn Write,
}

impl Dumper<'_> {
    fn emit(&mut self, s: &str) -> Result<()> {
        emit(self.out, s)
    }

    /// Prints a tree from `root` (or a single block when `follow` is false). Damaged blocks get
    /// an error line and the walk goes on with the rest.
    fn tree(&mut self, root: Root, follow: bool) -> Result<()> {
        let exp = Expect {
            owner: None,
            level: Some(root.level),
            generation: Some(root.generation),
            first_key: None,
        };
        let mut queue: VecDeque<(u64, Expect)> = VecDeque::from([(root.bytenr, exp)]);
        let mut budget = 1u64 << 32; // never loop forever on a damaged tree
        while let Some((bytenr, expect)) = if self.dfs {
            queue.pop_back()
        } else {
            queue.pop_front()
        } {
            budget -= 1;
            if budget == 0 {
                break;
            }
            let b = match self.disk.read_tree_block(bytenr, &expect) {
                Ok(b) => b,
                Err(e) => {
                    self.emit(&format!("ERROR: cannot read tree block {bytenr}: {e}\n"))?;
                    continue;
                }
            };
            let mut s = String::new();
            print_block(&mut s, &b.data, &self.opts);
            self.emit(&s)?;
            if !follow || b.is_leaf() {
                continue;
            }
            let kids: Vec<_> = (0..b.nritems())
                .map(|i| {
                    let p = b.ptr(i);
                    let e = Expect {
                        owner: None,
                        level: Some(b.level() - 1),
                        generation: Some(p.generation),
                        first_key: Some(p.key),
                    };
                    (p.blockptr, e)
                })
                .collect();
            if self.dfs {
                queue.extend(kids.into_iter().rev());
            } else {
                queue.extend(kids);
            }
        }
        Ok(())
    }

    /// Each block of `blocks`, read without expectations (its level and generation are
    /// unknown), and with `follow` the blocks below it.
    fn blocks(&mut self, blocks: &[u64], follow: bool) -> Result<()> {
        for &b in blocks {
            match self.disk.read_tree_block(b, &Expect::default()) {
                Ok(blk) => {
                    let r = Root {
                        id: 0,
                        bytenr: b,
                        level: blk.level(),
                        generation: blk.header.generation,
                    };
                    self.tree(r, follow)?;
                }
                Err(e) => self.emit(&format!("ERROR: cannot read tree block {b}: {e}\n"))?,
            }
        }
        Ok(())
    }
}

/// The root items of the root tree, in key order; a root item that does not decode comes back
/// as its error (annotated with where it is).
pub(crate) fn root_items(
    disk: &Arc<Disk>,
    tree_root: Root,
) -> Result<Vec<(Key, Result<RootItem>)>> {
    let mut v = Vec::new();
    let mut it = TreeIter::new(disk.clone(), tree_root, Key::MIN, Readahead::None)?;
    while let Some(item) = it.next_item()? {
        if item.key.ty != ROOT_ITEM_KEY {
            continue;
        }
        match RootItem::parse(item.data()) {
            Ok(ri) => v.push((item.key, Ok(ri))),
            Err(e) => v.push((item.key, Err(item.annotate(e)))),
        }
    }
    Ok(v)
}

/// Prints the trees of the filesystem on `dev` (the root tree, the chunk tree, the log root
/// tree when there is one, then every tree the root tree lists), or what `opts` picks.
pub fn dump_tree(
    dev: Arc<dyn BlockDevice>,
    opts: &DumpTreeOptions,
    out: &mut dyn Write,
) -> Result<()> {
    dump_tree_set(vec![("the image".into(), dev)], false, opts, out)
}

/// [`dump_tree`] of a filesystem of several devices (named for messages, the image first;
/// `degraded`: some may be missing).
pub fn dump_tree_set(
    given: Vec<(String, Arc<dyn BlockDevice>)>,
    degraded: bool,
    opts: &DumpTreeOptions,
    out: &mut dyn Write,
) -> Result<()> {
    let disk = crate::ctree::open_disk_set(given, degraded)?;
    let sb = disk.sb.clone();
    let mut d = Dumper {
        disk: &disk,
        opts: PrintOpts {
            csum_type: sb.csum_type,
            sectorsize: sb.sectorsize,
        },
        dfs: opts.dfs,
        out,
    };
    d.emit("btrfs-progs v6.14 compatible output (butter)\n")?;
    if !opts.blocks.is_empty() {
        return d.blocks(&opts.blocks, opts.follow);
    }
    let only = opts.tree;
    let tree_root = Root::of_root_tree(&sb);
    if only.is_none_or(|t| t == ROOT_TREE_OBJECTID) {
        d.emit("root tree\n")?;
        d.tree(tree_root, true)?;
    }
    if only.is_none_or(|t| t == CHUNK_TREE_OBJECTID) {
        d.emit("chunk tree\n")?;
        let chunk_root = Root {
            id: CHUNK_TREE_OBJECTID,
            bytenr: sb.chunk_root,
            level: sb.chunk_root_level,
            generation: sb.chunk_root_generation,
        };
        d.tree(chunk_root, true)?;
    }
    if sb.log_root != 0 && only.is_none_or(|t| t == TREE_LOG_OBJECTID) {
        d.emit("log root tree\n")?;
        let lr = Root {
            id: TREE_LOG_OBJECTID,
            bytenr: sb.log_root,
            level: sb.log_root_level,
            generation: sb.generation.wrapping_add(1),
        };
        d.tree(lr, true)?;
    }
    // Every other tree, in root tree order.
    for (key, ri) in root_items(&disk, tree_root)? {
        if only.is_some_and(|t| t != key.objectid) {
            continue;
        }
        let ri = match ri {
            Ok(ri) => ri,
            Err(e) => {
                d.emit(&format!("ERROR: bad root item {}: {e}\n", dump_key(&key)))?;
                continue;
            }
        };
        let label = tree_label(key.objectid);
        let sep = if label.is_empty() { "" } else { " " };
        d.emit(&format!("{label}{sep}tree {} \n", dump_key(&key)))?;
        let root = Root {
            id: key.objectid,
            bytenr: ri.bytenr,
            level: ri.level,
            generation: ri.generation,
        };
        d.tree(root, true)?;
    }
    if only.is_none() {
        d.emit(&format!(
            "total bytes {}\nbytes used {}\nuuid {}\n",
            sb.total_bytes,
            sb.bytes_used,
            fmt_uuid(&sb.fsid)
        ))?;
    }
    Ok(())
}
