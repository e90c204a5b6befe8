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

    fn text(&self, ty: u16) -> Result<String> {
        Ok(String::from_utf8_lossy(self.bytes(ty)?).into_owned())
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

    /// A timespec attribute as `--dump` prints it.
    fn time(&self, ty: u16) -> Result<String> {
        let (secs, _) = self.timespec(ty)?;
        let t = crate::format::print::utc_datetime(secs).replacen(' ', "T", 1);
        Ok(format!("{t}+0000"))
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

/// Prints the commands of the stream in `r` as `btrfs receive --dump` does: one line per
/// command, paths from the current subvolume's name (`./NAME/...`), times in UTC, up to the
/// first `end` command.
pub fn dump(r: impl Read, out: &mut dyn Write) -> Result<()> {
    let mut s = StreamReader::new(r)?;
    let mut subvol = String::new();
    let emit = |out: &mut dyn Write, line: String| {
        out.write_all(line.as_bytes())
            .map_err(|e| Error::io("writing the dump", 0, e))
    };
    while let Some(c) = s.next_command()? {
        let Some(name) = c.name() else {
            return Err(Error::Unsupported(format!(
                "send stream command {} at byte {}",
                c.kind, c.offset
            )));
        };
        let full = |p: String| format!("./{subvol}/{p}");
        let (path, attrs): (String, Vec<String>) = match c.kind {
            1 | 2 => {
                subvol = c.text(attr::PATH)?;
                let mut a = vec![
                    format!("uuid={}", c.uuid(attr::UUID)?),
                    format!("transid={}", c.u64(attr::CTRANSID)?),
                ];
                if c.kind == 2 {
                    a.push(format!("parent_uuid={}", c.uuid(attr::CLONE_UUID)?));
                    a.push(format!("parent_transid={}", c.u64(attr::CLONE_CTRANSID)?));
                }
                (format!("./{subvol}"), a)
            }
            3 | 4 | 6 | 7 | 11 | 12 => (full(c.text(attr::PATH)?), vec![]),
            5 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("mode={:o}", c.u64(attr::MODE)?),
                    format!("dev={:#x}", c.u64(attr::RDEV)?),
                ],
            ),
            8 => (
                full(c.text(attr::PATH)?),
                vec![format!("dest={}", c.text(attr::PATH_LINK)?)],
            ),
            9 => (
                full(c.text(attr::PATH)?),
                vec![format!("dest={}", full(c.text(attr::PATH_TO)?))],
            ),
            10 => (
                full(c.text(attr::PATH)?),
                vec![format!("dest={}", c.text(attr::PATH_LINK)?)],
            ),
            13 => {
                let data = c.bytes(attr::XATTR_DATA)?;
                (
                    full(c.text(attr::PATH)?),
                    vec![
                        format!("name={}", c.text(attr::XATTR_NAME)?),
                        String::from_utf8_lossy(data).into_owned(),
                        format!("len={}", data.len()),
                    ],
                )
            }
            14 => (
                full(c.text(attr::PATH)?),
                vec![format!("name={}", c.text(attr::XATTR_NAME)?)],
            ),
            15 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("offset={}", c.u64(attr::FILE_OFFSET)?),
                    format!("len={}", c.bytes(attr::DATA)?.len()),
                ],
            ),
            16 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("offset={}", c.u64(attr::FILE_OFFSET)?),
                    format!("len={}", c.u64(attr::CLONE_LEN)?),
                    format!("from={}", full(c.text(attr::CLONE_PATH)?)),
                    format!("clone_offset={}", c.u64(attr::CLONE_OFFSET)?),
                ],
            ),
            17 => (
                full(c.text(attr::PATH)?),
                vec![format!("size={}", c.u64(attr::SIZE)?)],
            ),
            18 => (
                full(c.text(attr::PATH)?),
                vec![format!("mode={:o}", c.u64(attr::MODE)?)],
            ),
            19 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("gid={}", c.u64(attr::GID)?),
                    format!("uid={}", c.u64(attr::UID)?),
                ],
            ),
            20 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("atime={}", c.time(attr::ATIME)?),
                    format!("mtime={}", c.time(attr::MTIME)?),
                    format!("ctime={}", c.time(attr::CTIME)?),
                ],
            ),
            // btrfs receive --dump stops at the first end, even where more streams follow
            // (a send of several subvolumes); so does this.
            21 => break,
            22 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("offset={}", c.u64(attr::FILE_OFFSET)?),
                    format!("len={}", c.u64(attr::SIZE)?),
                ],
            ),
            23 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("mode={}", c.u64(attr::FALLOCATE_MODE)?),
                    format!("offset={}", c.u64(attr::FILE_OFFSET)?),
                    format!("len={}", c.u64(attr::SIZE)?),
                ],
            ),
            24 => (
                full(c.text(attr::PATH)?),
                // btrfs-progs prints the decimal value after "0x"; so does this, to match.
                vec![format!("fileattr=0x{}", c.u64(attr::FILEATTR)?)],
            ),
            25 => (
                full(c.text(attr::PATH)?),
                vec![
                    format!("offset={}", c.u64(attr::FILE_OFFSET)?),
                    format!("len={}", c.bytes(attr::DATA)?.len()),
                    format!("unencoded_file_len={}", c.u64(attr::UNENCODED_FILE_LEN)?),
                    format!("unencoded_len={}", c.u64(attr::UNENCODED_LEN)?),
                    format!("unencoded_offset={}", c.u64(attr::UNENCODED_OFFSET)?),
                    format!("compression={}", c.u64_or(attr::COMPRESSION, 0)?),
                    format!("encryption={}", c.u64_or(attr::ENCRYPTION, 0)?),
                ],
            ),
            _ => (full(c.text(attr::PATH)?), vec![]),
        };
        let line = if attrs.is_empty() {
            format!("{name:<16}{path}\n")
        } else {
            format!("{name:<16}{path:<32}{}\n", attrs.join(" "))
        };
        emit(out, line)?;
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
