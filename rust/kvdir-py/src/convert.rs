//! Argument conversion: Python values to the core's types, before any lock is taken or the GIL
//! is released (tokenizers' habit: convert first, then detach).

use std::sync::OnceLock;
use std::time::Instant;

use numpy::PyReadonlyArray1;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

use kvdir::{BlockHash, BranchId, Error, NodeId, Tier};

use crate::errors::to_py;
use crate::fastint;

/// A hash from one Python int; ints outside the signed 64-bit range raise `HashRangeError`.
pub(crate) fn hash(obj: &Bound<'_, PyAny>) -> PyResult<BlockHash> {
    match obj.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(e) if obj.is_instance_of::<PyInt>() => {
            drop(e);
            Err(to_py(
                obj.py(),
                Error::HashRange {
                    value: obj.str()?.to_string(),
                },
            ))
        }
        Err(e) => Err(e),
    }
}

/// A chain of hashes from a list, a tuple, an `int64` numpy array or any iterable of ints.
pub(crate) fn hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    if let Ok(kept) = obj.cast::<crate::prompt::PyPageHashes>() {
        return Ok(kept.get().hashes.clone());
    }
    if let Ok(list) = obj.cast::<PyList>() {
        // NOTE: the fallback iterates safely (an item's `__index__` may change the list).
        return fastint::list(list)
            .map_or_else(|| list.iter().map(|item| hash(&item)).collect(), Ok);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return fastint::tuple(tuple)
            .map_or_else(|| tuple.iter().map(|item| hash(&item)).collect(), Ok);
    }
    if let Ok(array) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return Ok(array.as_array().to_vec());
    }
    if obj.is_instance_of::<PyString>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "hashes must be ints, not a str",
        ));
    }
    obj.try_iter()?.map(|item| hash(&item?)).collect()
}

/// Token ids as `u32`s, or `None` when one is not an int in [0, 2^32) (a bool, a float, a
/// negative or too large int). Lists and tuples of exact ints are read in place (`fastint`);
/// anything else, or a list the fast path turned down, goes item by item. Not a sequence of
/// items at all: `TypeError`.
pub(crate) fn token_ids(obj: &Bound<'_, PyAny>) -> PyResult<Option<Vec<u32>>> {
    let fast = if let Ok(list) = obj.cast::<PyList>() {
        fastint::list(list)
    } else if let Ok(tuple) = obj.cast::<PyTuple>() {
        fastint::tuple(tuple)
    } else {
        None
    };
    if let Some(ints) = fast {
        return Ok(ints.into_iter().map(|t| u32::try_from(t).ok()).collect());
    }
    if obj.is_instance_of::<PyString>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "token ids must be ints, not a str",
        ));
    }
    let mut out = Vec::with_capacity(obj.len().unwrap_or(0));
    for item in obj.try_iter()? {
        let item = item?;
        // Exact ints only: a bool is an int to Python, not a token id to SGLang.
        if !item.is_exact_instance_of::<PyInt>() {
            return Ok(None);
        }
        match item.extract::<u32>() {
            Ok(t) => out.push(t),
            Err(_) => return Ok(None),
        }
    }
    Ok(Some(out))
}

/// An int argument; ints beyond 64 bits raise `InvalidArgumentError` naming it (not a bare
/// `OverflowError`), other types raise `TypeError`.
fn int_arg(obj: &Bound<'_, PyAny>, argument: &'static str) -> PyResult<i64> {
    obj.extract::<i64>().map_err(|e| {
        if obj.is_instance_of::<PyInt>() {
            let reason = format!("{obj} does not fit 64 bits");
            to_py(obj.py(), Error::InvalidArgument { argument, reason })
        } else {
            e
        }
    })
}

pub(crate) fn node(obj: &Bound<'_, PyAny>) -> PyResult<NodeId> {
    kvdir::check_node(int_arg(obj, "node")?).map_err(|e| to_py(obj.py(), e))
}

pub(crate) fn tier(py: Python<'_>, tier: &str) -> PyResult<Tier> {
    tier.parse().map_err(|e| to_py(py, e))
}

pub(crate) fn count(obj: &Bound<'_, PyAny>, argument: &'static str) -> PyResult<usize> {
    let n = int_arg(obj, argument)?;
    usize::try_from(n).map_err(|_| {
        to_py(
            obj.py(),
            Error::InvalidArgument {
                argument,
                reason: format!("{n} is negative"),
            },
        )
    })
}

pub(crate) fn branch(py: Python<'_>, obj: &Bound<'_, PyAny>) -> PyResult<BranchId> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(BranchId::Str(s.to_str()?.into()));
    }
    if obj.is_instance_of::<PyInt>() {
        return obj.extract::<i64>().map(BranchId::Int).map_err(|_| {
            to_py(
                py,
                Error::InvalidArgument {
                    argument: "branch",
                    reason: "int ids must fit 64 bits".into(),
                },
            )
        });
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "branch ids are str or int, not {}",
        obj.get_type().name()?
    )))
}

/// Python's `time.monotonic()` clock (`CLOCK_MONOTONIC`), read without calling into Python: the
/// offset between it and `Instant` is taken once, when the module loads.
static CLOCK: OnceLock<(Instant, f64)> = OnceLock::new();

pub(crate) fn init_clock(py: Python<'_>) -> PyResult<()> {
    let t: f64 = py
        .import("time")?
        .getattr("monotonic")?
        .call0()?
        .extract()?;
    let _ = CLOCK.set((Instant::now(), t));
    Ok(())
}

pub(crate) fn now(now: Option<f64>) -> f64 {
    now.unwrap_or_else(|| {
        let (origin, base) = CLOCK.get().expect("clock set at module init");
        base + origin.elapsed().as_secs_f64()
    })
}
