//! `butter balance start|status|resume|cancel`: the kernel's balance, offline. The filters
//! (`-d`, `-m`, `-s`, as btrfs-progs spells them) select block groups; each is relocated (its
//! extents and tree blocks moved elsewhere) and removed, new chunks in the profile a
//! `convert=` asks for. The filters are kept in the filesystem (a BALANCE_ITEM, as the kernel
//! keeps them) until the balance ends, so an interrupted one (Ctrl-C, a crash, a power cut)
//! continues with `butter balance resume`, or at the next kernel mount.

use super::{CliError, CliResult};
use butter::format::print::block_group_profile;
use butter::inode::balance::{BalanceFilters, BalanceRequest};
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
        /// Image file or block device, or the mount point of a running `butter mount` (the
        /// balance then runs in the mount, between its other operations).
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

/// A profile name as btrfs-progs takes it: its block group profile bits (0 for single).
fn profile_bits(name: &str, flag: char) -> Result<u64, CliError> {
    let p = match name.to_ascii_lowercase().as_str() {
        "single" => 0,
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
fn parse_filters(spec: &str, flag: char) -> Result<BalanceFilters, CliError> {
    let mut f = BalanceFilters::default();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part.split_once('=').unwrap_or((part, ""));
        if value.is_empty() && name != "soft" {
            return Err(CliError(format!(
                "-{flag}: {}",
                if matches!(
                    name,
                    "profiles"
                        | "usage"
                        | "devid"
                        | "drange"
                        | "vrange"
                        | "limit"
                        | "stripes"
                        | "convert"
                ) {
                    format!("the {name} filter needs a value")
                } else {
                    format!(
                        "unknown balance filter `{name}` (profiles, usage, devid, drange, \
                         vrange, limit, stripes, convert, soft)"
                    )
                }
            )));
        }
        match name {
            "usage" => {
                f.usage = Some(if value.contains("..") {
                    let (lo, hi) = parse_range(value, "usage", flag)?;
                    (lo.min(100), hi.min(100))
                } else {
                    let n: u64 = value.parse().map_err(|_| {
                        CliError(format!("-{flag}: usage={value} is not a percentage"))
                    })?;
                    if n > 100 {
                        return Err(CliError(format!(
                            "-{flag}: usage={n}: a percentage is at most 100"
                        )));
                    }
                    (0, n)
                })
            }
            "devid" => {
                f.devid =
                    Some(value.parse().map_err(|_| {
                        CliError(format!("-{flag}: devid={value} is not a device id"))
                    })?)
            }
            "drange" => f.drange = Some(parse_range(value, "drange", flag)?),
            "vrange" => f.vrange = Some(parse_range(value, "vrange", flag)?),
            "limit" => f.limit = Some(parse_range(value, "limit", flag)?),
            "stripes" => {
                let (lo, hi) = if value.contains("..") {
                    parse_range(value, "stripes", flag)?
                } else {
                    let n = parse_range(value, "stripes", flag)?.1;
                    (n, n)
                };
                f.stripes = Some((
                    lo.min(u32::MAX as u64) as u32,
                    hi.min(u32::MAX as u64) as u32,
                ));
            }
            "convert" => f.convert = Some(profile_bits(value, flag)?),
            "profiles" => {
                let mut ps = Vec::new();
                for p in value.split('|') {
                    ps.push(profile_bits(p, flag)?);
                }
                f.profiles = Some(ps);
            }
            "soft" => f.soft = true,
            _ => {
                return Err(CliError(format!(
                    "-{flag}: unknown balance filter `{name}` (profiles, usage, devid, drange, \
                     vrange, limit, stripes, convert, soft)"
                )))
            }
        }
    }
    if f.soft && f.convert.is_none() {
        return Err(CliError(format!(
            "-{flag}: the soft filter only goes with convert"
        )));
    }
    Ok(f)
}

/// The balance a `start` asks for.
fn start_request(
    data: &Option<String>,
    metadata: &Option<String>,
    system: &Option<String>,
    full: bool,
    force: bool,
) -> Result<BalanceRequest, CliError> {
    let mut r = BalanceRequest {
        force,
        ..BalanceRequest::default()
    };
    if let Some(s) = data {
        r.data = Some(parse_filters(s, 'd')?);
    }
    if let Some(s) = metadata {
        r.metadata = Some(parse_filters(s, 'm')?);
    }
    if let Some(s) = system {
        if !force {
            return Err(CliError(
                "refusing to explicitly operate on system chunks: pass --force if you really \
                 want to do that"
                    .into(),
            ));
        }
        r.system = Some(parse_filters(s, 's')?);
    } else if r.metadata.is_some() {
        // As btrfs-progs: system chunks get what metadata chunks get.
        r.system = r.metadata.clone();
    }
    if r.data.is_none() && r.metadata.is_none() && r.system.is_none() {
        if !full {
            return Err(CliError(
                "a balance without filters moves every block group: give --full-balance, or \
                 filters such as -dusage=50 -musage=50"
                    .into(),
            ));
        }
        r.data = Some(BalanceFilters::default());
        r.metadata = Some(BalanceFilters::default());
        r.system = Some(BalanceFilters::default());
    }
    Ok(r)
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
            let request = start_request(&data, &metadata, &system, full, force)?;
            run(&image, Some(&request))
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

/// A balance through a running butter mount (IMAGE is its mount point): the kernel's balance
/// ioctl, which the mount serves.
fn run_mounted(dir: &Path, request: Option<&BalanceRequest>) -> CliResult {
    let Some(request) = request else {
        return Err(CliError(format!(
            "{} is a directory: resume, status and cancel work on an image (unmount it first)",
            dir.display()
        )));
    };
    const BTRFS_IOC_BALANCE_V2: u32 = 0xc400_9420;
    let mut args = request.to_ioctl_args(None);
    super::progress::dir_ioctl(dir, BTRFS_IOC_BALANCE_V2, &mut args).map_err(|e| {
        CliError(format!(
            "balance through the mount at {} failed: {e} (is it a butter mount, and are you root?)",
            dir.display()
        ))
    })?;
    let stat = 16 + 3 * 136;
    let word = |i: usize| {
        u64::from_le_bytes(
            args[stat + 8 * i..stat + 8 * i + 8]
                .try_into()
                .unwrap_or([0; 8]),
        )
    };
    println!(
        "Done, had to relocate {} out of {} chunks",
        word(2),
        word(1)
    );
    Ok(())
}

fn run(image: &Path, request: Option<&BalanceRequest>) -> CliResult {
    if image.is_dir() {
        return run_mounted(image, request);
    }
    let fs = super::subvol::open_rw(image)?;
    let interrupted = Arc::new(AtomicBool::new(false));
    let hooks: Vec<_> = [signal_hook::consts::SIGINT, signal_hook::consts::SIGTERM]
        .iter()
        .filter_map(|&s| signal_hook::flag::register(s, interrupted.clone()).ok())
        .collect();
    let mut line = super::progress::StatusLine::new();
    let flag = interrupted.clone();
    let r = fs.balance(request, &mut |m| line.show(m), &mut |_, _| {
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

fn describe(name: &str, f: &BalanceFilters) -> String {
    let mut parts = Vec::new();
    if let Some(p) = f.convert {
        parts.push(format!("converting to {}", block_group_profile(p)));
    }
    if f.soft {
        parts.push("soft".into());
    }
    if let Some(ps) = &f.profiles {
        let names: Vec<&str> = ps.iter().map(|&p| block_group_profile(p)).collect();
        parts.push(format!("profiles={}", names.join("|")));
    }
    if let Some((lo, hi)) = f.usage {
        parts.push(format!("usage={lo}..{hi}"));
    }
    if let Some(d) = f.devid {
        parts.push(format!("devid={d}"));
    }
    if let Some((s, e)) = f.drange {
        parts.push(format!("drange={s}..{e}"));
    }
    if let Some((s, e)) = f.vrange {
        parts.push(format!("vrange={s}..{e}"));
    }
    if let Some((lo, hi)) = f.limit {
        parts.push(format!("limit={lo}..{hi}"));
    }
    if let Some((lo, hi)) = f.stripes {
        parts.push(format!("stripes={lo}..{hi}"));
    }
    if parts.is_empty() {
        parts.push("every block group".into());
    }
    format!("  {name}: {}", parts.join(", "))
}

fn status(image: &Path) -> CliResult {
    let fs = super::open_fs(image)?;
    let Some(r) = fs.paused_balance()? else {
        println!("No balance found on '{}'", image.display());
        return Ok(());
    };
    println!("Balance on '{}' is paused", image.display());
    for (name, f) in [
        ("data", &r.data),
        ("metadata", &r.metadata),
        ("system", &r.system),
    ] {
        if let Some(f) = f {
            println!("{}", describe(name, f));
        }
    }
    println!(
        "`butter balance resume {}` continues it, `butter balance cancel {}` drops it",
        image.display(),
        image.display()
    );
    Ok(())
}
