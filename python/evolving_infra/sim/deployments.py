"""The deployment flags `sim` and `scenario` share: a named preset, each part overridable.

`--deployment paper` is the paper's setting (Kimi K2 on 9 x 4 GB300, NVFP4 experts, FP8 KV, 3
draft tokens with 2.5 accepted); `h100-llama` the simulator's long-standing one (Llama-3-70B on
4 x H100, BF16). `--model`, `--gpu`, `--tp`, `--mtp-draft-tokens` and `--mtp-accepted` replace
the preset's part they name.
"""

from __future__ import annotations

import argparse
import dataclasses

from evolving_infra.timing.specs import DEPLOYMENTS, GPUS, MODELS, Deployment
from evolving_infra.workloads.errors import WorkloadError


def add_deployment_arguments(parser: argparse.ArgumentParser, default: str = "h100-llama") -> None:
    parser.add_argument(
        "--deployment",
        choices=sorted(DEPLOYMENTS),
        default=default,
        help="the model, GPU and serving setting: paper (Kimi K2, an MLA mixture of experts "
        "with NVFP4 experts and an FP8 KV cache, on 4 x GB300 per node, 3 draft tokens of "
        "which 2.5 are accepted per step) or h100-llama (Llama-3-70B in BF16 on 4 x H100) "
        "(default: %(default)s)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        help="replace the deployment's model: dense Llama 3 (BF16); glm-4.5, a GQA mixture of "
        "experts (160 experts, 8 per token); kimi-k2, an MLA one (384 experts, 8 per token); "
        "both with NVFP4 experts and an FP8 KV cache",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        help="replace the deployment's GPU (gb300: Blackwell Ultra, with NVFP4 tensor cores)",
    )
    parser.add_argument("--tp", type=int, help="replace the deployment's GPUs per node")
    parser.add_argument(
        "--mtp-draft-tokens",
        type=int,
        help="replace the deployment's draft tokens per decode step (0: no speculative decoding)",
    )
    parser.add_argument(
        "--mtp-accepted",
        type=float,
        help="replace the deployment's mean tokens gained per decode step, the bonus token "
        "included (1 to draft tokens + 1)",
    )


def deployment_from(args: argparse.Namespace) -> Deployment:
    """The preset `args.deployment` with the parts the other flags name replaced."""
    d = DEPLOYMENTS[args.deployment]
    parts: dict[str, object] = {}
    if args.model is not None:
        parts["model"] = MODELS[args.model]
    if args.gpu is not None:
        parts["gpu"] = GPUS[args.gpu]
    if args.tp is not None:
        parts["tp"] = args.tp
    if args.mtp_draft_tokens is not None:
        parts["mtp_draft_tokens"] = args.mtp_draft_tokens
        if args.mtp_draft_tokens == 0 and args.mtp_accepted is None:
            parts["mtp_accepted"] = 1.0
    if args.mtp_accepted is not None:
        parts["mtp_accepted"] = args.mtp_accepted
    try:
        return dataclasses.replace(d, **parts)  # type: ignore[arg-type]
    except ValueError as e:
        raise WorkloadError(f"--deployment {args.deployment}: {e}") from None
