//! Per-operation figures: latency percentiles where single operations are timed, and rates.

use std::time::Duration;

/// One operation kind's timings on one index.
#[derive(Debug, Default, Clone)]
pub struct OpStats {
    /// Each operation's nanoseconds (empty where only batches were timed).
    pub each_ns: Vec<u64>,
    /// Total nanoseconds.
    pub total_ns: u64,
    /// Operations.
    pub ops: usize,
    /// Blocks they touched.
    pub blocks: usize,
}

impl OpStats {
    /// Adds one timed operation.
    pub fn one(&mut self, d: Duration, blocks: usize) {
        let ns = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.each_ns.push(ns);
        self.total_ns += ns;
        self.ops += 1;
        self.blocks += blocks;
    }

    /// Adds a batch timed as a whole.
    pub fn batch(&mut self, d: Duration, ops: usize, blocks: usize) {
        self.total_ns += u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.ops += ops;
        self.blocks += blocks;
    }

    /// Folds another's figures in (its single timings only if both have them).
    pub fn merge(&mut self, other: &OpStats) {
        let per_op = self.each_ns.len() == self.ops && other.each_ns.len() == other.ops;
        self.each_ns.extend(&other.each_ns);
        if !per_op {
            self.each_ns.clear();
        }
        self.total_ns += other.total_ns;
        self.ops += other.ops;
        self.blocks += other.blocks;
    }

    /// The `q`-quantile of single timings, if every operation was timed alone.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        if self.each_ns.is_empty() || self.each_ns.len() != self.ops {
            return None;
        }
        let mut v = self.each_ns.clone();
        let i = ((v.len() - 1) as f64 * q).round() as usize;
        Some(*v.select_nth_unstable(i).1)
    }

    /// Mean nanoseconds per operation.
    pub fn mean_ns(&self) -> Option<f64> {
        (self.ops > 0).then(|| self.total_ns as f64 / self.ops as f64)
    }

    /// Blocks per second.
    pub fn block_ops_per_s(&self) -> Option<f64> {
        (self.total_ns > 0).then(|| self.blocks as f64 / (self.total_ns as f64 * 1e-9))
    }

    /// The JSON object of these figures.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "median_ns": self.quantile(0.5),
            "p99_ns": self.quantile(0.99),
            "mean_ns": self.mean_ns(),
            "block_ops_per_s": self.block_ops_per_s(),
            "ops": self.ops,
            "blocks": self.blocks,
        })
    }
}
