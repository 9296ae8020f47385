"""OSWorld-like computer use: tens of turns, a screenshot per turn, seconds of tool wait.

One session is one task (OSWorld, Xie et al., NeurIPS 2024: 369 tasks on real desktop apps in a
VM, run with step limits of 15 or 50) worked by a vision-language agent on a single branch:

- the first request sends the system prompt, the task instruction and the first screenshot;
- every turn the agent answers with its reasoning and one action (e.g. a few lines of
  pyautogui); the harness executes it, waits for the screen to settle, captures a screenshot
  and sends it with a short observation text;
- the session ends when the agent says done / fail or reaches the step limit.

Prompts grow by a screenshot (thousands of image tokens) plus the previous action each turn, so
prefill of new tokens matters as much as decode. By default the whole history is kept: each
prompt extends the previous one, the most cache-friendly harness. `keep_screenshots = k > 0`
models a harness that keeps only the last k screenshots (the text of older steps stays): from
then on each prompt diverges where the oldest kept screenshot used to be, so the window's k
screenshots are prefilled again every turn. That is a compaction of the branch.
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

NAME = "osworld"
PREFIX = "osworld/system"  # the shared system prompt (action space, output format)


@dataclass(frozen=True, slots=True)
class Params:
    # The agent's system prompt: role, action space (pyautogui or a fixed action set), output
    # format. Assumption: ~1.5k tokens, a detailed action-space description.
    system_tokens: int = 1536
    # Whether the system prompt is a trace-wide shared prefix. Modelling choice.
    shared_prefix: bool = True
    # Task instruction tokens: lognormal, clipped. Assumption: OSWorld instructions are one or
    # two sentences, so tens of tokens.
    instruction: LogNormal = LogNormal(median=40.0, sigma=0.5, lo=8, hi=400)
    # Screen size in pixels. OSWorld's VMs run at 1920x1080 by default.
    screen_width: int = 1920
    screen_height: int = 1080
    # Pixels per side of one image token. Qwen2-VL / Qwen2.5-VL merge 2x2 patches of 14 px, so a
    # token covers 28x28 px after resizing each side to a multiple of 28: 1920x1080 is 69x39 =
    # 2691 tokens. (Claude's vision docs give ~w*h/750 tokens after downscaling to a 1568 px
    # long edge: ~1.8k; set `screenshot_tokens_override` to model such a VLM.)
    patch_pixels: int = 28
    # Tokens per screenshot when > 0, replacing the patch computation.
    screenshot_tokens_override: int = 0
    # Observation text sent with each screenshot (step number, "action executed", errors):
    # lognormal tokens, clipped. Assumption: a line or two.
    observation: LogNormal = LogNormal(median=30.0, sigma=0.5, lo=5, hi=500)
    # One response: reasoning plus one action. Lognormal tokens, clipped. Assumption: a short
    # ReAct-style thought and a few lines of pyautogui, hundreds of tokens.
    output: LogNormal = LogNormal(median=300.0, sigma=0.6, lo=30, hi=4000)
    # Step limit: OSWorld evaluates with 15 and with 50 steps; 50 is the longer budget.
    max_steps: int = 50
    # Chance that an episode runs to the step limit. Assumption: agents fail most OSWorld tasks
    # (the paper's best model succeeded on ~12% of them, humans on ~72%) and a failing agent
    # often loops until the limit rather than declaring failure.
    p_step_limit: float = 0.3
    # Steps of an episode that ends early (done / fail): lognormal, clipped to [lo, hi] and to
    # max_steps. Assumption: a dozen steps, the order of the human trajectories the tasks are
    # built from.
    steps: LogNormal = LogNormal(median=12.0, sigma=0.5, lo=3, hi=50)
    # Seconds between a response and the next request: executing the action, letting the UI
    # settle, capturing the screenshot. Lognormal, clipped. Assumption: a few seconds.
    action_wait: LogNormal = LogNormal(median=3.0, sigma=0.5, lo=0.5, hi=60.0)
    # Screenshots kept in the prompt (0: the whole history). Modelling choice; see the docstring.
    keep_screenshots: int = 0


def screenshot_tokens(p: Params) -> int:
    """Image tokens of one screenshot for the configured VLM."""
    if p.screenshot_tokens_override > 0:
        return p.screenshot_tokens_override
    # Each side is resized to the nearest multiple of the token's pixel size (Qwen2-VL's resize).
    return round(p.screen_width / p.patch_pixels) * round(p.screen_height / p.patch_pixels)


def prefixes(params: Params) -> dict[str, int]:
    """The trace's shared prefixes: the system prompt's full blocks, when shared."""
    return system_prefix(PREFIX, params.system_tokens, params.shared_prefix, BLOCK_SIZE)


def session(params: Params) -> Session:
    """One task: a single branch of screenshot turns until done or the step limit."""
    p = params
    if not 1 <= p.steps.lo <= p.max_steps or p.keep_screenshots < 0:
        raise ValueError("need 1 <= steps.lo <= max_steps and keep_screenshots >= 0")
    shot = screenshot_tokens(p)
    own_system = p.system_tokens - BLOCK_SIZE * prefixes(p).get(PREFIX, 0)

    def run(rng: random.Random, b: AgentBuilder, t: float) -> None:
        del t  # the workload does not change over the trace
        if rng.random() < p.p_step_limit:
            steps = p.max_steps
        else:
            steps = min(p.max_steps, p.steps.ints(rng))
        main = b.root()
        instruction = p.instruction.ints(rng)
        # Tokens of the context before the first screenshot: what truncation never rewrites.
        head = main.context_tokens + own_system + instruction
        texts: list[int] = []  # per step: observation text + response (kept after truncation)
        dropped = 0  # steps whose screenshot has left the prompt
        for i in range(steps):
            wait = p.action_wait.draw(rng) if i else 0.0
            obs = p.observation.ints(rng)
            out = p.output.ints(rng)
            if p.keep_screenshots and i + 1 - dropped > p.keep_screenshots:
                # The prompt keeps everything up to the first screenshot it drops; after that
                # come the texts of the newly stripped steps and the window, all rewritten.
                now = i + 1 - p.keep_screenshots
                keep = head + sum(texts[:dropped])
                rewritten = sum(texts[dropped:]) + shot * (p.keep_screenshots - 1)
                # `compact` keeps whole blocks: the tokens of the partial one are rewritten too.
                main.compact(keep, rewritten + keep % BLOCK_SIZE)
                dropped = now
            new = shot + obs + (own_system + instruction if i == 0 else 0)
            main.request(wait, new, out)
            texts.append(obs + out)

    return run


def generate(plan: SlotPlan, params: Params | None = None) -> Trace:
    """`plan.agents` slots of back-to-back OSWorld sessions."""
    params = params or Params()
    meta = {"params": dataclasses.asdict(params)}
    return one_workload(plan, NAME, session(params), prefixes(params), meta, BLOCK_SIZE)
