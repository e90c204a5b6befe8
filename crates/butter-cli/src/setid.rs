//! What happens to a file's set-user-id and set-group-id bits, decided as the kernel's VFS
//! decides it for filesystems it serves itself.
//!
//! Through FUSE the kernel leaves part of this to the server: a write to a file opened with
//! O_DIRECT (FOPEN_DIRECT_IO), an fallocate, a copy_file_range into it and a truncate at open
//! (O_TRUNC) reach us with the bits untouched, and a chmod's mode keeps a set-group-id bit
//! the caller may not set. The kernel's rules, which we follow:
//!
//! - A change of a regular file's data (write, truncate, fallocate of any mode, the target of
//!   copy_file_range) by a caller without CAP_FSETID clears set-user-id, and set-group-id
//!   when the group may execute the file or the caller is not in the file's group (Linux
//!   6.x; before, a set-group-id bit without group execute stayed).
//! - A chmod that leaves set-group-id on, by a caller who is neither in the file's group nor
//!   holds CAP_FSETID, drops it.
//!
//! The caller is the process FUSE names in the request: its effective capabilities and
//! supplementary groups come from /proc/PID/status, read only when a bit is at stake.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

/// CAP_FSETID's bit in a capability set.
const CAP_FSETID: u32 = 4;

/// The caller of one request.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

impl Caller {
    /// Whether it holds CAP_FSETID (may keep the bits). A caller whose status cannot be read
    /// (it exited, or the kernel itself asked) counts as root does.
    pub(crate) fn has_fsetid(&self) -> bool {
        match self.status() {
            Some(s) => s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
                .is_some_and(|caps| caps & (1 << CAP_FSETID) != 0),
            None => self.uid == 0,
        }
    }

    /// Whether it is in group `gid`: its filesystem group or a supplementary one.
    pub(crate) fn in_group(&self, gid: u32) -> bool {
        if self.gid == gid {
            return true;
        }
        self.status().is_some_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
        })
    }

    fn status(&self) -> Option<String> {
        if self.pid == 0 {
            return None;
        }
        std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()
    }
}

/// The bits a change by `caller` of the data of a file with `mode` and group `gid` clears
/// (0: none).
pub(crate) fn killed_by_change(caller: &Caller, mode: u32, gid: u32) -> u32 {
    if mode & libc::S_IFMT != libc::S_IFREG {
        return 0;
    }
    let mut kill = mode & libc::S_ISUID;
    if mode & libc::S_ISGID != 0 && (mode & libc::S_IXGRP != 0 || !caller.in_group(gid)) {
        kill |= libc::S_ISGID;
    }
    if kill != 0 && caller.has_fsetid() {
        return 0;
    }
    kill
}

/// The mode a chmod to `mode` by `caller` of a file in group `gid` sets.
pub(crate) fn chmod_mode(caller: &Caller, mode: u32, gid: u32) -> u32 {
    if mode & libc::S_ISGID != 0 && !caller.in_group(gid) && !caller.has_fsetid() {
        mode & !libc::S_ISGID
    } else {
        mode
    }
}

/// Node ids whose mode had a set-id bit when last seen: every reply that carries attributes
/// notes the node, so a write looks at the inode only when a bit may be at stake.
#[derive(Default)]
pub(crate) struct SetIdNodes {
    nodes: Mutex<HashSet<u64>>,
    count: AtomicUsize,
}

impl SetIdNodes {
    /// Notes what node `node`'s `mode` says.
    pub(crate) fn note(&self, node: u64, mode: u32) {
        let has = mode & (libc::S_ISUID | libc::S_ISGID) != 0;
        if !has && self.count.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut n = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let changed = if has { n.insert(node) } else { n.remove(&node) };
        if changed {
            self.count.store(n.len(), Ordering::Relaxed);
        }
    }

    /// Whether `node` may have a set-id bit.
    pub(crate) fn may_have(&self, node: u64) -> bool {
        self.count.load(Ordering::Relaxed) > 0
            && self
                .nodes
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .contains(&node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_clears_suid_and_sgid_unless_in_the_group_without_group_execute() {
        let reg = libc::S_IFREG;
        // No /proc status (pid 0), not root: no CAP_FSETID, in group 100 alone.
        let c = Caller {
            uid: 1000,
            gid: 100,
            pid: 0,
        };
        assert_eq!(killed_by_change(&c, reg | 0o6644, 100), libc::S_ISUID);
        assert_eq!(
            killed_by_change(&c, reg | 0o6644, 5),
            libc::S_ISUID | libc::S_ISGID
        );
        assert_eq!(
            killed_by_change(&c, reg | 0o6654, 100),
            libc::S_ISUID | libc::S_ISGID
        );
        assert_eq!(killed_by_change(&c, reg | 0o2644, 100), 0);
        assert_eq!(killed_by_change(&c, reg | 0o2754, 100), libc::S_ISGID);
        assert_eq!(killed_by_change(&c, libc::S_IFDIR | 0o6755, 5), 0);
        let root = Caller {
            uid: 0,
            gid: 0,
            pid: 0,
        };
        assert_eq!(killed_by_change(&root, reg | 0o6777, 5), 0);
    }

    #[test]
    fn the_kernel_and_a_process_without_status_count_as_privileged() {
        let k = Caller {
            uid: 0,
            gid: 0,
            pid: 0,
        };
        assert!(k.has_fsetid());
        let gone = Caller {
            uid: 1000,
            gid: 1000,
            pid: 0,
        };
        assert!(!gone.has_fsetid());
        assert_eq!(chmod_mode(&gone, 0o2755, 5), 0o755);
        assert_eq!(chmod_mode(&gone, 0o2755, 1000), 0o2755);
    }

    #[test]
    fn nodes_are_noted_and_forgotten() {
        let s = SetIdNodes::default();
        assert!(!s.may_have(7));
        s.note(7, libc::S_IFREG | 0o4755);
        assert!(s.may_have(7));
        s.note(7, libc::S_IFREG | 0o755);
        assert!(!s.may_have(7));
    }
}
