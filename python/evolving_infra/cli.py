"""The one `evolving-infra` entry point: one subcommand per part of the system.

A subcommand is a module with NAME, HELP, DESCRIPTION, `add_arguments(parser)` and
`run(args) -> int` (the `Command` protocol); add it to `COMMANDS`. Every subcommand also takes
`--config FILE`, a TOML file whose keys are its option names; flags override the file.

`main` is the one place that reports errors (`errors.py`): an error a user can fix is one line,
`evolving-infra CMD: error: ...`, with exit status 2; a bug is one line too, `internal error`,
with exit status 1 (EVOLVING_INFRA_DEBUG=1 shows its traceback); Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, Protocol

from evolving_infra import demo, errors, logs
from evolving_infra.cluster import command as cluster_command
from evolving_infra.engines.sim import command as engine_command
from evolving_infra.parity import command as parity_command
from evolving_infra.replay import command as replay_command
from evolving_infra.router import command as router_command
from evolving_infra.router import front_command
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
    front_command,
    cluster_command,
    replay_command,
    soak_command,
    parity_command,
)


class ConfigError(ValueError):
    """A --config file that cannot be used; the message names the file and the key."""


# Errors a user can fix, reported as one line with exit status 2 (CommandError: its own status).
USER_ERRORS: tuple[type[Exception], ...] = (
    errors.CommandError,
    ConfigError,
    TraceFormatError,
    TraceError,
    WorkloadError,
    TimingError,
    RouterConfigError,
    TokenizerLoadError,
    OSError,
)


class CliParser(argparse.ArgumentParser):
    """argparse, with its errors on one line like every other error of the CLI: a bad flag value
    is `evolving-infra CMD: error: argument --flag: WHY (see evolving-infra CMD --help)`, exit
    status 2; argparse itself prints the whole usage first, up to a dozen lines for `sim`.
    Subcommands' parsers (`add_subparsers`) are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {errors.one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = CliParser(
        prog="evolving-infra",
        description="Agent-adaptive control plane for prefill/decode disaggregated LLM serving.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parsers: dict[str, argparse.ArgumentParser] = {}
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
    except OSError as e:
        reason = (e.strerror or str(e)).lower()
        raise ConfigError(f"--config {path}: cannot read it: {reason}") from None
    actions = {a.dest: a for a in parser._actions if a.dest not in ("help", "config")}
    values: dict[str, Any] = {}
    for key, value in table.items():
        action = actions.get(key.replace("-", "_"))
        if action is None:
            known = ", ".join(sorted(a.replace("_", "-") for a in actions))
            raise ConfigError(f"{path}: {key}: unknown option (known: {known})")
        values[action.dest] = _convert(action, value, path, key)
    return values


_KINDS: dict[object, str] = {int: "an int", float: "a number"}


def _convert(action: argparse.Action, value: Any, path: Path, key: str) -> Any:
    def one(v: Any) -> Any:
        if isinstance(v, bool) or not isinstance(v, str | int | float):
            raise ConfigError(f"{path}: {key}: expected a string or number, got {v!r}")
        convert = action.type if callable(action.type) else str
        try:
            out = convert(str(v))
        except argparse.ArgumentTypeError as e:
            raise ConfigError(f"{path}: {key}: {e}") from None
        except (ValueError, TypeError) as e:
            reason = f"expected {_KINDS[convert]}, got {v!r}" if convert in _KINDS else str(e)
            raise ConfigError(f"{path}: {key}: {errors.one_line(reason)}") from None
        if action.choices is not None and out not in action.choices:
            known = ", ".join(map(str, action.choices))
            raise ConfigError(f"{path}: {key}: {v!r} is not one of {known}")
        # Relative paths in a config file are relative to the file, not to the working folder.
        return path.parent / out if isinstance(out, Path) else out

    if action.nargs == 0:  # a flag such as --json
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: {key}: expected true or false, got {value!r}")
        return value
    if action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
        # A repeatable flag (--planner-option) takes a list in the file, as many times.
        return [one(v) for v in (value if isinstance(value, list) else [value])]
    return one(value)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, parsers = build_parser()
    try:
        args = parser.parse_args(argv)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug in an option's type, say: argparse reports only its own
        return internal_error(argv[0] if argv else "", e)
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
    except KeyboardInterrupt:
        return 130
    except USER_ERRORS as e:
        return report(args.command, e)
    except Exception as e:
        return internal_error(args.command, e)


def internal_error(command: str, e: Exception) -> int:
    """A bug, not the user's doing: one line naming it (its traceback under EVOLVING_INFRA_DEBUG=1,
    which raises it again); exit status 1."""
    if errors.debugging():
        raise e
    prog = f"evolving-infra {command}".rstrip()
    with contextlib.suppress(OSError, ValueError):
        print(
            f"{prog}: internal error: {type(e).__name__}: {errors.message(e)}"
            f" (set {errors.DEBUG_ENV}=1 for the traceback)",
            file=sys.stderr,
        )
    return 1


def report(command: str, e: Exception) -> int:
    """Prints `e` as the CLI's error line (and its details, if any); returns the exit status."""
    lines = [f"evolving-infra {command}: error: {errors.message(e)}"]
    if isinstance(e, errors.CommandError):
        if e.details:
            lines.append(e.details)
        status = e.exit_status
    else:
        status = 2
    with contextlib.suppress(OSError, ValueError):  # stderr closed: the status still says it
        print("\n".join(lines), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
