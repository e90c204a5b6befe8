//! `butter balance start [-d[FILTERS]] [-m[FILTERS]] [-s[FILTERS]] [--full-balance] IMAGE`:
//! the kernel's balance filters, offline. What is built: block groups the filters select that
//! hold nothing are removed (their chunks and device space given back), as `btrfs balance
//! start -dusage=0` does. Moving extents out of a group in use (relocation) is not built
//! yet: when the filters select such a group, nothing is changed and the command says so.

use super::{CliError, CliResult};
use butter::format::print::{block_group_kind, block_group_profile};
use std::path::PathBuf;

/// Block group type bits (the on-disk BLOCK_GROUP_* flags).
const BLOCK_GROUP_DATA: u64 = 1;
const BLOCK_GROUP_SYSTEM: u64 = 2;
const BLOCK_GROUP_METADATA: u64 = 4;

#[derive(clap::Subcommand)]
pub enum BalanceCmd {
    /// Balance the block groups the filters select (give the other devices with --device).
    Start {
        /// Data block groups, with optional filters (-dusage=0, -d"usage=0,devid=2").
        #[arg(short = 'd', num_args = 0..=1, default_missing_value = "", value_name = "FILTERS")]
        data: Option<String>,
        /// Metadata block groups, with optional filters.
        #[arg(short = 'm', num_args = 0..=1, default_missing_value = "", value_name = "FILTERS")]
        metadata: Option<String>,
        /// System block groups, with optional filters.
        #[arg(short = 's', num_args = 0..=1, default_missing_value = "", value_name = "FILTERS")]
        system: Option<String>,
        /// Every block group, without filters (as btrfs-progs asks for it).
        #[arg(long = "full-balance")]
        full: bool,
        /// Accepted for btrfs-progs' spelling.
        #[arg(short = 'f', long = "force")]
        force: bool,
        /// Image file or block device.
        image: PathBuf,
    },
}

#[derive(clap::Args)]
pub struct BalanceArgs {
    #[command(subcommand)]
    pub cmd: BalanceCmd,
}

/// The kernel's balance filters for one block group type.
#[derive(Debug, Default, Clone)]
struct Filters {
    /// usage=N (below N percent) or usage=MIN..MAX.
    usage: Option<(u64, u64)>,
    devid: Option<u64>,
    /// drange=START..END: a stripe on the devid's device overlapping it.
    drange: Option<(u64, u64)>,
    /// vrange=START..END: the logical range overlapping it.
    vrange: Option<(u64, u64)>,
    limit: Option<u64>,
}

fn parse_range(v: &str, what: &str) -> Result<(u64, u64), CliError> {
    let bad = || {
        CliError(format!(
            "balance filter {what}={v}: give N, N.., ..M or N..M"
        ))
    };
    let num = |s: &str| -> Result<u64, CliError> { super::mkfs::parse_size(s).map_err(|_| bad()) };
    match v.split_once("..") {
        None => Ok((0, num(v)?)),
        Some((a, b)) => Ok((
            if a.is_empty() { 0 } else { num(a)? },
            if b.is_empty() { u64::MAX } else { num(b)? },
        )),
    }
}

fn parse_filters(spec: &str, flag: char) -> Result<Filters, CliError> {
    let mut f = Filters::default();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part.split_once('=').unwrap_or((part, ""));
        match name {
            "usage" => {
                f.usage = Some(match value.split_once("..") {
                    None => {
                        let n: u64 = value.parse().map_err(|_| {
                            CliError(format!("-{flag}: usage={value} is not a percentage"))
                        })?;
                        (0, n)
                    }
                    Some(_) => {
                        let (a, b) = parse_range(value, "usage")?;
                        (a, b.min(100))
                    }
                })
            }
            "devid" => {
                f.devid =
                    Some(value.parse().map_err(|_| {
                        CliError(format!("-{flag}: devid={value} is not a device id"))
                    })?)
            }
            "drange" => f.drange = Some(parse_range(value, "drange")?),
            "vrange" => f.vrange = Some(parse_range(value, "vrange")?),
            "limit" => {
                f.limit = Some(parse_range(value, "limit")?.1);
            }
            "convert" | "soft" | "stripes" | "profiles" => {
                return Err(CliError(format!(
                    "-{flag}: the {name} filter changes or selects block groups by moving their \
                     extents (relocation), which butter cannot do yet; `butter balance start \
                     -dusage=0 -musage=0` removes the empty ones"
                )))
            }
            _ => {
                return Err(CliError(format!(
                    "-{flag}: unknown balance filter `{name}` (usage, devid, drange, vrange, \
                     limit)"
                )))
            }
        }
    }
    Ok(f)
}

pub fn balance(a: BalanceArgs) -> CliResult {
    let BalanceCmd::Start {
        data,
        metadata,
        system,
        full,
        force: _,
        image,
    } = a.cmd;
    let mut kinds: Vec<(u64, Filters)> = Vec::new();
    for (spec, kind, flag) in [
        (&data, BLOCK_GROUP_DATA, 'd'),
        (&metadata, BLOCK_GROUP_METADATA, 'm'),
        (&system, BLOCK_GROUP_SYSTEM, 's'),
    ] {
        if let Some(s) = spec {
            kinds.push((kind, parse_filters(s, flag)?));
        }
    }
    if kinds.is_empty() {
        if !full {
            return Err(CliError(
                "a balance without filters moves every block group: give --full-balance, or \
                 filters such as -dusage=0 -musage=0"
                    .into(),
            ));
        }
        for kind in [BLOCK_GROUP_DATA, BLOCK_GROUP_METADATA, BLOCK_GROUP_SYSTEM] {
            kinds.push((kind, Filters::default()));
        }
    }
    let fs = super::subvol::open_rw(&image)?;
    let groups = fs.block_groups()?;
    let total = groups.len();
    let mut chosen = Vec::new();
    for (kind, f) in &kinds {
        let mut taken = 0u64;
        for g in groups.iter().filter(|g| g.flags & kind != 0) {
            if let Some((lo, hi)) = f.usage {
                // As the kernel: usage=N takes groups with less than N percent used (usage=0
                // the empty ones), usage=MIN..MAX those from MIN percent to below MAX.
                let of = |p: u64| (g.len as u128 * p.min(100) as u128 / 100) as u64;
                let min = of(lo);
                let max = match hi {
                    0 => 1,
                    h if h >= 100 => g.len + 1,
                    h => of(h),
                };
                if g.used < min || g.used >= max {
                    continue;
                }
            }
            if let Some(d) = f.devid {
                if !g.stripes.iter().any(|s| s.0 == d) {
                    continue;
                }
            }
            if let Some((lo, hi)) = f.drange {
                if !g.stripes.iter().any(|&(d, off, len)| {
                    f.devid.is_none_or(|x| x == d) && off < hi && lo < off + len
                }) {
                    continue;
                }
            }
            if let Some((lo, hi)) = f.vrange {
                if !(g.start < hi && lo < g.start + g.len) {
                    continue;
                }
            }
            if f.limit.is_some_and(|l| taken >= l) {
                continue;
            }
            taken += 1;
            chosen.push(g.clone());
        }
    }
    let busy: Vec<_> = chosen.iter().filter(|g| g.used > 0).collect();
    if !busy.is_empty() {
        let list: Vec<String> = busy
            .iter()
            .take(5)
            .map(|g| {
                format!(
                    "{} {} at {} ({} used)",
                    block_group_kind(g.flags),
                    block_group_profile(g.flags),
                    g.start,
                    super::mkfs::human(g.used)
                )
            })
            .collect();
        return Err(CliError(format!(
            "the filters select {} block groups that hold extents ({}{}); moving extents \
             (relocation) is not built yet, so nothing was changed; `-dusage=0 -musage=0` \
             removes the empty ones",
            busy.len(),
            list.join(", "),
            if busy.len() > 5 { ", ..." } else { "" }
        )));
    }
    // The last group of a kind stays (the filesystem needs somewhere to write): the first
    // one, so that the device's space frees from its end (`filesystem resize min` after).
    chosen.sort_by_key(|g| std::cmp::Reverse(g.start));
    let mut removable = Vec::new();
    for g in &chosen {
        let kind = g.flags & (BLOCK_GROUP_DATA | BLOCK_GROUP_METADATA | BLOCK_GROUP_SYSTEM);
        let left = groups
            .iter()
            .filter(|o| o.flags & kind != 0 && !removable.contains(&o.start))
            .count();
        if left > 1 {
            removable.push(g.start);
        }
    }
    if !removable.is_empty() {
        fs.remove_empty_block_groups(&removable).map_err(|e| {
            CliError(format!(
                "cannot remove empty block groups: {}",
                CliError::from(e)
            ))
        })?;
    }
    fs.close()?;
    println!(
        "Done, had to relocate {} out of {total} chunks",
        removable.len()
    );
    Ok(())
}
