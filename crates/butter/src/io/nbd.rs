//! A device on another machine, through the Network Block Device protocol: a small client of
//! its fixed newstyle handshake (NBD_OPT_GO, with NBD_OPT_STRUCTURED_REPLY where the server
//! offers it) and of the transmission commands READ, WRITE, FLUSH and TRIM, with FUA where
//! the server takes it. One request is in flight at a time (the device is shared behind a
//! lock), and a flush is the server's NBD_CMD_FLUSH: every write it acknowledged before is on
//! its stable storage, the same barrier a local file's fdatasync gives. A server that offers
//! no flush gets every write with FUA instead; one that offers neither is refused for
//! writing. Replies are checked for their magic, their cookie, their length and the error
//! the server sends, and nothing the server says is trusted beyond that: a malformed reply
//! is an I/O error naming it, and the connection is not used again.
//!
//! Addresses: `nbd://HOST[:PORT][/NAME]` (TCP, port 10809 by default) and
//! `nbd+unix:///NAME?socket=PATH` (a Unix socket), as qemu and libnbd spell them.

use crate::io::device::BlockDevice;
use std::io::{self, Read, Write};
use std::sync::Mutex;

const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

const FLAG_FIXED_NEWSTYLE: u16 = 1;
const FLAG_NO_ZEROES: u16 = 2;

const OPT_GO: u32 = 7;
const OPT_STRUCTURED_REPLY: u32 = 8;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const INFO_EXPORT: u16 = 0;

const TFLAG_READ_ONLY: u16 = 1 << 1;
const TFLAG_SEND_FLUSH: u16 = 1 << 2;
const TFLAG_SEND_FUA: u16 = 1 << 3;
const TFLAG_SEND_TRIM: u16 = 1 << 5;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;
const CMD_FLAG_FUA: u16 = 1;

const CHUNK_NONE: u16 = 0;
const CHUNK_OFFSET_DATA: u16 = 1;
const CHUNK_OFFSET_HOLE: u16 = 2;
const CHUNK_DONE: u16 = 1;

/// The most one request moves: servers take at least 32 MiB; smaller keeps memory low.
const MAX_REQUEST: usize = 4 << 20;

/// Where an NBD export is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    Tcp {
        host: String,
        port: u16,
        name: String,
    },
    Unix {
        socket: String,
        name: String,
    },
}

impl Address {
    /// Parses `nbd://HOST[:PORT][/NAME]` or `nbd+unix:///NAME?socket=PATH`; `None` for
    /// anything else (a path).
    pub fn parse(s: &str) -> Option<Result<Address, String>> {
        if let Some(rest) = s.strip_prefix("nbd+unix://") {
            let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
            let name = path.strip_prefix('/').unwrap_or(path).to_string();
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .map(str::to_string);
            return Some(match socket {
                Some(socket) if !socket.is_empty() => Ok(Address::Unix { socket, name }),
                _ => Err(format!("{s}: an nbd+unix address needs ?socket=PATH")),
            });
        }
        let rest = s.strip_prefix("nbd://")?;
        let (hostport, name) = rest.split_once('/').unwrap_or((rest, ""));
        let bracketed = hostport.starts_with('[') && hostport.ends_with(']');
        let (host, port) = match hostport.rsplit_once(':').filter(|_| !bracketed) {
            Some((h, p)) if !h.ends_with(']') || hostport.starts_with('[') => match p.parse() {
                Ok(p) => (h.trim_start_matches('[').trim_end_matches(']'), p),
                Err(_) => return Some(Err(format!("{s}: port {p:?} is not a number"))),
            },
            _ => (
                hostport.trim_start_matches('[').trim_end_matches(']'),
                10809,
            ),
        };
        if host.is_empty() {
            return Some(Err(format!("{s}: no host")));
        }
        Some(Ok(Address::Tcp {
            host: host.to_string(),
            port,
            name: name.to_string(),
        }))
    }
}

trait Stream: Read + Write + Send {}
impl<T: Read + Write + Send> Stream for T {}

struct Conn {
    s: Box<dyn Stream>,
    cookie: u64,
    /// A reply did not parse: the stream's position is unknown, nothing more is sent.
    broken: Option<String>,
}

/// An NBD export as a block device.
pub struct NbdDevice {
    conn: Mutex<Conn>,
    len: u64,
    flags: u16,
    structured: bool,
    what: String,
}

fn bad(what: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.into())
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

fn read_exact(s: &mut dyn Stream, n: usize) -> io::Result<Vec<u8>> {
    let mut b = vec![0u8; n];
    s.read_exact(&mut b)?;
    Ok(b)
}

/// The error an NBD error number stands for (the protocol's numbers are Linux's errno
/// values; one it does not define is EIO).
fn nbd_errno(e: u32) -> io::Error {
    let errno = match e {
        1 | 5 | 12 | 22 | 28 | 75 | 95 | 108 => e as i32,
        _ => 5,
    };
    io::Error::from_raw_os_error(errno)
}

impl NbdDevice {
    /// Connects to `addr` and negotiates the export.
    pub fn open(addr: &Address) -> io::Result<NbdDevice> {
        let (mut s, name, what): (Box<dyn Stream>, String, String) = match addr {
            Address::Tcp { host, port, name } => {
                let t = std::net::TcpStream::connect((host.as_str(), *port))?;
                t.set_nodelay(true)?;
                (
                    Box::new(t),
                    name.clone(),
                    format!("nbd://{host}:{port}/{name}"),
                )
            }
            Address::Unix { socket, name } => (
                Box::new(std::os::unix::net::UnixStream::connect(socket)?),
                name.clone(),
                format!("nbd+unix:///{name}?socket={socket}"),
            ),
        };
        let ctx = |e: io::Error| io::Error::new(e.kind(), format!("{what}: handshake: {e}"));
        let hello = read_exact(&mut *s, 18).map_err(ctx)?;
        if u64_at(&hello, 0) != NBDMAGIC || u64_at(&hello, 8) != IHAVEOPT {
            return Err(bad(format!(
                "{what}: not a newstyle NBD server (the greeting has no NBDMAGIC/IHAVEOPT)"
            )));
        }
        let hflags = u16_at(&hello, 16);
        if hflags & FLAG_FIXED_NEWSTYLE == 0 {
            return Err(bad(format!(
                "{what}: the server does not speak the fixed newstyle handshake"
            )));
        }
        let cflags = u32::from(FLAG_FIXED_NEWSTYLE | (hflags & FLAG_NO_ZEROES));
        s.write_all(&cflags.to_be_bytes()).map_err(ctx)?;
        let structured = Self::option(&mut *s, OPT_STRUCTURED_REPLY, &[], &what)
            .map_err(ctx)?
            .is_some();
        let mut go = Vec::new();
        go.extend_from_slice(&(name.len() as u32).to_be_bytes());
        go.extend_from_slice(name.as_bytes());
        go.extend_from_slice(&1u16.to_be_bytes());
        go.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        let infos = Self::option(&mut *s, OPT_GO, &go, &what).map_err(ctx)?;
        let Some(infos) = infos else {
            return Err(bad(format!("{what}: the server refused export {name:?}")));
        };
        let export = infos
            .iter()
            .find(|i| i.len() >= 12 && u16_at(i, 0) == INFO_EXPORT)
            .ok_or_else(|| bad(format!("{what}: the server named no export size")))?;
        let len = u64_at(export, 2);
        let flags = u16_at(export, 10);
        Ok(NbdDevice {
            conn: Mutex::new(Conn {
                s,
                cookie: 1,
                broken: None,
            }),
            len,
            flags,
            structured,
            what,
        })
    }

    /// Sends one option and reads its replies up to the final one: `Some(info payloads)` on
    /// success, `None` when the server refuses it (an error reply).
    fn option(
        s: &mut dyn Stream,
        opt: u32,
        data: &[u8],
        what: &str,
    ) -> io::Result<Option<Vec<Vec<u8>>>> {
        let mut m = Vec::with_capacity(16 + data.len());
        m.extend_from_slice(&IHAVEOPT.to_be_bytes());
        m.extend_from_slice(&opt.to_be_bytes());
        m.extend_from_slice(&(data.len() as u32).to_be_bytes());
        m.extend_from_slice(data);
        s.write_all(&m)?;
        let mut infos = Vec::new();
        loop {
            let h = read_exact(s, 20)?;
            if u64_at(&h, 0) != REPLY_MAGIC || u32_at(&h, 8) != opt {
                return Err(bad(format!("{what}: a malformed option reply")));
            }
            let ty = u32_at(&h, 12);
            let n = u32_at(&h, 16) as usize;
            if n > 64 << 10 {
                return Err(bad(format!("{what}: an option reply of {n} bytes")));
            }
            let body = read_exact(s, n)?;
            match ty {
                REP_ACK => return Ok(Some(infos)),
                REP_INFO => infos.push(body),
                t if t & (1 << 31) != 0 => return Ok(None),
                _ => {} // replies of other options' kinds: ignored, as the protocol allows
            }
        }
    }

    /// Whether the server takes writes.
    pub fn writable(&self) -> bool {
        self.flags & TFLAG_READ_ONLY == 0
    }

    /// Sends one request and waits for its reply; for a read, fills `read`.
    fn request(
        &self,
        ty: u16,
        flags: u16,
        offset: u64,
        len: u32,
        write: &[u8],
        read: &mut [u8],
    ) -> io::Result<()> {
        let mut c = self.conn.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(why) = &c.broken {
            return Err(io::Error::new(io::ErrorKind::BrokenPipe, why.clone()));
        }
        let r = Self::exchange(
            &mut c,
            self.structured,
            &self.what,
            ty,
            flags,
            offset,
            len,
            write,
            read,
        );
        if let Err(e) = &r {
            if e.kind() != io::ErrorKind::Other {
                c.broken = Some(format!("{}: connection unusable after: {e}", self.what));
            }
        }
        r
    }

    #[allow(clippy::too_many_arguments)]
    fn exchange(
        c: &mut Conn,
        structured: bool,
        what: &str,
        ty: u16,
        flags: u16,
        offset: u64,
        len: u32,
        write: &[u8],
        read: &mut [u8],
    ) -> io::Result<()> {
        let cookie = c.cookie;
        c.cookie += 1;
        let mut m = Vec::with_capacity(28 + write.len());
        m.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
        m.extend_from_slice(&flags.to_be_bytes());
        m.extend_from_slice(&ty.to_be_bytes());
        m.extend_from_slice(&cookie.to_be_bytes());
        m.extend_from_slice(&offset.to_be_bytes());
        m.extend_from_slice(&len.to_be_bytes());
        m.extend_from_slice(write);
        c.s.write_all(&m)?;
        let mut got = 0usize;
        let mut failed: Option<u32> = None;
        loop {
            let magic = read_exact(&mut *c.s, 4)?;
            match u32_at(&magic, 0) {
                SIMPLE_REPLY_MAGIC => {
                    let h = read_exact(&mut *c.s, 12)?;
                    if u64_at(&h, 4) != cookie {
                        return Err(bad(format!("{what}: a reply for another request")));
                    }
                    let err = u32_at(&h, 0);
                    if err != 0 {
                        // The server answered: the stream is still in step.
                        let e = nbd_errno(err);
                        return Err(io::Error::other(format!("{what}: the server says {e}")));
                    }
                    if ty == CMD_READ {
                        c.s.read_exact(read)?;
                    }
                    return Ok(());
                }
                STRUCTURED_REPLY_MAGIC if structured => {
                    let h = read_exact(&mut *c.s, 16)?;
                    let cflags = u16_at(&h, 0);
                    let cty = u16_at(&h, 2);
                    if u64_at(&h, 4) != cookie {
                        return Err(bad(format!("{what}: a reply for another request")));
                    }
                    let n = u32_at(&h, 12) as usize;
                    if n > MAX_REQUEST + 64 {
                        return Err(bad(format!("{what}: a reply chunk of {n} bytes")));
                    }
                    match cty {
                        CHUNK_NONE => {}
                        CHUNK_OFFSET_DATA | CHUNK_OFFSET_HOLE if ty == CMD_READ => {
                            let at = u64_at(&read_exact(&mut *c.s, 8)?, 0);
                            let (dlen, hole) = if cty == CHUNK_OFFSET_DATA {
                                (
                                    n.checked_sub(8).ok_or_else(|| {
                                        bad(format!("{what}: a short data chunk"))
                                    })?,
                                    false,
                                )
                            } else {
                                (u32_at(&read_exact(&mut *c.s, 4)?, 0) as usize, true)
                            };
                            let start = at
                                .checked_sub(offset)
                                .map(|v| v as usize)
                                .filter(|&v| v.checked_add(dlen).is_some_and(|e| e <= read.len()))
                                .ok_or_else(|| {
                                    bad(format!("{what}: a reply chunk outside the request"))
                                })?;
                            if hole {
                                read[start..start + dlen].fill(0);
                            } else {
                                c.s.read_exact(&mut read[start..start + dlen])?;
                            }
                            got += dlen;
                        }
                        t if t & (1 << 15) != 0 => {
                            let body = read_exact(&mut *c.s, n)?;
                            let err = if body.len() >= 4 { u32_at(&body, 0) } else { 5 };
                            failed.get_or_insert(err);
                        }
                        _ => {
                            return Err(bad(format!("{what}: a reply chunk of unknown type {cty}")))
                        }
                    }
                    if cflags & CHUNK_DONE != 0 {
                        if let Some(err) = failed {
                            let e = nbd_errno(err);
                            return Err(io::Error::other(format!("{what}: the server says {e}")));
                        }
                        if ty == CMD_READ && got != read.len() {
                            return Err(bad(format!(
                                "{what}: the reply carried {got} of {} bytes",
                                read.len()
                            )));
                        }
                        return Ok(());
                    }
                }
                m => return Err(bad(format!("{what}: a reply with magic {m:#x}"))),
            }
        }
    }

    /// Asks the server to discard `[offset, offset + len)` (a hint; no-op where it offers no
    /// TRIM).
    pub fn trim(&self, offset: u64, len: u64) -> io::Result<()> {
        if self.flags & TFLAG_SEND_TRIM == 0 {
            return Ok(());
        }
        let mut done = 0u64;
        while done < len {
            let n = (len - done).min(1 << 30) as u32;
            self.request(CMD_TRIM, 0, offset + done, n, &[], &mut [])?;
            done += n as u64;
        }
        Ok(())
    }

    fn check_range(&self, offset: u64, n: usize) -> io::Result<()> {
        if offset.checked_add(n as u64).is_none_or(|e| e > self.len) {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{}: bytes {offset}..+{n} are past its end ({})",
                    self.what, self.len
                ),
            ));
        }
        Ok(())
    }
}

impl BlockDevice for NbdDevice {
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len())?;
        for (i, piece) in buf.chunks_mut(MAX_REQUEST).enumerate() {
            let at = offset + (i * MAX_REQUEST) as u64;
            let n = piece.len() as u32;
            self.request(CMD_READ, 0, at, n, &[], piece)?;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        self.check_range(offset, buf.len())?;
        if !self.writable() {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!("{}: the export is read-only", self.what),
            ));
        }
        // Without a flush command, each write is made durable by itself.
        let fua = if self.flags & TFLAG_SEND_FLUSH == 0 {
            if self.flags & TFLAG_SEND_FUA == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("{}: the server offers neither flush nor FUA, so nothing written to it could be made durable", self.what),
                ));
            }
            CMD_FLAG_FUA
        } else {
            0
        };
        for (i, piece) in buf.chunks(MAX_REQUEST).enumerate() {
            let at = offset + (i * MAX_REQUEST) as u64;
            self.request(CMD_WRITE, fua, at, piece.len() as u32, piece, &mut [])?;
        }
        Ok(())
    }

    fn flush(&self) -> io::Result<()> {
        if self.flags & TFLAG_SEND_FLUSH == 0 {
            return Ok(()); // every write went with FUA
        }
        self.request(CMD_FLUSH, 0, 0, 0, &[], &mut [])
    }

    fn len(&self) -> u64 {
        self.len
    }
}

impl Drop for NbdDevice {
    fn drop(&mut self) {
        let c = self.conn.get_mut().unwrap_or_else(|e| e.into_inner());
        if c.broken.is_none() {
            let mut m = Vec::with_capacity(28);
            m.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
            m.extend_from_slice(&0u16.to_be_bytes());
            m.extend_from_slice(&CMD_DISC.to_be_bytes());
            m.extend_from_slice(&0u64.to_be_bytes());
            m.extend_from_slice(&0u64.to_be_bytes());
            m.extend_from_slice(&0u32.to_be_bytes());
            let _ = c.s.write_all(&m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_as_qemu_spells_them() {
        assert_eq!(
            Address::parse("nbd://127.0.0.1:10810/disk"),
            Some(Ok(Address::Tcp {
                host: "127.0.0.1".into(),
                port: 10810,
                name: "disk".into()
            }))
        );
        assert_eq!(
            Address::parse("nbd://server"),
            Some(Ok(Address::Tcp {
                host: "server".into(),
                port: 10809,
                name: String::new()
            }))
        );
        assert_eq!(
            Address::parse("nbd+unix:///x?socket=/run/nbd.sock"),
            Some(Ok(Address::Unix {
                socket: "/run/nbd.sock".into(),
                name: "x".into()
            }))
        );
        assert!(matches!(Address::parse("nbd+unix:///x"), Some(Err(_))));
        assert!(matches!(Address::parse("nbd://h:port/x"), Some(Err(_))));
        assert_eq!(Address::parse("/tmp/disk.img"), None);
    }
}
