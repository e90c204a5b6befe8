//! Helpers for the corruption suite (`../corruption.rs`) and the bounded fuzz replay
//! (`../fuzz_regress.rs`). `walk.rs` and `fuzz_logic.rs` are also the bodies of the fuzz
//! targets under `fuzz/` (built without the tests under the `fuzzing` feature and reached
//! through `butter::fuzz`), so they depend on nothing but `butter` and std.

#![allow(dead_code)]

#[cfg(test)]
pub mod alloc_track;
pub mod fuzz_logic;
#[cfg(test)]
pub mod image;
#[cfg(test)]
pub mod locate;
#[cfg(test)]
pub mod run;
pub mod walk;
