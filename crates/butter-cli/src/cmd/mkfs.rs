//! `butter mkfs [OPTIONS] IMAGE`: make a new, empty btrfs filesystem (see `butter::mkfs`).
//!
//! Options follow mkfs.btrfs: `-b` size (created or extended when IMAGE is a regular file),
//! `-n`/`-s` node and sector size, `--csum`, `-m`/`-d` profiles, `-O`/`-R` features, `-L`,
//! `-U`, `-f`, `-q`. SOURCE_DATE_EPOCH in the environment fixes every timestamp and derives
//! the other uuids from the fsid, so the same options and `-U` give a byte-identical image;
//! DETERMINISTIC_SEED (as btrfs-progs' reproducible-build proposal names it) fixes the fsid
//! too when `-U` is not given, so builders need no new flag. `--rootdir DIR` copies a tree
//! in through the write engine; with `--reflink` the files' data is cloned into the image
//! file instead of written, the image's bytes unchanged (`reflink`).

use super::docs::{suggest, COMPRESS_VALUES};
use super::{CliError, CliResult};
use butter::format::csum::CsumType;
use butter::format::print::{block_group_kind, block_group_profile};
use butter::format::*;
use butter::io::device::FileDevice;
use butter::mkfs::{MkfsOptions, MkfsReport, Profile};
use std::io::Write;
use std::path::{Path, PathBuf};

mod prefetch;
mod reflink;

#[derive(clap::Args)]
pub struct MkfsArgs {
    /// Image file or block device (not needed with `-O list-all`).
    pub image: Option<PathBuf>,
    /// More image files or block devices: the filesystem spans them all, IMAGE as device 1
    /// and these as devices 2, 3, ... (as `--device PATH` does too).
    #[arg(value_name = "DEVICE")]
    pub more: Vec<PathBuf>,
    /// Size of the filesystem (suffixes K, M, G, T, P, E; powers of 1024). A regular file
    /// that is missing or smaller is created or extended to this size.
    #[arg(short = 'b', long = "byte-count", value_parser = parse_size)]
    pub byte_count: Option<u64>,
    /// Tree block size in bytes (default 16384).
    #[arg(short = 'n', long = "nodesize", value_parser = parse_size)]
    pub nodesize: Option<u64>,
    /// Data block size in bytes (default 4096).
    #[arg(short = 's', long = "sectorsize", value_parser = parse_size)]
    pub sectorsize: Option<u64>,
    /// Checksum algorithm: crc32c, xxhash, sha256 or blake2.
    #[arg(
        long = "csum",
        visible_alias = "checksum",
        value_parser = suggest(parse_csum, &["crc32c", "xxhash", "sha256", "blake2"]),
        hide_possible_values = true
    )]
    pub csum: Option<CsumType>,
    /// Metadata profile: single, dup, raid0, raid1, raid1c3, raid1c4, raid10, raid5 or
    /// raid6 (default dup on one device, raid1 on several).
    #[arg(
        short = 'm',
        long = "metadata",
        value_parser = suggest(parse_profile, PROFILE_NAMES),
        hide_possible_values = true
    )]
    pub metadata: Option<Profile>,
    /// Data profile: single, dup, raid0, raid1, raid1c3, raid1c4, raid10, raid5 or raid6
    /// (default single).
    #[arg(
        short = 'd',
        long = "data",
        value_parser = suggest(parse_profile, PROFILE_NAMES),
        hide_possible_values = true
    )]
    pub data: Option<Profile>,
    /// Features, comma separated, `^` turns one off: no-holes, skinny-metadata,
    /// free-space-tree, block-group-tree (on by default); `list-all` lists them.
    #[arg(
        short = 'O',
        long = "features",
        value_parser = suggest(
            clap::builder::StringValueParser::new(),
            &["list-all", "block-group-tree", "^block-group-tree", "free-space-tree", "no-holes", "skinny-metadata"]
        ),
        hide_possible_values = true
    )]
    pub features: Vec<String>,
    /// Runtime features (older mkfs.btrfs put free-space-tree here); same syntax as -O.
    #[arg(short = 'R', long = "runtime-features")]
    pub runtime_features: Vec<String>,
    /// Filesystem label (at most 255 bytes).
    #[arg(short = 'L', long = "label")]
    pub label: Option<String>,
    /// Filesystem uuid (random by default).
    #[arg(short = 'U', long = "uuid", value_parser = parse_uuid)]
    pub uuid: Option<[u8; 16]>,
    /// Overwrite an existing filesystem.
    #[arg(short = 'f', long = "force")]
    pub force: bool,
    /// Print nothing but errors.
    #[arg(short = 'q', long = "quiet")]
    pub quiet: bool,
    /// Copy the tree at DIR into the new filesystem (files, holes, links, devices, modes,
    /// owners, times, xattrs). Without -b, a missing or empty IMAGE file is sized to fit.
    #[arg(short = 'r', long = "rootdir", value_name = "DIR")]
    pub rootdir: Option<PathBuf>,
    /// With --rootdir: make the directory SUBDIR (relative to DIR) a subvolume. TYPE is rw
    /// (the default), ro (read-only), default (the subvolume a mount without subvol= shows)
    /// or default-ro (both). May repeat (one default at most); nested ones work.
    #[arg(long = "subvol", value_name = "[TYPE:]SUBDIR", requires = "rootdir")]
    pub subvol: Vec<String>,
    /// With --rootdir: compress the copied files' data with ALGO (zlib, lzo, zstd; no or none
    /// for none) at LEVEL (zlib 1-9, zstd 1-15; 3 when not given), piece by piece: a piece
    /// that does not shrink is stored plain. Uses every CPU.
    #[arg(
        long = "compress",
        value_name = "ALGO[:LEVEL]",
        requires = "rootdir",
        value_parser = suggest(clap::builder::StringValueParser::new(), COMPRESS_VALUES),
        hide_possible_values = true
    )]
    pub compress: Option<String>,
    /// With --rootdir: give the file or directory PATH (relative to DIR) the inode FLAGS,
    /// comma separated: nodatacow (no copy on write, no checksums), nodatasum (no
    /// checksums). A directory passes them to everything below it, but not into subvolumes.
    /// May repeat.
    #[arg(long = "inode-flags", value_name = "FLAGS:PATH", requires = "rootdir")]
    pub inode_flags: Vec<String>,
    /// With --rootdir: shrink the filesystem, and a regular image file, to what it holds (new
    /// chunks are kept small, 8 MiB of data each, as mkfs.btrfs keeps them).
    #[arg(long = "shrink", requires = "rootdir")]
    pub shrink: bool,
    /// With --rootdir: clone the files' data into IMAGE (FICLONERANGE) instead of writing
    /// it, where IMAGE and DIR are on one filesystem that can (btrfs, xfs): the image's data
    /// shares its blocks with the files. The image's bytes are the same as without it; where
    /// cloning is refused the data is written, with a warning when nothing could be cloned.
    /// Data is stored uncompressed (--compress is ignored, as mkfs.btrfs does). IMAGE must
    /// be a regular file.
    #[arg(long = "reflink", requires = "rootdir")]
    pub reflink: bool,
    /// Do not discard the device's blocks first (accepted as mkfs.btrfs takes it; butter
    /// never discards).
    #[arg(short = 'K', long = "nodiscard")]
    pub nodiscard: bool,
}

/// A `--subvol` request: the path below the rootdir and whether it ends read-only.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubvolSpec {
    pub path: PathBuf,
    pub readonly: bool,
    /// `default:` or `default-ro:`: the subvolume a mount without subvol= shows.
    pub default: bool,
}

/// An `--inode-flags` request: the path below the rootdir and the flags it gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InodeFlagsSpec {
    pub path: PathBuf,
    pub nodatacow: bool,
    pub nodatasum: bool,
}

/// Parses `--inode-flags FLAGS:PATH` and checks PATH exists below `rootdir`.
fn parse_inode_flags(spec: &str, rootdir: &Path) -> Result<InodeFlagsSpec, CliError> {
    let Some((flags, sub)) = spec.split_once(':') else {
        return Err(CliError(format!(
            "--inode-flags {spec}: expected FLAGS:PATH, e.g. nodatacow:var/lib/images"
        )));
    };
    let (mut nodatacow, mut nodatasum) = (false, false);
    for f in flags.split(',') {
        match f {
            "nodatacow" => nodatacow = true,
            "nodatasum" => nodatasum = true,
            other => {
                return Err(CliError(format!(
                    "--inode-flags {spec}: unknown flag {other:?} (nodatacow, nodatasum)"
                )))
            }
        }
    }
    let path = PathBuf::from(sub.trim_end_matches('/'));
    if sub.is_empty()
        || path.is_absolute()
        || path
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(CliError(format!(
            "--inode-flags {spec}: give a path relative to the --rootdir directory, without . \
             or .."
        )));
    }
    let full = rootdir.join(&path);
    std::fs::symlink_metadata(&full)
        .map_err(|e| CliError(format!("--inode-flags {spec}: {}: {e}", full.display())))?;
    Ok(InodeFlagsSpec {
        path,
        nodatacow,
        nodatasum,
    })
}

/// Parses `--subvol [TYPE:]SUBDIR` and checks SUBDIR is a directory below `rootdir`.
fn parse_subvol(spec: &str, rootdir: &Path) -> Result<SubvolSpec, CliError> {
    let (readonly, default, sub) = match spec.split_once(':') {
        Some(("rw", s)) => (false, false, s),
        Some(("ro", s)) => (true, false, s),
        Some(("default", s)) => (false, true, s),
        Some(("default-ro", s)) => (true, true, s),
        _ => (false, false, spec),
    };
    let path = PathBuf::from(sub.trim_end_matches('/'));
    if sub.is_empty()
        || path.is_absolute()
        || path
            .components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(CliError(format!(
            "--subvol {spec}: give a path relative to the --rootdir directory, without . or .."
        )));
    }
    let full = rootdir.join(&path);
    match std::fs::symlink_metadata(&full) {
        Ok(m) if m.is_dir() => Ok(SubvolSpec {
            path,
            readonly,
            default,
        }),
        Ok(_) => Err(CliError(format!(
            "--subvol {spec}: {} is not a directory",
            full.display()
        ))),
        Err(e) => Err(CliError(format!(
            "--subvol {spec}: {}: {e}",
            full.display()
        ))),
    }
}

/// A size with an optional binary suffix: 4096, 16k, 128M, 2G, 1T.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (a number with an optional K/M/G/T/P/E)"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kib" | "kb" => 10,
        "m" | "mib" | "mb" => 20,
        "g" | "gib" | "gb" => 30,
        "t" | "tib" | "tb" => 40,
        "p" | "pib" | "pb" => 50,
        "e" | "eib" | "eb" => 60,
        _ => return Err(format!("`{s}`: unknown size suffix `{suffix}`")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}` is too large"))
}

fn parse_csum(s: &str) -> Result<CsumType, String> {
    match s.to_ascii_lowercase().as_str() {
        "crc32c" => Ok(CsumType::Crc32c),
        "xxhash" | "xxhash64" => Ok(CsumType::Xxhash64),
        "sha256" => Ok(CsumType::Sha256),
        "blake2" | "blake2b" => Ok(CsumType::Blake2b),
        _ => Err(format!(
            "unknown checksum `{s}` (crc32c, xxhash, sha256, blake2)"
        )),
    }
}

/// The profiles -m and -d take, as mkfs.btrfs spells them.
const PROFILE_NAMES: &[&str] = &[
    "single", "dup", "raid0", "raid1", "raid1c3", "raid1c4", "raid10", "raid5", "raid6",
];

fn parse_profile(s: &str) -> Result<Profile, String> {
    s.parse()
}

/// A uuid as 32 hex digits, with or without the usual dashes.
pub fn parse_uuid(s: &str) -> Result<[u8; 16], String> {
    let hex: Vec<u8> = s.bytes().filter(|&c| c != b'-').collect();
    let bad = || format!("`{s}` is not a uuid (like 01234567-89ab-cdef-0123-456789abcdef)");
    if hex.len() != 32 {
        return Err(bad());
    }
    let mut out = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        let txt = std::str::from_utf8(pair).map_err(|_| bad())?;
        out[i] = u8::from_str_radix(txt, 16).map_err(|_| bad())?;
    }
    Ok(out)
}

/// The features `-O`/`-R` know: name, what it sets, help text.
const FEATURES: &[(&str, &str)] = &[
    (
        "no-holes",
        "no explicit hole extents for files (incompat NO_HOLES)",
    ),
    (
        "skinny-metadata",
        "reduced-size metadata extent refs (incompat SKINNY_METADATA)",
    ),
    (
        "free-space-tree",
        "free space tree, space_cache=v2 (compat_ro FREE_SPACE_TREE)",
    ),
    (
        "block-group-tree",
        "block group items in a tree of their own, faster mounts (compat_ro BLOCK_GROUP_TREE; \
         on by default, as in mkfs.btrfs 6.19)",
    ),
];

/// Applies one comma-separated feature list; `Ok(true)` when `list-all` asked for the list.
fn apply_features(list: &str, opts: &mut MkfsOptions) -> Result<bool, CliError> {
    for f in list.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        let (on, name) = match f.strip_prefix('^') {
            Some(n) => (false, n),
            None => (true, f),
        };
        match name.to_ascii_lowercase().as_str() {
            "list-all" => return Ok(true),
            "no-holes" | "no_holes" => opts.no_holes = on,
            "skinny-metadata" | "skinny_metadata" => opts.skinny_metadata = on,
            "free-space-tree" | "free_space_tree" | "fst" => opts.free_space_tree = on,
            "block-group-tree" | "block_group_tree" | "bgt" => opts.block_group_tree = on,
            "extref" | "mixed-backref" if on => {} // always on
            other => {
                return Err(CliError(format!(
                    "feature `{other}` is not supported by butter mkfs{}; known: {}",
                    if on { "" } else { " (or cannot be turned off)" },
                    FEATURES
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", ")
                )))
            }
        }
    }
    Ok(false)
}

/// Human size the way mkfs.btrfs prints it: 1.00GiB, 51.19MiB.
pub(crate) fn human(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n}.00B")
    } else {
        format!("{v:.2}{}", units[u])
    }
}

/// The options from the command line and the environment.
fn options(a: &MkfsArgs) -> Result<Option<MkfsOptions>, CliError> {
    let mut o = MkfsOptions::default();
    if let Some(n) = a.nodesize {
        o.nodesize =
            u32::try_from(n).map_err(|_| CliError(format!("node size {n} is too large")))?;
    }
    if let Some(s) = a.sectorsize {
        o.sectorsize =
            u32::try_from(s).map_err(|_| CliError(format!("sector size {s} is too large")))?;
    }
    if let Some(c) = a.csum {
        o.csum = c;
    }
    if let Some(p) = a.metadata {
        o.metadata = p;
    }
    if let Some(p) = a.data {
        o.data = p;
    }
    for l in a.features.iter().chain(&a.runtime_features) {
        if apply_features(l, &mut o)? {
            return Ok(None);
        }
    }
    // The block group tree needs the free space tree and no-holes: turning either off takes
    // the default block group tree with it (asking for both is refused by mkfs itself).
    let named = |f: &str| {
        a.features
            .iter()
            .chain(&a.runtime_features)
            .flat_map(|l| l.split(','))
            .any(|x| {
                let x = x.trim().trim_start_matches('^').to_ascii_lowercase();
                x == f || x == f.replace('-', "_")
            })
    };
    let bgt_named = named("block-group-tree") || named("bgt");
    if !(o.free_space_tree && o.no_holes || bgt_named) {
        o.block_group_tree = false;
    }
    if let Some(l) = &a.label {
        o.label = l.clone();
    }
    o.fsid = a.uuid;
    if o.fsid.is_none() {
        if let Some(seed) = std::env::var_os("DETERMINISTIC_SEED")
            .map(|v| v.to_string_lossy().into_owned())
            .filter(|v| !v.is_empty() && v != "0")
        {
            o.fsid = Some(butter::mkfs::derived_uuid(
                &[0u8; 16],
                &format!("DETERMINISTIC_SEED={seed}"),
            ));
        }
    }
    if let Some(v) = std::env::var_os("SOURCE_DATE_EPOCH") {
        let s = v.to_string_lossy();
        let t: u64 = s.trim().parse().map_err(|_| {
            CliError(format!(
                "SOURCE_DATE_EPOCH=`{s}` is not a number of seconds since 1970"
            ))
        })?;
        o.time = Some(t);
    }
    Ok(Some(o))
}

/// The NBD address `p` names (`nbd://...`, `nbd+unix://...`), if it is one.
fn nbd_address(p: &Path) -> Result<Option<butter::io::nbd::Address>, CliError> {
    match p.to_str().and_then(butter::io::nbd::Address::parse) {
        None => Ok(None),
        Some(Ok(a)) => Ok(Some(a)),
        Some(Err(e)) => Err(CliError(format!("{}: {e}", p.display()))),
    }
}

/// Creates or extends a regular image file to `size` bytes (a block device is left alone).
/// True when the file was created.
fn prepare_image(path: &Path, size: Option<u64>) -> Result<bool, CliError> {
    let meta = std::fs::metadata(path);
    match (meta, size) {
        (Ok(m), Some(size)) if m.file_type().is_file() && m.len() < size => {
            let f = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| CliError(format!("cannot open {}: {e}", path.display())))?;
            f.set_len(size)
                .map_err(|e| CliError(format!("cannot extend {}: {e}", path.display())))?;
        }
        (Ok(_), _) => {}
        (Err(e), Some(size)) if e.kind() == std::io::ErrorKind::NotFound => {
            let f = std::fs::File::create(path)
                .map_err(|e| CliError(format!("cannot create {}: {e}", path.display())))?;
            f.set_len(size)
                .map_err(|e| CliError(format!("cannot size {}: {e}", path.display())))?;
            return Ok(true);
        }
        (Err(e), None) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(CliError(format!(
                "{} does not exist; give -b SIZE to create an image file",
                path.display()
            )))
        }
        (Err(e), _) => return Err(CliError(format!("{}: {e}", path.display()))),
    }
    Ok(false)
}

/// Where `image` is mounted, if it is: directly (a block device), or through a loop device
/// backed by it. Like mkfs.btrfs, mkfs refuses a mounted device even with `-f`.
fn mounted_at(image: &Path) -> Option<String> {
    let canon = std::fs::canonicalize(image).ok()?;
    let mut sources = vec![canon.clone()];
    if let Ok(dir) = std::fs::read_dir("/sys/block") {
        for e in dir.flatten() {
            let backing = e.path().join("loop/backing_file");
            if let Ok(b) = std::fs::read_to_string(&backing) {
                if Path::new(b.trim_end_matches('\n')) == canon {
                    sources.push(Path::new("/dev").join(e.file_name()));
                }
            }
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    for line in mounts.lines() {
        let mut f = line.split(' ');
        let (Some(src), Some(dir)) = (f.next(), f.next()) else {
            continue;
        };
        let src = std::fs::canonicalize(src).unwrap_or_else(|_| PathBuf::from(src));
        if sources.contains(&src) {
            return Some(dir.replace("\\040", " "));
        }
    }
    None
}

fn print_summary(out: &mut impl Write, r: &MkfsReport, images: &[PathBuf]) -> std::io::Result<()> {
    let label = if r.label.is_empty() {
        "(null)".to_string()
    } else {
        r.label.clone()
    };
    writeln!(out, "butter mkfs")?;
    writeln!(out, "Label:              {label}")?;
    writeln!(out, "UUID:               {}", fmt_uuid(&r.fsid))?;
    writeln!(out, "Node size:          {}", r.nodesize)?;
    writeln!(out, "Sector size:        {}", r.sectorsize)?;
    writeln!(out, "Filesystem size:    {}", human(r.total_bytes))?;
    writeln!(out, "Block group profiles:")?;
    for kind in ["Data", "Metadata", "Data+Metadata", "System"] {
        for c in r
            .chunks
            .iter()
            .filter(|c| block_group_kind(c.flags) == kind)
        {
            writeln!(
                out,
                "  {:<18}{:<8}{:>17}",
                format!("{kind}:"),
                block_group_profile(c.flags),
                human(c.length)
            )?;
        }
    }
    // One line of features, as mkfs.btrfs 6.14 prints them.
    let features = r.feature_names();
    writeln!(out, "Features:           {}", features.join(", "))?;
    writeln!(out, "Checksum:           {}", r.csum.name())?;
    writeln!(out, "Number of devices:  {}", r.devices.len())?;
    writeln!(out, "Devices:")?;
    writeln!(out, "   ID        SIZE  PATH")?;
    for (d, path) in r.devices.iter().zip(images) {
        writeln!(
            out,
            "  {:>3}  {:>10}  {}",
            d.devid,
            human(d.size),
            path.display()
        )?;
    }
    writeln!(out)?;
    Ok(())
}

/// Warnings mkfs.btrfs gives about the profiles chosen (on stderr; the filesystem is made).
fn profile_warnings(o: &MkfsOptions, devices: usize) {
    let raid56 = [o.metadata, o.data]
        .iter()
        .any(|p| matches!(p, Profile::Raid5 | Profile::Raid6));
    if raid56 {
        eprintln!(
            "butter mkfs: warning: RAID5 and RAID6 lose data the kernel had written when power \
             fails during a write and a device is lost before the next scrub (the write \
             hole); keep metadata on raid1 or raid1c3"
        );
    }
    if devices > 1 && [o.metadata, o.data].contains(&Profile::Dup) {
        eprintln!(
            "butter mkfs: warning: DUP keeps both copies on one device; with {devices} devices, \
             raid1 survives losing one"
        );
    }
}

pub fn mkfs(a: MkfsArgs) -> CliResult {
    // Refused before anything is written.
    if let Some(v) = &a.compress {
        butter::format::compress::Compression::parse(v)
            .map_err(|e| CliError(format!("--compress {v}: {}", CliError::from(e))))?;
    }
    let Some(mut opts) = options(&a)? else {
        let mut out = std::io::stdout().lock();
        writeln!(out, "Filesystem features available:")?;
        for (name, help) in FEATURES {
            writeln!(out, "{name:<20}- {help}")?;
        }
        return Ok(());
    };
    let Some(image) = a.image.clone() else {
        return Err(CliError(
            "mkfs needs an IMAGE: the file or block device to make the filesystem on".into(),
        ));
    };
    // Every device, IMAGE first: the positional ones, then any --device.
    let mut images = vec![image.clone()];
    images.extend(a.more.iter().cloned());
    images.extend(super::other_devices().paths.iter().cloned());
    for (i, p) in images.iter().enumerate() {
        let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
        if images[..i].iter().any(|q| canon(q) == canon(p)) {
            return Err(CliError(format!(
                "{} is given twice; name each device once",
                p.display()
            )));
        }
    }
    let several = images.len() > 1;
    if several && a.metadata.is_none() {
        // As mkfs.btrfs: metadata on several devices is mirrored unless told otherwise.
        opts.metadata = Profile::Raid1;
    }
    for (what, p) in [("metadata", opts.metadata), ("data", opts.data)] {
        if images.len() < p.min_devices() {
            return Err(CliError(format!(
                "{} {what} needs at least {} devices and {} {} given; add devices, or choose \
                 another profile with -{}",
                p.name(),
                p.min_devices(),
                images.len(),
                if images.len() == 1 { "is" } else { "are" },
                if what == "data" { 'd' } else { 'm' }
            )));
        }
    }
    let is_nbd = |p: &Path| {
        p.to_str()
            .and_then(butter::io::nbd::Address::parse)
            .is_some()
    };
    for image in &images {
        if is_nbd(image) {
            continue;
        }
        if let Some(dir) = mounted_at(image) {
            return Err(CliError(format!(
                "{} is mounted on {dir}; unmount it first",
                image.display()
            )));
        }
    }
    if several && (a.reflink || a.shrink) {
        return Err(CliError(format!(
            "--{} works on a filesystem of one device; {} devices are given",
            if a.reflink { "reflink" } else { "shrink" },
            images.len()
        )));
    }
    if a.reflink {
        // Clones go into a file: a block device (or anything else) cannot take them.
        if let Ok(m) = std::fs::metadata(&image) {
            if !m.file_type().is_file() {
                return Err(CliError(format!(
                    "--reflink clones file data into an image file, and {} is not a regular \
                     file",
                    image.display()
                )));
            }
        }
    }
    let mut size = a.byte_count;
    if let Some(dir) = &a.rootdir {
        let meta = std::fs::metadata(dir)
            .map_err(|e| CliError(format!("--rootdir {}: {e}", dir.display())))?;
        if !meta.is_dir() {
            return Err(CliError(format!(
                "--rootdir {} is not a directory",
                dir.display()
            )));
        }
        // A missing image, or an empty regular file (image builders hand one over), is
        // sized to fit the tree.
        let empty_or_missing = |image: &Path| match std::fs::symlink_metadata(image) {
            Err(_) => !is_nbd(image),
            Ok(m) => m.file_type().is_file() && m.len() == 0,
        };
        if size.is_none() && images.iter().any(|i| empty_or_missing(i)) {
            if several {
                return Err(CliError(
                    "--rootdir on several devices needs their size: give -b SIZE (each \
                     device's) or devices that have one"
                        .into(),
                ));
            }
            let min = butter::mkfs::min_device_size(opts.metadata, opts.data);
            size = Some(rootdir::fitting_size(dir, min)?);
        }
    }
    // One writer: an image that a butter process has open read-write (or that backs a loop
    // device) is refused, -f or not, before a byte changes; the locks are held until mkfs
    // ends.
    let mut _sole_writer = Vec::new();
    for image in &images {
        if !is_nbd(image) && std::fs::metadata(image).is_ok() {
            _sole_writer.push(
                FileDevice::open_exclusive(image).map_err(|e| match e.kind() {
                    std::io::ErrorKind::PermissionDenied => CliError(format!(
                        "cannot open {} for writing: permission denied (run as a user who may \
                         write it, or as root)",
                        image.display()
                    )),
                    std::io::ErrorKind::ResourceBusy => {
                        CliError(format!("{} is in use: {e}", image.display()))
                    }
                    _ => CliError(format!("cannot open {}: {e}", image.display())),
                })?,
            );
        }
    }
    if a.rootdir.is_some() {
        catch_interrupts();
    }
    // After the mount check: a mounted image is never extended.
    let mut created = Vec::new();
    let mut prepared = Ok(());
    for image in images.iter().filter(|i| !is_nbd(i)) {
        match prepare_image(image, size) {
            Ok(true) => created.push(image.clone()),
            Ok(false) => {}
            Err(e) => {
                prepared = Err(e);
                break;
            }
        }
    }
    let result = prepared.and_then(|()| make(&a, &images, opts));
    if result.is_err() {
        // Leave nothing behind for a file this command created.
        for image in &created {
            let _ = std::fs::remove_file(image);
        }
    }
    if let (Err(e), true) = (&result, interrupted()) {
        let left = if created.contains(&image) {
            format!(
                "{} is removed (this command had created it)",
                image.display()
            )
        } else {
            format!(
                "{} is left unfinished: its superblocks say it is still being made, so no \
                 tool takes it for a filesystem",
                image.display()
            )
        };
        eprintln!("butter mkfs: {e}; {left}. Run the same butter mkfs again to make it.");
        std::process::exit(130);
    }
    result
}

/// Set by SIGINT, SIGTERM or SIGHUP during `mkfs --rootdir`: the copy stops at its next
/// step and the command says what it left behind.
fn stop_flag() -> &'static std::sync::Arc<std::sync::atomic::AtomicBool> {
    static FLAG: std::sync::OnceLock<std::sync::Arc<std::sync::atomic::AtomicBool>> =
        std::sync::OnceLock::new();
    FLAG.get_or_init(Default::default)
}

/// The first SIGINT/SIGTERM/SIGHUP asks the copy to stop; a second one ends the process at
/// once (the image stays unfinished either way: only a complete copy gets a valid superblock).
fn catch_interrupts() {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
    for sig in [SIGINT, SIGTERM, SIGHUP] {
        let registered =
            signal_hook::flag::register_conditional_shutdown(sig, 130, stop_flag().clone())
                .and_then(|_| signal_hook::flag::register(sig, stop_flag().clone()));
        if let Err(e) = registered {
            log::warn!("cannot catch signal {sig}: {e}");
        }
    }
}

/// Whether an interrupt asked `mkfs --rootdir` to stop.
fn interrupted() -> bool {
    stop_flag().load(std::sync::atomic::Ordering::SeqCst)
}

fn make(a: &MkfsArgs, images: &[PathBuf], opts: MkfsOptions) -> CliResult {
    let image = images[0].as_path();
    // Checked before anything is written.
    let mut subvols = Vec::new();
    if let Some(dir) = &a.rootdir {
        for spec in &a.subvol {
            let sv = parse_subvol(spec, dir)?;
            if subvols.iter().any(|s: &SubvolSpec| s.path == sv.path) {
                return Err(CliError(format!("--subvol {spec} is given twice")));
            }
            if sv.default && subvols.iter().any(|s: &SubvolSpec| s.default) {
                return Err(CliError(format!(
                    "--subvol {spec}: only one subvolume can be the default"
                )));
            }
            subvols.push(sv);
        }
    }
    let mut inode_flags = Vec::new();
    if let Some(dir) = &a.rootdir {
        for spec in &a.inode_flags {
            inode_flags.push(parse_inode_flags(spec, dir)?);
        }
    }
    let mut set: Vec<std::sync::Arc<dyn butter::io::device::BlockDevice>> =
        Vec::with_capacity(images.len());
    // The first device as a file (for --reflink's clones), unless it is an NBD export.
    let mut first_file: Option<std::sync::Arc<FileDevice>> = None;
    for image in images {
        let dev: std::sync::Arc<dyn butter::io::device::BlockDevice> = match nbd_address(image)? {
            Some(addr) => {
                let d = butter::io::nbd::NbdDevice::open(&addr)
                    .map_err(|e| CliError(format!("cannot connect to {}: {e}", image.display())))?;
                if !d.writable() {
                    return Err(CliError(format!(
                        "{}: the NBD server exports it read-only; export it writable to \
                         make a filesystem on it",
                        image.display()
                    )));
                }
                std::sync::Arc::new(d)
            }
            None => {
                let f = std::sync::Arc::new(
                    FileDevice::open(image, true)
                        .map_err(|e| CliError(format!("cannot open {}: {e}", image.display())))?,
                );
                if first_file.is_none() && set.is_empty() {
                    first_file = Some(f.clone());
                }
                f
            }
        };
        if !a.force {
            if let Some(sig) = butter::mkfs::existing_signature(dev.as_ref())? {
                return Err(CliError(format!(
                    "{} appears to contain an existing filesystem ({sig}); use -f to overwrite \
                     it",
                    image.display()
                )));
            }
        }
        set.push(dev);
    }
    let mut o = opts;
    if let Some(b) = a.byte_count {
        o.size = b;
    }
    if !a.quiet {
        profile_warnings(&o, images.len());
    }
    let report = butter::mkfs::mkfs_devices(&set, &o).map_err(|e| {
        let on = images
            .iter()
            .map(|i| i.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        CliError(format!("cannot make a filesystem on {on}: {e}"))
    })?;
    if let Some(dir) = &a.rootdir {
        // Reproducible images: subvolume uuids derived from the fsid, like mkfs's others.
        let uuid_seed = o.time.map(|_| report.fsid);
        if let Some(t) = o.time {
            // New inodes get their birth time from the engine's clock: pin it so the image
            // depends only on the tree and the options.
            if std::env::var_os("BUTTER_FIXED_TIME").is_none() {
                std::env::set_var("BUTTER_FIXED_TIME", t.to_string());
            }
        }
        let mut compress = match &a.compress {
            Some(v) => butter::format::compress::Compression::parse(v)
                .map_err(|e| CliError(format!("--compress {v}: {}", CliError::from(e))))?,
            None => None,
        };
        if a.reflink && compress.is_some() {
            // As mkfs.btrfs: a clone shares the source's plain bytes, so nothing is compressed.
            eprintln!(
                "butter mkfs: warning: --compress is ignored with --reflink: cloned data is \
                 stored uncompressed"
            );
            compress = None;
        }
        // Every piece that shrinks is compressed, whatever the file's start does (mkfs.btrfs
        // does not give up on a file after its first piece either).
        let opts = butter::fs::RwOptions {
            compress,
            compress_force: compress.is_some(),
            small_chunks: a.shrink,
            // As mkfs.btrfs: every file shorter than a sector is inline (the kernel's own
            // writes stop at 2048 bytes).
            max_inline: u64::from(o.sectorsize) - 1,
            // No valid superblock until the copy is complete (`close` below).
            unfinished: true,
            ..Default::default()
        };
        let cloning = if a.reflink {
            let Some(file) = first_file.clone() else {
                return Err(CliError(format!(
                    "--reflink clones file data into an image file, and {} is an NBD export",
                    image.display()
                )));
            };
            let c = reflink::CloningDevice::new(file, image, o.sectorsize).map_err(|e| {
                CliError(format!(
                    "--reflink: cannot open {} for clones: {e}",
                    image.display()
                ))
            })?;
            Some(std::sync::Arc::new(c))
        } else {
            None
        };
        let rw_dev: std::sync::Arc<dyn butter::io::device::BlockDevice> = match &cloning {
            Some(c) => c.clone(),
            None => set[0].clone(),
        };
        let mut given: Vec<(String, std::sync::Arc<dyn butter::io::device::BlockDevice>)> =
            vec![(image.display().to_string(), rw_dev)];
        for (p, d) in images.iter().zip(&set).skip(1) {
            given.push((p.display().to_string(), d.clone()));
        }
        let fs = butter::fs::Fs::open_device_set_rw_with(given, opts).map_err(|e| {
            CliError(format!(
                "cannot open the new filesystem on {}: {e}",
                image.display()
            ))
        })?;
        // Files read and compressed ahead on every CPU (not with --reflink: its clones are
        // matched to the copy's own reads).
        let prefetch = cloning
            .is_none()
            .then(|| prefetch::Prefetch::start(dir, compress, o.sectorsize));
        if interrupted() {
            return Err(CliError("interrupted before the copy began".into()));
        }
        let stats = rootdir::populate(
            &fs,
            dir,
            (&subvols, &inode_flags),
            uuid_seed,
            (cloning.as_deref(), prefetch.as_ref()),
            a.quiet,
        )
        .map_err(|e| match e {
            rootdir::Failure::Engine(butter::Error::NoSpace(why)) => CliError(format!(
                "the image is too small for {}: use a larger -b ({} bytes now; {why})",
                dir.display(),
                report.total_bytes
            )),
            rootdir::Failure::Engine(e) => CliError(format!(
                "cannot copy {} into {}: {}",
                dir.display(),
                image.display(),
                CliError::from(e)
            )),
            rootdir::Failure::Source(m) => CliError(m),
            rootdir::Failure::Interrupted(n) => CliError(format!(
                "interrupted after copying {n} files and directories"
            )),
        })?;
        let mut report = report;
        if a.shrink {
            let end = fs.shrink_to_fit().map_err(|e| {
                CliError(format!(
                    "cannot shrink {}: {}",
                    image.display(),
                    CliError::from(e)
                ))
            })?;
            report.total_bytes = end;
        }
        // The copy is complete: the final commit writes the real superblocks.
        fs.close().map_err(|e| {
            CliError(format!(
                "cannot finish the filesystem on {}: {}",
                image.display(),
                CliError::from(e)
            ))
        })?;
        drop(fs);
        let end = report.total_bytes;
        if a.shrink
            && std::fs::metadata(image).is_ok_and(|m| m.file_type().is_file() && m.len() > end)
        {
            std::fs::OpenOptions::new()
                .write(true)
                .open(image)
                .and_then(|f| f.set_len(end))
                .map_err(|e| {
                    CliError(format!(
                        "cannot cut {} to {end} bytes: {e}",
                        image.display()
                    ))
                })?;
        }
        let outcome = cloning.map(|c| c.outcome());
        if let Some(why) = outcome.as_ref().and_then(|o| o.no_effect.as_ref()) {
            eprintln!("butter mkfs: warning: --reflink had no effect, the data was written: {why}");
        }
        if !a.quiet {
            let mut out = std::io::stdout().lock();
            print_summary(&mut out, &report, images)?;
            writeln!(
                out,
                "Rootdir:            {} ({} inodes, {} of data)",
                dir.display(),
                stats.inodes,
                human(stats.bytes)
            )?;
            if let Some(o) = &outcome {
                writeln!(out, "Reflinked:          {}", human(o.cloned))?;
            }
            out.flush()?;
        }
        return Ok(());
    }
    if !a.quiet {
        let mut out = std::io::stdout().lock();
        print_summary(&mut out, &report, images)?;
        out.flush()?;
    }
    Ok(())
}

/// `--rootdir`: copying a directory tree into the new filesystem through the write engine.
mod rootdir {
    use super::prefetch::Prefetch;
    use super::reflink::CloningDevice;
    use super::CliError;
    use butter::format::items::Timespec;
    use butter::fs::{Fs, Inode};
    use butter::inode::namespace::{Owner, SetAttr};
    use std::collections::HashMap;
    use std::ffi::{CString, OsString};
    use std::fs::{File, Metadata};
    use std::io::Write;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
    use std::os::unix::io::AsRawFd;
    use std::path::Path;
    use std::time::{Duration, Instant};

    /// Commit after this much file data ...
    const COMMIT_BYTES: u64 = 64 << 20;
    /// ... or this many new inodes, so the running transaction stays bounded.
    const COMMIT_INODES: u64 = 20_000;
    /// Largest piece of file data read and written at once.
    const CHUNK: usize = 8 << 20;

    /// Why copying failed: the engine (ENOSPC is reported as "image too small"), or the
    /// source tree (a message naming the path).
    pub enum Failure {
        Engine(butter::Error),
        Source(String),
        /// A signal asked the copy to stop, after this many inodes.
        Interrupted(u64),
    }

    impl From<butter::Error> for Failure {
        fn from(e: butter::Error) -> Self {
            Failure::Engine(e)
        }
    }

    type R<T> = Result<T, Failure>;

    fn src_err(what: &str, p: &Path, e: std::io::Error) -> Failure {
        Failure::Source(format!("--rootdir: {what} {}: {e}", p.display()))
    }

    /// What was copied.
    #[derive(Default)]
    pub struct Stats {
        pub inodes: u64,
        pub bytes: u64,
    }

    /// A size for an image that holds `dir`: 1.5 x its allocated bytes (hard-linked inodes
    /// once) plus 2 KiB of metadata per inode and 256 MiB, in whole MiB, at least `min`.
    pub fn fitting_size(dir: &Path, min: u64) -> Result<u64, CliError> {
        let mut seen = std::collections::HashSet::new();
        let mut blocks: u64 = 0;
        let mut inodes: u64 = 0;
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            let rd = std::fs::read_dir(&d)
                .map_err(|e| CliError(format!("--rootdir: reading {}: {e}", d.display())))?;
            for e in rd {
                let e =
                    e.map_err(|e| CliError(format!("--rootdir: reading {}: {e}", d.display())))?;
                let p = e.path();
                let m = std::fs::symlink_metadata(&p)
                    .map_err(|e| CliError(format!("--rootdir: stat {}: {e}", p.display())))?;
                if m.nlink() > 1 && !m.is_dir() && !seen.insert((m.dev(), m.ino())) {
                    continue;
                }
                inodes += 1;
                blocks =
                    blocks.saturating_add(m.blocks().saturating_mul(512).max(m.len().min(4096)));
                if m.is_dir() {
                    stack.push(p);
                }
            }
        }
        let want = blocks
            .saturating_add(blocks / 2)
            .saturating_add(inodes.saturating_mul(2048))
            .saturating_add(256 << 20);
        let mib = 1u64 << 20;
        Ok(want.div_ceil(mib).saturating_mul(mib).max(min))
    }

    /// Progress on stderr, at most once a second, after the first second.
    struct Progress {
        quiet: bool,
        start: Instant,
        last: Instant,
        shown: bool,
        tty: bool,
    }

    impl Progress {
        fn tick(&mut self, s: &Stats) {
            if self.quiet || self.last.elapsed() < Duration::from_secs(1) {
                return;
            }
            self.last = Instant::now();
            self.shown = true;
            self.print(s, false);
        }

        fn print(&self, s: &Stats, last: bool) {
            let secs = self.start.elapsed().as_secs_f64();
            let line = format!(
                "copying: {} inodes, {} of data, {:.1}s",
                s.inodes,
                super::human(s.bytes),
                secs
            );
            let mut err = std::io::stderr().lock();
            let _ = if self.tty {
                write!(err, "\r{line}\x1b[K{}", if last { "\n" } else { "" })
            } else {
                writeln!(err, "{line}")
            };
        }

        fn done(&self, s: &Stats) {
            if self.shown {
                self.print(s, true);
            }
        }
    }

    struct Copier<'a> {
        fs: &'a Fs,
        /// --reflink: the image's device, told what each read of a source file holds.
        cloning: Option<&'a CloningDevice>,
        /// Small files read and compressed ahead.
        prefetch: Option<&'a Prefetch>,
        /// Hard-linked source inodes (st_dev, st_ino, subvolume) already copied, and where to
        /// (links cannot cross subvolumes: each subvolume gets its own copy).
        links: HashMap<(u64, u64, u64), Inode>,
        /// The --rootdir directory and the --subvol requests below it.
        src_root: &'a Path,
        subvols: &'a [super::SubvolSpec],
        /// The --inode-flags requests.
        inode_flags: &'a [super::InodeFlagsSpec],
        /// fsid to derive subvolume uuids from (reproducible images), else random ones.
        uuid_seed: Option<[u8; 16]>,
        /// Subvolumes to make read-only once filled.
        readonly: Vec<u64>,
        /// The subvolume `default:`/`default-ro:` named.
        default: Option<u64>,
        stats: Stats,
        since_commit_bytes: u64,
        since_commit_inodes: u64,
        progress: Progress,
    }

    fn ts(sec: i64, nsec: i64) -> Timespec {
        Timespec {
            sec,
            nsec: nsec.clamp(0, 999_999_999) as u32,
        }
    }

    fn owner(m: &Metadata) -> Owner {
        Owner {
            uid: m.uid(),
            gid: m.gid(),
        }
    }

    /// The attributes a copy ends with: times from the source, ctime = mtime (a normal tool
    /// cannot set ctime, and the source's ctime would make the image depend on when the
    /// tree was made).
    fn final_attrs(m: &Metadata) -> SetAttr {
        let mtime = ts(m.mtime(), m.mtime_nsec());
        SetAttr {
            atime: Some(ts(m.atime(), m.atime_nsec())),
            mtime: Some(mtime),
            ctime: Some(mtime),
            ..SetAttr::default()
        }
    }

    fn cpath(p: &Path) -> R<CString> {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| Failure::Source(format!("--rootdir: NUL in path {}", p.display())))
    }

    /// All xattrs of `p` (not following a symlink), sorted by name.
    fn xattrs(p: &Path) -> R<Vec<(Vec<u8>, Vec<u8>)>> {
        let c = cpath(p)?;
        let mut names = vec![0u8; 4096];
        let len = loop {
            // SAFETY: valid C path and a buffer of the given length.
            let n = unsafe { libc::llistxattr(c.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
            if n >= 0 {
                break n as usize;
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ERANGE) => names.resize(names.len() * 4, 0),
                Some(libc::ENOTSUP) => return Ok(Vec::new()),
                _ => return Err(src_err("listing xattrs of", p, e)),
            }
        };
        let mut out = Vec::new();
        for name in names[..len.min(names.len())]
            .split(|&b| b == 0)
            .filter(|n| !n.is_empty())
        {
            let cname = CString::new(name).map_err(|_| {
                Failure::Source(format!("--rootdir: bad xattr name on {}", p.display()))
            })?;
            let mut val = vec![0u8; 256];
            let vlen = loop {
                // SAFETY: valid C strings and a buffer of the given length.
                let n = unsafe {
                    libc::lgetxattr(
                        c.as_ptr(),
                        cname.as_ptr(),
                        val.as_mut_ptr().cast(),
                        val.len(),
                    )
                };
                if n >= 0 {
                    break Some(n as usize);
                }
                let e = std::io::Error::last_os_error();
                match e.raw_os_error() {
                    Some(libc::ERANGE) if val.len() < (1 << 20) => val.resize(val.len() * 8, 0),
                    // Gone since the listing.
                    Some(libc::ENODATA) => break None,
                    _ => {
                        return Err(src_err(
                            &format!("reading xattr {} of", String::from_utf8_lossy(name)),
                            p,
                            e,
                        ))
                    }
                }
            };
            if let Some(vlen) = vlen {
                val.truncate(vlen);
                out.push((name.to_vec(), val));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The names in directory `d`, sorted by their bytes.
    fn sorted_names(d: &Path) -> R<Vec<OsString>> {
        let mut names = Vec::new();
        for e in std::fs::read_dir(d).map_err(|e| src_err("reading", d, e))? {
            names.push(e.map_err(|e| src_err("reading", d, e))?.file_name());
        }
        names.sort_by(|a, b| a.as_bytes().cmp(b.as_bytes()));
        Ok(names)
    }

    impl Copier<'_> {
        fn count_inode(&mut self) -> R<()> {
            self.stats.inodes += 1;
            self.since_commit_inodes += 1;
            self.maybe_commit()
        }

        fn maybe_commit(&mut self) -> R<()> {
            if super::interrupted() {
                return Err(Failure::Interrupted(self.stats.inodes));
            }
            if self.since_commit_bytes >= COMMIT_BYTES || self.since_commit_inodes >= COMMIT_INODES
            {
                self.fs.commit()?;
                // Everything read so far is on the image now.
                if let Some(c) = self.cloning {
                    c.forget();
                }
                self.since_commit_bytes = 0;
                self.since_commit_inodes = 0;
            }
            self.progress.tick(&self.stats);
            Ok(())
        }

        fn set_xattrs(&mut self, ino: Inode, p: &Path) -> R<()> {
            for (name, value) in xattrs(p)? {
                self.fs
                    .setxattr(ino, &name, &value, 0)
                    .map_err(|e| match e {
                        butter::Error::NoSpace(_) if value.len() > 1024 => {
                            Failure::Source(format!(
                        "--rootdir: xattr {} of {} ({} bytes) does not fit in one tree item: {e}",
                        String::from_utf8_lossy(&name),
                        p.display(),
                        value.len()
                    ))
                        }
                        e => Failure::Engine(e),
                    })?;
            }
            Ok(())
        }

        /// Copies the children of source directory `src` into `dir` (depth first, sorted),
        /// then gives `dir` its attributes (last: adding entries changes its times).
        fn copy_dir(&mut self, src: &Path, dir: Inode) -> R<()> {
            let names = sorted_names(src)?;
            // Stat after reading: reading may have moved the atime (relatime), and a second
            // run must see the same atime as the first.
            let meta = std::fs::symlink_metadata(src).map_err(|e| src_err("stat", src, e))?;
            for name in names {
                let p = src.join(&name);
                let m = std::fs::symlink_metadata(&p).map_err(|e| src_err("stat", &p, e))?;
                self.copy_entry(&p, dir, name.as_bytes(), &m)?;
            }
            self.fs.setattr(dir, &final_attrs(&meta))?;
            Ok(())
        }

        fn copy_entry(&mut self, p: &Path, dir: Inode, name: &[u8], m: &Metadata) -> R<()> {
            let fs = self.fs;
            let key = (m.dev(), m.ino(), dir.root);
            if !m.is_dir() && m.nlink() > 1 {
                if let Some(&ino) = self.links.get(&key) {
                    fs.link(ino, dir, name)?;
                    // The new link changed the inode's ctime: put it back.
                    fs.setattr(ino, &final_attrs(m))?;
                    return Ok(());
                }
            }
            let mode = m.mode();
            let perm = mode & 0o7777;
            let ft = m.file_type();
            let mut after_read = None;
            let ino = if ft.is_dir() {
                let rel = p.strip_prefix(self.src_root).unwrap_or(p);
                let ino = match self.subvols.iter().find(|s| s.path == rel) {
                    Some(sv) => {
                        let uuid = self.uuid_seed.map(|f| {
                            butter::mkfs::derived_uuid(&f, &format!("subvolume {}", rel.display()))
                        });
                        let ino = fs.create_subvolume(dir, name, perm, owner(m), uuid)?;
                        if sv.readonly {
                            self.readonly.push(ino.root);
                        }
                        if sv.default {
                            self.default = Some(ino.root);
                        }
                        ino
                    }
                    None => fs.mkdir(dir, name, perm, owner(m))?,
                };
                self.apply_inode_flags(rel, ino)?;
                self.count_inode()?;
                self.set_xattrs(ino, p)?;
                return self.copy_dir(p, ino);
            } else if ft.is_symlink() {
                let target = std::fs::read_link(p).map_err(|e| src_err("readlink", p, e))?;
                // As for directories: the atime after readlink.
                after_read = Some(std::fs::symlink_metadata(p).map_err(|e| src_err("stat", p, e))?);
                fs.symlink(dir, name, target.as_os_str().as_bytes(), owner(m))
                    .map_err(|e| match e {
                        butter::Error::NameTooLong(why) => Failure::Source(format!(
                            "--rootdir: symlink {} cannot be stored: {why}",
                            p.display()
                        )),
                        e => Failure::Engine(e),
                    })?
            } else if ft.is_file() {
                let ino = fs.create(dir, name, perm, owner(m))?;
                self.apply_inode_flags(p.strip_prefix(self.src_root).unwrap_or(p), ino)?;
                self.copy_data(p, ino, m.len())?;
                ino
            } else {
                let rdev = m.rdev();
                // btrfs keeps the kernel's internal dev_t: major << 20 | minor.
                let (major, minor) = (libc::major(rdev) as u64, libc::minor(rdev) as u64);
                fs.mknod(dir, name, mode & 0o177777, (major << 20) | minor, owner(m))?
            };
            self.count_inode()?;
            self.set_xattrs(ino, p)?;
            fs.setattr(ino, &final_attrs(after_read.as_ref().unwrap_or(m)))?;
            if m.nlink() > 1 {
                self.links.insert(key, ino);
            }
            Ok(())
        }

        /// The --inode-flags that reach `rel`: those given for it or for a directory above it,
        /// unless a subvolume lies between (subvolumes do not inherit them).
        fn apply_inode_flags(&self, rel: &Path, ino: Inode) -> R<()> {
            let (mut cow, mut sum) = (false, false);
            for f in self.inode_flags {
                if !rel.starts_with(&f.path) {
                    continue;
                }
                let cut = self.subvols.iter().any(|s| {
                    s.path != f.path && s.path.starts_with(&f.path) && rel.starts_with(&s.path)
                });
                if !cut {
                    cow |= f.nodatacow;
                    sum |= f.nodatasum;
                }
            }
            if cow || sum {
                self.fs.set_data_flags(ino, cow, sum)?;
            }
            Ok(())
        }

        /// The data of regular file `p`: only the ranges SEEK_DATA finds (holes stay holes),
        /// then the size (a hole at the end).
        fn copy_data(&mut self, p: &Path, ino: Inode, size: u64) -> R<()> {
            if size == 0 {
                return Ok(());
            }
            // A whole file at once, read (and compressed) ahead: the same bytes and the same
            // writes whether a worker or this thread prepared them.
            let ready = self
                .prefetch
                .filter(|_| size <= super::prefetch::MAX_FILE)
                .and_then(|pf| pf.get(p, size));
            if let Some(r) = ready {
                let n = match &r.packed {
                    Some(z) => self.fs.write_precompressed(ino, 0, &r.data, z)?,
                    None => self.fs.write(ino, 0, &r.data)?,
                };
                if n < r.data.len() {
                    return Err(Failure::Engine(butter::Error::NoSpace(
                        "short write".into(),
                    )));
                }
                self.stats.bytes += size;
                self.since_commit_bytes += size;
                return self.maybe_commit();
            }
            // O_NOATIME: reading must not change the source (nor a second run's image).
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOATIME)
                .open(p)
                .or_else(|_| File::open(p))
                .map_err(|e| src_err("opening", p, e))?;
            let fd = f.as_raw_fd();
            let mut buf = vec![0u8; CHUNK.min(size as usize)];
            let mut pos: u64 = 0;
            let mut written_end: u64 = 0;
            while pos < size {
                // SAFETY: lseek on an open descriptor.
                let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
                if data < 0 {
                    let e = std::io::Error::last_os_error();
                    if e.raw_os_error() == Some(libc::ENXIO) {
                        break; // only a hole is left
                    }
                    return Err(src_err("SEEK_DATA in", p, e));
                }
                let data = data as u64;
                // SAFETY: as above.
                let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
                let hole = if hole < 0 {
                    size
                } else {
                    (hole as u64).min(size)
                };
                let mut off = data;
                while off < hole {
                    let want = ((hole - off) as usize).min(buf.len());
                    let n = f
                        .read_at(&mut buf[..want], off)
                        .map_err(|e| src_err("reading", p, e))?;
                    if n == 0 {
                        break; // shrank under us
                    }
                    if let Some(c) = self.cloning {
                        c.register(p, off, &buf[..n]);
                    }
                    let mut done = 0;
                    while done < n {
                        let w = self.fs.write(ino, off + done as u64, &buf[done..n])?;
                        if w == 0 {
                            return Err(Failure::Engine(butter::Error::NoSpace(
                                "short write".into(),
                            )));
                        }
                        done += w;
                    }
                    off += n as u64;
                    written_end = off;
                    self.stats.bytes += n as u64;
                    self.since_commit_bytes += n as u64;
                    self.maybe_commit()?;
                }
                if off < hole {
                    break;
                }
                pos = hole;
            }
            if written_end < size {
                self.fs.setattr(
                    ino,
                    &SetAttr {
                        size: Some(size),
                        ..SetAttr::default()
                    },
                )?;
            }
            Ok(())
        }
    }

    /// Copies the tree at `src` into the filesystem's root directory (which takes the
    /// attributes of `src`) and commits.
    pub fn populate(
        fs: &Fs,
        src: &Path,
        (subvols, inode_flags): (&[super::SubvolSpec], &[super::InodeFlagsSpec]),
        uuid_seed: Option<[u8; 16]>,
        (cloning, prefetch): (Option<&CloningDevice>, Option<&Prefetch>),
        quiet: bool,
    ) -> R<Stats> {
        let meta = std::fs::metadata(src).map_err(|e| src_err("stat", src, e))?;
        // SAFETY: isatty on a standard descriptor.
        let tty = unsafe { libc::isatty(2) } == 1;
        let now = Instant::now();
        let mut c = Copier {
            fs,
            cloning,
            prefetch,
            links: HashMap::new(),
            src_root: src,
            subvols,
            inode_flags,
            uuid_seed,
            readonly: Vec::new(),
            default: None,
            stats: Stats::default(),
            since_commit_bytes: 0,
            since_commit_inodes: 0,
            progress: Progress {
                quiet,
                start: now,
                last: now,
                shown: false,
                tty,
            },
        };
        let root = fs.root_inode();
        fs.setattr(
            root,
            &SetAttr {
                mode: Some(meta.mode() & 0o7777),
                uid: Some(meta.uid()),
                gid: Some(meta.gid()),
                ..SetAttr::default()
            },
        )?;
        c.set_xattrs(root, src)?;
        c.copy_dir(src, root)?;
        if let Some(id) = c.default {
            fs.set_default_subvolume(id)?;
        }
        for id in &c.readonly {
            fs.set_subvolume_readonly(*id, true)?;
        }
        fs.commit()?;
        if let Some(cl) = c.cloning {
            cl.forget();
        }
        c.progress.done(&c.stats);
        Ok(c.stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("16k"), Ok(16384));
        assert_eq!(parse_size("128M"), Ok(128 << 20));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1TiB"), Ok(1 << 40));
        assert!(parse_size("").is_err());
        assert!(parse_size("12Q").is_err());
        assert!(parse_size("M").is_err());
        assert!(parse_size("99999999E").is_err());
    }

    #[test]
    fn uuids() {
        let u = parse_uuid("01234567-89ab-cdef-0123-456789ABCDEF").unwrap();
        assert_eq!(fmt_uuid(&u), "01234567-89ab-cdef-0123-456789abcdef");
        assert_eq!(parse_uuid("0123456789abcdef0123456789abcdef"), Ok(u));
        assert!(parse_uuid("0123").is_err());
        assert!(parse_uuid("0123456789abcdef0123456789abcdeg").is_err());
    }

    #[test]
    fn features() {
        let mut o = MkfsOptions::default();
        assert!(!apply_features("^no-holes,^skinny-metadata", &mut o).unwrap());
        assert!(!o.no_holes && !o.skinny_metadata && o.free_space_tree);
        assert!(!apply_features("^free-space-tree", &mut o).unwrap());
        assert!(!o.free_space_tree);
        assert!(!apply_features("no-holes,free-space-tree", &mut o).unwrap());
        assert!(o.no_holes && o.free_space_tree);
        assert!(apply_features("list-all", &mut o).unwrap());
        assert!(apply_features("raid56", &mut o).is_err());
        assert!(apply_features("^extref", &mut o).is_err());
        assert!(!apply_features("^block-group-tree", &mut o).unwrap());
        assert!(!o.block_group_tree);
        assert!(!apply_features("block_group_tree", &mut o).unwrap());
        assert!(o.block_group_tree);
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(1 << 30), "1.00GiB");
        assert_eq!(human(53673984), "51.19MiB");
        assert_eq!(human(8 << 20), "8.00MiB");
    }
}
