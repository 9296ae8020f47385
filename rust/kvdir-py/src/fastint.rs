//! Lists and tuples of exact Python ints read by `CPython`'s object layout, without a C-API call
//! per item.
//!
//! NOTE: why. A 100-block `match` spends more time converting its query than looking it up:
//! `PyList_GetItem` plus `PyLong_AsLong` cost ~8 ns an item for small ints and ~18 ns for the
//! 3-digit ints every page hash is (measured on the development VM, 2026-12-01: a 100-int list
//! took 1.8 µs more than the same query as an `int64` array). Reading the list's item array and
//! each int's digits directly is a few loads an item.
//!
//! The layouts read here are not part of the stable ABI, so nothing is assumed:
//! - the fast path is switched on at module init only on a `CPython` with the GIL, and only after a
//!   self-test: ints across the whole range (and beyond it), built by the C API, must decode to
//!   what `PyLong_AsLongLong` says, and a list's item array must be what `PyList_GetItem` returns;
//! - two int layouts are known: `ob_size` = ±digits (`CPython` ≤ 3.11) and `lv_tag` = digits << 3 |
//!   sign (3.12+); 30-bit digits. Anything else fails the self-test and every call takes the C
//!   API, as before;
//! - an item that is not an exact `int`, or an int outside the signed 64-bit range, returns
//!   `None` for the whole sequence: the caller converts it through the C API, which raises the
//!   right error (and may run Python code, which is why the fast loop never runs any).

use std::sync::OnceLock;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyTuple};

use kvdir::BlockHash;

/// How an int object stores its sign and digit count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// `ob_size` is the digit count, negative for negative ints (`CPython` ≤ 3.11).
    SignedSize,
    /// `lv_tag` is `digits << 3 | sign`, sign 0 positive, 1 zero, 2 negative (`CPython` 3.12+).
    Tagged,
}

/// `None` until init, or when the self-test failed: then every call takes the C API.
static LAYOUT: OnceLock<Option<Layout>> = OnceLock::new();

/// An int's header: the object header, then `ob_size` or `lv_tag` (one word either way), then the
/// digits.
#[repr(C)]
struct Long {
    head: ffi::PyVarObject,
    digits: [u32; 1],
}

/// A list's header: the variable-size object header, then the item array.
#[repr(C)]
struct List {
    head: ffi::PyVarObject,
    items: *mut *mut ffi::PyObject,
}

/// A tuple: the variable-size object header, then the items in place.
#[repr(C)]
struct Tuple {
    head: ffi::PyVarObject,
    items: [*mut ffi::PyObject; 1],
}

const DIGIT_BITS: u32 = 30;

/// `obj` as an `i64` if it is an exact int in range.
///
/// # Safety
/// `obj` is a valid object and the GIL is held.
#[inline]
unsafe fn decode(layout: Layout, obj: *mut ffi::PyObject) -> Option<i64> {
    // SAFETY: a valid object (caller), so its header is readable; the type check comes first,
    // and an exact int has at least the header word and as many digits as it says.
    unsafe {
        if (*obj).ob_type != &raw mut ffi::PyLong_Type {
            return None;
        }
        let long = obj.cast::<Long>();
        let word = (*long).head.ob_size;
        let (n, negative) = match layout {
            Layout::SignedSize => (word.unsigned_abs(), word < 0),
            Layout::Tagged => ((word as usize) >> 3, word & 3 == 2),
        };
        let d = (&raw const (*long).digits).cast::<u32>();
        let magnitude: u64 = match n {
            0 => 0,
            1 => u64::from(*d),
            2 => u64::from(*d) | u64::from(*d.add(1)) << DIGIT_BITS,
            3 => {
                let top = u64::from(*d.add(2));
                // The two low digits hold 60 bits, so the top digit decides the range:
                // < 8 fits either sign; exactly 8 with nothing below is -2^63.
                let low = u64::from(*d) | u64::from(*d.add(1)) << DIGIT_BITS;
                if top >= 8 && !(negative && top == 8 && low == 0) {
                    return None;
                }
                low | top << (2 * DIGIT_BITS)
            }
            _ => return None,
        };
        Some(if negative {
            0i64.wrapping_sub_unsigned(magnitude)
        } else {
            magnitude as i64
        })
    }
}

/// Prefetch distance in items: the ints of a real query were created one by one and lie
/// scattered, so reading each is a cache miss; loading item i + 32 while decoding item i overlaps
/// those misses.
const AHEAD: usize = 32;

/// Hints both cache lines an int may span. NOTE: objects are 16-byte aligned, and an int of
/// three digits takes 36 bytes (48 with padding), so one that starts in the second half of a line
/// has its size and digits in the next line: hinting only its first line left that miss to the
/// read (`p + 32` lies in the object and in its last line).
#[inline]
fn prefetch(p: *const ffi::PyObject) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults, whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>());
        _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().wrapping_add(32));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Decodes `n` items from `items`; `None` at the first item that is not an exact int in range.
///
/// # Safety
/// `items` points to `n` valid objects that stay alive and unchanged meanwhile (the GIL is held
/// and nothing here runs Python code).
#[inline]
unsafe fn decode_all(
    layout: Layout,
    items: *const *mut ffi::PyObject,
    n: usize,
) -> Option<Vec<BlockHash>> {
    let mut out = Vec::with_capacity(n);
    // SAFETY: every index read is < n (caller's contract).
    unsafe {
        for i in 0..n.min(AHEAD) {
            prefetch(*items.add(i));
        }
        for i in 0..n {
            if i + AHEAD < n {
                prefetch(*items.add(i + AHEAD));
            }
            out.push(decode(layout, *items.add(i))?);
        }
    }
    Some(out)
}

/// The list's items if every one is an exact int in the signed 64-bit range, else `None`.
pub(crate) fn list(list: &Bound<'_, PyList>) -> Option<Vec<BlockHash>> {
    read_list((*LAYOUT.get()?)?, list)
}

/// The tuple's items if every one is an exact int in the signed 64-bit range, else `None`.
pub(crate) fn tuple(tuple: &Bound<'_, PyTuple>) -> Option<Vec<BlockHash>> {
    read_tuple((*LAYOUT.get()?)?, tuple)
}

fn read_list(layout: Layout, list: &Bound<'_, PyList>) -> Option<Vec<BlockHash>> {
    let p = list.as_ptr().cast::<List>();
    // SAFETY: a list (the caller's cast checked it) with the GIL held: its size and item array
    // are consistent and no Python code runs while they are read.
    unsafe {
        let n = usize::try_from((*p).head.ob_size).ok()?;
        decode_all(layout, (*p).items, n)
    }
}

fn read_tuple(layout: Layout, tuple: &Bound<'_, PyTuple>) -> Option<Vec<BlockHash>> {
    let p = tuple.as_ptr().cast::<Tuple>();
    // SAFETY: a tuple (checked by the caller's cast), immutable, its items in place.
    unsafe {
        let n = usize::try_from((*p).head.ob_size).ok()?;
        decode_all(layout, (&raw const (*p).items).cast(), n)
    }
}

/// Chooses the layout for this interpreter and checks it; on any doubt the fast path stays off.
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    let layout = detect(py)?.filter(|&l| self_test(py, l).unwrap_or(false));
    let _ = LAYOUT.set(layout);
    Ok(())
}

/// Whether the fast path is on (for tests: `_core._fast_int_layout()`).
pub(crate) fn layout_name() -> Option<&'static str> {
    match LAYOUT.get().copied().flatten()? {
        Layout::SignedSize => Some("ob_size"),
        Layout::Tagged => Some("lv_tag"),
    }
}

fn detect(py: Python<'_>) -> PyResult<Option<Layout>> {
    let sys = py.import("sys")?;
    let name: String = sys.getattr("implementation")?.getattr("name")?.extract()?;
    // A free-threaded build may have other threads resizing a list while it is read.
    let gil = match sys.getattr("_is_gil_enabled") {
        Ok(f) => f.call0()?.extract::<bool>()?,
        Err(_) => true,
    };
    let version = py.version_info();
    if name != "cpython" || !gil {
        return Ok(None);
    }
    Ok(Some(if (version.major, version.minor) <= (3, 11) {
        Layout::SignedSize
    } else {
        Layout::Tagged
    }))
}

/// Ints across the range and beyond, each decoded by `layout` and by the C API; a list and a
/// tuple of them read both ways.
fn self_test(py: Python<'_>, layout: Layout) -> PyResult<bool> {
    let mut values: Vec<i128> = vec![0, 1, -1, 7, -8, 255, 1 << 29, 1 << 30, -(1 << 30)];
    for shift in [31, 45, 59, 60, 61, 62, 63, 64, 89, 90, 91, 100] {
        let v = 1i128 << shift;
        values.extend([v - 1, v, v + 1, -v + 1, -v, -v - 1, v | 0x1234_5678]);
    }
    let ints: Vec<Bound<'_, PyInt>> = values
        .iter()
        .map(|v| v.into_pyobject(py))
        .collect::<Result<_, _>>()?;
    for (v, obj) in values.iter().zip(&ints) {
        let want = i64::try_from(*v).ok();
        // SAFETY: a valid int object, GIL held.
        let got = unsafe { decode(layout, obj.as_ptr()) };
        if got != want || want.is_some_and(|w| obj.extract::<i64>().ok() != Some(w)) {
            return Ok(false);
        }
    }
    let in_range: Vec<i64> = values
        .iter()
        .filter_map(|v| i64::try_from(*v).ok())
        .collect();
    let as_list = PyList::new(py, &in_range)?;
    let as_tuple = PyTuple::new(py, &in_range)?;
    // LAYOUT is not set yet: `layout` is passed in.
    let p = as_list.as_ptr().cast::<List>();
    // SAFETY: a list we own, GIL held; `items` has `ob_size` valid entries (checked first).
    let items_ok = unsafe {
        usize::try_from((*p).head.ob_size).ok() == Some(in_range.len())
            && (0..in_range.len()).all(|i| {
                *(*p).items.add(i) == ffi::PyList_GetItem(as_list.as_ptr(), i as ffi::Py_ssize_t)
            })
    };
    // A tuple's size sits where a list's does: read only once the list's was found right.
    Ok(items_ok
        && read_list(layout, &as_list).as_deref() == Some(&in_range[..])
        && read_tuple(layout, &as_tuple).as_deref() == Some(&in_range[..]))
}
