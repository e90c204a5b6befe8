//! The engine's white-box test suites. They reach the engine's internals (tree blocks, the
//! chunk map, the free space tree codec, the extent io tree, ...), which may be crate-private,
//! so they live inside the crate and build into its unit-test binary; the integration tests
//! in `crates/butter/tests` use only the public API. The suites keep their `butter::...`
//! paths: lib.rs names the crate `butter` to itself (`extern crate self as butter`), which inside the crate reaches `pub(crate)`
//! items too.
//!
//! Run one with `cargo test -p butter --release --lib tests::corruption` (or
//! `tests::fuzz_regress`, `tests::crash`, ...).
//!
//! `corrupt_support`'s `fuzz_logic` and `walk` are also built, without the tests, under the
//! `fuzzing` feature: they are the bodies of the libFuzzer targets in `fuzz/`, reached through
//! `butter::fuzz`.

#[cfg(test)]
mod alloc_model;
#[cfg(test)]
mod check_damage;
#[cfg(test)]
mod check_more;
#[cfg(test)]
mod corruption;
#[cfg(test)]
mod crash;
#[cfg(test)]
mod crash_multi;
#[cfg(test)]
mod engine_rules;
#[cfg(test)]
mod extent_io_bench;
#[cfg(test)]
mod extent_io_model;
#[cfg(test)]
mod free_space_tree;
#[cfg(test)]
mod fsync_rand_bench;
#[cfg(test)]
mod fuzz_regress;
#[cfg(test)]
mod read_basic;
#[cfg(test)]
mod relocate;
#[cfg(test)]
mod subvol_delete;
#[cfg(test)]
mod write_api;

pub(crate) mod corrupt_support;
/// Shared with the integration tests (enospc, image_identity, typed_errors),
/// which declare the same file as their own module; one copy for both.
#[cfg(test)]
#[path = "../../tests/crash_support/mod.rs"]
mod crash_support;
#[cfg(test)]
mod oracle_support;
