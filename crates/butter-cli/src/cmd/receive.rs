//! `butter receive`: send streams, from a file or standard input, applied to a directory of
//! an image (butter::receive), or printed as `btrfs receive --dump` prints them.

use super::{CliError, CliResult};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ReceiveArgs {
    /// Read the stream from FILE instead of standard input.
    #[arg(short = 'f', value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Print the stream's commands instead of applying them (no image needed).
    #[arg(long)]
    pub dump: bool,
    /// Stop at an `end` command instead of at the end of the input.
    #[arg(short = 'e')]
    pub end: bool,
    /// Stop after N commands failed (0: never; default 1).
    #[arg(short = 'E', long = "max-errors", value_name = "N")]
    pub max_errors: Option<u64>,
    /// Quiet: no progress line and no "At subvol" lines, only errors.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// Image file or block device to receive into.
    #[arg(required_unless_present = "dump")]
    pub image: Option<PathBuf>,
    /// Directory inside the image that gets the received subvolumes.
    #[arg(required_unless_present = "dump")]
    pub dir: Option<std::ffi::OsString>,
    #[command(flatten)]
    pub start: super::paths::Start,
}

pub fn receive(a: ReceiveArgs) -> CliResult {
    let name = a
        .file
        .as_ref()
        .map(|f| f.display().to_string())
        .unwrap_or_else(|| "standard input".into());
    let input: Box<dyn std::io::Read> = match &a.file {
        Some(f) => Box::new(std::io::BufReader::with_capacity(
            1 << 20,
            std::fs::File::open(f).map_err(|e| CliError(format!("cannot open {name}: {e}")))?,
        )),
        None => Box::new(std::io::BufReader::with_capacity(
            1 << 20,
            std::io::stdin().lock(),
        )),
    };
    if !a.dump {
        return apply(&a, input, &name);
    }
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let r = butter::format::send_stream::dump(input, &mut out, &|t| {
        let t = super::local_time(t);
        format!("{}{}", t.date_time('T'), t.zone())
    });
    let flushed = std::io::Write::flush(&mut out);
    r.map_err(|e| match &e {
        // A closed pipe (`... --dump | head`): stop quietly.
        butter::Error::Io { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe => {
            CliError(String::new())
        }
        butter::Error::Corrupt { .. } | butter::Error::BadChecksum { .. } => CliError(format!(
            "{name}: {e}\n  the stream is damaged there: it cannot be received as it is; make it \
             again with btrfs send or butter send"
        )),
        _ => CliError(format!("{name}: {e}")),
    })?;
    flushed?;
    Ok(())
}

/// Receives the stream into the image.
fn apply(a: &ReceiveArgs, input: Box<dyn std::io::Read>, name: &str) -> CliResult {
    let (Some(image), Some(dir)) = (&a.image, &a.dir) else {
        return Err(CliError(
            "receive needs an IMAGE and a DIR inside it".into(),
        ));
    };
    let fs = super::subvol::open_rw(image)?;
    let at = a.start.resolve(&fs, dir).map_err(|e| {
        CliError(format!(
            "{e}\n  DIR is a directory inside the image {} (e.g. / or /backups)",
            image.display(),
        ))
    })?;
    let opts = butter::receive::ReceiveOptions {
        stop_at_end: a.end,
        max_errors: a.max_errors.unwrap_or(1),
    };
    let mut meter = super::progress::Meter::new("receiving", !a.quiet);
    let report = butter::receive::receive(&fs, at, input, &opts, &mut |p| {
        meter.tick(p.bytes, p.commands)
    });
    let closed = fs.close();
    meter.done(report.progress.bytes, report.progress.commands);
    let mut incomplete = false;
    for s in &report.subvolumes {
        if s.complete {
            if !a.quiet {
                eprintln!("At subvol {} (id {})", s.name, s.id);
            }
        } else {
            incomplete = true;
            eprintln!(
                "Incomplete subvol {} (id {}): left writable, without a received uuid",
                s.name, s.id
            );
        }
    }
    if let Some(e) = &report.stopped {
        let mut hint = match e {
            butter::Error::Corrupt { .. } | butter::Error::BadChecksum { .. } => {
                "\n  the stream is damaged there; make it again with btrfs send or butter send"
            }
            _ => "",
        }
        .to_string();
        if incomplete {
            hint.push_str(
                "\n  what was received before it stays in the image; delete the incomplete \
                 subvolume before receiving the stream again",
            );
        }
        if let Err(c) = &closed {
            hint.push_str(&format!("\n  closing the image failed too: {c}"));
        }
        return Err(CliError(format!("{name}: {e}{hint}")));
    }
    closed.map_err(|e| CliError(format!("closing {}: {e}", image.display())))?;
    if !report.errors.is_empty() {
        return Err(CliError(format!(
            "{name}: {} command(s) failed:\n  {}",
            report.errors.len(),
            report.errors.join("\n  ")
        )));
    }
    Ok(())
}
