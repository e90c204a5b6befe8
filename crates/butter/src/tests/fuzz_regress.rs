//! The fuzz targets' bounded run in the normal test suite: replay every committed corpus
//! entry (`fuzz/corpus/{tree_block,open_image}`) and a few thousand seeded mutations of it
//! through the same code the libFuzzer targets run (`corrupt_support/fuzz_logic.rs`, which
//! `butter::fuzz` exposes to them).
//!
//! Each input runs in a worker thread watched for hangs, with panics caught and the worker's
//! largest allocation measured. Needs no root and no tools: the corpus is committed. Scale the
//! mutation count with `BUTTER_FUZZ_ITERS` (default 10000 tree blocks, 1000 images) or
//! `BUTTER_FUZZ_ITERS_SCALE` (a factor on both); a failing
//! mutated image is written under `target/fuzz_regress/` in the `open_image` input format so
//! `cargo fuzz run open_image <file>` reproduces it.
//!
//! `make_seed_corpus` (ignored; needs mkfs.btrfs) regenerates the seed files: three fresh
//! mkfs.btrfs images populated with `--rootdir` (mixed block groups on 16 MiB; 4 KiB and
//! 16 KiB nodes on 110 MiB with single metadata), cut after their last used byte, and the tree
//! blocks and superblock of each as `tree_block` inputs. The committed corpus is those seeds
//! plus what `cargo fuzz run` found, minimized with `cargo fuzz cmin`.

use super::corrupt_support;

use butter::format::csum::CsumType;
use butter::internals::RamDevice;
use corrupt_support::alloc_track;
use corrupt_support::fuzz_logic::*;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest single allocation one input may cause (beyond the image buffers it is given).
const MAX_SINGLE_ALLOC: usize = 2 << 20;
/// One input taking longer than this is a hang.
const PER_INPUT: Duration = Duration::from_secs(20);

fn corpus_dir(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/corpus")
        .join(target)
}

fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = corpus_dir(target);
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    files
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&p).unwrap())
        })
        .collect()
}

fn iters(default: usize) -> usize {
    let f: f64 = std::env::var("BUTTER_FUZZ_ITERS_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1.0);
    match std::env::var("BUTTER_FUZZ_ITERS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(n) => n,
        None => (default as f64 * f) as usize,
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const INTERESTING: [u64; 14] = [
    0,
    1,
    2,
    7,
    8,
    0x7f,
    0xff,
    4095,
    4096,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    i64::MAX as u64,
    u64::MAX,
];

type Job = Box<dyn FnOnce() -> Result<(), String> + Send>;

/// Runs the jobs in order on a worker thread; returns one line per failed job. A job running
/// longer than [`PER_INPUT`] ends the run with a HANG failure.
fn run_jobs(jobs: Vec<(String, Job)>) -> Vec<String> {
    let names: Vec<String> = jobs.iter().map(|(n, _)| n.clone()).collect();
    let state = Arc::new(Mutex::new((0usize, Instant::now(), false)));
    let failures = Arc::new(Mutex::new(Vec::new()));
    let (st, fl) = (state.clone(), failures.clone());
    std::thread::Builder::new()
        .name("fuzz-regress".into())
        .spawn(move || {
            for (i, (name, job)) in jobs.into_iter().enumerate() {
                *st.lock().unwrap() = (i, Instant::now(), false);
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                let fail = match r {
                    Ok(Ok(())) => None,
                    Ok(Err(m)) => Some(m),
                    Err(p) => Some(format!(
                        "PANIC: {}",
                        p.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_default()
                    )),
                };
                if let Some(m) = fail {
                    eprintln!("FAIL {name}: {m}");
                    fl.lock().unwrap().push(format!("{name}: {m}"));
                }
            }
            st.lock().unwrap().2 = true;
        })
        .unwrap();
    loop {
        std::thread::sleep(Duration::from_millis(20));
        let (i, t, done) = *state.lock().unwrap();
        if done {
            break;
        }
        if t.elapsed() > PER_INPUT {
            let mut f = failures.lock().unwrap().clone();
            f.push(format!(
                "{}: HANG: still running after {PER_INPUT:?}",
                names[i]
            ));
            return f;
        }
    }
    let f = failures.lock().unwrap().clone();
    f
}

fn check_alloc(r: alloc_track::AllocReport) -> Result<(), String> {
    if r.max_single > MAX_SINGLE_ALLOC {
        return Err(format!(
            "MEMORY: single allocation of {} bytes",
            r.max_single
        ));
    }
    Ok(())
}

fn tree_block_job(data: Vec<u8>) -> Job {
    Box::new(move || {
        alloc_track::arm();
        tree_block_one(&data);
        check_alloc(alloc_track::disarm())
    })
}

/// Opens and walks `img`; on failure also saves it (open_image input format) for replay.
fn image_job(name: String, img: Vec<u8>) -> Job {
    Box::new(move || {
        let dev = Arc::new(RamDevice::new(img));
        alloc_track::arm();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            match open_and_walk(dev.clone(), &FUZZ_LIMITS) {
                Ok((_, errors)) => {
                    for e in errors {
                        let _ = e.to_string();
                    }
                }
                Err(e) => {
                    let _ = e.to_string();
                }
            }
        }));
        let a = alloc_track::disarm();
        let r = match r {
            Ok(()) => check_alloc(a),
            Err(p) => Err(format!(
                "PANIC: {}",
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default()
            )),
        };
        if r.is_err() {
            let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/fuzz_regress");
            let _ = std::fs::create_dir_all(&dir);
            let file = dir.join(name.replace(['/', ' ', ':'], "_"));
            let _ = std::fs::write(&file, encode_sparse(&dev.live_bytes()));
            return r.map_err(|m| format!("{m} (input saved to {})", file.display()));
        }
        r
    })
}

fn finish(what: &str, n: usize, failures: Vec<String>) {
    assert!(
        failures.is_empty(),
        "{what}: {} of {n} inputs failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

/// Blocks of every length up to a header and a bit, passed with their own length as the node
/// size (check_tree_block is public: it must not assume the caller validated the node size).
#[test]
fn tree_block_short_lengths() {
    let jobs: Vec<(String, Job)> = (0..=HEADER_LEN + 40)
        .map(|n| {
            let mut d = vec![0x80u8];
            d.extend(std::iter::repeat_n(0x11u8, n));
            (format!("tree_block of {n} bytes"), tree_block_job(d))
        })
        .collect();
    let n = jobs.len();
    finish("short tree blocks", n, run_jobs(jobs));
}

const HEADER_LEN: usize = butter::format::HEADER_SIZE;

#[test]
fn replay_tree_block_corpus() {
    let jobs: Vec<(String, Job)> = corpus("tree_block")
        .into_iter()
        .map(|(n, d)| (format!("tree_block/{n}"), tree_block_job(d)))
        .collect();
    let n = jobs.len();
    finish("tree_block corpus", n, run_jobs(jobs));
}

#[test]
fn replay_open_image_corpus() {
    let jobs: Vec<(String, Job)> = corpus("open_image")
        .into_iter()
        .map(|(n, d)| {
            let name = format!("open_image/{n}");
            (name.clone(), image_job(name, decode_sparse(&d)))
        })
        .collect();
    let n = jobs.len();
    finish("open_image corpus", n, run_jobs(jobs));
}

/// Damages bytes of `buf` in `[lo, hi)`: a bit, a byte, or an interesting 16/32/64-bit value.
fn poke(buf: &mut [u8], lo: usize, hi: usize, rng: &mut Rng) -> String {
    if hi <= lo || buf.is_empty() {
        return "nothing".into();
    }
    let at = lo + rng.below(hi - lo);
    let v = INTERESTING[rng.below(INTERESTING.len())];
    match rng.below(5) {
        0 => {
            let bit = 1u8 << rng.below(8);
            buf[at] ^= bit;
            format!("bit {bit:#x}@{at}")
        }
        1 => {
            let b = rng.below(256) as u8;
            buf[at] = b;
            format!("byte {b:#x}@{at}")
        }
        k => {
            let w = [2usize, 4, 8][k - 2];
            let at = at.min(buf.len().saturating_sub(w));
            let end = (at + w).min(buf.len());
            buf[at..end].copy_from_slice(&v.to_le_bytes()[..end - at]);
            format!("u{} {v:#x}@{at}", w * 8)
        }
    }
}

#[test]
fn mutations_tree_block() {
    let seeds = corpus("tree_block");
    let n = iters(10_000);
    let mut rng = Rng(0x7ee_b10c);
    let mut jobs: Vec<(String, Job)> = Vec::new();
    for i in 0..n {
        let (sname, seed) = &seeds[rng.below(seeds.len())];
        let mut d = seed.clone();
        let mut what = Vec::new();
        if rng.below(4) == 0 && !d.is_empty() {
            d[0] = rng.below(256) as u8;
            what.push(format!("ctl {:#x}", d[0]));
        }
        for _ in 0..1 + rng.below(3) {
            // Mostly the header and the item/pointer array.
            let hi = if rng.below(3) == 0 {
                d.len()
            } else {
                d.len().min(1 + 101 + 25 * 24)
            };
            what.push(poke(&mut d, 1, hi, &mut rng));
        }
        let name = format!("tree_block #{i} from {sname}: {}", what.join(", "));
        jobs.push((name, tree_block_job(d)));
    }
    finish("tree_block mutations", n, run_jobs(jobs));
}

/// Non-zero 4 KiB pages of an image.
fn hot_pages(img: &[u8]) -> Vec<usize> {
    img.chunks(4096)
        .enumerate()
        .filter(|(_, c)| c.iter().any(|&b| b != 0))
        .map(|(i, _)| i * 4096)
        .collect()
}

#[test]
fn mutations_open_image() {
    let seeds: Vec<(String, Arc<Vec<u8>>)> = corpus("open_image")
        .into_iter()
        .filter(|(n, _)| n.starts_with("seed-"))
        .map(|(n, d)| (n, Arc::new(decode_sparse(&d))))
        .collect();
    assert!(!seeds.is_empty(), "the open_image corpus has seed-* files");
    let n = iters(1000);
    let mut rng = Rng(0x1_3a9e);
    let mut jobs: Vec<(String, Job)> = Vec::new();
    for i in 0..n {
        let (sname, seed) = &seeds[rng.below(seeds.len())];
        let seed = seed.clone();
        let job_seed = rng.next();
        let name = format!("open_image #{i} from {sname} (rng {job_seed:#x})");
        let nm = name.clone();
        jobs.push((
            name,
            Box::new(move || {
                let (img, what) = mutate_image(&seed, job_seed);
                image_job(format!("{nm}: {what}"), img)().map_err(|m| format!("{what}: {m}"))
            }),
        ));
    }
    finish("open_image mutations", n, run_jobs(jobs));
}

/// A damaged copy of a seed image: 1-3 pokes into non-zero pages (mostly near the start of a
/// block, where headers and item records are), sometimes a page copied over another or
/// zeroed, sometimes a truncation; then usually the touched blocks' checksums recomputed so the
/// damage reaches validation.
fn mutate_image(seed: &[u8], job_seed: u64) -> (Vec<u8>, String) {
    let mut rng = Rng(job_seed);
    let mut img = seed.to_vec();
    let hot = hot_pages(&img);
    let nodesize = if img.len() >= 65536 + 4096 {
        u32::from_le_bytes(img[65536 + 148..65536 + 152].try_into().unwrap()) as usize
    } else {
        4096
    };
    let nodesize = if nodesize.is_power_of_two() && (4096..=65536).contains(&nodesize) {
        nodesize
    } else {
        4096
    };
    let mut what = Vec::new();
    let mut touched = Vec::new();
    for _ in 0..1 + rng.below(3) {
        let page = hot[rng.below(hot.len())];
        match rng.below(12) {
            0 => {
                let from = hot[rng.below(hot.len())];
                let src = img[from..from + 4096].to_vec();
                img[page..page + 4096].copy_from_slice(&src);
                what.push(format!("page {from} copied to {page}"));
            }
            1 => {
                img[page..page + 4096].fill(0);
                what.push(format!("page {page} zeroed"));
            }
            k => {
                let span = if k < 8 { 512 } else { 4096 };
                what.push(poke(&mut img, page, page + span, &mut rng));
            }
        }
        touched.push(page);
    }
    if rng.below(4) != 0 {
        for p in touched {
            // The superblock and 4 KiB nodes are sealed over [32, 4096) of their page; larger
            // nodes over [32, nodesize) from their aligned start.
            let (start, len) = if p == 65536 {
                (p, 4096)
            } else {
                (p / nodesize * nodesize, nodesize)
            };
            if start + len <= img.len() {
                let ct = CsumType::Crc32c;
                let c = ct.compute(&img[start + 32..start + len]);
                img[start..start + ct.size()].copy_from_slice(&c[..ct.size()]);
            }
        }
        what.push("resealed".into());
    }
    if rng.below(16) == 0 {
        let len = rng.below(img.len());
        img.truncate(len);
        what.push(format!("truncated to {len}"));
    }
    (img, what.join(", "))
}

// ---------------------------------------------------------------------------------------------
// Seed corpus generation (run by hand: cargo test -p butter --release --lib
// tests::fuzz_regress::make_seed_corpus -- --ignored).

/// File data mostly zeros (64 pattern bytes per 4 KiB sector), so the sparse encoding of
/// the images stays small while every sector still has its own checksum.
fn sparse_data(seed: u64, len: usize) -> Vec<u8> {
    use corrupt_support::image::pattern;
    let mut v = vec![0u8; len];
    for (i, chunk) in v.chunks_mut(4096).enumerate() {
        let n = chunk.len().min(64);
        chunk[..n].copy_from_slice(&pattern(seed + i as u64, n));
    }
    v
}

fn populate_seed_tree(root: &Path) {
    use corrupt_support::image::{pattern, set_xattr};
    std::fs::create_dir_all(root.join("d/e")).unwrap();
    std::fs::write(root.join("inline"), b"small inline file\n").unwrap();
    std::fs::write(root.join("d/10k"), sparse_data(1, 10_000)).unwrap();
    std::fs::write(root.join("d/e/40k"), sparse_data(2, 40_000)).unwrap();
    std::fs::write(root.join("empty"), b"").unwrap();
    for i in 0..12 {
        std::fs::write(
            root.join(format!("d/f{i}")),
            pattern(10 + i, 20 * i as usize),
        )
        .unwrap();
    }
    std::os::unix::fs::symlink("d/10k", root.join("link")).unwrap();
    std::fs::hard_link(root.join("d/10k"), root.join("hard")).unwrap();
    set_xattr(&root.join("inline"), "user.a", b"value a");
    set_xattr(&root.join("d"), "user.dir", &pattern(3, 100));
}

#[test]
#[ignore]
fn make_seed_corpus() {
    use corrupt_support::image::{have_mkfs, run, Scratch};
    use corrupt_support::locate::map_image;
    if !have_mkfs() {
        return;
    }
    let s = Scratch::new("fuzz-seeds");
    let src = s.0.join("src");
    populate_seed_tree(&src);
    let out_img = corpus_dir("open_image");
    let out_blk = corpus_dir("tree_block");
    std::fs::create_dir_all(&out_img).unwrap();
    std::fs::create_dir_all(&out_blk).unwrap();
    let variants: [(&str, u64, &[&str]); 3] = [
        ("mixed-4k", 16 << 20, &["-M", "-n", "4096"]),
        ("single-4k", 110 << 20, &["-m", "single", "-n", "4096"]),
        ("single-16k", 110 << 20, &["-m", "single"]),
    ];
    for (name, size, opts) in variants {
        let img = s.0.join(format!("{name}.img"));
        std::fs::File::create(&img).unwrap().set_len(size).unwrap();
        let mut args = vec!["-f", "-q", "--rootdir", src.to_str().unwrap()];
        args.extend_from_slice(opts);
        args.push(img.to_str().unwrap());
        run("mkfs.btrfs", &args);
        let bytes = std::fs::read(&img).unwrap();
        let m = map_image(&bytes);
        // Cut after the last byte any structure uses (the 64 MiB superblock mirror aside).
        let end = m
            .blocks
            .values()
            .flat_map(|b| b.copies.iter().map(|c| c + m.nodesize as u64))
            .chain(
                m.data
                    .iter()
                    .flat_map(|d| d.copies.iter().map(move |c| c + d.disk_num_bytes)),
            )
            .max()
            .unwrap() as usize;
        let cut = &bytes[..end.max(65536 + 4096)];
        assert!(cut.len() <= MAX_DEVICE, "{name}: {} bytes", cut.len());
        std::fs::write(out_img.join(format!("seed-{name}")), encode_sparse(cut)).unwrap();
        for b in m.blocks.values() {
            let p = b.copies[0] as usize;
            let mut d = vec![0u8];
            d.extend_from_slice(&bytes[p..p + m.nodesize]);
            let tree = butter::format::tree_name(b.tree).replace(' ', "");
            let f = format!("seed-{name}-{tree}-l{}-{}", b.level, b.bytenr);
            std::fs::write(out_blk.join(f), d).unwrap();
        }
        let mut d = vec![64u8];
        d.extend_from_slice(&bytes[65536..65536 + 4096]);
        std::fs::write(out_blk.join(format!("seed-{name}-superblock")), d).unwrap();
        eprintln!(
            "{name}: image cut at {} bytes, {} tree blocks",
            cut.len(),
            m.blocks.len()
        );
    }
}

/// Streams butter sends from an image built through the library on a RAM device: a full send
/// (protocol 1) of a snapshot with files, a directory, a symlink, a fifo, hard links, xattrs
/// and a sparse file, and an incremental one (protocol 2) after renames, an unlink and
/// overwrites.
fn generated_streams() -> Vec<(String, Vec<u8>)> {
    use butter::inode::namespace::Owner;
    let dev = Arc::new(RamDevice::new(vec![0u8; 128 << 20]));
    let opts = butter::mkfs::MkfsOptions {
        size: 128 << 20,
        fsid: Some([9; 16]),
        time: Some(1_700_000_000),
        ..Default::default()
    };
    butter::mkfs::mkfs(dev.as_ref(), &opts).unwrap();
    let fs = butter::fs::Fs::open_device_rw(dev.clone()).unwrap();
    let top = fs.subvol_root_inode(5).unwrap();
    let o = Owner { uid: 0, gid: 0 };
    let x = fs.create_subvolume(top, b"x", 0o755, o, None).unwrap();
    let f = fs.create(x, b"f", 0o644, o).unwrap();
    fs.write(f, 0, &[7u8; 10000]).unwrap();
    let d = fs.mkdir(x, b"d", 0o755, o).unwrap();
    fs.link(f, d, b"f2").unwrap();
    fs.symlink(d, b"l", b"../f", o).unwrap();
    fs.mknod(x, b"p", 0o010644, 0, o).unwrap();
    fs.setxattr(f, b"user.a", b"1", 0).unwrap();
    let s = fs.create(d, b"sparse", 0o600, o).unwrap();
    fs.write(s, 1 << 20, b"end").unwrap();
    fs.create_snapshot(x.root, top, b"s0", true, None).unwrap();
    fs.rename(x, b"f", d, b"g", 0).unwrap();
    fs.unlink(x, b"p").unwrap();
    fs.write(s, 4096, &[1u8; 5000]).unwrap();
    fs.create_snapshot(x.root, top, b"s1", true, None).unwrap();
    let id = |name: &[u8]| fs.lookup(top, name).unwrap().unwrap().target.root;
    let (s0, s1) = (id(b"s0"), id(b"s1"));
    let mut full = Vec::new();
    let sopts = butter::send::SendOptions::default();
    butter::send::send(&fs, s0, &sopts, &mut full, &mut |_| {}).unwrap();
    let mut inc = Vec::new();
    let iopts = butter::send::SendOptions {
        proto: 2,
        parent: Some(s0),
        ..Default::default()
    };
    butter::send::send(&fs, s1, &iopts, &mut inc, &mut |_| {}).unwrap();
    // Both in one input, as a multi-stream receive reads them.
    let mut both = full.clone();
    both.extend_from_slice(&inc);
    vec![
        ("generated full".into(), full),
        ("generated full+incremental".into(), both),
    ]
}

/// Recomputes the crc32c of every command of a stream as far as its lengths hold, so a
/// mutation gets past the checksums into the commands.
fn reseal(buf: &mut [u8]) {
    let mut off = 17;
    while off + 10 <= buf.len() {
        let len = u32::from_le_bytes([buf[off], buf[off + 1], buf[off + 2], buf[off + 3]]) as usize;
        let end = off + 10 + len;
        if end > buf.len() {
            break;
        }
        buf[off + 6..off + 10].fill(0);
        let crc = !crc32c::crc32c_append(!0, &buf[off..end]);
        buf[off + 6..off + 10].copy_from_slice(&crc.to_le_bytes());
        off = end;
    }
}

fn stream_job(data: Vec<u8>) -> Job {
    Box::new(move || {
        receive_stream_one(&data);
        Ok(())
    })
}

/// The receive target: the committed corpus, streams butter sends, and seeded mutations of
/// them (bytes changed, most resealed with good checksums; cut short), each received into a
/// fresh image that must check clean afterwards.
#[test]
fn receive_stream_corpus_and_mutations() {
    let mut seeds = corpus("receive_stream");
    seeds.extend(generated_streams());
    let mut jobs: Vec<(String, Job)> = seeds
        .iter()
        .map(|(n, d)| (format!("receive_stream/{n}"), stream_job(d.clone())))
        .collect();
    let n = iters(400);
    let mut rng = Rng(0x5e_4d57);
    for i in 0..n {
        let (sname, seed) = &seeds[rng.below(seeds.len())];
        let mut d = seed.clone();
        let mut what = Vec::new();
        for _ in 0..1 + rng.below(4) {
            let len = d.len();
            what.push(poke(&mut d, 17, len, &mut rng));
        }
        if rng.below(4) != 0 {
            reseal(&mut d);
            what.push("resealed".into());
        }
        if rng.below(5) == 0 {
            let at = 17 + rng.below(d.len().saturating_sub(17).max(1));
            d.truncate(at);
            what.push(format!("cut at {at}"));
        }
        jobs.push((
            format!("receive_stream #{i} from {sname}: {}", what.join(", ")),
            stream_job(d),
        ));
    }
    let total = jobs.len();
    finish("receive_stream", total, run_jobs(jobs));
}
