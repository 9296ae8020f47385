"""The simulated engine's clock (`engines/sim/env.py`): inside a node callback `now` is the time
the callback was due, so a loop that runs it late does not stretch the node's timeline (the
engine would otherwise run slower than the hardware it models on a busy machine); and `now`
never runs backwards."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from evolving_infra.engines.sim.env import RealTimeEnv
from evolving_infra.timing.specs import H100, LLAMA3_8B, Deployment


class _NoHooks:
    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"no node callback expected, got {name}")


def test_a_late_callback_sees_the_time_it_was_due() -> None:
    async def main() -> None:
        env = RealTimeEnv(Deployment(LLAMA3_8B, H100, 1), _NoHooks(), time_scale=10.0)
        seen: list[tuple[str, float]] = []

        def chain(step: int) -> None:
            # The node's habit: the next iteration is scheduled from `now`.
            seen.append((f"step {step}", env.now))
            if step < 3:
                env.at(env.now + 0.5, chain, step + 1)  # 0.5 simulated s = 50 ms real

        env.at(0.5, chain, 0)
        await asyncio.sleep(0.01)
        time.sleep(0.3)  # the loop is busy: 3 simulated seconds late for step 0
        await asyncio.sleep(0.2)
        assert [t for _, t in seen] == pytest.approx([0.5, 1.0, 1.5, 2.0])
        # Outside a callback the clock is the real one, and later than every time handed out.
        assert env.now >= 5.0

    asyncio.run(main())


def test_the_clock_never_runs_backwards() -> None:
    async def main() -> None:
        env = RealTimeEnv(Deployment(LLAMA3_8B, H100, 1), _NoHooks(), time_scale=10.0)
        seen: list[float] = []
        env.at(0.1, lambda _: seen.append(env.now), None)
        time.sleep(0.1)  # now ~1.0 simulated seconds
        read = env.now  # an HTTP handler reads the clock before the late callback runs
        await asyncio.sleep(0.01)
        assert seen[0] >= read  # not the 0.1 it was due at: time would go back
        assert env.now >= seen[0]

    asyncio.run(main())
