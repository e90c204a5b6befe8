//! `butter mount --ro IMAGE DIR`: serve an image through FUSE, in the foreground, until it is
//! unmounted (`fusermount3 -u DIR`) or the process gets SIGINT/SIGTERM (then it unmounts and
//! exits 0). Read-only for now: writing comes later, so `--ro` (or `-o ro`) is required.

use super::{open_fs, CliError, CliResult};
use crate::fuse::{self, MountConfig};
use butter::format::FS_TREE_OBJECTID;
use butter::fs::{Fs, Inode};
use fuser::MountOption;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct MountArgs {
    /// Image file or block device.
    pub image: PathBuf,
    /// Mount point: an existing directory.
    pub dir: PathBuf,
    /// Mount read-only (required until butter can write).
    #[arg(long)]
    pub ro: bool,
    /// Mount options, comma separated, may repeat: ro, allow_other, allow_root, fsname=NAME,
    /// subtype=NAME, subvol=PATH, subvolid=N, dev, nodev, suid, nosuid, exec, noexec, atime,
    /// noatime.
    #[arg(short = 'o', value_name = "OPTIONS")]
    pub options: Vec<String>,
    /// Mount this subvolume (path from the top-level subvolume) instead of the default one.
    #[arg(long, value_name = "PATH", conflicts_with = "subvol_id")]
    pub subvol: Option<String>,
    /// Mount the subvolume with this id (5 is the top level).
    #[arg(long, value_name = "N")]
    pub subvol_id: Option<u64>,
    /// Let users other than the one mounting see the files (FUSE allow_other).
    #[arg(long)]
    pub allow_other: bool,
    /// Worker threads serving requests.
    #[arg(long, default_value_t = 4, value_name = "N")]
    pub threads: usize,
}

/// Which subvolume becomes the mount's root.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Subvol {
    Default,
    Path(String),
    Id(u64),
}

/// The command line, with the `-o` list folded in.
#[derive(Debug)]
struct Plan {
    ro: bool,
    subvol: Subvol,
    cfg: MountConfig,
}

fn plan(a: &MountArgs) -> Result<Plan, CliError> {
    let mut ro = a.ro;
    let mut rw = false;
    let mut subvol = match (&a.subvol, a.subvol_id) {
        (Some(p), _) => Subvol::Path(p.clone()),
        (None, Some(id)) => Subvol::Id(id),
        (None, None) => Subvol::Default,
    };
    let mut cfg = MountConfig {
        fsname: "butter".into(),
        subtype: "butter".into(),
        allow_other: a.allow_other,
        allow_root: false,
        flags: Vec::new(),
        threads: a.threads.max(1),
    };
    for opt in a.options.iter().flat_map(|o| o.split(',')) {
        let (key, value) = match opt.split_once('=') {
            Some((k, v)) => (k, Some(v)),
            None => (opt, None),
        };
        let flag = match (key, value) {
            ("", None) => None,
            ("ro", None) => {
                ro = true;
                None
            }
            ("rw", None) => {
                rw = true;
                None
            }
            ("allow_other", None) => {
                cfg.allow_other = true;
                None
            }
            ("allow_root", None) => {
                cfg.allow_root = true;
                None
            }
            // Always on: the kernel checks permissions from the modes we report.
            ("default_permissions", None) => None,
            ("fsname", Some(v)) if !v.is_empty() => {
                cfg.fsname = v.to_string();
                None
            }
            ("subtype", Some(v)) if !v.is_empty() => {
                cfg.subtype = v.to_string();
                None
            }
            ("subvol", Some(v)) => {
                subvol = Subvol::Path(v.to_string());
                None
            }
            ("subvolid", Some(v)) => {
                let id = v
                    .parse()
                    .map_err(|_| CliError(format!("subvolid={v}: not a number")))?;
                subvol = Subvol::Id(id);
                None
            }
            ("dev", None) => Some(MountOption::Dev),
            ("nodev", None) => Some(MountOption::NoDev),
            ("suid", None) => Some(MountOption::Suid),
            ("nosuid", None) => Some(MountOption::NoSuid),
            ("exec", None) => Some(MountOption::Exec),
            ("noexec", None) => Some(MountOption::NoExec),
            ("atime", None) => Some(MountOption::Atime),
            ("noatime", None) => Some(MountOption::NoAtime),
            _ => return Err(CliError(format!("unknown mount option '{opt}'"))),
        };
        cfg.flags.extend(flag);
    }
    if rw {
        ro = false;
    }
    Ok(Plan { ro, subvol, cfg })
}

/// The root directory of the subvolume to mount. `subvol=` paths start at the top-level
/// subvolume (id 5), as with the kernel, and must name a subvolume.
fn subvol_root(fs: &Fs, s: &Subvol) -> Result<Inode, CliError> {
    match s {
        Subvol::Default => Ok(fs.root_inode()),
        Subvol::Id(id) => fs.subvol_root_inode(*id).map_err(|e| match e {
            butter::Error::NotFound(_) => CliError(format!("no subvolume with id {id}")),
            e => e.into(),
        }),
        Subvol::Path(path) => {
            let mut cur = fs.subvol_root_inode(FS_TREE_OBJECTID)?;
            for comp in path.split('/').filter(|c| !c.is_empty() && *c != ".") {
                if !fs.stat(cur)?.is_dir() {
                    return Err(CliError(format!("subvol {path}: not a directory")));
                }
                cur = fs
                    .lookup(cur, comp.as_bytes())?
                    .ok_or_else(|| CliError(format!("subvol {path}: no such file or directory")))?
                    .target;
            }
            if cur != fs.subvol_root_inode(cur.root)? {
                return Err(CliError(format!("subvol {path}: not a subvolume")));
            }
            Ok(cur)
        }
    }
}

pub fn mount(a: MountArgs) -> CliResult {
    let p = plan(&a)?;
    if !p.ro {
        return Err(CliError(
            "read-write mounting is not implemented yet; mount read-only with --ro (or -o ro)"
                .into(),
        ));
    }
    if !a.dir.is_dir() {
        return Err(CliError(format!(
            "mount point {} is not a directory",
            a.dir.display()
        )));
    }
    let fs = Arc::new(open_fs(&a.image)?);
    let root = subvol_root(&fs, &p.subvol)?;
    if !fs.stat(root)?.is_dir() {
        return Err(CliError(format!(
            "the root of subvolume {} is not a directory",
            root.root
        )));
    }
    fuse::serve(fs, root, &a.dir, &p.cfg).map_err(|e| {
        CliError(format!(
            "mounting {} on {}: {e}",
            a.image.display(),
            a.dir.display()
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct T {
        #[command(flatten)]
        a: MountArgs,
    }

    fn parse(args: &[&str]) -> Result<Plan, CliError> {
        let mut v = vec!["t"];
        v.extend_from_slice(args);
        plan(&T::try_parse_from(v).map_err(|e| CliError(e.to_string()))?.a)
    }

    #[test]
    fn ro_is_required() {
        assert!(!parse(&["img", "dir"]).unwrap().ro);
        assert!(parse(&["--ro", "img", "dir"]).unwrap().ro);
        assert!(parse(&["-o", "ro", "img", "dir"]).unwrap().ro);
        assert!(!parse(&["--ro", "-o", "rw", "img", "dir"]).unwrap().ro);
    }

    #[test]
    fn options() {
        let p = parse(&[
            "-o",
            "ro,allow_other,fsname=x,subvolid=257",
            "-o",
            "noexec",
            "img",
            "dir",
        ])
        .unwrap();
        assert!(p.cfg.allow_other);
        assert_eq!(p.cfg.fsname, "x");
        assert_eq!(p.subvol, Subvol::Id(257));
        assert_eq!(p.cfg.flags, vec![MountOption::NoExec]);
        let p = parse(&["--ro", "--subvol", "a/b", "img", "dir"]).unwrap();
        assert_eq!(p.subvol, Subvol::Path("a/b".into()));
        assert!(!p.cfg.allow_other);
        assert!(parse(&["-o", "ro,bogus", "img", "dir"]).is_err());
        assert!(parse(&["--subvol", "a", "--subvol-id", "5", "img", "dir"]).is_err());
    }
}
