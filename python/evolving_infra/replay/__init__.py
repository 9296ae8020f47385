"""Closed-loop load on a live router from agent traces (`evolving-infra replay`).

A client of the router's HTTP API: `prompts` turns trace prompts into token ids, `client` speaks
`/v1/completions` with the agent branch headers, `runner` drives the trace's closed loop
(`sim.agents.AgentReplay`) from real responses, `summary` defines what is measured, `command` is
the CLI.
"""

from evolving_infra.replay.prompts import PromptTokens
from evolving_infra.replay.runner import Replayer, ReplaySettings, scale_time
from evolving_infra.replay.summary import Outcome, Summary, summarize

__all__ = [
    "Outcome",
    "PromptTokens",
    "ReplaySettings",
    "Replayer",
    "Summary",
    "scale_time",
    "summarize",
]
