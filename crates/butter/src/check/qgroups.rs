//! Quota groups: the counts each qgroup item holds against what the trees reference.

use super::*;

impl Checker<'_> {
    /// Quota groups: each QGROUP_INFO's referenced and exclusive bytes against the extents its
    /// subvolumes reach (tree blocks through the trees that reach them, data through the file
    /// extent items of those trees' leaves). Skipped while a rescan is pending or the numbers
    /// are flagged inconsistent (the kernel recomputes them), and for simple quotas.
    pub(super) fn check_qgroups(&mut self) {
        const STATUS_RESCAN: u64 = 1 << 1;
        const STATUS_INCONSISTENT: u64 = 1 << 2;
        const STATUS_SIMPLE: u64 = 1 << 3;
        let Some(root) = self.tree(QUOTA_TREE_OBJECTID) else {
            return;
        };
        let items = self.collect_items(root, |k| {
            matches!(
                k.ty,
                QGROUP_STATUS_KEY | QGROUP_INFO_KEY | QGROUP_RELATION_KEY
            )
        });
        let mut status = None;
        let mut infos: Vec<(u64, [u64; 4], Location)> = Vec::new();
        // parent -> children
        let mut children: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for it in &items {
            let loc = item_loc(it, QUOTA_TREE_OBJECTID);
            let d = it.data();
            match it.key.ty {
                QGROUP_STATUS_KEY if d.len() >= 32 => status = Some(le_u64(d, 16)),
                QGROUP_INFO_KEY if d.len() >= 40 => infos.push((
                    it.key.offset,
                    [le_u64(d, 8), le_u64(d, 16), le_u64(d, 24), le_u64(d, 32)],
                    loc,
                )),
                QGROUP_RELATION_KEY if d.is_empty() => {
                    // Both directions are stored; (child, parent) has child < parent.
                    if it.key.objectid < it.key.offset {
                        children
                            .entry(it.key.offset)
                            .or_default()
                            .push(it.key.objectid);
                    }
                }
                _ => self.report.err(
                    FindingKind::QgroupMismatch,
                    loc,
                    format!("quota item {} has a bad size {}", it.key, d.len()),
                ),
            }
        }
        let Some(flags) = status else {
            if !infos.is_empty() {
                self.report.err(
                    FindingKind::QgroupMismatch,
                    Location::what("quota tree"),
                    "quota groups without a QGROUP_STATUS item".into(),
                );
            }
            return;
        };
        if flags & (STATUS_RESCAN | STATUS_INCONSISTENT | STATUS_SIMPLE) != 0
            || self.sb.has_incompat(INCOMPAT_SIMPLE_QUOTA)
            || !self.dropping.is_empty()
        {
            return;
        }
        // Subvolume trees (relocation trees' tags lie in the same number range: not them).
        let subvol = |t: u64| {
            !is_reloc_tag(t)
                && (t == FS_TREE_OBJECTID
                    || (FIRST_FREE_OBJECTID..=LAST_FREE_OBJECTID).contains(&t))
        };
        // Subvolumes reaching each extent, and its size.
        let mut per_extent: Vec<(u64, Vec<u64>)> = Vec::new();
        for rec in self.blocks.values() {
            let mut roots: Vec<u64> = rec.reach.iter().copied().filter(|t| subvol(*t)).collect();
            roots.sort_unstable();
            roots.dedup();
            if !roots.is_empty() {
                per_extent.push((self.fs.disk.nodesize() as u64, roots));
            }
        }
        let mut data_roots: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for fe in &self.file_exts {
            if let Some(l) = self.blocks.get(&fe.leaf) {
                data_roots
                    .entry(fe.disk_bytenr)
                    .or_default()
                    .extend(l.reach.iter().copied().filter(|t| subvol(*t)));
            }
        }
        for (b, mut roots) in data_roots {
            let Some(e) = self.extents.get(&b) else {
                continue;
            };
            roots.sort_unstable();
            roots.dedup();
            if !roots.is_empty() {
                per_extent.push((e.len, roots));
            }
        }
        // Level-0 members of each qgroup (a level-0 group is its own member).
        fn members(q: u64, children: &BTreeMap<u64, Vec<u64>>, out: &mut HashSet<u64>, depth: u32) {
            if q >> 48 == 0 {
                out.insert(q);
                return;
            }
            if depth > 8 {
                return;
            }
            for c in children.get(&q).map(|v| v.as_slice()).unwrap_or(&[]) {
                members(*c, children, out, depth + 1);
            }
        }
        for (q, [rfer, rfer_c, excl, excl_c], loc) in infos {
            let mut m = HashSet::default();
            members(q, &children, &mut m, 0);
            let (mut want_rfer, mut want_excl) = (0u64, 0u64);
            for (len, roots) in &per_extent {
                if roots.iter().any(|r| m.contains(r)) {
                    want_rfer += len;
                    if roots.iter().all(|r| m.contains(r)) {
                        want_excl += len;
                    }
                }
            }
            if (rfer, rfer_c, excl, excl_c) != (want_rfer, want_rfer, want_excl, want_excl) {
                self.report.err_fix(
                    FindingKind::QgroupMismatch,
                    loc,
                    format!(
                        "qgroup {}/{}: referenced {rfer} (compressed {rfer_c}), exclusive {excl} (compressed {excl_c}), but its subvolumes reach {want_rfer} referenced and {want_excl} exclusive bytes",
                        q >> 48,
                        q & ((1 << 48) - 1)
                    ),
                    Fix::QgroupsInconsistent,
                );
            }
        }
    }
}
