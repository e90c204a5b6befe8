//! Send streams (what `btrfs send` writes and `btrfs receive` reads): the reader of their
//! commands, versions 1 to 3, and the text `btrfs receive --dump` prints for them.
//!
//! A stream is the magic `btrfs-stream\0`, a little-endian u32 version, then commands: a
//! header (u32 payload length, u16 command, u32 crc32c of header and payload with the crc
//! field zero) and a payload of attributes (u16 type, u16 length, bytes). From version 2 on,
//! the DATA attribute has no length: it runs to the end of its command.
//!
//! Nothing in a stream is trusted: every length is checked against what is left, the
//! checksum of every command is verified, and an error names the command and its byte offset
//! in the stream.

use crate::error::{Error, Location, Result};
use std::io::{Read, Write};

/// The magic a send stream starts with.
const MAGIC: &[u8; 13] = b"btrfs-stream\0";
/// Header of one command: payload length, command, checksum.
const CMD_HEADER: usize = 10;
/// The longest command payload accepted (the kernel's largest send buffer is far smaller).
const MAX_PAYLOAD: usize = 64 << 20;

/// Attribute types.
pub(crate) mod attr {
    pub(crate) const INO: u16 = 3;
    pub(crate) const UUID: u16 = 1;
    pub(crate) const CTRANSID: u16 = 2;
    pub(crate) const SIZE: u16 = 4;
    pub(crate) const MODE: u16 = 5;
    pub(crate) const UID: u16 = 6;
    pub(crate) const GID: u16 = 7;
    pub(crate) const RDEV: u16 = 8;
    pub(crate) const CTIME: u16 = 9;
    pub(crate) const MTIME: u16 = 10;
    pub(crate) const ATIME: u16 = 11;
    pub(crate) const OTIME: u16 = 12;
    pub(crate) const XATTR_NAME: u16 = 13;
    pub(crate) const XATTR_DATA: u16 = 14;
    pub(crate) const PATH: u16 = 15;
    pub(crate) const PATH_TO: u16 = 16;
    pub(crate) const PATH_LINK: u16 = 17;
    pub(crate) const FILE_OFFSET: u16 = 18;
    pub(crate) const DATA: u16 = 19;
    pub(crate) const CLONE_UUID: u16 = 20;
    pub(crate) const CLONE_CTRANSID: u16 = 21;
    pub(crate) const CLONE_PATH: u16 = 22;
    pub(crate) const CLONE_OFFSET: u16 = 23;
    pub(crate) const CLONE_LEN: u16 = 24;
    pub(crate) const FALLOCATE_MODE: u16 = 25;
    pub(crate) const FILEATTR: u16 = 26;
    pub(crate) const UNENCODED_FILE_LEN: u16 = 27;
    pub(crate) const UNENCODED_LEN: u16 = 28;
    pub(crate) const UNENCODED_OFFSET: u16 = 29;
    pub(crate) const COMPRESSION: u16 = 30;
    pub(crate) const ENCRYPTION: u16 = 31;
    /// The highest attribute type a stream may carry (32 to 35 are version 3's verity
    /// attributes).
    pub(crate) const MAX: u16 = 35;
}

/// Command numbers.
pub(crate) mod cmd {
    pub(crate) const SUBVOL: u16 = 1;
    pub(crate) const SNAPSHOT: u16 = 2;
    pub(crate) const MKFILE: u16 = 3;
    pub(crate) const MKDIR: u16 = 4;
    pub(crate) const MKNOD: u16 = 5;
    pub(crate) const MKFIFO: u16 = 6;
    pub(crate) const MKSOCK: u16 = 7;
    pub(crate) const SYMLINK: u16 = 8;
    pub(crate) const RENAME: u16 = 9;
    pub(crate) const LINK: u16 = 10;
    pub(crate) const UNLINK: u16 = 11;
    pub(crate) const RMDIR: u16 = 12;
    pub(crate) const SET_XATTR: u16 = 13;
    pub(crate) const REMOVE_XATTR: u16 = 14;
    pub(crate) const WRITE: u16 = 15;
    pub(crate) const CLONE: u16 = 16;
    pub(crate) const TRUNCATE: u16 = 17;
    pub(crate) const CHMOD: u16 = 18;
    pub(crate) const CHOWN: u16 = 19;
    pub(crate) const UTIMES: u16 = 20;
    pub(crate) const END: u16 = 21;
    pub(crate) const UPDATE_EXTENT: u16 = 22;
    pub(crate) const FALLOCATE: u16 = 23;
    pub(crate) const FILEATTR: u16 = 24;
    pub(crate) const ENCODED_WRITE: u16 = 25;
    pub(crate) const ENABLE_VERITY: u16 = 26;
}

/// Command numbers and the names `btrfs receive --dump` gives them.
const COMMANDS: &[(u16, &str)] = &[
    (1, "subvol"),
    (2, "snapshot"),
    (3, "mkfile"),
    (4, "mkdir"),
    (5, "mknod"),
    (6, "mkfifo"),
    (7, "mksock"),
    (8, "symlink"),
    (9, "rename"),
    (10, "link"),
    (11, "unlink"),
    (12, "rmdir"),
    (13, "set_xattr"),
    (14, "remove_xattr"),
    (15, "write"),
    (16, "clone"),
    (17, "truncate"),
    (18, "chmod"),
    (19, "chown"),
    (20, "utimes"),
    (21, "end"),
    (22, "update_extent"),
    (23, "fallocate"),
    (24, "fileattr"),
    (25, "encoded_write"),
    (26, "enable_verity"),
];

/// One command of a stream, its attributes as they came.
#[derive(Debug, Clone)]
pub(crate) struct Command {
    /// The command number (1 subvol, 2 snapshot, ... 21 end).
    pub(crate) kind: u16,
    /// Byte offset of its header in the stream.
    pub(crate) offset: u64,
    /// Its place in the input, counting from 1 (across the streams of a multi-stream send).
    pub(crate) index: u64,
    attrs: Vec<(u16, Vec<u8>)>,
}

impl Command {
    /// The name `btrfs receive --dump` prints for it.
    pub(crate) fn name(&self) -> Option<&'static str> {
        COMMANDS
            .iter()
            .find(|(k, _)| *k == self.kind)
            .map(|(_, n)| *n)
    }

    fn loc(&self) -> Location {
        command_loc(self.index, self.kind, self.offset)
    }

    pub(crate) fn bytes(&self, ty: u16) -> Result<&[u8]> {
        self.attrs
            .iter()
            .find(|(t, _)| *t == ty)
            .map(|(_, v)| v.as_slice())
            .ok_or_else(|| Error::corrupt(self.loc(), format!("attribute {ty} is missing")))
    }

    /// A number attribute: little endian, 1, 2, 4 or 8 bytes (u8 to u64 attributes).
    pub(crate) fn u64(&self, ty: u16) -> Result<u64> {
        let b = self.bytes(ty)?;
        if ![1, 2, 4, 8].contains(&b.len()) {
            return Err(Error::corrupt(
                self.loc(),
                format!("number attribute {ty} is {} bytes", b.len()),
            ));
        }
        let mut a = [0u8; 8];
        a[..b.len()].copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    pub(crate) fn u64_or(&self, ty: u16, default: u64) -> Result<u64> {
        if self.attrs.iter().any(|(t, _)| *t == ty) {
            self.u64(ty)
        } else {
            Ok(default)
        }
    }

    /// A uuid attribute (16 bytes).
    pub(crate) fn uuid_bytes(&self, ty: u16) -> Result<[u8; 16]> {
        let b = self.bytes(ty)?;
        b.try_into().map_err(|_| {
            Error::corrupt(
                self.loc(),
                format!("attribute {ty} is {} bytes, not 16", b.len()),
            )
        })
    }

    fn uuid(&self, ty: u16) -> Result<String> {
        Ok(crate::format::fmt_uuid(&self.uuid_bytes(ty)?))
    }

    /// A timespec attribute: u64 seconds, u32 nanoseconds.
    pub(crate) fn timespec(&self, ty: u16) -> Result<(i64, u32)> {
        let b = self.bytes(ty)?;
        if b.len() != 12 {
            return Err(Error::corrupt(
                self.loc(),
                format!("time attribute {ty} is {} bytes, not 12", b.len()),
            ));
        }
        let mut s = [0u8; 8];
        s.copy_from_slice(&b[..8]);
        let mut n = [0u8; 4];
        n.copy_from_slice(&b[8..]);
        Ok((i64::from_le_bytes(s), u32::from_le_bytes(n)))
    }
}

/// Where command number `index` (counting from 1), of type `kind`, starts: the words every
/// error about a command uses.
pub(crate) fn command_loc(index: u64, kind: u16, at: u64) -> Location {
    let name = COMMANDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map(|(_, n)| *n)
        .unwrap_or("unknown");
    Location::what(format!("send stream command {index} ({name}) at byte {at}"))
}

/// Reads the commands of a send stream one by one.
pub(crate) struct StreamReader<R: Read> {
    r: R,
    version: u32,
    offset: u64,
    ended: bool,
    /// Commands read so far.
    count: u64,
}

impl<R: Read> StreamReader<R> {
    /// Checks the stream's magic and version (1 to 3).
    pub(crate) fn new(mut r: R) -> Result<Self> {
        let mut head = [0u8; 17];
        // Nothing at all is no damaged stream: there is none (an empty file or pipe).
        let first = loop {
            match r.read(&mut head) {
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                r => break r.map_err(|e| Error::io("reading the send stream", 0, e))?,
            }
        };
        if first == 0 {
            return Err(Error::Invalid(
                "the input is empty: there is no send stream in it (give one with -f FILE or \
                 on standard input, as `btrfs send ... | butter receive ...`)"
                    .into(),
            ));
        }
        read_full(
            &mut r,
            &mut head[first..],
            first as u64,
            "the stream header",
        )?;
        let loc = || Location::what("send stream header at byte 0");
        if &head[..13] != MAGIC {
            return Err(Error::corrupt(loc(), "not a btrfs send stream (bad magic)"));
        }
        let version = u32::from_le_bytes([head[13], head[14], head[15], head[16]]);
        if !(1..=3).contains(&version) {
            return Err(Error::Unsupported(format!(
                "send stream version {version} (butter reads versions 1 to 3)"
            )));
        }
        Ok(StreamReader {
            r,
            version,
            offset: 17,
            ended: false,
            count: 0,
        })
    }

    /// Bytes of the stream read so far.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// The next command; `None` at the end of the input (several streams may follow each
    /// other: a new magic after an `end` command starts the next).
    pub(crate) fn next_command(&mut self) -> Result<Option<Command>> {
        let at = self.offset;
        let mut h = [0u8; CMD_HEADER];
        let mut got = 0;
        while got < CMD_HEADER {
            match self.r.read(&mut h[got..]) {
                Ok(0) if got == 0 => return Ok(None),
                Ok(0) => {
                    return Err(Error::corrupt(
                        Location::what(format!("send stream at byte {at}")),
                        "the stream ends inside a command header",
                    ))
                }
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io("reading the send stream", at, e)),
            }
        }
        if self.ended && h[..CMD_HEADER] == MAGIC[..CMD_HEADER] {
            // The next stream of a multi-subvolume send: its header, then its commands.
            let mut rest = [0u8; 7];
            read_full(&mut self.r, &mut rest, at + 10, "a stream header")?;
            if rest[..3] != MAGIC[10..] {
                return Err(Error::corrupt(
                    Location::what(format!("send stream header at byte {at}")),
                    "bad magic",
                ));
            }
            self.offset += 17;
            self.ended = false;
            return self.next_command();
        }
        let len = u32::from_le_bytes([h[0], h[1], h[2], h[3]]) as usize;
        let kind = u16::from_le_bytes([h[4], h[5]]);
        let crc = u32::from_le_bytes([h[6], h[7], h[8], h[9]]);
        self.count += 1;
        let index = self.count;
        let loc = || command_loc(index, kind, at);
        if len > MAX_PAYLOAD {
            return Err(Error::corrupt(
                loc(),
                format!("payload of {len} bytes (at most {MAX_PAYLOAD})"),
            ));
        }
        let mut payload = vec![0u8; len];
        read_full(&mut self.r, &mut payload, at + 10, "a command's payload")?;
        self.offset += (CMD_HEADER + len) as u64;
        let mut zeroed = h;
        zeroed[6..10].fill(0);
        let want = crc_raw(&[&zeroed, &payload]);
        if want != crc {
            return Err(Error::bad_csum(
                loc(),
                format!("crc32c stored {crc:#010x}, computed {want:#010x}"),
            ));
        }
        let attrs = self.attributes(&payload, loc)?;
        if kind == cmd::END {
            self.ended = true;
        }
        Ok(Some(Command {
            kind,
            offset: at,
            index,
            attrs,
        }))
    }

    fn attributes(&self, p: &[u8], loc: impl Fn() -> Location) -> Result<Vec<(u16, Vec<u8>)>> {
        let mut out = Vec::new();
        let mut i = 0;
        while i < p.len() {
            if p.len() - i < 2 {
                return Err(Error::corrupt(loc(), "an attribute header is cut short"));
            }
            let ty = u16::from_le_bytes([p[i], p[i + 1]]);
            if ty == 0 || ty > attr::MAX {
                return Err(Error::corrupt(loc(), format!("unknown attribute {ty}")));
            }
            if ty == attr::DATA && self.version >= 2 {
                out.push((ty, p[i + 2..].to_vec()));
                break;
            }
            if p.len() - i < 4 {
                return Err(Error::corrupt(loc(), "an attribute header is cut short"));
            }
            let n = u16::from_le_bytes([p[i + 2], p[i + 3]]) as usize;
            let start = i + 4;
            if p.len() - start < n {
                return Err(Error::corrupt(
                    loc(),
                    format!("attribute {ty} of {n} bytes runs past the command"),
                ));
            }
            out.push((ty, p[start..start + n].to_vec()));
            i = start + n;
        }
        Ok(out)
    }
}

fn read_full(r: &mut impl Read, buf: &mut [u8], at: u64, what: &str) -> Result<()> {
    r.read_exact(buf).map_err(|e| {
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            Error::corrupt(
                Location::what(format!("send stream at byte {at}")),
                format!("the stream ends inside {what}"),
            )
        } else {
            Error::io("reading the send stream", at, e)
        }
    })
}

/// crc32c as the send stream stores it: seeded with 0, without the final inversion.
fn crc_raw(parts: &[&[u8]]) -> u32 {
    // crc32c_append(c, d) inverts on the way in and out: starting from !0 and inverting the
    // result gives the plain register update from 0.
    let mut c = !0u32;
    for p in parts {
        c = crc32c::crc32c_append(c, p);
    }
    !c
}

/// `bytes` as `btrfs receive --dump` writes a path, a name or an xattr value: C escapes for
/// the control characters that have one, a backslash before a space or a backslash, and three
/// octal digits for any other byte outside printable ASCII. Returns the printed width.
fn push_escaped(out: &mut Vec<u8>, bytes: &[u8]) -> usize {
    let start = out.len();
    for &b in bytes {
        let esc = match b {
            0x07 => b'a',
            0x08 => b'b',
            0x1b => b'e',
            0x0c => b'f',
            b'\n' => b'n',
            b'\r' => b'r',
            b'\t' => b't',
            0x0b => b'v',
            b' ' => b' ',
            b'\\' => b'\\',
            b if b.is_ascii_graphic() => {
                out.push(b);
                continue;
            }
            _ => {
                out.extend_from_slice(&[
                    b'\\',
                    b'0' + (b >> 6),
                    b'0' + ((b >> 3) & 7),
                    b'0' + (b & 7),
                ]);
                continue;
            }
        };
        out.extend_from_slice(&[b'\\', esc]);
    }
    out.len() - start
}

/// A string attribute as the C tools see it: up to its first NUL byte.
fn c_str(b: &[u8]) -> &[u8] {
    b.iter().position(|&c| c == 0).map_or(b, |n| &b[..n])
}

/// `a/b` with one trailing slash of each part dropped, as btrfs-progs joins the subvolume and
/// the path of a dumped command.
fn join_path(a: &[u8], b: &[u8]) -> Vec<u8> {
    let a = a.strip_suffix(b"/").unwrap_or(a);
    let b = b.strip_suffix(b"/").unwrap_or(b);
    let mut out = Vec::with_capacity(a.len() + b.len() + 1);
    out.extend_from_slice(a);
    out.push(b'/');
    out.extend_from_slice(b);
    out
}

/// One piece of a dumped line after the path: plain text, or bytes printed escaped.
enum Part<'a> {
    Text(String),
    Escaped(&'a [u8]),
}

/// Prints the commands of the stream in `r` as `btrfs receive --dump` (btrfs-progs 6.14) does,
/// byte for byte: the command's name in 16 columns, its path from the current subvolume's name
/// (`./NAME/...`) escaped and padded to 32 columns (longer paths get one space), then its
/// attributes, times as `time` formats seconds since the epoch (btrfs-progs: local time,
/// `2024-01-31T12:00:00+0100`); up to the first `end` command.
pub fn dump(r: impl Read, out: &mut dyn Write, time: &dyn Fn(i64) -> String) -> Result<()> {
    use Part::{Escaped as E, Text as T};
    let mut s = StreamReader::new(r)?;
    let mut subvol = b"./".to_vec();
    while let Some(c) = s.next_command()? {
        let Some(name) = c.name() else {
            return Err(Error::Unsupported(format!(
                "send stream command {} at byte {}",
                c.kind, c.offset
            )));
        };
        if c.kind == 1 || c.kind == 2 {
            subvol = join_path(b".", c_str(c.bytes(attr::PATH)?));
        }
        let path_of = |ty: u16| -> Result<Vec<u8>> { Ok(join_path(&subvol, c_str(c.bytes(ty)?))) };
        // Paths of the other attributes are joined here and borrowed by the parts below.
        let other;
        let (path, parts): (Vec<u8>, Vec<Part>) = match c.kind {
            1 | 2 => {
                let mut a = format!(
                    "uuid={} transid={}",
                    c.uuid(attr::UUID)?,
                    c.u64(attr::CTRANSID)?
                );
                if c.kind == 2 {
                    a.push_str(&format!(
                        " parent_uuid={} parent_transid={}",
                        c.uuid(attr::CLONE_UUID)?,
                        c.u64(attr::CLONE_CTRANSID)?
                    ));
                }
                (subvol.clone(), vec![T(a)])
            }
            3 | 4 | 6 | 7 | 11 | 12 => (path_of(attr::PATH)?, vec![]),
            5 => (
                path_of(attr::PATH)?,
                vec![T(format!(
                    "mode={:o} dev={:#x}",
                    c.u64(attr::MODE)?,
                    c.u64(attr::RDEV)?
                ))],
            ),
            8 | 10 => (
                path_of(attr::PATH)?,
                vec![T("dest=".into()), E(c_str(c.bytes(attr::PATH_LINK)?))],
            ),
            9 => {
                other = path_of(attr::PATH_TO)?;
                (path_of(attr::PATH)?, vec![T("dest=".into()), E(&other)])
            }
            13 => {
                let data = c.bytes(attr::XATTR_DATA)?;
                (
                    path_of(attr::PATH)?,
                    vec![
                        T("name=".into()),
                        E(c_str(c.bytes(attr::XATTR_NAME)?)),
                        T(" ".into()),
                        E(data),
                        T(format!(" len={}", data.len())),
                    ],
                )
            }
            14 => (
                path_of(attr::PATH)?,
                vec![T("name=".into()), E(c_str(c.bytes(attr::XATTR_NAME)?))],
            ),
            15 => (
                path_of(attr::PATH)?,
                vec![T(format!(
                    "offset={} len={}",
                    c.u64(attr::FILE_OFFSET)?,
                    c.bytes(attr::DATA)?.len()
                ))],
            ),
            16 => {
                other = path_of(attr::CLONE_PATH)?;
                (
                    path_of(attr::PATH)?,
                    vec![
                        T(format!(
                            "offset={} len={} from=",
                            c.u64(attr::FILE_OFFSET)?,
                            c.u64(attr::CLONE_LEN)?
                        )),
                        E(&other),
                        T(format!(" clone_offset={}", c.u64(attr::CLONE_OFFSET)?)),
                    ],
                )
            }
            17 => (
                path_of(attr::PATH)?,
                vec![T(format!("size={}", c.u64(attr::SIZE)?))],
            ),
            18 => (
                path_of(attr::PATH)?,
                vec![T(format!("mode={:o}", c.u64(attr::MODE)?))],
            ),
            19 => (
                path_of(attr::PATH)?,
                vec![T(format!(
                    "gid={} uid={}",
                    c.u64(attr::GID)?,
                    c.u64(attr::UID)?
                ))],
            ),
            20 => (
                path_of(attr::PATH)?,
                vec![T(format!(
                    "atime={} mtime={} ctime={}",
                    time(c.timespec(attr::ATIME)?.0),
                    time(c.timespec(attr::MTIME)?.0),
                    time(c.timespec(attr::CTIME)?.0)
                ))],
            ),
            // btrfs receive --dump stops at the first end, even where more streams follow
            // (a send of several subvolumes); so does this.
            21 => break,
            22 => (
                path_of(attr::PATH)?,
                vec![T(format!(
                    "offset={} len={}",
                    c.u64(attr::FILE_OFFSET)?,
                    c.u64(attr::SIZE)?
                ))],
            ),
            23 => (
                path_of(attr::PATH)?,
                vec![T(format!(
                    "mode={} offset={} len={}",
                    c.u64(attr::FALLOCATE_MODE)?,
                    c.u64(attr::FILE_OFFSET)?,
                    c.u64(attr::SIZE)?
                ))],
            ),
            // btrfs-progs prints the decimal value after "0x"; so does this, to match.
            24 => (
                path_of(attr::PATH)?,
                vec![T(format!("fileattr=0x{}", c.u64(attr::FILEATTR)?))],
            ),
            25 => (
                path_of(attr::PATH)?,
                vec![T(format!(
                    "offset={} len={} unencoded_file_len={} unencoded_len={} unencoded_offset={} compression={} encryption={}",
                    c.u64(attr::FILE_OFFSET)?,
                    c.bytes(attr::DATA)?.len(),
                    c.u64(attr::UNENCODED_FILE_LEN)?,
                    c.u64(attr::UNENCODED_LEN)?,
                    c.u64(attr::UNENCODED_OFFSET)?,
                    c.u64_or(attr::COMPRESSION, 0)?,
                    c.u64_or(attr::ENCRYPTION, 0)?
                ))],
            ),
            _ => (path_of(attr::PATH)?, vec![]),
        };
        let mut line = format!("{name:<16}").into_bytes();
        let width = push_escaped(&mut line, &path);
        if !parts.is_empty() {
            line.resize(line.len() + 32usize.saturating_sub(width).max(1), b' ');
            for p in &parts {
                match p {
                    T(t) => line.extend_from_slice(t.as_bytes()),
                    E(b) => {
                        push_escaped(&mut line, b);
                    }
                }
            }
        }
        line.push(b'\n');
        out.write_all(&line)
            .map_err(|e| Error::io("writing the dump", 0, e))?;
    }
    Ok(())
}

/// Writes a send stream: the header, then commands whose attributes are added one by one.
/// From version 2 on, DATA is the last attribute of its command and has no length.
pub(crate) struct StreamWriter<W: Write> {
    w: W,
    version: u32,
    /// The command being built: header space, then attributes.
    cmd: Vec<u8>,
    /// Bytes written so far.
    written: u64,
    /// Commands written so far.
    commands: u64,
}

impl<W: Write> StreamWriter<W> {
    /// Starts a stream of `version` (1 or 2) on `w`, with its header unless it continues
    /// one already started.
    pub(crate) fn new(mut w: W, version: u32, header: bool) -> Result<Self> {
        let mut head = MAGIC.to_vec();
        head.extend_from_slice(&version.to_le_bytes());
        if !header {
            head.clear();
        }
        w.write_all(&head)
            .map_err(|e| Error::io("writing the send stream", 0, e))?;
        Ok(StreamWriter {
            w,
            version,
            cmd: Vec::with_capacity(64 << 10),
            written: head.len() as u64,
            commands: 0,
        })
    }

    pub(crate) fn version(&self) -> u32 {
        self.version
    }

    /// Bytes and commands written so far.
    pub(crate) fn written(&self) -> (u64, u64) {
        (self.written, self.commands)
    }

    /// Starts command `kind`; attributes follow, [`StreamWriter::end_cmd`] writes it.
    pub(crate) fn begin(&mut self, kind: u16) -> &mut Self {
        self.cmd.clear();
        self.cmd.extend_from_slice(&[0; CMD_HEADER]);
        self.cmd[4..6].copy_from_slice(&kind.to_le_bytes());
        self
    }

    /// An attribute with its length.
    pub(crate) fn attr(&mut self, ty: u16, value: &[u8]) -> &mut Self {
        self.cmd.extend_from_slice(&ty.to_le_bytes());
        self.cmd
            .extend_from_slice(&(value.len().min(u16::MAX as usize) as u16).to_le_bytes());
        self.cmd.extend_from_slice(value);
        self
    }

    pub(crate) fn u64(&mut self, ty: u16, v: u64) -> &mut Self {
        self.attr(ty, &v.to_le_bytes())
    }

    pub(crate) fn u32(&mut self, ty: u16, v: u32) -> &mut Self {
        self.attr(ty, &v.to_le_bytes())
    }

    /// A timespec attribute: u64 seconds, u32 nanoseconds.
    pub(crate) fn time(&mut self, ty: u16, sec: i64, nsec: u32) -> &mut Self {
        let mut b = [0u8; 12];
        b[..8].copy_from_slice(&sec.to_le_bytes());
        b[8..].copy_from_slice(&nsec.to_le_bytes());
        self.attr(ty, &b)
    }

    /// The DATA attribute: with a length in version 1, to the end of the command after.
    pub(crate) fn data(&mut self, value: &[u8]) -> &mut Self {
        if self.version >= 2 {
            self.cmd.extend_from_slice(&attr::DATA.to_le_bytes());
            self.cmd.extend_from_slice(value);
            self
        } else {
            self.attr(attr::DATA, value)
        }
    }

    /// Seals the command (length and crc32c) and writes it.
    pub(crate) fn end_cmd(&mut self) -> Result<()> {
        let len = (self.cmd.len() - CMD_HEADER) as u32;
        self.cmd[..4].copy_from_slice(&len.to_le_bytes());
        let crc = crc_raw(&[&self.cmd]);
        self.cmd[6..10].copy_from_slice(&crc.to_le_bytes());
        self.w
            .write_all(&self.cmd)
            .map_err(|e| Error::io("writing the send stream", self.written, e))?;
        self.written += self.cmd.len() as u64;
        self.commands += 1;
        Ok(())
    }

    /// Flushes the output.
    pub(crate) fn flush(&mut self) -> Result<()> {
        self.w
            .flush()
            .map_err(|e| Error::io("writing the send stream", self.written, e))
    }
}
