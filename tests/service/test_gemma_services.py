"""Gemma 3 270M (the packaged sliding-window model) behind both services (slow): plain-text gateway
generations equal an in-process cold run; a prompt diverging at 60% of a stored 1,440-token prompt
reuses a checkpoint past the window and continues exactly like a cold run; chat is refused with a
message (a base model without a chat template)."""

from __future__ import annotations

import random

import pytest

from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.executors.options import ExecutorSettings
from engine_service.rpc.server import create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from tests.service.conftest import start_prefix

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def services():
    from engine_service.api.errors import ModelLoadError
    from engine_service.model.loading.loader import load_model

    try:
        loaded = load_model("gemma-3-270m")
    except ModelLoadError as exc:
        pytest.skip(f"gemma-3-270m unavailable: {exc}")
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name="gemma-3-270m",
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=32, max_session_tokens=2048),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    prefix = start_prefix(f"127.0.0.1:{port}", max_entries=16)
    client = PrefixClient(prefix.address, owner="slow", timeout=600)
    yield loaded, deps, client
    client.close_channel()
    prefix.stop(0)
    server.stop(0, shutdown_runner=True)


def cold(deps, tokens, n):
    with deps.runner.open_session() as session:
        return list(session.generate_async(tokens, GenConfig(max_new_tokens=n)).wait(300).tokens)


def test_plain_text_rounds_equal_a_cold_run(services):
    loaded, deps, client = services
    text = "The capital of France is"
    rounds = [
        client.generate(text=text, config=GenConfig(max_new_tokens=8), namespace="plain").collect()
        for _ in range(2)
    ]
    prompt = loaded.tokenizer.encode(text, add_special_tokens=True)
    assert prompt[0] == loaded.tokenizer.bos_token_id
    assert [r.done.reused_positions for r in rounds] == [0, len(prompt) - 1]
    assert rounds[0].tokens == rounds[1].tokens == cold(deps, prompt, 8)


def test_chat_is_refused_with_a_reason(services):
    _, _, client = services
    with pytest.raises(InvalidArgument, match="no chat template .* plain text"):
        client.generate(text="Hi", chat=True, config=GenConfig(max_new_tokens=4)).collect()


def test_a_prompt_diverging_past_the_window_reuses_a_branch_point_checkpoint_exactly(services):
    _, deps, client = services
    rng = random.Random(0)
    a = [2] + [rng.randrange(300, 60000) for _ in range(1439)]
    b = a[:864] + [rng.randrange(300, 60000) for _ in range(576)]
    c = b[:900] + [rng.randrange(300, 60000) for _ in range(540)]
    client.generate(a, config=GenConfig(max_new_tokens=1), namespace="long").collect()
    miss = client.generate(b, config=GenConfig(max_new_tokens=1), namespace="long").collect()
    # the stored prompt's own snapshot cannot rewind to 864 (its ring floor is 1440 - 512), and no
    # stride checkpoints are taken by default: a miss, which keeps a checkpoint where b left a
    assert miss.done.reused_positions == 0
    hit = client.generate(c, config=GenConfig(max_new_tokens=6), namespace="long").collect()
    # c leaves b at 900 and a at 864 (both floors at 928): the checkpoint at that branch point serves
    assert hit.done.reused_positions == 864
    assert hit.tokens == cold(deps, c, 6)


def test_the_main_job_runs_on_gemma_with_plain_text() -> None:
    """``./scripts/main.sh --model gemma-3-270m``: real processes; the demo sees from Info that the model has
    no chat template and sends plain text; round 2 reuses all but the final prompt token."""
    import re
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-m", "clients.demo", "--model", "gemma-3-270m", "--max_new_tokens", "8"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "gemma3" in run.stdout and "prompts go as plain text" in run.stdout
    reuse = re.findall(r"round \d: reused (\d+)/(\d+) prompt tokens", run.stdout)
    n = int(reuse[0][1])
    assert [(int(a), int(b)) for a, b in reuse] == [(0, n), (n - 1, n)]


def test_long_texts_reuse_their_pieces_within_a_scope_only(services):
    """The gateway's Tokenize carries the request's cache scope: a second text sharing a long prefix
    in the same namespace reuses the engine's pieces (``chunked_encoding.py``); under another cache
    salt nothing is reused (the negative control), and the ids stay the plain tokenizer's."""
    loaded, deps, client = services
    rng = random.Random(11)
    doc = " ".join(
        rng.choice(("harbor", "lantern", "window", "garden", "river", "stone")) for _ in range(900)
    )
    config = GenConfig(max_new_tokens=1)

    def ask(question: str, salt: str = "") -> tuple[int, int]:
        out = client.generate(text=f"{doc} {question}", config=config, namespace="pieces", cache_salt=salt)
        done = out.collect().done  # every position of the plain tokenizer's ids, computed or reused
        assert done.prompt_positions + done.reused_positions == len(
            loaded.tokenizer.encode(f"{doc} {question}", True)
        )
        return deps.tokenizer.piece_counts()

    first = ask("Which river?")
    second = ask("Which garden?")
    assert second[0] - first[0] > len(doc) - 1100  # all but the last piece or two came from the cache
    salted = ask("Which stone?", salt="another tenant")
    assert salted[0] == second[0] and salted[1] - second[1] >= len(doc)  # nothing reused, all tokenized
