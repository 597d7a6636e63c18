"""Deterministic mode: logits bitwise equal however a row's forward is shaped (issue 15).

A tiny seeded model with block-quantized weights (q8_0 and q4_1), full and sliding layers, prompts long
enough for several 64-position attention chunks. The logits of the first generated position and of each
later greedy step are compared byte for byte between a cold run (one-piece prefill, alone) and: a clone
at unaligned positions plus the rest of the prompt, a prefill in chunks of 7, and eight sessions of mixed
lengths prefilled and decoded in shared forwards; for both cache kinds. The negative control runs the
same comparisons in the ordinary mode and finds differences. The slow test does warm vs cold on the
packaged model over 16 prompts.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine_service.api.errors import FailedPrecondition
from engine_service.executors.base import ExecInput
from engine_service.executors.module import ModuleExecutor
from engine_service.model import deterministic, layers, projections
from engine_service.model.cpu_kernels import KERNEL_MAX_ROWS_AVX2
from engine_service.model.random_init import random_model

KINDS = ("batched-sequence", "batched-cell")
FORMATS = ("q8_0", "q4_1")
STEPS = 3
if deterministic.problem("q8_0") is not None:
    pytest.skip(deterministic.problem("q8_0"), allow_module_level=True)


def avx2_row_limit(monkeypatch) -> None:
    """The ordinary mode's kernel row limit as on AVX2 (with AVX-512 it has none), in both modules that
    read it: the projections' BLAS switch and the layers' fused path."""
    for module in (layers, projections):
        monkeypatch.setattr(module, "kernel_max_rows", lambda: KERNEL_MAX_ROWS_AVX2)


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 128, size=int(rng.integers(140, 230))).tolist() for _ in range(n)]


@pytest.fixture(scope="module", params=FORMATS)
def model(request):
    # window 20 on the sliding layers; hidden 64 over 4 heads (2 kv heads): head_dim 16
    return random_model("FRFR", 20, 3, weights_dtype=request.param, tie_embeddings=False)


def executor(model, kind: str, det: bool, chunk: int = 512, sessions: int = 10) -> ModuleExecutor:
    model.set_deterministic(det)
    return ModuleExecutor.create(
        model, kind, max_sessions=sessions, max_session_tokens=256, prefill_chunk=chunk, keep_logits=True
    )


def decode(ex: ModuleExecutor, sids: list[int], outs: list, steps: int = STEPS) -> list[list[bytes]]:
    """Greedy steps of every session together; per session the logits bytes of each output."""
    logs = [[np.array(o.logits).tobytes()] for o in outs]
    toks = [o.tokens[-1] for o in outs]
    for _ in range(steps):
        res = ex.execute([ExecInput(s, ex.position(s), tokens=(t,)) for s, t in zip(sids, toks, strict=True)])
        for i, o in enumerate(res):
            assert o.error is None, o.error
            logs[i].append(np.array(o.logits).tobytes())
            toks[i] = o.tokens[-1]
    return logs


def cold(model, kind: str, det: bool, tokens: list[int]) -> list[bytes]:
    ex = executor(model, kind, det)
    sid = ex.open_session()
    out = ex.execute([ExecInput(sid, 0, tokens=tuple(tokens))])[0]
    return decode(ex, [sid], [out])[0]


def comparisons(model, kind: str, det: bool) -> dict[str, bool]:
    """name -> whether that reuse path reproduced the cold logits bit for bit."""
    ps = prompts(8)
    colds = [cold(model, kind, det, p) for p in ps]
    same: dict[str, bool] = {}
    # prefix hit: clone a donor at unaligned positions, feed the rest of the prompt
    ex = executor(model, kind, det)
    donor = ex.open_session()
    ex.execute([ExecInput(donor, 0, tokens=tuple(ps[0]))])
    for k in (1, 13, 63, 64, 65, len(ps[0]) - 1):
        sid = ex.clone(donor, k)
        out = ex.execute([ExecInput(sid, k, tokens=tuple(ps[0][k:]))])[0]
        same[f"clone@{k}"] = decode(ex, [sid], [out]) == [colds[0]]
        ex.close_session(sid)
    # chunked prefill (rounds of 7 positions)
    ex = executor(model, kind, det, chunk=7)
    sid = ex.open_session()
    out = ex.execute([ExecInput(sid, 0, tokens=tuple(ps[1]))])[0]
    same["chunked"] = decode(ex, [sid], [out]) == [colds[1]]
    # eight sessions of different lengths: prefilled in one forward, decoded together
    ex = executor(model, kind, det)
    sids = [ex.open_session() for _ in ps]
    outs = ex.execute([ExecInput(s, 0, tokens=tuple(p)) for s, p in zip(sids, ps, strict=True)])
    same["batch of 8"] = decode(ex, sids, outs) == colds
    return same


@pytest.mark.parametrize("kind", KINDS)
def test_reuse_paths_reproduce_cold_logits_bitwise(model, kind, monkeypatch):
    avx2_row_limit(monkeypatch)  # the mode must lift the row limit itself
    same = comparisons(model, kind, det=True)
    assert all(same.values()), same


def test_clone_at_every_position_of_a_short_prompt(model):
    tokens = prompts(1, seed=9)[0][:24]
    want = cold(model, "batched-cell", True, tokens)
    ex = executor(model, "batched-cell", True)
    donor = ex.open_session()
    ex.execute([ExecInput(donor, 0, tokens=tuple(tokens))])
    for k in range(1, len(tokens)):
        sid = ex.clone(donor, k)
        out = ex.execute([ExecInput(sid, k, tokens=tuple(tokens[k:]))])[0]
        assert decode(ex, [sid], [out]) == [want], k
        ex.close_session(sid)


def test_negative_control_ordinary_mode_differs(model, monkeypatch):
    """The same comparisons without the mode: some reuse path changes the logits' bits. Long blocks go
    through BLAS as the ordinary mode sends them on an AVX2 CPU (with AVX-512 it keeps every row count
    on the kernels, and these comparisons then find no difference: the mode is what guarantees it)."""
    avx2_row_limit(monkeypatch)
    same = {}
    for kind in KINDS:
        same.update({f"{kind} {k}": v for k, v in comparisons(model, kind, det=False).items()})
    assert not all(same.values()), same


def test_fingerprint_separates_the_modes(model):
    plain = executor(model, "batched-sequence", False).fingerprint()
    det = executor(model, "batched-sequence", True).fingerprint()
    assert plain != det
    model.set_deterministic(False)


def test_float_weights_refuse_the_mode():
    m = random_model("FF", 4, 0, weights_dtype="float32")
    with pytest.raises(FailedPrecondition, match="block-quantized"):
        ModuleExecutor.create(
            m, "batched-sequence", max_sessions=2, max_session_tokens=64, deterministic=True
        )
    assert not m.deterministic


def test_seeded_sampling_reproduces_across_batch_and_reuse(model):
    """Sampling with a seed: the same tokens alone, batched with others and after a clone."""
    from engine_service.executors.sampling import SamplingParams

    ps = prompts(3, seed=4)
    params = SamplingParams(temperature=1.0, top_p=0.95, top_k=0)

    def sample(ex, sid, start, tokens, n=6):
        ex.set_sampling(sid, params, seed=1234)
        out = ex.execute([ExecInput(sid, start, tokens=tuple(tokens))])[0]
        got = list(out.tokens)
        while len(got) < n:
            got += ex.execute([ExecInput(sid, ex.position(sid), tokens=(got[-1],))])[0].tokens
        return got[:n]

    ex = executor(model, "batched-sequence", True)
    alone = sample(ex, ex.open_session(), 0, ps[0])
    ex = executor(model, "batched-sequence", True)
    donor = ex.open_session()
    ex.execute([ExecInput(donor, 0, tokens=tuple(ps[0]))])
    assert sample(ex, ex.clone(donor, 37), 37, ps[0][37:]) == alone
    model.set_deterministic(False)


@pytest.mark.slow
def test_real_model_warm_equals_cold_at_every_step():
    """The packaged model (q8_0 with the kernels), 16 prompts: a prefix hit (clone of a donor that read
    the prompt, at an unaligned position) then greedy steps give the cold run's logits bit for bit."""
    from engine_service.model import load_model

    loaded = load_model(None, "q8_0")
    tok = loaded.tokenizer
    questions = [
        "What is the capital of France?",
        "Name three primary colors.",
        "Why is the sky blue?",
        "Write a haiku about rain.",
        "What is 12 times 7?",
        "Who wrote Hamlet?",
        "Describe a cat in one sentence.",
        "What is photosynthesis?",
        "List two prime numbers.",
        "How many legs does a spider have?",
        "What is the boiling point of water?",
        "Give a synonym for happy.",
        "What language is spoken in Brazil?",
        "Define gravity briefly.",
        "What is the largest planet?",
        "Translate 'hello' to Spanish.",
    ]
    system = "You are a concise assistant. Answer in one short sentence."
    ps = [
        tok.encode(
            loaded.chat.format([{"role": "system", "content": system}, {"role": "user", "content": q}])
        )
        for q in questions
    ]
    ex = ModuleExecutor.create(
        loaded,
        "batched-sequence",
        max_sessions=4,
        max_session_tokens=256,
        keep_logits=True,
        deterministic=True,
    )
    for i, p in enumerate(ps):
        sid = ex.open_session()
        want = decode(ex, [sid], [ex.execute([ExecInput(sid, 0, tokens=tuple(p))])[0]], steps=4)
        ex.close_session(sid)
        donor = ex.open_session()
        ex.execute([ExecInput(donor, 0, tokens=tuple(p[: len(p) - 3]))])
        k = 5 + 7 * i % (len(p) - 9)  # a hit somewhere inside the shared part, rarely chunk-aligned
        sid = ex.clone(donor, k)
        got = decode(ex, [sid], [ex.execute([ExecInput(sid, k, tokens=tuple(p[k:]))])[0]], steps=4)
        assert got == want, (i, k)
        ex.close_session(sid)
        ex.close_session(donor)


@pytest.mark.parametrize("module", ["engine_service", "clients.run_llm_batched"])
def test_cli_flag_fails_at_start_without_the_kernels(module, tmp_path):
    """--deterministic where the kernels do not load: exit 2 with the reason, before serving anything."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    args = ["--port", "0"] if module == "engine_service" else ["hello", "--out_prefix", str(tmp_path / "o")]
    env = {**os.environ, "FORKLINE_KERNELS": "off"}
    proc = subprocess.run(
        [sys.executable, "-m", module, "--deterministic", *args],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "deterministic mode needs the compiled kernels" in proc.stderr, proc.stderr
