"""`RouterConfig`: the router daemon's options, from flags and a TOML file.

`add_arguments(parser)` declares every option with its help; the CLI's shared `--config FILE`
(cli.py) reads a TOML file whose keys are the option names (`page-size = 16`, `engines = [...]`)
and flags override it. `RouterConfig.from_args(args)` then checks what argparse cannot (at least
one engine, distinct addresses) and builds the frozen record the daemon runs from.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from evolving_infra.argtypes import natural_int, port, positive_int, positive_seconds, secret
from evolving_infra.control.server import CONTROL_API_KEY_ENV
from evolving_infra.logs import Level
from evolving_infra.planner import options
from evolving_infra.planner.options import Option
from evolving_infra.router.auth import ADMIN_API_KEY_ENV, API_KEY_ENV, ApiKeys
from evolving_infra.router.replicas import DEFAULT_TTL_S as DEFAULT_LEASE_TTL
from evolving_infra.router.turns import DEFAULT_BUDGET_MIB

HELP = "run the router daemon: OpenAI-compatible front end, branch API, dispatch to engines"
DESCRIPTION = """\
Serves the OpenAI API (/v1/chat/completions, /v1/completions with SSE streaming, /v1/models) in
front of the engines given with --engines (their control services), and the agent branch API:
the headers X-Agent-Branch, X-Agent-Parent-Branch and X-Agent-Event (fork|compaction|end), or
the same in a body field "agent": {"branch", "parent", "event"}; POST /v1/branches/{id}/end ends
a branch. Without them, the session headers harnesses already send name the branch: Dynamo's
X-Dynamo-Session-ID (and -Parent-Session-ID, -Session-Final), Claude Code's
X-Claude-Code-Session-Id / -Agent-Id, Codex's Session-Id, OpenCode's X-Session-Id.
Also /health and /metrics (Prometheus, evolving_* series). Logs are JSON lines on stderr.

Prompts are tokenized with --tokenizer (a Hugging Face tokenizer.json) or, without one, as UTF-8
bytes (one token per byte), then hashed in pages of --page-size tokens for the KV directory."""

DEFAULT_PORT = 8000
DEFAULT_PAGE_SIZE = 16
DEFAULT_MAX_BODY_MIB = 32  # an agent's whole context in JSON: 200k tokens are ~1 MiB of text
DEFAULT_BRANCH_TTL = 3600.0
DEFAULT_PLANNER_INTERVAL = 60.0
# The longest a request waits for decode room before a 429: a minute is what an agent harness
# waits on a slow turn without giving up; longer, and a client learns of overload too late.
DEFAULT_MAX_QUEUE_WAIT = 60.0
# A request survives this many decode engines dying under it (`PdDispatcher`'s migration).
# Dynamo's frontend ships --migration-limit 0 (off); here one, so that a crashed engine fails
# none of the streams it carried (the soak's engine kill).
DEFAULT_MIGRATION_LIMIT = 1
# A stopping router lets the requests it took finish this long (the drain, `server.Serving`):
# the longest wait for decode room plus a long turn, so that a restart fails none of them; a
# second Ctrl-C cuts them at once.
DEFAULT_SHUTDOWN_TIMEOUT = DEFAULT_MAX_QUEUE_WAIT + 30.0
LOG_LEVELS: tuple[Level, ...] = ("debug", "info", "warning", "error")


class RouterConfigError(ValueError):
    """Options that do not make a runnable router; the message names the option."""


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine, by the address of its `EngineControl` gRPC service: the router learns
    everything else (node id, phase, data URL, event endpoints, capacities) from `GetInfo`."""

    address: str  # HOST:PORT

    def __str__(self) -> str:
        return self.address


def redis_url(text: str) -> str:
    """A Redis URL (redis://host:port/db, rediss:// with TLS, unix:// a socket)."""
    scheme, sep, rest = text.partition("://")
    if not sep or scheme not in ("redis", "rediss", "unix") or not rest:
        raise argparse.ArgumentTypeError(
            f"expected a Redis URL such as redis://127.0.0.1:6379/0, got {text!r}"
        )
    return text


def engine_spec(text: str) -> EngineSpec:
    """`HOST:PORT` of an engine's control service."""
    host, sep, number = text.rpartition(":")
    if not sep or not host or "/" in text:
        raise argparse.ArgumentTypeError(
            f"engine must be the HOST:PORT of its control service, got {text!r}"
        )
    try:
        port(number)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"bad port in engine {text!r}") from None
    return EngineSpec(text)


@dataclass(frozen=True, slots=True)
class RouterConfig:
    engines: tuple[EngineSpec, ...] = ()
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    models: tuple[str, ...] = ()  # served model names; empty: any name is accepted
    tokenizer: Path | None = None  # None: the byte-level fallback
    page_size: int = DEFAULT_PAGE_SIZE
    max_body_bytes: int = DEFAULT_MAX_BODY_MIB * 2**20
    branch_ttl: float = DEFAULT_BRANCH_TTL
    turn_cache_bytes: int = DEFAULT_BUDGET_MIB * 2**20  # the branches' kept prompts (`turns`)
    log_level: Level = "info"
    planner: bool = True  # False: keep the engines' phases (the "no planner" ablation)
    admission: bool = True  # False: dispatch at once, as SGLang's gateway (`router.admission`)
    kv_pull: bool = True  # False: never move another node's cached prefix (`router.kvpull`)
    planner_interval: float = DEFAULT_PLANNER_INTERVAL
    # The evolving planner's other settings (`planner.options`; its interval is the one above).
    planner_options: tuple[Option, ...] = ()
    api_keys: ApiKeys = field(default_factory=ApiKeys)
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT
    control_api_key: str | None = None  # sent to the engines' EngineControl services
    max_queue_wait: float = DEFAULT_MAX_QUEUE_WAIT
    context_length: int | None = None  # None: the model's, when the router knows the model
    migration_limit: int = DEFAULT_MIGRATION_LIMIT  # broken decode streams a request survives
    # Router replicas: the coordination service's URL (redis://host:port/db; None: no
    # replicas, this router runs the planner), this replica's name (None: host:port) and the
    # leader lease's time to live.
    coordination: str | None = None
    replica: str | None = None
    lease_ttl: float = DEFAULT_LEASE_TTL

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterConfig:
        specs: list[EngineSpec] = list(args.engines or ())
        if not specs:
            raise RouterConfigError("engines: give at least one (--engines, or engines = [...])")
        addresses = [s.address for s in specs]
        if len(set(addresses)) != len(addresses):
            raise RouterConfigError(f"engines: addresses must be distinct, got {addresses}")
        return cls(
            engines=tuple(specs),
            host=args.host,
            port=args.port,
            models=tuple(args.model or ()),
            tokenizer=args.tokenizer,
            page_size=args.page_size,
            max_body_bytes=args.max_body_mib * 2**20,
            branch_ttl=args.branch_ttl,
            turn_cache_bytes=args.turn_cache_mib * 2**20,
            log_level=args.log_level,
            planner=not args.no_planner,
            admission=not args.no_admission,
            kv_pull=not args.no_kv_pull,
            planner_interval=args.planner_interval,
            planner_options=_planner_options(args.planner_option, len(specs)),
            shutdown_timeout=args.shutdown_timeout,
            max_queue_wait=args.max_queue_wait,
            context_length=args.context_length,
            migration_limit=args.migration_limit,
            coordination=args.coordination,
            replica=args.replica,
            lease_ttl=args.lease_ttl,
            control_api_key=secret(args.control_api_key, CONTROL_API_KEY_ENV),
            api_keys=ApiKeys(
                data=secret(args.api_key, API_KEY_ENV),
                admin=secret(args.admin_api_key, ADMIN_API_KEY_ENV),
                metrics_public=args.metrics_public,
            ),
        )

    @property
    def exposed_without_key(self) -> bool:
        """Listening beyond this machine with the API open: worth a warning at start."""
        return self.host not in ("127.0.0.1", "::1", "localhost") and self.api_keys.data is None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines",
        type=engine_spec,
        nargs="+",
        metavar="ENGINE",
        help="engines to dispatch to, each as the HOST:PORT of its EngineControl gRPC service"
        " (`evolving-infra engine --grpc-port`); node ids, phases, data URLs and KV event"
        " endpoints come from the engines themselves; required, here or in --config",
    )
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)"
    )
    parser.add_argument(
        "--port",
        type=port,
        default=DEFAULT_PORT,
        help=f"port (0: any free port; default: {DEFAULT_PORT})",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' (or X-API-Key) on /v1/*; prefer the"
        f" environment variable {API_KEY_ENV}, which `ps` does not show (default: open)",
    )
    parser.add_argument(
        "--admin-api-key",
        metavar="KEY",
        help="a separate key for operators' endpoints (/metrics); also from"
        f" {ADMIN_API_KEY_ENV} (default: the --api-key when one is set, else open). /health is"
        " always open, for load balancers",
    )
    parser.add_argument(
        "--metrics-public",
        action="store_true",
        help="leave /metrics open although --api-key is set (scrapers without credentials on a"
        " private network); an --admin-api-key still guards it",
    )
    parser.add_argument(
        "--model",
        nargs="+",
        metavar="NAME",
        help="served model names, listed by /v1/models; a request for another name is a 404"
        " (default: none listed, any name accepted)",
    )
    parser.add_argument(
        "--tokenizer",
        type=Path,
        metavar="FILE",
        help="Hugging Face tokenizer.json used to tokenize prompts (chat messages are rendered in"
        " a simple fixed format, not the model's template); default: UTF-8 bytes as token ids",
    )
    parser.add_argument(
        "--page-size",
        type=positive_int,
        default=DEFAULT_PAGE_SIZE,
        help="tokens per KV page; must equal the engines' --page-size, or block hashes will not"
        f" match the engines' KV events (default: {DEFAULT_PAGE_SIZE})",
    )
    parser.add_argument(
        "--max-body-mib",
        type=positive_int,
        default=DEFAULT_MAX_BODY_MIB,
        help=f"largest request body in MiB; larger is a 413 (default: {DEFAULT_MAX_BODY_MIB})",
    )
    parser.add_argument(
        "--branch-ttl",
        type=positive_seconds,
        default=DEFAULT_BRANCH_TTL,
        help="seconds after which a named branch with no request is ended, for harnesses that"
        f" never end their branches (default: {DEFAULT_BRANCH_TTL:g})",
    )
    parser.add_argument(
        "--coordination",
        metavar="URL",
        type=redis_url,
        help="router replicas: the Redis server they share (redis://host:port/db). The replica"
        " holding the leader lease runs the planner; every phase switch carries the lease's"
        " epoch, and engines refuse a deposed leader's (default: none, this router plans alone)",
    )
    parser.add_argument(
        "--replica",
        metavar="NAME",
        help="this replica's name among the routers sharing --coordination (default: host:port)",
    )
    parser.add_argument(
        "--lease-ttl",
        type=positive_seconds,
        default=DEFAULT_LEASE_TTL,
        help="seconds the leader lease lasts without renewal: a replica that dies hands the"
        f" planner over within this (default: {DEFAULT_LEASE_TTL:g})",
    )
    parser.add_argument(
        "--turn-cache-mib",
        type=natural_int,
        default=DEFAULT_BUDGET_MIB,
        help="MiB for each named branch's last prompt (token ids, page hashes, chat text: ~10"
        " bytes a token), so that its next turn is tokenized and hashed only where it adds to"
        " it; the least recently used branch goes first (0: tokenize every prompt whole;"
        f" default: {DEFAULT_BUDGET_MIB})",
    )
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default="info", help="least level logged (default: info)"
    )
    parser.add_argument(
        "--no-planner",
        action="store_true",
        help="never switch engine phases (the split stays as the engines started)",
    )
    parser.add_argument(
        "--no-admission",
        action="store_true",
        help="dispatch each request at once, as SGLang's gateway does, instead of holding it"
        " until a decode engine has room for its KV by the router's count (its prompt and"
        " max_tokens); the prefill engine then holds it while the decode engine is full",
    )
    parser.add_argument(
        "--no-kv-pull",
        action="store_true",
        help="never ask a prefill engine to pull a cached prefix another node holds (EngineControl"
        " TransferKV) before its prefill; it then computes what it does not hold itself or find"
        " in the pool",
    )
    parser.add_argument(
        "--migration-limit",
        type=natural_int,
        default=DEFAULT_MIGRATION_LIMIT,
        help="how many times a request whose decode engine breaks its stream mid-way (a crash)"
        " goes on on another decode engine, from the prompt and the tokens already streamed,"
        " the client's stream unbroken (Dynamo's --migration-limit); 0: it ends with an"
        f" engine_failed error event (default: {DEFAULT_MIGRATION_LIMIT})",
    )
    parser.add_argument(
        "--max-queue-wait",
        type=positive_seconds,
        default=DEFAULT_MAX_QUEUE_WAIT,
        metavar="S",
        help="the longest a request may wait for decode room: when the predicted wait (from how"
        " fast the decode engines free KV) is longer, or it has waited this long, it is refused"
        " at once with 429 and a Retry-After, before any engine saw it"
        f" (default: {DEFAULT_MAX_QUEUE_WAIT:g})",
    )
    parser.add_argument(
        "--context-length",
        type=positive_int,
        metavar="TOKENS",
        help="the most prompt and completion tokens one request may have; longer is a 400"
        " context_length_exceeded before dispatch (default: the served model's, when the"
        " engines name a model the router knows; the largest engine's KV bounds it too)",
    )
    parser.add_argument(
        "--control-api-key",
        metavar="KEY",
        help="the engines' EngineControl key (their --control-api-key), sent with every control"
        f" call; also from {CONTROL_API_KEY_ENV} (default: none)",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=positive_seconds,
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGINT/SIGTERM the router stops taking connections and gives the requests in"
        " flight (those waiting for decode room too) this many seconds to finish before it"
        f" cuts them; a second signal cuts them at once (default: {DEFAULT_SHUTDOWN_TIMEOUT:g})",
    )
    parser.add_argument(
        "--planner-interval",
        type=positive_seconds,
        default=DEFAULT_PLANNER_INTERVAL,
        help="seconds between phase-split decisions, each over the last 600 s in ten slices"
        f" (--planner-option window_s=..., slices=...) (default: {DEFAULT_PLANNER_INTERVAL:g})",
    )
    options.add_argument(parser, without={"interval": "use --planner-interval"})


def _planner_options(given: list[Option], engines: int) -> tuple[Option, ...]:
    """The planner options, refused here when the planner would refuse them (before any engine
    is dialled)."""
    try:
        options.settings(tuple(given), engines)
    except ValueError as e:
        raise RouterConfigError(f"planner-option: {e}") from None
    return tuple(given)
