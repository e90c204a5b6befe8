//! `butter property get|set`: properties of objects inside an image, as `btrfs property`
//! shows and changes them on a mounted filesystem. Today: `ro` of a subvolume (its root
//! item's read-only flag), and `compression` of an inode (read).
//!
//! Paths are inside the image, from the root of its default subvolume. `ro` needs the root
//! directory of a subvolume, as btrfs-progs does (it tells subvolumes by inode number 256).
//! Making a received subvolume writable is refused without `-f` (incremental send from it
//! would break); with `-f` its received uuid is cleared afterwards, as btrfs-progs 6.14 does
//! through the kernel's SET_RECEIVED_SUBVOL ioctl.

use super::paths::Start;
use super::{CliError, CliResult};
use butter::format::FIRST_FREE_OBJECTID;
use butter::fs::Inode;
use std::ffi::OsString;
use std::path::PathBuf;

#[derive(clap::Subcommand)]
pub enum PropertyCmd {
    /// Print a property (all of them without NAME) of the object at PATH.
    Get {
        /// Image file or block device.
        image: PathBuf,
        /// Path inside the image.
        path: OsString,
        /// Property name: ro, compression.
        name: Option<String>,
        #[command(flatten)]
        start: Start,
    },
    /// Set a property of the object at PATH.
    Set {
        /// Force the change: make a received subvolume writable (its received uuid is
        /// cleared).
        #[arg(short = 'f')]
        force: bool,
        /// Image file or block device.
        image: PathBuf,
        /// Path inside the image.
        path: OsString,
        /// Property name: ro.
        name: String,
        /// New value: true or false.
        value: String,
        #[command(flatten)]
        start: Start,
    },
}

#[derive(clap::Args)]
pub struct PropertyArgs {
    #[command(subcommand)]
    pub cmd: PropertyCmd,
}

/// The subvolume whose root directory `ino` is, if it is one.
fn subvol_of(ino: Inode) -> Option<u64> {
    (ino.ino == FIRST_FREE_OBJECTID).then_some(ino.root)
}

fn not_compatible(name: &str) -> CliError {
    CliError(format!("object is not compatible with property: {name}"))
}

pub fn property(a: PropertyArgs) -> CliResult {
    match a.cmd {
        PropertyCmd::Get {
            image,
            path,
            name,
            start,
        } => {
            let fs = super::open_fs(&image)?;
            let ino = start.resolve(&fs, &path)?;
            let show_ro = |id: u64| -> CliResult {
                println!(
                    "ro={}",
                    if fs.subvol_is_readonly(id)? {
                        "true"
                    } else {
                        "false"
                    }
                );
                Ok(())
            };
            let show_compression = || -> CliResult {
                if let Some(v) = fs.getxattr(ino, butter::inode::flags::COMPRESSION_PROP)? {
                    println!("compression={}", String::from_utf8_lossy(&v));
                }
                Ok(())
            };
            match name.as_deref() {
                Some("ro") => show_ro(subvol_of(ino).ok_or_else(|| not_compatible("ro"))?),
                Some("compression") => show_compression(),
                Some(n) => Err(CliError(format!("unknown property: {n}"))),
                None => {
                    if let Some(id) = subvol_of(ino) {
                        show_ro(id)?;
                    }
                    show_compression()
                }
            }
        }
        PropertyCmd::Set {
            force,
            image,
            path,
            name,
            value,
            start,
        } => {
            if name != "ro" {
                return Err(CliError(match name.as_str() {
                    "compression" | "label" => {
                        format!("setting property {name} is not supported by butter yet")
                    }
                    n => format!("unknown property: {n}"),
                }));
            }
            let readonly = match value.as_str() {
                "true" => true,
                "false" => false,
                v => return Err(CliError(format!("invalid value for property: {v}"))),
            };
            let fs = super::subvol::open_rw(&image)?;
            let id = subvol_of(start.resolve(&fs, &path)?).ok_or_else(|| not_compatible("ro"))?;
            let is_ro = fs.subvol_is_readonly(id)?;
            if is_ro && readonly {
                return Ok(());
            }
            let received = fs.received_uuid(id)?;
            if is_ro && received.is_some() && !force {
                return Err(CliError(
                    "cannot flip ro->rw with received_uuid set, use force (-f) if you really \
                     want that"
                        .into(),
                ));
            }
            if !is_ro && received.is_some() {
                eprintln!("WARNING: read-write subvolume with received_uuid, this is bad");
            }
            fs.set_subvolume_readonly(id, readonly)?;
            if is_ro && received.is_some() {
                fs.clear_received_uuid(id)?;
            }
            fs.commit()?;
            Ok(())
        }
    }
}
