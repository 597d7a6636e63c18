"""GenConfig validation: every bad field raises InvalidArgument (a ValueError) naming the field."""

from __future__ import annotations

import dataclasses

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.executors.sampling import SamplingParams
from engine_service.runtime.generation import GenerationMetrics, GenerationResult, GenerationUpdate

BAD = [
    ("max_new_tokens", 0),
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", True),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "1"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_k", -1),
    ("seed", -1),
    ("seed", 2**64),
    ("stop_tokens", (-1,)),
    ("stop_tokens", ("a",)),
    ("stop_tokens", 5),
    ("stop_tokens", (True,)),
    ("prefill_chunk", 0),
    ("prefill_breakpoints", (0,)),
    ("prefill_breakpoints", (2.5,)),
]


@pytest.mark.parametrize("field,value", BAD)
def test_bad_field_raises_naming_it(field, value):
    with pytest.raises(InvalidArgument, match=field) as info:
        GenConfig(**{field: value})
    assert isinstance(info.value, ValueError)


def test_defaults_and_normalisation():
    cfg = GenConfig(stop_tokens=[3, 1], prefill_breakpoints=[9, 3, 9])
    assert cfg.stop_tokens == (3, 1) and cfg.prefill_breakpoints == (3, 9)
    assert GenConfig() == GenConfig(
        max_new_tokens=128,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        seed=0,
        stop_tokens=(),
        prefill_chunk=512,
        prefill_breakpoints=(),
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.seed = 1
    params = SamplingParams.of(GenConfig(temperature=0.7, top_p=0.9, top_k=5))
    assert (params.temperature, params.top_p, params.top_k) == (0.7, 0.9, 5)


def test_update_and_result_validate_their_invariants():
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationUpdate((), 0, finished=True)
    with pytest.raises(ValueError, match="breakpoint"):
        GenerationUpdate((), 4, breakpoint=3)
    with pytest.raises(ValueError, match="error"):
        GenerationResult((), "error", None, GenerationMetrics())
    with pytest.raises(ValueError, match="finish_reason"):
        GenerationResult((), "bogus", None, GenerationMetrics())
