#!/usr/bin/env bash
# Install SGLang 0.5.23 into the virtual environment VENV_DIR so that its scheduler, radix caches,
# KV-event publisher and ServerArgs import and run on a CPU-only machine (tests of the SGLang
# patch, tests/test_sglang_*.py). It serves no model: that needs a GPU and SGLang's CUDA kernels.
#
#   scripts/install-sglang-cpu.sh .venv
#
# What goes in is pyproject.toml's: the `sglang` extra, then SGLang itself (the `sglang-gpu` extra's
# pin) without its requirements. Idempotent: a stamp in VENV_DIR records a hash of this script, its
# constraints file and pyproject.toml; a second run with all three unchanged does nothing.
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
# SGLang hashes KV pages with a C++ extension that torch compiles on first use (step 3): it
# needs a C++ compiler and OpenSSL's headers (Debian: g++, libssl-dev; `make` installs them).
for need in g++:g++ /usr/include/openssl/sha.h:libssl-dev; do
    if ! command -v "${need%%:*}" >/dev/null 2>&1 && [[ ! -e ${need%%:*} ]]; then
        echo "$0: ${need%%:*} not found; install the Debian package ${need#*:}" >&2
        exit 2
    fi
done
root=$(cd "$here/.." && pwd)
want=$(cat "${BASH_SOURCE[0]}" "$constraints" "$root/pyproject.toml" | sha256sum | cut -c1-16)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
    exit 0
fi

# The pin of SGLang itself: the `sglang-gpu` extra, what a GPU node installs with its requirements.
sglang=$("$venv/bin/python" - "$root/pyproject.toml" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as f:
    extras = tomllib.load(f)["project"]["optional-dependencies"]
(pin,) = extras["sglang-gpu"]
print(pin)
PY
)

# 1. The `sglang` extra, resolved together with the project's `dev` one so that neither moves the
#    other's versions: what SGLang's code imports on a CPU (pyproject.toml says which and why).
#    torch is PyPI's CUDA build (no "+cpu" wheel is reachable); it imports and runs on a CPU once
#    its nvidia-* libraries are installed, because libtorch_cuda.so links them even when no GPU is
#    used. The constraints file only forbids the CUDA kernel and media packages: a requirement that
#    names one fails the install instead of pulling gigabytes.
"$pip" install --quiet -c "$constraints" -e "$root[dev,sglang]"

# 2. SGLang without its requirements: they resolve the CUDA 13 kernels (flashinfer, sglang-kernel,
#    deep-ep, cutlass-dsl, ...), several gigabytes that cannot load without a GPU driver, and its
#    exact tokenizers pin. `--no-warn-conflicts` only silences pip's list of those left out.
"$pip" install --quiet --no-deps --no-warn-conflicts "$sglang"

# 3. Check that the parts the tests use import, and build SGLang's page-hash extension
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
