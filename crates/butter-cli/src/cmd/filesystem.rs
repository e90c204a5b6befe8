//! `butter filesystem df|usage|du|label|resize`: the space of an image's block groups, its
//! allocation on the device, the disk use of files, the label, as `btrfs filesystem df`,
//! `usage`, `du` and `label` show them, and a device's size changed offline.
//!
//! What `usage` cannot read from an image, because the running kernel makes it up at mount:
//! the global block reserve (printed as the kernel sizes it from the on-disk sizes of the
//! extent, checksum, free space and block group trees, with nothing of it in use) and the
//! statfs free space (computed as the kernel's statfs computes it from the block groups and
//! the unallocated device space, with that reserve). A kernel whose formulas differ prints
//! other numbers on those two lines.

use super::{CliError, CliResult};
use butter::format::print::{block_group_kind, block_group_profile};
use butter::fs::{Fs, Inode};
use std::collections::HashSet;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum FilesystemCmd {
    /// Size and use of the block groups per type and profile (Data, System, Metadata), as
    /// `btrfs filesystem df` prints them, as of the last commit.
    Df {
        /// Image file or block device.
        image: PathBuf,
    },
    /// Allocation of the device and use of the block groups, as `btrfs filesystem usage`
    /// prints them for a mounted filesystem, as of the last commit (single device).
    Usage {
        /// Sizes in bytes.
        #[arg(short = 'b', long = "raw")]
        raw: bool,
        /// Image file or block device.
        image: PathBuf,
    },
    /// Disk use of files and directories, as `btrfs filesystem du` prints it: each file's
    /// extents (Total), those no other file, subvolume or snapshot refers to (Exclusive),
    /// and per argument the shared bytes counted once (Set shared).
    Du {
        /// Only a total for each argument.
        #[arg(short = 's', long = "summarize")]
        summarize: bool,
        /// Sizes in bytes.
        #[arg(long = "raw")]
        raw: bool,
        /// Image file or block device.
        image: PathBuf,
        /// Files and directories inside the image (relative to the default subvolume).
        #[arg(required = true)]
        paths: Vec<std::ffi::OsString>,
        #[command(flatten)]
        start: super::paths::Start,
    },
    /// The filesystem's label, UUID and devices with their sizes and use, as `btrfs
    /// filesystem show` prints them (give the other devices with --device).
    Show {
        /// Image file or block device.
        image: PathBuf,
    },
    /// Change the size of a device of the filesystem offline, as `btrfs filesystem resize`
    /// does on a mount: SIZE sets it (suffixes K, M, G, T, P, E: powers of 1024), +SIZE and
    /// -SIZE change it by that much, max makes it the device's whole length, min the smallest
    /// it can be: block groups past the new end are relocated below it first (their extents
    /// and tree blocks moved, as the kernel's shrink does). DEVID: picks the device (1 when
    /// not given). A regular image file is extended to a larger size first and cut to a
    /// smaller one after.
    Resize {
        /// Image file or block device, or the mount point of a running `butter mount` (the
        /// resize then runs in the mount).
        image: PathBuf,
        /// The new size: [DEVID:][+|-]SIZE, [DEVID:]max or [DEVID:]min.
        #[arg(
            allow_hyphen_values = true,
            value_name = "[DEVID:][+|-]SIZE|max|min",
            required_unless_present = "shrink_to_min"
        )]
        size: Option<String>,
        /// The same as the size `min`: device 1 as small as relocation can make it.
        #[arg(long = "shrink-to-min", conflicts_with = "size")]
        shrink_to_min: bool,
    },
    /// Print the label, or set it to NEW (at most 255 bytes).
    Label {
        /// Image file or block device.
        image: PathBuf,
        /// The new label.
        new: Option<String>,
    },
}

#[derive(clap::Args)]
pub struct FilesystemArgs {
    #[command(subcommand)]
    pub cmd: FilesystemCmd,
}

pub fn filesystem(a: FilesystemArgs) -> CliResult {
    match a.cmd {
        FilesystemCmd::Df { image } => {
            let fs = super::open_fs(&image)?;
            for u in fs.space_usage()? {
                println!(
                    "{}, {}: total={}, used={}",
                    block_group_kind(u.flags),
                    block_group_profile(u.flags),
                    super::mkfs::human(u.total),
                    super::mkfs::human(u.used)
                );
            }
            Ok(())
        }
        FilesystemCmd::Usage { raw, image } => {
            let fs = super::open_fs(&image)?;
            print!("{}", usage(&fs, &image, raw)?);
            Ok(())
        }
        FilesystemCmd::Du {
            summarize,
            raw,
            image,
            paths,
            start,
        } => {
            let fs = super::open_fs(&image)?;
            du(&fs, start, &paths, summarize, raw)
        }
        FilesystemCmd::Show { image } => {
            let fs = super::open_fs(&image)?;
            print!("{}", show(&fs)?);
            Ok(())
        }
        FilesystemCmd::Resize {
            image,
            size,
            shrink_to_min,
        } => {
            let spec = match (size, shrink_to_min) {
                (Some(s), _) => s,
                (None, _) => "min".to_string(),
            };
            resize(&image, &spec)
        }
        FilesystemCmd::Label { image, new: None } => {
            let fs = super::open_fs(&image)?;
            println!("{}", fs.label());
            Ok(())
        }
        FilesystemCmd::Label {
            image,
            new: Some(label),
        } => {
            let fs = super::subvol::open_rw(&image)?;
            fs.set_label(&label)
                .map_err(|e| CliError(format!("cannot set the label: {}", CliError::from(e))))?;
            fs.close()?;
            Ok(())
        }
    }
}

/// A resize request: which device, and what its size becomes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NewSize {
    To(u64),
    Grow(u64),
    Shrink(u64),
    Max,
    Min,
}

/// `[DEVID:][+|-]SIZE|max|min`, as btrfs-progs spells it.
fn parse_resize(spec: &str) -> Result<(u64, NewSize), CliError> {
    let bad = |why: &str| {
        CliError(format!(
            "resize `{spec}`: {why}; give [DEVID:][+|-]SIZE, [DEVID:]max or [DEVID:]min \
             (for example +1G, 2:-500M, max)"
        ))
    };
    let (devid, rest) = match spec.split_once(':') {
        Some((d, r)) => (
            d.parse::<u64>()
                .map_err(|_| bad(&format!("`{d}` is not a device id")))?,
            r,
        ),
        None => (1, spec),
    };
    let size = |t: &str| super::mkfs::parse_size(t).map_err(|e| bad(&e));
    let what = match rest {
        "max" => NewSize::Max,
        "min" => NewSize::Min,
        r if r.starts_with('+') => NewSize::Grow(size(&r[1..])?),
        r if r.starts_with('-') => NewSize::Shrink(size(&r[1..])?),
        r => NewSize::To(size(r)?),
    };
    Ok((devid, what))
}

/// `butter filesystem resize IMAGE [DEVID:][+|-]SIZE|max|min`.
fn resize(image: &std::path::Path, spec: &str) -> Result<(), CliError> {
    if image.is_dir() {
        return resize_mounted(image, spec);
    }
    parse_resize(spec)?;
    let fs = super::subvol::open_rw(image)?;
    let mut line = super::progress::StatusLine::new();
    let r = resize_on(&fs, spec, &mut |m| line.show(m));
    line.end();
    let done = r?;
    fs.close()?;
    println!("{done}");
    Ok(())
}

/// Resize through a running butter mount (IMAGE is its mount point): the kernel's
/// BTRFS_IOC_RESIZE with the same size syntax, which the mount serves (an image file grows
/// or is cut under it).
fn resize_mounted(dir: &std::path::Path, spec: &str) -> Result<(), CliError> {
    const BTRFS_IOC_RESIZE: u32 = 0x5000_9403;
    parse_resize(spec)?;
    let mut args = vec![0u8; 4096];
    if spec.len() >= 4088 {
        return Err(CliError(format!("resize `{spec}`: too long")));
    }
    args[8..8 + spec.len()].copy_from_slice(spec.as_bytes());
    let mut line = super::progress::StatusLine::new();
    line.show(&format!("resizing ({spec}) through the mount"));
    let r = super::progress::dir_ioctl(dir, BTRFS_IOC_RESIZE, &mut args);
    line.end();
    r.map_err(|e| {
        CliError(format!(
            "cannot resize ({spec}) through the mount at {}: {e} (the mount's log says why)",
            dir.display()
        ))
    })?;
    println!("Resized ({spec}) through the mount at {}", dir.display());
    Ok(())
}

/// Resizes a device of `fs` (open read-write) as `spec` says (`[DEVID:][+|-]SIZE|max|min`)
/// and commits; an image file grows first or is cut after. Returns what to tell the user.
pub(crate) fn resize_on(
    fs: &Fs,
    spec: &str,
    progress: &mut dyn FnMut(&str),
) -> Result<String, CliError> {
    use butter::io::device::BlockDevice;
    let (devid, what) = parse_resize(spec)?;
    let devs = fs.devices()?;
    let Some(d) = devs.iter().find(|d| d.devid == devid) else {
        let ids: Vec<String> = devs.iter().map(|d| d.devid.to_string()).collect();
        return Err(CliError(format!(
            "the filesystem has no device {devid} (its devices: {})",
            ids.join(", ")
        )));
    };
    let Some(path) = d.path.clone() else {
        return Err(CliError(format!(
            "device {devid} is missing: give it with --device to resize it"
        )));
    };
    let cur = d.size;
    let path = PathBuf::from(&path);
    // The device's length now (a file or partition may have grown since it was opened).
    let dev_len = || -> Result<u64, CliError> {
        if let Some(m) = std::fs::metadata(&path)
            .ok()
            .filter(|m| m.file_type().is_file())
        {
            return Ok(m.len());
        }
        match path.to_str().and_then(butter::io::nbd::Address::parse) {
            Some(addr) => {
                let addr = addr.map_err(CliError)?;
                let d = butter::io::nbd::NbdDevice::open(&addr)
                    .map_err(|e| CliError(format!("{}: {e}", path.display())))?;
                Ok(d.len())
            }
            None => {
                let d = butter::io::device::FileDevice::open(&path, false)
                    .map_err(|e| CliError(format!("cannot open {}: {e}", path.display())))?;
                Ok(d.len())
            }
        }
    };
    let target = match what {
        NewSize::To(n) => Some(n),
        NewSize::Grow(n) => Some(cur.saturating_add(n)),
        NewSize::Shrink(n) => Some(cur.checked_sub(n).ok_or_else(|| {
            CliError(format!(
                "device {devid} is {} ({cur} bytes): it cannot shrink by {n} bytes",
                super::mkfs::human(cur)
            ))
        })?),
        NewSize::Max => Some(dev_len()?),
        NewSize::Min => None,
    };
    let r = match target {
        Some(t) => fs.resize_device(devid, t, progress),
        None => fs.shrink_device_to_min(devid, progress),
    };
    let new = r.map_err(|e| {
        CliError(format!(
            "cannot resize device {devid}: {}",
            CliError::from(e)
        ))
    })?;
    Ok(format!(
        "Resize device id {devid} ({}) from {} to {}",
        path.display(),
        super::mkfs::human(cur),
        super::mkfs::human(new)
    ))
}

/// `btrfs filesystem show` of one filesystem.
fn show(fs: &Fs) -> Result<String, CliError> {
    let sb = &fs.disk().sb;
    let label = fs.label();
    let label = if label.is_empty() {
        "none".to_string()
    } else {
        format!("'{label}'")
    };
    let devices = fs.devices()?;
    let mut out = format!(
        "Label: {label}  uuid: {}\n\tTotal devices {} FS bytes used {}\n",
        butter::format::fmt_uuid(&sb.fsid),
        devices.len(),
        super::mkfs::human(sb.bytes_used)
    );
    let mut missing = false;
    for d in &devices {
        match &d.path {
            Some(p) => out.push_str(&format!(
                "\tdevid {:>4} size {} used {} path {p}\n",
                d.devid,
                super::mkfs::human(d.size),
                super::mkfs::human(d.used)
            )),
            None => {
                missing = true;
                out.push_str(&format!(
                    "\tdevid {:>4} size {} used {} path <missing disk> MISSING\n",
                    d.devid,
                    super::mkfs::human(d.size),
                    super::mkfs::human(d.used)
                ));
            }
        }
    }
    if missing {
        out.push_str("\t*** Some devices missing\n");
    }
    out.push('\n');
    Ok(out)
}

// Block group type and profile bits (the on-disk format's).
const BG_DATA: u64 = 1 << 0;
const BG_SYSTEM: u64 = 1 << 1;
const BG_METADATA: u64 = 1 << 2;
const BG_TYPE_MASK: u64 = BG_DATA | BG_SYSTEM | BG_METADATA;
const BG_RAID0: u64 = 1 << 3;
const BG_RAID1: u64 = 1 << 4;
const BG_DUP: u64 = 1 << 5;
const BG_RAID10: u64 = 1 << 6;
const BG_RAID5: u64 = 1 << 7;
const BG_RAID6: u64 = 1 << 8;
const BG_RAID1C3: u64 = 1 << 9;
const BG_RAID1C4: u64 = 1 << 10;
const BG_PROFILE_MASK: u64 =
    BG_RAID0 | BG_RAID1 | BG_DUP | BG_RAID10 | BG_RAID5 | BG_RAID6 | BG_RAID1C3 | BG_RAID1C4;
const BG_RAID1_MASK: u64 = BG_RAID1 | BG_RAID1C3 | BG_RAID1C4;

/// Copies of each byte a profile keeps.
fn ncopies(flags: u64) -> u64 {
    match flags & BG_PROFILE_MASK {
        BG_RAID1 | BG_DUP | BG_RAID10 => 2,
        BG_RAID1C3 => 3,
        BG_RAID1C4 => 4,
        _ => 1,
    }
}

/// A size as btrfs-progs prints it: bytes (`raw`; `signed` reads the value as negative
/// when its top bit is set), or in binary units with two decimals of the value cut to the
/// unit below first (1536 is 1.50KiB, 0 is 0.00B), computed in single precision as progs
/// does.
pub(crate) fn pretty(n: u64, raw: bool, signed: bool) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if raw {
        return if signed {
            (n as i64).to_string()
        } else {
            n.to_string()
        };
    }
    let mut divs = 0;
    let fraction = if signed && (n as i64) < 0 {
        let mut v = n as i64;
        let mut last = v;
        while v.unsigned_abs() >= 1024 {
            last = v;
            v /= 1024;
            divs += 1;
        }
        let base = if divs == 0 { 1.0 } else { 1024.0f32 };
        last as f32 / base
    } else {
        let mut v = n;
        let mut last = v;
        while v >= 1024 {
            last = v;
            v /= 1024;
            divs += 1;
        }
        let base = if divs == 0 { 1.0 } else { 1024.0f32 };
        last as f32 / base
    };
    format!("{:.2}{}", f64::from(fraction), UNITS[divs])
}

/// progs' order of block group kinds: data, then metadata, then system; profiles in bit
/// order within a kind.
fn cmp_block_groups(a: u64, b: u64) -> std::cmp::Ordering {
    let mask = if a & BG_TYPE_MASK == b & BG_TYPE_MASK {
        BG_PROFILE_MASK
    } else if b & BG_SYSTEM != 0 {
        return std::cmp::Ordering::Less;
    } else if a & BG_SYSTEM != 0 {
        return std::cmp::Ordering::Greater;
    } else {
        BG_TYPE_MASK
    };
    (a & mask).cmp(&(b & mask))
}

/// The bytes a chunk entry takes on its device, as progs counts them.
fn chunk_size_on_device(a: &butter::inode::statfs::ChunkAllocation) -> u64 {
    if a.flags & (BG_RAID1_MASK | BG_DUP) != 0 {
        return a.bytes;
    }
    let parity = match a.flags & BG_PROFILE_MASK {
        BG_RAID5 => 1,
        BG_RAID6 => 2,
        _ => 0,
    };
    let sub = if a.flags & BG_RAID10 != 0 { 2 } else { 1 };
    let div = (u64::from(a.num_stripes).saturating_sub(parity) / sub).max(1);
    a.bytes / div
}

fn usage(fs: &Fs, image: &std::path::Path, raw: bool) -> Result<String, CliError> {
    use std::fmt::Write;
    let mut spaces = fs.space_usage()?;
    spaces.sort_by(|a, b| cmp_block_groups(a.flags, b.flags));
    if spaces.is_empty() {
        return Err(CliError("no chunks found".into()));
    }
    if spaces.iter().any(|s| s.flags & (BG_RAID5 | BG_RAID6) != 0) {
        return Err(CliError("RAID5/6 block groups are not supported".into()));
    }
    let chunks = fs.chunk_allocations();
    let sb = &fs.disk().sb;
    let devid = sb.dev_item.devid;
    let dev_size = sb.dev_item.total_bytes;
    let device_size = fs.disk().dev().len();
    let slack = if device_size > 0 {
        device_size.wrapping_sub(dev_size)
    } else {
        0
    };
    // As the kernel sizes it at mount (Core::statfs).
    let reserve = fs.statfs()?.reserve;

    let (mut r_data_used, mut r_data_chunks, mut l_data_chunks) = (0u64, 0u64, 0u64);
    let (mut r_meta_used, mut r_meta_chunks, mut l_meta_chunks) = (0u64, 0u64, 0u64);
    let (mut r_sys_used, mut r_sys_chunks) = (0u64, 0u64);
    let mut max_ratio = 1.0f64;
    let mut mixed = false;
    for s in &spaces {
        let ratio = ncopies(s.flags);
        max_ratio = max_ratio.max(ratio as f64);
        if s.flags & (BG_DATA | BG_METADATA) == BG_DATA | BG_METADATA {
            mixed = true;
        }
        if s.flags & BG_DATA != 0 {
            r_data_used = r_data_used.saturating_add(s.used.saturating_mul(ratio));
            r_data_chunks = r_data_chunks.saturating_add(s.total.saturating_mul(ratio));
            l_data_chunks = l_data_chunks.saturating_add(s.total);
        }
        if s.flags & BG_METADATA != 0 {
            r_meta_used = r_meta_used.saturating_add(s.used.saturating_mul(ratio));
            r_meta_chunks = r_meta_chunks.saturating_add(s.total.saturating_mul(ratio));
            l_meta_chunks = l_meta_chunks.saturating_add(s.total);
        }
        if s.flags & BG_SYSTEM != 0 {
            r_sys_used = r_sys_used.saturating_add(s.used.saturating_mul(ratio));
            r_sys_chunks = r_sys_chunks.saturating_add(s.total.saturating_mul(ratio));
        }
    }
    let mut r_total_chunks = r_data_chunks.saturating_add(r_sys_chunks);
    let mut r_total_used = r_data_used.saturating_add(r_sys_used);
    if !mixed {
        r_total_chunks = r_total_chunks.saturating_add(r_meta_chunks);
        r_total_used = r_total_used.saturating_add(r_meta_used);
    }
    let r_total_unused = dev_size.wrapping_sub(r_total_chunks);
    let data_ratio = r_data_chunks as f64 / l_data_chunks as f64;
    let meta_ratio = if mixed {
        data_ratio
    } else {
        r_meta_chunks as f64 / l_meta_chunks as f64
    };
    // progs' arithmetic: u64 divided by a double, truncated back.
    let mut free_est = (r_data_chunks.wrapping_sub(r_data_used) as f64 / data_ratio) as u64;
    if mixed {
        // The reserve, none of it in use, comes off the shared space.
        free_est = free_est.wrapping_sub(reserve);
    }
    let mut free_min = free_est;
    if r_total_unused >= 16 << 20 {
        free_est = (free_est as f64 + r_total_unused as f64 / data_ratio) as u64;
        free_min = (free_min as f64 + r_total_unused as f64 / max_ratio) as u64;
    }
    let statfs_free = statfs_free(fs, &spaces, &chunks);

    let w = if raw { 18 } else { 10 };
    let p = |n: u64| pretty(n, raw, false);
    let mut o = String::new();
    let _ = writeln!(o, "Overall:");
    let _ = writeln!(o, "    Device size:\t\t{:>w$}", p(dev_size));
    let _ = writeln!(o, "    Device allocated:\t\t{:>w$}", p(r_total_chunks));
    let _ = writeln!(
        o,
        "    Device unallocated:\t\t{:>w$}",
        pretty(r_total_unused, raw, true)
    );
    let _ = writeln!(o, "    Device missing:\t\t{:>w$}", p(0));
    let _ = writeln!(o, "    Device slack:\t\t{:>w$}", p(slack));
    let _ = writeln!(o, "    Used:\t\t\t{:>w$}", p(r_total_used));
    let _ = writeln!(
        o,
        "    Free (estimated):\t\t{:>w$}\t(min: {})",
        p(free_est),
        p(free_min)
    );
    let _ = writeln!(o, "    Free (statfs, df):\t\t{:>w$}", p(statfs_free));
    let _ = writeln!(o, "    Data ratio:\t\t\t{data_ratio:>w$.2}");
    let _ = writeln!(o, "    Metadata ratio:\t\t{meta_ratio:>w$.2}");
    let _ = writeln!(
        o,
        "    Global reserve:\t\t{:>w$}\t(used: {})",
        p(reserve),
        p(0)
    );
    let multi = multiple_profiles(&spaces);
    if multi.is_empty() {
        let _ = writeln!(o, "    Multiple profiles:\t\t{:>w$}", "no");
    } else {
        let _ = writeln!(o, "    Multiple profiles:\t\t{:>w$}\t({multi})", "yes");
    }
    let _ = writeln!(o);
    let path = image.display();
    for s in &spaces {
        let pct = 100.0f32 * s.used as f32 / (s.total.wrapping_add(1)) as f32;
        let _ = writeln!(
            o,
            "{},{}: Size:{}, Used:{} ({:.2}%)",
            block_group_kind(s.flags),
            block_group_profile(s.flags),
            p(s.total),
            p(s.used),
            f64::from(pct)
        );
        let on_dev: u64 = chunks
            .iter()
            .filter(|c| c.flags == s.flags && c.devid == devid)
            .map(chunk_size_on_device)
            .fold(0u64, u64::saturating_add);
        if on_dev > 0 {
            let _ = writeln!(o, "   {path}\t{:>10}", p(on_dev));
        }
        let _ = writeln!(o);
    }
    if !chunks.is_empty() {
        let all: u64 = chunks
            .iter()
            .filter(|c| c.devid == devid)
            .map(chunk_size_on_device)
            .fold(0u64, u64::saturating_add);
        let _ = writeln!(o, "Unallocated:");
        let _ = writeln!(
            o,
            "   {path}\t{:>10}",
            pretty(dev_size.wrapping_sub(all), raw, true)
        );
    }
    Ok(o)
}

/// What statfs(2) says is free for data, as the kernel's btrfs_statfs computes it: the free
/// bytes of the data block groups, plus the unallocated device space a data chunk could
/// still take (aligned to 64 KiB, less the first MiB), per copy, cut to whole sectors. The
/// kernel's zero when metadata is full and the reserve no longer fits is a runtime state
/// an idle image is never in; it is left out.
fn statfs_free(
    fs: &Fs,
    spaces: &[butter::inode::statfs::SpaceUsage],
    chunks: &[butter::inode::statfs::ChunkAllocation],
) -> u64 {
    const STRIPE_LEN: u64 = 64 << 10;
    let sb = &fs.disk().sb;
    let mut free_data = 0u64;
    let mut factor = 1u64;
    let mut data_flags = 0u64;
    for s in spaces.iter().filter(|s| s.flags & BG_DATA != 0) {
        let f = ncopies(s.flags);
        free_data = free_data.saturating_add(s.total.saturating_sub(s.used).saturating_mul(f));
        factor = f;
        data_flags = s.flags;
    }
    let allocated: u64 = chunks
        .iter()
        .filter(|c| c.devid == sb.dev_item.devid)
        .map(chunk_size_on_device)
        .fold(0u64, u64::saturating_add);
    let min_stripe = if data_flags & BG_DUP != 0 {
        2 * STRIPE_LEN
    } else {
        STRIPE_LEN
    };
    let mut avail = sb.dev_item.total_bytes.saturating_sub(allocated);
    avail -= avail % STRIPE_LEN;
    let unalloc = if avail <= (1 << 20) + min_stripe {
        0
    } else {
        avail - (1 << 20)
    };
    let copies = if data_flags & BG_RAID1_MASK != 0 {
        ncopies(data_flags)
    } else {
        1
    };
    let bavail = (free_data / factor).saturating_add(unalloc.saturating_mul(copies) / factor);
    let sector = u64::from(sb.sectorsize.max(1));
    bavail / sector * sector
}

/// The kinds of block groups that have more than one profile ("data, metadata"), as progs
/// lists them; empty when none has.
fn multiple_profiles(spaces: &[butter::inode::statfs::SpaceUsage]) -> String {
    // Data, metadata, mixed, system: their profiles, with "single" as a bit of its own.
    const SINGLE: u64 = 1 << 48;
    let mut seen = [0u64; 4];
    for s in spaces {
        let mut p = s.flags & BG_PROFILE_MASK;
        if p == 0 {
            p = SINGLE;
        }
        let i = if s.flags & (BG_DATA | BG_METADATA) == BG_DATA | BG_METADATA {
            2
        } else if s.flags & BG_DATA != 0 {
            0
        } else if s.flags & BG_METADATA != 0 {
            1
        } else {
            3
        };
        seen[i] |= p;
    }
    let names = ["data", "metadata", "data+metadata", "system"];
    names
        .iter()
        .zip(seen)
        .filter(|(_, p)| p.count_ones() > 1)
        .map(|(n, _)| *n)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One argument's walk: the inodes seen (a file with several names counts once) and the
/// shared ranges of the files below a top-level directory, as FIEMAP reports them
/// (start, length).
struct DuWalk<'a> {
    fs: &'a Fs,
    summarize: bool,
    raw: bool,
    seen: HashSet<Inode>,
}

/// Bytes in the union of ranges `(start, len)`.
fn union_bytes(mut r: Vec<(u64, u64)>) -> u64 {
    r.sort_unstable();
    let mut total = 0u64;
    let mut cur: Option<(u64, u64)> = None; // [start, end)
    for (s, l) in r {
        let e = s.saturating_add(l);
        match cur {
            Some((cs, ce)) if s < ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total = total.saturating_add(ce - cs);
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    if let Some((cs, ce)) = cur {
        total = total.saturating_add(ce - cs);
    }
    total
}

fn du(
    fs: &Fs,
    start: super::paths::Start,
    paths: &[std::ffi::OsString],
    summarize: bool,
    raw: bool,
) -> CliResult {
    println!(
        "{:>10}  {:>10}  {:>10}  Filename",
        "Total", "Exclusive", "Set shared"
    );
    let mut failed = false;
    for p in paths {
        let mut w = DuWalk {
            fs,
            summarize,
            raw,
            seen: HashSet::new(),
        };
        let r = start
            .resolve(fs, p)
            .and_then(|ino| w.add(&p.to_string_lossy(), ino, None, true).map(|_| ()));
        if let Err(e) = r {
            eprintln!(
                "ERROR: cannot check space of '{}': {e}",
                p.to_string_lossy()
            );
            failed = true;
        }
    }
    if failed {
        return Err(CliError("some paths could not be measured".into()));
    }
    Ok(())
}

impl DuWalk<'_> {
    /// Measures `ino` (named `path`), prints its line, and returns its (total, shared)
    /// bytes; shared ranges go to `set` (a top-level directory's collection).
    fn add(
        &mut self,
        path: &str,
        ino: Inode,
        set: Option<&mut Vec<(u64, u64)>>,
        top: bool,
    ) -> Result<(u64, u64), CliError> {
        let st = self.fs.stat(ino)?;
        if !st.is_reg() && !st.is_dir() {
            return Ok((0, 0));
        }
        // The placeholder of a subvolume a snapshot does not hold has no tree of its own.
        if ino.ino != butter::fs::EMPTY_SUBVOL_DIR_OBJECTID && !self.seen.insert(ino) {
            return Ok((0, 0));
        }
        let (mut total, mut shared) = (0u64, 0u64);
        let mut set_shared = None;
        if st.is_reg() {
            let mut set = set;
            for e in self.fs.extent_sharing(ino)? {
                // FIEMAP: inline extents take no data space; a compressed extent reports its
                // start on disk, a plain one where the item's part starts.
                if e.inline || e.length == 0 {
                    continue;
                }
                total = total.saturating_add(e.length);
                if e.shared {
                    shared = shared.saturating_add(e.length);
                    if let Some(s) = set.as_deref_mut() {
                        let phys = if e.compression != 0 {
                            e.disk_bytenr
                        } else {
                            e.disk_bytenr.saturating_add(e.extent_offset)
                        };
                        s.push((phys, e.length));
                    }
                }
            }
        } else {
            let mut own = Vec::new();
            let mut set = if top { Some(&mut own) } else { set };
            let mut after = 0;
            loop {
                let batch = self.fs.readdir(ino, after, 512)?;
                let Some(last) = batch.last() else {
                    break;
                };
                after = last.index;
                for e in batch {
                    let ty = e.mode_type();
                    if ty != libc::S_IFREG && ty != libc::S_IFDIR {
                        continue;
                    }
                    let name = String::from_utf8_lossy(&e.name);
                    let child = if path.is_empty() || path.ends_with('/') {
                        format!("{path}{name}")
                    } else {
                        format!("{path}/{name}")
                    };
                    let (t, s) = self.add(&child, e.target, set.as_deref_mut(), false)?;
                    total = total.saturating_add(t);
                    shared = shared.saturating_add(s);
                }
            }
            if top {
                set_shared = Some(union_bytes(own));
            }
        }
        if !self.summarize || top {
            let third = if top {
                pretty(set_shared.unwrap_or(shared), self.raw, false)
            } else {
                "-".to_string()
            };
            println!(
                "{:>10}  {:>10}  {:>10}  {}",
                pretty(total, self.raw, false),
                pretty(total.wrapping_sub(shared), self.raw, false),
                third,
                path
            );
        }
        Ok((total, shared))
    }
}
