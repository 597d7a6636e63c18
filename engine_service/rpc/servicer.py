"""EngineServicer: ``forkline.engine.v1.Engine`` over a Runner. Converts, delegates, maps errors.

Every engine operation goes through the Runner's thread-safe API (``open_session``, ``Session``
methods and futures); nothing here touches MLX or the executor. Handles are resolved through the
:class:`HandleRegistry` with the caller's owner id (request metadata ``forkline-owner``).

Quotas (``engine_service/handles.py``): every resident session an owner has counts against its quota,
live or held -- a fresh session for the length of its call (kept: afterwards too), held sessions,
clones and snapshots -- so one owner cannot fill the engine and make another owner's request fail. The
registry reserves before anything is allocated: a fresh session before ``open_session``, a clone before
``clone_async``, a generation's snapshots before it starts. A generation's weight is what it may reach
(``position + input + max_new_tokens``, at most ``max_session_tokens``), checked when it starts; a held
session weighs its position afterwards. A clone or snapshot may go to another owner only to or from a
persistent owner (the prefix service), and counts against the new owner.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from engine_service.api.clones import CloneRefusal
from engine_service.api.config import GenConfig
from engine_service.api.content import check_digest
from engine_service.api.engine_info import NO_WINDOW, EngineInfo
from engine_service.api.errors import Cancelled, FailedPrecondition, InvalidArgument, Stopping, Unavailable
from engine_service.api.owners import NO_QUOTA, PERSISTENT_OWNER, OwnerQuota, check_owner
from engine_service.executors.base import ExecutorLimits
from engine_service.executors.prepared_input import PreparedInput
from engine_service.handles import HandleRegistry
from engine_service.rpc import convert, snapshot_calls
from engine_service.rpc.generation_call import GenerationCall
from engine_service.runtime.session import close_child_when_done
from engine_service.serving import engine_wire
from engine_service.serving.auth import owner_of
from engine_service.serving.errors import status_on_error
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc

if TYPE_CHECKING:  # annotations only: the model, tokenizer and runner are built by whoever builds the deps
    from engine_service.model.chat import ChatFormatter
    from engine_service.model.loader import LoadedModel
    from engine_service.model.tokenizer import Tokenizer
    from engine_service.model.transformer import Transformer
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session

log = logging.getLogger(__name__)

CLONE_TIMEOUT_S = 60.0


@dataclass
class EngineDeps:
    """What the engine service serves. ``runner`` is started and owned by whoever built the deps.

    limits: the executor's limits (published in Info, checked on input). registry: session handles
    (its instance id is the engine instance id). fingerprint: defaults to the runner's.
    hidden_size: the model's hidden size, which prepared ``embeddings`` inputs must match (None: unchecked).
    """

    runner: Runner
    tokenizer: Tokenizer
    limits: ExecutorLimits
    model_name: str
    cache_kind: str
    eos_token_ids: tuple[int, ...] = ()
    chat: ChatFormatter | None = None
    registry: HandleRegistry[Session] = field(default_factory=HandleRegistry)
    fingerprint: str | None = None
    hidden_size: int | None = None
    architecture: str = ""

    @classmethod
    def build(
        cls,
        model: Transformer | LoadedModel,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        chat: ChatFormatter | None = None,
        cache_kind: str = "batched-sequence",
        max_sessions: int = 8,
        max_session_tokens: int = 2048,
        max_decode_sequences: int = 8,
        prefill_chunk: int = 512,
        idle_timeout_s: float = 0.0,
        persistent_owners: tuple[str, ...] = (PERSISTENT_OWNER,),
        eos_token_ids: tuple[int, ...] | None = None,
        prepared_inputs: bool = False,
        quota: OwnerQuota = NO_QUOTA,
        persistent_quota: OwnerQuota = NO_QUOTA,
    ) -> EngineDeps:
        """An executor over ``model`` (a Transformer or LoadedModel) and a started Runner.

        ``prepared_inputs``: an EmbeddingsExecutor (also accepts ``embeddings`` prepared inputs)
        instead of the raw-token ModuleExecutor. ``quota`` / ``persistent_quota``: what each client /
        persistent owner may hold (default: unlimited; the CLI's defaults: ``handles.engine_quotas``).
        """
        from engine_service.executors.embeddings import EmbeddingsExecutor
        from engine_service.executors.module import ModuleExecutor
        from engine_service.runtime.runner import Runner

        executor_cls = EmbeddingsExecutor if prepared_inputs else ModuleExecutor
        executor = executor_cls.create(
            model,
            cache_kind,
            max_sessions,
            max_session_tokens,
            prefill_chunk=prefill_chunk,
        )
        runner = Runner(executor, max_decode_sequences=max_decode_sequences)
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids
        return cls(
            runner=runner,
            tokenizer=tokenizer,
            limits=runner.limits,
            model_name=model_name,
            cache_kind=cache_kind,
            eos_token_ids=eos_token_ids,
            chat=chat,
            registry=HandleRegistry(
                idle_timeout_s=idle_timeout_s,
                persistent_owners=frozenset(persistent_owners),
                quota=quota,
                persistent_quota=persistent_quota,
            ),
            hidden_size=executor.config.hidden_size,
            architecture=executor.config.architecture,
        )

    def __post_init__(self) -> None:
        if self.fingerprint is None:
            self.fingerprint = str(self.runner.fingerprint)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)


class EngineServicer(engine_pb2_grpc.EngineServicer):
    """See the module docstring. :meth:`drain` makes new work UNAVAILABLE (graceful shutdown)."""

    def __init__(self, deps: EngineDeps) -> None:
        self.deps = deps
        self._draining = threading.Event()

    def drain(self) -> None:
        self._draining.set()

    def _serving(self) -> None:
        if self._draining.is_set():
            raise Stopping("the engine is shutting down")

    # -- generation ----------------------------------------------------------------------------
    def Generate(
        self, request: pb.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.GenerateEvent]:
        with status_on_error(context):
            self._serving()
            d = self.deps
            owner = owner_of(context.invocation_metadata())
            value = convert.generate_input(request, d.tokenizer, d.chat, d.limits.vocab_size, d.hidden_size)
            breakpoints = tuple(request.capture.breakpoints)
            config = engine_wire.gen_config(request.config, d.eos_token_ids, breakpoints)
            call = self._open_call(request, owner, value, config)
            context.add_callback(call.finish)
            try:
                for event in call.events(value, config, context.is_active):
                    yield engine_wire.event_message(event)
            finally:
                call.finish()

    def _open_call(
        self, request: pb.GenerateRequest, owner: str, value: list[int] | PreparedInput, config: GenConfig
    ) -> GenerationCall:
        """Resolve (or open) the session and reserve what the call may hold in its owner's quota."""
        d = self.deps
        breakpoints = config.prefill_breakpoints
        snapshot_owner = self._receiver(owner, request.capture.snapshot_owner, "capture.snapshot_owner")
        size = convert.input_size(value)
        if request.session:
            if request.keep_session:
                raise InvalidArgument("keep_session only applies to a fresh session (session is set)")
            session = d.registry.pin(request.session, owner)
            handle, fresh = request.session, False
        else:
            convert.check_fits(0, size, breakpoints, d.limits)  # before anything is reserved or opened
            handle, fresh = d.registry.reserve(owner, self._weight(0, size, config)), True
            try:
                session = d.runner.open_session()
            except BaseException:
                d.registry.discard(handle)
                raise
            if not d.registry.fill(handle, session):
                session.close()
                raise Stopping("the engine is shutting down")
            d.registry.pin(handle, owner)
        call: GenerationCall | None = None
        try:
            if session.generating:
                raise FailedPrecondition(f"session {handle} is already generating")
            start = session.position + (1 if session.has_pending else 0)
            convert.check_fits(start, size, breakpoints, d.limits)
            d.registry.weigh(handle, self._weight(start, size, config), check=True)
            call = GenerationCall(
                registry=d.registry,
                owner=owner,
                handle=handle,
                session=session,
                fresh=fresh,
                keep_session=request.keep_session,
                tokenizer=d.tokenizer,
                prompt_snapshot=request.capture.prompt_snapshot,
                breakpoints=breakpoints,
                snapshot_owner=snapshot_owner,
            )
            call.reserve_snapshots(start + size)
        except BaseException:
            if call is not None:
                call.release_reservations()
            d.registry.unpin(handle)
            if fresh:
                d.registry.discard(handle)
                session.close()
            raise
        return call

    def _weight(self, start: int, size: int, config: GenConfig) -> int:
        """The positions a generation may reach: what its session weighs in its owner's quota."""
        return min(start + size + config.max_new_tokens, self.deps.limits.max_session_tokens)

    def _receiver(self, owner: str, requested: str, field_name: str) -> str:
        """Who receives a clone or snapshot the caller asks for: itself, or another owner when one of
        the two is a persistent owner (a client hands a snapshot to the prefix service, the prefix
        service a clone to its caller); any other hand-over is INVALID_ARGUMENT."""
        if not requested or requested == owner:
            return owner
        receiver = check_owner(requested, field_name)
        persistent = self.deps.registry.persistent_owners
        if owner not in persistent and receiver not in persistent:
            names = ", ".join(sorted(persistent)) or "none configured"
            raise InvalidArgument(
                f"{field_name} {receiver!r}: only a persistent owner ({names}) can receive "
                f"or give another owner's session"
            )
        return receiver

    # -- sessions ------------------------------------------------------------------------------
    def Clone(self, request: pb.CloneRequest, context: grpc.ServicerContext) -> pb.CloneResponse:
        with status_on_error(context):
            self._serving()
            owner = owner_of(context.invocation_metadata())
            new_owner = self._receiver(owner, request.new_owner, "new_owner")
            if request.upto < 0:
                raise InvalidArgument(f"upto must be >= 0, got {request.upto}")
            expected = check_digest(request.expected_content_digest, "expected_content_digest")
            source = self.deps.registry.resolve(request.session, owner)
            position = source.position
            if request.upto > position:
                return convert.clone_refused(
                    CloneRefusal.POSITION, request.upto, f"upto={request.upto} is outside [0, {position}]"
                )
            registry = self.deps.registry
            handle = registry.reserve(new_owner, request.upto)  # the new owner's quota, before the clone
            try:
                future = source.clone_async(request.upto, expected)
                try:
                    child = future.result(timeout=CLONE_TIMEOUT_S)
                except TimeoutError:  # concurrent.futures' is the builtin since 3.11
                    close_child_when_done(future)  # nobody will receive it
                    raise Unavailable(f"the clone did not complete within {CLONE_TIMEOUT_S} s") from None
            except BaseException:
                registry.discard(handle)
                raise
            if child is None:
                registry.discard(handle)
                return convert.clone_refused(future.refusal or CloneRefusal.BOUNDARY, request.upto)
            if not context.is_active():  # the caller gave up (deadline, disconnect): nobody gets it
                registry.discard(handle)
                child.close()
                raise Cancelled("the caller left before the clone completed")
            # a matched expected digest is the child's: no second hash
            digest = expected if expected is not None else child.content_digest()
            if not registry.fill(handle, child):
                child.close()
                raise Stopping("the engine is shutting down")
            return pb.CloneResponse(session=handle, position=request.upto, content_digest=digest or b"")

    def Close(self, request: pb.CloseRequest, context: grpc.ServicerContext) -> pb.CloseResponse:
        with status_on_error(context):
            owner = owner_of(context.invocation_metadata())
            self.deps.registry.remove(request.session, owner).close()
            return pb.CloseResponse()

    def ReleaseOwner(
        self, request: pb.ReleaseOwnerRequest, context: grpc.ServicerContext
    ) -> pb.ReleaseOwnerResponse:
        with status_on_error(context):
            owner = owner_of(context.invocation_metadata())
            released = self.deps.registry.release_owner(owner, keep=request.keep)
            for r in released:
                r.value.close()
            return pb.ReleaseOwnerResponse(released=len(released))

    def ExportSession(
        self, request: pb.ExportSessionRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.SnapshotChunk]:
        with status_on_error(context):
            self._serving()
            owner = owner_of(context.invocation_metadata())
            yield from snapshot_calls.export_chunks(self.deps, request.session, owner, request.extra)

    def ImportSession(
        self, request_iterator: Iterator[pb.SnapshotChunk], context: grpc.ServicerContext
    ) -> pb.ImportSessionResponse:
        with status_on_error(context):
            self._serving()
            owner = owner_of(context.invocation_metadata())
            return snapshot_calls.import_chunks(self.deps, request_iterator, owner)

    def Describe(self, request: pb.DescribeRequest, context: grpc.ServicerContext) -> pb.DescribeResponse:
        with status_on_error(context):
            owner = owner_of(context.invocation_metadata())
            session = self.deps.registry.resolve(request.session, owner)
            generating = session.generating
            digest = None if generating else session.content_digest()  # changing while it generates
            return pb.DescribeResponse(
                position=session.position, generating=generating, content_digest=digest or b""
            )

    # -- model ---------------------------------------------------------------------------------
    def Info(self, request: pb.InfoRequest, context: grpc.ServicerContext) -> pb.InfoResponse:
        with status_on_error(context):
            d = self.deps
            owner = owner_of(context.invocation_metadata())
            load = d.runner.metrics()
            return engine_wire.info_message(
                EngineInfo(
                    instance_id=d.registry.instance_id,
                    fingerprint=d.fingerprint,
                    vocab_size=d.limits.vocab_size,
                    max_session_tokens=d.limits.max_session_tokens,
                    max_sessions=d.limits.max_sessions,
                    model=d.model_name,
                    cache_kind=d.cache_kind,
                    architecture=d.architecture,
                    eos_token_ids=d.eos_token_ids,
                    chat_template=d.chat is not None and d.chat.available,
                    idle_session_timeout_s=d.registry.idle_timeout_s,
                    client_quota=d.registry.quota,
                    persistent_quota=d.registry.persistent_quota,
                    caller=d.registry.usage(owner),
                    resident_sessions=d.runner.resident_sessions,
                    open_handles=len(d.registry),
                    active_generations=load.active_generations,
                    queued_commands=load.queued_commands,
                    window=d.runner.window_geometry or NO_WINDOW,
                    compute_path=d.runner.compute_path,
                    slow_path=d.runner.slow_path,
                )
            )

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        with status_on_error(context):
            return pb.TokenizeResponse(
                ids=convert.text_tokens(request.text, self.deps.tokenizer, self.deps.chat)
            )

    def Detokenize(
        self, request: pb.DetokenizeRequest, context: grpc.ServicerContext
    ) -> pb.DetokenizeResponse:
        with status_on_error(context):
            ids = convert.token_ids(request.ids, self.deps.limits.vocab_size, field="ids")
            return pb.DetokenizeResponse(text=self.deps.tokenizer.decode(ids))
