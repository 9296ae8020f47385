#!/usr/bin/env python3
"""Measure real LLM iteration times on one GPU, as samples the iteration-time model learns from.

What it measures: the wall time of one engine iteration (a forward pass) of a Llama-architecture
model with RANDOM weights in bf16, built from plain torch ops (embedding, RMSNorm, fused QKV and
O linears, RoPE, GQA attention, SwiGLU MLP, LM head), on one GPU, no tensor parallelism:

- prefill: a batch of requests, each `(uncached, cached)` tokens: it computes the `uncached`
  tokens now and attends to a `cached` prefix already in a preallocated KV pool. Query positions
  t_c .. t_c+t_uc-1 attend to every cached key and causally to the new ones. The LM head runs on
  the last position of each request. Single requests on a log-spaced grid (t_uc 16..32k x t_c
  0..128k, within memory) and seeded batches of 2-16 requests of mixed sizes.
- decode: B requests, one new token each, over their contexts (per-request context lengths drawn
  so that they add up to C); the LM head runs on every token. B 1..256 x context per request
  256..32k (within memory), plus seeded off-grid points. Decode runs as a CUDA graph when it can
  be captured (as serving engines do), else eagerly; the JSON sidecar says which.

Batching: the linears run on the packed tokens of all requests (no padding). Attention uses
flash-attn's varlen kernel when `flash_attn` is importable (exact, one call a layer); otherwise
`torch.nn.functional.scaled_dot_product_attention`: prefill loops over the requests (one call per
request a layer, with a lower-right causal mask so the new tokens see the whole prefix), decode
pads requests of similar length into a few groups (`--decode-groups`) with a key-padding mask.
The backend is chosen by a correctness probe at start-up against a float32 reference.

Timing: CUDA events around each iteration, `torch.cuda.synchronize` between, warm-up iterations
first, the median of `--repeats` runs per composition. Compositions that run out of memory are
skipped and logged. The run is bounded by `--budget-s` (the plan is sized to it from a roofline
estimate, and the run stops when the budget is spent), so a default run fits a 10-minute slot.

Run it on a machine with an NVIDIA GPU and torch (flash-attn optional):

    python benches/gpu/iteration_profile.py --out benches/gpu/data/h200-llama3-8b.csv
    python benches/gpu/iteration_profile.py --quick --out /tmp/quick.csv          # ~2 minutes
    python benches/gpu/iteration_profile.py --model llama-3-70b --layers 20 --out ...
    python benches/gpu/iteration_profile.py --dry-run                    # the plan; no torch
    python benches/gpu/iteration_profile.py --device cpu --model tiny --quick --out /tmp/t.csv

The CSV is exactly `evolving_infra.timing.samples.write_csv`'s format (columns phase, seconds,
batch, batch_size, context_tokens); a sidecar FILE.json beside it holds the metadata (GPU, torch
and CUDA versions, model config and the layer count measured, dtype, date, repeats, attention
backend, per-sample runs, skipped compositions). With `--layers` the times are for that many
layers: consumers scale by `layers` / `full_layers` from the sidecar. Results are committed as
data under `benches/gpu/data/` and feed `evolving-infra model eval --data CSV`.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The code is the `iteration_profiler` package beside this script (on the path already when the
# script runs as `python benches/gpu/iteration_profile.py`, not when it is run otherwise).
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from iteration_profiler.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(description=__doc__))
