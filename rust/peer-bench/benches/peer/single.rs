//! One thread: an index built by the workload's events, queried, torn down; every answer kept
//! for the equality check against ours.

use std::collections::BTreeMap;

use kvdir_peer_bench::{Op, Workload};

use crate::alloc::live_bytes;
use crate::indexers::{Answer, Clock, Index};
use crate::stats::OpStats;

/// What one index did with one workload.
pub struct Single {
    /// "store", "remove", "events" (all events) and "match".
    pub ops: BTreeMap<&'static str, OpStats>,
    /// Heap bytes the index held when fullest.
    pub memory_bytes: isize,
    /// Each query's answer, in order.
    pub answers: Vec<Answer>,
}

/// Applies `events` to `idx`, per event or, for a batch-only index, per run of one kind (a
/// stream alternating kinds is timed as one batch and gives only "events").
fn apply_events(idx: &mut dyn Index, events: &[&Op], ops: &mut BTreeMap<&'static str, OpStats>) {
    let mut clock = Clock::default();
    let mut all = OpStats::default();
    if idx.per_event() {
        for op in events {
            idx.apply(op, &mut clock);
            ops.entry(op.kind())
                .or_default()
                .one(clock.elapsed, op.blocks());
            all.one(clock.elapsed, op.blocks());
        }
    } else {
        let runs: Vec<&[&Op]> = events.chunk_by(|a, b| a.kind() == b.kind()).collect();
        if runs.len() <= 4 {
            for run in runs {
                idx.apply_batch(run, &mut clock);
                let blocks = run.iter().map(|o| o.blocks()).sum();
                ops.entry(run[0].kind())
                    .or_default()
                    .batch(clock.elapsed, run.len(), blocks);
                all.batch(clock.elapsed, run.len(), blocks);
            }
        } else {
            idx.apply_batch(events, &mut clock);
            let blocks = events.iter().map(|o| o.blocks()).sum();
            all.batch(clock.elapsed, events.len(), blocks);
        }
    }
    ops.entry("events").or_default().merge(&all);
}

/// Heap bytes `idx` holds after the events before `w.memory_at` (nothing timed).
pub fn memory_only(idx: &mut dyn Index, w: &Workload) -> isize {
    let build: Vec<&Op> = w.ops[..w.memory_at]
        .iter()
        .filter(|o| !matches!(o, Op::Query { .. }))
        .collect();
    let base = live_bytes();
    idx.apply_batch(&build, &mut Clock::default());
    live_bytes() - base
}

/// Builds the index from empty with the events before `w.memory_at`, reads its memory, answers
/// every query, then applies the remaining events.
pub fn run(idx: &mut dyn Index, w: &Workload) -> Single {
    let is_event = |o: &&Op| !matches!(o, Op::Query { .. });
    let build: Vec<&Op> = w.ops[..w.memory_at].iter().filter(is_event).collect();
    let teardown: Vec<&Op> = w.ops[w.memory_at..].iter().filter(is_event).collect();
    let mut ops = BTreeMap::new();
    let base = live_bytes();
    apply_events(idx, &build, &mut ops);
    let memory_bytes = live_bytes() - base;
    let mut clock = Clock::default();
    let mut matched = OpStats::default();
    let mut answers = Vec::new();
    for q in w.queries() {
        let Op::Query { blocks } = q else {
            unreachable!()
        };
        answers.push(idx.query(blocks, &mut clock));
        matched.one(clock.elapsed, blocks.len());
    }
    ops.insert("match", matched);
    apply_events(idx, &teardown, &mut ops);
    Single {
        ops,
        memory_bytes,
        answers,
    }
}
