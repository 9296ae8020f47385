"""Putnam-like formal math proving: few turns, long reasoning outputs, parallel proof attempts.

One session is one competition problem (PutnamBench, Tsoukalas et al. 2024: 640+ Putnam
problems formalised in Lean 4) worked by a long chain-of-thought prover:

- the main branch sends the system prompt and the problem (informal statement and its Lean 4
  formalisation) and gets back an informal proof sketch;
- `attempts` forks of the main branch, right after the sketch, each write a whole proof (pass@K
  sampling run in parallel). Every attempt is checked by the Lean compiler; a failed one gets the
  compiler's errors as a feedback turn and retries, up to `max_retries` times;
- the main branch joins the attempts (after the last ones are checked) and, given their results,
  writes the final answer.

Decode dominates: a proof attempt is thousands to tens of thousands of tokens, while what is
appended to a cached context between turns (an instruction, compiler errors) is hundreds.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from evolving_infra.workloads.claude_code import BLOCK_SIZE
from evolving_infra.workloads.generators.common import (
    AgentBuilder,
    LogNormal,
    Session,
    SlotPlan,
    one_workload,
    system_prefix,
)
from evolving_infra.workloads.model import Trace

NAME = "putnam"
PREFIX = "putnam/system"  # the shared system prompt of every Putnam session


@dataclass(frozen=True, slots=True)
class Params:
    # The prover's system prompt (instructions, Lean 4 / Mathlib conventions, output format).
    # Assumption: ~1k tokens, the size of a detailed instruction prompt with a worked example.
    system_tokens: int = 1024
    # Whether every session's system prompt is one trace-wide shared prefix (the same prover
    # serving many problems) or private to the session. Modelling choice, not a measurement.
    shared_prefix: bool = True
    # Problem statement tokens: lognormal median/sigma, clipped. Assumption: a Putnam problem is
    # a paragraph of prose plus a Lean 4 theorem statement of a few to a few dozen lines
    # (PutnamBench's formalisations), so hundreds of tokens.
    problem: LogNormal = LogNormal(median=350.0, sigma=0.4, lo=80, hi=2000)
    # The main branch's informal proof sketch, which all attempts share. Assumption: a sketch /
    # subgoal decomposition before formal proving (the pipeline of DeepSeek-Prover-V2, Ren et
    # al. 2025); its length, ~2k tokens of reasoning, is assumed.
    sketch: LogNormal = LogNormal(median=2000.0, sigma=0.6, lo=200, hi=16384)
    # Parallel proof attempts per problem (forks of the main branch). Assumption: provers are
    # evaluated pass@K with K from 32 upward; 8 concurrent samples per session keeps one
    # session's fan-out moderate while still exercising fork-shared prefixes.
    attempts: int = 8
    # Tokens of the per-attempt instruction appended to the shared context. Assumption: a line.
    attempt_prompt_tokens: int = 40
    # One attempt's output (reasoning + Lean proof): lognormal, clipped. Long-CoT reasoners emit
    # thousands to tens of thousands of tokens on hard math (DeepSeek-R1, Guo et al. 2025: the
    # mean response length of R1-Zero grows to ~10k tokens during RL; its evaluation caps
    # generation at 32,768 tokens, hence the clip). The 8k median is an assumption in that range.
    attempt_output: LogNormal = LogNormal(median=8000.0, sigma=0.6, lo=1000, hi=32768)
    # Feedback rounds after a failed check (each: compiler errors in, a new attempt out).
    # Assumption: a small repair budget, as in verifier-feedback provers.
    max_retries: int = 2
    # Chance that a check accepts the proof (ending the attempt early). Assumption: Putnam
    # problems are hard; the systems evaluated in PutnamBench solved only a handful of them.
    p_verified: float = 0.1
    # Lean compiler feedback (errors with goal states): lognormal tokens, clipped. Assumption.
    feedback: LogNormal = LogNormal(median=600.0, sigma=0.8, lo=50, hi=8000)
    # Seconds to check a proof with Lean (the wait before the feedback turn): lognormal,
    # clipped. Assumption: seconds to a minute with Mathlib already loaded in a warm REPL.
    verify: LogNormal = LogNormal(median=15.0, sigma=0.8, lo=1.0, hi=300.0)
    # Whether the main branch joins the attempts for a final answer. Modelling choice.
    final_answer: bool = True
    # Tokens per attempt reported to the final turn (verdict and proof or last errors):
    # lognormal median, clipped. Assumption: a Lean proof of tens of lines.
    result: LogNormal = LogNormal(median=400.0, sigma=0.6, lo=20, hi=4000)
    # The final answer: lognormal tokens, clipped. Assumption: a write-up shorter than an attempt.
    final: LogNormal = LogNormal(median=1500.0, sigma=0.6, lo=100, hi=16384)


def prefixes(params: Params) -> dict[str, int]:
    """The trace's shared prefixes: the system prompt's full blocks, when shared."""
    return system_prefix(PREFIX, params.system_tokens, params.shared_prefix, BLOCK_SIZE)


def session(params: Params) -> Session:
    """One problem: sketch on the main branch, `attempts` forks with retries, a joined answer."""
    p = params
    if p.attempts < 1 or p.max_retries < 0:
        raise ValueError("attempts must be >= 1 and max_retries >= 0")
    # Only full blocks can be a shared prefix; the rest of the system prompt is the session's.
    own_system = p.system_tokens - BLOCK_SIZE * prefixes(p).get(PREFIX, 0)

    def run(rng: random.Random, b: AgentBuilder, t: float) -> None:
        del t  # the workload does not change over the trace
        main = b.root()
        problem = p.problem.ints(rng)
        sketch = p.sketch.ints(rng)
        first = main.request(0.0, own_system + problem, sketch)
        forks = []
        for _ in range(p.attempts):
            f = b.fork(main, first)
            f.request(0.0, p.attempt_prompt_tokens, p.attempt_output.ints(rng))
            for _ in range(p.max_retries):
                if rng.random() < p.p_verified:
                    break
                wait = p.verify.draw(rng)
                feedback = p.feedback.ints(rng)
                f.request(wait, feedback, p.attempt_output.ints(rng))
            forks.append(f)
        if p.final_answer:
            # The wait is the check of the attempts' last proofs, run once they have all ended.
            wait = p.verify.draw(rng)
            results = sum(p.result.ints(rng) for _ in forks)
            final = p.final.ints(rng)
            main.request(wait, results, final, join=tuple(f.id for f in forks))

    return run


def generate(plan: SlotPlan, params: Params | None = None) -> Trace:
    """`plan.agents` slots of back-to-back Putnam sessions."""
    params = params or Params()
    meta = {"params": dataclasses.asdict(params)}
    return one_workload(plan, NAME, session(params), prefixes(params), meta, BLOCK_SIZE)
