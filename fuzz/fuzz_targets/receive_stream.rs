//! Fuzz target: arbitrary bytes as a send stream, printed as `btrfs receive --dump` prints it
//! and received into a fresh image on a RAM device; the image must check clean afterwards.
//! Input format: a send stream (magic, version, commands). The body is in
//! `crates/butter/src/tests/corrupt_support/fuzz_logic.rs` (exposed as `butter::fuzz` under the
//! `fuzzing` feature).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    butter::fuzz::receive_stream_one(data);
});
