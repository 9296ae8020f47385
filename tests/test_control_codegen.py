"""The committed engine-control modules are what `proto/` generates, and the check notices edits.

Runs protoc (grpcio-tools) and the mypy-protobuf plugins, as `make proto` does; a failure of the
first test means someone edited `proto/` without regenerating (`make proto`).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from evolving_infra.control import codegen

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto"
PACKAGE = REPO / "python" / "evolving_infra" / "control" / "v1"


def test_committed_code_is_fresh(capsys: pytest.CaptureFixture[str]) -> None:
    assert codegen.main(["--check"]) == 0, capsys.readouterr().err


def test_check_names_stale_files_after_a_proto_edit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    proto = tmp_path / "proto"
    shutil.copytree(PROTO, proto)
    source = proto / codegen.PROTO_FILE
    text = source.read_text()
    edited = text.replace(
        "message HealthRequest {}", "message HealthRequest {\n  bool deep = 1;\n}"
    )
    assert edited != text
    source.write_text(edited)

    assert codegen.main(["--check", "--proto-dir", str(proto), "--package-dir", str(PACKAGE)]) == 1
    err = capsys.readouterr().err
    assert str(PACKAGE / "engine_pb2.py") in err
    assert str(PACKAGE / "engine_pb2.pyi") in err

    # Regenerating into a copy of the package makes the check pass there, and the generated
    # code imports from its real package (protoc's `evolving_infra.v1` rewritten).
    package = tmp_path / "v1"
    assert codegen.main(["--proto-dir", str(proto), "--package-dir", str(package)]) == 0
    assert codegen.stale_files(proto, package) == []
    grpc_module = (package / "engine_pb2_grpc.py").read_text()
    assert "from evolving_infra.control.v1 import engine_pb2" in grpc_module
    assert "'/evolving_infra.v1.EngineControl/Health'" in grpc_module  # wire name unchanged


def test_a_broken_proto_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proto = tmp_path / "proto"
    shutil.copytree(PROTO, proto)
    (proto / codegen.PROTO_FILE).write_text('syntax = "proto3";\nmessage {')
    assert codegen.main(["--check", "--proto-dir", str(proto)]) == 2
    assert "protoc failed" in capsys.readouterr().err
