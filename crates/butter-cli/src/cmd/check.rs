//! `butter check IMAGE`: read-only consistency check (see `butter::check`); with `--repair`,
//! what it knows how to mend, in one transaction written only when the checker finds the
//! result better (see `butter::check::repair`).

use super::{open_fs, CliError, CliResult};
use butter::check::Severity;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct CheckArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Also read every data block that has a checksum and compare (slow: reads all data).
    #[arg(long = "check-data-csum")]
    pub check_data_csum: bool,
    /// Mend what the checker knows how to, in one transaction that is written only when the
    /// checker, run again on the result, finds fewer problems and none new.
    #[arg(long = "repair", conflicts_with = "check_data_csum")]
    pub repair: bool,
    /// With --repair: print the changes a repair would make, write nothing.
    #[arg(long = "dry-run", requires = "repair")]
    pub dry_run: bool,
    /// With --repair: make the checksum tree again from the data first (every range a file
    /// uses read and summed, on every CPU), written only when the result has no new problem.
    #[arg(
        long = "init-csum-tree",
        requires = "repair",
        conflicts_with = "dry_run"
    )]
    pub init_csum_tree: bool,
    /// With --repair: make the extent tree again from the other trees first (every tree
    /// block and data extent they use, with the back references they call for; block
    /// groups' used bytes and the free space tree with them), written only when the result
    /// has no new problem.
    #[arg(
        long = "init-extent-tree",
        requires = "repair",
        conflicts_with = "dry_run"
    )]
    pub init_extent_tree: bool,
}

/// The block cache of a read-only check.
const CHECK_CACHE: u64 = 16 << 20;

pub fn check(a: CheckArgs) -> CliResult {
    if a.repair {
        return repair(&a);
    }
    let fs = open_fs(&a.image).map_err(|e| CliError(format!("{e}{}", size_hint(&a.image))))?;
    // The checker reads each tree block once, in one walk per tree: a small block cache
    // costs no time (measured on a 100k-file image: 0.57 s either way) and keeps the
    // memory to the checker's own records (304 MiB there, 427 with the default cache).
    fs.set_memory(butter::fs::MemoryLimits {
        cache: CHECK_CACHE,
        dirty: u64::MAX,
    });
    let mut err = std::io::stderr();
    let mut progress = |s: &str| {
        let _ = writeln!(std::io::stderr(), "{s}");
    };
    let opts = butter::check::Options {
        check_data_csum: a.check_data_csum,
    };
    let report = fs.check(opts, &mut progress)?;
    let mut out = std::io::stdout().lock();
    for f in &report.findings {
        writeln!(out, "{f}")?;
    }
    let count = |s: Severity| report.findings.iter().filter(|f| f.severity == s).count();
    let (w, e, x) = (
        count(Severity::Warning),
        count(Severity::Error),
        count(Severity::Fatal),
    );
    let c = &report.counts;
    writeln!(
        out,
        "checked {}: {} trees, {} tree blocks, {} metadata extents, {} data extents, {} file extents, {} block groups, {} inodes, {} csum sectors",
        a.image.display(),
        c.trees,
        c.tree_blocks,
        c.metadata_extents,
        c.data_extents,
        c.file_extents,
        c.block_groups,
        c.inodes,
        c.csum_sectors
    )?;
    writeln!(out, "{x} fatal, {e} errors, {w} warnings")?;
    out.flush()?;
    let _ = err.flush();
    if report.is_clean() {
        Ok(())
    } else {
        Err(CliError(format!(
            "{} has {} problems",
            a.image.display(),
            e + x
        )))
    }
}

/// `butter check --repair [--dry-run] IMAGE`.
fn repair(a: &CheckArgs) -> CliResult {
    let (image, dry_run) = (a.image.as_path(), a.dry_run);
    let open = || {
        let opts = butter::fs::RwOptions {
            untouched: true,
            ..Default::default()
        };
        super::open_fs_rw(image, opts).map_err(|e| {
            CliError(format!(
                "cannot open {} for repair: {}",
                image.display(),
                CliError::from(e)
            ))
        })
    };
    let fs = open()?;
    let mut progress = |s: &str| {
        let _ = writeln!(std::io::stderr(), "{s}");
    };
    if a.init_extent_tree {
        let n = fs.init_extent_tree(&mut progress).map_err(|e| {
            CliError(format!(
                "cannot make the extent tree of {} again: {}",
                image.display(),
                CliError::from(e)
            ))
        })?;
        println!("made the extent tree again: {n} extents recorded");
    }
    if a.init_csum_tree {
        let n = fs.init_csum_tree(&mut progress).map_err(|e| {
            CliError(format!(
                "cannot make the checksum tree of {} again: {}",
                image.display(),
                CliError::from(e)
            ))
        })?;
        println!(
            "made the checksum tree again: {} MiB of data summed",
            n >> 20
        );
    }
    let fs = if a.init_extent_tree || a.init_csum_tree {
        // The repair checks what is on the image now, as a fresh open reads it (the
        // superblock's fields included).
        fs.close()?;
        drop(fs);
        open()?
    } else {
        fs
    };
    let r = fs.repair(dry_run, &mut progress)?;
    let mut out = std::io::stdout().lock();
    let problems = |rep: &butter::check::Report| {
        rep.findings
            .iter()
            .filter(|f| f.severity != Severity::Warning)
            .count()
    };
    let before = problems(&r.before);
    for f in &r.before.findings {
        writeln!(out, "{f}")?;
    }
    if r.fixes.is_empty() {
        writeln!(out, "{before} problems; none of them has a repair")?;
        out.flush()?;
        return if before == 0 {
            fs.close()?;
            Ok(())
        } else if let Some(why) = &r.refused {
            Err(CliError(format!(
                "nothing was written to {}: {why}",
                image.display()
            )))
        } else {
            Err(CliError(format!(
                "{} has {before} problems butter cannot repair; nothing was written",
                image.display()
            )))
        };
    }
    writeln!(out, "{} changes:", r.fixes.len())?;
    for f in &r.fixes {
        writeln!(out, "  {f}")?;
    }
    if dry_run {
        writeln!(out, "{before} problems; dry run, nothing written")?;
        out.flush()?;
        return Ok(());
    }
    if let Some(why) = &r.refused {
        if let Some(after) = &r.after {
            for f in &after.findings {
                writeln!(out, "after: {f}")?;
            }
        }
        out.flush()?;
        return Err(CliError(format!(
            "nothing was written to {}: {why}",
            image.display()
        )));
    }
    fs.close()?;
    let after = r.after.as_ref().map_or(0, problems);
    writeln!(
        out,
        "repaired {}: {before} problems before, {after} after",
        image.display()
    )?;
    out.flush()?;
    if after == 0 {
        Ok(())
    } else {
        Err(CliError(format!(
            "{} still has {after} problems butter cannot repair",
            image.display()
        )))
    }
}

/// When an image cannot be opened: a note if it is shorter than its superblock says.
fn size_hint(image: &std::path::Path) -> String {
    let Ok(dev) = butter::io::device::FileDevice::open(image, false) else {
        return String::new();
    };
    use butter::io::device::BlockDevice;
    let Ok(sb) = butter::io::disk_io::read_superblock(&dev) else {
        return String::new();
    };
    let len = dev.len();
    // One device of several holds its own share (its dev_item), not the filesystem's total.
    let size = if sb.num_devices > 1 {
        sb.dev_item.total_bytes
    } else {
        sb.dev_item.total_bytes.max(sb.total_bytes)
    };
    if len < size {
        format!(
            "\n  the image is {len} bytes, but its superblock says the device is {size} bytes: it was truncated"
        )
    } else {
        String::new()
    }
}
