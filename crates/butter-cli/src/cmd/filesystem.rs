//! `butter filesystem df|label`: the space of an image's block groups, and its label, as
//! `btrfs filesystem df` and `btrfs filesystem label` show them.

use super::{CliError, CliResult};
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum FilesystemCmd {
    /// Size and use of the block groups per type and profile (Data, System, Metadata), as
    /// `btrfs filesystem df` prints them, as of the last commit.
    Df {
        /// Image file or block device.
        image: PathBuf,
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
                    u.kind(),
                    u.profile(),
                    super::mkfs::human(u.total),
                    super::mkfs::human(u.used)
                );
            }
            Ok(())
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
