//! Checksum algorithms of btrfs metadata and data blocks.
//!
//! The superblock field `csum_type` selects one algorithm for the whole filesystem. Every
//! checksum slot on disk (superblock, tree block header, EXTENT_CSUM items) is 32 bytes wide
//! in headers; only the first [`CsumType::size`] bytes are meaningful, the rest is zero.
//! EXTENT_CSUM items pack checksums of `size()` bytes each, one per data sector.
//!
//! Byte order as stored on disk:
//! - crc32c: the standard (Castagnoli, reflected, init and final xor `!0`) CRC as a le32;
//! - xxhash64: XXH64 with seed 0 as a le64;
//! - sha256: the 32-byte digest;
//! - blake2b: the BLAKE2b digest with a 32-byte output length (BLAKE2b-256, no key).

use blake2::digest::consts::U32;
use blake2::{Blake2b, Digest};

/// Width of every checksum slot in headers and the superblock.
pub(crate) const CSUM_SLOT: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CsumType {
    Crc32c,
    Xxhash64,
    Sha256,
    Blake2b,
}

impl CsumType {
    /// Decodes the superblock `csum_type` (0 crc32c, 1 xxhash64, 2 sha256, 3 blake2b).
    pub(crate) fn from_disk(v: u16) -> Option<CsumType> {
        match v {
            0 => Some(CsumType::Crc32c),
            1 => Some(CsumType::Xxhash64),
            2 => Some(CsumType::Sha256),
            3 => Some(CsumType::Blake2b),
            _ => None,
        }
    }

    /// The superblock `csum_type` code of this algorithm.
    pub(crate) fn to_disk(self) -> u16 {
        match self {
            CsumType::Crc32c => 0,
            CsumType::Xxhash64 => 1,
            CsumType::Sha256 => 2,
            CsumType::Blake2b => 3,
        }
    }

    /// Number of meaningful bytes of a checksum: 4, 8, 32, 32.
    pub(crate) fn size(self) -> usize {
        match self {
            CsumType::Crc32c => 4,
            CsumType::Xxhash64 => 8,
            CsumType::Sha256 | CsumType::Blake2b => 32,
        }
    }

    /// The name btrfs-progs uses (`mkfs.btrfs --csum`, `dump-super`).
    pub fn name(self) -> &'static str {
        match self {
            CsumType::Crc32c => "crc32c",
            CsumType::Xxhash64 => "xxhash64",
            CsumType::Sha256 => "sha256",
            CsumType::Blake2b => "blake2b",
        }
    }

    /// Checksum of `data` in on-disk byte order, zero-padded to 32 bytes.
    pub fn compute(self, data: &[u8]) -> [u8; 32] {
        let mut out = [0u8; CSUM_SLOT];
        match self {
            CsumType::Crc32c => {
                out[..4].copy_from_slice(&crc32c::crc32c(data).to_le_bytes());
            }
            CsumType::Xxhash64 => {
                out[..8].copy_from_slice(&xxhash_rust::xxh64::xxh64(data, 0).to_le_bytes());
            }
            CsumType::Sha256 => {
                out.copy_from_slice(&sha2::Sha256::digest(data));
            }
            CsumType::Blake2b => {
                out.copy_from_slice(&Blake2b::<U32>::digest(data));
            }
        }
        out
    }

    /// True if the first `size()` bytes of `stored` equal the checksum of `data`.
    /// A `stored` shorter than `size()` never matches.
    pub(crate) fn verify(self, data: &[u8], stored: &[u8]) -> bool {
        let n = self.size();
        match stored.get(..n) {
            Some(s) => self.compute(data)[..n] == *s,
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::compress::oracle;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    #[test]
    fn codes_sizes_names_round_trip() {
        for v in 0..4u16 {
            let t = CsumType::from_disk(v).unwrap();
            assert_eq!(t.to_disk(), v);
        }
        assert_eq!(CsumType::from_disk(4), None);
        assert_eq!(CsumType::from_disk(0xffff), None);
        let sizes: Vec<usize> = (0..4)
            .map(|v| CsumType::from_disk(v).unwrap().size())
            .collect();
        assert_eq!(sizes, [4, 8, 32, 32]);
        let names: Vec<&str> = (0..4)
            .map(|v| CsumType::from_disk(v).unwrap().name())
            .collect();
        assert_eq!(names, ["crc32c", "xxhash64", "sha256", "blake2b"]);
    }

    #[test]
    fn known_vectors() {
        // CRC-32C check value.
        let c = CsumType::Crc32c.compute(b"123456789");
        assert_eq!(&c[..4], &0xe306_9283u32.to_le_bytes());
        assert!(c[4..].iter().all(|&b| b == 0));
        assert_eq!(&CsumType::Crc32c.compute(b"")[..4], &[0, 0, 0, 0]);

        // XXH64, seed 0.
        let x = CsumType::Xxhash64.compute(b"");
        assert_eq!(&x[..8], &0xef46_db37_51d8_e999u64.to_le_bytes());
        assert!(x[8..].iter().all(|&b| b == 0));

        // FIPS 180-2 "abc".
        let s = CsumType::Sha256.compute(b"abc");
        assert_eq!(
            s.to_vec(),
            hex("ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        );
        let s = CsumType::Sha256.compute(b"");
        assert_eq!(
            s.to_vec(),
            hex("e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
        );

        // BLAKE2b with 32-byte output of "abc".
        let b = CsumType::Blake2b.compute(b"abc");
        assert_eq!(
            b.to_vec(),
            hex("bddd813c634239723171ef3fee98579b94964e3bb1cb3e427262c8c068d52319")
        );
    }

    #[test]
    fn verify_checks_prefix_only() {
        let data = b"some block";
        for v in 0..4 {
            let t = CsumType::from_disk(v).unwrap();
            let mut stored = t.compute(data);
            assert!(t.verify(data, &stored));
            assert!(t.verify(data, &stored[..t.size()]));
            assert!(!t.verify(data, &stored[..t.size() - 1]));
            stored[0] ^= 1;
            assert!(!t.verify(data, &stored));
        }
    }

    /// mkfs.btrfs with each checksum type; the primary superblock's checksum over [32, 4096)
    /// must equal compute() of those bytes.
    #[test]
    fn superblock_checksums_of_real_images() {
        if !oracle::mkfs_available() {
            return;
        }
        let scratch = oracle::Scratch::new("csum-super");
        for (arg, t) in [
            ("crc32c", CsumType::Crc32c),
            ("xxhash", CsumType::Xxhash64),
            ("sha256", CsumType::Sha256),
            ("blake2", CsumType::Blake2b),
        ] {
            let img = scratch.image(&format!("{arg}.img"), 256 << 20);
            oracle::mkfs(&img, &["--csum", arg]);
            let bytes = std::fs::read(&img).unwrap();
            let sb = &bytes[65536..65536 + 4096];
            // csum_type at superblock offset 0xc4 (le16).
            let code = u16::from_le_bytes([sb[0xc4], sb[0xc5]]);
            assert_eq!(
                CsumType::from_disk(code),
                Some(t),
                "csum_type of {arg} image"
            );
            let c = t.compute(&sb[32..]);
            assert_eq!(&c[..t.size()], &sb[..t.size()], "superblock csum {arg}");
            assert!(t.verify(&sb[32..], &sb[..32]));
            std::fs::remove_file(&img).unwrap();
        }
    }
}
