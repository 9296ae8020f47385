//! PyO3 bindings of `kvdir`: the native module `evolving_infra._core`. Thin wrappers only:
//! arguments are converted here, the work happens in the core crate, errors are converted in
//! `errors.rs`.

mod alloc;
mod body;
mod convert;
mod directory;
mod errors;
mod fastint;
mod prompt;

use pyo3::prelude::*;

#[global_allocator]
static GLOBAL: alloc::SmallInMimalloc = alloc::SmallInMimalloc;

/// SGLang 0.5.23 page hashes of every full page of `token_ids` (signed 64-bit ints).
#[pyfunction]
#[pyo3(signature = (token_ids, page_size))]
fn block_hashes(
    py: Python<'_>,
    token_ids: &Bound<'_, PyAny>,
    page_size: &Bound<'_, PyAny>,
) -> PyResult<Vec<i64>> {
    let page_size = convert::count(page_size, "page_size")?;
    let tokens = convert::token_ids(token_ids)?.ok_or_else(|| {
        errors::to_py(
            py,
            kvdir::Error::InvalidArgument {
                argument: "token_ids",
                reason: "token ids must be in [0, 2^32)".into(),
            },
        )
    })?;
    // Hashing a long prompt is the one pure-CPU call here that can take milliseconds.
    let out = if tokens.len() > 4096 {
        py.detach(|| kvdir::block_hashes(&tokens, page_size))
    } else {
        kvdir::block_hashes(&tokens, page_size)
    };
    out.map_err(|e| errors::to_py(py, e))
}

/// Whether `token_ids` (a list or tuple) holds only ints in [0, 2^32), bools excluded: what SGLang
/// accepts as `input_ids`. The router and every engine check each prompt (~100k ids) once per
/// request; read in place this is ~50 µs, against ~2 ms for the quickest check in Python.
#[pyfunction]
fn token_ids_valid(token_ids: &Bound<'_, PyAny>) -> PyResult<bool> {
    Ok(convert::token_ids(token_ids)?.is_some())
}

/// Trace block hashes chained from `seed` (`workloads.blocks.chain_from`): blake2b with an
/// 8-byte digest and `person` over the previous digest and each id's 8 little-endian bytes.
#[pyfunction]
fn trace_chain(
    py: Python<'_>,
    seed: &[u8],
    ids: numpy::PyReadonlyArray1<'_, i64>,
    person: &[u8],
) -> PyResult<Vec<i64>> {
    let ids = ids.as_slice()?;
    let out = if ids.len() > 4096 {
        py.detach(|| kvdir::trace_chain(seed, ids, person))
    } else {
        kvdir::trace_chain(seed, ids, person)
    };
    out.map_err(|e| errors::to_py(py, e))
}

/// The int layout lists of hashes are read by (`"ob_size"`, `"lv_tag"`), or None where every item
/// goes through the C API (`fastint.rs`). For tests and bug reports.
#[pyfunction]
fn _fast_int_layout() -> Option<&'static str> {
    fastint::layout_name()
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    convert::init_clock(m.py())?;
    fastint::init(m.py())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(block_hashes, m)?)?;
    m.add_function(wrap_pyfunction!(token_ids_valid, m)?)?;
    m.add_function(wrap_pyfunction!(trace_chain, m)?)?;
    m.add_function(wrap_pyfunction!(_fast_int_layout, m)?)?;
    m.add_function(wrap_pyfunction!(body::array_spans, m)?)?;
    m.add_function(wrap_pyfunction!(body::common_prefix, m)?)?;
    m.add_class::<directory::KvDirectory>()?;
    m.add_class::<directory::PrefixMatch>()?;
    m.add_class::<prompt::PyPagedPrompt>()?;
    m.add_class::<prompt::PyPromptText>()?;
    m.add_class::<prompt::PyPageHashes>()?;
    errors::register(m)?;
    Ok(())
}
