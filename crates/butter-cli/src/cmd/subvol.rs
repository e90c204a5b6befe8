//! `butter subvolume create|snapshot|delete|sync|list|show|get-default|set-default`: subvolumes
//! of an image, without mounting it.
//!
//! Paths are inside the image, from the root of its default subvolume (as on a mount), or
//! of the subvolume `--subvol-id N` names.

use super::paths::Start;
use super::{CliError, CliResult};
use butter::fs::Fs;
use butter::inode::namespace::Owner;
use butter::inode::read::SubvolInfo;
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
    super::open_fs_rw(image, Default::default()).map_err(|e| {
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
            write_out(&show_subvolume(&fs, id)?)?;
            Ok(())
        }
        SubvolCmd::GetDefault { image } => {
            let fs = super::open_fs(&image)?;
            write_out(&describe_subvolume(&fs, fs.default_subvolume())?)?;
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
            write_out(&describe_subvolume(&fs, id)?)?;
            Ok(())
        }
    }
}

/// Writes bytes (names as they are) to standard output.
fn write_out(b: &[u8]) -> CliResult {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(b)?;
    out.flush()?;
    Ok(())
}

/// One line about subvolume `id`, as `btrfs subvolume get-default` prints it.
fn describe_subvolume(fs: &Fs, id: u64) -> Result<Vec<u8>, CliError> {
    if id == butter::format::FS_TREE_OBJECTID {
        return Ok(format!("ID {id} (FS_TREE)\n").into_bytes());
    }
    let list = fs.list_subvolumes()?;
    let s = list
        .iter()
        .find(|s| s.id == id)
        .ok_or_else(|| CliError(format!("subvolume {id} is not linked anywhere")))?;
    let mut out = format!(
        "ID {} gen {} top level {} path ",
        s.id, s.item.generation, s.parent
    )
    .into_bytes();
    out.extend_from_slice(&s.path);
    out.push(b'\n');
    Ok(out)
}

/// Subvolume `id` as `btrfs subvolume show` (btrfs-progs 6.14) lays it out: times in the
/// local time zone, the snapshots taken of it (paths from the top level, in the order the
/// kernel's subvolume iterator finds them), its quota group. As btrfs-progs does, "Send
/// time" repeats the creation time.
fn show_subvolume(fs: &Fs, id: u64) -> Result<Vec<u8>, CliError> {
    use super::ls::uuid_or_dash;
    let time = |t: &butter::format::items::Timespec| {
        if t.sec == 0 {
            "-".to_string()
        } else {
            let l = super::local_time(t.sec);
            format!("{} {}", l.date_time(' '), l.zone())
        }
    };
    let list = fs.list_subvolumes()?;
    let (path, name, parent, ri): (Vec<u8>, Vec<u8>, u64, _) =
        if id == butter::format::FS_TREE_OBJECTID {
            let ri = fs
                .find_root_item(id)?
                .ok_or_else(|| CliError("the top-level subvolume has no root item".into()))?;
            (b"/".to_vec(), b"<FS_TREE>".to_vec(), 0, ri)
        } else {
            let s = list
                .iter()
                .find(|s| s.id == id)
                .ok_or_else(|| CliError(format!("subvolume {id} is not linked anywhere")))?;
            let name = s.path.rsplit(|&b| b == b'/').next().unwrap_or(&s.path);
            (s.path.clone(), name.to_vec(), s.parent, s.item.clone())
        };
    if ri.received_uuid != [0; 16] && ri.flags & butter::format::ROOT_SUBVOL_RDONLY == 0 {
        eprintln!(
            "WARNING: the subvolume is read-write and has received_uuid set,\n\t don't use it \
             for incremental send. Please see section\n\t 'SUBVOLUME FLAGS' in manual page \
             btrfs-subvolume for\n\t further information."
        );
    }
    let mut out = path;
    out.extend_from_slice(b"\n\tName: \t\t\t");
    out.extend_from_slice(&name);
    out.push(b'\n');
    let created = time(&ri.otime);
    for (k, v) in [
        ("UUID: \t\t\t", uuid_or_dash(&ri.uuid)),
        ("Parent UUID: \t\t", uuid_or_dash(&ri.parent_uuid)),
        ("Received UUID: \t\t", uuid_or_dash(&ri.received_uuid)),
        ("Creation time: \t\t", created.clone()),
        ("Subvolume ID: \t\t", id.to_string()),
        ("Generation: \t\t", ri.generation.to_string()),
        ("Gen at creation: \t", ri.otransid.to_string()),
        ("Parent ID: \t\t", parent.to_string()),
        ("Top level ID: \t\t", parent.to_string()),
        (
            "Flags: \t\t\t",
            if ri.flags & butter::format::ROOT_SUBVOL_RDONLY != 0 {
                "readonly".into()
            } else {
                "-".into()
            },
        ),
        ("Send transid: \t\t", ri.stransid.to_string()),
        ("Send time: \t\t", created),
        ("Receive transid: \t", ri.rtransid.to_string()),
        ("Receive time: \t\t", time(&ri.rtime)),
    ] {
        out.extend_from_slice(format!("\t{k}{v}\n").as_bytes());
    }
    out.extend_from_slice(b"\tSnapshot(s):\n");
    for s in preorder(&list) {
        if s.item.parent_uuid == ri.uuid {
            out.extend_from_slice(b"\t\t\t\t");
            out.extend_from_slice(&s.path);
            out.push(b'\n');
        }
    }
    match fs.qgroup_usage(id)? {
        None => out.extend_from_slice(b"\tQuota group:\t\tn/a\n"),
        Some([rfer, excl, max_rfer, max_excl]) => {
            let size = |n: u64| super::filesystem::pretty(n, false, false);
            let limit = |n: u64| if n == 0 { "-".into() } else { size(n) };
            out.extend_from_slice(
                format!(
                    "\tQuota group:\t\t0/{id}\n\t  Limit referenced:\t{}\n\t  Limit exclusive:\t{}\n\t  Usage referenced:\t{}\n\t  Usage exclusive:\t{}\n",
                    limit(max_rfer),
                    limit(max_excl),
                    size(rfer),
                    size(excl)
                )
                .as_bytes(),
            );
        }
    }
    Ok(out)
}

/// Subvolumes in the order the kernel's subvolume iterator walks them from the top level:
/// depth first, a subvolume before those linked inside it, siblings by id.
fn preorder(list: &[SubvolInfo]) -> Vec<&SubvolInfo> {
    let mut kids: std::collections::HashMap<u64, Vec<&SubvolInfo>> = Default::default();
    for s in list {
        kids.entry(s.parent).or_default().push(s);
    }
    for v in kids.values_mut() {
        v.sort_by_key(|s| s.id);
    }
    let below = |id: u64| kids.get(&id).into_iter().flatten().rev().copied();
    let mut stack: Vec<&SubvolInfo> = below(butter::format::FS_TREE_OBJECTID).collect();
    let mut out = Vec::with_capacity(list.len());
    // Bounded by the list: a damaged tree that names a subvolume its own parent ends here.
    while let Some(s) = stack.pop().filter(|_| out.len() < list.len()) {
        out.push(s);
        stack.extend(below(s.id));
    }
    out
}
