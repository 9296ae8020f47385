//! Criterion benchmarks of the directory at cluster scale: about 1M blocks held over 1,000 nodes.
//!
//! Workload model: 20,000 agent contexts of 100 blocks (SGLang pages), each sharing a random
//! prefix (0–99 blocks) with an earlier context, as agents forked from a shared system prompt and
//! from each other do; each context is held in the L1 of a random node, and one in five also in
//! the L2 of another node (the shared host pool). Every operation below is measured against that
//! directory and leaves it as it found it (the undo step is not timed):
//!
//! - `store/84`: a node stores an 84-block continuation of a held prefix (one prefill's new KV);
//! - `remove/84`: the same 84 blocks leave that node (eviction events);
//! - `match/{hit,partial,miss}`: a 100-block query fully held / held for 50 blocks / unknown;
//! - `branch_set/append`: a live branch's 100–200-block context grows by one block (an agent turn);
//! - `branch_set/compaction`: a branch's 100-block context is replaced by a fresh 20-block one;
//! - `evict/1`: a node evicts its first candidate;
//! - `apply_events/84`: one SGLang `KVEventBatch` (tagged maps) storing 84 blocks, decoded and applied.
//!
//! Run: `cargo bench -p kvdir --bench directory` (or `make bench-rust`). Memory per block of the
//! built directory is printed before the measurements.

use std::cell::RefCell;
use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use kvdir::{BranchId, Directory, Tier};

const NODES: u32 = 1_000;
const CONTEXTS: usize = 20_000;
const LEN: usize = 100;

/// A small deterministic generator (`SplitMix64`), so the bench needs no RNG crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

struct World {
    d: Directory,
    contexts: Vec<Vec<i64>>,
    homes: Vec<u32>,
    rng: Rng,
}

fn build() -> World {
    let mut rng = Rng(42);
    let mut d = Directory::new();
    let mut contexts: Vec<Vec<i64>> = Vec::with_capacity(CONTEXTS);
    let mut homes = Vec::with_capacity(CONTEXTS);
    for i in 0..CONTEXTS {
        let mut ctx = if i == 0 {
            Vec::new()
        } else {
            let base = &contexts[rng.below(i)];
            base[..rng.below(LEN)].to_vec()
        };
        while ctx.len() < LEN {
            ctx.push(rng.next() as i64);
        }
        let node = rng.below(NODES as usize) as u32;
        d.store(node, Tier::L1, &ctx, None, i as f64)
            .expect("consistent chain");
        if rng.below(5) == 0 {
            let other = rng.below(NODES as usize) as u32;
            d.store(other, Tier::L2, &ctx, None, i as f64)
                .expect("consistent chain");
        }
        contexts.push(ctx);
        homes.push(node);
    }
    World {
        d,
        contexts,
        homes,
        rng,
    }
}

fn fresh(rng: &mut Rng, n: usize) -> Vec<i64> {
    (0..n).map(|_| rng.next() as i64).collect()
}

/// Times `op` only; `undo` restores the directory between iterations.
fn timed<S>(
    iters: u64,
    mut setup: impl FnMut() -> S,
    mut op: impl FnMut(&S),
    mut undo: impl FnMut(&S),
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let s = setup();
        let t = Instant::now();
        op(&s);
        total += t.elapsed();
        undo(&s);
    }
    total
}

fn encode_stored(hashes: &[i64], parent: i64) -> Vec<u8> {
    // [ts, [{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": p, "medium": "GPU"}], 0]
    let mut out = vec![0x93, 0xcb];
    out.extend_from_slice(&1.5f64.to_be_bytes());
    out.extend_from_slice(&[0x91, 0x84]);
    let s = |out: &mut Vec<u8>, x: &str| {
        out.push(0xa0 | x.len() as u8);
        out.extend_from_slice(x.as_bytes());
    };
    s(&mut out, "type");
    s(&mut out, "BlockStored");
    s(&mut out, "block_hashes");
    out.push(0xdc);
    out.extend_from_slice(&(hashes.len() as u16).to_be_bytes());
    for h in hashes {
        out.push(0xd3);
        out.extend_from_slice(&h.to_be_bytes());
    }
    s(&mut out, "parent_block_hash");
    out.push(0xd3);
    out.extend_from_slice(&parent.to_be_bytes());
    s(&mut out, "medium");
    s(&mut out, "GPU");
    out.push(0x00);
    out
}

type Group<'a> = criterion::BenchmarkGroup<'a, criterion::measurement::WallTime>;

fn bench_store_remove(g: &mut Group<'_>, w: &mut World) {
    g.bench_function("store/84", |b| {
        b.iter_custom(|iters| {
            let d = RefCell::new(&mut w.d);
            let (rng, contexts, homes) = (&mut w.rng, &w.contexts, &w.homes);
            timed(
                iters,
                || {
                    let i = rng.below(CONTEXTS);
                    (homes[i], contexts[i][15], fresh(rng, 84))
                },
                |(node, parent, chain)| {
                    d.borrow_mut()
                        .store(*node, Tier::L1, black_box(chain), Some(*parent), 1e6)
                        .unwrap();
                },
                |(node, _, chain)| d.borrow_mut().remove(*node, Tier::L1, chain),
            )
        });
    });
    g.bench_function("remove/84", |b| {
        b.iter_custom(|iters| {
            let d = RefCell::new(&mut w.d);
            let (rng, contexts, homes) = (&mut w.rng, &w.contexts, &w.homes);
            timed(
                iters,
                || {
                    let i = rng.below(CONTEXTS);
                    let chain = fresh(rng, 84);
                    d.borrow_mut()
                        .store(homes[i], Tier::L1, &chain, Some(contexts[i][15]), 1e6)
                        .unwrap();
                    (homes[i], chain)
                },
                |(node, chain)| d.borrow_mut().remove(*node, Tier::L1, black_box(chain)),
                |_| {},
            )
        });
    });
}

fn bench_match(g: &mut Group<'_>, w: &mut World) {
    for (name, held) in [("match/hit", LEN), ("match/partial", 50), ("match/miss", 0)] {
        let queries: Vec<Vec<i64>> = (0..1024)
            .map(|_| {
                let i = w.rng.below(CONTEXTS);
                let mut q = w.contexts[i][..held].to_vec();
                q.extend(fresh(&mut w.rng, LEN - held));
                q
            })
            .collect();
        let mut k = 0;
        g.bench_function(name, |b| {
            b.iter(|| {
                k = (k + 1) % queries.len();
                black_box(w.d.match_prefix(black_box(&queries[k])))
            });
        });
    }
}

fn bench_branches(g: &mut Group<'_>, w: &mut World) {
    let branch = BranchId::Str("bench-agent".into());
    let mut ctx = w.contexts[0].clone();
    w.d.branch_set(branch.clone(), &ctx, None).unwrap();
    g.bench_function("branch_set/append", |b| {
        // An agent turn: the 100-200-block context grows by one block (reset, untimed, at 200).
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                if ctx.len() >= 2 * LEN {
                    ctx.truncate(LEN);
                    w.d.branch_set(branch.clone(), &ctx, None).unwrap();
                }
                ctx.push(w.rng.next() as i64);
                let t = Instant::now();
                w.d.branch_set(branch.clone(), black_box(&ctx), None)
                    .unwrap();
                total += t.elapsed();
            }
            total
        });
    });
    g.bench_function("branch_set/compaction", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let i = w.rng.below(CONTEXTS);
                w.d.branch_set(branch.clone(), &w.contexts[i], None)
                    .unwrap();
                let compacted = fresh(&mut w.rng, 20);
                let t = Instant::now();
                w.d.branch_set(branch.clone(), black_box(&compacted), None)
                    .unwrap();
                total += t.elapsed();
            }
            total
        });
    });
    w.d.branch_end(&branch);
}

fn bench_evict(g: &mut Group<'_>, w: &mut World) {
    g.bench_function("evict/1", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let i = w.rng.below(CONTEXTS);
                let node = w.homes[i];
                let t = Instant::now();
                let gone = w.d.evict(node, Tier::L1, 1);
                total += t.elapsed();
                // Put the block back where it was, so the directory keeps its size.
                if let Some(&h) = gone.first() {
                    let ctx = w.homes.iter().zip(&w.contexts).filter(|(&n, _)| n == node);
                    for (_, ctx) in ctx {
                        if let Some(pos) = ctx.iter().position(|&x| x == h) {
                            let parent = pos.checked_sub(1).map(|p| ctx[p]);
                            w.d.store(node, Tier::L1, &[h], parent, 0.0).unwrap();
                            break;
                        }
                    }
                }
            }
            total
        });
    });
}

fn bench_events(g: &mut Group<'_>, w: &mut World) {
    g.bench_function("apply_events/84", |b| {
        b.iter_custom(|iters| {
            let d = RefCell::new(&mut w.d);
            let (rng, contexts, homes) = (&mut w.rng, &w.contexts, &w.homes);
            timed(
                iters,
                || {
                    let i = rng.below(CONTEXTS);
                    let chain = fresh(rng, 84);
                    (homes[i], encode_stored(&chain, contexts[i][15]), chain)
                },
                |(node, payload, _)| {
                    d.borrow_mut()
                        .apply_events(*node, black_box(payload), 1e6)
                        .unwrap();
                },
                |(node, _, chain)| d.borrow_mut().remove(*node, Tier::L1, chain),
            )
        });
    });
}

fn benches(c: &mut Criterion) {
    let t = Instant::now();
    let mut w = build();
    let s = w.d.stats();
    eprintln!(
        "built {} blocks, {} locations over {} nodes in {:.1} s; memory {:.1} MiB = {:.1} B/block, {:.1} B/location",
        s.blocks,
        s.locations,
        s.nodes,
        t.elapsed().as_secs_f64(),
        s.memory_bytes as f64 / f64::from(1 << 20),
        s.memory_bytes as f64 / s.blocks as f64,
        s.memory_bytes as f64 / s.locations as f64,
    );
    let mut g = c.benchmark_group("directory");
    bench_store_remove(&mut g, &mut w);
    bench_match(&mut g, &mut w);
    bench_branches(&mut g, &mut w);
    bench_evict(&mut g, &mut w);
    bench_events(&mut g, &mut w);
    g.finish();
    assert_eq!(
        w.d.stats().blocks,
        s.blocks,
        "benchmarks leave the directory as they found it"
    );
}

criterion_group! {
    name = directory;
    config = Criterion::default().sample_size(50).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = benches
}
criterion_main!(directory);
