//! Consistency checks of the whole directory, for tests: every derived structure (held-children
//! counts, eviction index, rooted flags and counts, wide lists, orphan and placeholder counters,
//! refcounts) recomputed from scratch and compared. O(blocks × holders).

use hashbrown::HashMap;

use crate::directory::Directory;
use crate::eviction::EvKey;
use crate::holder_list::Holder;
use crate::table::{Block, NIL};
use crate::wide::Kind;
use crate::{BlockHash, Place, Tier};

impl Directory {
    pub(crate) fn for_each_block(&self, mut f: impl FnMut(u32, &Block)) {
        // Reached through the places' candidates would miss unheld blocks; walk the slab.
        let mut idx = 0u32;
        while (idx as usize) < self.blocks.slab_len() {
            if self.blocks.is_live(idx) {
                f(idx, self.blocks.get(idx));
            }
            idx += 1;
        }
    }

    /// Checks every invariant of the module docs; panics with a message on the first violation.
    /// O(blocks × holders); for tests.
    #[doc(hidden)]
    #[allow(clippy::too_many_lines, reason = "one checklist, read top to bottom")]
    pub fn check_invariants(&self) {
        let mut expected: HashMap<Place, Vec<EvKey>> = HashMap::new();
        let mut held: HashMap<Place, u64> = HashMap::new();
        let mut orphans: HashMap<Place, u64> = HashMap::new();
        self.for_each_block(|idx, b| {
            let hash = self.blocks.hash(idx);
            assert_eq!(self.blocks.find(hash), Some(idx), "table entry of {hash}");
            assert_eq!(
                self.blocks.chained(idx),
                b.parent != NIL && b.parent + 1 == idx,
                "chained flag of {hash}"
            );
            assert_eq!(
                self.blocks.held(idx),
                !b.holders.is_empty(),
                "held flag of {hash}"
            );
            assert!(
                !b.holders.is_empty() || b.refcount > 0 || b.first_child != NIL,
                "garbage block {hash} survived"
            );
            assert!(
                b.holders.windows(2).all(|w| w[0].place < w[1].place),
                "holders sorted"
            );
            assert!(
                b.holders.is_tight(),
                "holders of {hash} keep spare room between calls"
            );
            let parent = (b.parent != NIL).then(|| self.blocks.get(b.parent));
            let (mut full_l1, mut full_node) = (0, 0);
            for (i, h) in b.holders.iter().enumerate() {
                let node = h.place.node();
                let want_tier = h.place.tier() == Tier::L1
                    && parent.is_none_or(|p| p.holder(h.place).is_some_and(Holder::root_tier));
                assert_eq!(
                    h.root_tier(),
                    want_tier,
                    "root_tier of {hash} at {:?}",
                    h.place
                );
                let want_node = parent.is_none_or(|p| {
                    p.node_entries(node)
                        .next()
                        .is_some_and(|j| p.holders[j].root_node())
                });
                assert_eq!(
                    h.root_node(),
                    want_node,
                    "root_node of {hash} at {:?}",
                    h.place
                );
                full_l1 += u32::from(h.root_tier());
                let first_of_node = i == 0 || b.holders[i - 1].place.node() != node;
                full_node += u32::from(h.root_node() && first_of_node);
                let n = self
                    .blocks
                    .children(idx)
                    .filter(|&c| self.blocks.get(c).holder(h.place).is_some())
                    .count() as u32;
                assert_eq!(
                    h.held_children(),
                    n,
                    "held_children of {hash} at {:?}",
                    h.place
                );
                *held.entry(h.place).or_default() += 1;
                if parent.is_some_and(|p| p.holder(h.place).is_none()) {
                    *orphans.entry(h.place).or_default() += 1;
                }
                if n == 0 {
                    expected.entry(h.place).or_default().push(self.key(idx, h));
                }
            }
            self.wide.check(
                idx,
                hash,
                b,
                [Kind::Node, Kind::L1].map(|k| self.blocks.has_wide(idx, k)),
            );
            assert_eq!(
                (b.full_l1, b.full_node),
                (full_l1, full_node),
                "full counts of {hash}"
            );
            if b.parent == NIL {
                assert_eq!(b.depth, 0);
            } else {
                let p = self.blocks.get(b.parent);
                assert_eq!(b.depth, p.depth + 1, "depth of {hash}");
                assert!(
                    self.blocks.children(b.parent).any(|c| c == idx),
                    "child link of {hash}"
                );
            }
        });
        let live = (0..self.blocks.slab_len() as u32)
            .filter(|&idx| self.blocks.is_live(idx))
            .count();
        assert_eq!(live, self.blocks.len(), "live slots against the index");
        let mut unheld = 0;
        self.for_each_block(|_, b| unheld += usize::from(b.holders.is_empty()));
        assert_eq!(unheld, self.blocks.unheld(), "placeholder count");
        assert_eq!(held.len(), self.places.len(), "places with holdings");
        for (place, s) in &self.places {
            assert_eq!(Some(&s.held), held.get(place), "held count at {place:?}");
            let want = orphans.get(place).copied().unwrap_or(0);
            assert_eq!(s.orphans, want, "orphans at {place:?}");
            let mut want = expected.remove(place).unwrap_or_default();
            want.sort_unstable();
            let got: Vec<EvKey> = s.candidates.iter().copied().collect();
            assert_eq!(got, want, "candidates at {place:?}");
        }
        assert!(expected.is_empty(), "candidates of places without state");
        let mut refs: HashMap<u32, u32> = HashMap::new();
        for b in self.branches.values() {
            for &i in &b.context {
                *refs.entry(i).or_default() += 1;
            }
            let hashes: Vec<BlockHash> = b.context.iter().map(|&i| self.blocks.hash(i)).collect();
            assert_eq!(b.hashes, hashes, "a branch's hashes are its context's");
        }
        self.for_each_block(|idx, b| {
            assert_eq!(
                b.refcount,
                refs.get(&idx).copied().unwrap_or(0),
                "refcount of {}",
                self.blocks.hash(idx)
            );
        });
    }
}
