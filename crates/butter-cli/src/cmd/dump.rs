//! `butter dump-super` and `butter dump-tree`: the on-disk structures as text, laid out like
//! `btrfs inspect-internal dump-super` / `dump-tree` so the two can be compared line by line.

use super::{CliError, CliResult};
use butter::inspect::{self, DumpTreeOptions};
use butter::io::device::{BlockDevice, FileDevice};
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

/// An error of the library's dump, named after the image (a closed pipe stays quiet).
fn on_image(image: &std::path::Path, e: butter::Error) -> CliError {
    let e = CliError::from(e);
    if e.0.is_empty() {
        return e;
    }
    CliError(format!("{}: {}", image.display(), e.0))
}

pub fn dump_super(a: DumpSuperArgs) -> CliResult {
    let dev = open_dev(&a.image)?;
    let name = a.image.display().to_string();
    let mut out = std::io::stdout().lock();
    inspect::dump_super(dev.as_ref(), &name, a.mirror, a.all, a.full, &mut out)
        .map_err(|e| on_image(&a.image, e))
}

pub fn dump_tree(a: DumpTreeArgs) -> CliResult {
    let dev = open_dev(&a.image)?;
    let tree = match a.tree.as_deref() {
        None => None,
        Some(s) => Some(inspect::tree_id(s).ok_or_else(|| {
            CliError(format!(
                "unknown tree '{s}': give a number or a name such as fs, extent, csum"
            ))
        })?),
    };
    let opts = DumpTreeOptions {
        tree,
        blocks: a.blocks,
        follow: a.follow,
        dfs: a.dfs,
    };
    let mut out = std::io::stdout().lock();
    let others = super::other_devices().clone();
    let mut given = vec![(a.image.display().to_string(), dev)];
    for p in &others.paths {
        given.push((p.display().to_string(), open_dev(p)?));
    }
    inspect::dump_tree_set(given, others.degraded, &opts, &mut out)
        .map_err(|e| on_image(&a.image, e))
}
