//! `butter check --repair` on the facade: check, plan, apply in one transaction, check the
//! result before its superblock is written, and write it only when it is better.

use super::Fs;
use crate::check::{repair, Fix, Options, Report};
use crate::error::{Error, Result};

/// How many verified transactions one repair may take (see [`Fs::repair`]).
const REPAIR_ROUNDS: usize = 4;

/// What [`Fs::repair`] found and did.
#[derive(Debug)]
pub struct RepairReport {
    /// The checker's report before.
    pub before: Report,
    /// The changes planned, one per finding the checker knows how to mend (the later
    /// rounds' after the first's).
    pub fixes: Vec<Fix>,
    /// The checker's report on the repaired trees (checked before anything was kept), when
    /// a repair was tried.
    pub after: Option<Report>,
    /// The repair was written (its superblock committed).
    pub committed: bool,
    /// Why nothing was written, where something was tried and refused.
    pub refused: Option<String>,
}

impl Fs {
    /// Checks the filesystem and mends what the checker knows how to (its findings'
    /// [`Fix`]es) in one copy-on-write transaction. Before the new superblock is written,
    /// the checker runs on the new trees; the superblock is written only if it finds
    /// strictly fewer problems and none it did not find before; otherwise nothing is written
    /// (the write engine stops; drop the filesystem without closing it) and
    /// [`RepairReport::refused`] says why. `dry_run`: only check and plan. The filesystem
    /// should be opened with [`super::RwOptions::untouched`], so that nothing else changed it
    /// first.
    pub fn repair(&self, dry_run: bool, progress: &mut dyn FnMut(&str)) -> Result<RepairReport> {
        let before = self.check(Options::default(), progress)?;
        let fixes = repair::plan(&before);
        let held = match repair::unreadable_block(&before) {
            Some(f) if fixes.is_empty() => Some(format!(
                "{}; while a tree block can be neither read nor mended the repair changes \
                 nothing, since the block may hold what other repairs would change or free \
                 (`butter restore` copies out the files that can be read)",
                f.message
            )),
            _ => None,
        };
        let mut out = self.repair_with(before, fixes, dry_run, progress)?;
        if held.is_some() {
            out.refused = held;
            return Ok(out);
        }
        // A repair can uncover what the damage hid (a tree pointed at its newer root shows
        // the references its blocks need): more rounds, each its own verified transaction,
        // while the last one was written and its result has more to mend. A later round that
        // is refused leaves the earlier ones' result.
        for _ in 1..REPAIR_ROUNDS {
            let Some(after) = out.after.as_ref().filter(|_| out.committed) else {
                break;
            };
            let next = repair::plan(after);
            if next.is_empty() {
                break;
            }
            let r = self.repair_with(after.clone(), next, false, progress)?;
            if !r.committed {
                break;
            }
            out.fixes.extend(r.fixes);
            out.after = r.after;
        }
        Ok(out)
    }

    /// [`Fs::repair`] of `fixes` against the report `before` (a test's own fixes, to see a
    /// bad repair refused).
    pub(crate) fn repair_with(
        &self,
        before: Report,
        fixes: Vec<Fix>,
        dry_run: bool,
        progress: &mut dyn FnMut(&str),
    ) -> Result<RepairReport> {
        let mut out = RepairReport {
            before,
            fixes,
            after: None,
            committed: false,
            refused: None,
        };
        if out.fixes.is_empty() || dry_run {
            return Ok(out);
        }
        progress(&format!("repairing: {} changes", out.fixes.len()));
        let (before, fixes) = (&out.before, &out.fixes);
        let mut after = None;
        let mut refused = None;
        let r = self.changing("repair", None, |c| {
            repair::apply(c, fixes)?;
            c.commit_verified(|sb| {
                let candidate = Fs::candidate(&c.disk, sb)?;
                let report = candidate.check(Options::default(), &mut |_| {})?;
                let (new, fewer) = repair::judge(before, &report);
                let why = match new.first() {
                    Some(first) => Some(format!(
                        "the repaired trees would have {} problem(s) the image does not have, \
                         the first: {first}",
                        new.len()
                    )),
                    None if !fewer => {
                        Some("the repaired trees would not have fewer problems".to_string())
                    }
                    None => None,
                };
                after = Some(report);
                match why {
                    None => Ok(()),
                    Some(why) => {
                        refused = Some(why.clone());
                        Err(Error::Invalid(format!("repair not written: {why}")))
                    }
                }
            })
        });
        out.after = after;
        match (r, refused) {
            (Ok(()), _) => out.committed = true,
            (Err(_), Some(why)) => out.refused = Some(why),
            (Err(e), None) => return Err(e),
        }
        Ok(out)
    }
}
