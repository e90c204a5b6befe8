//! `butter dump-super` and `butter dump-tree`: the on-disk structures as text, laid out like
//! `btrfs inspect-internal dump-super` / `dump-tree` so the two can be compared line by line.

use super::{CliError, CliResult};
use butter::ctree::Root;
use butter::format::items::RootItem;
use butter::format::print::{dump_key, print_block, print_superblock_bytes, PrintOpts};
use butter::format::*;
use butter::io::device::{BlockDevice, FileDevice};
use butter::io::disk_io::{Disk, Expect};
use std::collections::VecDeque;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct DumpSuperArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Print everything: dev item, sys_chunk_array, backup roots.
    #[arg(short = 'f', long)]
    pub full: bool,
    /// Which copy: 0 (64 KiB), 1 (64 MiB), 2 (256 GiB).
    #[arg(short = 's', long = "super", default_value_t = 0)]
    pub mirror: usize,
    /// Print every copy that fits on the device.
    #[arg(short = 'a', long)]
    pub all: bool,
}

#[derive(clap::Args)]
pub struct DumpTreeArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Only this tree: a number or a name (root, chunk, extent, dev, fs, csum, uuid,
    /// free-space, data-reloc, quota, block-group).
    #[arg(short = 't', long = "tree")]
    pub tree: Option<String>,
    /// Only these blocks (logical addresses).
    #[arg(short = 'b', long = "block")]
    pub blocks: Vec<u64>,
    /// With -b: also print every block below it.
    #[arg(long)]
    pub follow: bool,
    /// Depth-first instead of breadth-first (nodes, then leaves) order.
    #[arg(long)]
    pub dfs: bool,
}

fn open_dev(image: &std::path::Path) -> Result<Arc<dyn BlockDevice>, CliError> {
    let dev = FileDevice::open(image, false)
        .map_err(|e| CliError(format!("cannot open {}: {e}", image.display())))?;
    Ok(Arc::new(dev))
}

pub fn dump_super(a: DumpSuperArgs) -> CliResult {
    let dev = open_dev(&a.image)?;
    if let Some(e) = butter::io::disk_io::probe_not_btrfs(dev.as_ref()) {
        return Err(CliError(format!("{}: {e}", a.image.display())));
    }
    let mirrors: Vec<usize> = if a.all {
        (0..SUPER_MIRROR_MAX).collect()
    } else {
        vec![a.mirror]
    };
    let mut out = String::new();
    for m in mirrors {
        if m >= SUPER_MIRROR_MAX {
            return Err(CliError(format!(
                "superblock copy {m} does not exist (0, 1 or 2)"
            )));
        }
        let off = super_offset(m);
        if off + SUPER_INFO_SIZE as u64 > dev.len() {
            if a.all {
                continue;
            }
            return Err(CliError(format!(
                "the device is too small for superblock copy {m} at byte {off}"
            )));
        }
        let mut buf = vec![0u8; SUPER_INFO_SIZE];
        dev.read_at(&mut buf, off)
            .map_err(|e| CliError(format!("reading superblock at {off}: {e}")))?;
        out.push_str(&format!(
            "superblock: bytenr={off}, device={}\n",
            a.image.display()
        ));
        out.push_str("---------------------------------------------------------\n");
        print_superblock_bytes(&mut out, &buf, a.full);
        out.push('\n');
    }
    std::io::stdout().write_all(out.as_bytes())?;
    Ok(())
}

fn parse_tree_id(s: &str) -> Result<u64, CliError> {
    if let Ok(n) = s.parse::<u64>() {
        return Ok(n);
    }
    let id = match s
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
        _ => {
            return Err(CliError(format!(
                "unknown tree '{s}': give a number or a name such as fs, extent, csum"
            )))
        }
    };
    Ok(id)
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

struct Dumper<'a> {
    disk: &'a Disk,
    opts: PrintOpts,
    dfs: bool,
    out: std::io::StdoutLock<'static>,
}

impl Dumper<'_> {
    fn emit(&mut self, s: &str) -> CliResult {
        self.out.write_all(s.as_bytes())?;
        Ok(())
    }

    /// Prints a tree from `root` (or a single block when `follow` is false). Damaged blocks get
    /// an error line and the walk goes on with the rest.
    fn tree(&mut self, root: Root, follow: bool) -> CliResult {
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
}

pub fn dump_tree(a: DumpTreeArgs) -> CliResult {
    let dev = open_dev(&a.image)?;
    let disk = butter::ctree::open_disk(dev).map_err(|e| {
        CliError(format!(
            "cannot open {}: {}",
            a.image.display(),
            CliError::from(e)
        ))
    })?;
    let sb = disk.sb.clone();
    let opts = PrintOpts {
        csum_type: sb.csum_type,
        sectorsize: sb.sectorsize,
    };
    let mut d = Dumper {
        disk: &disk,
        opts,
        dfs: a.dfs,
        out: std::io::stdout().lock(),
    };
    d.emit("btrfs-progs v6.14 compatible output (butter)\n")?;
    if !a.blocks.is_empty() {
        for b in &a.blocks {
            let root = Root {
                id: 0,
                bytenr: *b,
                level: 0,
                generation: 0,
            };
            // Unknown level/generation: read without those expectations.
            let exp = Expect::default();
            match disk.read_tree_block(*b, &exp) {
                Ok(blk) => {
                    let r = Root {
                        level: blk.level(),
                        generation: blk.header.generation,
                        ..root
                    };
                    d.tree(r, a.follow)?;
                }
                Err(e) => d.emit(&format!("ERROR: cannot read tree block {b}: {e}\n"))?,
            }
        }
        return Ok(());
    }
    let tree_root = Root {
        id: ROOT_TREE_OBJECTID,
        bytenr: sb.root,
        level: sb.root_level,
        generation: sb.generation,
    };
    let chunk_root = Root {
        id: CHUNK_TREE_OBJECTID,
        bytenr: sb.chunk_root,
        level: sb.chunk_root_level,
        generation: sb.chunk_root_generation,
    };
    let only = a.tree.as_deref().map(parse_tree_id).transpose()?;
    if only.is_none() || only == Some(ROOT_TREE_OBJECTID) {
        d.emit("root tree\n")?;
        d.tree(tree_root, true)?;
    }
    if only.is_none() || only == Some(CHUNK_TREE_OBJECTID) {
        d.emit("chunk tree\n")?;
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
    let roots = {
        let mut v = Vec::new();
        let mut it = butter::ctree::TreeIter::new(
            disk.clone(),
            tree_root,
            Key::MIN,
            butter::io::disk_io::Readahead::None,
        )?;
        while let Some(item) = it.next_item()? {
            if item.key.ty != ROOT_ITEM_KEY {
                continue;
            }
            match RootItem::parse(item.data()) {
                Ok(ri) => v.push((item.key, Ok(ri))),
                Err(e) => v.push((item.key, Err(item.annotate(e)))),
            }
        }
        v
    };
    for (key, ri) in roots {
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
        d.tree(
            Root {
                id: key.objectid,
                bytenr: ri.bytenr,
                level: ri.level,
                generation: ri.generation,
            },
            true,
        )?;
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
