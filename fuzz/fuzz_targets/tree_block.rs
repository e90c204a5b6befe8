//! Fuzz target: `check_tree_block` on arbitrary bytes (checksum recomputed unless the control
//! byte says not), then every accessor of a block that validates and every item decoder on
//! every item body; the same bytes as a superblock and a sys_chunk_array.
//! Input format: see `crates/butter/src/tests/corrupt_support/fuzz_logic.rs` (the body,
//! exposed as `butter::fuzz` under the `fuzzing` feature).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    butter::fuzz::tree_block_one(data);
});
