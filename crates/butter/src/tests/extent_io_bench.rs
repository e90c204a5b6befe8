//! Timing of `ExtentIoTree::clear_bits` with the seed-000 trim-in-place optimization on and
//! off, over a pattern modelled on the seed's benchmark (4 KiB random writes to one file):
//! each step dirties `w` random 4 KiB blocks, then clears all bits of a random block-aligned
//! range of 1..=8 blocks, which often starts or ends inside a dirty record (partial overlap).
//! Two patterns: sparse (`w = 1`, about a fifth of the file dirty) and dense (`w = 4`, about
//! half dirty, so partial overlaps are more frequent).
//!
//! A benchmark, not a test: ignored by the suite, run on demand with
//! `cargo test --release -p butter --lib extent_io_bench -- --ignored --nocapture`
//! (`BUTTER_BENCH_STEPS`, default 500000, and `BUTTER_BENCH_FILE_MIB`, default 256, size it).
//! It lives inside the crate because the range-state tree is crate-private.
//! Both modes replay the same pre-generated operations on fresh trees; the runs alternate
//! on/off to spread machine noise; the reported figure per mode is the median run.

use butter::extent_io::{ExtentBits, ExtentIoTree};
use std::hint::black_box;
use std::time::Instant;

const BLOCK: u64 = 4096;

/// splitmix64: a small deterministic generator (no dependency).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

struct Step {
    writes: Vec<u64>,
    clear: (u64, u64),
}

struct Run {
    clear_ns: Vec<u32>,
    total_ns: f64,
    tree: ExtentIoTree,
}

fn run(steps: &[Step], warm: &[u64], trim: bool) -> Run {
    let mut t = ExtentIoTree::new();
    t.set_trim_in_place(trim);
    for &w in warm {
        t.set_bits(w, w + BLOCK - 1, ExtentBits::DIRTY);
    }
    t.reset_stats();
    let mut clear_ns = Vec::with_capacity(steps.len());
    let t0 = Instant::now();
    for s in steps {
        for &w in &s.writes {
            t.set_bits(w, w + BLOCK - 1, ExtentBits::DIRTY);
        }
        let c0 = Instant::now();
        black_box(t.clear_bits(s.clear.0, s.clear.1, ExtentBits::ALL));
        clear_ns.push(c0.elapsed().as_nanos().min(u32::MAX as u128) as u32);
    }
    let total_ns = t0.elapsed().as_nanos() as f64;
    Run {
        clear_ns,
        total_ns,
        tree: t,
    }
}

fn pct(sorted: &[u32], p: f64) -> u32 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or(0)
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[test]
#[ignore = "a benchmark: run on demand (see the module documentation)"]
fn extent_io_bench() {
    let steps_n = env_u64("BUTTER_BENCH_STEPS", 500_000) as usize;
    let file_mib = env_u64("BUTTER_BENCH_FILE_MIB", 256);
    let blocks = file_mib * 1024 * 1024 / BLOCK;
    for (pattern, writes_per_step) in [("sparse", 1), ("dense", 4)] {
        bench(pattern, writes_per_step, steps_n, file_mib, blocks);
    }
}

fn bench(pattern: &str, writes_per_step: u64, steps_n: usize, file_mib: u64, blocks: u64) {
    let mut rng = Rng(0x5eed_0000 + writes_per_step);
    // Warm the tree so it holds a realistic number of records before timing.
    let warm: Vec<u64> = (0..blocks / 2)
        .map(|_| rng.next() % blocks * BLOCK)
        .collect();
    let steps: Vec<Step> = (0..steps_n)
        .map(|_| {
            let writes = (0..writes_per_step)
                .map(|_| rng.next() % blocks * BLOCK)
                .collect();
            let first = rng.next() % blocks;
            let n = 1 + rng.next() % 8;
            let last = (first + n - 1).min(blocks - 1);
            Step {
                writes,
                clear: (first * BLOCK, (last + 1) * BLOCK - 1),
            }
        })
        .collect();

    println!(
        "{pattern}: {steps_n} steps of {writes_per_step} 4 KiB write(s) + 1 clear on a \
         {file_mib} MiB file ({blocks} blocks), {} warm-up writes",
        warm.len()
    );
    let mut per_mode: [Vec<Run>; 2] = [Vec::new(), Vec::new()];
    for _round in 0..3 {
        for (i, trim) in [(0, true), (1, false)] {
            per_mode[i].push(run(&steps, &warm, trim));
        }
    }
    let mut final_records = Vec::new();
    for (i, name) in [(0, "trim in place ON "), (1, "trim in place OFF")] {
        let runs = &mut per_mode[i];
        runs.sort_by(|a, b| a.total_ns.total_cmp(&b.total_ns));
        let mid = &runs[runs.len() / 2];
        let mut ns = mid.clear_ns.clone();
        ns.sort_unstable();
        let mean = ns.iter().map(|&v| v as f64).sum::<f64>() / ns.len() as f64;
        let st = mid.tree.stats();
        println!(
            "  {name}: clear_bits mean {mean:.1} ns, median {} ns, p90 {} ns, p99 {} ns | \
             whole step {:.1} ns | splits performed {}, avoided {} \
             (first {}, last {}), records inserted {}, removed {} | records at end {}",
            pct(&ns, 0.5),
            pct(&ns, 0.9),
            pct(&ns, 0.99),
            mid.total_ns / steps.len() as f64,
            st.splits_performed,
            st.splits_avoided,
            st.trims_first,
            st.trims_last,
            st.records_inserted,
            st.records_removed,
            mid.tree.len(),
        );
        final_records.push(mid.tree.iter().collect::<Vec<_>>());
    }
    // The optimization must not change the result.
    assert_eq!(
        final_records[0], final_records[1],
        "trees differ between modes"
    );
}
