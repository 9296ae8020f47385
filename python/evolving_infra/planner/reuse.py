"""How much of each prompt a split's cache would keep: the `evolving` planner's reuse model.

The placements' cached/uncached estimate is the split that ran's: the blocks the cluster held
when the request arrived. A split with more decode nodes keeps more of the last turns' KV
(a decode node holds a finished turn's whole context, which the agent's next turn reads
through the pool): Claude Code at 150 held-out agents on 36 H100s lost 0.10 of the ideal reuse
at 2P7D, 0.17 at 3P6D and 0.30 at 4P5D, and the best static split was 3P6D. A planner pricing
3P6D with 4P5D's uncached tokens finds them equal and stays at 4P5D.

The model: a cache keeps what was touched recently, and keeps it longer the larger it is. The
drivers record, per arrival, how long ago an earlier prompt held each block of its reusable
prefix (`ReuseTracker`: every `stride`-th block of the chain; a chain block's position fixes
its prefix, so the sampled positions are the same in every prompt, and the gaps grow along the
chain: a prompt holding block k held every block before it). A token reused after a gap g is
still cached with probability exp(-(g/τ)^2), τ the cache's retention time (`kept_share`). The
shape is what the tuning runs showed (cc 126 agents, seed 0, static 2P7D / 3P6D / 4P5D, by gap:
none lost under 60 s, 7-13% at 60-120 s, 24-53% at 120-240 s, 88-95% at 240-480 s, all of it
beyond; a hard threshold at the same mean moved a sixth of what the splits really differed by,
since the tokens it moves are mostly lost already). The planner finds each slice's τ, the one
at which the expected kept tokens equal what the placements found cached (`SliceReuse.of`), scales
it by the decode nodes a candidate has over the ones the slice ran with, to a power
(`SliceReuse.on`: the decode nodes' caches hold the reused turns, above, and the prefill
nodes' a copy of the prompts), and scales the arrivals' cached or lost tokens by the
ratio of the two kept shares (`SliceReuse.at`). Fitted at one split of those runs and read at the
other two, the kept share was off by at most 0.015 on average over 10-minute windows (the
splits differed by up to 0.08). Where a slice lost nothing (everything reusable was cached),
τ is only known to be large and the estimate stands for every candidate: a cache with room to
spare says nothing about a smaller one; nor does a slice whose decode KV is full of running
requests (the planner then leaves the model out, `evolving._reuse_model`). Not modelled: a
split's own latency lengthens the gaps (a slower decode delays the next turn), about a third
of the difference in those runs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

REUSE_STRIDE = 16  # blocks: every 16th block of a chain is tracked
HORIZON_S = 7200.0  # gaps longer than this count as never seen (the tracker forgets them)
_GAP_BIN = 1.25  # runs of gaps within a factor of this of each other are merged
_TAU_MIN, _TAU_MAX = 0.1, 1e7  # seconds: the retention times `_solve` searches
# A slice whose arrivals found at least this share of their reusable prefix cached lost
# nothing the model could attribute to the cache's size.
FULL_REUSE = 0.995
# τ grows as the decode nodes to this power: fitted on the tuning runs (cc 100 and 126 agents,
# seed 0, static 2P7D / 3P6D / 4P5D: 0.5 fits the first, 1.0 the second; 0.7 leaves a mean
# error of at most 0.015 in the kept share on either, read at one split from another).
DECODE_EXPONENT = 0.7


@dataclass(frozen=True, slots=True)
class Reuse:
    """An arrival's reusable prefix by age: `runs` of (tokens, gap seconds), gaps ascending:
    the first `runs[0][0]` tokens were last in a prompt `runs[0][1]` seconds ago, and so on.
    Tokens never seen before are not in it."""

    runs: tuple[tuple[int, float], ...] = ()

    @property
    def tokens(self) -> int:
        """The reusable prefix: what an infinite cache would hold."""
        return sum(n for n, _ in self.runs)


class ReuseTracker:
    """When a prompt last held every `stride`-th block of each chain (one per driver)."""

    def __init__(
        self, block_tokens: int, *, stride: int = REUSE_STRIDE, horizon_s: float = HORIZON_S
    ) -> None:
        if block_tokens < 1 or stride < 1 or horizon_s <= 0:
            raise ValueError("need block_tokens >= 1, stride >= 1 and horizon_s > 0")
        self.block_tokens = block_tokens
        self.stride = stride
        self.horizon_s = horizon_s
        self._last: dict[int, float] = {}
        self._swept = 0.0

    def __len__(self) -> int:
        return len(self._last)

    def observe(self, now: float, hashes: Sequence[int], *, sampled: bool = False) -> Reuse:
        """The arrival's reusable prefix by age; then its blocks are marked seen at `now`.
        `sampled`: `hashes` are already every `stride`-th block (as another router replica
        sends them)."""
        kept = hashes if sampled else hashes[:: self.stride]
        last = self._last
        span = self.stride * self.block_tokens  # tokens each sampled block stands for
        runs: list[tuple[int, float]] = []
        # Blocks a prompt marked together share its time: taken a group of equal times at a
        # time (the lookups in C), a 100k-token prompt costs ~20 µs here, not ~200 µs.
        for seen, group in itertools.groupby(map(last.get, kept)):
            if seen is None or now - seen >= self.horizon_s:
                break  # the rest of the chain is newer still (see the module docstring)
            gap = max(now - seen, 0.0)
            tokens = span * len(list(group))
            if runs and _same_bin(runs[-1][1], gap):  # (a gap is in its own bin)
                runs[-1] = (runs[-1][0] + tokens, runs[-1][1])
            else:
                runs.append((tokens, gap))
        last.update(zip(kept, itertools.repeat(now)))
        if now - self._swept >= self.horizon_s / 4:
            self._sweep(now)
        return Reuse(tuple(runs))

    def _sweep(self, now: float) -> None:
        """Forget blocks not seen within the horizon (a long-running router stays bounded)."""
        self._swept = now
        old = now - self.horizon_s
        self._last = {h: t for h, t in self._last.items() if t > old}


def _same_bin(a: float, b: float) -> bool:
    lo, hi = (a, b) if a <= b else (b, a)
    return hi <= max(lo, 1.0) * _GAP_BIN


class SliceReuse:
    """One slice's sampled arrivals and their reusable prefixes, with the retention time τ of
    the cache they met, on `decode_nodes` decode nodes (`of`); `at` serves them from a cache
    holding `scale` times as long, `on` from the cache of a split with other decode nodes."""

    def __init__(
        self,
        arrivals: Sequence[tuple[int, int]],
        reuse: Sequence[Reuse],
        found: float,
        decode_nodes: float,
    ) -> None:
        self.arrivals, self.reuse, self.kept = arrivals, reuse, found
        self.decode_nodes = decode_nodes
        self._gaps, self._tokens = _flat(reuse)
        self.tau = _solve(self._gaps, self._tokens, found)
        # The model's own share at τ: `found`, unless τ sits at the bottom of its range.
        self._at_tau = self.share(1.0)

    @classmethod
    def of(
        cls, arrivals: Sequence[tuple[int, int]], reuse: Sequence[Reuse], decode_nodes: float
    ) -> SliceReuse | None:
        """The model of a slice, from its arrivals' (uncached, cached) and reusable prefixes
        and the decode nodes it ran with; None when they found (nearly) everything reusable
        cached, or had nothing to reuse: then every candidate keeps the estimate."""
        if len(arrivals) != len(reuse):
            raise ValueError(f"{len(arrivals)} arrivals with {len(reuse)} reuse records")
        if decode_nodes <= 0:
            raise ValueError(f"decode_nodes must be > 0, got {decode_nodes}")
        found = found_share([c for _, c in arrivals], reuse)
        if found is None or found >= FULL_REUSE:
            return None
        return cls(arrivals, reuse, found, decode_nodes)

    def share(self, scale: float) -> float:
        """The kept share of the reusable tokens at `scale` times the slice's τ."""
        return _kept(self._gaps, self._tokens, self.tau * scale)

    def on(self, decode_nodes: float, exponent: float = DECODE_EXPONENT) -> list[tuple[int, int]]:
        """The arrivals' (uncached, cached) on a split with `decode_nodes` decode nodes: τ
        scaled by their ratio to the slice's, to the power `exponent`."""
        return self.at((decode_nodes / self.decode_nodes) ** exponent)

    def at(self, scale: float) -> list[tuple[int, int]]:
        """The arrivals' (uncached, cached) at `scale` times the slice's τ: fewer cached tokens
        in proportion to the kept share (scale < 1), or fewer lost ones (scale > 1)."""
        if scale == 1.0:
            return list(self.arrivals)
        now, then = self.kept, self.share(scale) * self.kept / self._at_tau
        out = []
        for (u, c), r in zip(self.arrivals, self.reuse, strict=True):
            prompt, ideal = u + c, max(r.tokens, c)
            # Fewer kept: the cached part shrinks; more: the lost part does, towards none.
            c2 = c * then / now if then <= now else ideal - (ideal - c) * (1 - then) / (1 - now)
            c2 = round(min(max(c2, 0.0), prompt))
            out.append((prompt - c2, c2))
        return out


def found_share(cached: Sequence[int], reuse: Sequence[Reuse]) -> float | None:
    """What the placements found cached of the arrivals' reusable tokens (each arrival's capped
    at its prefix); None when they had none."""
    ideal = sum(r.tokens for r in reuse)
    if ideal <= 0:
        return None
    return sum(min(c, r.tokens) for c, r in zip(cached, reuse, strict=True)) / ideal


def kept_share(reuse: Sequence[Reuse], tau: float) -> float:
    """The share of the arrivals' reusable tokens a cache of retention time `tau` keeps:
    each token reused after a gap g with probability exp(-(g/τ)^2)."""
    return _kept(*_flat(reuse), tau)


def _flat(reuse: Sequence[Reuse]) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    gaps = np.array([g for r in reuse for _, g in r.runs], dtype=np.float64)
    tokens = np.array([n for r in reuse for n, _ in r.runs], dtype=np.float64)
    return gaps, tokens


def _kept(gaps: npt.NDArray[np.float64], tokens: npt.NDArray[np.float64], tau: float) -> float:
    total = float(tokens.sum())
    if total <= 0:
        return 1.0
    return float(tokens @ np.exp(-((gaps / tau) ** 2))) / total


def _solve(gaps: npt.NDArray[np.float64], tokens: npt.NDArray[np.float64], share: float) -> float:
    """τ with `_kept` = `share` (bisection on log τ, to a factor of 1e-7)."""
    lo, hi = _TAU_MIN, _TAU_MAX
    if _kept(gaps, tokens, lo) >= share:
        return lo
    for _ in range(40):
        mid = math.sqrt(lo * hi)
        if _kept(gaps, tokens, mid) < share:
            lo = mid
        else:
            hi = mid
    return math.sqrt(lo * hi)
