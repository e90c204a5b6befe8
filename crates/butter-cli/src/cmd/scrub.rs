//! `butter scrub start IMAGE`: reads every copy of every extent and every parity block on
//! every device, verifies them, and rewrites what is bad from a good copy (unless `-r`),
//! offline; then reports as `btrfs scrub status` does, for the filesystem or per device.

use super::{CliError, CliResult};
use butter::io::disk_io::ScrubCounts;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Subcommand)]
pub enum ScrubCmd {
    /// Scrub the filesystem now, in the foreground (give the other devices with --device).
    Start {
        /// Read-only: report what is bad, repair nothing.
        #[arg(short = 'r')]
        readonly: bool,
        /// Report per device.
        #[arg(short = 'd')]
        per_device: bool,
        /// Raw counters, as `btrfs scrub status -R` prints them.
        #[arg(short = 'R')]
        raw: bool,
        /// Accepted for btrfs-progs' spelling: an offline scrub always runs in the
        /// foreground.
        #[arg(short = 'B')]
        foreground: bool,
        /// No report (the exit status still says whether errors were left).
        #[arg(short = 'q')]
        quiet: bool,
        /// Image file or block device.
        image: PathBuf,
    },
}

#[derive(clap::Args)]
pub struct ScrubArgs {
    #[command(subcommand)]
    pub cmd: ScrubCmd,
}

pub fn scrub(a: ScrubArgs) -> CliResult {
    let ScrubCmd::Start {
        readonly,
        per_device,
        raw,
        foreground: _,
        quiet,
        image,
    } = a.cmd;
    let fs = if readonly {
        super::open_fs(&image)?
    } else {
        super::open_fs_rw(&image, Default::default()).map_err(|e| {
            CliError(format!(
                "cannot open {} read-write to repair it: {}; scrub it read-only with -r",
                image.display(),
                CliError::from(e)
            ))
        })?
    };
    let started = Instant::now();
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    let tty = std::io::stderr().is_terminal() && !quiet;
    let mut progress = |s: &str| {
        if tty {
            let _ = write!(std::io::stderr(), "\r{s}");
        }
    };
    let report = fs.scrub(!readonly, &mut progress)?;
    if tty {
        let _ = writeln!(std::io::stderr());
    }
    let secs = started.elapsed().as_secs();
    let uuid = butter::format::fmt_uuid(&fs.disk().sb.fsid);
    fs.close()?;
    let total = report.total();
    if !quiet {
        let mut out = String::new();
        out.push_str(&format!("UUID:             {uuid}\n"));
        let when = super::local_time(wall);
        if per_device {
            for (d, c, supers) in &report.devices {
                let path = d.path.as_deref().unwrap_or("<missing disk>");
                out.push_str(&format!("Scrub device {path} (id {}) done\n", d.devid));
                section(&mut out, &when, secs, c, *supers, raw, report.repaired);
            }
        } else {
            let supers = report.devices.iter().map(|d| d.2).sum();
            section(&mut out, &when, secs, &total, supers, raw, report.repaired);
        }
        print!("{out}");
    }
    let left = if report.repaired {
        total.uncorrectable
    } else {
        total.uncorrectable + total.correctable
    };
    if left > 0 {
        return Err(CliError(format!(
            "{}: {left} errors {}",
            image.display(),
            if report.repaired {
                "could not be corrected (no good copy); `butter restore` saves what is readable"
            } else {
                "found; run `butter scrub start` without -r to repair them from the good copies"
            }
        )));
    }
    Ok(())
}

/// One `btrfs scrub status` block.
fn section(
    out: &mut String,
    when: &super::LocalTime,
    secs: u64,
    c: &ScrubCounts,
    supers: u64,
    raw: bool,
    repaired: bool,
) {
    let h = super::mkfs::human;
    out.push_str(&format!("Scrub started:    {}\n", when.date_time(' ')));
    out.push_str("Status:           finished\n");
    out.push_str(&format!(
        "Duration:         {}:{:02}:{:02}\n",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    ));
    if raw {
        out.push_str(&format!(
            "\tbytes_scrubbed: {}\n\tparity_bytes_scrubbed: {}\n\tread_errors: {}\n\tcsum_errors: {}\n\tparity_errors: {}\n\tsuper_errors: {supers}\n\tcorrected_errors: {}\n\tuncorrectable_errors: {}\n",
            c.bytes,
            c.parity_bytes,
            c.read_errors,
            c.csum_errors,
            c.parity_errors,
            c.corrected,
            if repaired { c.uncorrectable } else { c.uncorrectable + c.correctable },
        ));
        return;
    }
    out.push_str(&format!(
        "Total to scrub:   {}\n",
        h(c.bytes + c.parity_bytes)
    ));
    out.push_str(&format!(
        "Rate:             {}/s\n",
        h((c.bytes + c.parity_bytes) / secs.max(1))
    ));
    let mut kinds = Vec::new();
    for (n, what) in [
        (c.read_errors, "read"),
        (c.csum_errors, "csum"),
        (c.parity_errors, "parity"),
        (supers, "super"),
    ] {
        if n > 0 {
            kinds.push(format!("{what}={n}"));
        }
    }
    if kinds.is_empty() {
        out.push_str("Error summary:    no errors found\n");
        return;
    }
    out.push_str(&format!("Error summary:    {}\n", kinds.join(" ")));
    if repaired {
        out.push_str(&format!("  Corrected:      {}\n", c.corrected));
        out.push_str(&format!("  Uncorrectable:  {}\n", c.uncorrectable));
    } else {
        out.push_str(&format!("  Correctable:    {}\n", c.correctable));
        out.push_str(&format!("  Uncorrectable:  {}\n", c.uncorrectable));
    }
}
