"""Timing: the iteration-time model, its ground truths and the TTFT predictor (no decisions).

`samples` is the one interface timing sources feed (prefill batches of (uncached, cached)
tokens, decode batch size and context); `specs` holds model and GPU figures; `truth` the hidden
roofline ground truth that the simulated engine and the simulator run on; `model` the online
`IterationModel`; `ttft` the per-node TTFT predictor.
"""

from evolving_infra.timing.model import IterationModel
from evolving_infra.timing.samples import (
    BadSampleError,
    PrefillBatch,
    Sample,
    SampleFileError,
    Timing,
    TimingError,
    from_forward_pass_metrics,
    read_csv,
    write_csv,
)
from evolving_infra.timing.specs import (
    A100,
    DEFAULT_DEPLOYMENT,
    GPUS,
    H100,
    H200,
    LLAMA3_8B,
    LLAMA3_70B,
    MODELS,
    Deployment,
    GpuSpec,
    ModelConfig,
)
from evolving_infra.timing.ttft import TTFTPredictor

__all__ = [
    "A100",
    "DEFAULT_DEPLOYMENT",
    "GPUS",
    "H100",
    "H200",
    "LLAMA3_8B",
    "LLAMA3_70B",
    "MODELS",
    "BadSampleError",
    "Deployment",
    "GpuSpec",
    "IterationModel",
    "ModelConfig",
    "PrefillBatch",
    "Sample",
    "SampleFileError",
    "TTFTPredictor",
    "Timing",
    "TimingError",
    "from_forward_pass_metrics",
    "read_csv",
    "write_csv",
]
