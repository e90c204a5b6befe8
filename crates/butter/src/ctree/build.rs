//! The one tree builder: whole tree blocks made from sorted items, for the writers that lay
//! out a tree at once instead of editing one in place — mkfs (every tree of a new filesystem)
//! and the fsync log (the log trees, rewritten leaf by leaf). Both encode their leaves and
//! nodes here, pack items into leaves with [`pack`], and the log stacks nodes over its leaves
//! with [`upper_levels`].

use crate::ctree::ops::{finalize, LeafMut, NewHeader, NodeMut};
use crate::error::{Error, Result};
use crate::format::csum::CsumType;
use crate::format::*;

/// The items of one leaf: (key, item data), ascending keys.
pub(crate) type Items = Vec<(Key, Vec<u8>)>;

/// A leaf of `nodesize` bytes with header `h`, holding `items` (ascending keys) in slot order,
/// checksummed.
pub(crate) fn leaf(
    nodesize: usize,
    h: &NewHeader,
    items: &[(Key, Vec<u8>)],
    csum_type: CsumType,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; nodesize];
    {
        let mut leaf = LeafMut::init(&mut buf, h)?;
        let specs: Vec<(Key, usize)> = items.iter().map(|(k, v)| (*k, v.len())).collect();
        leaf.insert_items(0, &specs)?;
        for (slot, (_, v)) in items.iter().enumerate() {
            leaf.item_data_mut(slot)?.copy_from_slice(v);
        }
    }
    finalize(&mut buf, csum_type)?;
    Ok(buf)
}

/// A node of `nodesize` bytes at `level` (1 or more) with header `h`, pointing at `ptrs`
/// (first key, child block) in slot order, every child stamped with `h.generation`,
/// checksummed.
pub(crate) fn node(
    nodesize: usize,
    level: u8,
    h: &NewHeader,
    ptrs: &[(Key, u64)],
    csum_type: CsumType,
) -> Result<Vec<u8>> {
    let mut buf = vec![0u8; nodesize];
    {
        let mut node = NodeMut::init(&mut buf, level, h)?;
        for (slot, (k, child)) in ptrs.iter().enumerate() {
            node.insert_ptr(slot, *k, *child, h.generation)?;
        }
    }
    finalize(&mut buf, csum_type)?;
    Ok(buf)
}

/// Items (ascending keys) packed greedily into as few leaves of `nodesize` bytes as they
/// need, in order. An item too big for any leaf is an internal error: callers make items
/// that fit.
pub(crate) fn pack(items: Items, nodesize: usize) -> Result<Vec<Items>> {
    let cap = nodesize - HEADER_SIZE;
    let mut groups: Vec<Items> = Vec::new();
    let mut used = cap;
    for (k, v) in items {
        let need = ITEM_SIZE + v.len();
        if need > cap {
            return Err(Error::Internal(format!(
                "item {k} of {} bytes does not fit a leaf",
                v.len()
            )));
        }
        if used + need > cap {
            groups.push(Vec::new());
            used = 0;
        }
        used += need;
        if let Some(g) = groups.last_mut() {
            g.push((k, v));
        }
    }
    Ok(groups)
}

/// Stacks nodes over the blocks `ptrs` (first key, block) of one level until one root is
/// left: each node gets a block from `new_block` and is appended to `out`, and its address
/// to `nodes`. Returns the root (block, level); `ptrs` must not be empty.
pub(crate) fn upper_levels(
    mut ptrs: Vec<(Key, u64)>,
    nodesize: usize,
    csum_type: CsumType,
    new_block: &mut dyn FnMut() -> Result<(u64, NewHeader)>,
    out: &mut Vec<(u64, Vec<u8>)>,
    nodes: &mut Vec<u64>,
) -> Result<(u64, u8)> {
    let Some(&(_, first)) = ptrs.first() else {
        return Err(Error::Internal("a tree of no blocks has no root".into()));
    };
    if ptrs.len() == 1 {
        return Ok((first, 0));
    }
    let max_ptrs = (nodesize - HEADER_SIZE) / KEY_PTR_SIZE;
    let mut level = 0u8;
    while ptrs.len() > 1 {
        level += 1;
        if level >= MAX_LEVEL {
            return Err(Error::Internal("tree too tall".into()));
        }
        let mut next = Vec::new();
        for chunk in ptrs.chunks(max_ptrs) {
            let (bytenr, h) = new_block()?;
            out.push((bytenr, node(nodesize, level, &h, chunk, csum_type)?));
            nodes.push(bytenr);
            next.push((chunk[0].0, bytenr));
        }
        ptrs = next;
    }
    Ok((ptrs[0].1, level))
}
