"""Load indexes: a router's choice kept up to date one node at a time.

The stateless entry points (`Router.choose_prefill(request, nodes)`) take every node's
`NodeLoad` on every call: right for the live router (tens of engines, views rebuilt from their
metrics), but at 3,072 GPUs (768 nodes) the simulator spent milliseconds per request building
768 views, filtering, sorting and scanning them. An index is told a node's view when it changes
(`put`) and answers the same question from columns: numpy arrays aligned with the phase's
accepting nodes in id order, so that an argmin (the first of equal minima) breaks ties to the
lowest id, as the stateless methods do (Dynamo's, which draws among equal costs, takes all the
minima in id order, `minima`). Lexicographic keys are packed into one int64,
`a * 2**32 + b` with `0 <= b < 2**32`, which orders as the tuple `(a, b)` does; a value out of
range makes numpy raise `OverflowError` rather than pack a wrong key.

Each router's index (`EvolvingRouter.index()`, ...) gives exactly the node its stateless method
gives on the same views (tests/test_routing_index.py checks it on random views and caches).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from evolving_infra.routing.base import NodeLoad, Placement, RouteRequest
from evolving_infra.routing.common import NoNodeError
from evolving_infra.types import Phase

IntArray = npt.NDArray[np.int64]

SHIFT = 2**32  # packing factor of two-part keys (see the module docstring)
NO_KEY = np.iinfo(np.int64).max  # a masked-out slot


class LoadIndex:
    """The accepting nodes of each phase and their latest views; subclasses keep columns.

    Membership (accepting, phase) changes only when a node drains, switches or goes down: the
    columns of a phase are then rebuilt, lazily, at its next choice. Any other change writes one
    slot (`_write`).
    """

    def __init__(self) -> None:
        self.loads: dict[int, NodeLoad] = {}  # every node's latest view
        self.ids: dict[Phase, list[int]] = {"prefill": [], "decode": []}  # ascending
        self._slot: dict[Phase, dict[int, int]] = {"prefill": {}, "decode": {}}
        self._stale: dict[Phase, bool] = {"prefill": False, "decode": False}

    def put(self, load: NodeLoad) -> None:
        """`load` is now the node's view (accepting or not, of either phase)."""
        old = self.loads.get(load.node)
        self.loads[load.node] = load
        phase = load.phase
        if load.accepting and old is not None and old.accepting and old.phase == phase:
            slot = self._slot[phase].get(load.node)
            if slot is not None:  # else the phase is stale and rebuilds from `loads`
                self._write(phase, slot, load)
            return
        if load.accepting:
            self._stale[phase] = True
        if old is not None and old.accepting:
            self._stale[old.phase] = True

    def accepting(self, phase: Phase) -> int:
        """How many nodes of `phase` accept work."""
        return len(self._fresh(phase))

    def members(self, phase: Phase) -> list[NodeLoad]:
        """The accepting views of `phase`, by node id."""
        return [self.loads[n] for n in self._fresh(phase)]

    def _fresh(self, phase: Phase) -> list[int]:
        if self._stale[phase]:
            self._stale[phase] = False
            ids = sorted(n for n, x in self.loads.items() if x.accepting and x.phase == phase)
            self.ids[phase] = ids
            self._slot[phase] = {n: k for k, n in enumerate(ids)}
            self._rebuild(phase, [self.loads[n] for n in ids])
        return self.ids[phase]

    def _need(self, phase: Phase) -> list[int]:
        ids = self._fresh(phase)
        if not ids:
            raise NoNodeError(phase)
        return ids

    # -- what a router's index defines ---------------------------------------------------------

    def _rebuild(self, phase: Phase, loads: list[NodeLoad]) -> None:
        """Columns of `phase` for `loads` (its accepting nodes, by id)."""

    def _write(self, phase: Phase, slot: int, load: NodeLoad) -> None:
        """Slot `slot` of `phase`'s columns now shows `load`."""

    def choose_prefill(self, request: RouteRequest) -> Placement:
        raise NotImplementedError

    def choose_decode(self, request: RouteRequest) -> int:
        raise NotImplementedError


def keys(n: int) -> IntArray:
    return np.zeros(n, dtype=np.int64)


def most_free_key(load: NodeLoad) -> int:
    """`(-free blocks, running requests)` packed: `common.most_free_decode`'s order."""
    return (load.kv_used_blocks - load.kv_capacity_blocks) * SHIFT + load.decode_requests


def minima(values: IntArray, mask: Sequence[int]) -> list[int]:
    """Indices (ascending) of the least of `values` outside the indices `mask`; [] if none."""
    if mask:
        values = values.copy()
        values[list(mask)] = NO_KEY
    if not len(values):
        return []
    low = values.min()
    return [] if low == NO_KEY else np.flatnonzero(values == low).tolist()
