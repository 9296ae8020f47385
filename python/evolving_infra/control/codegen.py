"""Regenerate the engine-control gRPC code from `proto/`, or check that the committed copy is fresh.

    python -m evolving_infra.control.codegen            # rewrite python/evolving_infra/control/v1/
    python -m evolving_infra.control.codegen --check    # exit 1 naming stale files; changes nothing

The generated modules are committed so that users need neither protoc nor grpcio-tools; this
module is how they are made, with the pinned grpcio-tools (its protoc) and mypy-protobuf (the
`.pyi` stubs that make `mypy --strict` work for code using the messages). protoc names Python
modules after the proto package (`evolving_infra.v1`), while the code lives in
`evolving_infra.control.v1`: the module paths are rewritten after generation, the wire names
(`evolving_infra.v1.EngineControl`, the `.proto` file name in the descriptor) are not.
"""

from __future__ import annotations

import argparse
import filecmp
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

PROTO_FILE = "evolving_infra/v1/engine.proto"
GENERATED = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py", "engine_pb2_grpc.pyi")

_PACKAGE_DIR = Path(__file__).resolve().parent / "v1"
_REPO_PROTO_DIR = Path(__file__).resolve().parents[3] / "proto"

# Python module paths only: "evolving_infra.v1.engine_pb2", "from evolving_infra.v1 import" and
# the module's file path in grpc's version message. The proto package in RPC paths
# ("/evolving_infra.v1.EngineControl/...") and the descriptor's file name "…/engine.proto" differ
# from these patterns and stay as they are: they are the wire protocol.
_REWRITES = (
    (re.compile(r"\bevolving_infra\.v1\.engine_pb2\b"), "evolving_infra.control.v1.engine_pb2"),
    (re.compile(r"\bfrom evolving_infra\.v1 import\b"), "from evolving_infra.control.v1 import"),
    (re.compile(r"\bevolving_infra/v1/engine_pb2"), "evolving_infra/control/v1/engine_pb2"),
)


class CodegenError(RuntimeError):
    """protoc or one of its plugins failed, or an input is missing; the message says which."""


def _plugin(name: str) -> str:
    """The plugin executable installed next to this interpreter (mypy-protobuf's scripts)."""
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found = shutil.which(name, path=folder)
        if found:
            return found
    found = shutil.which(name)
    if found is None:
        raise CodegenError(f"{name} not found: install the dev requirements (mypy-protobuf)")
    return found


def generate(proto_dir: Path, out_dir: Path) -> list[Path]:
    """Generate the four modules from `proto_dir` into `out_dir` (created); returns their paths."""
    source = proto_dir / PROTO_FILE
    if not source.is_file():
        raise CodegenError(f"{source}: no such file (run from a checkout of the repository)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ei-protoc-") as raw_dir:
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
            f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
            f"--python_out={raw_dir}",
            f"--grpc_python_out={raw_dir}",
            f"--mypy_out={raw_dir}",
            f"--mypy_grpc_out={raw_dir}",
            PROTO_FILE,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise CodegenError(f"protoc failed ({done.returncode}):\n{done.stderr.strip()}")
        produced = Path(raw_dir) / Path(PROTO_FILE).parent
        paths = []
        for name in GENERATED:
            text = (produced / name).read_text()
            for pattern, replacement in _REWRITES:
                text = pattern.sub(replacement, text)
            target = out_dir / name
            target.write_text(text)
            paths.append(target)
    return paths


def stale_files(proto_dir: Path, package_dir: Path) -> list[str]:
    """Names of the generated files in `package_dir` that differ from a fresh generation."""
    with tempfile.TemporaryDirectory(prefix="ei-codegen-") as fresh:
        generate(proto_dir, Path(fresh))
        return [
            name
            for name in GENERATED
            if not (package_dir / name).is_file()
            or not filecmp.cmp(Path(fresh) / name, package_dir / name, shallow=False)
        ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m evolving_infra.control.codegen",
        description="Regenerate the engine-control gRPC modules from proto/.",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="generate into a temporary folder and exit 1 if the committed files differ",
    )
    parser.add_argument("--proto-dir", type=Path, default=_REPO_PROTO_DIR, help="proto root")
    parser.add_argument(
        "--package-dir", type=Path, default=_PACKAGE_DIR, help="where the generated modules live"
    )
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files(args.proto_dir, args.package_dir)
            if stale:
                names = ", ".join(str(args.package_dir / n) for n in stale)
                print(
                    f"stale generated code: {names}\n"
                    "  regenerate with `python -m evolving_infra.control.codegen` (`make proto`)",
                    file=sys.stderr,
                )
                return 1
            return 0
        for path in generate(args.proto_dir, args.package_dir):
            print(f"wrote {path}")
    except CodegenError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
