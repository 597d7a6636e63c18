"""The second-language example: clients/examples/node/client.js (@grpc/grpc-js) against real servers.

Skips only when node or npm is missing. Installs the example's two npm packages (about 10 s) when
``node_modules`` is absent.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.service.helpers import in_process_tokens

EXAMPLE = Path(__file__).resolve().parents[2] / "clients" / "examples" / "node"


@pytest.mark.skipif(
    shutil.which("node") is None or shutil.which("npm") is None, reason="node/npm not installed"
)
def test_node_client_round_trip(engine, prefix_factory) -> None:
    if not (EXAMPLE / "node_modules" / "@grpc" / "grpc-js").is_dir():
        subprocess.run(
            ["npm", "ci", "--no-audit", "--no-fund"],
            cwd=EXAMPLE,
            check=True,
            timeout=180,
            capture_output=True,
        )
    prefix = prefix_factory(engine.address)
    run = subprocess.run(
        ["node", "client.js", engine.address, prefix.address, "Hello, node!"],
        cwd=EXAMPLE,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    info, *rounds = (json.loads(line) for line in run.stdout.splitlines())
    assert info["instance_id"] and info["model"].startswith("tiny")
    prompt = [1, *map(ord, "Hello, node!")]
    expected = in_process_tokens(prompt, 8)
    assert [(r["reused"], r["prompt"], r["tokens"], r["finish"]) for r in rounds] == [
        (0, len(prompt), expected, "length"),
        (len(prompt) - 1, len(prompt), expected, "length"),
    ]
