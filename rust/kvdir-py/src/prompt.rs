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
    fn json<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        PyBytes::new_with(py, self.inner.json_len(), |buf| {
            self.inner.write_json(buf);
            Ok(())
        })
    }

    /// The text between the ids' JSON brackets as it is kept: one `PromptText` a chunk of
    /// ~4k ids, each a read-only buffer over the chunk itself (`memoryview`), so that the
    /// engines' bodies are sent as `[`, these, `]` with nothing copied (`transport.Body`: at
    /// 100k ids, two ~600 KB bodies written afresh per request were ~0.4 ms, mostly page
    /// faults).
    fn text(&self) -> Vec<PyPromptText> {
        self.inner
            .text()
            .map(|inner| PyPromptText { inner })
            .collect()
    }

    fn __getitem__<'py>(&self, item: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        index(item, self.inner.len(), |i| self.inner.get(i))
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        PyList::new(py, self.inner.ids().collect::<Vec<_>>())?.try_iter()
    }

    /// The block hash of every full page, kept native: the directory reads them in place, and
    /// Python builds an int only for the few it looks at (at 100k tokens, a list of 6,250 ints
    /// built per request and read back by each directory call was ~0.15 ms).
    fn hashes(&self) -> PyPageHashes {
        PyPageHashes {
            hashes: self.inner.hashes().collect(),
        }
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
        self.inner.len()
    }
}

/// A piece of a prompt's kept text (`PagedPrompt.text`): a read-only buffer over the native
/// bytes, which stay alive (and never change) while a view of them does.
#[pyclass(frozen, name = "PromptText", module = "evolving_infra._core")]
pub struct PyPromptText {
    inner: kvdir::PromptText,
}

#[pymethods]
impl PyPromptText {
    /// # Safety
    /// Called by Python's buffer protocol with a valid `view`; `PyBuffer_FillInfo` fills it
    /// with a pointer into the chunk this object holds (an `Arc` whose bytes are never
    /// changed) and takes a reference to this object, so the bytes outlive every view.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let bytes = slf.get().inner.as_bytes();
        let len = pyo3::ffi::Py_ssize_t::try_from(bytes.len()).expect("a chunk's text fits");
        // SAFETY: see the method's note; read-only (1): a writable request is refused.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                bytes.as_ptr().cast_mut().cast(),
                len,
                1,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    fn __len__(&self) -> usize {
        self.inner.as_bytes().len()
    }

    fn __bytes__<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.as_bytes())
    }
}

/// A prompt's page hashes (`PagedPrompt.hashes`): an immutable sequence of ints that the
/// directory's calls read without converting them.
#[pyclass(frozen, sequence, name = "PageHashes", module = "evolving_infra._core")]
pub struct PyPageHashes {
    pub(crate) hashes: Vec<i64>,
}

#[pymethods]
impl PyPageHashes {
    fn __len__(&self) -> usize {
        self.hashes.len()
    }

    fn __getitem__<'py>(&self, item: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        index(item, self.hashes.len(), |i| self.hashes.get(i).copied())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyIterator>> {
        PyList::new(py, &self.hashes)?.try_iter()
    }

    /// Equal to any sequence of the same ints (a list or tuple included), as a list would be.
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        if let Ok(o) = other.cast::<PyPageHashes>() {
            return o.get().hashes == self.hashes;
        }
        if other.is_instance_of::<pyo3::types::PyString>()
            || other.len().ok() != Some(self.hashes.len())
        {
            return false;
        }
        crate::convert::hashes(other).is_ok_and(|h| h == self.hashes)
    }

    fn __repr__(&self) -> String {
        format!("PageHashes({:?})", self.hashes)
    }
}

/// `items[item]` as Python indexes a list of `len` items, item `i` being `get(i)`: an int
/// (negative from the end), or a slice (a list).
fn index<'py, T>(
    item: &Bound<'py, PyAny>,
    len: usize,
    get: impl Fn(usize) -> Option<T>,
) -> PyResult<Bound<'py, PyAny>>
where
    T: Into<i64>,
{
    let py = item.py();
    let at = |i: isize| usize::try_from(i).ok().and_then(&get);
    if let Ok(slice) = item.cast::<PySlice>() {
        let s = slice.indices(len as isize)?;
        let picked: Vec<i64> = (0..s.slicelength)
            .map(|i| {
                at(s.start + i as isize * s.step)
                    .expect("in the slice's range")
                    .into()
            })
            .collect();
        return Ok(PyList::new(py, picked)?.into_any());
    }
    let i: isize = item.extract()?;
    match at(if i < 0 { i + len as isize } else { i }) {
        Some(t) => Ok(t.into().into_pyobject(py)?.into_any()),
        None => Err(PyIndexError::new_err("index out of range")),
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
