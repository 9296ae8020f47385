//! Agent branches and the per-block count `R_b` of live branches whose context contains the block
//! (DESIGN §2, "Branches"). A branch's context is a chain from a first page; blocks no node holds
//! yet stay in the directory as placeholders so their counts are right when they are stored.

use crate::directory::Directory;
use crate::table::NIL;
use crate::{BlockHash, Error, Result};

/// A branch id as the router names it: an int, or a string such as an `X-Agent-Branch` header.
/// `1` and `"1"` are different branches.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum BranchId {
    /// An integer id.
    Int(i64),
    /// A string id.
    Str(Box<str>),
}

impl std::fmt::Display for BranchId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BranchId::Int(i) => write!(f, "{i}"),
            BranchId::Str(s) => write!(f, "{s:?}"),
        }
    }
}

/// A live branch: its context (slab indices, first page first) and version.
#[derive(Debug, Clone)]
pub(crate) struct Branch {
    pub(crate) version: i64,
    pub(crate) context: Vec<u32>,
}

impl Directory {
    /// The branch's live context is now exactly `hashes`. Returns `false` (and changes nothing)
    /// when `version` is lower than the branch's current version.
    pub fn branch_set(
        &mut self,
        branch: BranchId,
        hashes: &[BlockHash],
        version: Option<i64>,
    ) -> Result<bool> {
        self.validate_chain(None, hashes)?;
        let current = self.branches.get(&branch).map(|b| b.version);
        let version = match (current, version) {
            (Some(cur), Some(v)) if v < cur => return Ok(false),
            (_, Some(v)) => v,
            (Some(cur), None) => cur.saturating_add(1),
            (None, None) => 0,
        };
        let mut context = Vec::with_capacity(hashes.len());
        let mut prev = NIL;
        for &h in hashes {
            prev = self.find_or_insert(h, prev);
            context.push(prev);
        }
        let old = self
            .branches
            .remove(&branch)
            .map(|b| b.context)
            .unwrap_or_default();
        // Contexts are chains from a first page, so after their first difference they share no
        // block: only the two tails change counts. New counts go up before old ones go down so a
        // block in neither tail is never collected in between.
        let common = old.iter().zip(&context).take_while(|(a, b)| a == b).count();
        for &idx in &context[common..] {
            let r = self.blocks.get(idx).refcount;
            self.set_refcount(idx, r + 1);
        }
        self.release(&old[common..]);
        self.branches
            .insert(branch, crate::branches::Branch { version, context });
        Ok(true)
    }

    /// `dst` starts with `src`'s context and version.
    pub fn branch_fork(&mut self, src: &BranchId, dst: BranchId) -> Result<()> {
        let Some(source) = self.branches.get(src) else {
            return Err(Error::UnknownBranch {
                branch: src.to_string(),
            });
        };
        if self.branches.contains_key(&dst) {
            return Err(Error::BranchExists {
                branch: dst.to_string(),
            });
        }
        let forked = source.clone();
        for &idx in &forked.context {
            let r = self.blocks.get(idx).refcount;
            self.set_refcount(idx, r + 1);
        }
        self.branches.insert(dst, forked);
        Ok(())
    }

    /// Ends a branch; `false` if it is unknown.
    pub fn branch_end(&mut self, branch: &BranchId) -> bool {
        match self.branches.remove(branch) {
            Some(b) => {
                self.release(&b.context);
                true
            }
            None => false,
        }
    }

    /// The current version of a branch, if it is live.
    #[must_use]
    pub fn branch_version(&self, branch: &BranchId) -> Option<i64> {
        self.branches.get(branch).map(|b| b.version)
    }

    /// Drops one reference to each block of `chain`, deepest first, collecting garbage.
    fn release(&mut self, chain: &[u32]) {
        for &idx in chain.iter().rev() {
            // Shallower blocks of the chain still count this branch, so collecting a deeper one
            // never drops them before their turn.
            debug_assert!(self.blocks.is_live(idx));
            let r = self.blocks.get(idx).refcount;
            debug_assert!(r > 0);
            self.set_refcount(idx, r - 1);
            self.collect(idx);
        }
    }
}
