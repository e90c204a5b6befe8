//! Superblock feature bits by name, and which of them butter reads and writes.
//!
//! Every incompat and compat_ro bit is listed with what butter can do with a filesystem that
//! has it, so that an open refuses a feature by name (and says what the user can do instead)
//! before a single byte is written. Bits not listed are unknown: refused for reading when
//! incompat, for writing when compat_ro (a kernel that does not know a compat_ro bit mounts
//! read-only too).

use super::consts::*;
use super::superblock::Superblock;

/// What butter does with a filesystem that has a feature.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Support {
    /// Read and written correctly.
    ReadWrite,
    /// Read; writing is refused (the reason is the entry's note).
    ReadOnly,
    /// Neither (an incompat bit butter cannot even read).
    None,
}

/// One feature bit: which word it is in, its bit, the name btrfs-progs uses, what butter does.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Feature {
    pub compat_ro: bool,
    pub bit: u64,
    pub name: &'static str,
    pub support: Support,
    /// Why writing (or reading) is refused, in users' words.
    pub note: &'static str,
}

const fn f(
    compat_ro: bool,
    bit: u64,
    name: &'static str,
    support: Support,
    note: &'static str,
) -> Feature {
    Feature {
        compat_ro,
        bit,
        name,
        support,
        note,
    }
}

/// incompat bit 15: encryption (btrfs-progs' experimental builds).
pub(crate) const INCOMPAT_ENCRYPT: u64 = 1 << 15;
/// incompat bit 17: the remap tree (kernel 7.0).
pub(crate) const INCOMPAT_REMAP_TREE: u64 = 1 << 17;

use Support::*;

/// Every feature bit butter knows.
pub(crate) const FEATURES: &[Feature] = &[
    f(
        false,
        INCOMPAT_MIXED_BACKREF,
        "mixed-backref",
        ReadWrite,
        "",
    ),
    f(
        false,
        INCOMPAT_DEFAULT_SUBVOL,
        "default-subvol",
        ReadWrite,
        "",
    ),
    f(
        false,
        INCOMPAT_MIXED_GROUPS,
        "mixed-bg",
        ReadOnly,
        "data and metadata share block groups, and butter's allocator keeps them apart",
    ),
    f(false, INCOMPAT_COMPRESS_LZO, "compress-lzo", ReadWrite, ""),
    f(
        false,
        INCOMPAT_COMPRESS_ZSTD,
        "compress-zstd",
        ReadWrite,
        "",
    ),
    f(false, INCOMPAT_BIG_METADATA, "big-metadata", ReadWrite, ""),
    f(false, INCOMPAT_EXTENDED_IREF, "extref", ReadWrite, ""),
    f(false, INCOMPAT_RAID56, "raid56", ReadWrite, ""),
    f(
        false,
        INCOMPAT_SKINNY_METADATA,
        "skinny-metadata",
        ReadWrite,
        "",
    ),
    f(false, INCOMPAT_NO_HOLES, "no-holes", ReadWrite, ""),
    f(
        false,
        INCOMPAT_METADATA_UUID,
        "metadata-uuid",
        ReadOnly,
        "tree blocks carry a metadata uuid apart from the filesystem uuid, which butter's \
         writer does not stamp",
    ),
    f(false, INCOMPAT_RAID1C34, "raid1c34", ReadWrite, ""),
    f(
        false,
        INCOMPAT_ZONED,
        "zoned",
        None,
        "zoned devices need sequential writes within zones",
    ),
    f(
        false,
        INCOMPAT_EXTENT_TREE_V2,
        "extent-tree-v2",
        None,
        "the extent tree v2 layout (global roots) is experimental and not implemented",
    ),
    f(
        false,
        INCOMPAT_RAID_STRIPE_TREE,
        "raid-stripe-tree",
        None,
        "data placement is described by the raid stripe tree, which butter does not read",
    ),
    f(
        false,
        INCOMPAT_ENCRYPT,
        "encrypt",
        None,
        "encrypted file data is experimental and not implemented",
    ),
    f(
        false,
        INCOMPAT_SIMPLE_QUOTA,
        "squota",
        ReadOnly,
        "simple quotas record owners in extent items, which butter does not maintain",
    ),
    f(
        false,
        INCOMPAT_REMAP_TREE,
        "remap-tree",
        None,
        "relocated block groups are found through the remap tree, which butter does not read",
    ),
    f(
        true,
        COMPAT_RO_FREE_SPACE_TREE,
        "free-space-tree",
        ReadWrite,
        "",
    ),
    f(
        true,
        COMPAT_RO_FREE_SPACE_TREE_VALID,
        "free-space-tree-valid",
        ReadWrite,
        "",
    ),
    f(
        true,
        COMPAT_RO_VERITY,
        "verity",
        ReadOnly,
        "fs-verity files carry Merkle trees that butter does not keep in step",
    ),
    f(
        true,
        COMPAT_RO_BLOCK_GROUP_TREE,
        "block-group-tree",
        ReadWrite,
        "",
    ),
];

#[cfg(test)]
/// The names of the bits set in `word` (incompat or compat_ro), unknown ones as `bit N`.
pub(crate) fn names(word: u64, compat_ro: bool) -> Vec<String> {
    set_bits(word)
        .map(|bit| match find(bit, compat_ro) {
            Some(f) => f.name.to_string(),
            Option::None => format!("unknown bit {}", bit.trailing_zeros()),
        })
        .collect()
}

fn set_bits(word: u64) -> impl Iterator<Item = u64> {
    (0..64)
        .map(|b| 1u64 << b)
        .filter(move |bit| word & bit != 0)
}

/// The bits of `word` whose support falls short (`short` says which), described for the user:
/// the feature's name and why, or the unknown bit.
fn lacking(word: u64, compat_ro: bool, short: impl Fn(Support) -> bool) -> Vec<String> {
    set_bits(word)
        .filter_map(|bit| match find(bit, compat_ro) {
            Some(f) if short(f.support) => Some(format!("{} ({})", f.name, f.note)),
            Some(_) => Option::None,
            Option::None => Some(format!(
                "unknown {} bit {} (made by a newer btrfs)",
                if compat_ro { "compat_ro" } else { "incompat" },
                bit.trailing_zeros()
            )),
        })
        .collect()
}

fn find(bit: u64, compat_ro: bool) -> Option<&'static Feature> {
    FEATURES
        .iter()
        .find(|f| f.bit == bit && f.compat_ro == compat_ro)
}

/// Why butter cannot read a filesystem with these incompat bits, if it cannot.
pub(crate) fn refuse_read(sb: &Superblock) -> Option<String> {
    let bad = lacking(sb.incompat_flags, false, |s| s == None);
    (!bad.is_empty()).then(|| {
        format!(
            "this filesystem uses features butter cannot read (superblock incompat flags \
             {:#x}): {}; use the kernel's btrfs or btrfs-progs to read it",
            sb.incompat_flags,
            bad.join("; ")
        )
    })
}

/// Why butter must not write a filesystem with this superblock, if it must not: a feature it
/// does not keep correct, an unknown bit, or a superblock flag of an unfinished conversion.
pub(crate) fn refuse_write(sb: &Superblock) -> Option<String> {
    let mut bad = lacking(sb.incompat_flags, false, |s| s != ReadWrite);
    bad.extend(lacking(sb.compat_ro_flags, true, |s| s != ReadWrite));
    if sb.compat_ro_flags & COMPAT_RO_FREE_SPACE_TREE != 0
        && sb.compat_ro_flags & COMPAT_RO_FREE_SPACE_TREE_VALID == 0
    {
        bad.push(
            "free-space-tree without free-space-tree-valid (the free space tree must be \
             rebuilt first: mount it once with the kernel)"
                .into(),
        );
    }
    for (flag, what) in [
        (
            SUPER_FLAG_SEEDING,
            "a seed device (btrfstune -S 0 makes it writable)",
        ),
        (
            SUPER_FLAG_CHANGING_FSID | SUPER_FLAG_CHANGING_FSID_V2,
            "an unfinished change of the filesystem uuid (finish it with btrfstune)",
        ),
        (
            SUPER_FLAG_CHANGING_BG_TREE,
            "an unfinished block-group-tree conversion (finish it with btrfstune)",
        ),
        (
            SUPER_FLAG_CHANGING_CSUM,
            "an unfinished checksum conversion (finish it with btrfstune)",
        ),
    ] {
        if sb.flags & flag != 0 {
            bad.push(what.into());
        }
    }
    (!bad.is_empty()).then(|| {
        format!(
            "butter cannot write this filesystem: {}; open it read-only instead (butter mount \
             -o ro, butter ls/cat/restore)",
            bad.join("; ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_known_bit_has_one_entry() {
        for (i, a) in FEATURES.iter().enumerate() {
            assert_eq!(a.bit.count_ones(), 1, "{}", a.name);
            assert!(
                FEATURES[i + 1..]
                    .iter()
                    .all(|b| (b.bit, b.compat_ro) != (a.bit, a.compat_ro)),
                "{} twice",
                a.name
            );
            assert_eq!(a.support == ReadWrite, a.note.is_empty(), "{}", a.name);
        }
        assert_eq!(
            names(INCOMPAT_ZONED | (1 << 40), false),
            vec!["zoned".to_string(), "unknown bit 40".to_string()]
        );
    }
}
