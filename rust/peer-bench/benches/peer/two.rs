//! Two threads, as a router runs its index: one applies the workload's events from empty as fast
//! as it can while the other answers its queries, round and round, until the events are done.
//! Reported: the events' block-ops/s and the queries' rate and latency under that load.
//!
//! How each index is shared is its own design's way: ours behind a `parking_lot::RwLock` (one
//! writer, readers in between), CRTC and Positional behind `ThreadPoolIndexer` with one event
//! thread (reads run inline, lock-free for CRTC), `RadixTree` behind `KvIndexer`, whose one
//! thread serves events and queries from channels. Answers are not checked here (the index
//! moves under the queries); the one-thread run checks them.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use dynamo_kv_router::indexer::positional::SearchMode;
use dynamo_kv_router::indexer::{KvIndexer, KvIndexerInterface, KvIndexerMetrics, SyncIndexer};
use dynamo_kv_router::{ConcurrentRadixTreeCompressed, PositionalIndexer, ThreadPoolIndexer};
use kvdir::Directory;
use kvdir_peer_bench::{Block, Op, Workload};
use parking_lot::{RwLock, RwLockWriteGuard};
use tokio_util::sync::CancellationToken;

use crate::indexers::{locals, ours_apply, ours_hashes, router_event, JUMP, KV_BLOCK_SIZE};
use crate::stats::OpStats;

/// The two threads' figures.
pub struct Two {
    /// The events, timed as a whole from the start to the last one applied.
    pub events: OpStats,
    /// Each query answered while the events ran.
    pub matched: OpStats,
}

fn event_ops(w: &Workload) -> Vec<&Op> {
    w.events().collect()
}

fn query_blocks(w: &Workload) -> Vec<&[Block]> {
    w.queries()
        .map(|q| match q {
            Op::Query { blocks } => blocks.as_slice(),
            _ => unreachable!(),
        })
        .collect()
}

/// Runs `writer` (returns once every event is applied) on a second thread while this one calls
/// `query` over `queries`, round and round, until the writer is done.
fn race(
    events: &[&Op],
    queries: &[&[Block]],
    writer: impl FnOnce() + Send,
    mut query: impl FnMut(&[Block]),
) -> Two {
    let done = AtomicBool::new(false);
    let start = Barrier::new(2);
    let mut matched = OpStats::default();
    let mut events_stats = OpStats::default();
    std::thread::scope(|s| {
        let h = s.spawn(|| {
            start.wait();
            let t = Instant::now();
            writer();
            let d = t.elapsed();
            done.store(true, Ordering::Release);
            d
        });
        start.wait();
        let mut i = 0;
        while !done.load(Ordering::Acquire) {
            let q = queries[i % queries.len()];
            let t = Instant::now();
            query(q);
            matched.one(t.elapsed(), q.len());
            i += 1;
        }
        let d: Duration = h.join().expect("the writer finished");
        let blocks = events.iter().map(|o| o.blocks()).sum();
        events_stats.batch(d, events.len(), blocks);
    });
    Two {
        events: events_stats,
        matched,
    }
}

/// Events applied per hold of our directory's write lock: an engine's events arrive in batches
/// (SGLang publishes one `KVEventBatch` per scheduler step), which the router applies at once.
const WRITE_BATCH: usize = 16;

/// Ours behind a reader-writer lock.
pub fn ours(w: &Workload) -> Two {
    let events = event_ops(w);
    let queries = query_blocks(w);
    let dir = RwLock::new(Directory::new());
    let mut qh: Vec<i64> = Vec::new();
    race(
        &events,
        &queries,
        || {
            let mut hashes = Vec::new();
            for (b, batch) in events.chunks(WRITE_BATCH).enumerate() {
                let mut d = dir.write();
                for (i, op) in batch.iter().enumerate() {
                    let node = ours_hashes(op, &mut hashes);
                    ours_apply(&mut d, op, node, &hashes, (b * WRITE_BATCH + i) as f64);
                }
                // Fair: a waiting reader goes next, as queries do between a router's batches.
                RwLockWriteGuard::unlock_fair(d);
            }
        },
        |q| {
            qh.clear();
            qh.extend(q.iter().map(|b| b.seq as i64));
            std::hint::black_box(dir.read().match_prefix(&qh));
        },
    )
}

/// A `SyncIndexer` behind `ThreadPoolIndexer` with one event thread.
fn pooled<T: SyncIndexer>(backend: T, w: &Workload) -> Two {
    let events = event_ops(w);
    let queries = query_blocks(w);
    let pool = ThreadPoolIndexer::new(backend, 1, KV_BLOCK_SIZE);
    let built: Vec<_> = events
        .iter()
        .enumerate()
        .map(|(i, op)| router_event(op, i as u64 + 1))
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("a runtime");
    race(
        &events,
        &queries,
        || {
            for ev in built {
                pool.enqueue_event(ev).expect("the pool is running");
            }
            rt.block_on(pool.flush());
        },
        |q| {
            let l = locals(q);
            std::hint::black_box(pool.backend().find_matches(&l, false));
        },
    )
}

/// Dynamo's default: CRTC behind the pool.
pub fn crtc(w: &Workload) -> Two {
    pooled(ConcurrentRadixTreeCompressed::new(), w)
}

/// Positional behind the pool.
pub fn positional(w: &Workload) -> Two {
    pooled(
        PositionalIndexer::new_with_mode(JUMP, SearchMode::Strided),
        w,
    )
}

/// `RadixTree` behind `KvIndexer` (Dynamo's router with one event thread).
pub fn radix(w: &Workload) -> Two {
    let events = event_ops(w);
    let queries = query_blocks(w);
    let token = CancellationToken::new();
    let idx = KvIndexer::new(
        token.clone(),
        KV_BLOCK_SIZE,
        Arc::new(KvIndexerMetrics::new_unregistered()),
    );
    let built: Vec<_> = events
        .iter()
        .enumerate()
        .map(|(i, op)| router_event(op, i as u64 + 1))
        .collect();
    let rt_w = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let rt_q = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let out = race(
        &events,
        &queries,
        || {
            rt_w.block_on(async {
                for ev in built {
                    idx.apply_event(ev).await;
                }
                idx.flush().await;
            });
        },
        |q| {
            let l = locals(q);
            std::hint::black_box(rt_q.block_on(idx.find_matches(l)).expect("answered"));
        },
    );
    token.cancel();
    out
}
