//! Name hashes used as key offsets.
//!
//! - DIR_ITEM and XATTR_ITEM: key `(dir or inode, type, name_hash(name))`. The hash is the raw
//!   CRC-32C (Castagnoli, reflected) register after feeding the name with the register preset
//!   to `0xFFFF_FFFE` and without the final inversion. Names that collide share one item,
//!   which then holds several entries.
//! - INODE_EXTREF: key `(inode, INODE_EXTREF, extref_hash(parent, name))`, the same raw
//!   CRC-32C register preset to the parent directory's inode number (truncated to 32 bits).
//!
//! The `crc32c` crate computes the standard CRC (register preset to `!init`, result inverted),
//! so a raw register run from `seed` is `!crc32c_append(!seed, data)`.

/// Raw CRC-32C register after feeding `data` starting from `seed`, without final inversion.
fn crc32c_raw(seed: u32, data: &[u8]) -> u32 {
    !crc32c::crc32c_append(!seed, data)
}

/// Key offset of DIR_ITEM / XATTR_ITEM for a name (crc32c Castagnoli seeded 0xFFFFFFFE, no final xor).
pub(crate) fn name_hash(name: &[u8]) -> u64 {
    u64::from(crc32c_raw(0xFFFF_FFFE, name))
}

/// Key offset of INODE_EXTREF: crc32c of the name seeded with the parent inode number (as btrfs does).
///
/// Only the low 32 bits of `parent_ino` take part (the seed is a 32-bit CRC register).
pub(crate) fn extref_hash(parent_ino: u64, name: &[u8]) -> u64 {
    u64::from(crc32c_raw(parent_ino as u32, name))
}

/// Key offset of a keyed EXTENT_DATA_REF (and the order of inline ones): two raw CRC-32C
/// registers preset to all ones, one over the root id, one over the inode number and the
/// file offset (little endian), combined as `high << 31 ^ low`.
pub(crate) fn extent_data_ref_hash(root: u64, objectid: u64, offset: u64) -> u64 {
    let high = crc32c_raw(!0, &root.to_le_bytes());
    let mut low = crc32c_raw(!0, &objectid.to_le_bytes());
    low = crc32c_raw(low, &offset.to_le_bytes());
    (u64::from(high) << 31) ^ u64::from(low)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::compress::oracle;
    use std::collections::HashMap;

    /// Bit-by-bit reference of the reflected Castagnoli register, independent of the crate.
    fn crc32c_bitwise(seed: u32, data: &[u8]) -> u32 {
        let mut crc = seed;
        for &b in data {
            crc ^= u32::from(b);
            for _ in 0..8 {
                crc = if crc & 1 != 0 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
            }
        }
        crc
    }

    #[test]
    fn matches_bitwise_reference() {
        let names: [&[u8]; 5] = [b"", b"a", b"foo", b"123456789", &[0xff; 300]];
        for n in names {
            assert_eq!(name_hash(n), u64::from(crc32c_bitwise(0xFFFF_FFFE, n)));
            assert_eq!(extref_hash(256, n), u64::from(crc32c_bitwise(256, n)));
            assert_eq!(
                extref_hash(0x1_0000_0101, n),
                u64::from(crc32c_bitwise(0x101, n))
            );
        }
        // Standard CRC-32C check value, as a cross-check of the reference itself.
        assert_eq!(!crc32c_bitwise(!0, b"123456789"), 0xe306_9283);
        // Empty name: the seed itself.
        assert_eq!(name_hash(b""), 0xFFFF_FFFE);
        assert!(name_hash(b"some name") <= u64::from(u32::MAX));
    }

    /// One parsed item of `btrfs inspect-internal dump-tree`: key and the name lines under it.
    struct DumpItem {
        objectid: u64,
        kind: String,
        offset: u64,
        /// (parent, name) for INODE_EXTREF entries; (child inode, name) for DIR_ITEM entries.
        names: Vec<(u64, String)>,
        /// Child inode of the DIR_ITEM entry being read (from its "location key" line).
        location: u64,
    }

    /// Parses DIR_ITEM and INODE_EXTREF items (with their names) out of dump-tree text.
    fn parse_items(dump: &str) -> Vec<DumpItem> {
        let mut items: Vec<DumpItem> = Vec::new();
        for line in dump.lines() {
            let t = line.trim();
            if let Some(rest) = t.strip_prefix("item ") {
                // item N key (OBJ TYPE OFF) itemoff ...
                let Some(k0) = rest.find("key (") else {
                    continue;
                };
                let Some(k1) = rest[k0..].find(')') else {
                    continue;
                };
                let key: Vec<&str> = rest[k0 + 5..k0 + k1].split_whitespace().collect();
                if key.len() == 3 {
                    if let (Ok(o), Ok(off)) = (key[0].parse(), key[2].parse()) {
                        items.push(DumpItem {
                            objectid: o,
                            kind: key[1].to_string(),
                            offset: off,
                            names: Vec::new(),
                            location: 0,
                        });
                        continue;
                    }
                }
                continue;
            }
            let Some(cur) = items.last_mut() else {
                continue;
            };
            if cur.kind == "DIR_ITEM" {
                if let Some(l) = t.strip_prefix("location key (") {
                    cur.location = l.split_whitespace().next().unwrap().parse().unwrap();
                } else if let Some(n) = t.strip_prefix("name: ") {
                    cur.names.push((cur.location, unescape(n)));
                }
            } else if cur.kind == "INODE_EXTREF" {
                // index N parent P namelen L name: NAME
                if let (Some(p), Some(n)) = (t.find("parent "), t.find("name: ")) {
                    let parent: u64 = t[p + 7..]
                        .split_whitespace()
                        .next()
                        .unwrap()
                        .parse()
                        .unwrap();
                    cur.names.push((parent, unescape(&t[n + 6..])));
                }
            }
        }
        items
    }

    /// Undoes dump-tree's escaping of names (btrfs-progs 6.14: `\ `, `\\`, C escapes, octal).
    fn unescape(s: &str) -> String {
        let b = s.as_bytes();
        let mut out = Vec::new();
        let mut i = 0;
        while i < b.len() {
            if b[i] != b'\\' || i + 1 == b.len() {
                out.push(b[i]);
                i += 1;
                continue;
            }
            let c = b[i + 1];
            if c.is_ascii_digit() && i + 3 < b.len() {
                let oct = std::str::from_utf8(&b[i + 1..i + 4]).unwrap();
                out.push(u8::from_str_radix(oct, 8).unwrap());
                i += 4;
                continue;
            }
            out.push(match c {
                b'a' => 7,
                b'b' => 8,
                b't' => b'\t',
                b'n' => b'\n',
                b'v' => 11,
                b'f' => 12,
                b'r' => b'\r',
                b'e' => 27,
                c => c,
            });
            i += 2;
        }
        String::from_utf8(out).unwrap()
    }

    /// Creates files in a kernel-mounted image and checks the DIR_ITEM key offsets; then
    /// 200 hard links with 200-byte names force INODE_EXTREF items, whose key offsets are
    /// checked against extref_hash(parent, name).
    #[test]
    fn hashes_match_kernel_written_image() {
        if !oracle::loop_mount_available() {
            return;
        }
        let scratch = oracle::Scratch::new("hash");
        let img = scratch.image("hash.img", 300 << 20);
        oracle::mkfs(&img, &[]);
        let mut names: Vec<String> = vec![
            "a".into(),
            "foo".into(),
            "hello world.txt".into(),
            "ünïcødé-名前".into(),
            "x".repeat(255),
        ];
        let mut links: Vec<String> = Vec::new();
        {
            let m = scratch.mount(&img, &[]);
            std::fs::create_dir(m.path().join("d")).unwrap();
            for n in &names {
                std::fs::write(m.path().join("d").join(n), b"x").unwrap();
            }
            let target = m.path().join("d").join("a");
            for i in 0..200 {
                let name = format!("{i:03}-{}", "L".repeat(196));
                std::fs::hard_link(&target, m.path().join("d").join(&name)).unwrap();
                links.push(name);
            }
            m.unmount();
        }
        let dump = oracle::run(
            "btrfs",
            &[
                "inspect-internal",
                "dump-tree",
                "-t",
                "fs",
                img.to_str().unwrap(),
            ],
        );
        let items = parse_items(&dump);

        // The inode number of directory "d", from its DIR_ITEM in the root directory (256).
        let dir_ino = {
            let i = items
                .iter()
                .filter(|i| i.kind == "DIR_ITEM" && i.objectid == 256)
                .find(|i| i.names.iter().any(|(_, n)| n == "d"))
                .expect("DIR_ITEM of d");
            assert_eq!(i.offset, name_hash(b"d"));
            i.names.iter().find(|(_, n)| n == "d").unwrap().0
        };
        assert!(dir_ino >= 256);

        names.extend(links.iter().cloned());
        let mut dir_items: HashMap<String, u64> = HashMap::new();
        for it in items
            .iter()
            .filter(|i| i.kind == "DIR_ITEM" && i.objectid == dir_ino)
        {
            for (_, n) in &it.names {
                dir_items.insert(n.clone(), it.offset);
            }
        }
        for n in &names {
            let off = *dir_items
                .get(n)
                .unwrap_or_else(|| panic!("no DIR_ITEM for {n:?}"));
            assert_eq!(off, name_hash(n.as_bytes()), "DIR_ITEM offset of {n:?}");
        }

        let mut extrefs = 0;
        for it in items.iter().filter(|i| i.kind == "INODE_EXTREF") {
            for (parent, n) in &it.names {
                assert_eq!(*parent, dir_ino);
                assert_eq!(
                    it.offset,
                    extref_hash(*parent, n.as_bytes()),
                    "extref {n:?}"
                );
                extrefs += 1;
            }
        }
        assert!(
            extrefs > 0,
            "expected INODE_EXTREF items with 200 long hard links"
        );
    }
}
