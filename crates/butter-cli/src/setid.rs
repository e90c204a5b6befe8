//! The caller of a FUSE request as the engine's POSIX rules see it
//! (`butter::fs::posix::Caller`): the process FUSE names, its effective capabilities and
//! supplementary groups read from /proc/PID/status, and only when a set-id bit is at stake.

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
    fn status(&self) -> Option<String> {
        if self.pid == 0 {
            return None;
        }
        std::fs::read_to_string(format!("/proc/{}/status", self.pid)).ok()
    }
}

impl butter::fs::posix::Caller for Caller {
    fn uid(&self) -> u32 {
        self.uid
    }

    fn gid(&self) -> u32 {
        self.gid
    }

    /// A caller whose status cannot be read (it exited, or the kernel itself asked) counts
    /// as root does.
    fn has_fsetid(&self) -> bool {
        match self.status() {
            Some(s) => s
                .lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
                .is_some_and(|caps| caps & (1 << CAP_FSETID) != 0),
            None => self.uid == 0,
        }
    }

    /// Its filesystem group or a supplementary one.
    fn in_group(&self, gid: u32) -> bool {
        if self.gid == gid {
            return true;
        }
        self.status().is_some_and(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Groups:"))
                .is_some_and(|g| g.split_whitespace().any(|x| x.parse() == Ok(gid)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use butter::fs::posix::Caller as _;

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
        assert!(gone.in_group(1000));
    }
}
