"""mlx_run_llm_batched --snapshot_dir across separate processes (a tiny GGUF written by the test, so the
runs take about a second each): the second invocation reuses the first one's prompts from disk and
writes the same text; a damaged file is refused, removed and its prompt runs cold; another cache kind
neither loads nor removes the first configuration's files.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from clients.run_llm_batched import main
from engine_service.model.random_init import random_tensors, tiny_config
from tests.model.gguf_writer import write_gguf
from tests.model.test_cli import REUSE, ROOT
from tests.unit.model.test_loading import gguf_metadata, gguf_tensors

PROMPTS = ("abc def ghi jkl mno pqr", "stu vwx yz abc def")  # 18 and 14 positions: the window-4 rings wrap
LOADED = re.compile(r"^snapshots: loaded (\d+) from .*?\((\d+) positions\)(.*)$", re.M)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    write_gguf(str(path), gguf_metadata(), gguf_tensors(random_tensors(tiny_config("RR", 4), seed=7)))
    return str(path)


def run(model: str, folder, out, *extra: str) -> subprocess.CompletedProcess:
    argv = [
        "--model",
        model,
        "--weights_dtype",
        "float32",
        "--prefix_cache_entries",
        "2",
        "--snapshot_dir",
        str(folder),
        "--max_new_tokens",
        "6",
        "--prefill_chunk",
        "4",
        "--max_session_tokens",
        "128",
        "--out_prefix",
        str(out),
        *extra,
        *PROMPTS,
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "clients.run_llm_batched", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def reused(proc) -> list[tuple[int, int]]:
    return [(int(m.group(3)), int(m.group(4))) for m in map(REUSE.match, proc.stdout.splitlines()) if m]


def loaded(proc) -> tuple[int, str]:
    match = LOADED.search(proc.stdout)
    assert match, proc.stdout
    return int(match.group(1)), match.group(3)


@pytest.mark.parametrize("kind", ["batched-sequence", "batched-cell"])
def test_second_invocation_reuses_the_first_ones_prompts_from_disk(tiny_gguf, tmp_path, kind) -> None:
    folder = tmp_path / "snapshots"  # created by the first run
    first = run(tiny_gguf, folder, tmp_path / "a", "--cache_kind", kind)
    assert loaded(first) == (0, "") and all(r == 0 for r, _ in reused(first))
    assert len(list(folder.glob("*.safetensors"))) == 2
    second = run(tiny_gguf, folder, tmp_path / "b", "--cache_kind", kind)
    assert loaded(second)[0] == 2
    assert [(r, n) for r, n in reused(second)] == [(n - 1, n) for _, n in reused(first)]  # all but the last
    for i in range(2):
        text = (tmp_path / f"a_{i}.txt").read_text()
        assert text and text == (tmp_path / f"b_{i}.txt").read_text()


def test_a_damaged_file_is_refused_and_removed_and_another_kind_leaves_the_files_alone(
    tiny_gguf, tmp_path
) -> None:
    folder = tmp_path / "snapshots"
    first = run(tiny_gguf, folder, tmp_path / "a")
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 2
    other = run(tiny_gguf, folder, tmp_path / "o", "--cache_kind", "batched-cell")
    assert loaded(other)[0] == 0  # another configuration's files are not even read
    assert set(files) < set(folder.glob("*.safetensors"))  # and not removed; its own were added
    data = bytearray(files[0].read_bytes())
    data[-1] ^= 0x01
    files[0].write_bytes(bytes(data))
    again = run(tiny_gguf, folder, tmp_path / "b")
    count, note = loaded(again)
    assert count == 1 and "1 checksum" in note and "removed 1 corrupt" in note
    assert sorted(r == n - 1 for r, n in reused(again)) == [False, True]  # the damaged prompt ran cold
    for i in range(2):
        assert (tmp_path / f"a_{i}.txt").read_text() == (tmp_path / f"b_{i}.txt").read_text()
    assert (
        len([p for p in folder.glob("*.safetensors") if p.name[:16] == files[0].name[:16]]) == 2
    )  # re-saved
    assert reused(first) and loaded(first)[0] == 0


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--snapshot_dir", "d", "hi"], "--prefix_cache_entries"),
        (["--snapshot_dir", "d", "--prefix_cache_entries", "2", "--engine", "127.0.0.1:1", "hi"], "--engine"),
        (
            ["--snapshot_dir", ROOT + "/pyproject.toml", "--prefix_cache_entries", "2", "hi"],
            "not a directory",
        ),
    ],
)
def test_snapshot_dir_argument_errors(argv, flag, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --snapshot_dir") and flag in err[0]
