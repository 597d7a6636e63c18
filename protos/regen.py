"""Regenerate the committed Python code for the protos: ``python -m protos.regen [--out DIR]``.

Runs ``grpc_tools.protoc`` on every ``*.proto`` in this folder and writes ``*_pb2.py``,
``*_pb2_grpc.py`` and ``*_pb2.pyi`` next to them (or into ``--out``). protoc emits top-level imports
(``import engine_pb2``); they are rewritten to package-relative ``from protos import engine_pb2`` so
the code works as part of the ``protos`` package. ``tests/test_protos_current.py`` regenerates into a
temporary folder and fails on any difference from the committed files.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    return sorted(PROTO_DIR.glob("*.proto"))


def generated_names() -> list[str]:
    """File names the protos generate (relative to the protos folder)."""
    return [p.stem + suffix for p in proto_files() for suffix in GENERATED_SUFFIXES]


def _fix_imports(text: str, modules: set[str]) -> str:
    """``import engine_pb2 as engine__pb2`` -> ``from protos import engine_pb2 as engine__pb2``."""

    def repl(match: re.Match[str]) -> str:
        name = match.group(2)
        return (
            f"{match.group(1)}from protos import {name}{match.group(3)}"
            if name in modules
            else match.group(0)
        )

    return re.sub(r"^(\s*)import (\w+_pb2)(\b.*)$", repl, text, flags=re.MULTILINE)


def regenerate(out_dir: Path) -> list[Path]:
    """Generate code for every proto into ``out_dir``; returns the files written."""
    from grpc_tools import protoc  # build-time tool: only needed here

    protos = proto_files()
    if not protos:
        raise FileNotFoundError(f"no .proto files in {PROTO_DIR}")
    include = Path(protoc.__file__).resolve().parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(p.name for p in protos),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        modules = {p.stem + "_pb2" for p in protos}
        written = []
        for name in generated_names():
            src = Path(tmp) / name
            target = out_dir / name
            target.write_text(_fix_imports(src.read_text(), modules))
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder (default: protos/)")
    args = parser.parse_args(argv)
    for path in regenerate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
