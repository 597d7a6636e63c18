"""mlx_run_llm_batched: argument errors (fast, in-process) and two cached rounds on the real model (slow)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from clients.run_llm_batched import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REUSE = re.compile(
    r"^\[(\d+)\] prompt (\d+) positions, reused (\d+)/(\d+) prompt tokens, ttft .* finish (\w+)"
)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--top_p", "0", "hi"], "--top_p"),
        (["--top_p", "1.5", "hi"], "--top_p"),
        (["--max_new_tokens", "0", "hi"], "--max_new_tokens"),
        (["--prompt_rounds", "0", "hi"], "--prompt_rounds"),
        (["--prefix_cache_entries", "-1", "hi"], "--prefix_cache_entries"),
        (["--max_session_tokens", "0", "hi"], "--max_session_tokens"),
        (["--temperature", "-1", "hi"], "--temperature"),
        (["--top_k", "-3", "hi"], "--top_k"),
        (["--flush_every", "0", "hi"], "--flush_every"),
        (["--max_new_tokens", "4096", "--max_session_tokens", "2048", "hi"], "--max_session_tokens"),
        (["--cache_kind", "bogus", "hi"], "--cache_kind"),
        (["--max_new_tokens", "many", "hi"], "--max_new_tokens"),
        ([], "PROMPT"),
        (["--out_prefix", "/no/such/dir/gen", "hi"], "--out_prefix"),
        (["--model", "/no/such/model.gguf", "hi"], "/no/such/model.gguf"),
        # the services' GenerationConfig.seed is an int64: a larger seed cannot be sent
        (["--engine", "127.0.0.1:1", "--seed", str(2**63 - 1), "hi"], "--seed"),
    ],
)
def test_argument_errors_exit_2_with_one_line(argv, flag, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert flag.lower() in lines[0].lower() or flag.lstrip("-") in lines[0]
    assert captured.out == ""


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """A separate process: checks the exit status of a full run, exit-time teardown included."""
    return subprocess.run(
        [sys.executable, "-m", "clients.run_llm_batched", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_prompt_longer_than_the_session_exits_2(tmp_path):
    proc = run_cli(
        "--max_session_tokens",
        "20",
        "--max_new_tokens",
        "16",
        "--out_prefix",
        str(tmp_path / "g"),
        "a prompt that is long enough to need more than four tokens",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "max_session_tokens" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["batched-sequence", "batched-cell"])
def test_second_round_reuses_all_but_the_final_prompt_token(tmp_path, kind):
    out = tmp_path / "cached"
    proc = run_cli(
        "--prefix_cache_entries",
        "4",
        "--prompt_rounds",
        "2",
        "--temperature",
        "0",
        "--max_new_tokens",
        "16",
        "--cache_kind",
        kind,
        "--out_prefix",
        str(out),
        "--chat",
        "Write one sentence about the sea.",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [m for m in map(REUSE.match, proc.stdout.splitlines()) if m]
    assert [int(m.group(1)) for m in lines] == [0, 1]
    first, second = lines
    length = int(first.group(2))
    assert length > 2 and int(first.group(3)) == 0  # round one runs cold
    assert int(second.group(3)) == length - 1 and int(second.group(4)) == length
    assert "2/2 generations completed" in proc.stdout
    text0 = (tmp_path / "cached_0.txt").read_text()
    text1 = (tmp_path / "cached_1.txt").read_text()
    assert text0.strip(), "an empty output would make the comparison vacuous"
    assert text0 == text1


@pytest.mark.slow
def test_unwritable_output_file_is_one_line_exit_2(tmp_path, capsys):
    from clients.run_llm_batched import _main

    (tmp_path / "g_0.txt").mkdir()  # the first output path is taken by a directory
    assert _main(["--max_new_tokens", "2", "--out_prefix", str(tmp_path / "g"), "hi"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "g_0.txt" in lines[0], captured.err
