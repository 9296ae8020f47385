"""Real SGLang 0.5.23 objects on a CPU, for tests/test_sglang_*.py.

SGLang and its CPU dependencies are installed into the venv by scripts/install-sglang-cpu.sh
(`make sglang`). Tests that use it are marked `sglang` and *fail* when it is missing: a CI that
silently skipped them would test nothing of the engine patch.

Everything here is SGLang's own code running on CPU: the token KV pool (`MHATokenToKVPool` with
tiny CPU tensors), its page allocator, the request-to-token pool, `RadixCache` and
`UnifiedRadixCache` (both tree cores), `ServerArgs`. The one part that cannot run here is
HiCache's host pool, which pins its memory with `cudaHostRegister` (no GPU driver); tests that
need an L2 say how they stand in for it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import json
import os
import sys
import warnings
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evolving_infra.engines.sglang import patch

INSTALL = "scripts/install-sglang-cpu.sh"
PAGE = 4  # tokens per page in these tests: small, so block boundaries are easy to see


class SglangMissingError(RuntimeError):
    """SGLang (or the right version of it) is not installed in this venv."""


@functools.cache
def import_sglang() -> Any:
    """Imports SGLang 0.5.23 (once per process), or raises a `SglangMissingError` naming the
    install script."""
    try:
        patch.check_version()
    except patch.SglangVersionError as err:
        raise SglangMissingError(
            f"{err}. Install it into this venv with `{INSTALL} {sys.prefix}` (make sglang)"
        ) from None
    # SGLang's page hash is a C++ extension torch compiles on first use (with ninja from the venv's
    # bin/); the install script built it into the venv already.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch-extensions"))
    bin_dir = str(Path(sys.executable).parent)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # SGLang warns at import about CUDA-only kernels; pytest turns warnings into errors.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in (
            "sglang.srt.mem_cache.radix_cache",
            "sglang.srt.mem_cache.unified_radix_cache",
            "sglang.srt.managers.scheduler",
            "sglang.srt.disaggregation.role_switch",
            "sglang.srt.disaggregation.kv_events",
            "sglang.srt.server_args",
        ):
            importlib.import_module(name)
    return importlib.import_module("sglang")


def sg(module: str) -> Any:
    """An SGLang (or torch) module, typed Any: SGLang has no type information."""
    import_sglang()
    return importlib.import_module(module)


@dataclass
class Pools:
    """SGLang's real device-side pools, on CPU and tiny."""

    kv: Any  # MHATokenToKVPool
    allocator: Any  # PagedTokenToKVPoolAllocator
    req_to_token: Any  # ReqToTokenPool
    capacity: int


def pools(capacity: int = 128, page_size: int = PAGE) -> Pools:
    torch = sg("torch")
    memory_pool = sg("sglang.srt.mem_cache.memory_pool")
    paged = sg("sglang.srt.mem_cache.allocator.paged")
    kv = memory_pool.MHATokenToKVPool(
        size=capacity, page_size=page_size, dtype=torch.float16, head_num=1, head_dim=8,
        layer_num=1, device="cpu", enable_memory_saver=False, enable_alt_stream=False,
    )  # fmt: skip
    allocator = paged.PagedTokenToKVPoolAllocator(
        size=capacity, page_size=page_size, dtype=torch.float16, device="cpu", kvcache=kv,
        need_sort=False,
    )  # fmt: skip
    req = memory_pool.ReqToTokenPool(
        size=4, max_context_len=capacity, device="cpu", enable_memory_saver=False
    )
    return Pools(kv, allocator, req, capacity)


CACHE_KINDS = ("radix", "unified-python", "unified-rust")


def cache(kind: str, p: Pools, *, eviction_policy: str = "lru", page_size: int = PAGE) -> Any:
    """A real radix cache with KV events on: `RadixCache`, or `UnifiedRadixCache` (what 0.5.23's
    scheduler builds by default) on its Python or its Rust tree core."""
    params = sg("sglang.srt.mem_cache.cache_init_params").CacheInitParams(
        disable=False,
        req_to_token_pool=p.req_to_token,
        token_to_kv_pool_allocator=p.allocator,
        page_size=page_size,
        enable_kv_cache_events=True,
        eviction_policy=eviction_policy,
    )
    if kind == "radix":
        return sg("sglang.srt.mem_cache.radix_cache").RadixCache(params)
    component = sg("sglang.srt.mem_cache.unified_cache.components").ComponentType.FULL
    params.tree_components = (component,)
    params.tree_core_backend = kind.removeprefix("unified-")
    made = sg("sglang.srt.mem_cache.unified_radix_cache").UnifiedRadixCache(params)
    core = type(made.tree_core).__name__
    assert ("Rust" in core) == (kind == "unified-rust"), core  # no silent fallback of the core
    return made


def key(tokens: list[int]) -> Any:
    return sg("sglang.srt.mem_cache.radix_cache").RadixKey(array("q", tokens))


def insert(c: Any, p: Pools, tokens: list[int], page_size: int = PAGE) -> Any:
    """What a finished request leaves behind: slots for the full pages of `tokens`, the key
    inserted, and the slots of the prefix the tree already had freed again. `RadixCache` leaves
    that free to its caller (`RadixCache._insert_cache` does it); `UnifiedRadixCache.insert` does
    it itself. The tree owns the rest from then on; they are returned."""
    n = len(tokens) // page_size * page_size
    slots = p.allocator.alloc(n)
    assert slots is not None, "pool full"
    base = sg("sglang.srt.mem_cache.base_prefix_cache")
    result = c.insert(base.InsertParams(key=key(tokens[:n]), value=slots))
    if isinstance(c, sg("sglang.srt.mem_cache.radix_cache").RadixCache):
        p.allocator.free_segment(slots[: result.prefix_len], start_pos=0)
    return slots[result.prefix_len :]


def cached_len(c: Any, tokens: list[int]) -> int:
    """How many leading tokens of `tokens` the cache holds on the device (a prefix match)."""
    base = sg("sglang.srt.mem_cache.base_prefix_cache")
    return int(c.match_prefix(base.MatchPrefixParams(key=key(tokens))).device_prefix_len)


def tiny_model_dir(path: Path) -> str:
    """A model directory with only a config.json (a one-layer Llama): enough for SGLang to parse
    and validate server args; no weights, nothing is loaded."""
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "vocab_size": 256, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return str(path)
