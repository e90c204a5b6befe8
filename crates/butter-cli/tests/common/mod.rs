//! Test harness that compares butter with the real kernel btrfs.
//!
//! Integration tests include it with `mod common;` and typically:
//!
//! ```ignore
//! if !common::kernel::require_privileges() { return; }
//! let scratch = common::kernel::ScratchDir::new("restore-defaults");
//! let v = common::variant::variant("defaults");
//! let img = common::variant::build_variant_image(v, scratch.path(), 42);
//! let want = common::variant::kernel_manifest(&img, &scratch.join("kmnt"), &Default::default());
//! // ... run `butter restore IMAGE DIR`, then:
//! let got = common::manifest::take(&scratch.join("out"), &Default::default());
//! common::manifest::assert_same(&want, &got, &common::manifest::CompareOpts::restore(), "restore");
//! ```
//!
//! - [`kernel`]: privileges, scratch dirs, loop mounts, mkfs / check / dump-tree wrappers.
//! - [`gen`]: the seeded tree generator for a kernel btrfs mount.
//! - [`manifest`]: walking a tree into a comparable manifest, and diffing two.
//! - [`variant`]: the mkfs variants and building a populated image of each.
//!
//! Environment: `CI` (missing privileges fail instead of skip), `BUTTER_ORACLE_SCALE`
//! (`small`/`full`), `BUTTER_ORACLE_VARIANTS` (comma list or `all`), `BUTTER_ORACLE_TMP`
//! (scratch base, default /tmp/butter-oracle), `BUTTER_ORACLE_KEEP` (keep scratch dirs).

// Each test binary uses a different part of the harness.
#![allow(dead_code)]

pub mod butter_target;
pub mod corpus;
pub mod damage;
pub mod fsync;
pub mod fuse_mount;
pub mod gen;
pub mod kernel;
pub mod manifest;
pub mod model;
pub mod nbd;
pub mod send_source;
pub mod variant;

/// Runs the butter binary under test with `args`, capturing its output.
pub fn run_butter(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_butter"))
        .args(args)
        .output()
        .expect("run butter")
}

/// A command's standard output followed by its standard error.
pub fn output_text(o: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
