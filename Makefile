# evolving-infra: `make help` lists the targets. Everything runs from a virtual environment in
# .venv that the targets create and fill themselves, so a fresh machine needs only `make demo`
# and `make test`.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
NATIVE := $(VENV)/.native
SGLANG := $(VENV)/.sglang-cpu
# Checks (and as root installs) what the targets need outside .venv; one line and exit 2 if it
# cannot (scripts/system-deps.sh says what each level holds).
SYSTEM_DEPS := PYTHON=$(PYTHON) scripts/system-deps.sh

.DEFAULT_GOAL := help
.PHONY: help system-deps-build system-deps-test venv build demo demo-directory test test-rust \
	test-py lint proto fmt bench bench-rust bench-py bench-dynamo bench-peer soak parity sglang fuzz clean

help: ## list the targets
	@awk 'BEGIN {FS = ":.*## "} /^[a-z-]+:.*## / {printf "  make %-13s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

system-deps-build:
	@$(SYSTEM_DEPS) build

system-deps-test:
	@$(SYSTEM_DEPS) test

# Every Python dependency is in pyproject.toml; `dev` is a working copy's set (test, bench, the
# pool, lint and build tools). The editable install builds the extension once (release, as
# maturin's PEP 517 backend does); `build` rebuilds it in place after a change to the Rust code.
$(STAMP): pyproject.toml | system-deps-build
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e '.[dev]'
	touch $@

venv: $(STAMP) ## create .venv with the project and its `dev` extra (test, bench, pool, lint)

$(NATIVE): $(STAMP) Cargo.toml rust/kvdir/Cargo.toml rust/kvdir-py/Cargo.toml $(wildcard rust/*/src/*.rs)
	$(VENV)/bin/maturin develop --release --skip-install --quiet
	touch $@

build: $(NATIVE) ## build the Rust extension (release) into .venv

# SGLang 0.5.23's own code, for the tests of the SGLang backend (tests/test_sglang_*): the
# `sglang` extra and SGLang without its CUDA kernels (scripts/install-sglang-cpu.sh says how and
# why), ~3 GB to download, ~6 GB on disk.
$(SGLANG): $(STAMP) pyproject.toml scripts/install-sglang-cpu.sh scripts/sglang-cpu-constraints.txt | system-deps-test
	scripts/install-sglang-cpu.sh $(VENV)
	touch $@

sglang: $(SGLANG) ## install SGLang 0.5.23 (CPU) into .venv for the SGLang backend's tests

demo: build ## 36 simulated GPUs, the bundled Claude Code sessions: evolving vs dynamo, and the best static split on Dynamo's infrastructure and ours (~1 min)
	$(VENV)/bin/evolving-infra sim --trace data/traces/claude-code --gpus 36 --agents 40 \
		--duration 1800 --policies evolving,dynamo,best-dynamo-static,best-static --seed 0 \
		--out out/demo

demo-directory: build ## replay the bundled Claude Code traces into the KV directory alone; per-node hit rates
	$(VENV)/bin/evolving-infra demo

test: system-deps-test lint test-rust test-py ## everything CI runs: lint (clippy, stubtest, mypy, ruff), cargo tests, pytest

test-rust: system-deps-test ## cargo tests (unit, property, golden; Dynamo's indexers answer as ours)
	cargo test --workspace --exclude kvdir-py --all-targets
	cargo test -p kvdir-py --lib  # the bindings' Rust tests: their allocator, the request-body scanner
	cargo test $(PEER)

test-py: system-deps-test build $(SGLANG) ## pytest (the SGLang backend's tests included: `pytest -m sglang`)
	$(VENV)/bin/pytest -q

lint: system-deps-test build ## clippy, rustfmt --check, stubtest, mypy --strict, ruff
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy $(PEER) --all-targets -- -D warnings
	cargo fmt --all --check
	cargo fmt --manifest-path rust/peer-bench/Cargo.toml --check
	$(PY) -m mypy.stubtest evolving_infra._core --allowlist python/stubtest-allowlist.txt
	$(VENV)/bin/mypy
	$(VENV)/bin/mypy benches
	$(VENV)/bin/ruff check python tests benches
	$(VENV)/bin/ruff format --check python tests benches

proto: $(STAMP) ## regenerate the engine-control gRPC code from proto/ (commit the result)
	$(PY) python/evolving_infra/control/codegen.py

fmt: $(STAMP) ## format Rust and Python
	cargo fmt --all
	cargo fmt --manifest-path rust/peer-bench/Cargo.toml
	$(VENV)/bin/ruff format python tests benches
	$(VENV)/bin/ruff check --fix python tests benches

# Sized for a 2-core machine: the engines simulate H200s (a 500k-token Claude Code prompt fits
# one GPU's KV) 50x faster than real time, and think times run at the traces' own pace (speed
# 1): the cluster's CPU, not the simulated GPUs, is what 200 agents of ~100k-token prompts load.
# No shared pool: its PD hand-offs put every prompt block through the Mooncake store, which on
# 2 cores starves the rest (the pool's own faults are tested in tests/test_engine_pool.py).
# Six engines, so that two decode engines remain when one is killed; a host KV tier of 50,000
# pages per engine, which fills within the run (the default, 1 TiB per 8 GPUs, takes hours), so
# memory levels off where a long-running engine's would.
SOAK_ARGS ?= --agents 200 --duration 1800 --kill-engine-at 200 --restart-router-at 400 \
	--engines 6 --l2-blocks 50000 --speed 1 --time-scale 50 --gpu h200-sxm --no-pool \
	--request-timeout 120

soak: build ## 200 agents for 30 min on a loopback cluster, an engine killed, the router restarted (not in `make test`)
	mkdir -p out
	$(VENV)/bin/evolving-infra soak $(SOAK_ARGS) --log-dir out/soak-logs --json > out/soak.json
	$(PY) -m json.tool out/soak.json

PARITY_ARGS ?= --engines 4 --agents 16 --duration 120 --seed 1

parity: build ## one workload through the simulator and the live system (4 engines, 16 agents, 120 s), figures side by side (not in `make test`)
	$(VENV)/bin/evolving-infra parity $(PARITY_ARGS) --log-dir out/parity-logs --report out/parity.json

FUZZ_SECONDS ?= 60

fuzz: ## fuzz the SGLang event decoder and directory operations, FUZZ_SECONDS (60) s each (not in `make test`)
	command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
	rustup toolchain list | grep -q '^nightly' || rustup toolchain install nightly --profile minimal
	$(PYTHON) rust/kvdir/fuzz/build_corpus.py
	cd rust/kvdir && cargo +nightly fuzz run decode_events -- \
		-max_total_time=$(FUZZ_SECONDS) -dict=fuzz/decode_events.dict
	cd rust/kvdir && cargo +nightly fuzz run directory_ops -- \
		-max_total_time=$(FUZZ_SECONDS) -max_len=1024

bench: bench-rust bench-py bench-dynamo bench-peer ## all benchmarks (figures printed; nothing asserted on time)

bench-rust: ## criterion benchmarks of the core crate (1M blocks x 1,000 nodes)
	cargo bench -p kvdir --bench directory

bench-py: build ## pytest-benchmark of the Python API
	$(VENV)/bin/pytest benches -m bench --benchmark-only -p no:randomly

# The side-by-side crate is outside the workspace (Dynamo's crate and its tokio stack stay out of
# the workspace's lock and builds); it shares the workspace's target directory.
PEER = --manifest-path rust/peer-bench/Cargo.toml --target-dir target

bench-peer: ## natively, our directory against Dynamo's RadixTree, CRTC and PositionalIndexer (dynamo-kv-router 1.6.1); writes target/peer-bench.json
	PEER_BENCH_COMMIT=$$(git rev-parse --short HEAD 2>/dev/null) cargo bench $(PEER) --bench peer

bench-dynamo: build ## side by side with NVIDIA Dynamo's RadixTree (ai-dynamo-runtime 1.6.1, the `bench` extra)
	OPENBLAS_NUM_THREADS=1 $(PY) benches/compare_dynamo.py

clean: ## remove build outputs and .venv
	cargo clean
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
