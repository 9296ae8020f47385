//! A reference model of the directory (DESIGN §2), as plain as it can be: ordered maps, garbage
//! collected to a fixed point after every call, eviction order sorted on every call. Fine for the
//! few dozen blocks a test or fuzz input builds; quadratic and worse beyond that.
//!
//! Written from the design, not from `kvdir`'s code, so that a bug shared by the two would have
//! to be made twice. The one model both the differential test (`kvdir/tests/differential.rs`)
//! and the fuzz targets (`kvdir/fuzz`) compare `kvdir::Directory` against.

#![allow(
    clippy::missing_panics_doc,
    reason = "a test oracle: its panics are broken invariants of its own, not errors to document"
)]

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kvdir::{BlockHash, BranchId, Error, NodeId, Tier};

/// A decoded event as the model applies it (tier already mapped from the medium).
#[derive(Debug, Clone, PartialEq)]
pub enum ModelEvent {
    /// `BlockStored`; `None` tier: DISK, EXTERNAL or an unknown medium (skipped).
    Stored(Vec<BlockHash>, Option<BlockHash>, Option<Tier>),
    /// `BlockRemoved`.
    Removed(Vec<BlockHash>, Option<Tier>),
    /// `AllBlocksCleared`.
    Cleared,
    /// An event type nobody knows (skipped).
    Unknown,
}

/// What `match` returns: node → (l1, l12) for nodes with l12 > 0, pool, cluster.
pub type ModelMatch = (BTreeMap<NodeId, (u32, u32)>, u32, u32);

/// The model's state.
#[derive(Debug, Default, Clone)]
pub struct Model {
    /// Known blocks and their recorded parents.
    pub parent: BTreeMap<BlockHash, Option<BlockHash>>,
    /// (node, tier) → held block → last-access time. No empty inner maps.
    pub held: BTreeMap<(NodeId, Tier), BTreeMap<BlockHash, f64>>,
    /// Live branches: version and context.
    pub branches: HashMap<BranchId, (i64, Vec<BlockHash>)>,
    /// Events `apply` skipped (medium not a tier, unknown type).
    pub events_skipped: u64,
    /// Inside `apply`: garbage waits for the end of the batch.
    in_batch: bool,
}

/// Same error kind (the payload may differ when several problems exist at once).
#[must_use]
pub fn same_kind(a: &Error, b: &Error) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

fn time(now: f64) -> Result<f64, Error> {
    if now.is_finite() {
        Ok(now + 0.0)
    } else {
        Err(Error::InvalidArgument {
            argument: "now",
            reason: "not finite".into(),
        })
    }
}

impl Model {
    /// Live branches whose context contains `h`.
    #[must_use]
    pub fn refcount(&self, h: BlockHash) -> u32 {
        self.branches
            .values()
            .filter(|(_, c)| c.contains(&h))
            .count() as u32
    }

    fn holds(&self, node: NodeId, tier: Tier, h: BlockHash) -> bool {
        self.held
            .get(&(node, tier))
            .is_some_and(|m| m.contains_key(&h))
    }

    fn held_anywhere(&self, h: BlockHash) -> bool {
        self.held.values().any(|m| m.contains_key(&h))
    }

    fn depth(&self, mut h: BlockHash) -> i64 {
        let mut d = 0;
        while let Some(Some(p)) = self.parent.get(&h) {
            d += 1;
            h = *p;
        }
        d
    }

    fn is_garbage(&self, h: BlockHash, children: &BTreeMap<BlockHash, u32>) -> bool {
        !children.contains_key(&h) && !self.held_anywhere(h) && self.refcount(h) == 0
    }

    /// Drops blocks nobody holds, no branch needs and with no children, then their parents if
    /// they became garbage, and so on.
    fn gc(&mut self) {
        if self.in_batch {
            return;
        }
        let mut children: BTreeMap<BlockHash, u32> = BTreeMap::new();
        for p in self.parent.values().flatten() {
            *children.entry(*p).or_default() += 1;
        }
        let mut work: Vec<BlockHash> = self
            .parent
            .keys()
            .copied()
            .filter(|&h| self.is_garbage(h, &children))
            .collect();
        while let Some(h) = work.pop() {
            let Some(p) = self.parent.remove(&h) else {
                continue;
            };
            if let Some(p) = p {
                let c = children.get_mut(&p).expect("parent counted");
                *c -= 1;
                if *c == 0 {
                    children.remove(&p);
                    if self.is_garbage(p, &children) {
                        work.push(p);
                    }
                }
            }
        }
    }

    /// Is `hashes` under `parent` consistent with the forest (and with the blocks `overlay` says
    /// earlier events of a batch create)? Adds the blocks the chain creates to `overlay`.
    /// Checked in the order unknown parent, repeated hash, parent mismatch.
    pub fn validate(
        &self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        overlay: &mut BTreeMap<BlockHash, Option<BlockHash>>,
    ) -> Result<(), Error> {
        let known = |h: BlockHash| self.parent.get(&h).or_else(|| overlay.get(&h)).copied();
        if let Some(p) = parent {
            if known(p).is_none() {
                return Err(Error::UnknownParent { parent: p });
            }
        }
        let mut seen = BTreeSet::new();
        for &h in parent.iter().chain(hashes) {
            if !seen.insert(h) {
                return Err(Error::DuplicateHash { hash: h });
            }
        }
        let mut prev = parent;
        let mut created = Vec::new();
        for &h in hashes {
            match known(h) {
                Some(k) if k != prev => {
                    return Err(Error::ParentMismatch {
                        hash: h,
                        parent: prev,
                        known_parent: k,
                    })
                }
                Some(_) => {}
                None => created.push((h, prev)),
            }
            prev = Some(h);
        }
        overlay.extend(created);
        Ok(())
    }

    fn put(
        &mut self,
        node: NodeId,
        tier: Tier,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        now: f64,
    ) {
        let mut prev = parent;
        for &h in hashes {
            self.parent.entry(h).or_insert(prev);
            self.held.entry((node, tier)).or_default().insert(h, now);
            prev = Some(h);
        }
    }

    /// `store`.
    pub fn store(
        &mut self,
        node: NodeId,
        tier: Tier,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        now: f64,
    ) -> Result<(), Error> {
        let now = time(now)?;
        self.validate(parent, hashes, &mut BTreeMap::new())?;
        self.put(node, tier, hashes, parent, now);
        Ok(())
    }

    /// `remove`: hashes not held are ignored.
    pub fn remove(&mut self, node: NodeId, tier: Tier, hashes: &[BlockHash]) {
        if let Some(m) = self.held.get_mut(&(node, tier)) {
            for h in hashes {
                m.remove(h);
            }
            if m.is_empty() {
                self.held.remove(&(node, tier));
            }
        }
        self.gc();
    }

    /// `clear`.
    pub fn clear(&mut self, node: NodeId, tier: Option<Tier>) {
        for t in Tier::ALL {
            if tier.is_none_or(|x| x == t) {
                self.held.remove(&(node, t));
            }
        }
        self.gc();
    }

    /// The leading query blocks that are known and chained from a first page.
    fn walk(&self, hashes: &[BlockHash]) -> Vec<BlockHash> {
        let mut prev = None;
        let mut out = Vec::new();
        for &h in hashes {
            if self.parent.get(&h) != Some(&prev) {
                break;
            }
            out.push(h);
            prev = Some(h);
        }
        out
    }

    /// `match`.
    #[must_use]
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> ModelMatch {
        let path = self.walk(hashes);
        let count =
            |pred: &dyn Fn(BlockHash) -> bool| path.iter().take_while(|&&h| pred(h)).count() as u32;
        let nodes: BTreeSet<NodeId> = self.held.keys().map(|&(n, _)| n).collect();
        let mut out = BTreeMap::new();
        for n in nodes {
            let l1 = count(&|h| self.holds(n, Tier::L1, h));
            let l12 = count(&|h| self.holds(n, Tier::L1, h) || self.holds(n, Tier::L2, h));
            if l12 > 0 {
                out.insert(n, (l1, l12));
            }
        }
        let pool = count(&|h| {
            self.held
                .iter()
                .any(|(p, m)| p.1 == Tier::L2 && m.contains_key(&h))
        });
        let cluster = count(&|h| self.held_anywhere(h));
        (out, pool, cluster)
    }

    /// `touch`.
    pub fn touch(&mut self, node: NodeId, hashes: &[BlockHash], now: f64) -> Result<(), Error> {
        let now = time(now)?;
        for h in self.walk(hashes) {
            let tiers: Vec<Tier> = Tier::ALL
                .into_iter()
                .filter(|&t| self.holds(node, t, h))
                .collect();
            if tiers.is_empty() {
                break;
            }
            for t in tiers {
                self.held.get_mut(&(node, t)).expect("held").insert(h, now);
            }
        }
        Ok(())
    }

    /// `eviction_order` without a limit.
    #[must_use]
    pub fn eviction_order(&self, node: NodeId, tier: Tier) -> Vec<BlockHash> {
        let Some(m) = self.held.get(&(node, tier)) else {
            return Vec::new();
        };
        // Blocks with a child held here are not candidates.
        let inner: BTreeSet<BlockHash> = m.keys().filter_map(|c| self.parent[c]).collect();
        let mut keys: Vec<(bool, f64, i64, BlockHash)> = m
            .iter()
            .filter(|(h, _)| !inner.contains(h))
            .map(|(&h, &t)| (self.refcount(h) > 0, t, -self.depth(h), h))
            .collect();
        keys.sort_by(|a, b| a.partial_cmp(b).expect("finite times"));
        keys.into_iter().map(|k| k.3).collect()
    }

    /// `evict`.
    pub fn evict(&mut self, node: NodeId, tier: Tier, n: usize) -> Vec<BlockHash> {
        let mut out = Vec::new();
        while out.len() < n {
            let Some(&h) = self.eviction_order(node, tier).first() else {
                break;
            };
            self.remove(node, tier, &[h]);
            out.push(h);
        }
        out
    }

    /// `branch_set`.
    pub fn branch_set(
        &mut self,
        b: BranchId,
        hashes: &[BlockHash],
        version: Option<i64>,
    ) -> Result<bool, Error> {
        self.validate(None, hashes, &mut BTreeMap::new())?;
        let cur = self.branches.get(&b).map(|x| x.0);
        let v = match (cur, version) {
            (Some(c), Some(v)) if v < c => return Ok(false),
            (_, Some(v)) => v,
            (Some(c), None) => c.saturating_add(1),
            (None, None) => 0,
        };
        let mut prev = None;
        for &h in hashes {
            self.parent.entry(h).or_insert(prev);
            prev = Some(h);
        }
        self.branches.insert(b, (v, hashes.to_vec()));
        self.gc();
        Ok(true)
    }

    /// `branch_fork`.
    pub fn branch_fork(&mut self, src: &BranchId, dst: BranchId) -> Result<(), Error> {
        let Some(s) = self.branches.get(src).cloned() else {
            return Err(Error::UnknownBranch {
                branch: src.to_string(),
            });
        };
        if self.branches.contains_key(&dst) {
            return Err(Error::BranchExists {
                branch: dst.to_string(),
            });
        }
        self.branches.insert(dst, s);
        Ok(())
    }

    /// `branch_end`.
    pub fn branch_end(&mut self, b: &BranchId) -> bool {
        let had = self.branches.remove(b).is_some();
        self.gc();
        had
    }

    /// `apply_events` on a decoded batch: every store validated first (all or nothing), garbage
    /// collected once at the end.
    pub fn apply(&mut self, node: NodeId, events: &[ModelEvent], now: f64) -> Result<usize, Error> {
        let now = time(now)?;
        let mut overlay = BTreeMap::new();
        for e in events {
            if let ModelEvent::Stored(hs, p, Some(_)) = e {
                self.validate(*p, hs, &mut overlay)?;
            }
        }
        self.in_batch = true;
        let mut applied = 0;
        for e in events {
            match e {
                ModelEvent::Stored(hs, p, Some(t)) => self.put(node, *t, hs, *p, now),
                ModelEvent::Removed(hs, Some(t)) => self.remove(node, *t, hs),
                ModelEvent::Cleared => self.clear(node, None),
                ModelEvent::Stored(_, _, None)
                | ModelEvent::Removed(_, None)
                | ModelEvent::Unknown => {
                    self.events_skipped += 1;
                    continue;
                }
            }
            applied += 1;
        }
        self.in_batch = false;
        self.gc();
        Ok(applied)
    }

    /// Known blocks no node holds.
    #[must_use]
    pub fn placeholders(&self) -> u64 {
        self.parent
            .keys()
            .filter(|&&h| !self.held_anywhere(h))
            .count() as u64
    }
}
