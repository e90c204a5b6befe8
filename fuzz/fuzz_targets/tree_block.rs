//! Fuzz target: `check_tree_block` on arbitrary bytes (checksum recomputed unless the control
//! byte says not), then every accessor of a block that validates and every item decoder on
//! every item body; the same bytes as a superblock and a sys_chunk_array.
//! Input format: see `crates/butter/tests/corrupt_support/fuzz_logic.rs`.
#![no_main]

#[path = "../../crates/butter/tests/corrupt_support/fuzz_logic.rs"]
mod fuzz_logic;
#[path = "../../crates/butter/tests/corrupt_support/walk.rs"]
mod walk;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    fuzz_logic::tree_block_one(data);
});
