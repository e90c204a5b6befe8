//! Paths inside an image, and `--subvol-id N`: the subvolume they start from.
//!
//! Every command that takes a path inside an image takes it from the root of the default
//! subvolume, as a mount without `subvol=` shows the filesystem, unless `--subvol-id N` names
//! another start (5 is the top level, where the paths `butter subvolumes` prints start).
//! Paths are bytes: names that are not UTF-8 reach their files.

use super::CliError;
use butter::fs::{Fs, Inode};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

#[derive(clap::Args, Clone, Copy, Debug, Default)]
pub struct Start {
    /// Take paths inside the image from subvolume N, as a mount with subvolid=N shows them
    /// (5 is the top level, where the paths `butter subvolumes` prints start). Default: the
    /// default subvolume.
    #[arg(long = "subvol-id", value_name = "N")]
    pub subvol_id: Option<u64>,
}

impl Start {
    /// The directory paths start from.
    pub fn root(&self, fs: &Fs) -> Result<Inode, CliError> {
        match self.subvol_id {
            None => Ok(fs.root_inode()),
            Some(id) => fs.subvol_root_inode(id).map_err(|e| {
                CliError(format!(
                    "--subvol-id {id}: {}\n  `butter subvolumes IMAGE` lists the subvolumes and their ids",
                    CliError::from(e)
                ))
            }),
        }
    }

    /// The inode at `path`, crossing into subvolumes, not following symlinks.
    pub fn resolve(&self, fs: &Fs, path: &OsStr) -> Result<Inode, CliError> {
        let shown = path.to_string_lossy();
        fs.resolve_in(self.root(fs)?, path.as_bytes())
            .map_err(|e| match e {
                butter::Error::NotFound(_) => self.not_found(fs, &shown),
                e => CliError(format!("{shown}: {}", CliError::from(e))),
            })
    }

    /// "not found", and where paths start when that may be the reason.
    fn not_found(&self, fs: &Fs, shown: &str) -> CliError {
        let default = fs.default_subvolume();
        let mut msg = format!("{shown}: not found");
        match self.subvol_id {
            None if default != butter::format::FS_TREE_OBJECTID => msg.push_str(&format!(
                "\n  paths start in the default subvolume (id {default}), not at the top level; \
                 with --subvol-id 5 they start where the paths `butter subvolumes` prints do"
            )),
            None => {}
            Some(id) => msg.push_str(&format!(" (paths start in subvolume {id})")),
        }
        CliError(msg)
    }

    /// Splits `path` into its parent directory's inode and its last name, which must be a
    /// new name (not empty, "." or "..").
    pub fn parent_and_name(&self, fs: &Fs, path: &OsStr) -> Result<(Inode, Vec<u8>), CliError> {
        let b = path.as_bytes();
        let mut trimmed = b;
        while let Some(t) = trimmed.strip_suffix(b"/") {
            trimmed = t;
        }
        let (parent, name) = match trimmed.iter().rposition(|&c| c == b'/') {
            Some(i) => (&trimmed[..i], &trimmed[i + 1..]),
            None => (&b""[..], trimmed),
        };
        if name.is_empty() || name == b"." || name == b".." {
            return Err(CliError(format!(
                "{:?}: give a path that ends in a new name",
                path
            )));
        }
        let dir = self
            .resolve(fs, OsStr::from_bytes(parent))
            .map_err(|e| CliError(format!("parent directory of {path:?}: {e}")))?;
        Ok((dir, name.to_vec()))
    }

    /// The id of the subvolume whose root directory `path` is.
    pub fn subvolume_at(&self, fs: &Fs, path: &OsStr) -> Result<u64, CliError> {
        let ino = self.resolve(fs, path)?;
        if ino != fs.subvol_root_inode(ino.root)? {
            return Err(CliError(format!(
                "{} is not the root of a subvolume (see `butter subvolume list`)",
                path.to_string_lossy()
            )));
        }
        Ok(ino.root)
    }
}
