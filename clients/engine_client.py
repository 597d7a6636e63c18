"""EngineClient: a typed Python client of the ``forkline.engine.v1.Engine`` service. Requests are built
from ``GenConfig`` / prompts and events read back by the engine wire; failed calls raise the
``engine_service.api.errors`` type of their status."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.channel_client import ChannelClient
from engine_service.api.config import GenConfig
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import InvalidArgument
from engine_service.api.logprobs import TokenLogprob
from engine_service.api.owners import DEFAULT_OWNER
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Done, Event, Snapshot, Started, Tokens
from engine_service.serving.engine_wire import (
    Prompt,
    described,
    engine_info,
    event_from_proto,
    generate_request,
    text_input,
)
from engine_service.serving.errors import from_rpc_error
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc


@dataclass
class GenerationOutcome:
    """Everything one stream said, in order."""

    started: Started | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    snapshots: list[Snapshot] = field(default_factory=list)
    done: Done | None = None
    events: list[Event] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with top_logprobs: one per token


class GenerationStream:
    """A running Generate call: iterate for events; ``cancel()`` stops it (the engine cancels too)."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Event]:
        try:
            for msg in self._call:
                yield event_from_proto(msg)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._call.cancel()

    def collect(self) -> GenerationOutcome:
        out = GenerationOutcome()
        for event in self:
            out.events.append(event)
            if isinstance(event, Started):
                out.started = event
            elif isinstance(event, Tokens):
                out.tokens.extend(event.ids)
                out.text += event.text
                out.logprobs.extend(event.logprobs)
            elif isinstance(event, Snapshot):
                out.snapshots.append(event)
            else:
                out.done = event
        return out


def prompt_of(
    tokens: Sequence[int] | None, text: str | None, chat: bool, system: str, add_special_tokens: bool
) -> Prompt:
    """The prompt a call names: exactly one of ``tokens`` / ``text``."""
    if tokens is not None and text is None:
        return tokens
    if text is not None and tokens is None:
        return TextPrompt(text, chat, system, add_special_tokens)
    raise InvalidArgument("pass exactly one of tokens / text")


class EngineClient(ChannelClient):
    """See the module docstring. ``target`` is ``host:port`` or an open channel."""

    def __init__(
        self,
        target: str | grpc.Channel,
        *,
        owner: str = DEFAULT_OWNER,
        timeout: float | None = 60.0,
        token: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ) -> None:
        super().__init__(
            target,
            owner=owner,
            timeout=timeout,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        self.stub = engine_pb2_grpc.EngineStub(self.channel)

    def generate(
        self,
        tokens: Sequence[int] | None = None,
        *,
        text: str | None = None,
        chat: bool = False,
        system: str = "",
        add_special_tokens: bool = False,
        prepared: pb.PreparedInput | None = None,
        session: str | None = None,
        config: GenConfig | None = None,
        ignore_eos: bool = False,
        prompt_snapshot: bool = False,
        keep_session: bool = False,
        close_session: bool = False,
        final_snapshot: bool = False,
        timeout: float | None = None,
    ) -> GenerationStream:
        """Start a generation of ``config`` (default ``GenConfig()``; its ``prefill_breakpoints`` are
        captured as snapshots). ``ignore_eos``: only ``config.stop_tokens`` stop it. ``keep_session``:
        keep the fresh session after done; ``close_session``: close the given ``session`` when the call
        ends (no Close needed); ``final_snapshot``: a snapshot at its last committed token when it ends."""
        if prepared is not None:
            if tokens is not None or text is not None:
                raise InvalidArgument("pass exactly one of tokens / text / prepared")
            prompt: Prompt | pb.PreparedInput = prepared
        else:
            prompt = prompt_of(tokens, text, chat, system, add_special_tokens)
        request = generate_request(
            prompt,
            config or GenConfig(),
            ignore_eos=ignore_eos,
            session=session or "",
            prompt_snapshot=prompt_snapshot,
            keep_session=keep_session,
            close_session=close_session,
            final_snapshot=final_snapshot,
        )
        return GenerationStream(self.stub.Generate(request, metadata=self._metadata, timeout=timeout))

    def clone(self, session: str, upto: int, *, new_owner: str = "") -> str | None:
        """A new session holding [0, upto) (owned by ``new_owner`` or this client), or None if refused."""
        reply = self._unary(self.stub.Clone, pb.CloneRequest(session=session, upto=upto, new_owner=new_owner))
        return reply.session or None

    def clone_detailed(self, session: str, upto: int, *, new_owner: str = "") -> pb.CloneResponse:
        return self._unary(self.stub.Clone, pb.CloneRequest(session=session, upto=upto, new_owner=new_owner))

    def close(self, session: str) -> None:
        self._unary(self.stub.Close, pb.CloseRequest(session=session))

    def claim(self, session: str) -> None:
        """Take over the quota charge of a session handed to this (persistent) owner."""
        self._unary(self.stub.Claim, pb.ClaimRequest(session=session))

    def release_owner(self, keep: Sequence[str] = ()) -> int:
        """Close every session this owner holds (or handed over unclaimed) except ``keep``; how many."""
        return self._unary(self.stub.ReleaseOwner, pb.ReleaseOwnerRequest(keep=list(keep))).released

    def describe(self, session: str) -> tuple[int, bool]:
        """(committed position, generating)."""
        d = described(self._unary(self.stub.Describe, pb.DescribeRequest(session=session)))
        return d.position, d.generating

    def info(self) -> EngineInfo:
        return engine_info(self._unary(self.stub.Info, pb.InfoRequest()))

    def tokenize(
        self, text: str, *, chat: bool = False, system: str = "", add_special_tokens: bool = False
    ) -> list[int]:
        msg = text_input(TextPrompt(text, chat, system, add_special_tokens))
        return list(self._unary(self.stub.Tokenize, pb.TokenizeRequest(text=msg)).ids)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self._unary(self.stub.Detokenize, pb.DetokenizeRequest(ids=list(ids))).text

    def health(self, service: str = "") -> str:
        """The health status name (``SERVING``, ``NOT_SERVING``, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        reply = self._unary(stub.Check, health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (Unavailable after ``timeout``)."""
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            from engine_service.api.errors import Unavailable

            raise Unavailable(f"engine not reachable within {timeout} s") from None
