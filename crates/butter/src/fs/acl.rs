//! POSIX ACLs in their xattr form (`system.posix_acl_access` / `system.posix_acl_default`):
//! a little-endian header `u32 version = 2`, then entries `u16 tag, u16 perm, u32 id`. This is
//! what the kernel passes through FUSE and what btrfs stores, so values are kept as given;
//! this module only reads them to keep the mode bits in step (as a kernel filesystem does on
//! set, chmod and create).

pub(crate) const ACCESS: &[u8] = b"system.posix_acl_access";
pub(crate) const DEFAULT: &[u8] = b"system.posix_acl_default";

const VERSION: u32 = 2;
const USER_OBJ: u16 = 0x01;
const USER: u16 = 0x02;
const GROUP_OBJ: u16 = 0x04;
const GROUP: u16 = 0x08;
const MASK: u16 = 0x10;
const OTHER: u16 = 0x20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) tag: u16,
    pub(crate) perm: u16,
    pub(crate) id: u32,
}

/// Parses an ACL xattr value; `None` if it is malformed or lacks a required entry.
pub(crate) fn parse(v: &[u8]) -> Option<Vec<Entry>> {
    let (head, rest) = v.split_first_chunk::<4>()?;
    if u32::from_le_bytes(*head) != VERSION || rest.len() % 8 != 0 {
        return None;
    }
    let entries: Vec<Entry> = rest
        .as_chunks::<8>()
        .0
        .iter()
        .map(|c| Entry {
            tag: u16::from_le_bytes([c[0], c[1]]),
            perm: u16::from_le_bytes([c[2], c[3]]),
            id: u32::from_le_bytes([c[4], c[5], c[6], c[7]]),
        })
        .collect();
    let has = |t| entries.iter().filter(|e| e.tag == t).count();
    let named = has(USER) + has(GROUP);
    if has(USER_OBJ) != 1
        || has(GROUP_OBJ) != 1
        || has(OTHER) != 1
        || has(MASK) > 1
        || (named > 0 && has(MASK) == 0)
        || entries.iter().any(|e| {
            e.perm & !7 != 0 || ![USER_OBJ, USER, GROUP_OBJ, GROUP, MASK, OTHER].contains(&e.tag)
        })
    {
        return None;
    }
    Some(entries)
}

pub(crate) fn encode(entries: &[Entry]) -> Vec<u8> {
    let mut out = VERSION.to_le_bytes().to_vec();
    for e in entries {
        out.extend_from_slice(&e.tag.to_le_bytes());
        out.extend_from_slice(&e.perm.to_le_bytes());
        out.extend_from_slice(&e.id.to_le_bytes());
    }
    out
}

/// The permission bits (0o777) an access ACL implies, and whether the mode bits say all it
/// says (only the three base entries).
pub(crate) fn mode_of(entries: &[Entry]) -> (u32, bool) {
    let mut mode = 0u32;
    let mut equiv = true;
    let mut mask = None;
    for e in entries {
        let p = u32::from(e.perm & 7);
        match e.tag {
            USER_OBJ => mode |= p << 6,
            GROUP_OBJ => mode |= p << 3,
            OTHER => mode |= p,
            MASK => {
                mask = Some(p);
                equiv = false;
            }
            _ => equiv = false,
        }
    }
    if let Some(m) = mask {
        mode = (mode & !0o070) | (m << 3);
    }
    (mode, equiv)
}

/// chmod on a file with an access ACL: the owner, mask (or owning group without one) and
/// other entries follow the new mode.
pub(crate) fn chmod(entries: &mut [Entry], mode: u32) {
    let has_mask = entries.iter().any(|e| e.tag == MASK);
    for e in entries.iter_mut() {
        match e.tag {
            USER_OBJ => e.perm = ((mode >> 6) & 7) as u16,
            MASK => e.perm = ((mode >> 3) & 7) as u16,
            GROUP_OBJ if !has_mask => e.perm = ((mode >> 3) & 7) as u16,
            OTHER => e.perm = (mode & 7) as u16,
            _ => {}
        }
    }
}

/// A new inode in a directory with default ACL `entries`: its access ACL is the default one
/// limited by the requested `mode`, and the mode's permission bits are limited by the ACL
/// (umask does not apply). Returns the ACL and the new mode.
pub(crate) fn inherit(entries: &[Entry], mode: u32) -> (Vec<Entry>, u32) {
    let mut acl = entries.to_vec();
    let mut mode = mode;
    let has_mask = acl.iter().any(|e| e.tag == MASK);
    for e in acl.iter_mut() {
        match e.tag {
            USER_OBJ => {
                e.perm &= ((mode >> 6) & 7) as u16;
                mode &= (u32::from(e.perm) << 6) | !0o700;
            }
            OTHER => {
                e.perm &= (mode & 7) as u16;
                mode &= u32::from(e.perm) | !0o007;
            }
            MASK => {
                e.perm &= ((mode >> 3) & 7) as u16;
                mode &= (u32::from(e.perm) << 3) | !0o070;
            }
            GROUP_OBJ if !has_mask => {
                e.perm &= ((mode >> 3) & 7) as u16;
                mode &= (u32::from(e.perm) << 3) | !0o070;
            }
            _ => {}
        }
    }
    (acl, mode)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(tag: u16, perm: u16, id: u32) -> Entry {
        Entry { tag, perm, id }
    }

    #[test]
    fn round_trip_and_mode() {
        let acl = vec![
            e(USER_OBJ, 7, u32::MAX),
            e(USER, 5, 1000),
            e(GROUP_OBJ, 5, u32::MAX),
            e(MASK, 7, u32::MAX),
            e(OTHER, 4, u32::MAX),
        ];
        let v = encode(&acl);
        assert_eq!(v.len(), 4 + 5 * 8);
        assert_eq!(parse(&v).unwrap(), acl);
        assert_eq!(mode_of(&acl), (0o774, false));
        let base = vec![
            e(USER_OBJ, 6, u32::MAX),
            e(GROUP_OBJ, 4, u32::MAX),
            e(OTHER, 0, u32::MAX),
        ];
        assert_eq!(mode_of(&base), (0o640, true));
        assert!(parse(&v[..10]).is_none());
        assert!(parse(&encode(&acl[1..])).is_none()); // no owner entry
        assert!(parse(&encode(&[acl[0], acl[1], acl[2], acl[4]])).is_none()); // named, no mask
    }

    #[test]
    fn chmod_and_inherit() {
        let mut acl = vec![
            e(USER_OBJ, 7, u32::MAX),
            e(USER, 7, 1000),
            e(GROUP_OBJ, 5, u32::MAX),
            e(MASK, 7, u32::MAX),
            e(OTHER, 5, u32::MAX),
        ];
        chmod(&mut acl, 0o750);
        assert_eq!(mode_of(&acl), (0o750, false));
        assert_eq!(acl[1].perm, 7); // named entries keep their bits; the mask limits them
        assert_eq!(acl[2].perm, 5);
        let (child, mode) = inherit(&acl, 0o100666);
        assert_eq!(mode, 0o100640);
        assert_eq!(mode_of(&child).0, 0o640);
        assert_eq!(child[1], e(USER, 7, 1000));
    }
}
