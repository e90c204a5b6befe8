//! A progress line on stderr for long commands (send, receive): at most once a second,
//! after the first second, rewritten in place on a terminal, one line each time otherwise
//! (a log), never when the command was asked to be quiet.

use std::io::{IsTerminal, Write};
use std::time::{Duration, Instant};

pub struct Meter {
    verb: &'static str,
    on: bool,
    tty: bool,
    start: Instant,
    last: Instant,
    shown: bool,
}

impl Meter {
    /// A meter for `verb` ("receiving", "sending"); shown only when `on`.
    pub fn new(verb: &'static str, on: bool) -> Meter {
        let now = Instant::now();
        Meter {
            verb,
            on,
            tty: std::io::stderr().is_terminal(),
            start: now,
            last: now,
            shown: false,
        }
    }

    /// Shows `bytes` of stream and `commands` so far, with the rate, if a second has passed.
    pub fn tick(&mut self, bytes: u64, commands: u64) {
        if !self.on || self.last.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last = Instant::now();
        self.print(bytes, commands, false);
        self.shown = true;
    }

    /// Ends the line with the final numbers, if a line was shown.
    pub fn done(&mut self, bytes: u64, commands: u64) {
        if self.shown {
            self.print(bytes, commands, true);
            self.shown = false;
        }
    }

    fn print(&self, bytes: u64, commands: u64, last: bool) {
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        let line = format!(
            "{}: {} of stream, {commands} commands, {}/s, {secs:.0}s",
            self.verb,
            human(bytes),
            human((bytes as f64 / secs) as u64),
        );
        let mut err = std::io::stderr().lock();
        let _ = if self.tty {
            write!(err, "\r{line}\x1b[K{}", if last { "\n" } else { "" })
        } else {
            writeln!(err, "{line}")
        };
    }
}

/// 1.5 MiB, 312 KiB, 17 B.
pub fn human(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// A status line for operations that report what they are doing in words (relocation): on a
/// terminal the latest message, rewritten in place at most five times a second; otherwise
/// nothing (the command prints its result when done). `end` finishes the line.
pub struct StatusLine {
    tty: bool,
    last: Option<Instant>,
    shown: bool,
}

impl StatusLine {
    pub fn new() -> StatusLine {
        StatusLine {
            tty: std::io::stderr().is_terminal(),
            last: None,
            shown: false,
        }
    }

    pub fn show(&mut self, msg: &str) {
        if !self.tty
            || self
                .last
                .is_some_and(|t| t.elapsed() < Duration::from_millis(200))
        {
            return;
        }
        self.last = Some(Instant::now());
        self.shown = true;
        let mut err = std::io::stderr().lock();
        let _ = write!(err, "\r{msg}\x1b[K");
    }

    pub fn end(&mut self) {
        if self.shown {
            let _ = writeln!(std::io::stderr().lock());
            self.shown = false;
        }
    }
}

/// Sends a btrfs ioctl to the directory `dir` (a butter mount's): `buf` is its argument, read
/// and (for an _IOWR one) written back. For the commands that reach a running mount.
pub fn dir_ioctl(dir: &std::path::Path, cmd: u32, buf: &mut [u8]) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(dir)?;
    // SAFETY: `buf` is as long as the size the command number encodes (the callers build
    // it so), and it outlives the call.
    let r = unsafe { libc::ioctl(f.as_raw_fd(), cmd as _, buf.as_mut_ptr()) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
