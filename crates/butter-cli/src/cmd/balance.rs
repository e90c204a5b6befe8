//! `butter balance start|status|resume|cancel`: the kernel's balance, offline. The filters
//! (`-d`, `-m`, `-s`, as btrfs-progs spells them) select block groups; each is relocated (its
//! extents and tree blocks moved elsewhere) and removed, new chunks in the profile a
//! `convert=` asks for. The filters are kept in the filesystem (a BALANCE_ITEM, as the kernel
//! keeps them) until the balance ends, so an interrupted one (Ctrl-C, a crash, a power cut)
//! continues with `butter balance resume`, or at the next kernel mount.

use super::{CliError, CliResult};
use butter::format::items::{BalanceArgs, BalanceItem};
use butter::format::print::block_group_profile;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Subcommand)]
pub enum BalanceCmd {
    /// Balance the block groups the filters select (give the other devices with --device).
    /// Ctrl-C pauses after the block group being moved; `balance resume` continues.
    Start {
        /// Data block groups, with optional filters (-dusage=50, -d"convert=raid1,soft").
        #[arg(short = 'd', num_args = 0..=1, default_missing_value = "", value_name = "FILTERS")]
        data: Option<String>,
        /// Metadata block groups, with optional filters (system ones follow, as in
        /// btrfs-progs, unless -s is given).
        #[arg(short = 'm', num_args = 0..=1, default_missing_value = "", value_name = "FILTERS")]
        metadata: Option<String>,
        /// System block groups, with optional filters (needs --force).
        #[arg(short = 's', num_args = 0..=1, default_missing_value = "", value_name = "FILTERS")]
        system: Option<String>,
        /// Every block group, without filters (as btrfs-progs asks for it).
        #[arg(long = "full-balance")]
        full: bool,
        /// Allow reducing the redundancy of metadata and balancing system chunks.
        #[arg(short = 'f', long = "force")]
        force: bool,
        /// Image file or block device.
        image: PathBuf,
    },
    /// Show whether a balance was interrupted on the filesystem, and what it has left.
    Status {
        /// Image file or block device.
        image: PathBuf,
    },
    /// Continue an interrupted balance with its own filters.
    Resume {
        /// Image file or block device.
        image: PathBuf,
    },
    /// Drop an interrupted balance (what it moved stays moved).
    Cancel {
        /// Image file or block device.
        image: PathBuf,
    },
}

#[derive(clap::Args)]
pub struct BalanceArgsCli {
    #[command(subcommand)]
    pub cmd: BalanceCmd,
}

fn parse_range(v: &str, what: &str, flag: char) -> Result<(u64, u64), CliError> {
    let bad = || {
        CliError(format!(
            "-{flag}: balance filter {what}={v}: give N, N.., ..M or N..M"
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

/// A profile name as btrfs-progs takes it, in balance args' bits.
fn profile_bits(name: &str, flag: char) -> Result<u64, CliError> {
    let p = match name.to_ascii_lowercase().as_str() {
        "single" => BalanceArgs::SINGLE,
        "raid0" => 1 << 3,
        "raid1" => 1 << 4,
        "dup" => 1 << 5,
        "raid10" => 1 << 6,
        "raid5" => 1 << 7,
        "raid6" => 1 << 8,
        "raid1c3" => 1 << 9,
        "raid1c4" => 1 << 10,
        _ => {
            return Err(CliError(format!(
                "-{flag}: unknown profile `{name}` (single, dup, raid0, raid1, raid1c3, \
                 raid1c4, raid10, raid5, raid6)"
            )))
        }
    };
    Ok(p)
}

/// One type's filters, as the kernel takes them.
fn parse_filters(spec: &str, flag: char) -> Result<BalanceArgs, CliError> {
    let mut a = BalanceArgs::default();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part.split_once('=').unwrap_or((part, ""));
        let need_value = || {
            if value.is_empty() {
                Err(CliError(format!("-{flag}: the {name} filter needs a value")))
            } else {
                Ok(())
            }
        };
        match name {
            "usage" => {
                need_value()?;
                if value.contains("..") {
                    let (lo, hi) = parse_range(value, "usage", flag)?;
                    a.usage = lo.min(100) | (hi.min(100) << 32);
                    a.flags |= BalanceArgs::USAGE_RANGE;
                } else {
                    let n: u64 = value.parse().map_err(|_| {
                        CliError(format!("-{flag}: usage={value} is not a percentage"))
                    })?;
                    if n > 100 {
                        return Err(CliError(format!(
                            "-{flag}: usage={n}: a percentage is at most 100"
                        )));
                    }
                    a.usage = n;
                    a.flags |= BalanceArgs::USAGE;
                }
            }
            "devid" => {
                need_value()?;
                a.devid = value.parse().map_err(|_| {
                    CliError(format!("-{flag}: devid={value} is not a device id"))
                })?;
                a.flags |= BalanceArgs::DEVID;
            }
            "drange" => {
                need_value()?;
                (a.pstart, a.pend) = parse_range(value, "drange", flag)?;
                a.flags |= BalanceArgs::DRANGE;
            }
            "vrange" => {
                need_value()?;
                (a.vstart, a.vend) = parse_range(value, "vrange", flag)?;
                a.flags |= BalanceArgs::VRANGE;
            }
            "limit" => {
                need_value()?;
                if value.contains("..") {
                    let (lo, hi) = parse_range(value, "limit", flag)?;
                    a.limit = lo.min(u32::MAX as u64) | (hi.min(u32::MAX as u64) << 32);
                    a.flags |= BalanceArgs::LIMIT_RANGE;
                } else {
                    a.limit = parse_range(value, "limit", flag)?.1;
                    a.flags |= BalanceArgs::LIMIT;
                }
            }
            "stripes" => {
                need_value()?;
                let (lo, hi) = if value.contains("..") {
                    parse_range(value, "stripes", flag)?
                } else {
                    let n = parse_range(value, "stripes", flag)?.1;
                    (n, n)
                };
                a.stripes_min = lo.min(u32::MAX as u64) as u32;
                a.stripes_max = hi.min(u32::MAX as u64) as u32;
                a.flags |= BalanceArgs::STRIPES_RANGE;
            }
            "convert" => {
                need_value()?;
                a.target = profile_bits(value, flag)?;
                a.flags |= BalanceArgs::CONVERT;
            }
            "profiles" => {
                need_value()?;
                for p in value.split('|') {
                    a.profiles |= profile_bits(p, flag)?;
                }
                a.flags |= BalanceArgs::PROFILES;
            }
            "soft" => a.flags |= BalanceArgs::SOFT,
            _ => {
                return Err(CliError(format!(
                    "-{flag}: unknown balance filter `{name}` (profiles, usage, devid, drange, \
                     vrange, limit, stripes, convert, soft)"
                )))
            }
        }
    }
    if a.flags & BalanceArgs::SOFT != 0 && a.flags & BalanceArgs::CONVERT == 0 {
        return Err(CliError(format!(
            "-{flag}: the soft filter only goes with convert"
        )));
    }
    Ok(a)
}

/// The balance a `start` asks for.
fn start_item(
    data: &Option<String>,
    metadata: &Option<String>,
    system: &Option<String>,
    full: bool,
    force: bool,
) -> Result<BalanceItem, CliError> {
    let mut item = BalanceItem::default();
    if let Some(s) = data {
        item.data = parse_filters(s, 'd')?;
        item.flags |= BalanceItem::DATA;
    }
    if let Some(s) = metadata {
        item.meta = parse_filters(s, 'm')?;
        item.flags |= BalanceItem::METADATA;
    }
    if let Some(s) = system {
        if !force {
            return Err(CliError(
                "refusing to explicitly operate on system chunks: pass --force if you really \
                 want to do that"
                    .into(),
            ));
        }
        item.sys = parse_filters(s, 's')?;
        item.flags |= BalanceItem::SYSTEM;
    } else if metadata.is_some() {
        // As btrfs-progs: system chunks get what metadata chunks get.
        item.sys = item.meta;
        item.flags |= BalanceItem::SYSTEM;
    }
    if item.flags == 0 {
        if !full {
            return Err(CliError(
                "a balance without filters moves every block group: give --full-balance, or \
                 filters such as -dusage=50 -musage=50"
                    .into(),
            ));
        }
        item.flags = BalanceItem::DATA | BalanceItem::METADATA | BalanceItem::SYSTEM;
    }
    if force {
        item.flags |= BalanceItem::FORCE;
    }
    Ok(item)
}

pub fn balance(a: BalanceArgsCli) -> CliResult {
    match a.cmd {
        BalanceCmd::Start {
            data,
            metadata,
            system,
            full,
            force,
            image,
        } => {
            let item = start_item(&data, &metadata, &system, full, force)?;
            run(&image, Some(item))
        }
        BalanceCmd::Resume { image } => run(&image, None),
        BalanceCmd::Status { image } => status(&image),
        BalanceCmd::Cancel { image } => {
            let fs = super::subvol::open_rw(&image)?;
            let had = fs.cancel_balance()?;
            fs.close()?;
            if had {
                println!("Balance on '{}' cancelled", image.display());
                Ok(())
            } else {
                Err(CliError(format!(
                    "there is no balance to cancel on '{}'",
                    image.display()
                )))
            }
        }
    }
}

fn run(image: &Path, item: Option<BalanceItem>) -> CliResult {
    let fs = super::subvol::open_rw(image)?;
    let interrupted = Arc::new(AtomicBool::new(false));
    let hooks: Vec<_> = [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM]
        .iter()
        .filter_map(|&s| signal_hook::flag::register(s, interrupted.clone()).ok())
        .collect();
    let mut line = super::progress::StatusLine::new();
    let flag = interrupted.clone();
    let r = fs.balance(item, &mut |m| line.show(m), &mut |_, _| {
        flag.load(Ordering::SeqCst)
    });
    line.end();
    for h in hooks {
        signal_hook::low_level::unregister(h);
    }
    let report = r.map_err(|e| CliError(format!("balance failed: {}", CliError::from(e))))?;
    fs.close()?;
    if interrupted.load(Ordering::SeqCst) {
        println!(
            "Balance paused after {} of its block groups: `butter balance resume {}` \
             continues it",
            report.relocated,
            image.display()
        );
        return Ok(());
    }
    println!(
        "Done, had to relocate {} out of {} chunks",
        report.relocated, report.considered
    );
    Ok(())
}

fn describe(name: &str, a: &BalanceArgs) -> String {
    let mut parts = Vec::new();
    let f = a.flags;
    if f & BalanceArgs::CONVERT != 0 {
        parts.push(format!(
            "converting to {}",
            block_group_profile(a.target & !BalanceArgs::SINGLE)
        ));
    }
    if f & BalanceArgs::SOFT != 0 {
        parts.push("soft".into());
    }
    if f & (BalanceArgs::USAGE | BalanceArgs::USAGE_RANGE) != 0 {
        let (lo, hi) = a.usage_range();
        parts.push(format!("usage={lo}..{hi}"));
    }
    if f & BalanceArgs::DEVID != 0 {
        parts.push(format!("devid={}", a.devid));
    }
    if f & BalanceArgs::DRANGE != 0 {
        parts.push(format!("drange={}..{}", a.pstart, a.pend));
    }
    if f & BalanceArgs::VRANGE != 0 {
        parts.push(format!("vrange={}..{}", a.vstart, a.vend));
    }
    if f & (BalanceArgs::LIMIT | BalanceArgs::LIMIT_RANGE) != 0 {
        let (lo, hi) = a.limit_range();
        parts.push(format!("limit={lo}..{hi}"));
    }
    if f & BalanceArgs::STRIPES_RANGE != 0 {
        parts.push(format!("stripes={}..{}", a.stripes_min, a.stripes_max));
    }
    if f & BalanceArgs::PROFILES != 0 {
        parts.push(format!("profiles={:#x}", a.profiles));
    }
    if parts.is_empty() {
        parts.push("every block group".into());
    }
    format!("  {name}: {}", parts.join(", "))
}

fn status(image: &Path) -> CliResult {
    let fs = super::open_fs(image)?;
    let Some(item) = fs.balance_item()? else {
        println!("No balance found on '{}'", image.display());
        return Ok(());
    };
    println!("Balance on '{}' is paused", image.display());
    for (bit, name, args) in [
        (BalanceItem::DATA, "data", &item.data),
        (BalanceItem::METADATA, "metadata", &item.meta),
        (BalanceItem::SYSTEM, "system", &item.sys),
    ] {
        if item.flags & bit != 0 {
            println!("{}", describe(name, args));
        }
    }
    println!(
        "`butter balance resume {}` continues it, `butter balance cancel {}` drops it",
        image.display(),
        image.display()
    );
    Ok(())
}
