//! A clean-room reference model of DESIGN §2, written for clarity, not speed: plain maps, a
//! fixed-point garbage pass after every call, and eviction order sorted on every call. The
//! differential test runs it side by side with `kvdir::Directory`.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kvdir::{BranchId, Error, Tier};

type Place = (u32, Tier);

#[derive(Default, Clone)]
pub struct Reference {
    /// Known blocks and their parents.
    pub parent: BTreeMap<i64, Option<i64>>,
    /// Place → held block → last-access time.
    pub held: BTreeMap<Place, BTreeMap<i64, f64>>,
    pub branches: HashMap<BranchId, (i64, Vec<i64>)>,
    /// While applying a batch: garbage is collected at its end.
    in_batch: bool,
}

fn discriminant(e: &Error) -> std::mem::Discriminant<Error> {
    std::mem::discriminant(e)
}

/// Same error kind (the payload may differ when several problems exist at once).
pub fn same_kind(a: &Error, b: &Error) -> bool {
    discriminant(a) == discriminant(b)
}

impl Reference {
    pub fn refcount(&self, h: i64) -> u32 {
        self.branches
            .values()
            .filter(|(_, ctx)| ctx.contains(&h))
            .count() as u32
    }

    fn depth(&self, mut h: i64) -> u32 {
        let mut d = 0;
        while let Some(Some(p)) = self.parent.get(&h) {
            d += 1;
            h = *p;
        }
        d
    }

    fn held_anywhere(&self, h: i64) -> bool {
        self.held.values().any(|m| m.contains_key(&h))
    }

    fn gc(&mut self) {
        if self.in_batch {
            return;
        }
        loop {
            let parents: BTreeSet<i64> = self.parent.values().filter_map(|p| *p).collect();
            let garbage: Vec<i64> = self
                .parent
                .keys()
                .copied()
                .filter(|&h| {
                    !parents.contains(&h) && !self.held_anywhere(h) && self.refcount(h) == 0
                })
                .collect();
            if garbage.is_empty() {
                return;
            }
            for h in garbage {
                self.parent.remove(&h);
            }
        }
    }

    pub fn validate(
        &self,
        parent: Option<i64>,
        hashes: &[i64],
        overlay: &mut BTreeMap<i64, Option<i64>>,
    ) -> Result<(), Error> {
        let known = |h: i64| {
            self.parent
                .get(&h)
                .copied()
                .or_else(|| overlay.get(&h).copied())
        };
        if let Some(p) = parent {
            if known(p).is_none() {
                return Err(Error::UnknownParent { parent: p });
            }
        }
        let mut seen = BTreeSet::new();
        for &h in hashes.iter().chain(parent.iter()) {
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

    pub fn store(
        &mut self,
        node: u32,
        tier: Tier,
        hashes: &[i64],
        parent: Option<i64>,
        now: f64,
    ) -> Result<(), Error> {
        self.validate(parent, hashes, &mut BTreeMap::new())?;
        self.store_valid(node, tier, hashes, parent, now);
        self.gc();
        Ok(())
    }

    fn store_valid(
        &mut self,
        node: u32,
        tier: Tier,
        hashes: &[i64],
        parent: Option<i64>,
        now: f64,
    ) {
        let mut prev = parent;
        for &h in hashes {
            self.parent.entry(h).or_insert(prev);
            self.held.entry((node, tier)).or_default().insert(h, now);
            prev = Some(h);
        }
    }

    pub fn remove(&mut self, node: u32, tier: Tier, hashes: &[i64]) {
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

    pub fn clear(&mut self, node: u32, tier: Option<Tier>) {
        for t in Tier::ALL {
            if tier.is_none_or(|x| x == t) {
                self.held.remove(&(node, t));
            }
        }
        self.gc();
    }

    fn is_first_page_walk(&self, hashes: &[i64], mut keep: impl FnMut(usize, i64) -> bool) {
        let mut prev = None;
        for (i, &h) in hashes.iter().enumerate() {
            match self.parent.get(&h) {
                Some(&p) if p == prev => {}
                _ => return,
            }
            if !keep(i, h) {
                return;
            }
            prev = Some(h);
        }
    }

    /// (nodes → (l1, l12), pool, cluster)
    pub fn match_prefix(&self, hashes: &[i64]) -> (BTreeMap<u32, (u32, u32)>, u32, u32) {
        let holds = |node: u32, tier: Tier, h: i64| {
            self.held
                .get(&(node, tier))
                .is_some_and(|m| m.contains_key(&h))
        };
        let count = |pred: &dyn Fn(i64) -> bool| {
            let mut n = 0;
            self.is_first_page_walk(hashes, |_, h| {
                let ok = pred(h);
                n += u32::from(ok);
                ok
            });
            n
        };
        let nodes: BTreeSet<u32> = self.held.keys().map(|p| p.0).collect();
        let mut out = BTreeMap::new();
        for node in nodes {
            let l1 = count(&|h| holds(node, Tier::L1, h));
            let l12 = count(&|h| holds(node, Tier::L1, h) || holds(node, Tier::L2, h));
            if l12 > 0 {
                out.insert(node, (l1, l12));
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

    pub fn touch(&mut self, node: u32, hashes: &[i64], now: f64) {
        let mut touched = Vec::new();
        self.is_first_page_walk(hashes, |_, h| {
            let tiers: Vec<Tier> = Tier::ALL
                .into_iter()
                .filter(|&t| {
                    self.held
                        .get(&(node, t))
                        .is_some_and(|m| m.contains_key(&h))
                })
                .collect();
            let any = !tiers.is_empty();
            touched.extend(tiers.into_iter().map(|t| (t, h)));
            any
        });
        for (t, h) in touched {
            self.held.get_mut(&(node, t)).unwrap().insert(h, now);
        }
    }

    pub fn eviction_order(&self, node: u32, tier: Tier) -> Vec<i64> {
        let Some(m) = self.held.get(&(node, tier)) else {
            return vec![];
        };
        let mut cands: Vec<(bool, f64, i64, i64)> = m
            .iter()
            .filter(|(h, _)| !m.keys().any(|c| self.parent.get(c) == Some(&Some(**h))))
            .map(|(&h, &t)| (self.refcount(h) > 0, t, -i64::from(self.depth(h)), h))
            .collect();
        cands.sort_by(|a, b| a.partial_cmp(b).unwrap());
        cands.into_iter().map(|c| c.3).collect()
    }

    pub fn evict(&mut self, node: u32, tier: Tier, n: usize) -> Vec<i64> {
        let mut out = vec![];
        while out.len() < n {
            let Some(&h) = self.eviction_order(node, tier).first() else {
                break;
            };
            self.remove(node, tier, &[h]);
            out.push(h);
        }
        out
    }

    pub fn branch_set(
        &mut self,
        b: BranchId,
        hashes: &[i64],
        version: Option<i64>,
    ) -> Result<bool, Error> {
        self.validate(None, hashes, &mut BTreeMap::new())?;
        let cur = self.branches.get(&b).map(|x| x.0);
        let v = match (cur, version) {
            (Some(c), Some(v)) if v < c => return Ok(false),
            (_, Some(v)) => v,
            (Some(c), None) => c + 1,
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

    pub fn branch_end(&mut self, b: &BranchId) -> bool {
        let had = self.branches.remove(b).is_some();
        self.gc();
        had
    }

    /// Applies decoded events with DESIGN §4's medium mapping; garbage waits for the batch end.
    pub fn apply(&mut self, node: u32, events: &[RefEvent], now: f64) -> Result<usize, Error> {
        let mut overlay = BTreeMap::new();
        for e in events {
            if let RefEvent::Stored(hs, p, Some(_)) = e {
                self.validate(*p, hs, &mut overlay)?;
            }
        }
        self.in_batch = true;
        let mut n = 0;
        for e in events {
            match e {
                RefEvent::Stored(hs, p, Some(t)) => self.store_valid(node, *t, hs, *p, now),
                RefEvent::Removed(hs, Some(t)) => self.remove(node, *t, hs),
                RefEvent::Cleared => self.clear(node, None),
                _ => continue,
            }
            n += 1;
        }
        self.in_batch = false;
        self.gc();
        Ok(n)
    }
}

#[derive(Debug, Clone)]
pub enum RefEvent {
    Stored(Vec<i64>, Option<i64>, Option<Tier>),
    Removed(Vec<i64>, Option<Tier>),
    Cleared,
}
