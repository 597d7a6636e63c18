"""Domain values <-> the engine's messages for the prefix service's engine calls. Pure functions."""

from __future__ import annotations

from engine_service.api.answers import CloneRefusal, TakenClone
from engine_service.api.config import GenConfig
from engine_service.api.prompts import TextPrompt
from engine_service.serving.engine_wire import CLONE_REFUSALS
from prefix_service.gateway.gateway_backend import EngineGenerate
from protos import engine_pb2 as epb

_CLONE_REFUSALS = {value: reason for reason, value in CLONE_REFUSALS.items()}  # engine wire -> domain


def taken_clone(reply: epb.CloneResponse) -> TakenClone:
    """A Clone reply as ``GatewayBackend.take_clone`` answers it."""
    if reply.session:
        return TakenClone(reply.session)
    return TakenClone(None, _CLONE_REFUSALS.get(reply.reason, CloneRefusal.BOUNDARY))


def text_input(text: TextPrompt) -> epb.TextInput:
    return epb.TextInput(
        text=text.text,
        chat=text.chat,
        system=text.system,
        add_special_tokens=text.add_special_tokens,
        messages=[epb.ChatMessage(role=role, content=content) for role, content in text.messages],
    )


def generation_config(config: GenConfig, ignore_eos: bool) -> epb.GenerationConfig:
    """The engine request's config: every field set, so the engine builds the same GenConfig."""
    return epb.GenerationConfig(
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
    )


def engine_request(request: EngineGenerate, snapshot_owner: str = "") -> epb.GenerateRequest:
    """The engine Generate; ``snapshot_owner``: who receives the snapshots ("": the caller)."""
    return epb.GenerateRequest(
        session=request.session,
        tokens=epb.TokenIds(ids=request.tokens),
        config=generation_config(request.config, request.ignore_eos),
        capture=epb.CaptureOptions(
            prompt_snapshot=request.prompt_snapshot,
            breakpoints=request.config.prefill_breakpoints,
            snapshot_owner=snapshot_owner,
        ),
        close_session=request.close_session,
    )
