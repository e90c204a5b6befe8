//! Compressed file extents (regular and inline): decompression, and the compression the
//! write path uses ([`compress`], with the [`Compression`] a mount option, a property or an
//! inode flag asks for).
//!
//! The file extent item's `compression` byte selects the codec; `ram_bytes` is the length of
//! the decompressed data. A compressed regular extent holds at most 128 KiB of data
//! ([`MAX_UNCOMPRESSED`]); an inline one at most a sector.
//!
//! Stream formats:
//! - 1 zlib: one zlib stream (RFC 1950). Like the kernel, the 2-byte header is checked and
//!   the deflate body is inflated raw, so the trailing Adler-32 is not verified.
//! - 2 lzo: btrfs's own framing around LZO1X streams:
//!   - a le32 total length of the compressed data, counting this 4-byte header;
//!   - segments, each a le32 length followed by that many bytes of one LZO1X stream that
//!     decompresses to at most one sector (every sector of input but the last gives a full
//!     sector); segments follow each other and their payload may cross sector boundaries,
//!     but a segment header never does: when fewer than 4 bytes remain in the current
//!     sector after a segment, they are zero padding and the next header starts at the next
//!     sector (positions are counted from the start of the compressed data);
//!   - the total length may count padding after the last segment (the kernel writes that);
//!   - each segment's output follows the previous one's actual output;
//!   - an inline extent has exactly one segment (not enforced here).
//! - 3 zstd: one zstd frame; the kernel writes frames with a window of at most 2^17 bytes and
//!   its decoder accepts no more, so neither do we (which also bounds memory).
//!
//! In every case decoding stops as soon as `ram_bytes` of output exist (later input is not
//! examined, as in the kernel), and a stream that ends cleanly before `ram_bytes` leaves the
//! rest zero-filled. Input that ends in the middle of a stream, or is malformed, is
//! [`crate::Error::Corrupt`]. Nothing here panics or allocates more than `ram_bytes` plus one
//! sector, whatever the input.
//!
//! The LZO1X decoder is our own, written from the format description (instruction set as
//! documented in the Linux tree's Documentation/staging/lzo.rst): every read is bounds-checked,
//! back-references may not reach before the start of the segment's output, and output may not
//! exceed the segment's room.

use crate::{Error, Location, Result};

/// On-disk `compression` code of a file extent item: not compressed.
pub(crate) const COMPRESS_NONE: u8 = 0;
/// On-disk `compression` code: zlib.
pub(crate) const COMPRESS_ZLIB: u8 = 1;
/// On-disk `compression` code: LZO (btrfs framing, see the module docs).
pub(crate) const COMPRESS_LZO: u8 = 2;
/// On-disk `compression` code: zstd.
pub(crate) const COMPRESS_ZSTD: u8 = 3;

/// An algorithm and level to compress with, as `-o compress=ALG[:LEVEL]` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compression {
    /// On-disk code: 1 zlib, 2 lzo, 3 zstd.
    code: u8,
    /// zlib 1 to 9, zstd 1 to 15; 0 for lzo (no levels).
    /// zlib 1-9; zstd -15 to 15 (negative: the fast levels, as the kernel takes them since
    /// Linux 6.15); lzo 0.
    level: i8,
}

impl Compression {
    /// zlib at level 3 (the kernel's default algorithm and level).
    pub const ZLIB: Compression = Compression { code: 1, level: 3 };

    /// Parses `zlib`, `lzo`, `zstd`, each with an optional `:LEVEL` (zlib 1-9, zstd 1-15;
    /// 3 when not given), as the kernel's `compress=` option and the `btrfs.compression`
    /// property spell them. `None` for `no` and `none` (the property's way to turn it off).
    pub fn parse(s: &str) -> Result<Option<Compression>> {
        let (alg, level) = match s.split_once(':') {
            Some((a, l)) => (a, Some(l)),
            None => (s, None),
        };
        let (code, max) = match alg {
            "zlib" => (COMPRESS_ZLIB, 9),
            "lzo" => (COMPRESS_LZO, 0),
            "zstd" => (COMPRESS_ZSTD, 15i8),
            "no" | "none" if level.is_none() => return Ok(None),
            _ => {
                return Err(Error::Invalid(format!(
                    "compression {s:?}: zlib, lzo or zstd, with :LEVEL for zlib (1-9) and \
                     zstd (-15 to 15)"
                )))
            }
        };
        // zstd: level 0 is the default, as the kernel reads it, and the negative levels are
        // the fast ones.
        let min = if code == COMPRESS_ZSTD { -max } else { 1 };
        let level = match level {
            None if max == 0 => 0,
            None => 3,
            Some(l) => match l.parse::<i8>() {
                Ok(0) if code == COMPRESS_ZSTD => 3,
                Ok(n) if max > 0 && (min..=max).contains(&n) => n,
                _ => {
                    return Err(Error::Invalid(format!(
                        "compression level {l:?} for {alg} (zlib 1-9, zstd -15 to 15, lzo none)"
                    )))
                }
            },
        };
        Ok(Some(Compression { code, level }))
    }

    /// The on-disk code of the file extent item.
    pub(crate) fn code(self) -> u8 {
        self.code
    }

    /// The algorithm's name, as the property stores it.
    pub fn name(self) -> &'static str {
        match self.code {
            COMPRESS_ZLIB => "zlib",
            COMPRESS_LZO => "lzo",
            _ => "zstd",
        }
    }
}

/// `input` compressed with `c` in the stream format its code reads back (see the module
/// docs); `None` when the codec fails (it does not on valid input).
pub(crate) fn compress(c: Compression, input: &[u8], sectorsize: u32) -> Option<Vec<u8>> {
    match c.code {
        COMPRESS_ZLIB => ZLIB.with(|cell| {
            // One deflate state per thread and level, reset between extents: making one
            // costs more than compressing a small extent.
            let mut slot = cell.borrow_mut();
            let z = match slot.as_mut() {
                Some((level, z)) if *level == c.level => {
                    z.reset();
                    z
                }
                _ => {
                    let fresh = flate2::Compress::new(
                        flate2::Compression::new(c.level.unsigned_abs().into()),
                        true,
                    );
                    &mut slot.insert((c.level, fresh)).1
                }
            };
            let mut out = Vec::with_capacity(input.len() + input.len() / 1000 + 64);
            match z.compress_vec(input, &mut out, flate2::FlushCompress::Finish) {
                Ok(flate2::Status::StreamEnd) => Some(out),
                _ => None,
            }
        }),
        COMPRESS_LZO => Some(lzo_frame(input, sectorsize as usize)),
        _ => ZSTD.with(|cell| {
            let mut slot = cell.borrow_mut();
            if slot.as_ref().is_none_or(|(level, _)| *level != c.level) {
                let mut z = zstd::bulk::Compressor::new(i32::from(c.level)).ok()?;
                // A window of at most 2^17 bytes, as btrfs's decoder requires.
                z.set_parameter(zstd::zstd_safe::CParameter::WindowLog(ZSTD_WINDOW_LOG_MAX))
                    .ok()?;
                *slot = Some((c.level, z));
            }
            slot.as_mut()?.1.compress(input).ok()
        }),
    }
}

thread_local! {
    /// Each thread's compressor contexts, kept between extents (see [`compress`]).
    static ZLIB: std::cell::RefCell<Option<(i8, flate2::Compress)>> =
        const { std::cell::RefCell::new(None) };
    static ZSTD: std::cell::RefCell<Option<(i8, zstd::bulk::Compressor<'static>)>> =
        const { std::cell::RefCell::new(None) };
}

/// Frames `data` the way btrfs does for LZO: one segment per sector of input, a segment
/// header never straddling a sector boundary.
fn lzo_frame(data: &[u8], sectorsize: usize) -> Vec<u8> {
    let mut v = vec![0u8; LZO_LEN];
    for chunk in data.chunks(sectorsize) {
        let left = sectorsize - v.len() % sectorsize;
        if left < LZO_LEN {
            v.resize(v.len() + left, 0);
        }
        let c = match lzokay_native::compress(chunk) {
            Ok(c) => c,
            // The encoder has no failure on valid input; a segment that could not be
            // compressed makes the whole result useless: the caller stores it plain.
            Err(_) => return vec![0u8; data.len() + sectorsize],
        };
        v.extend_from_slice(&(c.len() as u32).to_le_bytes());
        v.extend_from_slice(&c);
    }
    let total = v.len() as u32;
    v[..4].copy_from_slice(&total.to_le_bytes());
    v
}

/// Largest window (log2 bytes) of a zstd frame that btrfs accepts.
const ZSTD_WINDOW_LOG_MAX: u32 = 17;

/// Size of a btrfs LZO length field (total length and segment headers).
const LZO_LEN: usize = 4;

/// Most file data one compressed extent holds (the kernel's limit too).
pub(crate) const MAX_PIECE: u64 = 128 * 1024;

/// A piece's compressed bytes (padded to whole sectors), `None` where it stays plain.
pub(crate) type Packed = Option<Vec<u8>>;

/// A write of `total` (sector-aligned) bytes cut into compressed extents' pieces: `(offset
/// in the write, length)`, at most 128 KiB of file data each.
pub(crate) fn pieces_of(total: u64) -> Vec<(u64, u64)> {
    (0..total)
        .step_by(MAX_PIECE as usize)
        .map(|o| (o, (total - o).min(MAX_PIECE)))
        .collect()
}

/// `piece` compressed with `c` and padded to whole sectors, or `None` when that does not take
/// fewer sectors than the piece.
pub(crate) fn pack(c: Compression, piece: &[u8], ss: u64) -> Option<Vec<u8>> {
    let mut z = compress(c, piece, ss as u32)?;
    let padded = (z.len() as u64).div_ceil(ss) * ss;
    if padded >= piece.len() as u64 {
        return None;
    }
    z.resize(padded as usize, 0);
    Some(z)
}

/// File data compressed ahead of its write, on any thread and off every lock
/// (`Core::write_precompressed`): a caller with many files to write (mkfs --rootdir)
/// compresses the next ones on every CPU while the engine stores the last.
#[derive(PartialEq, Eq)]
pub struct Precompressed {
    c: Compression,
    len: usize,
    /// Shorter than a sector: the data compressed as it is, for an inline extent, if that
    /// made it smaller. Else each piece of at most 128 KiB of the data (the last padded with
    /// zeros to a sector) as [`pack`] leaves it.
    pieces: Vec<Option<Vec<u8>>>,
}

impl Precompressed {
    /// Compresses `data`, to be written at offset 0 of a file or at a sector boundary, with
    /// `c` on a filesystem of `sectorsize`.
    pub fn new(c: Compression, data: &[u8], sectorsize: u32) -> Precompressed {
        let ss = u64::from(sectorsize.max(512));
        let pieces = if (data.len() as u64) < ss {
            vec![compress(c, data, sectorsize).filter(|z| z.len() < data.len())]
        } else {
            pieces_of((data.len() as u64).div_ceil(ss) * ss)
                .iter()
                .map(|&(d, len)| {
                    let (d, end) = (d as usize, (d + len) as usize);
                    if end <= data.len() {
                        pack(c, &data[d..end], ss)
                    } else {
                        let mut last = data[d..].to_vec();
                        last.resize(end - d, 0);
                        pack(c, &last, ss)
                    }
                })
                .collect()
        };
        Precompressed {
            c,
            len: data.len(),
            pieces,
        }
    }

    /// The compressed bytes for a write of `len` bytes with `c`, if these are theirs.
    pub(crate) fn pieces_for(&self, c: Compression, len: usize) -> Option<&[Option<Vec<u8>>]> {
        (self.c == c && self.len == len).then_some(&self.pieces[..])
    }
}

#[cfg(test)]
/// Name of a compression code for messages ("zlib", "lzo", "zstd", "none").
pub(crate) fn compression_name(compression: u8) -> &'static str {
    match compression {
        COMPRESS_NONE => "none",
        COMPRESS_ZLIB => "zlib",
        COMPRESS_LZO => "lzo",
        COMPRESS_ZSTD => "zstd",
        _ => "unknown",
    }
}

fn corrupt(codec: &str, reason: impl Into<String>) -> Error {
    Error::corrupt(
        Location::what(format!("compressed extent ({codec})")),
        reason,
    )
}

/// Decompresses one compressed extent (or compressed inline extent) of file data.
/// `compression` is the on-disk code of the file extent item (1 zlib, 2 lzo, 3 zstd).
/// `ram_bytes` is the decompressed length recorded in the item; output is exactly ram_bytes long
/// (zero-filled if the stream ends short, which btrfs allows). `sectorsize` is needed for
/// btrfs's LZO per-sector framing (a power of two from 512 to 65536, else corrupt).
///
/// Memory: the output buffer (`ram_bytes`) is allocated up front, plus at most one sector of
/// scratch for LZO; nothing is sized from lengths inside the stream. `ram_bytes` itself comes
/// from disk, so callers bound it first (a regular compressed extent never exceeds
/// [`MAX_UNCOMPRESSED`]; an inline one never exceeds a sector). Code 0 (none) copies the
/// input, truncated or zero-padded to `ram_bytes`. Codes above 3 are corrupt.
pub(crate) fn decompress(
    compression: u8,
    input: &[u8],
    ram_bytes: usize,
    sectorsize: u32,
) -> Result<Vec<u8>> {
    if compression > COMPRESS_ZSTD {
        return Err(Error::corrupt(
            Location::what("compressed extent"),
            format!("unknown compression type {compression}"),
        ));
    }
    let mut out = vec![0u8; ram_bytes];
    if ram_bytes == 0 {
        return Ok(out);
    }
    match compression {
        COMPRESS_NONE => {
            let n = input.len().min(ram_bytes);
            out[..n].copy_from_slice(&input[..n]);
        }
        COMPRESS_ZLIB => zlib_into(input, &mut out)?,
        COMPRESS_LZO => lzo_btrfs_into(input, &mut out, sectorsize)?,
        _ => zstd_into(input, &mut out)?,
    }
    Ok(out)
}

/// Inflates a zlib stream into `out`, stopping when `out` is full or the stream ends.
fn zlib_into(input: &[u8], out: &mut [u8]) -> Result<()> {
    use flate2::{Decompress, FlushDecompress, Status};
    let (cmf, flg) = match input {
        [a, b, ..] => (*a, *b),
        _ => {
            return Err(corrupt(
                "zlib",
                format!("stream of {} bytes has no header", input.len()),
            ))
        }
    };
    if cmf & 0x0f != 8 || cmf >> 4 > 7 {
        return Err(corrupt("zlib", format!("bad header byte CMF {cmf:#04x}")));
    }
    if (u16::from(cmf) << 8 | u16::from(flg)) % 31 != 0 {
        return Err(corrupt(
            "zlib",
            format!("header check fails: CMF {cmf:#04x} FLG {flg:#04x}"),
        ));
    }
    if flg & 0x20 != 0 {
        return Err(corrupt("zlib", "stream needs a preset dictionary"));
    }
    let body = &input[2..];
    let mut d = Decompress::new(false);
    loop {
        let in_pos = usize::try_from(d.total_in()).unwrap_or(usize::MAX);
        let out_pos = usize::try_from(d.total_out()).unwrap_or(usize::MAX);
        let (Some(src), Some(dst)) = (body.get(in_pos..), out.get_mut(out_pos..)) else {
            return Err(corrupt("zlib", "decoder position out of range"));
        };
        if dst.is_empty() {
            return Ok(());
        }
        let status = d.decompress(src, dst, FlushDecompress::None).map_err(|e| {
            corrupt(
                "zlib",
                format!("bad deflate data after {} input bytes: {e}", in_pos + 2),
            )
        })?;
        if status == Status::StreamEnd {
            // Keep the zero-fill guarantee whatever the backend did past its output position.
            let end = usize::try_from(d.total_out())
                .unwrap_or(usize::MAX)
                .min(out.len());
            out[end..].fill(0);
            return Ok(());
        }
        if d.total_in() as usize == in_pos && d.total_out() as usize == out_pos {
            return Err(corrupt(
                "zlib",
                format!(
                    "stream truncated: input ends after {} bytes with {out_pos} of {} bytes produced",
                    input.len(),
                    out.len()
                ),
            ));
        }
    }
}

/// Decodes one zstd frame into `out`, stopping when `out` is full or the frame ends.
fn zstd_into(input: &[u8], out: &mut [u8]) -> Result<()> {
    use zstd::stream::raw::{DParameter, Decoder, InBuffer, Operation, OutBuffer};
    let mut dec =
        Decoder::new().map_err(|e| corrupt("zstd", format!("decoder setup failed: {e}")))?;
    dec.set_parameter(DParameter::WindowLogMax(ZSTD_WINDOW_LOG_MAX))
        .map_err(|e| corrupt("zstd", format!("decoder setup failed: {e}")))?;
    let total = out.len();
    let mut src = InBuffer::around(input);
    let mut dst = OutBuffer::around(out);
    loop {
        if dst.pos() >= total {
            return Ok(());
        }
        let (in_before, out_before) = (src.pos(), dst.pos());
        let hint = dec.run(&mut src, &mut dst).map_err(|e| {
            corrupt(
                "zstd",
                format!("bad frame at input byte {}: {e}", src.pos()),
            )
        })?;
        if hint == 0 {
            // The frame is complete. zstd may have used the space past its output position as
            // scratch (wild copies), so clear what follows.
            let end = dst.pos();
            out[end..].fill(0);
            return Ok(());
        }
        if src.pos() == in_before && dst.pos() == out_before {
            return Err(corrupt(
                "zstd",
                format!(
                    "frame truncated: input ends after {} bytes with {} of {total} bytes produced",
                    input.len(),
                    dst.pos()
                ),
            ));
        }
    }
}

/// Worst-case LZO1X output for `n` input bytes: the largest segment payload for a sector.
fn lzo_worst(n: usize) -> usize {
    n + n / 16 + 64 + 3
}

fn read_le32(b: &[u8], pos: usize) -> Option<u32> {
    let s = b.get(pos..pos.checked_add(LZO_LEN)?)?;
    Some(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// Decodes btrfs-framed LZO (see the module docs) into `out`.
fn lzo_btrfs_into(input: &[u8], out: &mut [u8], sectorsize: u32) -> Result<()> {
    let sector = sectorsize as usize;
    if !sectorsize.is_power_of_two() || !(512..=65536).contains(&sectorsize) {
        return Err(corrupt("lzo", format!("bad sector size {sectorsize}")));
    }
    let total = read_le32(input, 0).ok_or_else(|| {
        corrupt(
            "lzo",
            format!("input of {} bytes has no length header", input.len()),
        )
    })? as usize;
    if total > input.len() {
        return Err(corrupt(
            "lzo",
            format!(
                "total length {total} exceeds the {} bytes of the extent",
                input.len()
            ),
        ));
    }
    if total < LZO_LEN {
        return Err(corrupt(
            "lzo",
            format!("total length {total} is less than its own header"),
        ));
    }
    let data = &input[..total];
    let max_seg = lzo_worst(sector);
    let mut scratch: Vec<u8> = Vec::new();
    let mut pos = LZO_LEN;
    let mut out_pos = 0usize;
    while pos < total && out_pos < out.len() {
        let seg_len = read_le32(data, pos).ok_or_else(|| {
            corrupt(
                "lzo",
                format!("segment header at {pos} runs past the total length {total}"),
            )
        })? as usize;
        let seg_start = pos + LZO_LEN;
        if seg_len > max_seg {
            return Err(corrupt(
                "lzo",
                format!("segment at {pos} has length {seg_len}, more than {max_seg} for sector size {sector}"),
            ));
        }
        let seg_end = seg_start.saturating_add(seg_len);
        let seg = data.get(seg_start..seg_end).ok_or_else(|| {
            corrupt(
                "lzo",
                format!("segment at {pos} of {seg_len} bytes runs past the total length {total}"),
            )
        })?;
        let room = out.len() - out_pos;
        let produced = if room >= sector {
            lzo1x_decode(seg, &mut out[out_pos..out_pos + sector])
        } else {
            // Last, partial sector of the output: decode into a sector-sized buffer so a
            // full-sector segment is accepted, then keep what fits.
            scratch.resize(sector, 0);
            lzo1x_decode(seg, &mut scratch).map(|n| {
                let keep = n.min(room);
                out[out_pos..out_pos + keep].copy_from_slice(&scratch[..keep]);
                keep
            })
        }
        .map_err(|e| corrupt("lzo", format!("segment at {pos} of {seg_len} bytes: {e}")))?;
        out_pos += produced;
        pos = seg_end;
        let left_in_sector = sector - pos % sector;
        if left_in_sector < LZO_LEN {
            pos += left_in_sector;
        }
    }
    Ok(())
}

/// Why an LZO1X stream failed to decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LzoError {
    /// The stream needs more input than there is.
    InputOverrun,
    /// The stream produces more than the output room (more than a sector in btrfs).
    OutputOverrun { room: usize },
    /// A match refers to data before the start of the output.
    LookBehind { distance: usize, produced: usize },
    /// The end-of-stream marker has a length other than 3.
    BadEnd,
    /// Input bytes follow the end-of-stream marker.
    Trailing { extra: usize },
}

impl std::fmt::Display for LzoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LzoError::InputOverrun => write!(f, "LZO1X stream ends early"),
            LzoError::OutputOverrun { room } => {
                write!(f, "decompresses to more than {room} bytes")
            }
            LzoError::LookBehind { distance, produced } => {
                write!(f, "match distance {distance} reaches before the start ({produced} bytes produced)")
            }
            LzoError::BadEnd => write!(f, "malformed end-of-stream marker"),
            LzoError::Trailing { extra } => {
                write!(f, "{extra} bytes after the end-of-stream marker")
            }
        }
    }
}

/// Bounds-checked cursor over an LZO1X stream and its output window.
struct Lzo<'a> {
    src: &'a [u8],
    ip: usize,
    dst: &'a mut [u8],
    op: usize,
}

impl Lzo<'_> {
    fn byte(&mut self) -> Result<u8, LzoError> {
        let b = *self.src.get(self.ip).ok_or(LzoError::InputOverrun)?;
        self.ip += 1;
        Ok(b)
    }

    fn le16(&mut self) -> Result<usize, LzoError> {
        let lo = self.byte()?;
        let hi = self.byte()?;
        Ok(usize::from(u16::from_le_bytes([lo, hi])))
    }

    /// Extended length: a run of zero bytes (255 each) ended by a non-zero byte (its value).
    fn ext_len(&mut self) -> Result<usize, LzoError> {
        let mut zeros = 0usize;
        loop {
            let b = self.byte()?;
            if b != 0 {
                return Ok(zeros.saturating_mul(255).saturating_add(usize::from(b)));
            }
            zeros += 1;
        }
    }

    fn literals(&mut self, n: usize) -> Result<(), LzoError> {
        let end = self.ip.checked_add(n).ok_or(LzoError::InputOverrun)?;
        let s = self.src.get(self.ip..end).ok_or(LzoError::InputOverrun)?;
        let oend = self.op.checked_add(n).filter(|&e| e <= self.dst.len());
        let oend = oend.ok_or(LzoError::OutputOverrun {
            room: self.dst.len(),
        })?;
        self.dst[self.op..oend].copy_from_slice(s);
        self.ip = end;
        self.op = oend;
        Ok(())
    }

    /// Copies `len` bytes from `distance` bytes back; the ranges may overlap (runs).
    fn copy_match(&mut self, distance: usize, len: usize) -> Result<(), LzoError> {
        if distance == 0 || distance > self.op {
            return Err(LzoError::LookBehind {
                distance,
                produced: self.op,
            });
        }
        let oend = self.op.checked_add(len).filter(|&e| e <= self.dst.len());
        let oend = oend.ok_or(LzoError::OutputOverrun {
            room: self.dst.len(),
        })?;
        let from = self.op - distance;
        if distance >= len {
            self.dst.copy_within(from..from + len, self.op);
        } else {
            for i in 0..len {
                self.dst[self.op + i] = self.dst[from + i];
            }
        }
        self.op = oend;
        Ok(())
    }
}

/// Decodes one LZO1X stream into `dst`; returns the number of bytes produced.
///
/// `state` below is the number of literals the previous instruction copied (4 meaning "four
/// or more"); it selects how the short instructions 0..=15 are read.
fn lzo1x_decode(src: &[u8], dst: &mut [u8]) -> Result<usize, LzoError> {
    let mut z = Lzo {
        src,
        ip: 0,
        dst,
        op: 0,
    };
    let mut state = 0usize;
    // A first byte above 17 is a literal run of (byte - 17) bytes.
    let first = *z.src.first().ok_or(LzoError::InputOverrun)?;
    if first > 17 {
        z.ip = 1;
        let n = usize::from(first - 17);
        z.literals(n)?;
        state = n.min(4);
    }
    loop {
        let inst = z.byte()?;
        let (distance, len, next) = match inst {
            0..=15 if state == 0 => {
                // Literal run: 3 + (L, or 15 + extension when L is 0) bytes.
                let l = usize::from(inst);
                let n = if l == 0 {
                    z.ext_len()?.saturating_add(18)
                } else {
                    l + 3
                };
                z.literals(n)?;
                state = 4;
                continue;
            }
            0..=15 => {
                // Short match: 2 bytes within 1 KiB after 1..3 literals, or 3 bytes at
                // 2 KiB..3 KiB after a longer literal run.
                let h = usize::from(z.byte()?);
                let d = (h << 2) + usize::from((inst >> 2) & 3);
                if state < 4 {
                    (d + 1, 2, usize::from(inst & 3))
                } else {
                    (d + 2049, 3, usize::from(inst & 3))
                }
            }
            16..=31 => {
                // Far match (16 KiB..48 KiB), or the end of the stream at distance 16 KiB.
                let l = usize::from(inst & 7);
                let len = if l == 0 {
                    z.ext_len()?.saturating_add(9)
                } else {
                    l + 2
                };
                let v = z.le16()?;
                let distance = 16384 + (usize::from(inst & 8) << 11) + (v >> 2);
                if distance == 16384 {
                    if len != 3 {
                        return Err(LzoError::BadEnd);
                    }
                    if z.ip != z.src.len() {
                        return Err(LzoError::Trailing {
                            extra: z.src.len() - z.ip,
                        });
                    }
                    return Ok(z.op);
                }
                (distance, len, v & 3)
            }
            32..=63 => {
                // Match within 16 KiB.
                let l = usize::from(inst & 31);
                let len = if l == 0 {
                    z.ext_len()?.saturating_add(33)
                } else {
                    l + 2
                };
                let v = z.le16()?;
                ((v >> 2) + 1, len, v & 3)
            }
            _ => {
                // Short match within 2 KiB: 3..4 bytes (64..127) or 5..8 bytes (128..255).
                let h = usize::from(z.byte()?);
                let distance = (h << 3) + usize::from((inst >> 2) & 7) + 1;
                let len = if inst >= 128 {
                    5 + usize::from((inst >> 5) & 3)
                } else {
                    3 + usize::from((inst >> 5) & 1)
                };
                (distance, len, usize::from(inst & 3))
            }
        };
        z.copy_match(distance, len)?;
        z.literals(next)?;
        state = next;
    }
}

/// Helpers for tests that ask the real kernel btrfs and btrfs-progs (the oracle).
///
/// When a tool, root or loop devices are missing the test is skipped with a message, unless
/// the environment variable `CI` is set: then it fails.
#[cfg(test)]
pub(crate) mod oracle {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    fn unavailable(what: &str) -> bool {
        if std::env::var_os("CI").is_some() {
            panic!("CI is set but the btrfs oracle is unavailable: {what}");
        }
        eprintln!("skipping oracle test: {what}");
        false
    }

    fn on_path(tool: &str) -> bool {
        std::env::var_os("PATH")
            .map(|p| std::env::split_paths(&p).any(|d| d.join(tool).is_file()))
            .unwrap_or(false)
            || ["/usr/sbin", "/sbin", "/usr/bin", "/bin"]
                .iter()
                .any(|d| Path::new(d).join(tool).is_file())
    }

    /// mkfs.btrfs and btrfs are installed.
    pub(crate) fn mkfs_available() -> bool {
        for tool in ["mkfs.btrfs", "btrfs"] {
            if !on_path(tool) {
                return unavailable(&format!("{tool} not found"));
            }
        }
        true
    }

    /// Additionally: running as root, loop devices and kernel btrfs present.
    pub(crate) fn loop_mount_available() -> bool {
        if !mkfs_available() {
            return false;
        }
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let root = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .and_then(|l| l.split_whitespace().nth(2))
            == Some("0");
        if !root {
            return unavailable("not running as root");
        }
        if !Path::new("/dev/loop-control").exists() {
            return unavailable("no /dev/loop-control");
        }
        for tool in ["losetup", "mount", "umount"] {
            if !on_path(tool) {
                return unavailable(&format!("{tool} not found"));
            }
        }
        let fs = std::fs::read_to_string("/proc/filesystems").unwrap_or_default();
        if !fs
            .lines()
            .any(|l| l.split_whitespace().last() == Some("btrfs"))
        {
            return unavailable("kernel has no btrfs");
        }
        true
    }

    fn tool_path(tool: &str) -> String {
        for d in ["/usr/sbin", "/sbin", "/usr/bin", "/bin"] {
            let p = Path::new(d).join(tool);
            if p.is_file() {
                return p.to_string_lossy().into_owned();
            }
        }
        tool.to_string()
    }

    fn try_run(cmd: &str, args: &[&str]) -> Result<String, String> {
        let out = Command::new(tool_path(cmd))
            .args(args)
            .output()
            .map_err(|e| format!("{cmd} {args:?}: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "{cmd} {args:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs a tool and returns its stdout; panics with its stderr on failure.
    pub(crate) fn run(cmd: &str, args: &[&str]) -> String {
        try_run(cmd, args).unwrap_or_else(|e| panic!("{e}"))
    }

    /// mkfs.btrfs -f -q IMG plus `extra` arguments.
    pub fn mkfs(img: &Path, extra: &[&str]) {
        let mut args = vec!["-f", "-q"];
        args.extend_from_slice(extra);
        let img = img.to_str().expect("utf-8 path");
        args.push(img);
        run("mkfs.btrfs", &args);
    }

    /// A private directory /tmp/codecs/<name>-<pid>, removed on drop.
    pub(crate) struct Scratch {
        dir: PathBuf,
    }

    impl Scratch {
        pub(crate) fn new(name: &str) -> Scratch {
            let dir = PathBuf::from(format!("/tmp/codecs/{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Scratch { dir }
        }

        /// A sparse image file of `size` bytes.
        pub(crate) fn image(&self, name: &str, size: u64) -> PathBuf {
            let p = self.dir.join(name);
            let f = std::fs::File::create(&p).unwrap();
            f.set_len(size).unwrap();
            p
        }

        /// Attaches `img` to a loop device and mounts it on a fresh directory with `opts`.
        pub(crate) fn mount(&self, img: &Path, opts: &[&str]) -> Mount {
            let mnt = self.dir.join("mnt");
            std::fs::create_dir_all(&mnt).unwrap();
            let dev = run("losetup", &["--find", "--show", img.to_str().unwrap()])
                .trim()
                .to_string();
            let mut m = Mount {
                dev,
                mnt,
                mounted: false,
                attached: true,
            };
            let mut args = vec![];
            let o = opts.join(",");
            if !o.is_empty() {
                args.push("-o");
                args.push(&o);
            }
            let mnt_s = m.mnt.to_str().unwrap().to_string();
            args.extend_from_slice(&["-t", "btrfs", &m.dev, &mnt_s]);
            run("mount", &args);
            m.mounted = true;
            m
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// A kernel mount of an image on a loop device we attached; unmounted and detached on drop.
    pub(crate) struct Mount {
        dev: String,
        mnt: PathBuf,
        mounted: bool,
        attached: bool,
    }

    impl Mount {
        pub(crate) fn path(&self) -> &Path {
            &self.mnt
        }

        /// `mount -o remount,OPTS`.
        pub(crate) fn remount(&self, opts: &str) {
            let o = format!("remount,{opts}");
            run("mount", &["-o", &o, self.mnt.to_str().unwrap()]);
        }

        /// Unmounts and detaches the loop device (panics on failure).
        pub(crate) fn unmount(mut self) {
            self.release().unwrap_or_else(|e| panic!("{e}"));
        }

        fn release(&mut self) -> Result<(), String> {
            if self.mounted {
                try_run("umount", &[self.mnt.to_str().unwrap()])?;
                self.mounted = false;
            }
            if self.attached {
                try_run("losetup", &["-d", &self.dev])?;
                self.attached = false;
            }
            Ok(())
        }
    }

    impl Drop for Mount {
        fn drop(&mut self) {
            if let Err(e) = self.release() {
                eprintln!("cleanup of {}: {e}", self.mnt.display());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// xorshift64*: deterministic test data without extra crates.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
        fn bytes(&mut self, n: usize) -> Vec<u8> {
            (0..n).map(|_| self.next() as u8).collect()
        }
    }

    /// Compressible text of `n` bytes made of words.
    fn text(seed: u64, n: usize) -> Vec<u8> {
        const WORDS: [&str; 12] = [
            "btrfs",
            "extent",
            "leaf",
            "node",
            "tree",
            "sector",
            "chunk",
            "stripe",
            "inode",
            "csum",
            "root",
            "subvolume",
        ];
        let mut r = Rng(seed | 1);
        let mut v = Vec::with_capacity(n + 16);
        while v.len() < n {
            v.extend_from_slice(WORDS[r.below(WORDS.len())].as_bytes());
            v.push(if r.below(10) == 0 { b'\n' } else { b' ' });
            if r.below(7) == 0 {
                v.extend_from_slice(format!("{}", r.next() % 100000).as_bytes());
            }
        }
        v.truncate(n);
        v
    }

    /// Test data of several kinds: text, zeros, incompressible, and mixed.
    fn samples() -> Vec<Vec<u8>> {
        let mut r = Rng(7);
        let mut mixed = text(3, 50_000);
        mixed.extend(r.bytes(20_000));
        mixed.extend(vec![0u8; 30_000]);
        mixed.extend(text(4, 31_072));
        vec![
            b"a".to_vec(),
            b"hello hello hello hello".to_vec(),
            text(1, 3000),
            text(2, 131_072),
            vec![0u8; 131_072],
            vec![0xab; 4096],
            r.bytes(4096),
            r.bytes(100_000),
            mixed,
        ]
    }

    fn zlib(data: &[u8]) -> Vec<u8> {
        let mut e = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::new(3));
        e.write_all(data).unwrap();
        e.finish().unwrap()
    }

    #[test]
    fn compress_reads_back_with_every_algorithm_and_level() {
        let data: Vec<u8> = (0..131072u32).map(|i| (i / 7 % 251) as u8).collect();
        for spec in [
            "zlib:1", "zlib:9", "lzo", "zstd:1", "zstd:15", "zstd", "zstd:-5",
        ] {
            let c = Compression::parse(spec).unwrap().unwrap();
            for ss in [4096u32, 65536] {
                let z = compress(c, &data, ss).unwrap();
                assert!(z.len() < data.len() / 4, "{spec}: {} bytes", z.len());
                let back = decompress(c.code(), &z, data.len(), ss).unwrap();
                same(&back, &data, spec);
            }
        }
        assert_eq!(Compression::parse("none").unwrap(), None);
        assert_eq!(Compression::parse("zstd").unwrap().unwrap().level, 3);
        // zstd's fast levels, as the kernel takes them; 0 is the default.
        assert_eq!(Compression::parse("zstd:-3").unwrap().unwrap().level, -3);
        assert_eq!(Compression::parse("zstd:-15").unwrap().unwrap().level, -15);
        assert_eq!(Compression::parse("zstd:0").unwrap().unwrap().level, 3);
        assert!(Compression::parse("zstd:-16").is_err());
        assert!(Compression::parse("zlib:-1").is_err());
        for bad in [
            "zlib:0", "zlib:10", "zstd:16", "lzo:1", "brotli", "no:1", "",
        ] {
            assert!(Compression::parse(bad).is_err(), "{bad} accepted");
        }
    }

    fn zstd(data: &[u8]) -> Vec<u8> {
        zstd::bulk::compress(data, 3).unwrap()
    }

    /// [`super::lzo_frame`] padded to a whole number of sectors, as an extent stores it.
    fn lzo_frame(data: &[u8], sectorsize: usize) -> Vec<u8> {
        let mut v = super::lzo_frame(data, sectorsize);
        let padded = v.len().div_ceil(sectorsize) * sectorsize;
        v.resize(padded, 0);
        v
    }

    /// Compares two buffers, reporting the first difference instead of both buffers.
    #[track_caller]
    fn same(got: &[u8], want: &[u8], what: &str) {
        if got != want {
            let at = got.iter().zip(want).position(|(a, b)| a != b);
            panic!(
                "{what}: lengths {} vs {}, first difference at {at:?}",
                got.len(),
                want.len()
            );
        }
    }

    fn assert_corrupt(r: Result<Vec<u8>>, needle: &str) {
        match r {
            Err(Error::Corrupt { loc, reason }) => {
                let msg = format!("{loc}: {reason}");
                assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
                assert!(loc
                    .what
                    .as_deref()
                    .unwrap_or("")
                    .starts_with("compressed extent"));
            }
            other => panic!("expected corrupt error containing {needle:?}, got {other:?}"),
        }
    }

    #[test]
    fn zlib_round_trip() {
        for d in samples() {
            let c = zlib(&d);
            same(
                &decompress(COMPRESS_ZLIB, &c, d.len(), 4096).unwrap(),
                &d,
                "zlib",
            );
            // Shorter ram_bytes: a prefix. Longer: zero-filled tail. Padding after the stream.
            let half = d.len() / 2;
            same(
                &decompress(COMPRESS_ZLIB, &c, half, 4096).unwrap(),
                &d[..half],
                "zlib prefix",
            );
            let mut padded = c.clone();
            padded.resize(c.len().div_ceil(4096) * 4096 + 4096, 0);
            let mut long = d.clone();
            long.resize(d.len() + 5000, 0);
            same(
                &decompress(COMPRESS_ZLIB, &padded, long.len(), 4096).unwrap(),
                &long,
                "zlib zero-filled",
            );
        }
    }

    #[test]
    fn zstd_round_trip() {
        for d in samples() {
            let c = zstd(&d);
            same(
                &decompress(COMPRESS_ZSTD, &c, d.len(), 4096).unwrap(),
                &d,
                "zstd",
            );
            let half = d.len() / 2;
            same(
                &decompress(COMPRESS_ZSTD, &c, half, 4096).unwrap(),
                &d[..half],
                "zstd prefix",
            );
            let mut padded = c.clone();
            padded.resize(c.len() + 4096, 0);
            let mut long = d.clone();
            long.resize(d.len() + 5000, 0);
            same(
                &decompress(COMPRESS_ZSTD, &padded, long.len(), 4096).unwrap(),
                &long,
                "zstd zero-filled",
            );
        }
    }

    #[test]
    fn lzo1x_decoder_matches_reference_codec() {
        for d in samples() {
            for chunk in d.chunks(65536) {
                let c = lzokay_native::compress(chunk).unwrap();
                let mut out = vec![0u8; chunk.len()];
                assert_eq!(lzo1x_decode(&c, &mut out), Ok(chunk.len()));
                same(&out, chunk, "lzo1x");
                // One byte too little room.
                let mut small = vec![0u8; chunk.len() - 1];
                assert!(matches!(
                    lzo1x_decode(&c, &mut small),
                    Err(LzoError::OutputOverrun { .. })
                ));
                // Truncated streams never decode.
                for cut in [0, 1, c.len() / 2, c.len() - 1] {
                    let mut out = vec![0u8; chunk.len()];
                    assert!(lzo1x_decode(&c[..cut], &mut out).is_err(), "cut {cut}");
                }
                // Trailing garbage is rejected (as the kernel does).
                let mut t = c.clone();
                t.push(0);
                let mut out = vec![0u8; chunk.len()];
                assert_eq!(
                    lzo1x_decode(&t, &mut out),
                    Err(LzoError::Trailing { extra: 1 })
                );
            }
        }
        // The empty stream is just the end marker.
        assert_eq!(lzo1x_decode(&[0x11, 0, 0], &mut []), Ok(0));
        // A match before any output.
        assert!(matches!(
            lzo1x_decode(&[18, b'a', 0x40, 0x01, 0x11, 0, 0], &mut [0u8; 16]),
            Err(LzoError::LookBehind { .. })
        ));
    }

    /// Hand-assembled streams for the instructions a greedy compressor rarely emits.
    #[test]
    fn lzo1x_rare_instructions() {
        // One literal (first byte 18), then a 2-byte match at distance 1 (state 1..3 form),
        // carrying 2 trailing literals, then the end marker.
        let s = [18, b'a', 0x02, 0x00, b'x', b'y', 0x11, 0, 0];
        let mut out = [0u8; 16];
        assert_eq!(lzo1x_decode(&s, &mut out), Ok(5));
        assert_eq!(&out[..5], b"aaaxy");

        // A long literal run with an extended length (state 0 form: 18 + 255 * 8 + 42 = 2100
        // bytes), then a 3-byte match at distance (H << 2) + D + 2049 (state 4 form).
        let lits: Vec<u8> = (0..2100u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut s = vec![0u8];
        s.extend([0u8; 8]);
        s.push(42);
        s.extend_from_slice(&lits);
        s.extend([0x04 | 0x01, 0x02, b'z']); // D = 1, S = 1, H = 2: distance 2058
        s.extend([0x11, 0, 0]);
        let mut out = vec![0u8; 4096];
        let n = lzo1x_decode(&s, &mut out).unwrap();
        let mut want = lits.clone();
        let from = want.len() - 2058;
        want.extend_from_within(from..from + 3);
        want.push(b'z');
        same(&out[..n], &want, "state-4 match");

        // A far match (M4: 0001HLLL, LE16 D << 2 | S, distance 16384 + (H << 14) + D) after
        // 18 + 255 * 64 + 255 = 16593 literals.
        let lits: Vec<u8> = (0..16593u32).map(|i| (i * 13 % 253) as u8).collect();
        let mut head = vec![0u8];
        head.extend([0u8; 64]);
        head.push(255);
        head.extend_from_slice(&lits);
        let mut s = head.clone();
        s.extend([0x12, 5 << 2, 0]); // H = 0, L = 2 (length 4), D = 5, S = 0
        s.extend([0x11, 0, 0]);
        let mut out = vec![0u8; 32768];
        let n = lzo1x_decode(&s, &mut out).unwrap();
        let mut want = lits.clone();
        let from = want.len() - 16389;
        want.extend_from_within(from..from + 4);
        same(&out[..n], &want, "far match");
        // H = 1 reaches 32768 + D back: before the start.
        let mut s = head.clone();
        s.extend([0x1a, 5 << 2, 0, 0x11, 0, 0]);
        assert!(matches!(
            lzo1x_decode(&s, &mut out),
            Err(LzoError::LookBehind { .. })
        ));
        // An end marker (distance 16384) with a length other than 3.
        let mut s = head;
        s.extend([0x12, 0, 0]);
        assert_eq!(lzo1x_decode(&s, &mut out), Err(LzoError::BadEnd));
    }

    #[test]
    fn lzo_btrfs_round_trip() {
        for sectorsize in [4096usize, 16384, 65536] {
            for d in samples() {
                let framed = lzo_frame(&d, sectorsize);
                let got = decompress(COMPRESS_LZO, &framed, d.len(), sectorsize as u32).unwrap();
                same(
                    &got,
                    &d,
                    &format!("sectorsize {sectorsize} len {}", d.len()),
                );
                // ram_bytes rounded up to the sector (as the last extent of a file is).
                let up = d.len().div_ceil(sectorsize) * sectorsize;
                let mut long = d.clone();
                long.resize(up, 0);
                same(
                    &decompress(COMPRESS_LZO, &framed, up, sectorsize as u32).unwrap(),
                    &long,
                    "lzo rounded up",
                );
                // A prefix that ends inside a segment.
                let cut = d.len() * 2 / 3 + 1;
                let got = decompress(COMPRESS_LZO, &framed, cut, sectorsize as u32).unwrap();
                same(&got, &d[..cut], "lzo prefix");
            }
        }
    }

    #[test]
    fn lzo_padding_rule_is_honoured() {
        // Make the first segment end 1..3 bytes before the sector boundary (k random bytes and
        // zeros compress to a little more than k), so the next header must move to the next
        // sector; a reader that ignored the rule would take padding for a length.
        let mut found = 0;
        for k in 3900..4096 {
            let mut d = Rng(k as u64).bytes(k);
            d.resize(4096, 0);
            d.extend(text(k as u64, 6000));
            let framed = lzo_frame(&d, 4096);
            let first = u32::from_le_bytes(framed[4..8].try_into().unwrap()) as usize;
            let end = 8 + first;
            if end < 4096 && 4096 - end < 4 {
                found += 1;
                assert!(framed[end..4096].iter().all(|&b| b == 0));
                let next = u32::from_le_bytes(framed[4096..4100].try_into().unwrap());
                assert!(next > 0 && next < 4096, "second header at the sector start");
                same(
                    &decompress(COMPRESS_LZO, &framed, d.len(), 4096).unwrap(),
                    &d,
                    "padded",
                );
            }
        }
        assert!(found > 0, "no case with padding generated");
    }

    #[test]
    fn lzo_framing_errors() {
        let d = text(5, 20_000);
        let framed = lzo_frame(&d, 4096);
        let total = u32::from_le_bytes(framed[..4].try_into().unwrap()) as usize;
        let n = d.len();

        assert_corrupt(
            decompress(COMPRESS_LZO, &framed[..3], n, 4096),
            "no length header",
        );
        assert_corrupt(decompress(COMPRESS_LZO, &framed, n, 0), "bad sector size 0");
        assert_corrupt(
            decompress(COMPRESS_LZO, &framed, n, 4095),
            "bad sector size 4095",
        );
        assert_corrupt(
            decompress(COMPRESS_LZO, &framed, n, 1 << 31),
            "bad sector size",
        );

        // Total length beyond the input, absurd, or smaller than its header.
        assert_corrupt(
            decompress(COMPRESS_LZO, &framed[..total - 1], n, 4096),
            "exceeds",
        );
        let mut f = framed.clone();
        f[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_corrupt(
            decompress(COMPRESS_LZO, &f, n, 4096),
            "total length 4294967295",
        );
        f[..4].copy_from_slice(&2u32.to_le_bytes());
        assert_corrupt(
            decompress(COMPRESS_LZO, &f, n, 4096),
            "less than its own header",
        );

        // Total length cutting the data short: a segment runs past it.
        let mut f = framed.clone();
        f[..4].copy_from_slice(&((total - 10) as u32).to_le_bytes());
        assert_corrupt(
            decompress(COMPRESS_LZO, &f, n, 4096),
            "runs past the total length",
        );

        // Absurd and crossing segment lengths.
        let mut f = framed.clone();
        f[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_corrupt(
            decompress(COMPRESS_LZO, &f, n, 4096),
            "has length 4294967295",
        );
        let mut f = framed.clone();
        f[4..8].copy_from_slice(&4000u32.to_le_bytes());
        f.truncate(1000);
        f[..4].copy_from_slice(&1000u32.to_le_bytes());
        assert_corrupt(
            decompress(COMPRESS_LZO, &f, n, 4096),
            "segment at 4 of 4000 bytes runs past",
        );

        // A segment that decompresses to more than a sector.
        let big = text(6, 8192);
        let c = lzokay_native::compress(&big).unwrap();
        let mut f = ((c.len() + 8) as u32).to_le_bytes().to_vec();
        f.extend_from_slice(&(c.len() as u32).to_le_bytes());
        f.extend_from_slice(&c);
        assert_corrupt(
            decompress(COMPRESS_LZO, &f, 8192, 4096),
            "more than 4096 bytes",
        );

        // A damaged stream inside a segment.
        let mut f = framed.clone();
        for b in &mut f[8..40] {
            *b = 0xff;
        }
        assert!(decompress(COMPRESS_LZO, &f, n, 4096).is_err());

        // Only a header and nothing else: zeros.
        let f = 4u32.to_le_bytes();
        assert_eq!(
            decompress(COMPRESS_LZO, &f, 100, 4096).unwrap(),
            vec![0u8; 100]
        );
    }

    #[test]
    fn other_codes_and_errors() {
        assert_eq!(
            decompress(COMPRESS_NONE, b"abc", 5, 4096).unwrap(),
            b"abc\0\0"
        );
        assert_eq!(
            decompress(COMPRESS_NONE, b"abcdef", 2, 4096).unwrap(),
            b"ab"
        );
        assert_corrupt(decompress(4, b"abc", 5, 4096), "unknown compression type 4");
        assert_corrupt(
            decompress(255, b"", 5, 4096),
            "unknown compression type 255",
        );
        // ram_bytes 0: nothing to do, whatever the input.
        for code in 0..4 {
            assert_eq!(decompress(code, b"", 0, 4096).unwrap(), Vec::<u8>::new());
        }

        let d = text(8, 10_000);
        let z = zlib(&d);
        assert_corrupt(
            decompress(COMPRESS_ZLIB, &z[..1], d.len(), 4096),
            "no header",
        );
        assert_corrupt(
            decompress(COMPRESS_ZLIB, &z[..z.len() / 2], d.len(), 4096),
            "truncated",
        );
        let mut bad = z.clone();
        bad[0] = 0x79;
        assert_corrupt(decompress(COMPRESS_ZLIB, &bad, d.len(), 4096), "CMF 0x79");
        let mut bad = z.clone();
        bad[1] ^= 1;
        assert_corrupt(
            decompress(COMPRESS_ZLIB, &bad, d.len(), 4096),
            "header check",
        );
        // Preset dictionary flag set (and a valid check).
        // FLG 0x3f: FDICT (0x20) set, FCHECK making 0x783f a multiple of 31.
        assert_eq!(0x783fu16 % 31, 0);
        let mut bad = vec![0x78u8, 0x3f];
        bad.extend_from_slice(&z[2..]);
        assert_corrupt(decompress(COMPRESS_ZLIB, &bad, d.len(), 4096), "dictionary");

        let s = zstd(&d);
        assert_corrupt(
            decompress(COMPRESS_ZSTD, &s[..s.len() / 2], d.len(), 4096),
            "truncated",
        );
        assert_corrupt(
            decompress(COMPRESS_ZSTD, b"not zstd at all", d.len(), 4096),
            "zstd",
        );
        // A frame with a window larger than btrfs allows.
        let big = text(9, 1 << 20);
        let mut enc = zstd::bulk::Compressor::new(3).unwrap();
        enc.set_parameter(zstd::zstd_safe::CParameter::WindowLog(20))
            .unwrap();
        enc.set_parameter(zstd::zstd_safe::CParameter::ContentSizeFlag(false))
            .unwrap();
        let c = enc.compress(&big).unwrap();
        assert_corrupt(decompress(COMPRESS_ZSTD, &c, big.len(), 4096), "zstd");
    }

    /// Random, truncated and bit-flipped inputs, and random lengths in the LZO framing: no
    /// panic, and the output is always exactly ram_bytes.
    #[test]
    fn fuzz_never_panics() {
        let mut r = Rng(0x5eed);
        let base = text(10, 40_000);
        let valid: Vec<(u8, Vec<u8>)> = vec![
            (COMPRESS_ZLIB, zlib(&base)),
            (COMPRESS_LZO, lzo_frame(&base, 4096)),
            (COMPRESS_ZSTD, zstd(&base)),
        ];
        let iters = std::env::var("BUTTER_FUZZ_ITERS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(3000usize);
        for i in 0..iters {
            let code = (i % 3) as u8 + 1;
            let input: Vec<u8> = match r.below(4) {
                0 => {
                    // Random bytes; for LZO a plausible total length and segment length.
                    let mut v = {
                        let n = r.below(9000);
                        r.bytes(n)
                    };
                    if code == COMPRESS_LZO && v.len() >= 8 && r.below(2) == 0 {
                        let tl = (r.below(v.len() + 8)) as u32;
                        v[..4].copy_from_slice(&tl.to_le_bytes());
                        let sl = r.below(5000) as u32;
                        v[4..8].copy_from_slice(&sl.to_le_bytes());
                    }
                    v
                }
                1 => {
                    let v = &valid[i % 3].1;
                    v[..r.below(v.len() + 1)].to_vec()
                }
                2 => {
                    let mut v = valid[i % 3].1.clone();
                    for _ in 0..1 + r.below(8) {
                        let p = r.below(v.len());
                        v[p] ^= 1 << r.below(8);
                    }
                    v
                }
                _ => {
                    // Overwrite a length field of the LZO framing with an extreme value.
                    let mut v = valid[1].1.clone();
                    let p = [0usize, 4][r.below(2)];
                    let val = [0u32, 1, 3, 4, 5, 4095, 4096, 4419, 4420, u32::MAX][r.below(10)];
                    v[p..p + 4].copy_from_slice(&val.to_le_bytes());
                    v
                }
            };
            let code = if r.below(8) == 0 {
                r.next() as u8
            } else {
                code
            };
            let ram = [0, 1, 4096, 40_000, 131_072][r.below(5)];
            let sector = [4096u32, 4096, 65536, 0, 3][r.below(5)];
            if let Ok(out) = decompress(code, &input, ram, sector) {
                assert_eq!(out.len(), ram);
            }
        }
    }

    #[test]
    fn fuzz_lzo1x_decoder() {
        let mut r = Rng(0xfeed);
        let c = lzokay_native::compress(&text(11, 4096)).unwrap();
        for _ in 0..20_000 {
            let input = if r.below(2) == 0 {
                {
                    let n = r.below(300);
                    r.bytes(n)
                }
            } else {
                let mut v = c.clone();
                for _ in 0..1 + r.below(4) {
                    let p = r.below(v.len());
                    v[p] = r.next() as u8;
                }
                v
            };
            let mut out = vec![0u8; 4096];
            if let Ok(n) = lzo1x_decode(&input, &mut out) {
                assert!(n <= 4096);
            }
        }
    }

    /// Number of places in btrfs-framed LZO data where 1..3 padding bytes precede a segment
    /// header at a sector start (walks the framing of valid data only).
    fn lzo_padding_count(framed: &[u8]) -> usize {
        let total = u32::from_le_bytes(framed[..4].try_into().unwrap()) as usize;
        let (mut pos, mut n) = (4, 0);
        while pos < total {
            let seg = u32::from_le_bytes(framed[pos..pos + 4].try_into().unwrap()) as usize;
            pos += 4 + seg;
            let left = 4096 - pos % 4096;
            if left < 4 {
                // The kernel counts padding after the last segment in the total length too.
                if pos + left < total {
                    n += 1;
                }
                pos += left;
            }
        }
        n
    }

    /// Parsed `btrfs inspect-internal dump-tree` output: enough to find file extents.
    mod dump {
        #[derive(Debug, Default, Clone)]
        pub(crate) struct Extent {
            pub ino: u64,
            pub file_offset: u64,
            pub leaf: u64,
            pub itemoff: usize,
            pub inline: bool,
            pub compression: u8,
            pub disk_bytenr: u64,
            pub disk_num_bytes: u64,
            pub offset: u64,
            pub num_bytes: u64,
            pub ram_bytes: u64,
            pub inline_size: usize,
        }

        fn num_after(line: &str, word: &str) -> Option<u64> {
            let i = line.find(word)?;
            line[i + word.len()..]
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        }

        /// Returns (inode -> name from INODE_REF, file extents).
        pub(crate) fn fs_tree(dump: &str) -> (Vec<(u64, String)>, Vec<Extent>) {
            let mut names = Vec::new();
            let mut extents: Vec<Extent> = Vec::new();
            let mut leaf = 0u64;
            let mut cur: Option<(u64, String, u64, usize)> = None;
            for line in dump.lines() {
                let t = line.trim();
                if let Some(rest) = t.strip_prefix("leaf ") {
                    if let Some(b) = rest.split_whitespace().next().and_then(|s| s.parse().ok()) {
                        leaf = b;
                    }
                    continue;
                }
                if t.starts_with("item ") {
                    cur = None;
                    let (Some(k0), Some(k1)) = (t.find("key ("), t.find(')')) else {
                        continue;
                    };
                    let key: Vec<&str> = t[k0 + 5..k1].split_whitespace().collect();
                    let itemoff = num_after(t, "itemoff ").unwrap_or(0) as usize;
                    if let (3, Ok(o), Ok(off)) = (key.len(), key[0].parse(), key[2].parse()) {
                        cur = Some((o, key[1].to_string(), off, itemoff));
                        if key[1] == "EXTENT_DATA" {
                            extents.push(Extent {
                                ino: o,
                                file_offset: off,
                                leaf,
                                itemoff,
                                ..Default::default()
                            });
                        }
                    }
                    continue;
                }
                let Some((ino, kind, _, _)) = &cur else {
                    continue;
                };
                if kind == "INODE_REF" {
                    if let Some(i) = t.find("name: ") {
                        names.push((*ino, t[i + 6..].to_string()));
                    }
                } else if kind == "EXTENT_DATA" {
                    let e = extents.last_mut().unwrap();
                    if t.contains("type 0 (inline)") {
                        e.inline = true;
                    }
                    if t.starts_with("inline extent data size") {
                        e.inline_size = num_after(t, "data size ").unwrap() as usize;
                        e.ram_bytes = num_after(t, "ram_bytes ").unwrap();
                        e.compression = num_after(t, "compression ").unwrap() as u8;
                    } else if t.starts_with("extent data disk byte") {
                        e.disk_bytenr = num_after(t, "disk byte ").unwrap();
                        e.disk_num_bytes = num_after(t, " nr ").unwrap();
                    } else if t.starts_with("extent data offset") {
                        e.offset = num_after(t, "offset ").unwrap();
                        e.num_bytes = num_after(t, " nr ").unwrap();
                        e.ram_bytes = num_after(t, " ram ").unwrap();
                    } else if t.starts_with("extent compression") {
                        e.compression = num_after(t, "compression ").unwrap() as u8;
                    }
                }
            }
            (names, extents)
        }

        /// Chunk tree: (logical start, length, physical offset of stripe 0).
        pub(crate) fn chunks(dump: &str) -> Vec<(u64, u64, u64)> {
            let mut v = Vec::new();
            let mut cur: Option<(u64, u64)> = None;
            for line in dump.lines() {
                let t = line.trim();
                if t.starts_with("item ") {
                    cur = None;
                    if let Some(i) = t.find("CHUNK_ITEM ") {
                        let start = t[i + 11..]
                            .split(')')
                            .next()
                            .and_then(|s| s.trim().parse().ok());
                        cur = start.map(|s| (s, 0));
                    }
                } else if let Some((start, len)) = cur.as_mut() {
                    if t.starts_with("length ") {
                        *len = num_after(t, "length ").unwrap();
                    } else if t.starts_with("stripe 0 ") {
                        v.push((*start, *len, num_after(t, " offset ").unwrap()));
                        cur = None;
                    }
                }
            }
            v
        }

        pub(crate) fn physical(chunks: &[(u64, u64, u64)], logical: u64) -> u64 {
            for &(start, len, phys) in chunks {
                if logical >= start && logical < start + len {
                    return phys + (logical - start);
                }
            }
            panic!("logical {logical} in no chunk");
        }
    }

    /// The kernel writes files with compress-force=lzo, zlib and zstd (large files in several
    /// 128 KiB extents, and small files as compressed inline extents); we read the raw extents
    /// from the image and decompress them.
    #[test]
    fn decompresses_kernel_written_extents() {
        use super::oracle;
        use std::os::unix::fs::FileExt;
        if !oracle::loop_mount_available() {
            return;
        }
        let scratch = oracle::Scratch::new("compress");
        let img = scratch.image("compress.img", 300 << 20);
        oracle::mkfs(&img, &[]);

        let mut r = Rng(1234);
        let mut files: Vec<(String, Vec<u8>)> = Vec::new();
        {
            let m = scratch.mount(&img, &["compress-force=lzo"]);
            for (i, algo) in ["lzo", "zlib", "zstd"].iter().enumerate() {
                if i > 0 {
                    m.remount(&format!("compress-force={algo}"));
                }
                let mut mixed = text(r.next(), 150_000);
                mixed.extend(r.bytes(5000));
                mixed.extend(text(r.next(), 200_001));
                // For LZO also a larger file, so that the kernel's framing pads some sectors.
                let huge = if *algo == "lzo" { 8 << 20 } else { 0 };
                let mut m2 = Vec::new();
                while m2.len() < huge {
                    m2.extend(text(r.next(), 3000 + r.below(3000)));
                    let n = r.below(1500);
                    m2.extend(r.bytes(n));
                }
                let contents = [
                    (format!("{algo}-huge"), m2),
                    (format!("{algo}-big"), mixed),
                    (format!("{algo}-small"), text(r.next(), 3000)),
                    (format!("{algo}-tiny"), b"x".to_vec()),
                ];
                for (name, data) in contents {
                    let p = m.path().join(&name);
                    let mut f = std::fs::File::create(&p).unwrap();
                    f.write_all(&data).unwrap();
                    // Compression happens at writeback: flush before the next remount.
                    f.sync_all().unwrap();
                    files.push((name, data));
                }
            }
            m.unmount();
        }

        let img_s = img.to_str().unwrap();
        let fs_dump = oracle::run(
            "btrfs",
            &["inspect-internal", "dump-tree", "-t", "fs", img_s],
        );
        let chunk_dump = oracle::run(
            "btrfs",
            &["inspect-internal", "dump-tree", "-t", "chunk", img_s],
        );
        let (names, extents) = dump::fs_tree(&fs_dump);
        let chunks = dump::chunks(&chunk_dump);
        let image = std::fs::File::open(&img).unwrap();
        let read_at = |phys: u64, len: usize| {
            let mut b = vec![0u8; len];
            image.read_exact_at(&mut b, phys).unwrap();
            b
        };

        let mut seen = [0usize; 4];
        let mut lzo_padded = 0;
        let mut inline_seen = [0usize; 4];
        for (name, data) in &files {
            let ino = names
                .iter()
                .find(|(_, n)| n == name)
                .expect("inode of file")
                .0;
            let want_code = match &name[..name.find('-').unwrap()] {
                "lzo" => COMPRESS_LZO,
                "zlib" => COMPRESS_ZLIB,
                _ => COMPRESS_ZSTD,
            };
            let mut covered = 0u64;
            for e in extents.iter().filter(|e| e.ino == ino) {
                // Even with compress-force, an extent (a 1-byte file, a random tail) is stored
                // plain when compression does not make it smaller.
                let plain = e.compression == COMPRESS_NONE;
                assert!(e.compression == want_code || plain, "{name}: {e:?}");
                let (raw, len) = if e.inline {
                    // Inline data follows the 21-byte head of the file extent item, inside
                    // the leaf (101-byte header; item offsets count from its end).
                    let leaf = read_at(dump::physical(&chunks, e.leaf), 16384);
                    let at = 101 + e.itemoff + 21;
                    inline_seen[e.compression as usize] += 1;
                    (leaf[at..at + e.inline_size].to_vec(), e.ram_bytes)
                } else {
                    let phys = dump::physical(&chunks, e.disk_bytenr);
                    (read_at(phys, e.disk_num_bytes as usize), e.ram_bytes)
                };
                let out = decompress(e.compression, &raw, len as usize, 4096)
                    .unwrap_or_else(|err| panic!("{name} extent at {}: {err}", e.file_offset));
                assert_eq!(out.len() as u64, len);
                let (start, n) = if e.inline {
                    (0, len)
                } else {
                    (e.offset, e.num_bytes)
                };
                let fo = e.file_offset as usize;
                let view = &out[start as usize..(start + n) as usize];
                let end = (fo + view.len()).min(data.len());
                same(
                    &view[..end - fo],
                    &data[fo..end],
                    &format!("{name} extent at {fo}"),
                );
                assert!(
                    view[end - fo..].iter().all(|&b| b == 0),
                    "{name}: tail beyond EOF"
                );
                covered += n;
                if !e.inline {
                    seen[e.compression as usize] += 1;
                }
                if e.compression == COMPRESS_LZO {
                    lzo_padded += lzo_padding_count(&raw);
                }
            }
            assert!(
                covered >= data.len() as u64,
                "{name}: extents cover {covered} bytes"
            );
        }
        eprintln!("kernel LZO extents: {lzo_padded} segment headers moved past sector padding");
        for code in [COMPRESS_ZLIB, COMPRESS_LZO, COMPRESS_ZSTD] {
            let c = code as usize;
            assert!(
                seen[c] >= 3,
                "{} extents of {}",
                seen[c],
                compression_name(code)
            );
            assert!(
                inline_seen[c] >= 1,
                "no inline {} extent",
                compression_name(code)
            );
        }
    }
}
