"""The SGLang 0.5.23 patch against SGLang's own code on CPU (see tests/sglang_support.py).

Role switch: a real `Scheduler` needs a model runner on a GPU, so the switch runs SGLang's real
`disaggregation/role_switch.py::teardown_disaggregation` (the caller of the replaced function)
on a `SimpleNamespace` holding the attributes it reads: real caches and real pools. The same
engine is switched once as upstream ships it and once patched, so the difference is the patch's.

HiCache's controller cannot be built here (its host pool pins memory with `cudaHostRegister`);
`HostTierStandIn` takes its place, holding a real `HiCacheFile` storage backend as the L3 and
running upstream's own `HybridCacheController.clear_storage_backend`.
"""

from __future__ import annotations

import importlib.metadata
import multiprocessing
import os
import pickle
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog
import zmq

from evolving_infra import block_hashes
from evolving_infra.engines.sglang import flags, patch
from sglang_support import (
    CACHE_KINDS,
    PAGE,
    Pools,
    cache,
    cached_len,
    insert,
    key,
    pools,
    sg,
    tiny_model_dir,
)

pytestmark = pytest.mark.sglang

A = list(range(1, 13))  # 3 pages
B = [*A[:8], 90, 91, 92, 93]  # shares A's first 2 pages, then its own third


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    """Every test starts and ends with upstream SGLang and no hints."""
    patch.revert()
    patch.BRANCH_COUNTS.clear()
    yield
    patch.revert()
    patch.BRANCH_COUNTS.clear()


class HostTierStandIn:
    """Stands in for `mem_cache/hybrid_cache/hybrid_cache_controller.py::HybridCacheController`
    (its host pool needs a GPU driver): the real L3 backend, and a count of host-pool clears."""

    enable_storage = True

    def __init__(self, storage: Any) -> None:
        self.storage_backend = storage
        self.host_pool_clears = 0
        self.mem_pool_host = SimpleNamespace(clear=self._clear_host_pool)
        controller = sg("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
        self.clear_storage_backend = types.MethodType(
            controller.HybridCacheController.clear_storage_backend, self
        )

    def _clear_host_pool(self) -> None:
        self.host_pool_clears += 1

    def reset(self) -> None:
        """Upstream drops its in-flight transfer queues here; there are none."""


@dataclass
class Engine:
    kind: str
    pools: Pools
    cache: Any
    scheduler: SimpleNamespace
    host: HostTierStandIn | None
    l3_dir: Path | None
    l3_keys: list[str]


def engine(kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """A prefill engine that served A and B: both are in its tree; with a unified cache, their
    pages are also in L3 (one `HiCacheFile` file per page, named by its block hash)."""
    p = pools()
    c = cache(kind, p)
    insert(c, p, A)
    insert(c, p, B)
    host, l3_dir, l3_keys = None, None, []
    if kind != "radix":
        monkeypatch.delenv("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", raising=False)
        l3_dir = tmp_path / "l3"
        storage_mod = sg("sglang.srt.mem_cache.hicache_storage")
        config = storage_mod.HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
            is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
            model_name="tiny", extra_config={"file_storage_path": str(l3_dir)},
        )  # fmt: skip
        storage = storage_mod.HiCacheFile(config)
        torch = sg("torch")
        l3_keys = [f"{h:x}" for h in {*block_hashes(A, PAGE), *block_hashes(B, PAGE)}]
        for k in l3_keys:
            assert storage.set(k, torch.zeros(8))
        host = HostTierStandIn(storage)
        # Where `UnifiedRadixCache.init_hicache` attaches a controller and its storage.
        c.cache_controller = host
        c._storage_attachment = sg(
            "sglang.srt.mem_cache.unified_cache.storage_attachment"
        ).StorageAttachment(c)
    role = sg("sglang.srt.disaggregation.utils").DisaggregationMode.PREFILL
    scheduler = SimpleNamespace(
        disaggregation_mode=role,
        disagg_prefill_bootstrap_queue=None,  # no KV manager: nothing to tear down on a CPU
        disagg_prefill_inflight_queue=[],
        disagg_metadata_buffers=None,
        req_to_metadata_buffer_idx_allocator=None,
        disable_radix_cache=False,
        server_args=SimpleNamespace(disaggregation_decode_enable_radix_cache=True),
        tree_cache=c,
        req_to_token_pool=p.req_to_token,
        token_to_kv_pool_allocator=p.allocator,
    )
    c.take_events()
    return Engine(kind, p, c, scheduler, host, l3_dir, l3_keys)


def switch(e: Engine) -> None:
    """SGLang's own teardown on a role switch (`role_switch.teardown_disaggregation`)."""
    sg("sglang.srt.disaggregation.role_switch").teardown_disaggregation(e.scheduler)


def l3_files(e: Engine) -> int:
    assert e.l3_dir is not None
    return sum(1 for f in e.l3_dir.iterdir() if f.suffix == ".bin")


def event_types(c: Any) -> list[str]:
    return [type(ev).__name__ for ev in c.take_events()]


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_upstream_switch_drops_every_tier(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the patch is for: upstream empties L1, the host pool and the shared L3 on a flip."""
    e = engine(kind, tmp_path, monkeypatch)
    assert cached_len(e.cache, A) == 12
    assert e.pools.allocator.available_size() == e.pools.capacity - 16
    switch(e)
    assert cached_len(e.cache, A) == 0
    assert cached_len(e.cache, B) == 0
    assert e.pools.allocator.available_size() == e.pools.capacity
    assert event_types(e.cache) == ["AllBlocksCleared"]
    if e.host is not None:
        assert e.host.host_pool_clears == 1
        assert l3_files(e) == 0


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_patched_switch_keeps_every_tier(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    e = engine(kind, tmp_path, monkeypatch)
    held_slots = set(insert(e.cache, e.pools, [7] * 8).tolist())  # a third prefix, C
    e.pools.req_to_token.free_slots.pop()  # a request row never given back
    free_before = e.pools.allocator.available_size()
    e.cache.take_events()
    patch.apply()
    switch(e)
    assert (cached_len(e.cache, A), cached_len(e.cache, B), cached_len(e.cache, [7] * 8)) == (
        12,
        12,
        8,
    )
    assert event_types(e.cache) == []  # the router's directory stays right without a word
    # The allocator still owns exactly the free slots: the new role cannot be handed C's slots.
    assert e.pools.allocator.available_size() == free_before
    fresh = e.pools.allocator.alloc(free_before)
    assert fresh is not None
    assert not held_slots & set(fresh.tolist())
    # Request rows are reclaimed as upstream does (no request is running at a switch).
    assert e.pools.req_to_token.available_size() == e.pools.req_to_token.size
    if e.host is not None:
        assert e.host.host_pool_clears == 0
        assert l3_files(e) == len(e.l3_keys)
        assert all(e.host.storage_backend.exists(k) for k in e.l3_keys)


@pytest.mark.parametrize("kind", CACHE_KINDS)
def test_locked_tree_falls_back_to_upstream(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node still locked (a request SGLang did not release) must not cross into the new role
    with its lock: the patch then drops the cache as upstream does, and says so."""
    e = engine(kind, tmp_path, monkeypatch)
    base = sg("sglang.srt.mem_cache.base_prefix_cache")
    match = e.cache.match_prefix(base.MatchPrefixParams(key=key(A)))
    e.cache.inc_lock_ref(match.last_device_node)
    assert fallback_reasons(e) == ["12 tokens still locked in the tree"]


def test_no_decode_radix_cache_falls_back_to_upstream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the decode radix flag, a decode engine never evicts from the tree it inherited."""
    e = engine("unified-rust", tmp_path, monkeypatch)
    e.scheduler.server_args.disaggregation_decode_enable_radix_cache = False
    assert fallback_reasons(e) == [
        "decode would never evict: no --disaggregation-decode-enable-radix-cache"
    ]


def fallback_reasons(e: Engine) -> list[str]:
    """Switches patched; checks the cache went as upstream's would; returns the warnings."""
    patch.apply()
    with structlog.testing.capture_logs() as logs:
        switch(e)
    assert cached_len(e.cache, B) == 0
    assert e.pools.allocator.available_size() == e.pools.capacity
    return [r["reason"] for r in logs if r["log_level"] == "warning"]


def test_refuses_another_sglang_version(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = sg("sglang.srt.managers.scheduler").Scheduler
    upstream = scheduler.ingest_requests
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.5.22")
    with pytest.raises(patch.SglangVersionError, match=r"sglang 0\.5\.22 is installed"):
        patch.apply()
    assert scheduler.ingest_requests is upstream  # nothing was replaced

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(patch.SglangVersionError, match=r"install-sglang-cpu\.sh"):
        patch.check_version()


# ------------------------------------------------------------------------------------------------
# Eviction hints


def send(endpoint: str, *messages: bytes) -> None:
    """What the sidecar does: PUSH to the scheduler's PULL."""
    push: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(endpoint)
        for m in messages:
            push.send(m)
    finally:
        push.close(linger=5000)  # delivered before the socket goes


def drain(receiver: patch.HintsReceiver, messages: int) -> None:
    deadline = time.monotonic() + 5
    got = 0
    while got < messages:
        assert time.monotonic() < deadline, "hints not delivered"
        got += receiver.poll()
        time.sleep(0.002)


SEQS = {
    name: [base + i for i in range(8)] for name, base in zip("ABCD", (10, 30, 50, 70), strict=True)
}


def evicted_after(c: Any, blocks: int) -> list[str]:
    """Evicts `blocks` pages' worth of tokens; names the sequences (2 pages each) now gone."""
    c.evict(sg("sglang.srt.mem_cache.base_prefix_cache").EvictParams(num_tokens=blocks * PAGE))
    return [n for n, s in SEQS.items() if cached_len(c, s) == 0]


@pytest.mark.parametrize("kind", ["radix", "unified-python"])
def test_live_branches_are_evicted_last(kind: str) -> None:
    """A and B are the oldest; LRU alone evicts them first. With A and B live, C and D go."""
    p = pools()
    c = cache(kind, p, eviction_policy="priority")
    for s in SEQS.values():  # inserted oldest first
        insert(c, p, s)
        time.sleep(0.001)  # RadixCache orders by time.monotonic()
    patch.apply()
    receiver = patch.HintsReceiver("tcp://127.0.0.1:*")
    try:
        # As the router hints: the tail of each live branch stands for its whole chain.
        tails = [block_hashes(SEQS[n], PAGE)[-1] for n in ("A", "B")]
        send(receiver.endpoint, patch.encode_hints(tails, [2, 1], replace=False))
        drain(receiver, 1)
        assert patch.BRANCH_COUNTS.refresh(c.root_node) >= 2  # A's and B's nodes, and parents
        assert evicted_after(c, 4) == ["C", "D"]
        # A replacing message: only A is live now, so B (older than nothing left) goes next.
        send(receiver.endpoint, patch.encode_hints(tails[:1], [1], replace=True))
        drain(receiver, 1)
        patch.BRANCH_COUNTS.refresh(c.root_node)
        assert patch.BRANCH_COUNTS.count(tails[1]) == 0
        assert evicted_after(c, 2) == ["B", "C", "D"]
    finally:
        receiver.close()


@pytest.mark.parametrize("kind", ["radix", "unified-python"])
def test_without_hints_priority_eviction_is_lru(kind: str) -> None:
    """The control for the test above: same cache, patched, no hints: oldest first."""
    p = pools()
    c = cache(kind, p, eviction_policy="priority")
    for s in SEQS.values():
        insert(c, p, s)
        time.sleep(0.001)
    patch.apply()
    assert evicted_after(c, 4) == ["A", "B"]


def test_bad_hints_are_counted_not_applied() -> None:
    receiver = patch.HintsReceiver("tcp://127.0.0.1:*")
    try:
        send(
            receiver.endpoint,
            b"\xc1",  # not msgpack
            patch.encode_hints([1, 2], [1], replace=False),  # lengths differ
            patch.encode_hints([2**63], [1], replace=False),  # not a signed 64-bit hash
            patch.encode_hints([5], [-1], replace=False),  # negative count
            patch.encode_hints([5], [3], replace=False),
        )
        drain(receiver, 1)
        assert (receiver.messages, receiver.rejected) == (1, 4)
        assert (patch.BRANCH_COUNTS.count(5), len(patch.BRANCH_COUNTS)) == (3, 1)
    finally:
        receiver.close()


def test_scheduler_polls_hints_each_iteration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wrapped `Scheduler.ingest_requests` binds $EVOLVING_INFRA_HINTS_ENDPOINT on first use
    and drains it on every call. Upstream's intake (which needs the tokenizer's sockets) is
    replaced by a recorder before the patch wraps it."""
    scheduler_cls = sg("sglang.srt.managers.scheduler").Scheduler
    calls: list[Any] = []

    def intake(self: Any) -> list[Any]:
        calls.append(self)
        return []

    monkeypatch.setattr(scheduler_cls, "ingest_requests", intake)
    endpoint = f"ipc://{tmp_path}/hints.sock"
    monkeypatch.setenv(patch.HINTS_ENDPOINT_ENV, endpoint)
    monkeypatch.delenv(patch.TREE_CORE_ENV, raising=False)
    patch.apply()
    assert os.environ[patch.TREE_CORE_ENV] == "python"  # the key is computed in Python only
    p = pools()
    tree = cache("radix", p)
    insert(tree, p, SEQS["A"])
    s = SimpleNamespace(tp_size=1, tree_cache=tree)
    assert scheduler_cls.ingest_requests(s) == []
    tail = block_hashes(SEQS["A"], PAGE)[-1]
    send(endpoint, patch.encode_hints([tail, 12], [1, 4], replace=True))
    deadline = time.monotonic() + 5
    while patch.BRANCH_COUNTS.count(12) != 4:
        assert time.monotonic() < deadline, "the scheduler loop never applied the hints"
        scheduler_cls.ingest_requests(s)
        time.sleep(0.002)
    assert calls[0] is s
    # ... and marked the scheduler's tree nodes the hinted chain runs through.
    [node] = tree.root_node.children.values()
    assert patch.BRANCH_COUNTS.node_is_live(node)


def test_hints_stay_off_with_tensor_parallelism(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler_cls = sg("sglang.srt.managers.scheduler").Scheduler
    monkeypatch.setattr(scheduler_cls, "ingest_requests", lambda self: None)
    monkeypatch.setenv(patch.HINTS_ENDPOINT_ENV, "tcp://127.0.0.1:*")
    patch.apply()
    with structlog.testing.capture_logs() as logs:
        scheduler_cls.ingest_requests(SimpleNamespace(tp_size=2))
    assert [r["event"] for r in logs] == ["eviction hints off: TP ranks would evict differently"]


# ------------------------------------------------------------------------------------------------
# Reaching the scheduler process


class Tripwire:
    """Server args that end the process at SGLang's first look at them (exit code 42)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)  # pickle's probes
        raise SystemExit(42)


def test_scheduler_target_applies_the_patch_in_a_spawned_process(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """SGLang spawns its schedulers; the target must travel by reference and patch the child
    before upstream `run_scheduler_process` runs (which then trips on the server args)."""
    target = patch.run_patched_scheduler_process
    assert pickle.loads(pickle.dumps(target)) is target
    proc = multiprocessing.get_context("spawn").Process(
        target=target, args=(Tripwire(), None, 0, 0, 0, None, None)
    )
    proc.start()
    proc.join(120)
    out, err = capfd.readouterr()
    assert proc.exitcode == 42, err
    assert "sglang patch applied" in out
    assert f"pid={proc.pid}" in out


def _launch_with_recorders(model_dir: str, out: Any) -> None:
    """Child of the test below: SGLang's real `run_server` with its process launcher replaced by
    a recorder; the findings go back through `out`.

    NOTE: `os._exit`, not a normal exit: after `run_server` has run, SGLang 0.5.23's native
    modules crash the interpreter's finalization (a segfault with no Python frame, in a C
    extension's static destructors), which would fail the test process for what SGLang does at
    exit, not for the patch. The child skips finalization once it has reported.
    """
    http_server = sg("sglang.srt.entrypoints.http_server")
    engine_cls = sg("sglang.srt.entrypoints.engine").Engine
    launched: list[tuple[Any, Any]] = []
    killed: list[int] = []
    http_server.launch_server = lambda args, run_scheduler_process_func=None: launched.append(
        (args, run_scheduler_process_func)
    )
    engine_cls.run_scheduler_process_func = None
    sg("sglang.srt.utils").kill_process_tree = lambda pid, **_: killed.append(pid)
    argv = [
        "--model-path", model_dir, "--device", "cpu",
        *flags.sglang_flags(phase="prefill", bootstrap_port=18998,
                            kv_events_endpoint="tcp://127.0.0.1:15557",
                            kv_replay_endpoint="tcp://127.0.0.1:15558", fpm_endpoint=None,
                            page_size=PAGE, hicache_mooncake=False),
    ]  # fmt: skip
    patch.launch_patched_server(argv)
    [(server_args, target)] = launched
    role_switch = sg("sglang.srt.disaggregation.role_switch")
    out.put(
        {
            "target": target is patch.run_patched_scheduler_process,
            "engine_target": engine_cls.run_scheduler_process_func
            is patch.run_patched_scheduler_process,
            "mode": server_args.disaggregation_mode,
            "page_size": server_args.page_size,
            "killed_self": killed == [os.getpid()],
            # The parent is patched too (it runs the tokenizer manager, not the scheduler).
            "parent_patched": role_switch._release_prefix_cache_for_role_switch
            is patch.keep_prefix_cache_for_role_switch,
        }
    )
    out.close()
    out.join_thread()
    os._exit(0)


def test_launch_patched_server_hands_sglang_the_patched_target(tmp_path: Path) -> None:
    """SGLang's real `launch_server.run_server` (argument parsing and validation included) up to
    the point where it would start the engine processes, in a child process (see
    `_launch_with_recorders` for why)."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(
        target=_launch_with_recorders, args=(tiny_model_dir(tmp_path / "model"), out)
    )
    proc.start()
    try:
        found = out.get(timeout=180)
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert found == {
        "target": True,
        "engine_target": True,
        "mode": "prefill",
        "page_size": PAGE,
        "killed_self": True,
        "parent_patched": True,
    }
