"""One engine node's mechanics, driven by two clocks: the discrete-event simulator (`sim/`) and
the real-time simulated engine (`engines/sim/`).

- `node.Node`: a prefill queue in chunked iterations or a decode batch in spans, admission by KV
  room, phase switches; what it needs of its driver is `node.Env` (time, the ground truth, the
  observers);
- `kv.NodeKv`: its L1 and L2 tiers as the shared `KvDirectory` records them, pins and
  reservations, demotion, and the listener the engine turns into SGLang KV events;
- `request.SimRequest`: the request record both of them work on;
- `hardware.NodeHardware`: its capacities and bandwidths from the deployment.

It knows neither driver: nothing here imports `sim`, `engines` or `router`.
"""

from evolving_infra.nodemodel.hardware import NodeHardware
from evolving_infra.nodemodel.kv import NodeKv
from evolving_infra.nodemodel.node import Node, NodeSettings
from evolving_infra.nodemodel.request import SimRequest

__all__ = ["Node", "NodeHardware", "NodeKv", "NodeSettings", "SimRequest"]
