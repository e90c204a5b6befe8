//! `butter mkfs [OPTIONS] IMAGE`: make a new, empty btrfs filesystem (see `butter::mkfs`).
//!
//! Options follow mkfs.btrfs: `-b` size (created or extended when IMAGE is a regular file),
//! `-n`/`-s` node and sector size, `--csum`, `-m`/`-d` profiles, `-O`/`-R` features, `-L`,
//! `-U`, `-f`, `-q`. SOURCE_DATE_EPOCH in the environment fixes every timestamp and derives
//! the other uuids from the fsid, so the same options and `-U` give a byte-identical image.

use super::{CliError, CliResult};
use butter::device::FileDevice;
use butter::format::csum::CsumType;
use butter::format::*;
use butter::mkfs::{MkfsOptions, MkfsReport, Profile};
use std::io::Write;
use std::path::{Path, PathBuf};

#[derive(clap::Args)]
pub struct MkfsArgs {
    /// Image file or block device.
    pub image: PathBuf,
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
    #[arg(long = "csum", visible_alias = "checksum", value_parser = parse_csum)]
    pub csum: Option<CsumType>,
    /// Metadata profile: single or dup (default dup).
    #[arg(short = 'm', long = "metadata", value_parser = parse_profile)]
    pub metadata: Option<Profile>,
    /// Data profile: single or dup (default single).
    #[arg(short = 'd', long = "data", value_parser = parse_profile)]
    pub data: Option<Profile>,
    /// Features, comma separated, `^` turns one off: no-holes, skinny-metadata,
    /// free-space-tree; `list-all` lists them.
    #[arg(short = 'O', long = "features")]
    pub features: Vec<String>,
    /// Runtime features (mkfs.btrfs 6.2 puts free-space-tree here); same syntax as -O.
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

fn parse_profile(s: &str) -> Result<Profile, String> {
    match s.to_ascii_lowercase().as_str() {
        "single" => Ok(Profile::Single),
        "dup" => Ok(Profile::Dup),
        _ => Err(format!(
            "profile `{s}` is not supported on one device (single, dup)"
        )),
    }
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
fn human(n: u64) -> String {
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
    if let Some(l) = &a.label {
        o.label = l.clone();
    }
    o.fsid = a.uuid;
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

fn print_summary(out: &mut impl Write, r: &MkfsReport, image: &Path) -> std::io::Result<()> {
    let label = if r.label.is_empty() {
        "(null)".to_string()
    } else {
        r.label.clone()
    };
    let profile_name = |flags: u64| {
        if flags & BLOCK_GROUP_DUP != 0 {
            "DUP"
        } else {
            "single"
        }
    };
    writeln!(out, "butter mkfs")?;
    writeln!(out, "Label:              {label}")?;
    writeln!(out, "UUID:               {}", fmt_uuid(&r.fsid))?;
    writeln!(out, "Node size:          {}", r.nodesize)?;
    writeln!(out, "Sector size:        {}", r.sectorsize)?;
    writeln!(out, "Filesystem size:    {}", human(r.total_bytes))?;
    writeln!(out, "Block group profiles:")?;
    for (name, ty) in [
        ("Data", BLOCK_GROUP_DATA),
        ("Metadata", BLOCK_GROUP_METADATA),
        ("System", BLOCK_GROUP_SYSTEM),
    ] {
        for c in r.chunks.iter().filter(|c| c.flags & ty != 0) {
            writeln!(
                out,
                "  {:<18}{:<8}{:>17}",
                format!("{name}:"),
                profile_name(c.flags),
                human(c.length)
            )?;
        }
    }
    let mut incompat = vec!["extref"];
    if r.incompat_flags & INCOMPAT_SKINNY_METADATA != 0 {
        incompat.push("skinny-metadata");
    }
    if r.incompat_flags & INCOMPAT_NO_HOLES != 0 {
        incompat.push("no-holes");
    }
    writeln!(out, "Incompat features:  {}", incompat.join(", "))?;
    let runtime = if r.compat_ro_flags & COMPAT_RO_FREE_SPACE_TREE != 0 {
        "free-space-tree"
    } else {
        "none"
    };
    writeln!(out, "Runtime features:   {runtime}")?;
    writeln!(out, "Checksum:           {}", r.csum.name())?;
    writeln!(out, "Number of devices:  1")?;
    writeln!(out, "Devices:")?;
    writeln!(out, "   ID        SIZE  PATH")?;
    writeln!(
        out,
        "    1  {:>10}  {}",
        human(r.total_bytes),
        image.display()
    )?;
    writeln!(out)?;
    Ok(())
}

pub fn mkfs(a: MkfsArgs) -> CliResult {
    let Some(opts) = options(&a)? else {
        let mut out = std::io::stdout().lock();
        writeln!(out, "Filesystem features available:")?;
        for (name, help) in FEATURES {
            writeln!(out, "{name:<20}- {help}")?;
        }
        return Ok(());
    };
    if let Some(dir) = mounted_at(&a.image) {
        return Err(CliError(format!(
            "{} is mounted on {dir}; unmount it first",
            a.image.display()
        )));
    }
    // After the mount check: a mounted image is never extended.
    let created = prepare_image(&a.image, a.byte_count)?;
    let result = make(&a, opts);
    if result.is_err() && created {
        // Leave nothing behind for a file this command created.
        let _ = std::fs::remove_file(&a.image);
    }
    result
}

fn make(a: &MkfsArgs, opts: MkfsOptions) -> CliResult {
    let dev = FileDevice::open(&a.image, true)
        .map_err(|e| CliError(format!("cannot open {}: {e}", a.image.display())))?;
    if !a.force {
        if let Some(sig) = butter::mkfs::existing_signature(&dev)? {
            return Err(CliError(format!(
                "{} appears to contain an existing filesystem ({sig}); use -f to overwrite it",
                a.image.display()
            )));
        }
    }
    let mut o = opts;
    if let Some(b) = a.byte_count {
        o.size = b;
    }
    let report = butter::mkfs::mkfs(&dev, &o).map_err(|e| {
        CliError(format!(
            "cannot make a filesystem on {}: {e}",
            a.image.display()
        ))
    })?;
    if !a.quiet {
        let mut out = std::io::stdout().lock();
        print_summary(&mut out, &report, &a.image)?;
        out.flush()?;
    }
    Ok(())
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
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(1 << 30), "1.00GiB");
        assert_eq!(human(53673984), "51.19MiB");
        assert_eq!(human(8 << 20), "8.00MiB");
    }
}
