"""The simulated engine: the node model's mechanics behind SGLang's HTTP API, in real time.

`SimEngine` (core.py) runs one `nodemodel.node.Node` and its `nodemodel.kv.NodeKv` under
`RealTimeEnv` (env.py), an asyncio driver of the same `Env` protocol the discrete-event
simulator implements; `http.py` serves SGLang 0.5.23's data API over it; `command.py` is
`evolving-infra engine --backend sim`. See docs/simulator.md for the mechanics and core.py
for the request lifecycle.
"""

from evolving_infra.engines.sim.cache import CacheEvents, KvEventSink, Medium
from evolving_infra.engines.sim.core import EngineSettings
from evolving_infra.engines.sim.env import EngineHooks, RealTimeEnv, SampleSink
from evolving_infra.engines.sim.http import build_app
from evolving_infra.engines.sim.requests import Bootstrap, GenerateError, GenerateSpec, LiveRequest
from evolving_infra.engines.sim.service import SimEngine

__all__ = [
    "Bootstrap",
    "CacheEvents",
    "EngineHooks",
    "EngineSettings",
    "GenerateError",
    "GenerateSpec",
    "KvEventSink",
    "LiveRequest",
    "Medium",
    "RealTimeEnv",
    "SampleSink",
    "SimEngine",
    "build_app",
]
