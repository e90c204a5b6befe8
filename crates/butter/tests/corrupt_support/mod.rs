//! Helpers for the corruption suite (`tests/corruption.rs`) and the bounded fuzz replay
//! (`tests/fuzz_regress.rs`). `walk.rs` and `fuzz_logic.rs` are also compiled into the fuzz
//! targets under `fuzz/`, so they depend on nothing but `butter` and std.

#![allow(dead_code)]

pub mod alloc_track;
pub mod fuzz_logic;
pub mod image;
pub mod locate;
pub mod run;
pub mod walk;
