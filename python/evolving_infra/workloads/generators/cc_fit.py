"""Fits `cc_like.Params` to Claude Code traces, and writes the committed `cc_params.json`.

    python -m evolving_infra.workloads.generators.cc_fit [TRACE_FILE_OR_DIR ...] [-o OUT]

Without paths it fits the bundled traces (`data/traces/claude-code/`) and rewrites
`cc_params.json` beside `cc_like`; the output depends only on the traces (no dates), so a refit
of the same files is byte-identical (tests/test_workloads_cc_like.py checks it).

The fit reads the trace model (`importers.claude_code_trace`), not the raw files, so that a
wait, a join or a compaction means here what it means in an imported trace. Tables are empirical
quantiles (linear between order statistics, numpy's default) at `cc_like.LEVELS`, rounded to
0.01; probabilities are shares of counts, rounded to 1e-6.
"""

from __future__ import annotations

import argparse
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from evolving_infra.workloads.blocks import common_prefix
from evolving_infra.workloads.claude_code import (
    Conversation,
    bundled_trace_dir,
    find_trace_files,
    load_conversations,
)
from evolving_infra.workloads.generators.cc_like import (
    LEVELS,
    PARAMS_FILE,
    SHRINK_BELOW,
    Params,
    Table,
)
from evolving_infra.workloads.importers import claude_code_trace
from evolving_infra.workloads.model import Agent, Branch, BranchKind, Request, Trace

CcParams = Params
COMMAND = "python -m evolving_infra.workloads.generators.cc_fit"


def quantiles(values: Sequence[float]) -> Table:
    """The values' quantiles at LEVELS (empty: all 0, so that a draw is 0)."""
    s = sorted(values)
    if not s:
        return tuple(0.0 for _ in LEVELS)
    out = []
    for level in LEVELS:
        h = (len(s) - 1) * level
        lo = math.floor(h)
        hi = min(lo + 1, len(s) - 1)
        out.append(round(s[lo] + (h - lo) * (s[hi] - s[lo]), 2))
    return tuple(out)


def _share(part: int, whole: int) -> float:
    return round(part / whole, 6) if whole else 0.0


def _kept_blocks(prev: Request, r: Request) -> int:
    """Leading blocks two prompts of one branch have in common, shared prefix included."""
    if prev.shared != r.shared:
        return min(prev.shared, r.shared)
    return r.shared + common_prefix(prev.blocks, r.blocks)


def fit(data: Trace | Sequence[Conversation], *, long_wait: float = 600.0) -> Params:
    """The parameters of `cc_like` that reproduce the traces' distributions."""
    trace = data if isinstance(data, Trace) else claude_code_trace(data)
    bs = trace.block_size
    turns: list[int] = []
    first: list[int] = []
    new: list[int] = []
    out: list[int] = []
    wait: list[float] = []
    trigger: list[int] = []
    keep: list[int] = []
    summary: list[int] = []
    shrinks = followups = 0
    rewrites = {True: 0, False: 0}  # by "the wait was long"
    candidates = {True: 0, False: 0}
    spawning: list[Agent] = []
    for a in trace.agents:
        rs = a.root.requests
        turns.append(len(rs))
        first.append(rs[0].prompt_tokens)
        out.extend(r.output_tokens for r in rs)
        after_shrink = False
        for prev, r in itertools.pairwise(rs):
            wait.append(r.wait)
            kept = _kept_blocks(prev, r) * bs
            if r.compaction:
                keep.append(kept)
            if r.compaction and r.prompt_tokens < SHRINK_BELOW * prev.prompt_tokens:
                shrinks += 1
                trigger.append(prev.prompt_tokens)
                summary.append(r.prompt_tokens - kept)
                after_shrink = True
                continue
            new.append(max(0, r.prompt_tokens - prev.prompt_tokens - prev.output_tokens))
            if after_shrink:
                followups += r.compaction
            else:
                long = r.wait >= long_wait
                candidates[long] += 1
                rewrites[long] += r.compaction
            after_shrink = False
        if any(b.kind is not BranchKind.ROOT for b in a.branches):
            spawning.append(a)
    sub = _fit_subagents(spawning)
    requests = trace.request_count
    n_subs = sum(len(a.branches) - 1 for a in trace.agents)
    return Params(
        session_turns=quantiles(turns),
        first_prompt=quantiles(first),
        new_tokens=quantiles(new),
        output_tokens=quantiles(out),
        wait=quantiles(wait),
        subagent_session_share=_share(len(spawning), len(trace.agents)),
        compact_trigger=quantiles(trigger),
        compact_keep=quantiles(keep),
        compact_summary=quantiles(summary),
        followup_rate=_share(followups, shrinks),
        rewrite_rate_long=_share(rewrites[True], candidates[True]),
        rewrite_rate_short=_share(rewrites[False], candidates[False]),
        long_wait=long_wait,
        shrink_below=SHRINK_BELOW,
        **sub,
        provenance={
            "source": trace.meta.get("source", ""),
            "files": list(trace.meta.get("files", [])),
            "via": "importers.claude_code_trace",
            "command": COMMAND,
            "sessions": len(trace.agents),
            "requests": requests,
            "subagents": n_subs,
            "auto_compactions": shrinks,
            "rewrites": followups + rewrites[True] + rewrites[False],
        },
    )


def _fit_subagents(spawning: Sequence[Agent]) -> dict[str, Any]:
    """The sub-agent parameters, from the sessions that spawn any."""
    first_turn: list[int] = []
    sizes: list[int] = []
    delays: list[float] = []
    events = background = opportunities = 0
    turns: list[int] = []
    first: list[int] = []
    new: list[int] = []
    out: list[int] = []
    wait: list[float] = []
    for a in spawning:
        root = a.root
        joined = {j for r in root.requests for j in r.join}
        groups: dict[int, list[Branch]] = {}
        for b in a.branches[1:]:
            if b.parent == root.id and b.after is not None:
                groups.setdefault(b.after, []).append(b)
            delays.append(b.delay)
            rs = b.requests
            turns.append(len(rs))
            first.append(rs[0].prompt_tokens)
            out.extend(r.output_tokens for r in rs)
            for prev, r in itertools.pairwise(rs):
                wait.append(r.wait)
                new.append(max(0, r.prompt_tokens - prev.prompt_tokens - prev.output_tokens))
        if not groups:
            continue
        start = min(groups)
        first_turn.append(start)
        # The generator spawns at most up to the second-to-last request, each turn a trial.
        opportunities += max(0, len(root.requests) - 2 - start)
        events += len(groups) - 1
        for g in groups.values():
            sizes.append(len(g))
            background += not any(b.id in joined for b in g)
    return {
        "first_spawn_turn": quantiles(first_turn),
        "respawn_rate": _share(events, opportunities),
        "parallel": tuple(_share(sizes.count(k), len(sizes)) for k in range(1, max(sizes) + 1))
        if sizes
        else (1.0,),
        "background_share": _share(background, len(sizes)),
        "spawn_delay": quantiles(delays),
        "sub_turns": quantiles(turns),
        "sub_first_prompt": quantiles(first),
        "sub_new_tokens": quantiles(new),
        "sub_output_tokens": quantiles(out),
        "sub_wait": quantiles(wait),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="*", type=Path, help="trace files or folders")
    parser.add_argument("-o", "--output", type=Path, default=PARAMS_FILE)
    args = parser.parse_args(argv)
    files = find_trace_files(args.paths or [bundled_trace_dir()])
    args.output.write_text(fit(load_conversations(files)).to_json(), encoding="utf-8")
    print(f"wrote {args.output} from {len(files)} trace files")


if __name__ == "__main__":
    main()
