//! `PagedPrompt`: a prompt's token ids and page digests, kept per agent branch by the router so
//! that the next turn hashes only what it adds (`kvdir::PagedPrompt`).

use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyIterator, PyList, PySlice};

use crate::{convert, errors};

/// Prompts this long are paged with the GIL released (as `block_hashes` does).
const DETACH_TOKENS: usize = 4096;

#[pyclass(
    frozen,
    sequence,
    name = "PagedPrompt",
    module = "evolving_infra._core"
)]
pub struct PyPagedPrompt {
    inner: kvdir::PagedPrompt,
}

#[pymethods]
impl PyPagedPrompt {
    #[new]
    #[pyo3(signature = (token_ids, page_size, after = None))]
    fn new(
        py: Python<'_>,
        token_ids: &Bound<'_, PyAny>,
        page_size: &Bound<'_, PyAny>,
        after: Option<&Bound<'_, PyPagedPrompt>>,
    ) -> PyResult<Self> {
        let page_size = convert::count(page_size, "page_size")?;
        let ids = ids_arg(py, token_ids, "token_ids")?;
        let after = after.map(|a| &a.get().inner);
        let out = if ids.len() > DETACH_TOKENS {
            py.detach(|| kvdir::PagedPrompt::new(ids, page_size, after))
        } else {
            kvdir::PagedPrompt::new(ids, page_size, after)
        };
        out.map(|inner| Self { inner })
            .map_err(|e| errors::to_py(py, e))
    }

    /// The first `keep` ids of `before`, then `tail`: only the pages past the kept ones are
    /// hashed and no id is compared (the caller verified what it keeps).
    #[staticmethod]
    fn extend(
        py: Python<'_>,
        before: &Bound<'_, PyPagedPrompt>,
        keep: usize,
        tail: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        let tail = ids_arg(py, tail, "tail")?;
        let before = &before.get().inner;
        let inner = if keep > DETACH_TOKENS {
            py.detach(|| kvdir::PagedPrompt::extend(before, keep, &tail))
        } else {
            kvdir::PagedPrompt::extend(before, keep, &tail)
        };
        Ok(Self { inner })
    }

    /// The ids as the text of a JSON array without spaces.
    fn json<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let text = if self.inner.ids().len() > DETACH_TOKENS {
            py.detach(|| self.inner.json())
        } else {
            self.inner.json()
        };
        PyBytes::new(py, &text)
    }

    fn __getitem__<'py>(&self, item: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = item.py();
        let ids = self.inner.ids();
        if let Ok(slice) = item.cast::<PySlice>() {
            let s = slice.indices(ids.len() as isize)?;
            let picked: Vec<u32> = (0..s.slicelength)
                .map(|i| ids[(s.start + i as isize * s.step) as usize])
                .collect();
            return Ok(PyList::new(py, picked)?.into_any());
        }
        let i: isize = item.extract()?;
        let at = if i < 0 { i + ids.len() as isize } else { i };
        match usize::try_from(at).ok().and_then(|a| ids.get(a)) {
            Some(&t) => Ok(t.into_pyobject(py)?.into_any()),
            None => Err(PyIndexError::new_err("token index out of range")),
        }
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        PyList::new(py, self.inner.ids())?.try_iter()
    }

    /// The block hash of every full page.
    fn hashes(&self) -> Vec<i64> {
        self.inner.hashes().collect()
    }

    #[getter]
    fn reused(&self) -> usize {
        self.inner.reused()
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.inner.page_size()
    }

    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.bytes()
    }

    fn __len__(&self) -> usize {
        self.inner.ids().len()
    }
}

/// Token ids from a list or tuple of ints, each in [0, 2^32) (else `InvalidArgumentError`).
fn ids_arg(py: Python<'_>, ids: &Bound<'_, PyAny>, argument: &'static str) -> PyResult<Vec<u32>> {
    convert::token_ids(ids)?.ok_or_else(|| {
        errors::to_py(
            py,
            kvdir::Error::InvalidArgument {
                argument,
                reason: "token ids must be in [0, 2^32)".into(),
            },
        )
    })
}
