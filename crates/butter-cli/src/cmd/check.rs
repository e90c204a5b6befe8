//! `butter check IMAGE`: read-only consistency check (see `butter::check`).

use super::{open_fs, CliError, CliResult};
use butter::check::Severity;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct CheckArgs {
    /// Image file or block device.
    pub image: PathBuf,
}

pub fn check(a: CheckArgs) -> CliResult {
    let fs = open_fs(&a.image)?;
    let mut err = std::io::stderr();
    let mut progress = |s: &str| {
        let _ = writeln!(std::io::stderr(), "{s}");
    };
    let report = butter::check::check(&fs, &mut progress)?;
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
