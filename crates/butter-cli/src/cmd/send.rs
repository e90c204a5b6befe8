//! `butter send`: read-only snapshots of an image as a send stream (butter::send), to a file
//! or standard output, for `btrfs receive` or `butter receive`.

use super::{CliError, CliResult};
use butter::fs::Fs;
use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct SendArgs {
    /// Send only the changes from PARENT (a read-only snapshot the receiver has).
    #[arg(short = 'p', value_name = "PARENT")]
    pub parent: Option<OsString>,
    /// A read-only snapshot the receiver has, whose data may be cloned (repeatable).
    #[arg(short = 'c', value_name = "CLONE_SRC")]
    pub clone_sources: Vec<OsString>,
    /// Write the stream to FILE instead of standard output.
    #[arg(short = 'f', value_name = "FILE")]
    pub file: Option<PathBuf>,
    /// Stream version: 1, or 2 (larger writes, compressed data, hole punching).
    #[arg(long, value_name = "1|2", default_value_t = 1)]
    pub proto: u32,
    /// Send compressed extents as they are (needs --proto 2).
    #[arg(long)]
    pub compressed_data: bool,
    /// Send no file data, only which ranges changed.
    #[arg(long)]
    pub no_data: bool,
    /// No progress line.
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// Readahead of a full send's tree walk: `always` (every leaf and node ahead, the
    /// default) or `forward` (only past leaves that had to be read); for benchmarks.
    #[arg(
        long,
        value_name = "always|forward",
        default_value = "always",
        hide = true
    )]
    pub readahead: String,
    /// Image file or block device.
    pub image: PathBuf,
    /// Read-only snapshots to send, paths inside the image (e.g. /snaps/monday).
    #[arg(required = true, value_name = "SUBVOL")]
    pub subvols: Vec<OsString>,
    #[command(flatten)]
    pub start: super::paths::Start,
}

pub fn send(a: SendArgs) -> CliResult {
    let fs = super::open_fs(&a.image)?;
    let parent = a
        .parent
        .as_deref()
        .map(|p| a.start.subvolume_at(&fs, p))
        .transpose()?;
    let clone_sources = a
        .clone_sources
        .iter()
        .map(|p| a.start.subvolume_at(&fs, p))
        .collect::<Result<Vec<_>, _>>()?;
    let ids = a
        .subvols
        .iter()
        .map(|p| a.start.subvolume_at(&fs, p))
        .collect::<Result<Vec<_>, _>>()?;
    let mut out: Box<dyn Write> = match &a.file {
        Some(f) => Box::new(std::io::BufWriter::with_capacity(
            1 << 20,
            std::fs::File::create(f)
                .map_err(|e| CliError(format!("cannot create {}: {e}", f.display())))?,
        )),
        None => {
            let stdout = std::io::stdout();
            if std::io::IsTerminal::is_terminal(&stdout) {
                return Err(CliError(
                    "not writing a send stream to a terminal; give -f FILE or redirect \
                     standard output"
                        .into(),
                ));
            }
            Box::new(std::io::BufWriter::with_capacity(1 << 20, stdout.lock()))
        }
    };
    let mut meter = super::progress::Meter::new("sending", !a.quiet);
    let (mut bytes, mut commands) = (0, 0);
    for (i, (id, path)) in ids.iter().zip(&a.subvols).enumerate() {
        let path = path.to_string_lossy();
        let opts = butter::send::SendOptions {
            proto: a.proto,
            compressed_data: a.compressed_data,
            no_data: a.no_data,
            parent: parent.or_else(|| find_parent(&fs, *id, &clone_sources)),
            clone_sources: clone_sources.clone(),
            omit_header: i > 0,
            omit_end: i + 1 < ids.len(),
            readahead_always: a.readahead != "forward",
        };
        let r = butter::send::send(&fs, *id, &opts, &mut out, &mut |p| {
            meter.tick(bytes + p.bytes, commands + p.commands)
        })
        .map_err(|e| match &e {
            butter::Error::Io { source, .. } if source.kind() == std::io::ErrorKind::BrokenPipe => {
                CliError(String::new())
            }
            _ => CliError(format!("sending {path}: {}", CliError::from(e))),
        })?;
        bytes += r.bytes;
        commands += r.commands;
        if !a.quiet {
            eprintln!("At subvol {path}");
        }
    }
    out.flush()
        .map_err(|e| CliError(format!("writing the stream: {e}")))?;
    meter.done(bytes, commands);
    Ok(())
}

/// Without -p, a parent among the clone sources, as btrfs send picks one: the snapshot the
/// sent one was taken of, else one taken of the same subvolume, the nearest in time.
fn find_parent(fs: &Fs, id: u64, clone_sources: &[u64]) -> Option<u64> {
    if clone_sources.is_empty() {
        return None;
    }
    let list = fs.list_subvolumes().ok()?;
    let me = list.iter().find(|s| s.id == id)?;
    let of = |c: u64| list.iter().find(|s| s.id == c);
    if let Some(c) = clone_sources
        .iter()
        .find(|c| of(**c).is_some_and(|s| s.item.uuid == me.item.parent_uuid))
    {
        return Some(*c);
    }
    clone_sources
        .iter()
        .filter_map(|c| of(*c))
        .filter(|s| s.item.parent_uuid == me.item.parent_uuid && me.item.parent_uuid != [0; 16])
        .min_by_key(|s| s.item.ctransid.abs_diff(me.item.ctransid))
        .map(|s| s.id)
}
