//! `butter rescue`: btrfs-progs' rescue commands on an image (and its other devices with
//! `--device`), each checked before it writes (see `butter::fs::Fs::zero_log`,
//! `super_recover`, `fix_device_size`).

use super::{CliError, CliResult};
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub enum RescueCmd {
    /// Drop the fsync log: the superblocks stop naming it, so what was fsynced since the
    /// last commit is lost (for a log that cannot be replayed).
    ZeroLog {
        /// Image file or block device.
        image: PathBuf,
    },
    /// Rewrite every damaged, missing or stale superblock copy from the newest good one.
    SuperRecover {
        /// Accepted for btrfs-progs' spelling (butter does not ask).
        #[arg(short = 'y')]
        yes: bool,
        /// Name each copy rewritten.
        #[arg(short = 'v')]
        verbose: bool,
        /// Image file or block device.
        image: PathBuf,
    },
    /// Round each device's size down to whole sectors and make the superblock's total their
    /// sum.
    FixDeviceSize {
        /// Image file or block device.
        image: PathBuf,
    },
    /// Delete the free space cache: v1 (the old cache files) or v2 (the free space tree,
    /// which a kernel mount with -o space_cache=v2 builds again).
    ClearSpaceCache {
        /// v1 or v2.
        #[arg(value_parser = ["v1", "v2"])]
        version: String,
        /// Image file or block device.
        image: PathBuf,
    },
    /// Delete the uuid tree (subvolume uuids to ids); the kernel builds it again at its next
    /// mount.
    ClearUuidTree {
        /// Image file or block device.
        image: PathBuf,
    },
}

#[derive(clap::Args)]
pub struct RescueArgs {
    #[command(subcommand)]
    pub cmd: RescueCmd,
}

/// The image and the other devices given with --device.
fn paths(image: &Path) -> Vec<PathBuf> {
    let mut v = vec![image.to_path_buf()];
    v.extend(super::other_devices().paths.iter().cloned());
    v
}

pub fn rescue(a: RescueArgs) -> CliResult {
    match a.cmd {
        RescueCmd::ZeroLog { image } => {
            let p = paths(&image);
            let refs: Vec<&Path> = p.iter().map(|p| p.as_path()).collect();
            let dropped = butter::fs::Fs::zero_log(&refs).map_err(|e| {
                CliError(format!(
                    "cannot drop the log of {}: {}",
                    image.display(),
                    CliError::from(e)
                ))
            })?;
            if dropped {
                println!(
                    "Clearing log on {}: the fsync log is dropped",
                    image.display()
                );
            } else {
                println!("{} has no fsync log: nothing to do", image.display());
            }
            Ok(())
        }
        RescueCmd::SuperRecover { verbose, image, .. } => {
            let p = paths(&image);
            let refs: Vec<&Path> = p.iter().map(|p| p.as_path()).collect();
            let n = butter::fs::Fs::super_recover(&refs).map_err(|e| {
                CliError(format!(
                    "cannot recover the superblocks of {}: {}",
                    image.display(),
                    CliError::from(e)
                ))
            })?;
            if n == 0 {
                println!("All supers are valid, no need to recover");
            } else {
                if verbose {
                    println!("rewrote {n} superblock copies from the newest good one");
                }
                println!("Recovered bad superblocks successful");
            }
            Ok(())
        }
        RescueCmd::FixDeviceSize { image } => {
            let fs = open_untouched(&image)?;
            let fixed = fs.fix_device_size().map_err(|e| {
                CliError(format!(
                    "cannot fix the device size of {}: {}",
                    image.display(),
                    CliError::from(e)
                ))
            })?;
            if fixed {
                fs.close()?;
                println!("Fixed device size for {}", image.display());
            } else {
                println!("No device size related problem found");
            }
            Ok(())
        }
        RescueCmd::ClearSpaceCache { version, image } => {
            let fs = open_untouched(&image)?;
            let v = if version == "v1" { 1 } else { 2 };
            let cleared = fs.clear_space_cache(v).map_err(|e| {
                CliError(format!(
                    "cannot clear the {version} space cache of {}: {}",
                    image.display(),
                    CliError::from(e)
                ))
            })?;
            if cleared {
                fs.close()?;
                println!("Cleared the {version} space cache of {}", image.display());
            } else {
                println!(
                    "{} has no {version} space cache: nothing to do",
                    image.display()
                );
            }
            Ok(())
        }
        RescueCmd::ClearUuidTree { image } => {
            let fs = open_untouched(&image)?;
            let cleared = fs.clear_uuid_tree().map_err(|e| {
                CliError(format!(
                    "cannot clear the uuid tree of {}: {}",
                    image.display(),
                    CliError::from(e)
                ))
            })?;
            if cleared {
                fs.close()?;
                println!("Cleared the uuid tree of {}", image.display());
            } else {
                println!("{} has no uuid tree: nothing to do", image.display());
            }
            Ok(())
        }
    }
}

/// The image open read-write, left as it is until the rescue change.
fn open_untouched(image: &Path) -> Result<butter::fs::Fs, CliError> {
    let opts = butter::fs::RwOptions {
        untouched: true,
        ..Default::default()
    };
    super::open_fs_rw(image, opts).map_err(|e| {
        CliError(format!(
            "cannot open {}: {}",
            image.display(),
            CliError::from(e)
        ))
    })
}
