"""The engine's ``GenerateRequest``, built from api values (the engine's servicer reads it back in
``rpc/convert.py``: it needs the sessions' request types, which this kit may not import)."""

from __future__ import annotations

from typing import Protocol

from engine_service.api.config import GenConfig
from engine_service.serving.engine_wire.config import generation_config
from engine_service.serving.engine_wire.prompts import Prompt, prompt_fields
from protos import engine_pb2 as pb


def generate_request(
    prompt: Prompt | pb.PreparedInput,
    config: GenConfig,
    *,
    ignore_eos: bool = False,
    session: str = "",
    prompt_snapshot: bool = False,
    snapshot_owner: str = "",
    keep_session: bool = False,
    close_session: bool = False,
    final_snapshot: bool = False,
    checkpoint_every: int = 0,
) -> pb.GenerateRequest:
    """A Generate of ``prompt`` (token ids, a TextPrompt or a prepared input); the prefill breakpoints
    of ``config`` travel as capture breakpoints. ``snapshot_owner``: who receives the snapshots ("": the
    caller)."""
    fields = {"prepared": prompt} if isinstance(prompt, pb.PreparedInput) else prompt_fields(prompt)
    return pb.GenerateRequest(
        session=session,
        config=generation_config(config, ignore_eos),
        capture=pb.CaptureOptions(
            prompt_snapshot=prompt_snapshot,
            breakpoints=config.prefill_breakpoints,
            snapshot_owner=snapshot_owner,
            final_snapshot=final_snapshot,
            checkpoint_every=checkpoint_every,
        ),
        keep_session=keep_session,
        close_session=close_session,
        **fields,
    )


class EngineCall(Protocol):
    """What :func:`engine_request` reads of the prefix gateway's ``EngineGenerate`` (read-only)."""

    @property
    def session(self) -> str: ...
    @property
    def tokens(self) -> tuple[int, ...]: ...
    @property
    def config(self) -> GenConfig: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def prompt_snapshot(self) -> bool: ...
    @property
    def close_session(self) -> bool: ...
    @property
    def final_snapshot(self) -> bool: ...
    @property
    def checkpoint_every(self) -> int: ...


def engine_request(request: EngineCall, snapshot_owner: str = "") -> pb.GenerateRequest:
    """The prefix service's engine Generate; ``snapshot_owner``: who receives the snapshots ("": the
    caller)."""
    return generate_request(
        request.tokens,
        request.config,
        ignore_eos=request.ignore_eos,
        session=request.session,
        prompt_snapshot=request.prompt_snapshot,
        snapshot_owner=snapshot_owner,
        close_session=request.close_session,
        final_snapshot=request.final_snapshot,
        checkpoint_every=request.checkpoint_every,
    )
