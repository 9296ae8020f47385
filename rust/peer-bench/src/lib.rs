//! Operation streams for the native side-by-side of our KV directory against Dynamo's indexers
//! (`benches/peer.rs`, `make bench-peer`; issue 28).
//!
//! A workload is what a KV-aware router's index sees: engines' *store* and *remove* events and
//! the router's prefix *queries*, in the order they happen. Every block carries both identities
//! the two designs key on: its content hash (`local`, Dynamo's `LocalBlockHash`: the hash of one
//! block's tokens, which its trees walk) and its sequence hash (`seq`, a rolling hash of the
//! whole prefix: SGLang's page hash, our directory's block id, Dynamo's
//! `ExternalSequenceBlockHash`). The sequence hash is the caller's function (`SeqHash`): the
//! benchmark passes Dynamo's own `compute_next_sequence_hash`, since its `PositionalIndexer`
//! checks each stored `block_hash` against it at query time.
//!
//! Three workloads:
//! - [`compare_dynamo`]: the shape of `benches/workload.py` (64 workers, 2,000 sequences of
//!   100 blocks sharing random prefixes, 10,000 padded queries, 20,000 one-block appends, then
//!   leaf-first removal of everything);
//! - [`mooncake`]: a real trace's block ids (Mooncake FAST'25 `conversation_trace.jsonl`),
//!   routed to workers with finite caches that evict least-recently-used leaves, as SGLang's
//!   radix cache does; each request is a query, a store of what its worker lacked, and the
//!   evictions that made room;
//! - [`cluster`]: cluster scale, 1M+ blocks over 512 workers, long shared prefixes (agent
//!   families' system prompts and tool schemas) under per-session histories.
//!
//! Nothing here depends on Dynamo's crate: it is a dev-dependency of the benchmark and tests.

use std::collections::{BTreeSet, HashMap, HashSet};

mod trace;
pub use trace::{read_trace, TraceRequest};

/// The sequence hash of a block: `f(parent's sequence hash, this block's content hash)`; the
/// first block of a sequence has no parent.
pub type SeqHash<'a> = &'a dyn Fn(Option<u64>, u64) -> u64;

/// One block under both identities (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    /// Content hash (Dynamo's `LocalBlockHash`).
    pub local: u64,
    /// Sequence hash (our block id as `i64`; Dynamo's `ExternalSequenceBlockHash`).
    pub seq: u64,
}

/// One operation of a router's index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// `worker` now holds `blocks`, a chain whose first block's parent is `parent` (a sequence
    /// hash the worker holds) or the root.
    Store {
        /// The engine.
        worker: u32,
        /// Sequence hash of the parent of `blocks[0]`.
        parent: Option<u64>,
        /// The chain, root first.
        blocks: Vec<Block>,
    },
    /// `worker` no longer holds these sequence hashes (leaf first).
    Remove {
        /// The engine.
        worker: u32,
        /// Sequence hashes, each listed after its descendants on this worker.
        seqs: Vec<u64>,
    },
    /// How many leading blocks of `blocks` each worker holds.
    Query {
        /// The request's blocks, root first.
        blocks: Vec<Block>,
    },
}

impl Op {
    /// Blocks this operation touches (a block-op each).
    #[must_use]
    pub fn blocks(&self) -> usize {
        match self {
            Op::Store { blocks, .. } | Op::Query { blocks } => blocks.len(),
            Op::Remove { seqs, .. } => seqs.len(),
        }
    }

    /// `"store"`, `"remove"` or `"match"`.
    #[must_use]
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Store { .. } => "store",
            Op::Remove { .. } => "remove",
            Op::Query { .. } => "match",
        }
    }
}

/// A named stream of operations, and where in it to measure memory.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Short name (the JSON key).
    pub name: &'static str,
    /// One line on its shape, for the printed table.
    pub about: String,
    /// Workers (engines) the events come from.
    pub workers: u32,
    /// The operations, in order.
    pub ops: Vec<Op>,
    /// Memory per block is read after `ops[..memory_at]`, where the index is fullest.
    pub memory_at: usize,
}

impl Workload {
    /// The event operations (stores and removes) in order: the writer thread's stream.
    pub fn events(&self) -> impl Iterator<Item = &Op> {
        self.ops.iter().filter(|o| !matches!(o, Op::Query { .. }))
    }

    /// The queries in order: the reader thread's stream.
    pub fn queries(&self) -> impl Iterator<Item = &Op> {
        self.ops.iter().filter(|o| matches!(o, Op::Query { .. }))
    }

    /// (worker, block) entries held after `ops[..end]`.
    #[must_use]
    pub fn held_after(&self, end: usize) -> usize {
        let mut held: HashSet<(u32, u64)> = HashSet::new();
        for op in &self.ops[..end] {
            match op {
                Op::Store { worker, blocks, .. } => {
                    held.extend(blocks.iter().map(|b| (*worker, b.seq)));
                }
                Op::Remove { worker, seqs } => {
                    for s in seqs {
                        held.remove(&(*worker, *s));
                    }
                }
                Op::Query { .. } => {}
            }
        }
        held.len()
    }
}

/// A small deterministic generator (`SplitMix64`): the same seed gives the same workload.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// Seeded.
    #[must_use]
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    pub fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }
}

/// `n` fresh blocks (random content hashes) chained under `parent`.
fn fresh_chain(rng: &mut Rng, seq: SeqHash<'_>, parent: Option<u64>, n: usize) -> Vec<Block> {
    let mut out = Vec::with_capacity(n);
    let mut prev = parent;
    for _ in 0..n {
        let local = rng.next_u64();
        let s = seq(prev, local);
        out.push(Block { local, seq: s });
        prev = Some(s);
    }
    out
}

/// Blocks of `chain` a worker holding `mine` lacks: a suffix, since what a worker holds is
/// prefix-closed. Returns (parent of the suffix, the suffix).
fn missing_suffix(mine: &HashSet<u64>, chain: &[Block]) -> (Option<u64>, Vec<Block>) {
    let k = chain.iter().take_while(|b| mine.contains(&b.seq)).count();
    let parent = k.checked_sub(1).map(|i| chain[i].seq);
    (parent, chain[k..].to_vec())
}

/// Sizes of [`compare_dynamo`] (defaults: `benches/workload.py`'s).
#[derive(Debug, Clone, Copy)]
pub struct CompareSizes {
    /// Workers.
    pub workers: u32,
    /// Stored sequences.
    pub sequences: usize,
    /// Blocks per sequence.
    pub seq_len: usize,
    /// Prefix queries.
    pub queries: usize,
    /// One-block appends.
    pub appends: usize,
}

impl Default for CompareSizes {
    fn default() -> Self {
        CompareSizes {
            workers: 64,
            sequences: 2_000,
            seq_len: 100,
            queries: 10_000,
            appends: 20_000,
        }
    }
}

/// The shape of `benches/workload.py` (the Python side-by-side's workload): sequence `i > 0`
/// shares a uniform 0..len-1-block prefix with a uniform earlier one and runs on a uniform
/// worker, which stores the blocks it lacks; then queries (a uniform prefix of a uniform
/// sequence, padded to full length with fresh blocks), one-block appends at random sequences'
/// tails, and the removal of every store and append, newest first, each leaf first.
#[must_use]
pub fn compare_dynamo(seed: u64, sizes: CompareSizes, seq: SeqHash<'_>) -> Workload {
    let mut rng = Rng::new(seed);
    let n = sizes.seq_len;
    let mut sequences: Vec<Vec<Block>> = Vec::with_capacity(sizes.sequences);
    let mut homes: Vec<u32> = Vec::with_capacity(sizes.sequences);
    let mut held: HashMap<u32, HashSet<u64>> = HashMap::new();
    let mut ops = Vec::new();
    for i in 0..sizes.sequences {
        let mut chain = if i == 0 {
            Vec::new()
        } else {
            let base = &sequences[rng.below(i)];
            base[..rng.below(n)].to_vec()
        };
        let parent = chain.last().map(|b| b.seq);
        chain.extend(fresh_chain(&mut rng, seq, parent, n - chain.len()));
        let worker = rng.below(sizes.workers as usize) as u32;
        let mine = held.entry(worker).or_default();
        let (parent, blocks) = missing_suffix(mine, &chain);
        mine.extend(blocks.iter().map(|b| b.seq));
        if !blocks.is_empty() {
            ops.push(Op::Store {
                worker,
                parent,
                blocks,
            });
        }
        sequences.push(chain);
        homes.push(worker);
    }
    for _ in 0..sizes.queries {
        let base = &sequences[rng.below(sizes.sequences)];
        let p = rng.below(n + 1);
        let mut blocks = base[..p].to_vec();
        let parent = blocks.last().map(|b| b.seq);
        blocks.extend(fresh_chain(&mut rng, seq, parent, n - p));
        ops.push(Op::Query { blocks });
    }
    let mut tails: Vec<u64> = sequences.iter().map(|s| s[n - 1].seq).collect();
    for _ in 0..sizes.appends {
        let i = rng.below(sizes.sequences);
        let parent = tails[i];
        let blocks = fresh_chain(&mut rng, seq, Some(parent), 1);
        tails[i] = blocks[0].seq;
        ops.push(Op::Store {
            worker: homes[i],
            parent: Some(parent),
            blocks,
        });
    }
    let memory_at = ops.len();
    let removals: Vec<Op> = ops
        .iter()
        .rev()
        .filter_map(|o| match o {
            Op::Store { worker, blocks, .. } => Some(Op::Remove {
                worker: *worker,
                seqs: blocks.iter().rev().map(|b| b.seq).collect(),
            }),
            _ => None,
        })
        .collect();
    ops.extend(removals);
    Workload {
        name: "compare-dynamo",
        about: format!(
            "{} workers, {} x {}-block sequences, {} queries, {} appends, all removed",
            sizes.workers, sizes.sequences, sizes.seq_len, sizes.queries, sizes.appends
        ),
        workers: sizes.workers,
        ops,
        memory_at,
    }
}

/// One worker's cache in [`mooncake`]: what it holds, and its leaves by last use (SGLang's
/// radix cache evicts the least recently used leaf, so what stays is prefix-closed).
#[derive(Default)]
struct Cache {
    /// seq -> (parent, children held, last use)
    nodes: HashMap<u64, (Option<u64>, u32, u64)>,
    leaves: BTreeSet<(u64, u64)>,
}

impl Cache {
    fn prefix(&self, chain: &[Block]) -> usize {
        chain
            .iter()
            .take_while(|b| self.nodes.contains_key(&b.seq))
            .count()
    }

    /// Marks `chain` used at `now`; the blocks it lacks are added. Returns (parent, new blocks).
    fn use_chain(&mut self, chain: &[Block], now: u64) -> (Option<u64>, Vec<Block>) {
        let k = self.prefix(chain);
        for b in &chain[..k] {
            let node = self.nodes.get_mut(&b.seq).expect("held");
            if node.1 == 0 {
                self.leaves.remove(&(node.2, b.seq));
                self.leaves.insert((now, b.seq));
            }
            node.2 = now;
        }
        let parent = k.checked_sub(1).map(|i| chain[i].seq);
        let mut prev = parent;
        for b in &chain[k..] {
            if let Some(p) = prev {
                let node = self.nodes.get_mut(&p).expect("parent held");
                if node.1 == 0 {
                    self.leaves.remove(&(node.2, p));
                }
                node.1 += 1;
            }
            self.nodes.insert(b.seq, (prev, 0, now));
            prev = Some(b.seq);
        }
        if k < chain.len() {
            self.leaves.insert((now, chain[chain.len() - 1].seq));
        }
        (parent, chain[k..].to_vec())
    }

    /// Evicts least recently used leaves until `capacity` blocks remain; leaf first.
    fn evict_to(&mut self, capacity: usize) -> Vec<u64> {
        let mut out = Vec::new();
        while self.nodes.len() > capacity {
            let (_, seq) = self.leaves.pop_first().expect("a full cache has a leaf");
            let (parent, _, _) = self.nodes.remove(&seq).expect("held");
            if let Some(p) = parent {
                let node = self.nodes.get_mut(&p).expect("parent held");
                node.1 -= 1;
                if node.1 == 0 {
                    self.leaves.insert((node.2, p));
                }
            }
            out.push(seq);
        }
        out
    }
}

/// The blocks each worker was sent to prefill over the last `window` requests: the load term of
/// [`mooncake`]'s routing.
struct Recent {
    load: Vec<usize>,
    sent: std::collections::VecDeque<(usize, usize)>,
    window: usize,
}

impl Recent {
    fn new(workers: usize, window: usize) -> Self {
        Recent {
            load: vec![0; workers],
            sent: std::collections::VecDeque::with_capacity(window + 1),
            window,
        }
    }

    fn add(&mut self, worker: usize, blocks: usize) {
        self.load[worker] += blocks;
        self.sent.push_back((worker, blocks));
        if self.sent.len() > self.window {
            let (w, b) = self.sent.pop_front().expect("non-empty");
            self.load[w] -= b;
        }
    }
}

/// Sizes of [`mooncake`].
#[derive(Debug, Clone, Copy)]
pub struct MooncakeSizes {
    /// Workers.
    pub workers: u32,
    /// Blocks each worker's cache holds (a trace block is 512 tokens).
    pub capacity: usize,
    /// Copies of the trace served side by side, each with its own block ids (Dynamo's own
    /// Mooncake harness duplicates the trace the same way to reach cluster rates).
    pub copies: u64,
    /// Requests of the trace used (all if larger).
    pub requests: usize,
}

impl Default for MooncakeSizes {
    fn default() -> Self {
        MooncakeSizes {
            workers: 64,
            capacity: 1_024,
            copies: 4,
            requests: usize::MAX,
        }
    }
}

/// A real trace's block ids through a cluster of caches: each request (in trace order, the
/// copies interleaved) is a query; it goes to the worker with the fewest blocks to prefill plus
/// blocks recently sent to it, which stores what it lacked and evicts its least recently used
/// leaves down to `capacity`.
#[must_use]
pub fn mooncake(trace: &[TraceRequest], sizes: MooncakeSizes, seq: SeqHash<'_>) -> Workload {
    let mut caches: Vec<Cache> = (0..sizes.workers).map(|_| Cache::default()).collect();
    let mut recent = Recent::new(sizes.workers as usize, 4 * sizes.workers as usize);
    let mut ops = Vec::new();
    let mut now = 0u64;
    let requests = &trace[..trace.len().min(sizes.requests)];
    for req in requests {
        for copy in 0..sizes.copies {
            now += 1;
            let mut prev = None;
            let chain: Vec<Block> = req
                .hash_ids
                .iter()
                .map(|&id| {
                    // Each copy its own blocks: the id in the low 40 bits, the copy above.
                    let local = id | copy << 40;
                    let s = seq(prev, local);
                    prev = Some(s);
                    Block { local, seq: s }
                })
                .collect();
            if chain.is_empty() {
                continue;
            }
            ops.push(Op::Query {
                blocks: chain.clone(),
            });
            // A KV-aware router's cost (Dynamo's default weighs the same two terms): blocks
            // to prefill plus the blocks recently sent to the worker, lowest wins.
            let worker = (0..sizes.workers as usize)
                .min_by_key(|&w| (chain.len() - caches[w].prefix(&chain) + recent.load[w], w))
                .expect("at least one worker");
            recent.add(worker, chain.len() - caches[worker].prefix(&chain));
            let cache = &mut caches[worker];
            let (parent, blocks) = cache.use_chain(&chain, now);
            let evicted = cache.evict_to(sizes.capacity.max(chain.len()));
            let worker = worker as u32;
            if !blocks.is_empty() {
                ops.push(Op::Store {
                    worker,
                    parent,
                    blocks,
                });
            }
            if !evicted.is_empty() {
                ops.push(Op::Remove {
                    worker,
                    seqs: evicted,
                });
            }
        }
    }
    let memory_at = ops.len();
    Workload {
        name: "mooncake",
        about: format!(
            "Mooncake conversation trace, {} requests x {} copies, {} workers of {} blocks",
            requests.len(),
            sizes.copies,
            sizes.workers,
            sizes.capacity
        ),
        workers: sizes.workers,
        ops,
        memory_at,
    }
}

/// Sizes of [`cluster`].
#[derive(Debug, Clone, Copy)]
pub struct ClusterSizes {
    /// Workers.
    pub workers: u32,
    /// Agent families, each with one long shared prefix (system prompt, tool schemas).
    pub families: usize,
    /// Blocks of a family's prefix: uniform in this range.
    pub prefix: (usize, usize),
    /// Sessions (one agent's history under its family's prefix, on one worker).
    pub sessions: usize,
    /// Blocks of a session's own history: uniform in this range.
    pub history: (usize, usize),
    /// Prefix queries.
    pub queries: usize,
}

impl Default for ClusterSizes {
    fn default() -> Self {
        ClusterSizes {
            workers: 512,
            families: 16,
            prefix: (1_000, 2_000),
            sessions: 8_000,
            history: (50, 300),
            queries: 10_000,
        }
    }
}

/// Cluster scale: `sessions` agent histories under `families` long shared prefixes, each
/// worker serving two families; every session is stored on a worker of its family (with the
/// family prefix, where that worker lacks it). Then queries (a session's next turn: its whole
/// chain and 0-50 fresh blocks; one in ten a new session: the family prefix and a fresh
/// history), then half the sessions end (their own blocks removed, leaf first).
#[must_use]
pub fn cluster(seed: u64, sizes: ClusterSizes, seq: SeqHash<'_>) -> Workload {
    let mut rng = Rng::new(seed);
    let families: Vec<Vec<Block>> = (0..sizes.families)
        .map(|_| {
            let n = rng.between(sizes.prefix.0, sizes.prefix.1);
            fresh_chain(&mut rng, seq, None, n)
        })
        .collect();
    // Worker w serves families w mod F and (7w + 3) mod F.
    let serving: Vec<Vec<u32>> = (0..sizes.families)
        .map(|f| {
            (0..sizes.workers)
                .filter(|&w| {
                    let w = w as usize;
                    w % sizes.families == f || (7 * w + 3) % sizes.families == f
                })
                .collect()
        })
        .collect();
    let mut held: HashMap<u32, HashSet<u64>> = HashMap::new();
    let mut ops = Vec::new();
    let mut sessions: Vec<(usize, u32, Vec<Block>)> = Vec::with_capacity(sizes.sessions);
    for _ in 0..sizes.sessions {
        let f = rng.below(sizes.families);
        let worker = serving[f][rng.below(serving[f].len())];
        let prefix = &families[f];
        let n = rng.between(sizes.history.0, sizes.history.1);
        let own = fresh_chain(&mut rng, seq, Some(prefix[prefix.len() - 1].seq), n);
        let chain: Vec<Block> = prefix.iter().chain(&own).copied().collect();
        let mine = held.entry(worker).or_default();
        let (parent, blocks) = missing_suffix(mine, &chain);
        mine.extend(blocks.iter().map(|b| b.seq));
        ops.push(Op::Store {
            worker,
            parent,
            blocks,
        });
        sessions.push((f, worker, own));
    }
    for _ in 0..sizes.queries {
        let (f, _, own) = &sessions[rng.below(sessions.len())];
        let prefix = &families[*f];
        let mut blocks: Vec<Block> = if rng.below(10) == 0 {
            prefix.clone()
        } else {
            prefix.iter().chain(own).copied().collect()
        };
        let parent = blocks.last().map(|b| b.seq);
        let extra = if blocks.len() == prefix.len() {
            rng.between(sizes.history.0, sizes.history.1)
        } else {
            rng.below(51)
        };
        blocks.extend(fresh_chain(&mut rng, seq, parent, extra));
        ops.push(Op::Query { blocks });
    }
    let memory_at = ops.len();
    for (i, (_, worker, own)) in sessions.iter().enumerate() {
        if i % 2 == 0 {
            ops.push(Op::Remove {
                worker: *worker,
                seqs: own.iter().rev().map(|b| b.seq).collect(),
            });
        }
    }
    Workload {
        name: "cluster",
        about: format!(
            "{} workers, {} families of {}-{}-block prefixes, {} sessions of {}-{} blocks, {} queries",
            sizes.workers,
            sizes.families,
            sizes.prefix.0,
            sizes.prefix.1,
            sizes.sessions,
            sizes.history.0,
            sizes.history.1,
            sizes.queries
        ),
        workers: sizes.workers,
        ops,
        memory_at,
    }
}
