//! Our KV directory against Dynamo's own Rust indexers (dynamo-kv-router 1.6.1), natively, in
//! one run (issue 28).
//!
//! Workloads (`kvdir_peer_bench`): `compare-dynamo` (the Python side-by-side's shape),
//! `mooncake` (the Mooncake FAST'25 conversation trace's real block ids, routed to 64 caches
//! that evict least-recently-used leaves), `cluster` (1M+ blocks over 512 workers under long
//! shared prefixes). Each is fed to our `Directory` and to Dynamo's `RadixTree`,
//! `ConcurrentRadixTreeCompressed` (CRTC, Dynamo's default) and `PositionalIndexer` through their
//! own APIs (`indexers.rs`), and every query's per-worker answer is checked equal to ours.
//!
//! Per operation: median and p99 latency where single operations can be timed (CRTC applies
//! events only on its pool's threads: its events are timed as batches, so means only), mean,
//! block-ops/s on one thread and with two (`two.rs`: events on one, queries on the other), and
//! heap bytes per (worker, block) entry held when the index is fullest (`alloc.rs`).
//!
//! Run: `make bench-peer` (= `cargo bench --manifest-path rust/peer-bench/Cargo.toml`), which
//! prints the tables and writes `target/peer-bench.json`:
//! `{"workload": {"op": {"ours_ns": mean, "dynamo": {"RadixTree": mean, "CRTC": .., "Positional": ..},
//! "detail": {...}}}}` (ns per operation). Options after `--`: `--quick` (small sizes, a smoke
//! run), `--only NAME[,NAME]` (workloads), `--indexes NAME[,NAME]` (to profile one; ours always
//! runs, as the reference answers), `--json PATH`, `--trace PATH` (a Mooncake trace, `.jsonl[.xz]`).

mod alloc;
mod indexers;
mod report;
mod single;
mod stats;
mod two;

use std::path::PathBuf;
use std::process::ExitCode;

use kvdir_peer_bench::{
    cluster, compare_dynamo, mooncake, read_trace, ClusterSizes, CompareSizes, MooncakeSizes,
    Workload,
};

#[global_allocator]
static ALLOC: alloc::Counting = alloc::Counting;

/// Dynamo's sequence hash (what its `PositionalIndexer` checks stored hashes against).
fn dynamo_seq(parent: Option<u64>, local: u64) -> u64 {
    parent.map_or(local, |p| {
        dynamo_tokens::compute_next_sequence_hash(p, local)
    })
}

struct Args {
    quick: bool,
    only: Option<Vec<String>>,
    indexes: Option<Vec<String>>,
    json: PathBuf,
    trace: PathBuf,
}

fn parse_args() -> Result<Args, String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut args = Args {
        quick: false,
        only: None,
        indexes: None,
        json: root.join("target/peer-bench.json"),
        trace: root.join("data/traces/mooncake/conversation_trace.jsonl.xz"),
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--quick" => args.quick = true,
            "--only" => {
                let v = it.next().ok_or("--only needs NAME[,NAME]")?;
                args.only = Some(v.split(',').map(str::to_owned).collect());
            }
            "--indexes" => {
                let v = it.next().ok_or("--indexes needs NAME[,NAME]")?;
                args.indexes = Some(v.split(',').map(str::to_owned).collect());
            }
            "--json" => args.json = it.next().ok_or("--json needs a path")?.into(),
            "--trace" => args.trace = it.next().ok_or("--trace needs a path")?.into(),
            // cargo bench passes --bench; a filter word may follow it
            "--bench" => {}
            "--help" | "-h" => {
                return Err(String::from(
                    "usage: cargo bench --manifest-path rust/peer-bench/Cargo.toml -- \
                 [--quick] [--only compare-dynamo,mooncake,cluster] [--indexes ours,RadixTree,CRTC,Positional] \
                 [--json PATH] [--trace PATH]",
                ))
            }
            other => return Err(format!("unknown argument {other:?} (try --help)")),
        }
    }
    Ok(args)
}

fn workloads(args: &Args) -> Result<Vec<Workload>, String> {
    let want = |n: &str| args.only.as_ref().is_none_or(|o| o.iter().any(|x| x == n));
    let mut out = Vec::new();
    if want("compare-dynamo") {
        let mut s = CompareSizes::default();
        if args.quick {
            s.sequences = 300;
            s.queries = 1_000;
            s.appends = 2_000;
        }
        out.push(compare_dynamo(1234, s, &dynamo_seq));
    }
    if want("mooncake") {
        let trace =
            read_trace(&args.trace).map_err(|e| format!("{}: {e}", args.trace.display()))?;
        let mut s = MooncakeSizes::default();
        if args.quick {
            s.copies = 1;
            s.requests = 2_000;
        }
        out.push(mooncake(&trace, s, &dynamo_seq));
    }
    if want("cluster") {
        let mut s = ClusterSizes::default();
        if args.quick {
            s.workers = 64;
            s.sessions = 800;
            s.prefix = (100, 400);
            s.queries = 1_000;
        }
        out.push(cluster(7, s, &dynamo_seq));
    }
    Ok(out)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let ws = match workloads(&args) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut results = Vec::new();
    for w in &ws {
        match report::measure(w, args.indexes.as_deref()) {
            Ok(r) => {
                report::print(w, &r);
                results.push(r);
            }
            Err(e) => {
                eprintln!("error: {}: {e}", w.name);
                return ExitCode::FAILURE;
            }
        }
    }
    let doc = report::json(&ws, &results);
    if let Some(dir) = args.json.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    match std::fs::write(
        &args.json,
        serde_json::to_string_pretty(&doc).expect("json"),
    ) {
        Ok(()) => {
            println!("\nwrote {}", args.json.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {}: {e}", args.json.display());
            ExitCode::FAILURE
        }
    }
}
