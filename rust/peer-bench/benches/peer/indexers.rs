//! The four indexers behind one interface: ours (`kvdir::Directory`) and Dynamo 1.6.1's
//! `RadixTree`, `ConcurrentRadixTreeCompressed` (CRTC) and `PositionalIndexer`, each driven
//! through its own public API as Dynamo's router drives it (docs/research/dynamo-kv-router-1.6.1.md).
//!
//! Timing: the caller's `Clock` is started after the operation's input is built (Dynamo's
//! `RouterEvent`, the owned query `Vec` `RadixTree::find_matches` takes) and stopped before its
//! answer is converted for the equality check, so only the index's own work is timed. CRTC has
//! no public per-event apply (its events run on `ThreadPoolIndexer`'s threads): its events are
//! timed as a batch, enqueued and flushed, with one pool thread.

use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::positional::{LevelIndex, SearchMode};
use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheRemoveData, KvCacheStoreData,
    KvCacheStoredBlockData, OverlapScores, WorkerWithDpRank,
};
use dynamo_kv_router::{
    ConcurrentRadixTreeCompressed, LocalBlockHash, PositionalIndexer, RadixTree, RouterEvent,
    ThreadPoolIndexer,
};
use kvdir::{Directory, Tier};
use kvdir_peer_bench::{Block, Op};
use rustc_hash::FxHashMap;

/// Dynamo's block size argument; only a warning reads it for the indexers measured here.
pub const KV_BLOCK_SIZE: u32 = 16;
/// CRTC's batches are flushed every this many events when its memory is read (see `DynCrtc`).
pub const FLUSH_EVERY: usize = 256;
/// `PositionalIndexer`'s jump: the value its docs and tests use.
pub const JUMP: usize = 32;

/// Per-worker leading blocks matched, ascending by worker, zero omitted.
pub type Answer = Vec<(u32, u32)>;

/// Times one operation: `start` once its input is ready, `stop` before its answer is read.
#[derive(Debug, Default)]
pub struct Clock {
    started: Option<Instant>,
    /// The last measured span.
    pub elapsed: Duration,
}

impl Clock {
    pub fn start(&mut self) {
        self.started = Some(Instant::now());
    }

    pub fn stop(&mut self) {
        self.elapsed = self.started.take().expect("started").elapsed();
    }
}

/// One indexer under test.
pub trait Index {
    /// Its name in the tables and the JSON.
    fn name(&self) -> &'static str;
    /// Whether `apply` times single events (else only `apply_batch` is meaningful).
    fn per_event(&self) -> bool;
    /// Applies one event (a store or a remove), timed on `clock`.
    fn apply(&mut self, op: &Op, clock: &mut Clock);
    /// Applies `ops` in order and returns once all are applied; the whole is timed on `clock`.
    fn apply_batch(&mut self, ops: &[&Op], clock: &mut Clock) {
        clock.start();
        let mut one = Clock::default();
        for op in ops {
            self.apply(op, &mut one);
        }
        clock.stop();
    }
    /// Answers one prefix query, timed on `clock`.
    fn query(&mut self, blocks: &[Block], clock: &mut Clock) -> Answer;
}

// ---- ours -----------------------------------------------------------------------------------

/// Our directory, its blocks in L1 (Dynamo's indexers know one tier).
pub struct Ours {
    dir: Directory,
    now: f64,
    hashes: Vec<i64>,
}

impl Ours {
    pub fn new() -> Self {
        Ours {
            dir: Directory::new(),
            now: 0.0,
            hashes: Vec::new(),
        }
    }
}

/// Our directory's view of an event: the node and the chain's hashes as `i64`.
pub fn ours_hashes(op: &Op, hashes: &mut Vec<i64>) -> u32 {
    hashes.clear();
    match op {
        Op::Store { worker, blocks, .. } => {
            hashes.extend(blocks.iter().map(|b| b.seq as i64));
            *worker
        }
        Op::Remove { worker, seqs } => {
            hashes.extend(seqs.iter().map(|&s| s as i64));
            *worker
        }
        Op::Query { .. } => unreachable!("a query is not an event"),
    }
}

/// Applies one event to our directory, its hashes already in `hashes` (`ours_hashes`).
pub fn ours_apply(dir: &mut Directory, op: &Op, node: u32, hashes: &[i64], now: f64) {
    match op {
        Op::Store { parent, .. } => dir
            .store(node, Tier::L1, hashes, parent.map(|p| p as i64), now)
            .expect("a valid chain"),
        Op::Remove { .. } => dir.remove(node, Tier::L1, hashes),
        Op::Query { .. } => unreachable!("a query is not an event"),
    }
}

/// Our answer in the common form.
pub fn ours_answer(m: &kvdir::PrefixMatch) -> Answer {
    m.node_ids()
        .iter()
        .zip(m.l12())
        .filter(|(_, &n)| n > 0)
        .map(|(&w, &n)| (w, n))
        .collect()
}

impl Index for Ours {
    fn name(&self) -> &'static str {
        "ours"
    }

    fn per_event(&self) -> bool {
        true
    }

    fn apply(&mut self, op: &Op, clock: &mut Clock) {
        self.now += 1.0;
        let node = ours_hashes(op, &mut self.hashes);
        clock.start();
        ours_apply(&mut self.dir, op, node, &self.hashes, self.now);
        clock.stop();
    }

    fn query(&mut self, blocks: &[Block], clock: &mut Clock) -> Answer {
        self.hashes.clear();
        self.hashes.extend(blocks.iter().map(|b| b.seq as i64));
        clock.start();
        let m = self.dir.match_prefix(&self.hashes);
        clock.stop();
        ours_answer(&m)
    }
}

// ---- Dynamo's events and answers ------------------------------------------------------------

/// The `RouterEvent` Dynamo's router would receive for `op` (event ids count up per index).
pub fn router_event(op: &Op, event_id: u64) -> RouterEvent {
    let (worker, data) = match op {
        Op::Store {
            worker,
            parent,
            blocks,
        } => (
            *worker,
            KvCacheEventData::Stored(KvCacheStoreData {
                parent_hash: parent.map(ExternalSequenceBlockHash),
                start_position: None,
                blocks: blocks
                    .iter()
                    .map(|b| KvCacheStoredBlockData {
                        block_hash: ExternalSequenceBlockHash(b.seq),
                        tokens_hash: LocalBlockHash(b.local),
                        mm_extra_info: None,
                    })
                    .collect(),
            }),
        ),
        Op::Remove { worker, seqs } => (
            *worker,
            KvCacheEventData::Removed(KvCacheRemoveData {
                block_hashes: seqs.iter().map(|&s| ExternalSequenceBlockHash(s)).collect(),
            }),
        ),
        Op::Query { .. } => unreachable!("a query is not an event"),
    };
    RouterEvent::new(
        u64::from(worker),
        KvCacheEvent {
            event_id,
            data,
            dp_rank: 0,
        },
    )
}

/// The query as Dynamo takes it: content hashes.
pub fn locals(blocks: &[Block]) -> Vec<LocalBlockHash> {
    blocks.iter().map(|b| LocalBlockHash(b.local)).collect()
}

/// Dynamo's answer in the common form.
pub fn dynamo_answer(s: &OverlapScores) -> Answer {
    let mut out: Answer = s
        .scores
        .iter()
        .filter(|(_, &n)| n > 0)
        .map(|(w, &n)| {
            let w: WorkerWithDpRank = *w;
            (u32::try_from(w.worker_id).expect("worker ids fit u32"), n)
        })
        .collect();
    out.sort_unstable();
    out
}

// ---- RadixTree -------------------------------------------------------------------------------

/// Dynamo's single-threaded tree, called directly (its `KvIndexer` wraps it in a thread).
pub struct DynRadix {
    tree: RadixTree,
    event_id: u64,
}

impl DynRadix {
    pub fn new() -> Self {
        DynRadix {
            tree: RadixTree::new(),
            event_id: 0,
        }
    }
}

impl Index for DynRadix {
    fn name(&self) -> &'static str {
        "RadixTree"
    }

    fn per_event(&self) -> bool {
        true
    }

    fn apply(&mut self, op: &Op, clock: &mut Clock) {
        self.event_id += 1;
        let ev = router_event(op, self.event_id);
        clock.start();
        self.tree.apply_event(ev).expect("a valid event");
        clock.stop();
    }

    fn query(&mut self, blocks: &[Block], clock: &mut Clock) -> Answer {
        let q = locals(blocks);
        clock.start();
        let s = self.tree.find_matches(q, false);
        clock.stop();
        dynamo_answer(&s)
    }
}

// ---- PositionalIndexer ----------------------------------------------------------------------

/// Dynamo's position-keyed index, its events applied on the caller's thread with the caller's
/// per-worker reverse map, as one `ThreadPoolIndexer` thread does.
pub struct DynPositional {
    index: PositionalIndexer,
    lookup: FxHashMap<WorkerWithDpRank, LevelIndex>,
    event_id: u64,
}

impl DynPositional {
    pub fn new() -> Self {
        DynPositional {
            index: PositionalIndexer::new_with_mode(JUMP, SearchMode::Strided),
            lookup: FxHashMap::default(),
            event_id: 0,
        }
    }
}

impl Index for DynPositional {
    fn name(&self) -> &'static str {
        "Positional"
    }

    fn per_event(&self) -> bool {
        true
    }

    fn apply(&mut self, op: &Op, clock: &mut Clock) {
        self.event_id += 1;
        let ev = router_event(op, self.event_id);
        clock.start();
        self.index
            .apply_event(&mut self.lookup, ev, None)
            .expect("a valid event");
        clock.stop();
    }

    fn query(&mut self, blocks: &[Block], clock: &mut Clock) -> Answer {
        let q = locals(blocks);
        clock.start();
        let s = self.index.find_matches(&q, false);
        clock.stop();
        dynamo_answer(&s)
    }
}

// ---- CRTC --------------------------------------------------------------------------------------

/// Dynamo's default indexer: `ConcurrentRadixTreeCompressed` behind `ThreadPoolIndexer` (one
/// event thread here; Dynamo's default is 4, which a 2-core machine cannot run in parallel).
///
/// A batch is enqueued whole and flushed once, as fast as the pool goes; but the pool's channel
/// then keeps the largest backlog it held allocated, which a memory reading would count as the
/// index's, so the memory figure comes from a build flushed every `FLUSH_EVERY` events
/// (`for_memory`; slower: each flush waits for the pool thread).
pub struct DynCrtc {
    pool: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    rt: tokio::runtime::Runtime,
    event_id: u64,
    flush_every: usize,
}

impl DynCrtc {
    /// For a memory reading.
    pub fn for_memory() -> Self {
        DynCrtc {
            flush_every: FLUSH_EVERY,
            ..Self::new()
        }
    }

    pub fn new() -> Self {
        DynCrtc {
            flush_every: usize::MAX,
            pool: ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, KV_BLOCK_SIZE),
            rt: tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("a current-thread runtime"),
            event_id: 0,
        }
    }
}

impl Index for DynCrtc {
    fn name(&self) -> &'static str {
        "CRTC"
    }

    fn per_event(&self) -> bool {
        false
    }

    fn apply(&mut self, op: &Op, clock: &mut Clock) {
        self.apply_batch(&[op], clock);
    }

    fn apply_batch(&mut self, ops: &[&Op], clock: &mut Clock) {
        let events: Vec<RouterEvent> = ops
            .iter()
            .map(|op| {
                self.event_id += 1;
                router_event(op, self.event_id)
            })
            .collect();
        clock.start();
        let mut events = events.into_iter().peekable();
        while events.peek().is_some() {
            for ev in events.by_ref().take(self.flush_every) {
                self.pool.enqueue_event(ev).expect("the pool is running");
            }
            self.rt.block_on(self.pool.flush());
        }
        clock.stop();
    }

    fn query(&mut self, blocks: &[Block], clock: &mut Clock) -> Answer {
        let q = locals(blocks);
        clock.start();
        let s = self.pool.backend().find_matches(&q, false);
        clock.stop();
        dynamo_answer(&s)
    }
}
