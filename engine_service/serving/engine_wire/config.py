"""``GenConfig`` <-> ``GenerationConfig``: unset wire fields take GenConfig's defaults."""

from __future__ import annotations

from collections.abc import Sequence

from engine_service.api.config import GenConfig
from protos import engine_pb2 as pb

DEFAULTS = GenConfig()


def gen_config(
    msg: pb.GenerationConfig, eos_token_ids: Sequence[int], breakpoints: Sequence[int] = ()
) -> GenConfig:
    """A GenConfig from the request; unset fields take GenConfig's defaults. Stops default to EOS."""
    stops = tuple(msg.stop_tokens) or (() if msg.ignore_eos else tuple(eos_token_ids))
    return GenConfig(
        max_new_tokens=msg.max_new_tokens if msg.HasField("max_new_tokens") else DEFAULTS.max_new_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else DEFAULTS.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else DEFAULTS.top_p,
        top_k=msg.top_k if msg.HasField("top_k") else DEFAULTS.top_k,
        seed=msg.seed if msg.HasField("seed") else DEFAULTS.seed,
        stop_tokens=stops,
        prefill_chunk=msg.prefill_chunk if msg.HasField("prefill_chunk") else DEFAULTS.prefill_chunk,
        prefill_breakpoints=tuple(breakpoints),
        top_logprobs=msg.top_logprobs if msg.HasField("top_logprobs") else None,
        json_schema=msg.json_schema,
        drawn_tokens=msg.drawn_tokens,
        speculative=msg.speculative,
    )


def generation_config(config: GenConfig, ignore_eos: bool = False) -> pb.GenerationConfig:
    """Every field set, so the engine builds the same GenConfig. Empty ``stop_tokens``: the model's
    EOS tokens stop, unless ``ignore_eos``. ``prefill_breakpoints`` travel in the request's capture."""
    return pb.GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        seed=config.seed,
        stop_tokens=config.stop_tokens,
        ignore_eos=ignore_eos,
        prefill_chunk=config.prefill_chunk,
        top_logprobs=config.top_logprobs,
        json_schema=config.json_schema,
        drawn_tokens=config.drawn_tokens,
        speculative=config.speculative,
    )
