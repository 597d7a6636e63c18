"""The packaged SmolLM2-135M-Instruct behind both services: two gateway rounds (slow)."""

from __future__ import annotations

import pytest

from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from tests.service.conftest import real_model_services


@pytest.mark.slow
def test_two_gateway_rounds_on_the_real_model() -> None:
    with real_model_services(max_sessions=4) as (loaded, deps, prefix):
        client = PrefixClient(prefix.address, owner="slow")
        question = "What is the capital of France?"
        rounds = [
            client.generate(text=question, chat=True, config=GenConfig(max_new_tokens=16)).collect()
            for _ in range(2)
        ]
        prompt = loaded.tokenizer.encode(loaded.chat.format([{"role": "user", "content": question}]))
        assert [r.done.reused_positions for r in rounds] == [0, len(prompt) - 1]
        assert rounds[0].tokens == rounds[1].tokens
        # independent reference: the same runner driven in-process, no gRPC, no prefix cache
        with deps.runner.open_session() as session:
            config = GenConfig(max_new_tokens=16, stop_tokens=loaded.tokenizer.eos_token_ids)
            reference = session.generate_async(prompt, config).wait(120).tokens
        assert rounds[0].tokens == list(reference)
        assert "Paris" in rounds[0].text


@pytest.mark.slow
def test_demo_runs_both_service_processes_and_stops_them() -> None:
    """``python -m clients.demo``: real processes, free ports, SIGTERM drain (exit 0 from both)."""
    import re
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "clients.demo", "--max_new_tokens", "8"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    reuse = re.findall(r"round \d: reused (\d+)/(\d+) prompt tokens", run.stdout)
    assert [(int(a), int(b)) for a, b in reuse] == [
        (0, int(reuse[0][1])),
        (int(reuse[0][1]) - 1, int(reuse[0][1])),
    ]
    assert "forkline-prefix stopped (exit 0)" in run.stdout
    assert re.search(r"forkline-engine \S+ stopped \(exit 0\)", run.stdout)


@pytest.mark.slow
def test_demo_with_two_engines_survives_a_killed_engine_from_disk() -> None:
    """``--engines 2 --restart_engine``: the rounds go to one engine; it is killed (SIGKILL) and
    restarted; the last round reuses the prompt restored from the prefix service's snapshot directory
    (into the restarted engine or the other one: a file loads into any engine of the fingerprint)."""
    import re
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "clients.demo", "--max_new_tokens", "8", "--engines", "2", "--restart_engine"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rounds = re.findall(r"round (\d): reused (\d+)/(\d+) prompt tokens on engine (\S+),", run.stdout)
    assert len(rounds) == 3 and rounds[0][3] == rounds[1][3]
    prompt = int(rounds[0][2])
    assert [int(reused) for _, reused, _, _ in rounds] == [0, prompt - 1, prompt - 1]
    assert "killed (SIGKILL)" in run.stdout
    # the prompt's file and the generated snapshot's (the prompt and the answer); one restored
    assert re.search(r"snapshot directory: 2 files, .* 1 restored after the restart", run.stdout)
    assert run.stdout.count("stopped (exit 0)") == 3  # the prefix service and both (live) engines
