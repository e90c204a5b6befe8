//! The mkfs.btrfs variants the oracle suite covers, and building a populated image of each.
//!
//! An image is made by `mkfs.btrfs` (btrfs-progs 6.14) on a sparse file of [`IMAGE_SIZE`],
//! loop-mounted by the kernel with `noatime` plus the variant's mount options, filled by
//! [`populate`], and unmounted cleanly (so it has no log tree).

use super::gen::{populate, Scale};
use super::kernel::{mkfs_btrfs, LoopMount};
use super::manifest::{take, Manifest, TakeOpts};
use std::path::{Path, PathBuf};

/// Size of the sparse image files (the content of `Scale::Full` needs about 150 MiB).
pub const IMAGE_SIZE: u64 = 1 << 30;

/// One mkfs configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    /// Short name, usable in file names and in `BUTTER_ORACLE_VARIANTS`.
    pub name: &'static str,
    /// Extra arguments for mkfs.btrfs.
    pub mkfs_args: &'static [&'static str],
    /// Extra mount options while populating (comma-separated, may be empty).
    pub mount_opts: &'static str,
}

/// Every variant of the oracle suite.
pub const VARIANTS: &[Variant] = &[
    Variant {
        name: "defaults",
        mkfs_args: &[],
        mount_opts: "",
    },
    Variant {
        name: "nodesize-4k",
        mkfs_args: &["--nodesize", "4096"],
        mount_opts: "",
    },
    Variant {
        name: "nodesize-16k",
        mkfs_args: &["--nodesize", "16384"],
        mount_opts: "",
    },
    Variant {
        name: "nodesize-64k",
        mkfs_args: &["--nodesize", "65536"],
        mount_opts: "",
    },
    Variant {
        name: "csum-xxhash",
        mkfs_args: &["--csum", "xxhash"],
        mount_opts: "",
    },
    Variant {
        name: "csum-sha256",
        mkfs_args: &["--csum", "sha256"],
        mount_opts: "",
    },
    Variant {
        name: "csum-blake2",
        mkfs_args: &["--csum", "blake2"],
        mount_opts: "",
    },
    Variant {
        name: "holes",
        mkfs_args: &["-O", "^no-holes"],
        mount_opts: "",
    },
    Variant {
        name: "fat-metadata",
        mkfs_args: &["-O", "^skinny-metadata"],
        mount_opts: "",
    },
    // Block group items in their own tree (tree 11): mkfs.btrfs's default since 6.19.
    Variant {
        name: "block-group-tree",
        mkfs_args: &["-O", "block-group-tree"],
        mount_opts: "",
    },
    // Without a free space tree the kernel keeps using the v1 space cache (it does not convert
    // the image to v2 unless asked to).
    Variant {
        name: "no-fst",
        mkfs_args: &["-R", "^free-space-tree"],
        mount_opts: "",
    },
];

/// The variant called `name`; panics listing the known names otherwise.
pub fn variant(name: &str) -> &'static Variant {
    VARIANTS.iter().find(|v| v.name == name).unwrap_or_else(|| {
        let names: Vec<_> = VARIANTS.iter().map(|v| v.name).collect();
        panic!("unknown oracle variant {name:?}; known: {names:?}")
    })
}

/// The variants named in the environment variable `var` (comma-separated, or `all`), or
/// `default` (same syntax) when it is unset.
pub fn variants_from_env(var: &str, default: &str) -> Vec<&'static Variant> {
    let spec = std::env::var(var).unwrap_or_else(|_| default.to_string());
    if spec.trim() == "all" {
        return VARIANTS.iter().collect();
    }
    spec.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(variant)
        .collect()
}

/// Builds `dir/<variant>-<seed>.img` at the scale from `BUTTER_ORACLE_SCALE` and returns its
/// path. The mount point used while populating is `dir/<variant>-<seed>.mnt`.
pub fn build_variant_image(variant: &Variant, dir: &Path, seed: u64) -> PathBuf {
    build_variant_image_with(variant, dir, seed, Scale::from_env())
}

/// [`build_variant_image`] at an explicit scale.
pub fn build_variant_image_with(variant: &Variant, dir: &Path, seed: u64, scale: Scale) -> PathBuf {
    let img = dir.join(format!("{}-{seed:x}.img", variant.name));
    let mnt = dir.join(format!("{}-{seed:x}.mnt", variant.name));
    mkfs_btrfs(&img, IMAGE_SIZE, variant.mkfs_args);
    let mut opts = String::from("noatime");
    if !variant.mount_opts.is_empty() {
        opts.push(',');
        opts.push_str(variant.mount_opts);
    }
    let m = LoopMount::btrfs(&img, &mnt, &opts);
    populate(m.path(), seed, scale);
    m.unmount();
    img
}

/// Mounts `img` read-only with the kernel at `mnt`, takes its manifest, and unmounts: the
/// reference to compare butter's view of the image with.
pub fn kernel_manifest(img: &Path, mnt: &Path, opts: &TakeOpts) -> Manifest {
    let m = LoopMount::btrfs_ro(img, mnt);
    let man = take(m.path(), opts);
    m.unmount();
    man
}
