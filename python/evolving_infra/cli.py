"""The one `evolving-infra` entry point: one subcommand per part of the system.

A subcommand is a module with NAME, HELP, DESCRIPTION, `add_arguments(parser)` and
`run(args) -> int` (the `Command` protocol); add it to `COMMANDS`. Every subcommand also takes
`--config FILE`, a TOML file whose keys are its option names; flags override the file.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from evolving_infra import demo, logs
from evolving_infra.cluster import command as cluster_command
from evolving_infra.engines.sim import command as engine_command
from evolving_infra.replay import command as replay_command
from evolving_infra.router import command as router_command
from evolving_infra.router.config import RouterConfigError
from evolving_infra.router.tokenize import TokenizerLoadError
from evolving_infra.sim import command as sim_command
from evolving_infra.sim import scenario_command
from evolving_infra.soak import command as soak_command
from evolving_infra.timing import TimingError
from evolving_infra.timing import command as model_command
from evolving_infra.workloads import TraceError, TraceFormatError
from evolving_infra.workloads import command as trace_command
from evolving_infra.workloads.errors import WorkloadError


class Command(Protocol):
    NAME: str
    HELP: str
    DESCRIPTION: str

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...
    def run(self, args: argparse.Namespace) -> int: ...


COMMANDS: tuple[Command, ...] = (
    demo,
    trace_command,
    model_command,
    sim_command,
    scenario_command,
    engine_command,
    router_command,
    cluster_command,
    replay_command,
    soak_command,
)


class ConfigError(ValueError):
    """A --config file that cannot be used; the message names the file and the key."""


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="evolving-infra",
        description="Agent-adaptive control plane for prefill/decode disaggregated LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers = {}
    for command in COMMANDS:
        p = sub.add_parser(
            command.NAME,
            help=command.HELP,
            description=command.DESCRIPTION,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(p)
        p.add_argument(
            "--config", type=Path, metavar="FILE", help="TOML file of options (flags override it)"
        )
        p.set_defaults(command_obj=command)
        parsers[command.NAME] = p
    return parser, parsers


def config_defaults(parser: argparse.ArgumentParser, path: Path) -> dict[str, Any]:
    """Option values from a TOML file, checked and converted as the parser would do for flags."""
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not TOML: {e}") from None
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    values: dict[str, Any] = {}
    for key, value in table.items():
        action = actions.get(key.replace("-", "_"))
        if action is None:
            known = ", ".join(sorted(a.replace("_", "-") for a in actions))
            raise ConfigError(f"{path}: {key}: unknown option (known: {known})")
        values[action.dest] = _convert(action, value, path, key)
    return values


def _convert(action: argparse.Action, value: Any, path: Path, key: str) -> Any:
    def one(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise ConfigError(f"{path}: {key}: expected a string or number, got {v!r}")
        convert = action.type if callable(action.type) else str
        try:
            out = convert(str(v))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            raise ConfigError(f"{path}: {key}: {e}") from None
        # Relative paths in a config file are relative to the file, not to the working folder.
        return path.parent / out if isinstance(out, Path) else out

    if action.nargs == 0:  # a flag such as --json
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("+", "*"):
        return [one(v) for v in (value if isinstance(value, list) else [value])]
    return one(value)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, parsers = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    sub = parsers[args.command]
    try:
        if args.config is not None:
            sub.set_defaults(**config_defaults(sub, args.config))
            args = parser.parse_args(argv)
        logs.configure()
        command: Command = args.command_obj
        return command.run(args)
    except (
        ConfigError,
        TraceFormatError,
        TraceError,
        WorkloadError,
        TimingError,
        RouterConfigError,
        TokenizerLoadError,
        OSError,
    ) as e:
        print(f"evolving-infra {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
