//! The receiver's namespace while a stream is being made: which names each inode has there
//! now, so every command can name its inode by a path that exists at that point of the
//! stream.
//!
//! Inodes are (number, generation) pairs: a number the parent snapshot used for another inode
//! (deleted, then reused) is another inode. An inode the stream has not touched has, on the
//! receiver, the names the parent snapshot gives it (nothing, in a full send); once touched,
//! its names are kept here. Orphan names (`o<ino>-<gen>-<n>` in the subvolume's root) hold
//! inodes between losing their old names and getting their new ones, as in the kernel's send.

use crate::error::{Error, Result};
use crate::format::*;
use crate::fs::Fs;
use crate::send::tree::{inode_info, Snap};
use std::collections::{HashMap, HashSet};

/// An inode: number and generation.
pub(crate) type Id = (u64, u64);

/// A base snapshot's inode: its generation and names (directory number, name).
type BaseInode = Option<(u64, Vec<(u64, Vec<u8>)>)>;

/// The subvolume's root directory.
const ROOT: u64 = FIRST_FREE_OBJECTID;

/// The root directory as an inode: generation 0 stands for it in every snapshot.
pub(crate) const ROOT_ID: Id = (ROOT, 0);

/// Directory `ino` of generation `gen` as an inode ([`ROOT_ID`] for the root).
pub(crate) fn dir_id(ino: u64, gen: u64) -> Id {
    if ino == ROOT {
        ROOT_ID
    } else {
        (ino, gen)
    }
}

pub(crate) struct Names<'a> {
    fs: &'a Fs,
    /// The parent snapshot (what the receiver has before the stream), if any.
    base: Option<&'a Snap>,
    /// Names of touched inodes: (directory, its generation, name).
    touched: HashMap<Id, Vec<(Id, Vec<u8>)>>,
    /// Touched names by place, to see what a name is taken by.
    at: HashMap<(Id, Vec<u8>), Id>,
    /// Names the base snapshot had that the stream took away.
    gone: HashSet<(Id, Vec<u8>)>,
    /// Base inodes read so far: id -> (names).
    base_cache: HashMap<u64, BaseInode>,
}

impl<'a> Names<'a> {
    pub(crate) fn new(fs: &'a Fs, base: Option<&'a Snap>) -> Names<'a> {
        Names {
            fs,
            base,
            touched: HashMap::new(),
            at: HashMap::new(),
            gone: HashSet::new(),
            base_cache: HashMap::new(),
        }
    }

    /// The base snapshot's generation and names of inode `ino`.
    fn base_inode(&mut self, ino: u64) -> Result<BaseInode> {
        if let Some(b) = self.base_cache.get(&ino) {
            return Ok(b.clone());
        }
        let got = match self.base {
            Some(base) => inode_info(self.fs, base, ino)?.map(|i| (i.gen(), i.names)),
            None => None,
        };
        self.base_cache.insert(ino, got.clone());
        Ok(got)
    }

    /// The generation inode `ino` has in the base snapshot.
    pub(crate) fn base_gen(&mut self, ino: u64) -> Result<Option<u64>> {
        Ok(self.base_inode(ino)?.map(|b| b.0))
    }

    /// The names `id` has on the receiver now.
    pub(crate) fn names(&mut self, id: Id) -> Result<Vec<(Id, Vec<u8>)>> {
        if let Some(n) = self.touched.get(&id) {
            return Ok(n.clone());
        }
        let Some((gen, names)) = self.base_inode(id.0)? else {
            return Ok(Vec::new());
        };
        if gen != id.1 {
            return Ok(Vec::new());
        }
        let mut out = Vec::new();
        for (dir, name) in names {
            let dgen = if dir == ROOT {
                0
            } else {
                self.base_gen(dir)?.unwrap_or(0)
            };
            out.push(((dir, dgen), name));
        }
        Ok(out)
    }

    /// Whether `id` exists on the receiver now (the root always does).
    pub(crate) fn exists(&mut self, id: Id) -> Result<bool> {
        Ok(id.0 == ROOT || !self.names(id)?.is_empty())
    }

    /// The path of `id` on the receiver now, from the subvolume's root ("" for the root).
    pub(crate) fn path(&mut self, id: Id) -> Result<Vec<u8>> {
        let mut parts: Vec<Vec<u8>> = Vec::new();
        let mut cur = id;
        for _ in 0..4096 {
            if cur.0 == ROOT {
                parts.reverse();
                return Ok(parts.join(&b'/'));
            }
            let names = self.names(cur)?;
            let Some((dir, name)) = names.into_iter().next() else {
                return Err(Error::Internal(format!(
                    "send: inode {} (generation {}) has no name on the receiver",
                    cur.0, cur.1
                )));
            };
            parts.push(name);
            cur = dir;
        }
        Err(Error::Internal(format!(
            "send: the path of inode {} does not reach the root",
            id.0
        )))
    }

    /// `dir/name` as a path.
    pub(crate) fn join(&mut self, dir: Id, name: &[u8]) -> Result<Vec<u8>> {
        let mut p = self.path(dir)?;
        if !p.is_empty() {
            p.push(b'/');
        }
        p.extend_from_slice(name);
        Ok(p)
    }

    /// What has `name` in `dir` on the receiver now.
    pub(crate) fn taken_by(&mut self, dir: Id, name: &[u8]) -> Result<Option<Id>> {
        if let Some(id) = self.at.get(&(dir, name.to_vec())) {
            return Ok(Some(*id));
        }
        if self.gone.contains(&(dir, name.to_vec())) {
            return Ok(None);
        }
        let Some(base) = self.base else {
            return Ok(None);
        };
        if dir.0 != ROOT && self.base_gen(dir.0)? != Some(dir.1) {
            return Ok(None);
        }
        let key = Key::new(dir.0, DIR_ITEM_KEY, crate::format::hash::name_hash(name));
        let Some(it) = crate::ctree::lookup(self.fs.core().disk(), &base.root, &key)? else {
            return Ok(None);
        };
        for d in crate::format::items::DirItem::parse_all(it.data()).map_err(|e| it.annotate(e))? {
            if d.name == name && d.location.ty == INODE_ITEM_KEY {
                let ino = d.location.objectid;
                let gen = if ino == ROOT {
                    0
                } else {
                    self.base_gen(ino)?.unwrap_or(0)
                };
                // Still there only if that inode still has this name.
                let still = self
                    .names((ino, gen))?
                    .iter()
                    .any(|(d2, n)| *d2 == dir && n == name);
                return Ok(still.then_some((ino, gen)));
            }
        }
        Ok(None)
    }

    /// Whether `anc` is `id` or one of its directories on the receiver now.
    pub(crate) fn is_within(&mut self, id: Id, anc: Id) -> Result<bool> {
        let mut cur = id;
        for _ in 0..4096 {
            if cur == anc {
                return Ok(true);
            }
            if cur.0 == ROOT {
                return Ok(false);
            }
            match self.names(cur)?.into_iter().next() {
                Some((dir, _)) => cur = dir,
                None => return Ok(false),
            }
        }
        Ok(false)
    }

    /// Records that `id` now has exactly `names`.
    pub(crate) fn set(&mut self, id: Id, names: Vec<(Id, Vec<u8>)>) -> Result<()> {
        let old = self.names(id)?;
        for (dir, name) in &old {
            self.at.remove(&(*dir, name.clone()));
            // Only a base snapshot's names need remembering as gone.
            if self.base.is_some() && !names.contains(&(*dir, name.clone())) {
                self.gone.insert((*dir, name.clone()));
            }
        }
        for (dir, name) in &names {
            self.at.insert((*dir, name.clone()), id);
            self.gone.remove(&(*dir, name.clone()));
        }
        self.touched.insert(id, names);
        Ok(())
    }

    /// Drops `id` from the model (a full send's finished file: nothing names it again but
    /// through the snapshot).
    pub(crate) fn forget(&mut self, id: Id) {
        if let Some(names) = self.touched.remove(&id) {
            for (dir, name) in names {
                self.at.remove(&(dir, name));
            }
        }
    }

    /// An orphan name for `id` free in the root directory.
    pub(crate) fn orphan_name(&mut self, id: Id) -> Result<Vec<u8>> {
        for n in 0..u64::MAX {
            let name = format!("o{}-{}-{n}", id.0, id.1).into_bytes();
            if self.taken_by(ROOT_ID, &name)?.is_none() {
                return Ok(name);
            }
        }
        Err(Error::Internal("send: no free orphan name".into()))
    }
}
