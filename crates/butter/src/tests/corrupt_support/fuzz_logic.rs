//! The bodies of the two fuzz targets, shared by `fuzz/fuzz_targets/*.rs` (libFuzzer, through
//! `butter::fuzz` under the `fuzzing` feature) and by the `fuzz_regress` suite (corpus replay
//! plus seeded mutations in the normal test run). Depends on `butter`, std and the sibling
//! `walk.rs` only.
//!
//! `tree_block` input: byte 0 holds control bits, the rest is one tree block (zero-padded to
//! 4 KiB, 16 KiB or 64 KiB by length). Unless bit 0 is set the checksum is recomputed, so the
//! fuzzer reaches the structural checks instead of stopping at the checksum; bits 1..5 choose
//! which parent expectations (level, generation, first key, owner) are passed; bit 7 also
//! passes the unpadded bytes with their own length as the node size. A block that
//! validates is then read through every accessor of `TreeBlock` and every item body is fed to
//! every item decoder. The same bytes also go to `Superblock::parse` and the sys_chunk_array
//! decoder with the chunk map lookups.
//!
//! `open_image` input: a sparse image. `u32 le` device length (clamped to [`MAX_DEVICE`]), then
//! records `u32 le byte offset, u16 le length, bytes`; a record that runs past the device end
//! is clipped, a short tail is ignored. The image is opened with `Fs::open_device(RamDevice)`
//! and walked with [`super::walk::walk_tolerant`] under [`FUZZ_LIMITS`].

#![allow(dead_code)]

use super::walk::{walk_tolerant, Walk, WalkError, WalkLimits};
use butter::format::csum::CsumType;
use butter::format::header::Header;
use butter::format::items::*;
use butter::format::superblock::{DevItem, Superblock};
use butter::format::*;
use butter::fs::Fs;
use butter::internals::RamDevice;
use butter::io::disk_io::{check_tree_block, Expect, TreeBlock};
use butter::io::volumes::ChunkMap;
use std::sync::Arc;

/// Largest device an `open_image` input may ask for (keeps each run fast).
pub(crate) const MAX_DEVICE: usize = 32 << 20;

/// Walk bounds for fuzzing: small reads so a damaged huge file size stays cheap.
pub(crate) const FUZZ_LIMITS: WalkLimits = WalkLimits {
    chunk: 16 * 1024,
    max_file_bytes: 256 * 1024,
    max_entries: 20_000,
    readdir_page: 16,
};

fn csum_type_of(b: &[u8], off: usize) -> Option<CsumType> {
    let raw = b.get(off..off + 2)?;
    CsumType::from_disk(u16::from_le_bytes([raw[0], raw[1]]))
}

/// One `tree_block` run. Never panics unless the engine does.
pub(crate) fn tree_block_one(data: &[u8]) {
    let Some((&ctl, body)) = data.split_first() else {
        return;
    };
    let nodesize: usize = if body.len() <= 4096 {
        4096
    } else if body.len() <= 16384 {
        16384
    } else {
        65536
    };
    let mut blk = vec![0u8; nodesize];
    let n = body.len().min(nodesize);
    blk[..n].copy_from_slice(&body[..n]);
    let csum_type = CsumType::Crc32c;
    if ctl & 1 == 0 {
        let c = csum_type.compute(&blk[CSUM_SIZE..]);
        blk[..csum_type.size()].copy_from_slice(&c[..csum_type.size()]);
    }
    let h = Header::parse(&blk);
    let first_key = (blk.len() >= HEADER_SIZE + DISK_KEY_SIZE)
        .then(|| Key::from_bytes(&blk[HEADER_SIZE..HEADER_SIZE + DISK_KEY_SIZE]));
    let expect = Expect {
        level: (ctl & 2 != 0).then_some(h.level),
        generation: (ctl & 4 != 0).then_some(h.generation),
        first_key: if ctl & 8 != 0 { first_key } else { None },
        owner: (ctl & 16 != 0).then_some(h.owner),
    };
    let bytenr = if ctl & 32 != 0 {
        h.bytenr.wrapping_add(4096)
    } else {
        h.bytenr
    };
    if ctl & 128 != 0 {
        // Any length, including ones shorter than a header.
        let n = body.len().min(65536) as u32;
        let _ = check_tree_block(&body[..n as usize], bytenr, n, csum_type, &h.fsid, &expect);
    }
    let r = check_tree_block(&blk, bytenr, nodesize as u32, csum_type, &h.fsid, &expect);
    match r {
        Ok(header) => {
            let b = TreeBlock {
                bytenr,
                header,
                data: blk.clone().into_boxed_slice(),
            };
            read_block(&b);
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }

    // The same bytes as a superblock and as a sys_chunk_array.
    let mut sb = vec![0u8; SUPER_INFO_SIZE];
    let n = body.len().min(SUPER_INFO_SIZE);
    sb[..n].copy_from_slice(&body[..n]);
    if ctl & 1 == 0 {
        if let Some(ct) = csum_type_of(&sb, 196) {
            let c = ct.compute(&sb[CSUM_SIZE..]);
            sb[..ct.size()].copy_from_slice(&c[..ct.size()]);
        }
    }
    let off = if ctl & 64 != 0 {
        65536
    } else {
        le_u64(&sb, 48)
    };
    if let Ok(s) = Superblock::parse(&sb, off) {
        let _ = s.metadata_fsid();
        exercise_chunk_map(&s.sys_chunk_array, body);
    }
    exercise_chunk_map(&body[..body.len().min(SYSTEM_CHUNK_ARRAY_SIZE)], body);
}

fn exercise_chunk_map(arr: &[u8], probes: &[u8]) {
    match ChunkMap::from_sys_chunk_array(arr) {
        Ok(map) => {
            let mut logicals: Vec<u64> = map.chunks().map(|c| c.logical).collect();
            for c in map.chunks() {
                logicals.push(c.logical.wrapping_add(c.item.length).wrapping_sub(1));
                logicals.push(c.logical.wrapping_add(c.item.length / 2));
            }
            for w in probes.as_chunks::<8>().0.iter().take(8) {
                logicals.push(le_u64(w, 0));
            }
            for l in logicals {
                let _ = map.lookup(l);
                for len in [1u64, 4096, 16384, u64::MAX / 2] {
                    if let Err(e) = map.map(l, len) {
                        let _ = e.to_string();
                    }
                }
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// Reads every part of a validated block through the accessors and decoders.
pub(crate) fn read_block(b: &TreeBlock) {
    let _ = b.loc(None).to_string();
    for slot in 0..b.nritems() {
        let key = b.key(slot);
        let _ = b.loc(Some(slot)).to_string();
        if b.is_leaf() {
            let _ = b.item(slot);
            let body = b.item_data(slot);
            decode_all(key, body);
        } else {
            let _ = b.ptr(slot);
        }
    }
    let _ = b.loc(Some(b.nritems())).to_string();
    if b.is_leaf() {
        let _ = b.leaf_free_space();
    }
}

/// Feeds an item body to every decoder (the one its key type names and all the others).
pub(crate) fn decode_all(key: Key, body: &[u8]) {
    fn show<T: std::fmt::Debug>(r: butter::Result<T>) {
        match r {
            Ok(v) => {
                let _ = format!("{v:?}");
            }
            Err(e) => {
                let _ = e.to_string();
            }
        }
    }
    show(InodeItem::parse(body));
    show(DirItem::parse_all(body));
    show(InodeRef::parse_all(body));
    show(InodeExtref::parse_all(body));
    show(FileExtentItem::parse(body));
    show(RootItem::parse(body));
    show(RootRef::parse(body));
    show(ChunkItem::parse(body));
    show(BlockGroupItem::parse(body));
    show(DevExtent::parse(body));
    show(FreeSpaceInfo::parse(body));
    show(ExtentItem::parse(body, key.ty));
    show(ExtentItem::parse(body, EXTENT_ITEM_KEY));
    show(ExtentItem::parse(body, METADATA_ITEM_KEY));
    show(parse_extent_data_ref(body));
    show(DevItem::parse(body));
    let _ = key.to_string();
    let _ = key.successor();
    let _ = ft_to_mode(body.first().copied().unwrap_or(0));
}

/// Decodes an `open_image` input into image bytes.
pub(crate) fn decode_sparse(data: &[u8]) -> Vec<u8> {
    if data.len() < 4 {
        return Vec::new();
    }
    let len = (u32::from_le_bytes([data[0], data[1], data[2], data[3]]) as usize).min(MAX_DEVICE);
    let mut img = vec![0u8; len];
    let mut p = 4;
    while p + 6 <= data.len() {
        let off = u32::from_le_bytes([data[p], data[p + 1], data[p + 2], data[p + 3]]) as usize;
        let n = u16::from_le_bytes([data[p + 4], data[p + 5]]) as usize;
        p += 6;
        let n = n.min(data.len() - p);
        let src = &data[p..p + n];
        p += n;
        if off < len {
            let m = n.min(len - off);
            img[off..off + m].copy_from_slice(&src[..m]);
        }
    }
    img
}

/// Encodes image bytes as an `open_image` input: non-zero runs (zero gaps shorter than 64
/// bytes are kept inside a run) as records of at most 65535 bytes.
pub(crate) fn encode_sparse(img: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(img.len() as u32).to_le_bytes());
    let mut i = 0;
    while i < img.len() {
        if img[i] == 0 {
            i += 1;
            continue;
        }
        let start = i;
        let mut end = i;
        let mut zeros = 0;
        while i < img.len() && i - start < 65535 {
            if img[i] == 0 {
                zeros += 1;
                if zeros >= 64 {
                    break;
                }
            } else {
                zeros = 0;
                end = i + 1;
            }
            i += 1;
        }
        out.extend_from_slice(&(start as u32).to_le_bytes());
        out.extend_from_slice(&((end - start) as u16).to_le_bytes());
        out.extend_from_slice(&img[start..end]);
        i = end;
    }
    out
}

/// Opens an image on a RAM device and walks it. `Err` when it does not open.
pub(crate) fn open_and_walk(
    dev: Arc<RamDevice>,
    lim: &WalkLimits,
) -> butter::Result<(Walk, Vec<WalkError>)> {
    let fs = Fs::open_device(dev)?;
    // Every chunk the image declares must map without trouble.
    {
        let map = fs.disk().chunk_map();
        for c in map.chunks() {
            if let Err(e) = map.map(c.logical, fs.disk().nodesize() as u64) {
                let _ = e.to_string();
            }
        }
    }
    Ok(walk_tolerant(&fs, lim))
}

/// One `open_image` run. Never panics unless the engine does.
pub(crate) fn open_image_one(data: &[u8]) {
    let img = decode_sparse(data);
    let dev = Arc::new(RamDevice::new(img));
    match open_and_walk(dev, &FUZZ_LIMITS) {
        Ok((_, errors)) => {
            for e in errors {
                let _ = e.to_string();
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
}

/// A fresh 128 MiB image (mkfs defaults, fixed uuid and time) every `receive_stream` run
/// starts from; made once.
fn receive_template() -> Vec<u8> {
    static TEMPLATE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    TEMPLATE
        .get_or_init(|| {
            let dev = RamDevice::new(vec![0u8; 128 << 20]);
            let opts = butter::mkfs::MkfsOptions {
                size: 128 << 20,
                fsid: Some([7; 16]),
                time: Some(1_700_000_000),
                ..Default::default()
            };
            if let Err(e) = butter::mkfs::mkfs(&dev, &opts) {
                panic!("mkfs of the receive template: {e}");
            }
            dev.durable_bytes()
        })
        .clone()
}

/// One `receive_stream` run: the bytes as a send stream, printed as `--dump` prints it, then
/// received (no error limit) into the root of a fresh image on a RAM device. Whatever the
/// stream holds, the image must check clean afterwards; panics when it does not (or when the
/// engine panics).
pub(crate) fn receive_stream_one(data: &[u8]) {
    let _ = butter::format::send_stream::dump(data, &mut std::io::sink(), &|s| s.to_string());
    let dev = Arc::new(RamDevice::new(receive_template()));
    let fs = match Fs::open_device_rw(dev.clone()) {
        Ok(fs) => fs,
        Err(e) => panic!("the fresh image does not open: {e}"),
    };
    let root = match fs.subvol_root_inode(FS_TREE_OBJECTID) {
        Ok(r) => r,
        Err(e) => panic!("the fresh image has no root: {e}"),
    };
    let opts = butter::receive::ReceiveOptions {
        stop_at_end: false,
        max_errors: 0,
    };
    let report = butter::receive::receive(&fs, root, data, &opts, &mut |_| {});
    let _ = report.stopped.map(|e| e.to_string());
    let closed = fs.close();
    drop(fs);
    if let Err(e) = closed {
        panic!("closing after receive: {e}");
    }
    let fs = match Fs::open_device(dev) {
        Ok(fs) => fs,
        Err(e) => panic!("the image does not open after receive: {e}"),
    };
    match fs.check(Default::default(), &mut |_| {}) {
        Ok(r) if r.is_clean() => {}
        Ok(r) => panic!("the image is not clean after receive: {:?}", r.findings),
        Err(e) => panic!("the check after receive failed: {e}"),
    }
}
