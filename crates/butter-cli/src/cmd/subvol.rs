//! `butter subvolume create|snapshot|delete|sync|list|show|get-default|set-default`: subvolumes
//! of an image, without mounting it.
//!
//! Paths are inside the image, from the root of its default subvolume (as on a mount).

use super::paths::Start;
use super::{CliError, CliResult};
use butter::fs::Fs;
use butter::inode::namespace::Owner;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub enum SubvolCmd {
    /// Create an empty subvolume at PATH (its parent directory must exist).
    Create {
        /// Image file or block device.
        image: PathBuf,
        /// Path of the new subvolume inside the image.
        path: OsString,
        #[command(flatten)]
        start: Start,
    },
    /// Snapshot the subvolume at SOURCE as DEST.
    Snapshot {
        /// Make the snapshot read-only.
        #[arg(short = 'r')]
        readonly: bool,
        /// Image file or block device.
        image: PathBuf,
        /// Root directory of the subvolume to snapshot ("/" is the default subvolume).
        source: OsString,
        /// Path of the snapshot inside the image.
        dest: OsString,
        #[command(flatten)]
        start: Start,
    },
    /// Delete the subvolume or snapshot at PATH (read-only ones too) and free its tree, as the
    /// kernel does: the drop is committed in steps, and a drop cut off (by butter or the
    /// kernel) goes on at the next read-write open.
    Delete {
        /// The subvolume by id instead of by path (wherever it is linked).
        #[arg(
            short = 'i',
            long = "subvolid",
            value_name = "N",
            conflicts_with = "path"
        )]
        id: Option<u64>,
        /// Image file or block device.
        image: PathBuf,
        /// Root directory of the subvolume inside the image.
        #[arg(required_unless_present = "id")]
        path: Option<OsString>,
        #[command(flatten)]
        start: Start,
    },
    /// Finish the drops of deleted subvolumes left unfinished (any read-write open does it),
    /// then report that none is left.
    Sync {
        /// Image file or block device.
        image: PathBuf,
    },
    /// List subvolumes and snapshots (same as `butter subvolumes`).
    List(super::ls::SubvolArgs),
    /// Show one subvolume: uuids, parent and received uuids, generations, times, flags.
    Show {
        /// Image file or block device.
        image: PathBuf,
        /// Root directory of the subvolume inside the image.
        path: OsString,
        #[command(flatten)]
        start: Start,
    },
    /// Show the default subvolume: the one a mount without subvol= shows.
    GetDefault {
        /// Image file or block device.
        image: PathBuf,
    },
    /// Make a subvolume the default one: the one a mount without subvol= shows, in butter and
    /// in the kernel.
    SetDefault {
        /// The subvolume by id instead of by path (5 is the top level).
        #[arg(long, value_name = "N", conflicts_with = "path")]
        id: Option<u64>,
        /// Image file or block device.
        image: PathBuf,
        /// Root directory of the subvolume inside the image.
        #[arg(required_unless_present = "id")]
        path: Option<OsString>,
        #[command(flatten)]
        start: Start,
    },
}

#[derive(clap::Args)]
pub struct SubvolumeArgs {
    #[command(subcommand)]
    pub cmd: SubvolCmd,
}

pub(crate) fn open_rw(image: &Path) -> Result<Fs, CliError> {
    Fs::open_rw(image).map_err(|e| {
        CliError(format!(
            "cannot open {} read-write: {}",
            image.display(),
            CliError::from(e)
        ))
    })
}

pub fn subvolume(a: SubvolumeArgs) -> CliResult {
    match a.cmd {
        SubvolCmd::Create { image, path, start } => {
            let fs = open_rw(&image)?;
            let (dir, name) = start.parent_and_name(&fs, &path)?;
            let ino = fs
                .create_subvolume(dir, &name, 0o755, Owner::default(), None)
                .map_err(|e| CliError(format!("cannot create {path:?}: {}", CliError::from(e))))?;
            fs.commit()?;
            println!(
                "Create subvolume '{}' (id {})",
                path.to_string_lossy(),
                ino.root
            );
            Ok(())
        }
        SubvolCmd::Snapshot {
            readonly,
            image,
            source,
            dest,
            start,
        } => {
            let fs = open_rw(&image)?;
            let src = start.resolve(&fs, &source)?;
            let root_dir = fs.subvol_root_inode(src.root)?;
            if src != root_dir {
                return Err(CliError(format!(
                    "{source:?} is not the root of a subvolume; snapshot a subvolume (see \
                     `butter subvolume list`)"
                )));
            }
            let (dir, name) = start.parent_and_name(&fs, &dest)?;
            let ino = fs
                .create_snapshot(src.root, dir, &name, readonly, None)
                .map_err(|e| {
                    CliError(format!(
                        "cannot snapshot to {dest:?}: {}",
                        CliError::from(e)
                    ))
                })?;
            fs.commit()?;
            println!(
                "Create {}snapshot of '{}' in '{}' (id {})",
                if readonly { "a readonly " } else { "a " },
                source.to_string_lossy(),
                dest.to_string_lossy(),
                ino.root
            );
            Ok(())
        }
        SubvolCmd::Delete {
            id,
            image,
            path,
            start,
        } => {
            let fs = open_rw(&image)?;
            let (id, shown) = match (id, path) {
                (Some(id), _) => {
                    fs.delete_subvolume_by_id(id).map_err(|e| {
                        CliError(format!(
                            "cannot delete subvolume {id}: {}",
                            CliError::from(e)
                        ))
                    })?;
                    (id, format!("id {id}"))
                }
                (None, Some(path)) => {
                    let shown = path.to_string_lossy();
                    let trimmed = shown.trim_matches('/');
                    if trimmed.is_empty() || trimmed == "." {
                        return Err(CliError(format!(
                            "cannot delete {path:?}: it is the top level of the default \
                             subvolume, not a subvolume linked in a directory (the top level, \
                             id 5, is never deleted)"
                        )));
                    }
                    let id = start.subvolume_at(&fs, &path)?;
                    let (dir, name) = start.parent_and_name(&fs, &path)?;
                    fs.delete_subvolume(dir, &name).map_err(|e| {
                        CliError(format!(
                            "cannot delete subvolume {id} at {path:?}: {}",
                            CliError::from(e)
                        ))
                    })?;
                    (id, format!("'{shown}'"))
                }
                (None, None) => return Err(CliError("give a PATH or --subvolid".into())),
            };
            fs.commit()?;
            println!("Delete subvolume {id}: {shown}");
            Ok(())
        }
        SubvolCmd::Sync { image } => {
            // The read-write open finishes every drop left unfinished.
            let fs = open_rw(&image)?;
            fs.commit()?;
            println!("No deleted subvolume is left to drop");
            Ok(())
        }
        SubvolCmd::List(a) => super::ls::subvolumes(a),
        SubvolCmd::Show { image, path, start } => {
            let fs = super::open_fs(&image)?;
            let id = start.subvolume_at(&fs, &path)?;
            print!("{}", show_subvolume(&fs, id)?);
            Ok(())
        }
        SubvolCmd::GetDefault { image } => {
            let fs = super::open_fs(&image)?;
            println!("{}", describe_subvolume(&fs, fs.default_subvolume())?);
            Ok(())
        }
        SubvolCmd::SetDefault {
            id,
            image,
            path,
            start,
        } => {
            let fs = open_rw(&image)?;
            let id = match (id, path) {
                (Some(id), _) => id,
                (None, Some(path)) => start.subvolume_at(&fs, &path)?,
                (None, None) => return Err(CliError("give a PATH or --id".into())),
            };
            fs.set_default_subvolume(id).map_err(|e| {
                CliError(format!(
                    "cannot make subvolume {id} the default: {}",
                    CliError::from(e)
                ))
            })?;
            fs.commit()?;
            println!("{}", describe_subvolume(&fs, id)?);
            Ok(())
        }
    }
}

/// One line about subvolume `id`, as `btrfs subvolume get-default` prints it.
fn describe_subvolume(fs: &Fs, id: u64) -> Result<String, CliError> {
    if id == butter::format::FS_TREE_OBJECTID {
        return Ok(format!("ID {id} (FS_TREE)"));
    }
    let list = fs.list_subvolumes()?;
    let s = list
        .iter()
        .find(|s| s.id == id)
        .ok_or_else(|| CliError(format!("subvolume {id} is not linked anywhere")))?;
    Ok(format!(
        "ID {} gen {} top level {} path {}",
        s.id, s.item.generation, s.parent, s.path
    ))
}

/// Subvolume `id` as `btrfs subvolume show` lays it out (times in UTC).
fn show_subvolume(fs: &Fs, id: u64) -> Result<String, CliError> {
    use super::ls::uuid_or_dash;
    let time = |t: &butter::format::items::Timespec| {
        if t.sec == 0 && t.nsec == 0 {
            "-".to_string()
        } else {
            format!("{} +0000", butter::format::print::utc_datetime(t.sec))
        }
    };
    let (path, parent, ri) = if id == butter::format::FS_TREE_OBJECTID {
        let ri = fs
            .find_root_item(id)?
            .ok_or_else(|| CliError("the top-level subvolume has no root item".into()))?;
        ("/".to_string(), 0, ri)
    } else {
        let list = fs.list_subvolumes()?;
        let s = list
            .into_iter()
            .find(|s| s.id == id)
            .ok_or_else(|| CliError(format!("subvolume {id} is not linked anywhere")))?;
        (s.path, s.parent, s.item)
    };
    let name = path.rsplit('/').next().unwrap_or(&path).to_string();
    let flags = if ri.flags & butter::format::ROOT_SUBVOL_RDONLY != 0 {
        "readonly"
    } else {
        "-"
    };
    let mut out = format!("{path}\n");
    for (k, v) in [
        ("Name", name),
        ("UUID", uuid_or_dash(&ri.uuid)),
        ("Parent UUID", uuid_or_dash(&ri.parent_uuid)),
        ("Received UUID", uuid_or_dash(&ri.received_uuid)),
        ("Creation time", time(&ri.otime)),
        ("Subvolume ID", id.to_string()),
        ("Generation", ri.generation.to_string()),
        ("Gen at creation", ri.otransid.to_string()),
        ("Parent ID", parent.to_string()),
        ("Top level ID", parent.to_string()),
        ("Flags", flags.to_string()),
        ("Send transid", ri.stransid.to_string()),
        ("Send time", time(&ri.stime)),
        ("Receive transid", ri.rtransid.to_string()),
        ("Receive time", time(&ri.rtime)),
    ] {
        out.push_str(&format!("\t{k}: \t{v}\n"));
    }
    Ok(out)
}
