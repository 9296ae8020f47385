#!/usr/bin/env bash
# Install SGLang 0.5.23 into the virtual environment VENV_DIR so that its scheduler, radix caches,
# KV-event publisher and ServerArgs import and run on a CPU-only machine (tests of the SGLang
# patch, tests/test_sglang_*.py). It serves no model: that needs a GPU and SGLang's CUDA kernels.
#
#   scripts/install-sglang-cpu.sh .venv
#
# Idempotent: a stamp in VENV_DIR records a hash of this script and its constraints file; a second
# run with both unchanged does nothing.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
# Absolute: step 5 puts VENV_DIR/bin on PATH for a compiler that runs in another folder.
venv=$(cd "$1" 2>/dev/null && pwd) || { echo "$0: no folder $1" >&2; exit 2; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
constraints="$here/sglang-cpu-constraints.txt"
pip="$venv/bin/pip"
stamp="$venv/.sglang-cpu"

if [[ ! -x $pip ]]; then
    echo "$0: $venv is not a virtual environment (no bin/pip); run 'make venv' first" >&2
    exit 2
fi
# SGLang hashes KV pages with a C++ extension that torch compiles on first use (step 5): it
# needs a C++ compiler and OpenSSL's headers (Debian: g++, libssl-dev).
for need in g++:g++ /usr/include/openssl/sha.h:libssl-dev; do
    if ! command -v "${need%%:*}" >/dev/null 2>&1 && [[ ! -e ${need%%:*} ]]; then
        echo "$0: ${need%%:*} not found; install the Debian package ${need#*:}" >&2
        exit 2
    fi
done
want=$(cat "${BASH_SOURCE[0]}" "$constraints" | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi

# `--no-warn-conflicts` below only silences pip's list of the sglang requirements left out on
# purpose (CUDA kernels, its exact tokenizers pin); a real resolution error still fails the step.

# 1. torch. PyPI has only the CUDA build for Linux x86-64 (no "+cpu" wheel is reachable); it
#    imports and runs on a CPU once its nvidia-* libraries are installed, because libtorch_cuda.so
#    links them even when no GPU is used. 2.14.1 is the version sglang 0.5.23 pins, and the one
#    its bundled Rust radix-tree core (built against libtorch) supports.
"$pip" install --quiet --no-warn-conflicts -c "$constraints" torch

# 2. SGLang without its dependencies: plain `pip install sglang` resolves the CUDA 13 kernels
#    (flashinfer, sglang-kernel, deep-ep, cutlass-dsl, ...), several gigabytes that cannot load
#    without a GPU driver.
"$pip" install --quiet --no-deps -c "$constraints" sglang

# 3. What `import sglang.srt.managers.scheduler`, `sglang.srt.server_args`,
#    `sglang.srt.entrypoints.http_server` and the mem_cache / disaggregation modules need at import
#    time, and no more. torchvision is the real one built for torch 2.14 (its CPU operators work
#    without a GPU). The constraints keep the project's grpcio/protobuf where they are and make a
#    requirement on a CUDA kernel package fail instead of resolving.
"$pip" install --quiet --no-warn-conflicts -c "$constraints" \
    torchvision transformers huggingface_hub sentencepiece apache-tvm-ffi \
    msgspec pyzmq pydantic fastapi uvicorn python-multipart orjson psutil requests aiohttp \
    uvloop setproctitle prometheus-client pybase64 packaging pillow tqdm IPython dill gguf \
    openai partial_json_parser xxhash zstandard einops loguru jsonschema rpds-py soundfile cffi \
    ninja

# 4. Imported by sglang's constrained-decoding and quantization modules; their own requirements
#    name torch or CUDA packages we do not want resolved again, so they go in without them.
"$pip" install --quiet --no-deps --no-warn-conflicts -c "$constraints" xgrammar compressed-tensors

# 5. Check that the parts the tests use import, and build SGLang's page-hash extension
#    (mem_cache/cpp_utils/hash_binding.cpp, which every radix-cache insert needs; torch compiles
#    it with ninja, g++ and libssl's headers on first use) into VENV_DIR/torch-extensions, where
#    tests/sglang_support.py points TORCH_EXTENSIONS_DIR, so no test pays the ~30 s compile.
mkdir -p "$venv/torch-extensions"
PATH="$venv/bin:$PATH" TORCH_EXTENSIONS_DIR="$venv/torch-extensions" \
    "$venv/bin/python" -W ignore - <<'PY'
import importlib

for name in (
    "sglang.srt.server_args",
    "sglang.srt.managers.scheduler",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.disaggregation.role_switch",
    "sglang.srt.disaggregation.kv_events",
    "sglang.srt.mem_cache.radix_cache",
    "sglang.srt.mem_cache.unified_radix_cache",
    "sglang.launch_server",
):
    importlib.import_module(name)

from sglang.srt.mem_cache.utils import get_hash_str

assert len(get_hash_str([1, 2, 3, 4, 5, 6, 7, 8], page_size=4)) == 2
PY

echo "$want" >"$stamp"
