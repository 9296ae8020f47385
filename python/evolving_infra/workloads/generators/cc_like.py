"""Claude-Code-like sessions, fitted to the 24 bundled real traces, to scale them to thousands.

A session is a main branch of `turns` requests. The first sends the system and tool prompt and
the user's task; each later one appends the tool results or the user's next message to the
context (prompt + response). Along the way:

- sub-agents: a session uses them or not; one that does spawns its first group at a drawn turn
  and more groups later at a per-turn rate. A group of 1-3 sub-agents runs in parallel, each in
  its own context, and the main branch's next request joins them (Claude Code's Task tool returns
  their results), unless the group runs in the background;
- compactions: when the prompt passes a drawn trigger (~150k tokens) the history is replaced by
  a summary after the kept system prompt, often rewritten once more on the next turn; rarely,
  more often after a long idle, the prompt is rewritten after the system prompt at the same size.

Every quantity is drawn from the `random.Random` passed to the session: from an empirical
quantile table (values at `LEVELS`, interpolated linearly in log(1 + x), so a draw stays inside
the observed range, heavy tails keep their shape and the table's median is the draws' median), or
from a fitted probability. The tables come from `cc_params.json`, written by `cc_fit` from the
bundled kv-cache-tester traces (Apache-2.0) as imported by `importers.claude_code_trace`, so a
quantity here means what it means in an imported trace.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from evolving_infra.workloads.claude_code import BLOCK_SIZE
from evolving_infra.workloads.generators.common import (
    AgentBuilder,
    BranchBuilder,
    Session,
    SlotPlan,
    one_workload,
)
from evolving_infra.workloads.importers import (
    CLAUDE_CODE_PREFIX,
    CLAUDE_CODE_PREFIX_TOKENS,
    COMPACTION_KEEP_BELOW,
)
from evolving_infra.workloads.model import BranchId, Trace

NAME = "claude-code-like"
PARAMS_FILE = Path(__file__).with_name("cc_params.json")
PARAMS_FORMAT = "evolving-infra-cc-params"
PARAMS_VERSION = 1
# Quantile levels of every table: the deciles and ventiles, plus 1% and 99% because waits and
# prompt growth are heavy-tailed (a 99th percentile wait is minutes, the maximum hours).
LEVELS: tuple[float, ...] = (0.0, 0.01, *(k / 20 for k in range(1, 20)), 0.99, 1.0)

# A compaction that keeps less than this share of the previous prompt's tokens is an
# auto-compaction, the others rewrites. Assumption: the traces' shrinking compactions keep <= 85%,
# their rewrites ~100%.
SHRINK_BELOW = 0.9

Table = tuple[float, ...]  # values at LEVELS, non-decreasing, >= 0


@dataclass(frozen=True, slots=True)
class Params:
    """Unless marked "assumption", every field is fitted from the 24 bundled kv-cache-tester
    traces (Apache-2.0) by `cc_fit.fit`; "main" is the root branch, "sub" a sub-agent's."""

    # Main requests per session (the session's turns, compaction requests included).
    session_turns: Table
    # Prompt tokens of a session's first request (system + tool prompt ~15k, then the task; a
    # resumed session starts with its history, hence the tail).
    first_prompt: Table
    # Tokens appended per main request after the first, beyond the previous prompt and response
    # (tool results, the user's message). Negative in 9% of real turns (thinking blocks dropped
    # from the history), which the builder cannot express: those are 0.
    new_tokens: Table
    output_tokens: Table  # of main requests
    # Seconds between a main request's previous response (or the end of the sub-agents it
    # joins) and the request: tool execution and the human (the closed-loop gap).
    wait: Table
    subagent_session_share: float  # share of sessions that spawn sub-agents at all
    first_spawn_turn: Table  # main request whose response spawns a session's first group
    # After the first group, chance that a main request spawns another group (up to the
    # second-to-last request, so that a later request can join it).
    respawn_rate: float
    parallel: tuple[float, ...]  # P(a group has k sub-agents), k = 1, 2, ...
    background_share: float  # share of groups never joined (Claude Code's async launches)
    spawn_delay: Table  # seconds from the spawning response to a sub-agent's start
    sub_turns: Table  # requests per sub-agent
    sub_first_prompt: Table  # its first prompt: its own system prompt and task
    sub_new_tokens: Table  # as new_tokens, for a sub-agent's later requests
    sub_output_tokens: Table
    sub_wait: Table  # as wait, for a sub-agent's later requests
    # Prompt tokens of the main request before an auto-compaction (a prompt that keeps less than
    # half of the previous one's blocks and shrinks below `shrink_below` of it). One draw per
    # compaction cycle. A session whose first prompt is already past its first draw (a
    # long-context model: trace_0210 starts at 479k) never auto-compacts, as in the traces.
    compact_trigger: Table
    # Tokens kept at the head of the prompt by any compaction or rewrite (the system and tool
    # prompt, or part of it when that changed).
    compact_keep: Table
    compact_summary: Table  # tokens after the kept ones in an auto-compaction's prompt
    followup_rate: float  # chance that the request after an auto-compaction rewrites it again
    # Chance that a main request rewrites its prompt after the kept head at the same size (a
    # changed system prompt, e.g. a resumed session), for waits of at least `long_wait` s and
    # for shorter ones.
    rewrite_rate_long: float
    rewrite_rate_short: float
    # Assumption: the wait that makes an idle user (a resumed session); 10 min, where rewrites
    # become ~30x more frequent in the traces.
    long_wait: float = 600.0
    # The fit's rule telling auto-compactions from rewrites (`SHRINK_BELOW`), for the record.
    shrink_below: float = SHRINK_BELOW
    # Model choice, not fitted: every session's first 15,000 tokens are one trace-wide shared
    # prefix (`importers.CLAUDE_CODE_PREFIX`), like `claude_code_trace(shared_prefix=True)`.
    shared_prefix: bool = False
    provenance: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @staticmethod
    def default() -> Params:
        """The committed fit of the bundled traces (`cc_params.json`)."""
        return Params.from_json(PARAMS_FILE.read_text(encoding="utf-8"))

    @staticmethod
    def from_json(text: str) -> Params:
        doc = json.loads(text)
        if doc.get("format") != PARAMS_FORMAT or doc.get("version") != PARAMS_VERSION:
            raise ValueError(f"not {PARAMS_FORMAT} version {PARAMS_VERSION}")
        if tuple(doc["levels"]) != LEVELS:
            raise ValueError("the tables' quantile levels differ from LEVELS")
        kinds = {f.name: f.type for f in dataclasses.fields(Params)}
        values: dict[str, Any] = {
            k: tuple(v) if isinstance(v, list) else v for k, v in doc["params"].items()
        }
        unknown = set(values) - set(kinds)
        if unknown:
            raise ValueError(f"unknown parameters: {sorted(unknown)}")
        return Params(**values, provenance=doc["provenance"])

    def to_json(self) -> str:
        """One line per parameter, keys in field order: the same fit is the same bytes."""
        params = {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in dataclasses.fields(self)
            if f.name not in ("provenance", "shared_prefix")
        }
        doc = {
            "format": PARAMS_FORMAT,
            "version": PARAMS_VERSION,
            "provenance": dict(self.provenance),
            "levels": list(LEVELS),
            "params": params,
        }
        return _dump(doc, "") + "\n"


def _dump(value: Any, indent: str) -> str:
    if not isinstance(value, dict):
        return json.dumps(value)
    inner = indent + "  "
    items = [f"{inner}{json.dumps(k)}: {_dump(v, inner)}" for k, v in value.items()]
    return "{\n" + ",\n".join(items) + "\n" + indent + "}"


def draw(table: Table, rng: random.Random) -> float:
    """A value of the distribution the quantile table describes (one `rng.random()`)."""
    u = rng.random()
    k = min(bisect.bisect_right(LEVELS, u) - 1, len(LEVELS) - 2)
    f = (u - LEVELS[k]) / (LEVELS[k + 1] - LEVELS[k])
    lo, hi = math.log1p(table[k]), math.log1p(table[k + 1])
    return math.expm1(lo + f * (hi - lo))


def _tokens(table: Table, rng: random.Random) -> int:
    return max(0, round(draw(table, rng)))


def _pick(probabilities: tuple[float, ...], rng: random.Random) -> int:
    """k >= 1 with probability probabilities[k - 1]."""
    u, total = rng.random(), 0.0
    for k, p in enumerate(probabilities, start=1):
        total += p
        if u < total:
            return k
    return len(probabilities)


def session(params: Params | None = None) -> Session:
    """One Claude-Code-like session (see the module doc)."""
    p = params or Params.default()

    def run(rng: random.Random, b: AgentBuilder, t: float) -> None:
        del t  # the workload does not change over the trace
        _Session(p, rng, b).run()

    return run


@dataclass(slots=True)
class _Session:
    p: Params
    rng: random.Random
    builder: AgentBuilder

    def run(self) -> None:
        p, rng = self.p, self.rng
        turns = max(1, round(draw(p.session_turns, rng)))
        spawns = turns >= 2 and rng.random() < p.subagent_session_share
        # Clamped so that a session that uses sub-agents spawns them before its last request.
        first_spawn = min(round(draw(p.first_spawn_turn, rng)), turns - 2) if spawns else -1
        main = self.builder.root()
        first = _tokens(p.first_prompt, rng)
        trigger = draw(p.compact_trigger, rng)
        auto_compacts = first < trigger
        followup = False
        join: tuple[BranchId, ...] = ()
        for i in range(turns):
            if i == 0:
                wait, new = 0.0, max(0, first - main.context_tokens)
            else:
                wait, new = draw(p.wait, rng), _tokens(p.new_tokens, rng)
                prompt = main.turns[-1].prompt_tokens
                if followup:
                    self.rewrite(main)
                    followup = False
                elif auto_compacts and prompt >= trigger:
                    main.compact(_tokens(p.compact_keep, rng), _tokens(p.compact_summary, rng))
                    new = 0  # the summary is the whole prompt after the kept head
                    trigger = draw(p.compact_trigger, rng)
                    followup = rng.random() < p.followup_rate
                elif rng.random() < (
                    p.rewrite_rate_long if wait >= p.long_wait else p.rewrite_rate_short
                ):
                    self.rewrite(main)
            k = main.request(wait, new, _tokens(p.output_tokens, rng), join=join)
            join = ()
            if 0 <= first_spawn <= k <= turns - 2 and (
                k == first_spawn or rng.random() < p.respawn_rate
            ):
                join = self.spawn(main, k)

    def rewrite(self, main: BranchBuilder) -> None:
        """The prompt is rewritten after a kept head, at the same size."""
        keep = _tokens(self.p.compact_keep, self.rng)
        bs = self.builder.block_size
        kept = max(min(keep, main.context_tokens) // bs, main.shared) * bs
        # As in the importer, only a prompt that keeps less than half of the previous one is a
        # compaction; a rewrite of a short context keeps more and is left out.
        if kept < COMPACTION_KEEP_BELOW * main.turns[-1].prompt_tokens:
            main.compact(keep, main.context_tokens - kept)

    def spawn(self, main: BranchBuilder, after: int) -> tuple[BranchId, ...]:
        """A group of parallel sub-agents after `after`; returns the branches to join."""
        p, rng = self.p, self.rng
        group = []
        for _ in range(_pick(p.parallel, rng)):
            sub = self.builder.subagent(main, after, draw(p.spawn_delay, rng))
            n = max(1, round(draw(p.sub_turns, rng)))
            sub.request(0.0, _tokens(p.sub_first_prompt, rng), _tokens(p.sub_output_tokens, rng))
            for _ in range(n - 1):
                wait = draw(p.sub_wait, rng)
                sub.request(wait, _tokens(p.sub_new_tokens, rng), _tokens(p.sub_output_tokens, rng))
            group.append(sub.id)
        return () if rng.random() < p.background_share else tuple(group)


def prefixes(params: Params) -> dict[str, int]:
    """The trace's shared prefixes: the Claude Code system prompt's full blocks, when shared."""
    return (
        {CLAUDE_CODE_PREFIX: CLAUDE_CODE_PREFIX_TOKENS // BLOCK_SIZE}
        if params.shared_prefix
        else {}
    )


def generate(plan: SlotPlan, params: Params | None = None) -> Trace:
    """`plan.agents` slots of back-to-back Claude-Code-like sessions."""
    params = params or Params.default()
    meta = {"shared_prefix": params.shared_prefix, "params": json.loads(params.to_json())}
    return one_workload(plan, NAME, session(params), prefixes(params), meta, BLOCK_SIZE)
