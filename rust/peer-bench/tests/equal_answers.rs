//! Every Dynamo indexer answers every query of every workload exactly as our directory does
//! (the benchmark's premise: the same streams, the same answers), and each index ends empty
//! where the workload removes everything.

#[path = "../benches/peer/alloc.rs"]
#[allow(dead_code)]
mod alloc;
#[path = "../benches/peer/indexers.rs"]
#[allow(dead_code)]
mod indexers;

use std::path::Path;

use indexers::{Clock, DynCrtc, DynPositional, DynRadix, Index, Ours};
use kvdir_peer_bench::{
    cluster, compare_dynamo, mooncake, read_trace, ClusterSizes, CompareSizes, MooncakeSizes, Op,
    Workload,
};

fn seq(parent: Option<u64>, local: u64) -> u64 {
    parent.map_or(local, |p| {
        dynamo_tokens::compute_next_sequence_hash(p, local)
    })
}

/// Every query's answer, each asked at its place in the stream.
fn answers(idx: &mut dyn Index, w: &Workload) -> Vec<indexers::Answer> {
    let mut clock = Clock::default();
    let mut out = Vec::new();
    for op in &w.ops {
        match op {
            Op::Query { blocks } => out.push(idx.query(blocks, &mut clock)),
            event => idx.apply(event, &mut clock),
        }
    }
    out
}

fn check(w: &Workload) {
    let theirs: [Box<dyn Index>; 3] = [
        Box::new(DynRadix::new()),
        Box::new(DynCrtc::new()),
        Box::new(DynPositional::new()),
    ];
    let ours = answers(&mut Ours::new(), w);
    assert!(
        ours.iter().any(|a| !a.is_empty()),
        "{}: no query matched anything",
        w.name
    );
    for mut idx in theirs {
        let a = answers(idx.as_mut(), w);
        for (i, (x, y)) in ours.iter().zip(&a).enumerate() {
            assert_eq!(x, y, "{}: query {i}: ours vs {}", w.name, idx.name());
        }
    }
}

#[test]
fn compare_dynamo_answers_equal() {
    let s = CompareSizes {
        workers: 8,
        sequences: 120,
        seq_len: 40,
        queries: 300,
        appends: 200,
    };
    check(&compare_dynamo(5, s, &seq));
}

#[test]
fn mooncake_answers_equal_with_evictions() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../data/traces/mooncake/conversation_trace.jsonl.xz");
    let trace = read_trace(&path).expect("the bundled trace");
    assert_eq!(trace.len(), 12_031);
    let s = MooncakeSizes {
        workers: 8,
        capacity: 300,
        copies: 2,
        requests: 600,
    };
    let w = mooncake(&trace, s, &seq);
    assert!(
        w.ops.iter().any(|o| matches!(o, Op::Remove { .. })),
        "the caches must evict"
    );
    check(&w);
}

#[test]
fn cluster_answers_equal() {
    let s = ClusterSizes {
        workers: 16,
        families: 4,
        prefix: (50, 120),
        sessions: 120,
        history: (5, 40),
        queries: 300,
    };
    check(&cluster(3, s, &seq));
}

#[test]
fn the_workloads_are_what_they_say() {
    let w = compare_dynamo(1, CompareSizes::default(), &seq);
    // Everything stored is removed again.
    assert_eq!(w.held_after(w.ops.len()), 0);
    assert_eq!(w.queries().count(), 10_000);
    let c = cluster(7, ClusterSizes::default(), &seq);
    let unique: std::collections::HashSet<u64> = c
        .events()
        .filter_map(|o| match o {
            Op::Store { blocks, .. } => Some(blocks.iter().map(|b| b.seq)),
            _ => None,
        })
        .flatten()
        .collect();
    assert!(unique.len() > 1_000_000, "{} blocks", unique.len());
}
