"""Reading and writing trace files, plain or compressed (by suffix: `.gz`, `.xz`)."""

from __future__ import annotations

import gzip
import lzma
from pathlib import Path
from typing import IO

from evolving_infra.workloads.errors import TraceFormatError


def read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed; a corrupt archive raises `TraceFormatError`."""
    try:
        if path.name.endswith(".xz"):
            with lzma.open(path, "rb") as fx:
                return fx.read()
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as fg:
                return fg.read()
        return path.read_bytes()
    except (lzma.LZMAError, gzip.BadGzipFile, EOFError) as e:
        raise TraceFormatError(path, None, f"cannot decompress: {e}") from None


def open_text_for_writing(path: Path) -> IO[str]:
    """A text stream into `path`, compressed as its suffix says."""
    if path.name.endswith(".xz"):
        return lzma.open(path, "wt", encoding="utf-8")
    if path.name.endswith(".gz"):
        return gzip.open(path, "wt", encoding="utf-8")
    return path.open("w", encoding="utf-8")
