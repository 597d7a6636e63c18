"""The workload bench's ideal cache (bench/ideal_cache.py) against hand-computed hits, with controls where
a wrong rule would still pass: generated ids counted only once completed, the len - 1 cap."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[3] / "bench" / "ideal_cache.py"
_SPEC = importlib.util.spec_from_file_location("bench_ideal_cache", _PATH)
ideal_cache = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = ideal_cache  # its dataclasses look their module up
_SPEC.loader.exec_module(ideal_cache)
RequestLog, ideal_hits, share = ideal_cache.RequestLog, ideal_cache.ideal_hits, ideal_cache.share
ideal_replay = ideal_cache.ideal_replay


def log(prompt: list[int], generated: list[int], sent: float, done: float) -> RequestLog:
    return RequestLog(tuple(prompt), tuple(generated), sent, done)


def test_hand_computed_hits() -> None:
    logs = [
        log([1, 2, 3, 4], [5, 6], 0.0, 1.0),  # cold: 0
        log([1, 2, 3, 4, 5, 6, 7], [8], 2.0, 3.0),  # A's prompt + answer: 6
        log([1, 2, 9, 9], [], 4.0, 5.0),  # diverges after 2: 2
        log([1, 2, 3, 4], [], 6.0, 7.0),  # all 4 stored, capped at len - 1: 3
        log([7, 7, 7], [], 8.0, 9.0),  # nothing shared: 0
    ]
    assert ideal_hits(logs) == [0, 6, 2, 3, 0]
    # the radix tree's positions: the chain 1..8, the 9, 9 branch, the 7, 7, 7 root branch
    assert ideal_replay(logs)[1] == 8 + 2 + 3
    assert share([0, 6, 2, 3, 0], [4, 7, 4, 4, 3]) == round(11 / 22, 4)


def test_generated_ids_count_only_after_completion() -> None:
    # negative control: B is sent while A is still generating, so A's answer is not there yet; A's
    # prompt is (sent before B), so B reuses exactly A's 4 prompt positions, not 6.
    logs = [log([1, 2, 3, 4], [5, 6], 0.0, 5.0), log([1, 2, 3, 4, 5, 6, 7], [], 1.0, 2.0)]
    assert ideal_hits(logs) == [0, 4]
    # the same requests in order of completion: the answer counts
    done_first = [log([1, 2, 3, 4], [5, 6], 0.0, 1.0), log([1, 2, 3, 4, 5, 6, 7], [], 1.0, 2.0)]
    assert ideal_hits(done_first) == [0, 6]


def test_a_request_never_hits_itself_and_empty_share_is_zero() -> None:
    assert ideal_hits([log([4, 5, 6], [7], 0.0, 1.0)]) == [0]
    assert share([], []) == 0.0
