//! Fuzz target: a sparse image (seeded from fresh mkfs.btrfs images) opened with
//! `Fs::open_device(RamDevice)` and walked in full with bounded reads.
//! Input format: see `crates/butter/src/tests/corrupt_support/fuzz_logic.rs` (the body,
//! exposed as `butter::fuzz` under the `fuzzing` feature).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    butter::fuzz::open_image_one(data);
});
