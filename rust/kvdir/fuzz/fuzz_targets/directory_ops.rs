//! Fuzz target `directory_ops`: a sequence of directory operations (store, remove, clear, evict,
//! touch, match, eviction order, branches, event batches in both encodings) over a small universe
//! of hashes and nodes, so that chains share prefixes and collide. After every operation:
//! - no panic; a refused call returns a typed error of the same kind as the reference model's and
//!   leaves `stats()` unchanged;
//! - the directory's own invariant checker (`Directory::check_invariants`) passes;
//! - known blocks, refcounts, `match` of every root path, eviction orders, holdings, stats and
//!   branch versions agree with the reference model (`kvdir_fuzz::model`);
//! - an event batch written by `kvdir_fuzz::wire` decodes to exactly the events it encodes.

#![no_main]

use arbitrary::Arbitrary;
use kvdir::events::{decode_batch, Event, EventBatch};
use kvdir::{BlockHash, BranchId, Directory, Error, NodeId, Tier, MAX_NODE};
use kvdir_fuzz::check::{compare, match_of};
use kvdir_fuzz::model::{Model, ModelEvent};
use kvdir_fuzz::wire::{self, IntStyle, V};
use libfuzzer_sys::fuzz_target;

/// Operations per input beyond which the rest is ignored (keeps each run short).
const MAX_OPS: usize = 96;

/// The hashes an input can name: a forest where the parent of ±h is ±(h / 2) (so ±1 and 0 are
/// roots), plus the extremes of the signed range chained under one another.
#[rustfmt::skip]
const UNIVERSE: [BlockHash; 28] = [
    -12, -11, -10, -9, -8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
    i64::MAX, i64::MIN, i64::MIN + 1,
];

fn universe_parent(h: BlockHash) -> Option<BlockHash> {
    match h {
        i64::MAX => None,
        i64::MIN => Some(i64::MAX),
        x if x == i64::MIN + 1 => Some(i64::MIN),
        x if x.abs() >= 2 => Some(x.signum() * (x.abs() / 2)),
        _ => None,
    }
}

/// The universe path from a root down to `h`.
fn path_to(h: BlockHash) -> Vec<BlockHash> {
    let mut p = vec![h];
    while let Some(x) = universe_parent(*p.last().expect("non-empty")) {
        p.push(x);
    }
    p.reverse();
    p
}

/// Twelve nodes: a block can have 24 holders (heap lists grow and shrink through several
/// capacities in `holder_list`), more than eight nodes can share a prefix (the eight-at-a-time
/// scan of `matching::Alive::keep_only`), and the largest node id packs into the place value just
/// below the holder list's tags.
const NODES: [NodeId; 12] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, MAX_NODE];

#[derive(Debug, Clone, Copy, Arbitrary)]
struct H(u8);

impl H {
    fn get(self) -> BlockHash {
        UNIVERSE[usize::from(self.0) % UNIVERSE.len()]
    }
}

fn hs(v: &[H]) -> Vec<BlockHash> {
    v.iter().map(|h| h.get()).collect()
}

#[derive(Debug, Clone, Copy, Arbitrary)]
struct N(u8);

impl N {
    fn get(self) -> NodeId {
        NODES[usize::from(self.0) % NODES.len()]
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum T {
    L1,
    L2,
}

impl T {
    fn get(self) -> Tier {
        match self {
            T::L1 => Tier::L1,
            T::L2 => Tier::L2,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
struct B(u8);

impl B {
    fn get(self) -> BranchId {
        match self.0 % 4 {
            3 => BranchId::Str("1".into()),
            i => BranchId::Int(i64::from(i)),
        }
    }
}

/// A chain with its parent, for `store` and stored events.
#[derive(Debug, Clone, Arbitrary)]
enum Chain {
    /// The last `len` blocks of the universe path to `end`, under their true parent
    /// (`len` 0: an empty chain under `end`).
    Path { end: H, len: u8 },
    /// Any hashes under any parent (mostly refused).
    Raw { hashes: Vec<H>, parent: Option<H> },
}

impl Chain {
    fn get(&self) -> (Vec<BlockHash>, Option<BlockHash>) {
        match self {
            Chain::Path { end, len } => {
                let path = path_to(end.get());
                let k = usize::from(*len) % (path.len() + 1);
                let start = path.len() - k;
                let parent = start.checked_sub(1).map(|i| path[i]);
                (path[start..].to_vec(), parent)
            }
            Chain::Raw { hashes, parent } => (hs(hashes), parent.map(H::get)),
        }
    }
}

/// A query chain from a first page (match, touch, branches).
#[derive(Debug, Clone, Arbitrary)]
enum Rooted {
    /// The first `len` blocks of the universe path to `end`.
    Path { end: H, len: u8 },
    /// Any hashes.
    Raw(Vec<H>),
}

impl Rooted {
    fn get(&self) -> Vec<BlockHash> {
        match self {
            Rooted::Path { end, len } => {
                let path = path_to(end.get());
                let k = usize::from(*len) % (path.len() + 1);
                path[..k].to_vec()
            }
            Rooted::Raw(v) => hs(v),
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Now {
    /// Half the step number: equal times are common, so the eviction tie-breaks run.
    Step,
    /// Any float (NaN and infinities must be refused).
    Raw(f64),
}

impl Now {
    fn get(self, step: usize) -> f64 {
        match self {
            Now::Step => (step / 2) as f64,
            Now::Raw(x) => x,
        }
    }
}

#[derive(Debug, Clone, Copy, Arbitrary)]
enum Medium {
    /// No medium field (positional) or nil (map): GPU.
    Absent,
    Gpu,
    Cpu,
    CpuPinned,
    Disk,
    External,
}

impl Medium {
    fn wire(self) -> Option<&'static str> {
        match self {
            Medium::Absent => None,
            Medium::Gpu => Some("GPU"),
            Medium::Cpu => Some("CPU"),
            Medium::CpuPinned => Some("CPU_PINNED"),
            Medium::Disk => Some("DISK"),
            Medium::External => Some("EXTERNAL"),
        }
    }

    fn tier(self) -> Option<Tier> {
        match self {
            Medium::Absent | Medium::Gpu => Some(Tier::L1),
            Medium::Cpu | Medium::CpuPinned => Some(Tier::L2),
            Medium::Disk | Medium::External => None,
        }
    }
}

#[derive(Debug, Clone, Arbitrary)]
enum Ev {
    Stored { chain: Chain, medium: Medium },
    Removed { hashes: Vec<H>, medium: Medium },
    Cleared,
    Unknown,
}

#[derive(Debug, Clone, Arbitrary)]
enum Op {
    Store {
        node: N,
        tier: T,
        chain: Chain,
        now: Now,
    },
    /// The same chain stored on every node of `mask` (bit i: `NODES[i]`), so that blocks with
    /// many holders and prefixes shared by many nodes are common.
    StoreOnNodes {
        mask: u16,
        tier: T,
        chain: Chain,
        now: Now,
    },
    Remove {
        node: N,
        tier: T,
        hashes: Vec<H>,
    },
    /// Removes a root path leaf first, as engines do (the directory's fast path).
    RemovePath {
        node: N,
        tier: T,
        chain: Rooted,
        leaf_first: bool,
    },
    Clear {
        node: N,
        tier: Option<T>,
    },
    Evict {
        node: N,
        tier: T,
        n: u8,
    },
    Touch {
        node: N,
        chain: Rooted,
        now: Now,
    },
    Match {
        chain: Rooted,
    },
    EvictionOrder {
        node: N,
        tier: T,
        limit: Option<u8>,
    },
    BranchSet {
        branch: B,
        chain: Rooted,
        version: Option<i64>,
    },
    BranchFork {
        src: B,
        dst: B,
    },
    BranchEnd {
        branch: B,
    },
    Events {
        node: N,
        events: Vec<Ev>,
        positional: bool,
        style: IntStyle,
        now: Now,
    },
}

fn same_kind(a: &Error, b: &Error) -> bool {
    std::mem::discriminant(a) == std::mem::discriminant(b)
}

/// Both refused with the same kind of error, or both accepted with equal results.
fn agree<T: PartialEq + std::fmt::Debug>(what: &str, d: &Result<T, Error>, m: &Result<T, Error>) {
    match (d, m) {
        (Err(x), Err(y)) => assert!(same_kind(x, y), "{what}: directory {x:?}, model {y:?}"),
        _ => assert_eq!(d, m, "{what}"),
    }
}

/// Agreement with the model after every step: every universe hash probed, every universe path
/// from a known root matched (from an unknown root both sides match nothing, and `compare` has
/// checked that the directory does not know that root either).
fn check(d: &Directory, m: &Model) {
    let queries: Vec<Vec<BlockHash>> = UNIVERSE
        .iter()
        .map(|&h| path_to(h))
        .filter(|q| m.parent.contains_key(&q[0]))
        .collect();
    compare(d, m, &NODES, &queries);
    for h in UNIVERSE {
        assert_eq!(d.contains(h), m.parent.contains_key(&h), "contains {h}");
    }
}

/// Encodes `events` as one batch; returns the bytes, what they must decode to, and the model's
/// view of them.
fn encode(
    events: &[Ev],
    positional: bool,
    style: IntStyle,
    ts: f64,
) -> (Vec<u8>, EventBatch, Vec<ModelEvent>) {
    let mut wire_events = Vec::new();
    let mut decoded = Vec::new();
    let mut model = Vec::new();
    for e in events {
        let (w, dec, me) = match e {
            Ev::Stored { chain, medium } => {
                let (c, p) = chain.get();
                let w = if positional {
                    wire::stored_positional(&c, p, medium.wire(), style)
                } else {
                    wire::stored_map(&c, p, medium.wire(), style)
                };
                let dec = Event::Stored {
                    hashes: c.clone(),
                    parent: p,
                    tier: medium.tier(),
                };
                (w, dec, ModelEvent::Stored(c, p, medium.tier()))
            }
            Ev::Removed { hashes, medium } => {
                let c = hs(hashes);
                let w = if positional {
                    wire::removed_positional(&c, medium.wire(), style)
                } else {
                    wire::removed_map(&c, medium.wire(), style)
                };
                let dec = Event::Removed {
                    hashes: c.clone(),
                    tier: medium.tier(),
                };
                (w, dec, ModelEvent::Removed(c, medium.tier()))
            }
            Ev::Cleared => (
                wire::cleared(positional),
                Event::Cleared,
                ModelEvent::Cleared,
            ),
            Ev::Unknown => (
                wire::unknown(positional),
                Event::Unknown,
                ModelEvent::Unknown,
            ),
        };
        wire_events.push(w);
        decoded.push(dec);
        model.push(me);
    }
    let bytes = wire::encode(&V::Arr(vec![
        V::F64(ts),
        V::Arr(wire_events),
        V::Int(0, IntStyle::Compact),
    ]));
    let batch = EventBatch {
        ts: Some(ts),
        events: decoded,
        dp_rank: Some(0),
    };
    (bytes, batch, model)
}

/// On a refusal, `stats()` must not have moved.
fn unchanged_if_refused<T>(what: &str, before: &kvdir::Stats, d: &Directory, r: &Result<T, Error>) {
    if r.is_err() {
        assert_eq!(
            before,
            &d.stats(),
            "{what}: a refused call changed the directory"
        );
    }
}

#[allow(clippy::too_many_lines, reason = "one match arm per operation")]
fn run(ops: &[Op]) {
    let mut d = Directory::new();
    let mut m = Model::default();
    for (step, op) in ops.iter().take(MAX_OPS).enumerate() {
        let before = d.stats();
        match op {
            Op::Store {
                node,
                tier,
                chain,
                now,
            } => {
                let (c, p) = chain.get();
                let now = now.get(step);
                let r = d.store(node.get(), tier.get(), &c, p, now);
                unchanged_if_refused("store", &before, &d, &r);
                agree("store", &r, &m.store(node.get(), tier.get(), &c, p, now));
            }
            Op::StoreOnNodes {
                mask,
                tier,
                chain,
                now,
            } => {
                let (c, p) = chain.get();
                let now = now.get(step);
                for (i, &node) in NODES.iter().enumerate() {
                    if mask & (1 << i) != 0 {
                        let before = d.stats();
                        let r = d.store(node, tier.get(), &c, p, now);
                        unchanged_if_refused("store", &before, &d, &r);
                        agree("store", &r, &m.store(node, tier.get(), &c, p, now));
                    }
                }
            }
            Op::Remove { node, tier, hashes } => {
                let c = hs(hashes);
                d.remove(node.get(), tier.get(), &c);
                m.remove(node.get(), tier.get(), &c);
            }
            Op::RemovePath {
                node,
                tier,
                chain,
                leaf_first,
            } => {
                let mut c = chain.get();
                if *leaf_first {
                    c.reverse();
                }
                d.remove(node.get(), tier.get(), &c);
                m.remove(node.get(), tier.get(), &c);
            }
            Op::Clear { node, tier } => {
                let t = tier.map(T::get);
                d.clear(node.get(), t);
                m.clear(node.get(), t);
            }
            Op::Evict { node, tier, n } => {
                let n = usize::from(*n % 8);
                assert_eq!(
                    d.evict(node.get(), tier.get(), n),
                    m.evict(node.get(), tier.get(), n),
                    "evict"
                );
            }
            Op::Touch { node, chain, now } => {
                let c = chain.get();
                let now = now.get(step);
                let r = d.touch(node.get(), &c, now);
                unchanged_if_refused("touch", &before, &d, &r);
                agree("touch", &r, &m.touch(node.get(), &c, now));
            }
            Op::Match { chain } => {
                let c = chain.get();
                assert_eq!(match_of(&d, &c), m.match_prefix(&c), "match {c:?}");
            }
            Op::EvictionOrder { node, tier, limit } => {
                let limit = limit.map(usize::from);
                let mut want = m.eviction_order(node.get(), tier.get());
                want.truncate(limit.unwrap_or(usize::MAX));
                assert_eq!(
                    d.eviction_order(node.get(), tier.get(), limit),
                    want,
                    "eviction_order"
                );
            }
            Op::BranchSet {
                branch,
                chain,
                version,
            } => {
                let c = chain.get();
                let r = d.branch_set(branch.get(), &c, *version);
                unchanged_if_refused("branch_set", &before, &d, &r);
                if r == Ok(false) {
                    assert_eq!(
                        before,
                        d.stats(),
                        "a stale branch_set changed the directory"
                    );
                }
                agree("branch_set", &r, &m.branch_set(branch.get(), &c, *version));
            }
            Op::BranchFork { src, dst } => {
                let r = d.branch_fork(&src.get(), dst.get());
                unchanged_if_refused("branch_fork", &before, &d, &r);
                agree("branch_fork", &r, &m.branch_fork(&src.get(), dst.get()));
            }
            Op::BranchEnd { branch } => {
                assert_eq!(
                    d.branch_end(&branch.get()),
                    m.branch_end(&branch.get()),
                    "branch_end"
                );
            }
            Op::Events {
                node,
                events,
                positional,
                style,
                now,
            } => {
                let (bytes, batch, model_events) = encode(events, *positional, *style, step as f64);
                assert_eq!(
                    decode_batch(&bytes).as_ref(),
                    Ok(&batch),
                    "round trip of {bytes:02x?}"
                );
                let now = now.get(step);
                let r = d.apply_events(node.get(), &bytes, now);
                unchanged_if_refused("apply_events", &before, &d, &r);
                agree("apply_events", &r, &m.apply(node.get(), &model_events, now));
            }
        }
        check(&d, &m);
    }
}

fuzz_target!(|ops: Vec<Op>| run(&ops));
