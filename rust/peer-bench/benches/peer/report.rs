//! Runs every index on a workload, checks their answers against ours, prints the table and
//! builds the JSON.

use std::collections::BTreeMap;

use kvdir_peer_bench::Workload;
use serde_json::{json, Value};

use crate::indexers::{DynCrtc, DynPositional, DynRadix, Index, Ours};
use crate::single;
use crate::stats::OpStats;
use crate::two;

/// The indexes, ours first.
pub const NAMES: [&str; 4] = ["ours", "RadixTree", "CRTC", "Positional"];

/// One index's figures on one workload.
pub struct IndexResult {
    /// One-thread figures per operation.
    pub single: BTreeMap<&'static str, OpStats>,
    /// Heap bytes per (worker, block) entry when fullest.
    pub bytes_per_block: f64,
    /// Two threads: events, and queries meanwhile.
    pub two: two::Two,
}

/// Every index's figures on one workload, in `NAMES` order.
pub struct WorkloadResult {
    /// Entries held when the index is fullest.
    pub held: usize,
    /// Per index.
    pub by_index: Vec<IndexResult>,
}

fn make(name: &str) -> Box<dyn Index> {
    match name {
        "ours" => Box::new(Ours::new()),
        "RadixTree" => Box::new(DynRadix::new()),
        "CRTC" => Box::new(DynCrtc::new()),
        "Positional" => Box::new(DynPositional::new()),
        _ => unreachable!("{name}"),
    }
}

/// Measures every index on `w`; an answer that differs from ours is an error.
///
/// `indexes` limits the Dynamo indexes run (ours always runs: its answers are the reference);
/// the others' figures are then left empty.
pub fn measure(w: &Workload, indexes: Option<&[String]>) -> Result<WorkloadResult, String> {
    let held = w.held_after(w.memory_at);
    let mut by_index = Vec::new();
    let mut reference: Option<Vec<crate::indexers::Answer>> = None;
    for name in NAMES {
        if name != "ours" && indexes.is_some_and(|x| !x.iter().any(|n| n == name)) {
            by_index.push(IndexResult {
                single: BTreeMap::new(),
                bytes_per_block: f64::NAN,
                two: two::Two {
                    events: OpStats::default(),
                    matched: OpStats::default(),
                },
            });
            continue;
        }
        let mut idx = make(name);
        eprintln!("{}: {}, one thread", w.name, idx.name());
        let mut s = single::run(idx.as_mut(), w);
        drop(idx);
        if name == "CRTC" {
            s.memory_bytes = single::memory_only(&mut DynCrtc::for_memory(), w);
        }
        match &reference {
            None => reference = Some(s.answers),
            Some(r) => {
                if let Some(i) = (0..r.len()).find(|&i| r[i] != s.answers[i]) {
                    return Err(format!(
                        "query {i}: ours {:?} but {name} {:?}",
                        r[i], s.answers[i]
                    ));
                }
            }
        }
        eprintln!("{}: {name}, two threads", w.name);
        let t = match name {
            "ours" => two::ours(w),
            "RadixTree" => two::radix(w),
            "CRTC" => two::crtc(w),
            _ => two::positional(w),
        };
        by_index.push(IndexResult {
            single: s.ops,
            bytes_per_block: s.memory_bytes as f64 / held.max(1) as f64,
            two: t,
        });
    }
    Ok(WorkloadResult { held, by_index })
}

fn fmt_ns(ns: Option<f64>) -> String {
    match ns {
        None => "-".into(),
        Some(x) if x >= 1e6 => format!("{:.2} ms", x / 1e6),
        Some(x) if x >= 1e3 => format!("{:.2} us", x / 1e3),
        Some(x) => format!("{x:.0} ns"),
    }
}

fn fmt_rate(r: Option<f64>) -> String {
    r.map_or("-".into(), |x| format!("{:.1}M", x / 1e6))
}

/// Our lead over the best Dynamo index: their best time over ours (above 1: we lead).
fn lead(ours: Option<f64>, theirs: &[Option<f64>]) -> String {
    let best = theirs
        .iter()
        .flatten()
        .copied()
        .fold(f64::INFINITY, f64::min);
    match ours {
        Some(o) if best.is_finite() && o > 0.0 => format!("{:.2}x", best / o),
        _ => "-".into(),
    }
}

fn row(label: &str, cells: &[String], lead: String) {
    print!("{label:<22}");
    for c in cells {
        print!("{c:>20}");
    }
    println!("{lead:>10}");
}

/// Prints the workload's table.
pub fn print(w: &Workload, r: &WorkloadResult) {
    println!(
        "\n== {} ({}; {} entries held when fullest)",
        w.name, w.about, r.held
    );
    row("", &NAMES.map(String::from), "lead".into());
    for op in ["store", "remove", "events", "match"] {
        let get = |i: &IndexResult| i.single.get(op).cloned().unwrap_or_default();
        let stats: Vec<OpStats> = r.by_index.iter().map(get).collect();
        if stats.iter().all(|s| s.ops == 0) {
            continue;
        }
        let cells: Vec<String> = stats
            .iter()
            .map(|s| {
                format!(
                    "{} / {}",
                    fmt_ns(s.quantile(0.5).map(|x| x as f64)),
                    fmt_ns(s.quantile(0.99).map(|x| x as f64))
                )
            })
            .collect();
        let p50: Vec<Option<f64>> = stats
            .iter()
            .map(|s| s.quantile(0.5).map(|x| x as f64))
            .collect();
        row(&format!("{op} p50 / p99"), &cells, lead(p50[0], &p50[1..]));
        let means: Vec<Option<f64>> = stats.iter().map(OpStats::mean_ns).collect();
        let cells: Vec<String> = stats
            .iter()
            .map(|s| format!("{} {}", fmt_ns(s.mean_ns()), fmt_rate(s.block_ops_per_s())))
            .collect();
        row(
            &format!("{op} mean, blk/s"),
            &cells,
            lead(means[0], &means[1..]),
        );
    }
    let ev: Vec<Option<f64>> = r.by_index.iter().map(|i| i.two.events.mean_ns()).collect();
    let cells: Vec<String> = r
        .by_index
        .iter()
        .map(|i| fmt_rate(i.two.events.block_ops_per_s()))
        .collect();
    row("2T events blk/s", &cells, lead(ev[0], &ev[1..]));
    let q: Vec<Option<f64>> = r.by_index.iter().map(|i| i.two.matched.mean_ns()).collect();
    let cells: Vec<String> = r
        .by_index
        .iter()
        .map(|i| {
            let m = &i.two.matched;
            format!(
                "{} {}/{}",
                m.ops,
                fmt_ns(m.quantile(0.5).map(|x| x as f64)),
                fmt_ns(m.quantile(0.99).map(|x| x as f64))
            )
        })
        .collect();
    row("2T match n p50/p99", &cells, lead(q[0], &q[1..]));
    let mem: Vec<Option<f64>> = r.by_index.iter().map(|i| Some(i.bytes_per_block)).collect();
    let cells: Vec<String> = mem
        .iter()
        .map(|m| format!("{:.1} B", m.unwrap_or(0.0)))
        .collect();
    row("memory per entry", &cells, lead(mem[0], &mem[1..]));
}

fn op_json(
    name: &str,
    stats: &[Option<&OpStats>],
    value: impl Fn(&OpStats) -> Option<f64>,
) -> Value {
    let v = |i: usize| stats[i].and_then(&value);
    json!({
        "ours_ns": v(0),
        "dynamo": {"RadixTree": v(1), "CRTC": v(2), "Positional": v(3)},
        "detail": NAMES.iter().enumerate().map(|(i, n)| {
            ((*n).to_owned(), stats[i].map_or(Value::Null, OpStats::json))
        }).collect::<serde_json::Map<_, _>>(),
        "what": name,
    })
}

/// `{"workload": {"op": {"ours_ns", "dynamo": {..}, "detail": {..}}}, "_meta": {..}}`.
pub fn json(ws: &[Workload], rs: &[WorkloadResult]) -> Value {
    let mut doc = serde_json::Map::new();
    for (w, r) in ws.iter().zip(rs) {
        let mut ops = serde_json::Map::new();
        for op in ["store", "remove", "events", "match"] {
            let stats: Vec<Option<&OpStats>> =
                r.by_index.iter().map(|i| i.single.get(op)).collect();
            if stats.iter().flatten().all(|s| s.ops == 0) {
                continue;
            }
            ops.insert(
                op.into(),
                op_json(
                    "mean ns per operation, one thread",
                    &stats,
                    OpStats::mean_ns,
                ),
            );
        }
        let ev: Vec<Option<&OpStats>> = r.by_index.iter().map(|i| Some(&i.two.events)).collect();
        ops.insert(
            "events_2t".into(),
            op_json(
                "mean ns per event, events and queries on two threads",
                &ev,
                OpStats::mean_ns,
            ),
        );
        let q: Vec<Option<&OpStats>> = r.by_index.iter().map(|i| Some(&i.two.matched)).collect();
        ops.insert(
            "match_2t".into(),
            op_json(
                "mean ns per query while events run on the other thread",
                &q,
                OpStats::mean_ns,
            ),
        );
        let mem: Vec<f64> = r.by_index.iter().map(|i| i.bytes_per_block).collect();
        ops.insert(
            "memory".into(),
            json!({
                "ours_bytes_per_entry": mem[0],
                "dynamo": {"RadixTree": mem[1], "CRTC": mem[2], "Positional": mem[3]},
                "entries": r.held,
            }),
        );
        ops.insert("about".into(), json!(w.about));
        doc.insert(w.name.into(), Value::Object(ops));
    }
    doc.insert(
        "_meta".into(),
        json!({
            "dynamo_kv_router": "1.6.1",
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "commit": std::env::var("PEER_BENCH_COMMIT").ok(),
        }),
    );
    Value::Object(doc)
}
