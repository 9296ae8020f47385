"""Hash arguments in every accepted form read the same values.

A list or tuple of exact ints is read by CPython's object layout (`rust/kvdir-py/src/fastint.rs`),
every other form through the C API; these tests hold the two paths to the same answers, at the
digit boundaries of CPython's 30-bit ints and at both ends of the signed 64-bit range.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from evolving_infra import HashRangeError, KvDirectory, _core

MIN = -(2**63)
MAX = 2**63 - 1
# Around every digit boundary (2^30, 2^60) and the range's ends, both signs.
EDGES = sorted(
    {
        v
        for k in (0, 1, 29, 30, 31, 59, 60, 61, 62)
        for b in (2**k, -(2**k))
        for v in (b - 1, b, b + 1)
    }
    | {MIN, MIN + 1, MAX - 1, MAX, 0}
)


class SubInt(int):
    """An int subclass: not an exact int, so it takes the C API."""


class Index:
    """Not an int at all, but usable as one (`__index__`)."""

    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v


FORMS: dict[str, Callable[[list[int]], Iterable[object]]] = {
    "list": list,
    "tuple": tuple,
    "array": lambda hs: np.array(hs, dtype=np.int64),
    "generator": lambda hs: (h for h in hs),
    "list of subclass ints": lambda hs: [SubInt(h) for h in hs],
    "list of numpy ints": lambda hs: [np.int64(h) for h in hs],
    "list of __index__": lambda hs: [Index(h) for h in hs],
}


def test_fast_path_is_on_for_this_interpreter() -> None:
    # The CI interpreter is CPython 3.11 with the GIL: the self-test at import must pass there.
    # Elsewhere the fast path may stay off (all calls then take the C API), never be wrong.
    if sys.implementation.name == "cpython" and sys.version_info[:2] == (3, 11):
        assert _core._fast_int_layout() == "ob_size"
    else:
        assert _core._fast_int_layout() in (None, "ob_size", "lv_tag")


def held_after_store(form: Callable[[list[int]], Iterable[object]], hashes: list[int]) -> list[int]:
    d = KvDirectory()
    d.store(0, "L1", form(hashes), now=0.0)  # type: ignore[arg-type]
    # Read back one hash at a time: `eviction_order` returns what was stored.
    return sorted(d.eviction_order(0, "L1"))


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_every_form_stores_the_exact_values(form: Callable[[list[int]], Iterable[object]]) -> None:
    chain = list(dict.fromkeys(EDGES))
    # A chain with one leaf: only the leaf is a candidate; store each edge as its own chain.
    for h in chain:
        assert held_after_store(form, [h]) == [h]
    d = KvDirectory()
    d.store(0, "L1", form(chain), now=0.0)  # type: ignore[arg-type]
    assert all(h in d for h in chain)
    m = d.match(form(chain))  # type: ignore[arg-type]
    assert m.node(0) == (len(chain), len(chain))


@given(st.lists(st.integers(MIN, MAX), min_size=1, max_size=300, unique=True))
def test_list_tuple_and_array_agree(hashes: list[int]) -> None:
    d = KvDirectory()
    d.store(3, "L1", hashes, now=0.0)
    want = d.match(np.array(hashes, dtype=np.int64)).node(3)
    assert want == (len(hashes), len(hashes))
    assert d.match(tuple(hashes)).node(3) == want
    assert d.match([SubInt(h) for h in hashes]).node(3) == want
    # One wrong value anywhere cuts the match there.
    k = len(hashes) // 2
    changed = [*hashes[:k], hashes[k] ^ 1, *hashes[k + 1 :]]
    if changed[k] not in hashes:
        for form in (list, tuple):
            assert d.match(form(changed)).node(3) == (k, k)


@pytest.mark.parametrize("bad", [MAX + 1, MIN - 1, 2**64, -(2**64), 2**90, -(2**90), 2**200])
@pytest.mark.parametrize("where", [0, 17, 99])
@pytest.mark.parametrize("form", [list, tuple], ids=["list", "tuple"])
def test_out_of_range_anywhere_raises(
    bad: int, where: int, form: Callable[[list[int]], Iterable[int]]
) -> None:
    hashes = list(range(1, 101))
    hashes[where] = bad
    d = KvDirectory()
    with pytest.raises(HashRangeError) as err:
        d.match(form(hashes))  # type: ignore[arg-type]
    assert err.value.value == bad
    with pytest.raises(HashRangeError):
        d.store(0, "L1", form(hashes), now=0.0)  # type: ignore[arg-type]
    assert len(d) == 0


@pytest.mark.parametrize("form", [list, tuple], ids=["list", "tuple"])
def test_non_ints_raise_type_error(form: Callable[[list[object]], Iterable[object]]) -> None:
    d = KvDirectory()
    for bad in ("7", 1.5, None, b"\x01"):
        with pytest.raises(TypeError):
            d.match(form([1, 2, bad]))  # type: ignore[arg-type]


def test_bool_items_are_ints() -> None:
    # bool is an int subclass: the C API reads True as 1, as it always has.
    d = KvDirectory()
    d.store(0, "L1", [1, 0], now=0.0)
    assert d.match([True, False]).node(0) == (2, 2)


def test_an_item_that_empties_the_list_does_not_crash() -> None:
    # The C-API path runs `__index__`, which may change the list being read.
    d = KvDirectory()
    d.store(0, "L1", [1, 5], now=0.0)
    items: list[object] = [1, 2, 3]

    class Shrinks:
        def __index__(self) -> int:
            items.clear()
            return 5

    items.insert(1, Shrinks())
    assert d.match(items).node(0) == (2, 2)  # type: ignore[arg-type]  # [1, 5]: the list ended
