//! The one place where `kvdir::Error` becomes a Python exception: one class per cause under
//! `KvDirectoryError(ValueError)`, each carrying its fields as attributes so callers never parse
//! messages (the pattern of polars' `error.rs` and dynamo's `errors.rs`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::{create_exception, PyErr};

use kvdir::Error;

create_exception!(
    evolving_infra._core,
    KvDirectoryError,
    PyValueError,
    "Base of every error the directory raises; the directory is unchanged when it is raised."
);
create_exception!(
    evolving_infra._core,
    UnknownParentError,
    KvDirectoryError,
    "`parent` is not a block the directory knows."
);
create_exception!(
    evolving_infra._core,
    ParentMismatchError,
    KvDirectoryError,
    "`hash` is known under `known_parent` but the call gives it `parent` (None: a first page)."
);
create_exception!(
    evolving_infra._core,
    DuplicateHashError,
    KvDirectoryError,
    "A chain repeats `hash` (or contains its own parent)."
);
create_exception!(
    evolving_infra._core,
    HashRangeError,
    KvDirectoryError,
    "`value` is outside the signed 64-bit range of block hashes."
);
create_exception!(
    evolving_infra._core,
    UnknownBranchError,
    KvDirectoryError,
    "`branch_fork` from a branch that does not exist."
);
create_exception!(
    evolving_infra._core,
    BranchExistsError,
    KvDirectoryError,
    "`branch_fork` onto a branch that already exists."
);
create_exception!(
    evolving_infra._core,
    InvalidArgumentError,
    KvDirectoryError,
    "A bad tier, node, time, page size or limit; `argument` names it."
);
create_exception!(
    evolving_infra._core,
    EventDecodeError,
    KvDirectoryError,
    "Event bytes that are not a valid SGLang `KVEventBatch`; `offset` is where decoding stopped."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvDirectoryError", py.get_type::<KvDirectoryError>())?;
    m.add("UnknownParentError", py.get_type::<UnknownParentError>())?;
    m.add("ParentMismatchError", py.get_type::<ParentMismatchError>())?;
    m.add("DuplicateHashError", py.get_type::<DuplicateHashError>())?;
    m.add("HashRangeError", py.get_type::<HashRangeError>())?;
    m.add("UnknownBranchError", py.get_type::<UnknownBranchError>())?;
    m.add("BranchExistsError", py.get_type::<BranchExistsError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("EventDecodeError", py.get_type::<EventDecodeError>())?;
    Ok(())
}

fn with_attrs<'py>(py: Python<'py>, err: PyErr, attrs: &[(&str, Bound<'py, PyAny>)]) -> PyErr {
    let value = err.value(py);
    for (name, v) in attrs {
        // Setting an attribute on a fresh exception instance cannot fail in practice; if it did,
        // the error itself is still the right one to raise.
        let _ = value.setattr(*name, v);
    }
    err
}

/// Converts a directory error into its Python exception.
pub(crate) fn to_py(py: Python<'_>, e: Error) -> PyErr {
    let msg = e.to_string();
    let int = |v: i64| {
        v.into_pyobject(py)
            .map(pyo3::Bound::into_any)
            .expect("ints convert")
    };
    let opt = |v: Option<i64>| v.map_or_else(|| py.None().into_bound(py), int);
    let text = |s: &str| s.into_pyobject(py).expect("strs convert").into_any();
    match e {
        Error::UnknownParent { parent } => with_attrs(
            py,
            UnknownParentError::new_err(msg),
            &[("parent", int(parent))],
        ),
        Error::ParentMismatch {
            hash,
            parent,
            known_parent,
        } => with_attrs(
            py,
            ParentMismatchError::new_err(msg),
            &[
                ("hash", int(hash)),
                ("parent", opt(parent)),
                ("known_parent", opt(known_parent)),
            ],
        ),
        Error::DuplicateHash { hash } => {
            with_attrs(py, DuplicateHashError::new_err(msg), &[("hash", int(hash))])
        }
        Error::HashRange { value } => {
            let v = py
                .get_type::<pyo3::types::PyInt>()
                .call1((value.as_str(),))
                .unwrap_or_else(|_| text(&value));
            with_attrs(py, HashRangeError::new_err(msg), &[("value", v)])
        }
        Error::UnknownBranch { branch } => with_attrs(
            py,
            UnknownBranchError::new_err(msg),
            &[("branch", text(&branch))],
        ),
        Error::BranchExists { branch } => with_attrs(
            py,
            BranchExistsError::new_err(msg),
            &[("branch", text(&branch))],
        ),
        Error::InvalidArgument { argument, .. } => with_attrs(
            py,
            InvalidArgumentError::new_err(msg),
            &[("argument", text(argument))],
        ),
        Error::EventDecode { offset, .. } => with_attrs(
            py,
            EventDecodeError::new_err(msg),
            &[(
                "offset",
                offset.into_pyobject(py).expect("ints convert").into_any(),
            )],
        ),
    }
}
