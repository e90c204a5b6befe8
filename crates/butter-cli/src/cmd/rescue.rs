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
    /// Read every copy of every checksummed data sector and list those that do not match,
    /// with the files that use them; with -m or -i, make a sector's checksum that of the data
    /// one copy holds (for data that is right under a wrong checksum).
    FixDataChecksum {
        /// Only report (the default without -i or -m).
        #[arg(short = 'r', long)]
        readonly: bool,
        /// Ask for each sector: ignore it (the default) or update its checksum from a mirror.
        #[arg(short = 'i', long, conflicts_with_all = ["readonly", "mirror"])]
        interactive: bool,
        /// Update every mismatched sector's checksum from this copy (1-based).
        #[arg(short = 'm', long, value_name = "NUM", conflicts_with = "readonly",
              value_parser = clap::value_parser!(u32).range(1..))]
        mirror: Option<u32>,
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
        RescueCmd::FixDataChecksum {
            interactive,
            mirror,
            image,
            ..
        } => fix_data_checksum(&image, interactive, mirror),
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

/// `rescue fix-data-checksum`: the report as btrfs-progs prints it, then the updates asked
/// for, all in one verified transaction.
fn fix_data_checksum(image: &Path, interactive: bool, mirror: Option<u32>) -> CliResult {
    let fs = open_untouched(image)?;
    let mut prog = super::progress::StatusLine::new();
    let bad = fs
        .data_checksum_mismatches(&mut |m| prog.show(m))
        .map_err(|e| {
            CliError(format!(
                "cannot read the data of {}: {}",
                image.display(),
                CliError::from(e)
            ))
        })?;
    prog.end();
    if bad.is_empty() {
        println!("no data checksum mismatch found");
        return Ok(());
    }
    let mut updates = Vec::new();
    let stdin = std::io::stdin();
    for b in &bad {
        let mirrors: Vec<String> = b.bad_mirrors.iter().map(|m| m.to_string()).collect();
        println!(
            "logical={} corrupted mirrors={} affected files:",
            b.logical,
            mirrors.join(",")
        );
        for (root, path) in &b.files {
            println!("  (subvolume {root})/{path}");
        }
        let chosen = if interactive {
            ask_mirror(&stdin, b.copies)
        } else {
            mirror
        };
        if let Some(m) = chosen {
            if m > b.copies {
                return Err(CliError(format!(
                    "the data at logical {} has {} cop{}, no mirror {m}: nothing was written",
                    b.logical,
                    b.copies,
                    if b.copies == 1 { "y" } else { "ies" }
                )));
            }
            updates.push((b.logical, m));
        }
    }
    if updates.is_empty() {
        println!(
            "{} sector(s) do not match their checksums; nothing changed (-m NUM updates them from mirror NUM)",
            bad.len()
        );
        return Ok(());
    }
    fs.update_data_checksums(&updates).map_err(|e| {
        CliError(format!(
            "cannot update the checksums of {}: {}",
            image.display(),
            CliError::from(e)
        ))
    })?;
    fs.close()?;
    for (logical, m) in &updates {
        println!("Csum item for logical {logical} updated using data from mirror {m}");
    }
    Ok(())
}

/// Asks what to do with one sector: ignore it (an empty answer, "i" or "ignore") or the
/// mirror whose data gives the new checksum.
fn ask_mirror(stdin: &std::io::Stdin, copies: u32) -> Option<u32> {
    use std::io::Write;
    loop {
        let choices: String = (1..=copies).map(|m| format!("<{m}>")).collect();
        print!("<<I>>gnore/{choices}:");
        let _ = std::io::stdout().flush();
        let mut line = String::new();
        match stdin.read_line(&mut line) {
            Ok(0) | Err(_) => return None,
            Ok(_) => {}
        }
        let a = line.trim();
        if a.is_empty() || a.eq_ignore_ascii_case("i") || a.eq_ignore_ascii_case("ignore") {
            return None;
        }
        match a.parse::<u32>() {
            Ok(m) if (1..=copies).contains(&m) => return Some(m),
            _ => eprintln!("butter: answer i to ignore it, or a mirror from 1 to {copies}"),
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
