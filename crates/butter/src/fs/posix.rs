//! What the kernel's VFS decides for the filesystems it serves itself and leaves to a FUSE
//! server: the set-id bits and file capabilities a change clears, the set-id bit a chmod may
//! keep, and the mode and ACL of a new inode (set-group-id directories, default ACLs, umask).
//! The operations of [`crate::fs::Fs`] that take a [`Caller`] apply these rules as they
//! change the inode, under the same passage of the gate.
//!
//! The rules (Linux 6.x):
//!
//! - A change of a regular file's data (write, truncate, fallocate of any mode, the target of
//!   copy_file_range) by a caller without CAP_FSETID clears set-user-id, and set-group-id
//!   when the group may execute the file or the caller is not in the file's group.
//! - A chown clears set-user-id, and set-group-id with group execute, whoever makes it.
//! - A write, truncate or chown removes `security.capability`.
//! - A chmod that leaves set-group-id on, by a caller who is neither in the file's group nor
//!   holds CAP_FSETID, drops it.

use crate::ids::Inode;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// The xattr holding file capabilities.
pub(crate) const CAPS: &[u8] = b"security.capability";

/// Who asks for a change: what the rules need to know about the calling process.
pub trait Caller {
    /// Its filesystem user id.
    fn uid(&self) -> u32;
    /// Its filesystem group id.
    fn gid(&self) -> u32;
    /// Whether it holds CAP_FSETID (may keep set-id bits).
    fn has_fsetid(&self) -> bool;
    /// Whether it is in group `gid` (its own or a supplementary one).
    fn in_group(&self, gid: u32) -> bool;
}

/// A caller with every capability (the engine's own tests).
#[cfg(test)]
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Root;

#[cfg(test)]
impl Caller for Root {
    fn uid(&self) -> u32 {
        0
    }
    fn gid(&self) -> u32 {
        0
    }
    fn has_fsetid(&self) -> bool {
        true
    }
    fn in_group(&self, _gid: u32) -> bool {
        true
    }
}

/// The bits a change by `caller` of the data of a file with `mode` and group `gid` clears
/// (0: none).
pub(crate) fn killed_by_change(caller: &dyn Caller, mode: u32, gid: u32) -> u32 {
    if mode & S_IFMT != S_IFREG {
        return 0;
    }
    let mut kill = mode & S_ISUID;
    if mode & S_ISGID != 0 && (mode & S_IXGRP != 0 || !caller.in_group(gid)) {
        kill |= S_ISGID;
    }
    if kill != 0 && caller.has_fsetid() {
        return 0;
    }
    kill
}

/// The bits a chown of a file with `mode` clears, whoever makes it.
pub(crate) fn killed_by_chown(mode: u32) -> u32 {
    if mode & S_IFMT != S_IFREG {
        return 0;
    }
    let mut kill = mode & S_ISUID;
    if mode & S_IXGRP != 0 {
        kill |= mode & S_ISGID;
    }
    kill
}

/// The mode a chmod to `mode` by `caller` of a file in group `gid` sets.
pub(crate) fn chmod_mode(caller: &dyn Caller, mode: u32, gid: u32) -> u32 {
    if mode & S_ISGID != 0 && !caller.in_group(gid) && !caller.has_fsetid() {
        mode & !S_ISGID
    } else {
        mode
    }
}

pub(crate) const S_IFMT: u32 = 0o170_000;
pub(crate) const S_IFREG: u32 = 0o100_000;
pub(crate) const S_IFDIR: u32 = 0o040_000;
pub(crate) const S_IFLNK: u32 = 0o120_000;
pub(crate) const S_ISUID: u32 = 0o4000;
pub(crate) const S_ISGID: u32 = 0o2000;
pub(crate) const S_IXGRP: u32 = 0o010;

/// Largest number of inodes whose capability xattr is remembered; past it the memory starts
/// afresh (a cache, so a mount's memory does not grow with the files it writes).
const CAPS_REMEMBERED: usize = 4096;

/// What the operations remember to spare a look at the inode on every write: the inodes
/// whose mode had a set-id bit when last seen (every inode item handed out is noted), and
/// whether an inode has `security.capability`.
#[derive(Default)]
pub(crate) struct Remembered {
    setid: Mutex<HashSet<Inode>>,
    setid_count: AtomicUsize,
    caps: Mutex<HashMap<Inode, bool>>,
}

impl Remembered {
    /// Notes what `ino`'s `mode` says.
    pub(crate) fn note_mode(&self, ino: Inode, mode: u32) {
        let has = mode & (S_ISUID | S_ISGID) != 0;
        if !has && self.setid_count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut n = self.setid.lock().unwrap_or_else(|e| e.into_inner());
        let changed = if has { n.insert(ino) } else { n.remove(&ino) };
        if changed {
            self.setid_count.store(n.len(), Ordering::Relaxed);
        }
    }

    /// Whether `ino` may have a set-id bit.
    pub(crate) fn may_have_setid(&self, ino: Inode) -> bool {
        self.setid_count.load(Ordering::Relaxed) > 0
            && self
                .setid
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&ino)
    }

    /// What is known of `ino`'s capability xattr (`None`: not looked at).
    pub(crate) fn caps(&self, ino: Inode) -> Option<bool> {
        self.caps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&ino)
            .copied()
    }

    /// Notes whether `ino` has a capability xattr.
    pub(crate) fn note_caps(&self, ino: Inode, has: bool) {
        let mut c = self.caps.lock().unwrap_or_else(|e| e.into_inner());
        if c.len() >= CAPS_REMEMBERED && !c.contains_key(&ino) {
            c.clear();
        }
        c.insert(ino, has);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A caller without CAP_FSETID in group 100 alone.
    struct User;
    impl Caller for User {
        fn uid(&self) -> u32 {
            1000
        }
        fn gid(&self) -> u32 {
            100
        }
        fn has_fsetid(&self) -> bool {
            false
        }
        fn in_group(&self, gid: u32) -> bool {
            gid == 100
        }
    }

    #[test]
    fn a_change_clears_suid_and_sgid_unless_in_the_group_without_group_execute() {
        let reg = S_IFREG;
        let c = User;
        assert_eq!(killed_by_change(&c, reg | 0o6644, 100), S_ISUID);
        assert_eq!(killed_by_change(&c, reg | 0o6644, 5), S_ISUID | S_ISGID);
        assert_eq!(killed_by_change(&c, reg | 0o6654, 100), S_ISUID | S_ISGID);
        assert_eq!(killed_by_change(&c, reg | 0o2644, 100), 0);
        assert_eq!(killed_by_change(&c, reg | 0o2754, 100), S_ISGID);
        assert_eq!(killed_by_change(&c, S_IFDIR | 0o6755, 5), 0);
        assert_eq!(killed_by_change(&Root, reg | 0o6777, 5), 0);
    }

    #[test]
    fn chown_and_chmod_rules() {
        assert_eq!(killed_by_chown(S_IFREG | 0o6755), S_ISUID | S_ISGID);
        assert_eq!(killed_by_chown(S_IFREG | 0o6745), S_ISUID);
        assert_eq!(killed_by_chown(S_IFDIR | 0o6755), 0);
        assert_eq!(chmod_mode(&User, 0o2755, 5), 0o755);
        assert_eq!(chmod_mode(&User, 0o2755, 100), 0o2755);
        assert_eq!(chmod_mode(&Root, 0o2755, 5), 0o2755);
    }

    #[test]
    fn inodes_are_noted_and_forgotten() {
        let r = Remembered::default();
        let i = Inode { root: 5, ino: 300 };
        assert!(!r.may_have_setid(i));
        r.note_mode(i, S_IFREG | 0o4755);
        assert!(r.may_have_setid(i));
        r.note_mode(i, S_IFREG | 0o755);
        assert!(!r.may_have_setid(i));
        assert_eq!(r.caps(i), None);
        r.note_caps(i, true);
        assert_eq!(r.caps(i), Some(true));
    }
}
