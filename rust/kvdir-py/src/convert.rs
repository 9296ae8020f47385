//! Argument conversion: Python values to the core's types, before any lock is taken or the GIL
//! is released (tokenizers' habit: convert first, then detach).

use std::sync::OnceLock;
use std::time::Instant;

use numpy::PyReadonlyArray1;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

use kvdir::{BlockHash, BranchId, Error, NodeId, Tier};

use crate::errors::to_py;

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

/// `PyLong_AsLong` where C's `long` is 64 bits: `CPython` 3.11's `PyLong_AsLongLong` goes through
/// `_PyLong_AsByteArray` for multi-digit ints (every real page hash), about 25 ns an int.
#[cfg(all(target_pointer_width = "64", not(windows)))]
unsafe fn as_i64(obj: *mut ffi::PyObject) -> i64 {
    // SAFETY: forwarded from the caller (a valid object, GIL held).
    unsafe { ffi::PyLong_AsLong(obj) }
}

#[cfg(not(all(target_pointer_width = "64", not(windows))))]
unsafe fn as_i64(obj: *mut ffi::PyObject) -> i64 {
    // SAFETY: forwarded from the caller (a valid object, GIL held).
    unsafe { ffi::PyLong_AsLongLong(obj) }
}

/// How many items ahead `list_of_hashes` prefetches.
const PREFETCH_AHEAD: usize = 16;

/// Asks the CPU to start loading the cache line at `p` (a hint: never faults, no effect on
/// results).
#[inline]
fn prefetch(p: *const ffi::PyObject) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never dereferences in the language's sense and never
    // faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The common case, a list of ints, read through the C API: pyo3's per-item `extract` costs
/// ~35 ns an item, which made list conversion the largest part of a 100-block `match`.
///
/// NOTE: the ints of a real query were created one by one (hashing) and lie scattered in
/// memory, so reading each is a cache miss; converting item i while item i + 16 is being
/// prefetched overlaps those misses (a 100-int list: ~4 µs → ~1 µs on the benchmark machine).
fn list_of_hashes(list: &Bound<'_, PyList>) -> PyResult<Vec<BlockHash>> {
    let n = list.len();
    let mut out = Vec::with_capacity(n);
    let item = |i: usize| -> *mut ffi::PyObject {
        // SAFETY: `list` is a list (checked by the cast) and `i < n`, its length, with the GIL
        // held: a valid borrowed reference.
        unsafe { ffi::PyList_GetItem(list.as_ptr(), i as ffi::Py_ssize_t) }
    };
    for i in 0..n.min(PREFETCH_AHEAD) {
        prefetch(item(i));
    }
    for i in 0..n {
        if i + PREFETCH_AHEAD < n {
            prefetch(item(i + PREFETCH_AHEAD));
        }
        let item = item(i);
        // SAFETY: a valid object (above); `as_i64` accepts any object and reports failure
        // through the error indicator, which is checked right after.
        let v = unsafe {
            let v = as_i64(item);
            if v == -1 && !ffi::PyErr_Occurred().is_null() {
                let err = PyErr::fetch(list.py());
                let item = Bound::from_borrowed_ptr(list.py(), item);
                return Err(if item.is_instance_of::<PyInt>() {
                    hash(&item).unwrap_err()
                } else {
                    err
                });
            }
            v
        };
        out.push(v);
    }
    Ok(out)
}

/// A chain of hashes from a list, a tuple, an `int64` numpy array or any iterable of ints.
pub(crate) fn hashes(obj: &Bound<'_, PyAny>) -> PyResult<Vec<BlockHash>> {
    if let Ok(list) = obj.cast::<PyList>() {
        return list_of_hashes(list);
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple.iter().map(|item| hash(&item)).collect();
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
