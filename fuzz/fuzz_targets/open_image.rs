//! Fuzz target: a sparse image (seeded from fresh mkfs.btrfs images) opened with
//! `Fs::open_device(RamDevice)` and walked in full with bounded reads.
//! Input format: see `crates/butter/tests/corrupt_support/fuzz_logic.rs`.
#![no_main]

#[path = "../../crates/butter/tests/corrupt_support/fuzz_logic.rs"]
mod fuzz_logic;
#[path = "../../crates/butter/tests/corrupt_support/walk.rs"]
mod walk;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_logic::open_image_one(data);
});
