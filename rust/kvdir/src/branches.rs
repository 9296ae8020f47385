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

/// A live branch: its context (slab indices, first page first, and the same blocks' hashes) and
/// version.
///
/// NOTE: the hashes are kept (8 bytes a block) so that `branch_set` finds the part of a new
/// context the old one already had by comparing two arrays: an agent's next context usually
/// extends its last one, and looking every block of a ~400-block context up (twice: validation,
/// then indices) was most of a call, a cache miss each in a large directory.
#[derive(Debug, Clone)]
pub(crate) struct Branch {
    pub(crate) version: i64,
    pub(crate) context: Vec<u32>,
    pub(crate) hashes: Vec<BlockHash>,
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
        let current = self.branches.get(&branch);
        // The old context's blocks are live (it counts in them) and chained, so the shared
        // prefix is valid; the rest is valid under it exactly when the whole chain is (a block
        // repeated from the prefix breaks its parent link). Only a refusal re-checks all of it,
        // so that it names the problem the full check finds first.
        let common = current.map_or(0, |b| {
            b.hashes
                .iter()
                .zip(hashes)
                .take_while(|(a, b)| a == b)
                .count()
        });
        let under = common.checked_sub(1).map(|i| hashes[i]);
        if self.validate_chain(under, &hashes[common..]).is_err() {
            self.validate_chain(None, hashes)?;
        }
        let version = match (current.map(|b| b.version), version) {
            (Some(cur), Some(v)) if v < cur => return Ok(false),
            (_, Some(v)) => v,
            (Some(cur), None) => cur.saturating_add(1),
            (None, None) => 0,
        };
        let old = self
            .branches
            .remove(&branch)
            .map(|b| b.context)
            .unwrap_or_default();
        let mut context = Vec::with_capacity(hashes.len());
        context.extend_from_slice(&old[..common]);
        let mut prev = context.last().copied().unwrap_or(NIL);
        let tail = &hashes[common..];
        for (i, &h) in tail.iter().enumerate() {
            self.blocks.prefetch_walk(tail, i);
            prev = self.find_or_insert(h, prev);
            context.push(prev);
        }
        // Contexts are chains from a first page, so after their first difference they share no
        // block: only the two tails change counts. New counts go up before old ones go down so a
        // block in neither tail is never collected in between.
        for &idx in &context[common..] {
            let r = self.blocks.get(idx).refcount;
            self.set_refcount(idx, r + 1);
        }
        self.release(&old[common..]);
        let hashes = hashes.to_vec();
        self.branches.insert(
            branch,
            crate::branches::Branch {
                version,
                context,
                hashes,
            },
        );
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
