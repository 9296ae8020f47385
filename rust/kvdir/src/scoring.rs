//! Per-node TTFT of one request from a [`PrefixMatch`]: the router's hot arithmetic.
//!
//! The model is Python's (`evolving_infra.timing.ttft`, DESIGN §3); this is its evaluation over
//! every candidate node in one call, because a numpy expression over 64 nodes costs ~20 calls of
//! a microsecond each, more than the match itself. TTFT on node n =
//! `max(queue_n, fetch_n) + prefill(p - c_n, c_n)`, with `c_n` the cached tokens (the node's own
//! L1 ∪ L2 prefix or the shared pool's, whichever is longer, capped so one token is computed),
//! `fetch_n` the time to bring the L2 and pool blocks into GPU memory, and `prefill(u, c) = b0 +
//! b1·u + b2·max(0, u - knee) + b3·(u·c + u(u+1)/2) + b4·c`, the iteration-time model's form
//! ([`PrefillForm`], the record Python's model hands over).

use crate::PrefixMatch;

/// The iteration-time model's prefill form and its fitted figures: Python's
/// `timing.model.PrefillForm`, which the bindings hand over as it is (a 6-tuple).
#[derive(Debug, Clone, Copy)]
pub struct PrefillForm {
    /// Coefficients: intercept, uncached, hinge, attention pairs, cached.
    pub coef: [f64; 5],
    /// Uncached tokens where the hinge starts (infinite: no hinge).
    pub knee: f64,
}

impl PrefillForm {
    /// Seconds of one request's prefill alone: `u` uncached tokens over `c` cached ones.
    #[must_use]
    pub fn seconds(&self, u: f64, c: f64) -> f64 {
        let [b0, b1, b2, b3, b4] = self.coef;
        let hinge = if u > self.knee { u - self.knee } else { 0.0 };
        b0 + b1 * u + b2 * hinge + b3 * (u * c + u * (u + 1.0) * 0.5) + b4 * c
    }
}

/// What the TTFT of one request depends on besides the match and the queues.
#[derive(Debug, Clone, Copy)]
pub struct TtftParams {
    /// Prompt tokens of the request (at least 1).
    pub prompt_tokens: f64,
    /// Tokens per block.
    pub block_size: f64,
    /// The prefill's time (the iteration-time model's current fit).
    pub form: PrefillForm,
    /// Seconds to fetch one block from the node's own L2.
    pub l2_seconds_per_block: f64,
    /// Seconds to fetch one block from the shared pool.
    pub pool_seconds_per_block: f64,
}

impl TtftParams {
    fn prefill(&self, cached_blocks: f64) -> f64 {
        let c = (cached_blocks * self.block_size).min(self.prompt_tokens - 1.0);
        self.form.seconds(self.prompt_tokens - c, c)
    }
}

/// Writes each candidate's TTFT into `out` and returns the index of the least (the first on
/// ties). `slot[node]` is the node's index in `queue`/`out`, or `queue.len()` for a node that
/// is not a candidate (nodes beyond `slot` are not candidates either).
///
/// # Panics
/// If `out` and `queue` differ in length or are empty.
#[must_use]
pub fn ttft_into(
    m: &PrefixMatch,
    p: &TtftParams,
    slot: &[i64],
    queue: &[f64],
    out: &mut [f64],
) -> usize {
    assert_eq!(queue.len(), out.len(), "one TTFT per queue");
    assert!(!queue.is_empty(), "at least one candidate");
    let pool = f64::from(m.pool);
    let pool_fetch = pool * p.pool_seconds_per_block;
    let base = p.prefill(pool);
    for (o, &q) in out.iter_mut().zip(queue) {
        *o = q.max(pool_fetch) + base;
    }
    let n = queue.len();
    for ((&node, &l1), &l12) in m.node_ids().iter().zip(m.l1()).zip(m.l12()) {
        let Some(k) = slot
            .get(node as usize)
            .and_then(|&s| usize::try_from(s).ok())
            .filter(|&s| s < n)
        else {
            continue;
        };
        let (l1, l12) = (f64::from(l1), f64::from(l12));
        let fetch =
            (l12 - l1) * p.l2_seconds_per_block + (pool - l12).max(0.0) * p.pool_seconds_per_block;
        out[k] = queue[k].max(fetch) + p.prefill(l12.max(pool));
    }
    let mut best = 0;
    for (k, &t) in out.iter().enumerate() {
        if t < out[best] {
            best = k;
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> TtftParams {
        TtftParams {
            prompt_tokens: 1000.0,
            block_size: 100.0,
            form: PrefillForm {
                coef: [0.01, 1e-4, 2e-4, 1e-9, 1e-6],
                knee: 200.0,
            },
            l2_seconds_per_block: 0.01,
            pool_seconds_per_block: 0.05,
        }
    }

    #[test]
    fn cached_nodes_win_unless_their_queue_is_long() {
        let m = PrefixMatch::new(&[1, 3], &[9, 0], &[9, 5], 0, 9);
        let p = params();
        let slot = [0, 1, 2, 3];
        let mut out = [0.0; 4];
        let best = ttft_into(&m, &p, &slot, &[0.0, 0.0, 0.0, 0.0], &mut out);
        assert_eq!(best, 1);
        // Node 1: 900 cached (L1), 100 uncached: no fetch, no hinge.
        let want =
            0.01 + 1e-4 * 100.0 + 1e-9 * (100.0 * 900.0 + 100.0 * 101.0 / 2.0) + 1e-6 * 900.0;
        assert!((out[1] - want).abs() < 1e-12);
        // Node 3: 500 cached from its L2 (5 blocks to fetch), 500 uncached: past the knee.
        let want3 = 0.05
            + (0.01
                + 1e-4 * 500.0
                + 2e-4 * 300.0
                + 1e-9 * (500.0 * 500.0 + 500.0 * 501.0 / 2.0)
                + 1e-6 * 500.0);
        assert!((out[3] - want3).abs() < 1e-12);
        // A queue longer than the saving moves the choice.
        let best = ttft_into(&m, &p, &slot, &[0.0, 5.0, 0.0, 0.0], &mut out);
        assert_eq!(best, 3);
    }

    #[test]
    fn a_full_hit_still_computes_one_token_and_non_candidates_are_skipped() {
        let m = PrefixMatch::new(&[0, 7], &[10, 10], &[10, 10], 0, 10);
        let p = params();
        let mut out = [0.0; 1];
        let best = ttft_into(&m, &p, &[0], &[0.0], &mut out);
        assert_eq!(best, 0);
        let want = 0.01 + 1e-4 + 1e-9 * (999.0 + 1.0) + 1e-6 * 999.0;
        assert!((out[0] - want).abs() < 1e-12);
    }
}
