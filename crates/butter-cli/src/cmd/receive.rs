//! `butter receive`: send streams, from a file or standard input. `--dump` prints one, as
//! `btrfs receive --dump` does; receiving into an image is not done yet and says so.

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
    /// Stop after N errors (0: never).
    #[arg(short = 'E', value_name = "N")]
    pub max_errors: Option<u64>,
    /// Image file or block device to receive into.
    #[arg(required_unless_present = "dump")]
    pub image: Option<PathBuf>,
    /// Directory inside the image that gets the received subvolumes.
    #[arg(required_unless_present = "dump")]
    pub dir: Option<String>,
}

pub fn receive(a: ReceiveArgs) -> CliResult {
    if !a.dump {
        return Err(CliError(
            "receiving a stream into an image is not implemented yet; `butter receive --dump` \
             prints what a stream holds"
                .into(),
        ));
    }
    let name = a
        .file
        .as_ref()
        .map(|f| f.display().to_string())
        .unwrap_or_else(|| "standard input".into());
    let input: Box<dyn std::io::Read> = match &a.file {
        Some(f) => Box::new(std::io::BufReader::new(
            std::fs::File::open(f).map_err(|e| CliError(format!("cannot open {name}: {e}")))?,
        )),
        None => Box::new(std::io::BufReader::new(std::io::stdin().lock())),
    };
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let r = butter::format::send_stream::dump(input, &mut out);
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
