"""The in-process patch that makes SGLang 0.5.23 the symmetric engine (DESIGN §4).

`apply()` replaces, in the process that calls it, these upstream functions (paths under
`sglang/srt/` in 0.5.23); it refuses any other SGLang version (`SglangVersionError`):

1. `disaggregation/role_switch.py::_release_prefix_cache_for_role_switch`, which
   `teardown_disaggregation` calls on every `POST /pd_role_switch`. Upstream resets the radix tree
   (GPU L1; on a `UnifiedRadixCache` also the host L2 pool), frees every KV slot and calls
   `tree_cache.clear_storage_backend()`, which for Mooncake is `MooncakeStore.clear()` =
   `remove_all()`: one flip empties the shared pool of every node. The replacement keeps all three
   tiers (`keep_prefix_cache_for_role_switch`).
2. `mem_cache/evict_policy.py::PriorityStrategy.get_priority`, the eviction key of
   `--radix-eviction-policy priority` on `RadixCache` and on the Python tree core of
   `UnifiedRadixCache` (smallest key evicted first). Upstream: `(node.priority,
   node.last_access_time)`; ours puts a liveness bit in front, `(1 if a live agent branch needs the
   node else 0, node.priority, node.last_access_time)`: dead-branch blocks go first, then the rest,
   least recently used first within each (DESIGN §2, key `(1[R_b > 0], T_b)`). The Rust tree core
   (the default since 0.5.21) computes its keys natively, so with hints on `apply()` selects the
   Python core (`SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python`, an upstream switch).
3. `managers/scheduler.py::Scheduler.ingest_requests` (upstream: "the one place a new
   per-iteration input source belongs") is wrapped: after it, the `HintsReceiver` drains its socket
   without blocking, once per scheduler loop iteration, in every role.

SGLang starts its schedulers with `multiprocessing` "spawn" (`entrypoints/engine.py`), so patching
the parent is not enough: `launch_patched_server` hands SGLang `run_patched_scheduler_process` as
its `run_scheduler_process_func` (the parameter of `entrypoints/http_server.py::launch_server` and
`Engine.run_scheduler_process_func`, whose upstream default is
`managers/scheduler.py::run_scheduler_process`), a module-level function that a spawned child
unpickles by reference, applies the patch in, and then runs the original.

Eviction hints (the sidecar sends, `encode_hints`; the scheduler receives): ZMQ PUSH to a PULL
socket the scheduler binds at `$EVOLVING_INFRA_HINTS_ENDPOINT` (e.g. `ipc:///tmp/e0-hints`), one
msgpack map per message::

    {"v": 1, "hashes": [int64, ...], "counts": [int >= 0, ...], "replace": bool}

`counts[i]` is the number of live agent branches whose context holds block `hashes[i]` (SGLang's
page hash, as in its KV events; DESIGN §2). A block with count > 0 is live; `replace: true` means
the message lists every live block and any hash absent from it drops to 0. Without the variable
no socket is bound and eviction is upstream's. With `--tp-size` > 1 hints stay off: every TP rank
must evict the same blocks, and only one rank could bind the socket.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import msgpack
import structlog
import zmq

SGLANG_VERSION: Final = "0.5.23"
HINTS_ENDPOINT_ENV: Final = "EVOLVING_INFRA_HINTS_ENDPOINT"
TREE_CORE_ENV: Final = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"  # upstream environ.py
HINTS_VERSION: Final = 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

log = structlog.get_logger(__name__)


class SglangVersionError(RuntimeError):
    """The installed SGLang is not the version this patch was written against (or is missing)."""


class HintsMessageError(ValueError):
    """An eviction-hints message that does not follow the wire format."""


def check_version() -> None:
    """Raises `SglangVersionError` unless SGLang `SGLANG_VERSION` is installed."""
    try:
        found = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise SglangVersionError(
            f"sglang is not installed; the patch needs sglang=={SGLANG_VERSION} "
            "(on a CPU-only machine: scripts/install-sglang-cpu.sh VENV)"
        ) from None
    if found != SGLANG_VERSION:
        raise SglangVersionError(
            f"sglang {found} is installed, but the patch replaces functions of sglang "
            f"{SGLANG_VERSION} by name and would silently do the wrong thing on another version"
        )


def _sglang(module: str) -> Any:
    """An SGLang module, typed Any (SGLang ships no type information)."""
    return importlib.import_module(module)


# ------------------------------------------------------------------------------------------------
# Eviction hints


def encode_hints(hashes: Sequence[int], counts: Sequence[int], *, replace: bool) -> bytes:
    """One hints message (see the module docstring)."""
    message = {
        "v": HINTS_VERSION,
        "hashes": list(hashes),
        "counts": list(counts),
        "replace": replace,
    }
    packed: bytes = msgpack.packb(message)
    return packed


@dataclass(frozen=True, slots=True)
class Hints:
    hashes: list[int]
    counts: list[int]
    replace: bool


def decode_hints(payload: bytes) -> Hints:
    """Parses and validates one message; `HintsMessageError` says what is wrong with it."""
    try:
        msg = msgpack.unpackb(payload)
    except (ValueError, TypeError, msgpack.UnpackException) as err:
        raise HintsMessageError(f"not msgpack: {err}") from None
    if not isinstance(msg, dict) or msg.get("v") != HINTS_VERSION:
        raise HintsMessageError(f"not a version-{HINTS_VERSION} hints map")
    hashes, counts, replace = msg.get("hashes"), msg.get("counts"), msg.get("replace")
    if not isinstance(hashes, list) or not isinstance(counts, list) or len(hashes) != len(counts):
        raise HintsMessageError("hashes and counts must be lists of the same length")
    if not isinstance(replace, bool):
        raise HintsMessageError("replace must be a bool")
    # NOTE: bool is an int subclass; a true/false where a number belongs is a sender bug.
    if not all(type(h) is int and INT64_MIN <= h <= INT64_MAX for h in hashes):
        raise HintsMessageError("hashes must be signed 64-bit integers")
    if not all(type(c) is int and c >= 0 for c in counts):
        raise HintsMessageError("counts must be non-negative integers")
    return Hints(hashes, counts, replace)


def page_hash(hex_digest: str) -> int:
    """A page's block hash from its SHA-256 hex digest, as upstream
    `mem_cache/utils.py::hash_str_to_int64` (first 16 hex digits as a signed 64-bit int)."""
    value = int(hex_digest[:16], 16)
    return value - 2**64 if value > INT64_MAX else value


class BranchCounts:
    """The blocks live agent branches need, as last told by the router, and the tree nodes that
    hold them.

    The router hints the *tail* of each live branch (`router/daemon.py::_hints_loop`): a hinted
    block and every block before it on its chain are needed (DESIGN §2's `R_b > 0`). So a radix
    node is live when it is on the path from the root to a node holding a hinted page.
    `refresh(root)` finds those nodes in one pass over the tree, each time hints arrive (every
    few seconds), and keeps their ids; the eviction key then costs one set lookup. Nodes created
    since the last refresh (a split, a new insert) count as dead until the next one, which only
    lets them be evicted as upstream's LRU would. A node whose page hashes SGLang has not
    computed (KV events off) counts as dead.
    """

    __slots__ = ("_live", "_nodes")

    def __init__(self) -> None:
        self._live: dict[int, int] = {}  # hinted block hash -> count > 0
        self._nodes: set[int] = set()  # ids of the tree nodes on a path to a hinted block

    def update(self, hashes: Sequence[int], counts: Sequence[int], *, replace: bool) -> None:
        if replace:
            self._live = {h: c for h, c in zip(hashes, counts, strict=True) if c > 0}
            return
        for h, c in zip(hashes, counts, strict=True):
            if c > 0:
                self._live[h] = c
            else:
                self._live.pop(h, None)

    def refresh(self, root: Any) -> int:
        """Marks the nodes on the path from `root` to every node holding a hinted page; returns
        how many are live."""
        live: set[int] = set()
        if self._live:
            # The router's hashes are the first 16 hex digits of the page digests (`page_hash`).
            prefixes = {format(h & 0xFFFF_FFFF_FFFF_FFFF, "016x") for h in self._live}
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                pages = node.event_hash_value or node.hash_value
                if pages and any(p[:16] in prefixes for p in pages):
                    while node is not None and node is not root and id(node) not in live:
                        live.add(id(node))
                        node = node.parent
        self._nodes = live
        return len(live)

    def count(self, block_hash: int) -> int:
        return self._live.get(block_hash, 0)

    def node_is_live(self, node: Any) -> bool:
        return id(node) in self._nodes

    def clear(self) -> None:
        self._live = {}
        self._nodes = set()

    def __len__(self) -> int:
        return len(self._live)


BRANCH_COUNTS: Final = BranchCounts()  # what the patched eviction key reads, per process


class HintsReceiver:
    """The scheduler's end of the hints stream: a bound PULL socket drained by `poll()`."""

    def __init__(
        self,
        endpoint: str,
        counts: BranchCounts = BRANCH_COUNTS,
        *,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.counts = counts
        self.messages = 0
        self.rejected = 0
        self._sock: zmq.Socket[bytes] = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._sock.linger = 0
        self._sock.bind(endpoint)
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # with the real port

    def poll(self, limit: int = 64) -> int:
        """Applies up to `limit` waiting messages without blocking; returns how many applied."""
        applied = 0
        for _ in range(limit):
            try:
                payload = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                hints = decode_hints(payload)
            except HintsMessageError as err:
                # The scheduler must keep serving: a bad message is dropped, counted and logged.
                self.rejected += 1
                log.warning("eviction hints: message rejected", error=str(err))
                continue
            self.counts.update(hints.hashes, hints.counts, replace=hints.replace)
            self.messages += 1
            applied += 1
        return applied

    def close(self) -> None:
        self._sock.close(linger=0)


# ------------------------------------------------------------------------------------------------
# The replacements


def keep_prefix_cache_for_role_switch(scheduler: Any) -> None:
    """Replaces `disaggregation/role_switch.py::_release_prefix_cache_for_role_switch`.

    Keeps the radix tree (GPU L1), the host L2 pool and the storage backend across the flip. This
    is safe because the token KV pool is role-independent and never reallocated (upstream's own
    role_switch.py docstring): a tree node's KV slots mean the same in the new role. What upstream
    frees is either tree-owned (kept on purpose) or, on an idle engine, already free:
    - request rows: `handle_pd_role_switch` switches only when `is_fully_idle()`, so no request
      holds a row; `req_to_token_pool.clear()` still runs, it only reclaims rows leaked by a
      request, and the tree never points at rows;
    - KV slots: the allocator keeps its free lists, since freeing the tree's slots while the tree
      still points at them would hand the same slots to two owners;
    - in-flight HiCache copies: `is_fully_idle()` already waits for write-through, load-back,
      prefetch and backup to finish, and both roles' loops run `check_hicache_events`.
    Upstream's full release runs instead, with a warning, when locked nodes or streaming sessions
    still own KV (they would carry over into the new role), or without
    `--disaggregation-decode-enable-radix-cache` (the decode role evicts from the tree only with
    it, `DecodePreallocQueue`, so a kept tree would starve it).
    """
    if scheduler.disable_radix_cache:
        return  # upstream returns here too: a disabled cache holds nothing
    tree = scheduler.tree_cache
    reason = _why_not_keep(scheduler, tree)
    if reason is not None:
        log.warning("pd role switch: prefix cache dropped as upstream does", reason=reason)
        _UPSTREAM["release"].upstream(scheduler)
        return
    scheduler.req_to_token_pool.clear()
    log.info("pd role switch: prefix cache kept", evictable_tokens=tree.evictable_size())


def _why_not_keep(scheduler: Any, tree: Any) -> str | None:
    if tree is None:
        return "no tree cache"
    if not scheduler.server_args.disaggregation_decode_enable_radix_cache:
        return "decode would never evict: no --disaggregation-decode-enable-radix-cache"
    locked = sum(
        getattr(tree, size)()
        for size in ("protected_size", "swa_protected_size", "mamba_protected_size")
        if hasattr(tree, size)
    )
    if locked:
        return f"{locked} tokens still locked in the tree"
    if any(kv.holds_kv for kv in tree.session_records().values()):
        return "a streaming session still owns KV"
    return None


def _priority_with_live_branches(self: Any, node: Any) -> tuple[int, int, float]:
    """Replaces `mem_cache/evict_policy.py::PriorityStrategy.get_priority` (see the module doc)."""
    return (int(BRANCH_COUNTS.node_is_live(node)), node.priority, node.last_access_time)


_receiver: HintsReceiver | None = None
_receiver_checked = False


def _ingest_requests_then_hints(self: Any, *args: Any, **kwargs: Any) -> Any:
    """Wraps `managers/scheduler.py::Scheduler.ingest_requests`; polls the hints after it."""
    result = _UPSTREAM["ingest_requests"].upstream(self, *args, **kwargs)
    receiver = _receiver if _receiver_checked else _start_receiver(self)
    if receiver is not None and receiver.poll():
        receiver.counts.refresh(self.tree_cache.root_node)
    return result


def _start_receiver(scheduler: Any) -> HintsReceiver | None:
    global _receiver, _receiver_checked
    _receiver_checked = True
    endpoint = os.environ.get(HINTS_ENDPOINT_ENV)
    if not endpoint:
        return None
    if scheduler.tp_size > 1:
        log.warning("eviction hints off: TP ranks would evict differently", tp=scheduler.tp_size)
        return None
    try:
        _receiver = HintsReceiver(endpoint)
    except zmq.ZMQError as err:
        # Serving without hints (upstream order) beats an engine that does not start.
        log.error("eviction hints off: cannot bind", endpoint=endpoint, error=str(err))
        return None
    log.info("eviction hints: listening", endpoint=_receiver.endpoint)
    return _receiver


# ------------------------------------------------------------------------------------------------
# Applying


class _Replaced(NamedTuple):
    owner: Any  # module or class
    name: str
    upstream: Callable[..., Any]


_UPSTREAM: dict[str, _Replaced] = {}  # what apply() replaced, for the fallbacks and revert()


def apply() -> None:
    """Installs the replacements in this process (idempotent); see the module docstring."""
    check_version()
    if _UPSTREAM:
        return
    replacements = {
        "release": (
            _sglang("sglang.srt.disaggregation.role_switch"),
            "_release_prefix_cache_for_role_switch",
            keep_prefix_cache_for_role_switch,
        ),
        "get_priority": (
            _sglang("sglang.srt.mem_cache.evict_policy").PriorityStrategy,
            "get_priority",
            _priority_with_live_branches,
        ),
        "ingest_requests": (
            _sglang("sglang.srt.managers.scheduler").Scheduler,
            "ingest_requests",
            _ingest_requests_then_hints,
        ),
    }
    for key, (owner, name, ours) in replacements.items():
        _UPSTREAM[key] = _Replaced(owner, name, getattr(owner, name))
        setattr(owner, name, ours)
    if os.environ.get(HINTS_ENDPOINT_ENV) and os.environ.get(TREE_CORE_ENV) != "python":
        # Set before any cache is built; spawned schedulers inherit it.
        os.environ[TREE_CORE_ENV] = "python"
        log.info("eviction hints on: SGLang's Python radix tree core selected")
    log.info("sglang patch applied", version=SGLANG_VERSION, pid=os.getpid())


def revert() -> None:
    """Puts the upstream functions back (for tests); the hints receiver, if any, is closed."""
    global _receiver, _receiver_checked
    for owner, name, upstream in _UPSTREAM.values():
        setattr(owner, name, upstream)
    _UPSTREAM.clear()
    if _receiver is not None:
        _receiver.close()
    _receiver, _receiver_checked = None, False


def run_patched_scheduler_process(*args: Any, **kwargs: Any) -> Any:
    """The scheduler process target: applies the patch in this (spawned) process, then runs
    upstream `managers/scheduler.py::run_scheduler_process` with the same arguments."""
    apply()
    return _sglang("sglang.srt.managers.scheduler").run_scheduler_process(*args, **kwargs)


def launch_patched_server(argv: list[str]) -> None:
    """Runs SGLang's server as `python -m sglang.launch_server ARGV` would, with the patch applied
    here and in every scheduler process it starts. Blocks until the server exits."""
    apply()
    http_server = _sglang("sglang.srt.entrypoints.http_server")
    if not isinstance(http_server.launch_server, functools.partial):
        # run_server looks launch_server up at call time; its default scheduler target was bound
        # when the module was imported, so it is passed explicitly.
        http_server.launch_server = functools.partial(
            http_server.launch_server, run_scheduler_process_func=run_patched_scheduler_process
        )
    # The Engine path (gRPC mode, data-parallel controller) reads the class attribute.
    _sglang("sglang.srt.entrypoints.engine").Engine.run_scheduler_process_func = staticmethod(
        run_patched_scheduler_process
    )
    _sglang("sglang.srt.plugins").load_plugins()  # as sglang.launch_server's __main__
    server_args = _sglang("sglang.srt.server_args").prepare_server_args(list(argv))
    try:
        _sglang("sglang.launch_server").run_server(server_args)
    finally:
        _sglang("sglang.srt.utils").kill_process_tree(os.getpid(), include_parent=False)
