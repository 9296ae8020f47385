"""`evolving-infra trace`: statistics, validation, import and generation of workload traces."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from evolving_infra.argtypes import check_output_file, positive_int, positive_seconds
from evolving_infra.workloads import generators, jsonl, stats
from evolving_infra.workloads.claude_code import find_trace_files, load_conversation
from evolving_infra.workloads.errors import TraceFormatError
from evolving_infra.workloads.importers import claude_code_trace, mooncake_trace
from evolving_infra.workloads.model import Trace
from evolving_infra.workloads.sampling import load_pool, sample_agents

NAME = "trace"
HELP = "statistics, validation, import and generation of workload traces"
DESCRIPTION = """\
Workload traces: files of agents, their branches and their LLM requests.

  trace stats PATH...        requests, tokens, waits and h* (the ideal KV hit rate) per file
  trace validate PATH...     check files; prints OK or FILE:LINE: FIELD: REASON for each
  trace import claude-code   raw Claude Code traces (kv-cache-tester JSON) into one trace file
  trace import mooncake      a Mooncake FAST'25 JSONL trace into a trace file
  trace gen GENERATOR        a seeded synthetic trace (putnam, osworld, cc, shift)
  trace sample PATH...       N concurrent agents drawn from traces, each in its own namespace

PATH may be a trace file of our format (.jsonl, .jsonl.gz, .jsonl.xz), a raw Claude Code file
(.json, .json.gz, .json.xz), a Mooncake trace (.jsonl...), or a folder of such files (searched
recursively). `evolving-infra trace ACTION --help` describes each action.

--config FILE (before or after the action) reads option values from a TOML file whose keys are
option names (json, shared-prefix, agents, duration, seed); flags override it."""

_STATS_EPILOG = """\
h* (ideal_hit_rate): one infinite KV cache per file; a request hits its leading prompt blocks
that each appeared in an earlier request of the file. Claude Code files: requests in their
literal time order, raw hash_ids; other files: nominal replay order, directory block hashes.
P:D is prompt tokens / output tokens; uncached P:D leaves out the tokens h* would hit. Waits are
the seconds before a request (Claude Code: think_time). See evolving_infra.workloads.stats."""


def _trace_path(text: str) -> Path:
    path = Path(text)
    if not jsonl.is_trace_file(path):
        raise argparse.ArgumentTypeError(f"expected a name ending in {', '.join(jsonl.SUFFIXES)}")
    return path


class _Options:
    """Adds an action's options, each also known to the `trace` parser, hidden.

    cli.py reads --config against the `trace` parser and sets its defaults; an action's parser
    would overwrite them with its own defaults, so the action's options default to SUPPRESS and
    their real defaults live on the `trace` parser, where --config can change them.
    """

    def __init__(self, top: argparse.ArgumentParser) -> None:
        self.top = top
        self.known: set[str] = set()

    def add(
        self, parser: argparse.ArgumentParser, flag: str, default: Any, help: str, **kw: Any
    ) -> None:
        dest = flag.lstrip("-").replace("-", "_")
        if dest not in self.known:
            self.known.add(dest)
            self.top.add_argument(flag, default=default, help=argparse.SUPPRESS, **kw)
        parser.add_argument(flag, default=argparse.SUPPRESS, help=help, **kw)

    def config(self, parser: argparse.ArgumentParser) -> None:
        # Same dest as the --config cli.py adds to `trace`: given after the action, it still
        # reaches cli.main (SUPPRESS: when absent, it leaves the `trace` parser's value alone).
        parser.add_argument(
            "--config",
            type=Path,
            default=argparse.SUPPRESS,
            metavar="FILE",
            help="TOML file of options (flags override it)",
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    opts = _Options(parser)
    actions = parser.add_subparsers(dest="trace_action", metavar="ACTION", required=True)

    p = actions.add_parser(
        "stats",
        help="requests, tokens, waits and h* per file and in total",
        description="Statistics of trace files, one row per file and a total.",
        epilog=_STATS_EPILOG,
        formatter_class=fmt,
    )
    p.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or folders")
    opts.add(
        p, "--json", False, action="store_true", help='print one JSON object {"files", "total"}'
    )
    opts.config(p)

    p = actions.add_parser(
        "validate",
        help="check trace files; exit 1 if any is invalid",
        description="Reads and checks every file: prints OK or FILE:LINE: FIELD: REASON for each.",
    )
    p.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or folders")
    opts.config(p)

    p = actions.add_parser(
        "import",
        help="convert real traces into a trace file",
        description="Converts real traces (Claude Code, Mooncake) into one trace file.",
    )
    sources = p.add_subparsers(dest="source", metavar="SOURCE", required=True)
    q = sources.add_parser(
        "claude-code",
        help="raw Claude Code files (kv-cache-tester JSON): one agent per conversation",
        description="Raw Claude Code files, one conversation each, into one trace where every "
        "session starts at t = 0; sub-agents become subagent branches.",
    )
    q.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or folders")
    _output(q)
    opts.add(
        q,
        "--shared-prefix",
        False,
        action="store_true",
        help="model the first 15,000 tokens as one system prompt shared by every session",
    )
    opts.config(q)
    q = sources.add_parser(
        "mooncake",
        help="a Mooncake FAST'25 JSONL trace: one single-request agent per line",
        description="A Mooncake JSONL trace into a trace file: each line an agent arriving at "
        "its timestamp, 512-token blocks in one shared namespace.",
    )
    q.add_argument("path", type=Path, metavar="PATH", help="the Mooncake .jsonl[.gz|.xz] file")
    _output(q)
    opts.config(q)

    p = actions.add_parser(
        "gen",
        help="generate a seeded synthetic trace",
        description="N slots of back-to-back agent sessions of one generator, for a duration of "
        "nominal time; the same seed gives the same file.",
    )
    p.add_argument("generator", choices=sorted(generators.MODULES), help="the workload")
    for flag in ("--agents", "--duration", "--seed"):
        opts.add(p, flag, **_SLOT_OPTIONS[flag])
    _output(p)
    opts.config(p)

    p = actions.add_parser(
        "sample",
        help="N concurrent agents drawn from real or generated traces",
        description="N slots of back-to-back sessions drawn (with replacement) from the agents "
        "of the given traces (trace files, or raw Claude Code files and folders), each drawn "
        "session in its own block namespace, for a duration of nominal time.",
    )
    p.add_argument("paths", type=Path, nargs="+", metavar="PATH", help="files or folders")
    for flag in ("--agents", "--duration", "--seed"):
        opts.add(p, flag, **_SLOT_OPTIONS[flag])
    _output(p)
    opts.config(p)


_SLOT_OPTIONS: dict[str, dict[str, Any]] = {
    "--agents": {
        "default": 1,
        "type": positive_int,
        "metavar": "N",
        "help": "concurrent slots (default 1)",
    },
    "--duration": {
        "default": 600.0,
        "type": positive_seconds,
        "metavar": "S",
        "help": "nominal seconds after which no slot starts a session (default 600)",
    },
    "--seed": {"default": 0, "type": int, "metavar": "K", "help": "random seed (default 0)"},
}


def _output(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "-o",
        "--output",
        type=_trace_path,
        required=True,
        metavar="OUT",
        help="trace file to write (.jsonl, .jsonl.gz or .jsonl.xz)",
    )


def run(args: argparse.Namespace) -> int:
    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "stats": _stats,
        "validate": _validate,
        "import": _import,
        "gen": _gen,
        "sample": _sample,
    }
    output = getattr(args, "output", None)
    if output is not None:  # before the import or generation, not after it
        check_output_file(output, "--output")
    return handlers[args.trace_action](args)


@contextmanager
def _progress(label: str, total: int) -> Iterator[Callable[[], None]]:
    """A progress bar on stderr, only when it is a terminal; yields `advance`."""
    console = Console(stderr=True)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(label, total=total)
        yield lambda: progress.advance(task)


def _files(paths: Sequence[Path]) -> list[Path]:
    files = stats.find_files(paths)
    if not files:
        raise FileNotFoundError(f"no trace files in {', '.join(map(str, paths))}")
    return files


def _stats(args: argparse.Namespace) -> int:
    files = _files(args.paths)
    rows: list[dict[str, Any]] = []
    per_file: list[stats.Stats] = []
    with _progress("reading", len(files)) as advance:
        for path in files:
            s = stats.file_stats(path)
            per_file.append(s)
            rows.append({"path": str(path)} | s.to_dict())
            advance()
    result = {"files": rows, "total": stats.total(per_file).to_dict()}
    if args.json:
        sys.stdout.write(json.dumps(result) + "\n")
    else:
        # Piped, rich would wrap at 80 columns; the table needs about 120.
        console = Console()
        _render_stats(result, console if console.is_terminal else Console(width=160))
    return 0


def _render_stats(result: dict[str, Any], console: Console) -> None:
    rows = result["files"]
    table = Table(title=f"Trace statistics ({len(rows)} file{'s' * (len(rows) != 1)})")
    headers = ("file", "kind", "req", "sub", "fork", "cmp", "prompt", "output", "h*", "P:D")
    for col in (*headers, "unc P:D", "wait p50/90/99"):
        table.add_column(col, justify="left" if col in ("file", "kind") else "right")
    for row in [*rows, result["total"] | {"path": "total"}]:
        table.add_row(
            Path(row["path"]).name,
            row["kind"],
            f"{row['requests']:,}",
            f"{row['subagents']:,}",
            f"{row['forks']:,}",
            f"{row['compactions']:,}",
            _si(row["prompt_tokens"]),
            _si(row["output_tokens"]),
            f"{row['ideal_hit_rate']:.1%}" if row["prompt_blocks"] else "-",
            _ratio(row["prefill_decode_ratio"]),
            _ratio(row["uncached_prefill_decode_ratio"]),
            "/".join(_seconds(row[k]) for k in _WAITS),
            end_section=row is rows[-1],
        )
    console.print(table)
    console.print(
        "req: requests; sub/fork: sub-agent and fork branches; cmp: compactions; prompt/output:"
        " tokens; h*: ideal KV hit rate; P:D: prompt / output tokens; unc P:D: without the"
        " tokens h* hits; wait: seconds before a request (percentiles)."
    )


_WAITS = ("wait_p50", "wait_p90", "wait_p99")


def _si(n: int) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.3g}" if s < 100 else f"{s:,.0f}"


def _ratio(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.3g}"


def _validate(args: argparse.Namespace) -> int:
    files = _files(args.paths)
    bad = 0
    with _progress("validating", len(files)) as advance:
        for path in files:
            try:
                kind, requests = stats.validate_file(path)
            except (TraceFormatError, OSError) as e:
                bad += 1
                print(e if isinstance(e, TraceFormatError) else f"{path}: {e}")
            else:
                print(f"OK {path} ({kind}, {requests:,} requests)")
            advance()
    if bad:
        print(f"{bad} of {len(files)} files invalid", file=sys.stderr)
    return 1 if bad else 0


def _import(args: argparse.Namespace) -> int:
    if args.source == "claude-code":
        files = find_trace_files(args.paths)
        if not files:
            raise FileNotFoundError(f"no Claude Code files in {', '.join(map(str, args.paths))}")
        conversations = []
        first: dict[str, Path] = {}
        with _progress("reading", len(files)) as advance:
            for path in files:
                c = load_conversation(path)
                if c.id in first:
                    raise TraceFormatError(
                        path, "id", f"conversation {c.id!r} is also in {first[c.id]}"
                    )
                first[c.id] = path
                conversations.append(c)
                advance()
        trace = claude_code_trace(conversations, shared_prefix=args.shared_prefix)
    else:
        trace = mooncake_trace(args.path)
    _write(trace, args.output)
    return 0


def _gen(args: argparse.Namespace) -> int:
    plan = generators.SlotPlan(agents=args.agents, duration=args.duration, seed=args.seed)
    trace = generators.generate(args.generator, plan)
    _write(trace, args.output)
    return 0


def _sample(args: argparse.Namespace) -> int:
    plan = generators.SlotPlan(agents=args.agents, duration=args.duration, seed=args.seed)
    _write(sample_agents(load_pool(args.paths), plan), args.output)
    return 0


def _write(trace: Trace, path: Path) -> None:
    jsonl.save(trace, path)
    branches = sum(len(a.branches) for a in trace.agents)
    print(
        f"wrote {path}: {trace.name!r}, {len(trace.agents):,} agents, {branches:,} branches, "
        f"{trace.request_count:,} requests, {trace.block_size}-token blocks"
    )
