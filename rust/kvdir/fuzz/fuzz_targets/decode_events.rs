//! Fuzz target `decode_events`: arbitrary bytes through `kvdir::events::decode_batch` and
//! `Directory::apply_events`.
//!
//! The input is one or more payloads joined by `SEP` (`BATCH` between two 0xc1 bytes, the
//! MessagePack marker that is never used, so a batch contains it only among its data bytes),
//! applied in order as node 0 to a directory that already holds some blocks on nodes 0 and 1 and
//! has two live branches; seeding a whole recorded SGLang sequence as one input lets later batches
//! find the parents earlier ones created. For each payload:
//! - neither call panics; a decode error is an `EventDecode` whose offset lies within the payload,
//!   and `apply_events` refuses every payload `decode_batch` refuses, with the same error;
//! - a refused payload leaves the directory unchanged: `stats()`, memory included, and `match`
//!   of the prior chains; when it is refused after decoding (an invalid chain), the error is the
//!   reference model's kind of error;
//! - an accepted payload applies as many events as the model applies, and leaves the directory's
//!   invariants intact (`check_invariants`);
//! - at the end of the input, the directory agrees with the model on everything observable
//!   (`kvdir_fuzz::check::compare`).

#![no_main]

use kvdir::events::{decode_batch, Event};
use kvdir::{BlockHash, BranchId, Directory, Error, NodeId, Tier};
use kvdir_fuzz::check::{compare, match_of, root_path};
use kvdir_fuzz::model::{Model, ModelEvent};
use libfuzzer_sys::fuzz_target;

/// Separates payloads in one input (also in `decode_events.dict` and `build_corpus.py`).
const SEP: &[u8] = b"\xc1BATCH\xc1";

/// Payloads per input beyond which the rest is ignored.
const MAX_PAYLOADS: usize = 32;

const NODES: [NodeId; 2] = [0, 1];

/// The state every input starts from, on both sides: node 0 holds a chain in L1 and part of it in
/// L2, node 1 a branch off it and a lone block, and two branches need blocks (one a placeholder).
fn prior() -> (Directory, Model, Vec<Vec<BlockHash>>) {
    let mut d = Directory::new();
    let mut m = Model::default();
    let stores: [(NodeId, Tier, &[BlockHash], Option<BlockHash>); 4] = [
        (0, Tier::L1, &[1, 2, 3], None),
        (0, Tier::L2, &[1, 2], None),
        (1, Tier::L1, &[4], Some(2)),
        (1, Tier::L2, &[7], None),
    ];
    for (i, (node, tier, hashes, parent)) in stores.into_iter().enumerate() {
        d.store(node, tier, hashes, parent, i as f64)
            .expect("prior store");
        m.store(node, tier, hashes, parent, i as f64)
            .expect("prior store");
    }
    for (b, hashes) in [
        (BranchId::Int(0), &[1, 2, 3, 5][..]),
        (BranchId::Str("b".into()), &[7][..]),
    ] {
        assert_eq!(d.branch_set(b.clone(), hashes, None), Ok(true));
        assert_eq!(m.branch_set(b, hashes, None), Ok(true));
    }
    let queries = vec![vec![1, 2, 3, 5], vec![1, 2, 4], vec![7]];
    (d, m, queries)
}

fn split(data: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let (mut start, mut i) = (0, 0);
    // Compare only where the first byte matches: a slice comparison at every offset is an
    // intercepted `bcmp` call each, a tenth of the run time.
    while let Some(j) = data[i..].iter().position(|&b| b == SEP[0]) {
        i += j;
        if data[i..].starts_with(SEP) {
            out.push(&data[start..i]);
            i += SEP.len();
            start = i;
        } else {
            i += 1;
        }
    }
    out.push(&data[start..]);
    out
}

fn model_event(e: &Event) -> ModelEvent {
    match e {
        Event::Stored {
            hashes,
            parent,
            tier,
        } => ModelEvent::Stored(hashes.clone(), *parent, *tier),
        Event::Removed { hashes, tier } => ModelEvent::Removed(hashes.clone(), *tier),
        Event::Cleared => ModelEvent::Cleared,
        Event::Unknown => ModelEvent::Unknown,
    }
}

fn run(data: &[u8]) {
    let (mut d, mut m, prior_queries) = prior();
    // Last hashes of chains the payloads name, probed at the end (bounded: hostile batches can
    // be long).
    let mut named = Vec::new();
    for (i, payload) in split(data).into_iter().take(MAX_PAYLOADS).enumerate() {
        let now = i as f64;
        let decoded = decode_batch(payload);
        if let Err(e) = &decoded {
            assert!(
                matches!(e, Error::EventDecode { offset, .. } if *offset <= payload.len()),
                "decode error {e:?} for a payload of {} bytes",
                payload.len()
            );
        }
        let before = d.stats();
        let applied = d.apply_events(0, payload, now);
        match (&decoded, &applied) {
            (Err(x), Err(y)) => assert_eq!(x, y, "apply_events and decode_batch disagree"),
            (Err(x), Ok(n)) => panic!("decode refused ({x:?}) but apply accepted {n} events"),
            (Ok(batch), _) => {
                let events: Vec<ModelEvent> = batch.events.iter().map(model_event).collect();
                let want = m.apply(0, &events, now);
                match (&applied, &want) {
                    (Err(x), Err(y)) => assert_eq!(
                        std::mem::discriminant(x),
                        std::mem::discriminant(y),
                        "directory refused with {x:?}, model with {y:?}"
                    ),
                    _ => assert_eq!(&applied, &want, "events applied"),
                }
                for e in &batch.events {
                    if let Event::Stored { hashes, .. } | Event::Removed { hashes, .. } = e {
                        if named.len() < 64 {
                            named.extend(hashes.last());
                        }
                    }
                }
                d.check_invariants();
            }
        }
        if applied.is_err() {
            assert_eq!(before, d.stats(), "a refused payload changed the directory");
            for q in &prior_queries {
                assert_eq!(match_of(&d, q), m.match_prefix(q), "match {q:?}");
            }
        }
    }
    // The whole comparison with the model once per input: per payload it would cost many times
    // the run itself on the recorded sequences, and a divergence persists to the end unless a
    // later payload happens to erase it.
    let mut queries = prior_queries;
    queries.extend(named.iter().map(|&h| root_path(&m, h)));
    compare(&d, &m, &NODES, &queries);
}

fuzz_target!(|data: &[u8]| run(data));
