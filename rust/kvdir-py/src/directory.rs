//! `KvDirectory` and `PrefixMatch`: the Python face of `kvdir::Directory`.
//!
//! One directory is shared by the router's event loop and its event-ingestion threads, so the
//! core sits behind a read-write lock. Short calls take the lock while holding the GIL (releasing
//! and re-taking the GIL costs more than a short `match`); long calls, and any call that finds the
//! lock taken, release the GIL first so other Python threads keep running. The lock is never
//! waited for while the GIL is held, and the GIL is never taken while the lock is held, so the
//! two cannot deadlock.

use numpy::{PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadwriteArray1};
use parking_lot::RwLock;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use kvdir::{BranchId, Directory, Error};

use crate::convert;
use crate::errors::to_py;

/// Chains longer than this (blocks) or batches larger than this (bytes) release the GIL.
const LONG_CALL: usize = 2048;

/// Cluster-wide directory of KV blocks: holders per tier, branch counts, eviction order.
#[pyclass(module = "evolving_infra._core", frozen)]
pub(crate) struct KvDirectory {
    inner: RwLock<Directory>,
}

impl KvDirectory {
    fn write<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut Directory) -> R + Send,
    ) -> R {
        if !long {
            if let Some(mut guard) = self.inner.try_write() {
                return f(&mut guard);
            }
        }
        py.detach(|| f(&mut self.inner.write()))
    }

    fn read<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&Directory) -> R + Send,
    ) -> R {
        if !long {
            if let Some(guard) = self.inner.try_read() {
                return f(&guard);
            }
        }
        py.detach(|| f(&self.inner.read()))
    }

    /// `write` for a call that can fail: the directory's error becomes its Python exception once
    /// the GIL is back (the one place the bindings release the GIL around a fallible call).
    fn try_write<R: Send>(
        &self,
        py: Python<'_>,
        long: bool,
        f: impl FnOnce(&mut Directory) -> kvdir::Result<R> + Send,
    ) -> PyResult<R> {
        self.write(py, long, f).map_err(|e| to_py(py, e))
    }
}

fn tier_opt(py: Python<'_>, tier: Option<&str>) -> PyResult<Option<kvdir::Tier>> {
    tier.map(|t| convert::tier(py, t)).transpose()
}

#[pymethods]
impl KvDirectory {
    #[new]
    fn new() -> Self {
        KvDirectory {
            inner: RwLock::new(Directory::new()),
        }
    }

    /// `(node, tier)` now holds the chain `hashes`; `parent` is the parent of `hashes[0]`.
    #[pyo3(signature = (node, tier, hashes, parent=None, now=None))]
    fn store(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        tier: &str,
        hashes: &Bound<'_, PyAny>,
        parent: Option<&Bound<'_, PyAny>>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let node = convert::node(node)?;
        let tier = convert::tier(py, tier)?;
        let hashes = convert::hashes(hashes)?;
        let parent = parent
            .filter(|p| !p.is_none())
            .map(convert::hash)
            .transpose()?;
        let now = convert::now(now);
        self.try_write(py, hashes.len() > LONG_CALL, |d| {
            d.store(node, tier, &hashes, parent, now)
        })
    }

    /// `(node, tier)` no longer holds `hashes`; unknown or not-held hashes are ignored.
    fn remove(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        tier: &str,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let node = convert::node(node)?;
        let tier = convert::tier(py, tier)?;
        let hashes = convert::hashes(hashes)?;
        self.write(py, hashes.len() > LONG_CALL, |d| {
            d.remove(node, tier, &hashes);
        });
        Ok(())
    }

    /// Drops everything `node` holds (in `tier`, or in both tiers when `tier` is None).
    #[pyo3(signature = (node, tier=None))]
    fn clear(&self, py: Python<'_>, node: &Bound<'_, PyAny>, tier: Option<&str>) -> PyResult<()> {
        let node = convert::node(node)?;
        let tier = tier_opt(py, tier)?;
        self.write(py, true, |d| d.clear(node, tier));
        Ok(())
    }

    /// How much of the query chain (from its first page) each node, the pool and the cluster hold.
    #[pyo3(name = "match")]
    fn match_(&self, py: Python<'_>, hashes: &Bound<'_, PyAny>) -> PyResult<PrefixMatch> {
        let hashes = convert::hashes(hashes)?;
        let m = self.read(py, hashes.len() > LONG_CALL, |d| d.match_prefix(&hashes));
        Ok(PrefixMatch { inner: m })
    }

    /// Last-access time := `now` for the leading query blocks `node` holds.
    #[pyo3(signature = (node, hashes, now=None))]
    fn touch(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<()> {
        let node = convert::node(node)?;
        let hashes = convert::hashes(hashes)?;
        let now = convert::now(now);
        self.try_write(py, hashes.len() > LONG_CALL, |d| {
            d.touch(node, &hashes, now)
        })
    }

    /// The branch's live context is now exactly `hashes`; False if `version` is stale.
    #[pyo3(signature = (branch, hashes, version=None))]
    fn branch_set(
        &self,
        py: Python<'_>,
        branch: &Bound<'_, PyAny>,
        hashes: &Bound<'_, PyAny>,
        version: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let id = convert::branch(py, branch)?;
        let hashes = convert::hashes(hashes)?;
        let version = version
            .filter(|v| !v.is_none())
            .map(|v| {
                v.extract::<i64>().map_err(|_| {
                    to_py(
                        py,
                        Error::InvalidArgument {
                            argument: "version",
                            reason: "must be an int of 64 bits".into(),
                        },
                    )
                })
            })
            .transpose()?;
        self.try_write(py, hashes.len() > LONG_CALL, |d| {
            d.branch_set(id, &hashes, version)
        })
    }

    /// `dst` starts with `src`'s context and version.
    fn branch_fork(
        &self,
        py: Python<'_>,
        src: &Bound<'_, PyAny>,
        dst: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let (s, t) = (convert::branch(py, src)?, convert::branch(py, dst)?);
        self.write(py, false, |d| d.branch_fork(&s, t))
            .map_err(|e| {
                // Give the caller back the branch object it passed, not its text.
                let culprit = if matches!(e, Error::UnknownBranch { .. }) {
                    src
                } else {
                    dst
                };
                let err = to_py(py, e);
                let _ = err.value(py).setattr("branch", culprit);
                err
            })
    }

    /// Ends a branch; False if it is unknown.
    fn branch_end(&self, py: Python<'_>, branch: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id: BranchId = convert::branch(py, branch)?;
        Ok(self.write(py, false, |d| d.branch_end(&id)))
    }

    /// `R_b`: live branches whose context contains `h` (0 if unknown).
    fn refcount(&self, py: Python<'_>, h: &Bound<'_, PyAny>) -> PyResult<u32> {
        let h = convert::hash(h)?;
        Ok(self.read(py, false, |d| d.refcount(h)))
    }

    /// Of `hashes`, those some node other than `node` holds in `tier`, in the order given.
    fn held_elsewhere(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        tier: &str,
        hashes: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<i64>> {
        let node = convert::node(node)?;
        let tier = convert::tier(py, tier)?;
        let hashes = convert::hashes(hashes)?;
        Ok(self.read(py, hashes.len() > LONG_CALL, |d| {
            d.held_elsewhere(node, tier, &hashes)
        }))
    }

    /// Blocks `node` holds in `tier` (both tiers, each holding counted, when `tier` is None).
    #[pyo3(signature = (node, tier=None))]
    fn held(&self, py: Python<'_>, node: &Bound<'_, PyAny>, tier: Option<&str>) -> PyResult<u64> {
        let node = convert::node(node)?;
        let tier = tier_opt(py, tier)?;
        Ok(self.read(py, false, |d| d.held(node, tier)))
    }

    /// The current eviction candidates of `(node, tier)`, first to evict first.
    #[pyo3(signature = (node, tier, limit=None))]
    fn eviction_order(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        tier: &str,
        limit: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<i64>> {
        let node = convert::node(node)?;
        let tier = convert::tier(py, tier)?;
        let limit = limit
            .filter(|l| !l.is_none())
            .map(|l| convert::count(l, "limit"))
            .transpose()?;
        let long = limit.is_none_or(|l| l > LONG_CALL);
        Ok(self.read(py, long, |d| d.eviction_order(node, tier, limit)))
    }

    /// Removes up to `n` blocks from `(node, tier)` in eviction order; returns them in order.
    fn evict(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        tier: &str,
        n: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<i64>> {
        let node = convert::node(node)?;
        let tier = convert::tier(py, tier)?;
        let n = convert::count(n, "n")?;
        Ok(self.write(py, n > 64, |d| d.evict(node, tier, n)))
    }

    /// Evicts up to `n` blocks from `node`'s L1 in eviction order and holds each in its L2 with
    /// last access `now`; returns `(hashes, parents)` in the order evicted (children first), a
    /// first page's parent `None`.
    #[pyo3(signature = (node, n, now=None))]
    fn demote(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        n: &Bound<'_, PyAny>,
        now: Option<f64>,
    ) -> PyResult<(Vec<i64>, Vec<Option<i64>>)> {
        let node = convert::node(node)?;
        let n = convert::count(n, "n")?;
        let now = convert::now(now);
        let demoted = self.try_write(py, n > 64, |d| d.demote(node, n, now))?;
        Ok(demoted.into_iter().unzip())
    }

    /// Applies one SGLang `KVEventBatch` (msgpack bytes) as `node`'s events; returns the number
    /// of events applied. Corrupt bytes or an invalid chain raise and change nothing.
    #[pyo3(signature = (node, payload, now=None))]
    fn apply_events(
        &self,
        py: Python<'_>,
        node: &Bound<'_, PyAny>,
        payload: &Bound<'_, PyBytes>,
        now: Option<f64>,
    ) -> PyResult<usize> {
        let node = convert::node(node)?;
        let bytes = payload.as_bytes();
        let now = convert::now(now);
        let long = bytes.len() > LONG_CALL;
        // Decoding needs no lock: do it before taking one.
        let batch = if long {
            py.detach(|| kvdir::events::decode_batch(bytes))
        } else {
            kvdir::events::decode_batch(bytes)
        }
        .map_err(|e| to_py(py, e))?;
        self.try_write(py, long, |d| d.apply_batch(node, &batch, now))
    }

    /// Sizes of the directory: blocks, placeholders, locations (per tier), nodes, branches,
    /// candidates, `events_skipped`, `memory_bytes`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.read(py, true, Directory::stats);
        let d = PyDict::new(py);
        d.set_item("blocks", s.blocks)?;
        d.set_item("placeholders", s.placeholders)?;
        d.set_item("locations", s.locations)?;
        d.set_item("locations_l1", s.locations_l1)?;
        d.set_item("locations_l2", s.locations_l2)?;
        d.set_item("nodes", s.nodes)?;
        d.set_item("branches", s.branches)?;
        d.set_item("candidates", s.candidates)?;
        d.set_item("events_skipped", s.events_skipped)?;
        d.set_item("memory_bytes", s.memory_bytes)?;
        Ok(d)
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.read(py, false, Directory::len)
    }

    fn __contains__(&self, py: Python<'_>, h: &Bound<'_, PyAny>) -> PyResult<bool> {
        let h = convert::hash(h)?;
        Ok(self.read(py, false, |d| d.contains(h)))
    }
}

/// Result of `KvDirectory.match`: how much of a query chain each place holds.
#[pyclass(module = "evolving_infra._core", frozen)]
pub(crate) struct PrefixMatch {
    inner: kvdir::PrefixMatch,
}

/// A new numpy array owning a copy of `values`, widened in numpy's own buffer. NOTE: handing
/// numpy a `Vec` (`into_pyarray`) also allocates a Python capsule to own it, and widening into
/// a `Vec` first to copy it (`from_slice`) cost one more allocation per array.
fn int64_array<'py>(py: Python<'py>, values: &[u32]) -> Bound<'py, PyArray1<i64>> {
    // SAFETY: a new array of `values.len()` elements, every one written below before Python
    // can see it.
    let out = unsafe { PyArray1::<i64>::new(py, values.len(), false) };
    // SAFETY: the array is new, contiguous and referenced only here.
    let dst = unsafe { out.as_slice_mut() }.expect("a new array is contiguous");
    for (d, &v) in dst.iter_mut().zip(values) {
        *d = i64::from(v);
    }
    out
}

#[pymethods]
impl PrefixMatch {
    /// {node: (l1, l12)} for every node with l12 > 0.
    #[getter]
    fn nodes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let m = &self.inner;
        for ((n, l1), l12) in m.node_ids().iter().zip(m.l1()).zip(m.l12()) {
            d.set_item(n, (l1, l12))?;
        }
        Ok(d)
    }

    /// Leading query blocks each held in the L2 of at least one node.
    #[getter]
    fn pool(&self) -> u32 {
        self.inner.pool
    }

    /// Leading query blocks each held somewhere.
    #[getter]
    fn cluster(&self) -> u32 {
        self.inner.cluster
    }

    /// `(l1, l12)` of one node, `(0, 0)` if it holds none of the query: `nodes.get(node, (0, 0))`
    /// without building the map (one binary search; the map costs a node per entry).
    fn node(&self, node: &Bound<'_, PyAny>) -> PyResult<(u32, u32)> {
        Ok(self.inner.node(convert::node(node)?))
    }

    /// Each candidate's predicted TTFT into `out`; returns the index of the least.
    /// The router's hot path (`evolving_infra.timing.ttft` says what the figures mean).
    /// `form`: the model's `PrefillForm` (intercept, uncached, hinge, attention, cached, knee).
    #[pyo3(signature = (prompt_tokens, block_size, form, l2_seconds_per_block,
        pool_seconds_per_block, slot, queue, out))]
    #[allow(clippy::too_many_arguments)] // one flat call: every argument is a number or array
    fn ttft(
        &self,
        prompt_tokens: u64,
        block_size: u32,
        form: (f64, f64, f64, f64, f64, f64),
        l2_seconds_per_block: f64,
        pool_seconds_per_block: f64,
        slot: PyReadonlyArray1<'_, i64>,
        queue: PyReadonlyArray1<'_, f64>,
        mut out: PyReadwriteArray1<'_, f64>,
    ) -> PyResult<usize> {
        let (b0, b1, b2, b3, b4, knee) = form;
        let params = kvdir::scoring::TtftParams {
            #[allow(clippy::cast_precision_loss)] // token counts are far below 2^53
            prompt_tokens: prompt_tokens as f64,
            block_size: f64::from(block_size),
            form: kvdir::scoring::PrefillForm {
                coef: [b0, b1, b2, b3, b4],
                knee,
            },
            l2_seconds_per_block,
            pool_seconds_per_block,
        };
        let (slot, queue) = (slot.as_slice()?, queue.as_slice()?);
        let out = out.as_slice_mut()?;
        if prompt_tokens == 0 || queue.is_empty() || queue.len() != out.len() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "ttft needs prompt_tokens >= 1 and queue and out of one non-zero length",
            ));
        }
        Ok(kvdir::scoring::ttft_into(
            &self.inner,
            &params,
            slot,
            queue,
            out,
        ))
    }

    /// Nodes with l12 > 0, ascending.
    #[getter]
    fn node_ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        int64_array(py, self.inner.node_ids())
    }

    /// Leading query blocks in each node's L1, aligned with `node_ids`.
    #[getter]
    fn l1<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        int64_array(py, self.inner.l1())
    }

    /// Leading query blocks in each node's L1 ∪ L2, aligned with `node_ids`.
    #[getter]
    fn l12<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<i64>> {
        int64_array(py, self.inner.l12())
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn __repr__(&self) -> String {
        let m = &self.inner;
        let nodes: Vec<String> = m
            .node_ids()
            .iter()
            .zip(m.l1())
            .zip(m.l12())
            .map(|((n, a), b)| format!("{n}: ({a}, {b})"))
            .collect();
        format!(
            "PrefixMatch(nodes={{{}}}, pool={}, cluster={})",
            nodes.join(", "),
            m.pool,
            m.cluster
        )
    }
}
