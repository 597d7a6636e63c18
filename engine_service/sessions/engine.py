"""EngineSessions: the engine's operations over a Runner, each for one owner, in ``api`` values --
what the gRPC servicer delegates to (no grpc, no protos, no MLX here).

Handles resolve in the :class:`HandleRegistry` with the caller's owner id. Quotas: every resident
session an owner has counts against its quota -- a fresh session for its call (kept: afterwards too),
held sessions, clones and snapshots -- reserved before anything is allocated. A generation reserves
``position + input + min(max_new_tokens, growth)`` (at most ``max_session_tokens``) and grows it as it
produces tokens, ending with ``length`` when its owner's quota has no room left (``reservation.py``);
a held session weighs its position. A clone or snapshot may go to another owner only to or from a persistent owner.
It counts against the client side: the receiving client (a persistent owner's clone for its caller),
or the giving client (a hand-over to a persistent owner) until the persistent owner claims it
(:meth:`EngineSessions.claim`, as the prefix service stores it) or it is released. After
:meth:`EngineSessions.drain` new work is ``Stopping``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_service.api.answers import (
    CloneRefusal,
    Described,
    ImportedSnapshot,
    TakenClone,
    close_child_when_done,
)
from engine_service.api.config import GenConfig
from engine_service.api.content import check_digest
from engine_service.api.engine_info import NO_WINDOW, EngineInfo
from engine_service.api.errors import Cancelled, FailedPrecondition, InvalidArgument, Stopping, Unavailable
from engine_service.api.limits import EngineLimits, check_tokens
from engine_service.api.owners import NO_QUOTA, PERSISTENT_OWNER, OwnerQuota, check_owner
from engine_service.api.prompts import TextPrompt
from engine_service.executors.grammar import with_grammar
from engine_service.model.text.token_bytes import token_bytes
from engine_service.persistence.snapshot_key import SnapshotKey
from engine_service.sessions.capture import SnapshotCapture
from engine_service.sessions.generation_call import GenerationCall
from engine_service.sessions.handles import HandleRegistry
from engine_service.sessions.inputs import Input, check_fits, fed_input, input_size, text_tokens
from engine_service.sessions.reservation import STEP_ROOM, GrowingReservation, default_growth
from engine_service.sessions.session_files import EncodedSession
from engine_service.sessions.transfer import SessionTransfer

if TYPE_CHECKING:  # annotations only: the model, tokenizer and runner are built by whoever builds these
    from engine_service.model.loading.loader import LoadedModel
    from engine_service.model.text.chat import ChatFormatter
    from engine_service.model.text.tokenizer import Tokenizer
    from engine_service.model.transformer import Transformer
    from engine_service.runtime.heartbeat import EngineHeartbeat
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session

CLONE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class GenerationRequest:
    """One generation: ``input`` fed to ``session`` ("": a fresh one, closed after the call unless
    ``keep_session``; a given one is closed after it with ``close_session``), sampling and
    breakpoints from ``config``; ``prompt_snapshot`` and the breakpoints are snapshots owned by
    ``snapshot_owner`` ("": the caller)."""

    input: Input
    config: GenConfig
    session: str = ""
    keep_session: bool = False
    close_session: bool = False
    prompt_snapshot: bool = False
    snapshot_owner: str = ""


@dataclass
class EngineSessions:
    """What the engine serves. ``runner`` is started and owned by whoever built this.

    limits: the executor's (published in Info, checked on input). registry: session handles (its
    instance id is the engine's). fingerprint: default the runner's. hidden_size: what prepared
    ``embeddings`` inputs must match (None: unchecked). reservation_growth: the positions a generation
    reserves beyond its input and adds as it grows (None: ``reservation.default_growth``).
    snapshot_key: signs exported snapshot files and verifies imported ones (None: unsigned files).
    """

    runner: Runner
    tokenizer: Tokenizer
    limits: EngineLimits
    model_name: str
    cache_kind: str
    eos_token_ids: tuple[int, ...] = ()
    chat: ChatFormatter | None = None
    registry: HandleRegistry[Session] = field(default_factory=HandleRegistry)
    fingerprint: str | None = None
    hidden_size: int | None = None
    architecture: str = ""
    reservation_growth: int | None = None
    snapshot_key: SnapshotKey | None = field(default=None, repr=False)
    heartbeat: EngineHeartbeat | None = field(default=None, repr=False)  # set by the server that runs it

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
        kv_dtype: str = "float32",
        idle_timeout_s: float = 0.0,
        persistent_owners: Iterable[str] = (PERSISTENT_OWNER,),
        eos_token_ids: tuple[int, ...] | None = None,
        prepared_inputs: bool = False,
        quota: OwnerQuota = NO_QUOTA,
        persistent_quota: OwnerQuota = NO_QUOTA,
        snapshot_key: SnapshotKey | None = None,
    ) -> EngineSessions:
        """An executor over ``model`` and a started Runner. ``prepared_inputs``: an EmbeddingsExecutor
        (also accepts ``embeddings`` inputs) instead of the raw-token ModuleExecutor. ``quota`` /
        ``persistent_quota``: what each client / persistent owner may hold (default: unlimited; the
        CLI's defaults: ``handles.engine_quotas``). ``snapshot_key``: signs and verifies snapshot files."""
        from engine_service.executors.embeddings import EmbeddingsExecutor
        from engine_service.executors.module import ModuleExecutor
        from engine_service.runtime.runner import Runner

        executor_cls = EmbeddingsExecutor if prepared_inputs else ModuleExecutor
        executor = executor_cls.create(
            model, cache_kind, max_sessions, max_session_tokens, kv_dtype, prefill_chunk=prefill_chunk
        )
        runner = Runner(executor, max_decode_sequences=max_decode_sequences)
        # the token byte table logprobs and json_schema need (0.3 s for 49k tokens, ~15 s for Gemma's
        # 262k on 2 busy cores), built while the engine starts rather than in the first such request
        threading.Thread(
            target=token_bytes, args=(tokenizer,), name="forkline-token-bytes", daemon=True
        ).start()
        return cls(
            runner=runner,
            tokenizer=tokenizer,
            limits=runner.limits,
            model_name=model_name,
            cache_kind=cache_kind,
            eos_token_ids=tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids,
            chat=chat,
            registry=HandleRegistry(
                idle_timeout_s=idle_timeout_s,
                persistent_owners=persistent_owners
                if isinstance(persistent_owners, frozenset)
                else frozenset(persistent_owners),
                quota=quota,
                persistent_quota=persistent_quota,
            ),
            hidden_size=executor.config.hidden_size,
            architecture=executor.config.architecture,
            snapshot_key=snapshot_key,
        )

    def __post_init__(self) -> None:
        if self.fingerprint is None:
            self.fingerprint = str(self.runner.fingerprint)
        if self.reservation_growth is None:
            self.reservation_growth = default_growth(self.limits.max_session_tokens)
        if self.reservation_growth < 2 * STEP_ROOM:
            raise InvalidArgument(
                f"reservation_growth must be >= {2 * STEP_ROOM}, got {self.reservation_growth}"
            )
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        self.transfer = SessionTransfer(
            self.runner, self.registry, self.limits.max_session_tokens, key=self.snapshot_key
        )
        self._draining = threading.Event()

    def drain(self) -> None:
        """From now on new work (generations, clones, imports) is refused (``Stopping``); calls in flight
        go on, and so do Info, Close, Describe and ExportSession (a prefix service writes its snapshot
        files before the engine goes)."""
        self._draining.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def _serving(self) -> None:
        if self._draining.is_set():
            raise Stopping("the engine is shutting down")

    # -- generation ----------------------------------------------------------------------------
    def generate(self, owner: str, request: GenerationRequest) -> GenerationCall:
        """Resolve (or open) the session, reserve what the call may hold, and return the call (its
        ``events`` start the generation; its ``finish`` must run however the call ends)."""
        self._serving()
        value = fed_input(request.input, self.tokenizer, self.chat, self.limits.vocab_size)
        # a json_schema compiled for this tokenizer now: an unsupported schema fails before anything runs
        config, size = with_grammar(request.config, self.tokenizer), input_size(value)
        snapshot_owner = self._receiver(owner, request.snapshot_owner, "capture.snapshot_owner")
        snapshot_payer = self._payer(owner, snapshot_owner)
        registry = self.registry
        if request.close_session and not request.session:
            raise InvalidArgument("close_session only applies to a given session (session is empty)")
        if request.session:
            if request.keep_session:
                raise InvalidArgument("keep_session only applies to a fresh session (session is set)")
            handle, fresh, session = request.session, False, registry.pin(request.session, owner)
        else:
            check_fits(0, size, config.prefill_breakpoints, self.limits)  # before anything is reserved
            handle, fresh = registry.reserve(owner, self._reservation("", 0, size, config).initial), True
            session = self._open(handle, owner)
        capture = SnapshotCapture(
            registry,
            session,
            snapshot_owner,
            payer=snapshot_payer,
            prompt_snapshot=request.prompt_snapshot,
            breakpoints=config.prefill_breakpoints,
        )
        try:
            if session.generating:
                raise FailedPrecondition(f"session {handle} is already generating")
            start = session.position + (1 if session.has_pending else 0)
            check_fits(start, size, config.prefill_breakpoints, self.limits)
            reservation = self._reservation(handle, start, size, config)
            registry.weigh(handle, reservation.initial, check=True)
            capture.reserve(start + size, owner)
        except BaseException:
            capture.release()
            registry.unpin(handle)
            if fresh:
                registry.discard(handle)
                session.close()
            raise
        return GenerationCall(
            registry=registry,
            handle=handle,
            session=session,
            fresh=fresh,
            keep_session=request.keep_session,
            close_session=request.close_session,
            tokenizer=self.tokenizer,
            input=value,
            config=config,
            capture=capture,
            reservation=reservation,
        )

    def _open(self, handle: str, owner: str) -> Session:
        """A fresh session into the reserved ``handle``, pinned for its call."""
        try:
            session = self.runner.open_session()
        except BaseException:
            self.registry.discard(handle)
            raise
        if not self.registry.fill(handle, session):
            session.close()
            raise Stopping("the engine is shutting down")
        self.registry.pin(handle, owner)
        return session

    def _reservation(self, handle: str, start: int, size: int, config: GenConfig) -> GrowingReservation:
        """What a generation of ``size`` input positions from ``start`` weighs in its owner's quota."""
        return GrowingReservation(
            self.registry,
            handle,
            start=start,
            size=size,
            max_new_tokens=config.max_new_tokens,
            max_session_tokens=self.limits.max_session_tokens,
            growth=self.reservation_growth or default_growth(self.limits.max_session_tokens),
        )

    def _receiver(self, owner: str, requested: str, field_name: str) -> str:
        """Who receives a clone or snapshot: the caller, or another owner when one of the two is a
        persistent owner (a client hands a snapshot to the prefix service, the prefix service a clone
        to its caller); any other hand-over is InvalidArgument."""
        if not requested or requested == owner:
            return owner
        receiver = check_owner(requested, field_name)
        persistent = self.registry.persistent_owners
        if owner not in persistent and receiver not in persistent:
            names = ", ".join(sorted(persistent)) or "none configured"
            raise InvalidArgument(
                f"{field_name} {receiver!r}: only a persistent owner ({names}) can receive "
                f"or give another owner's session"
            )
        return receiver

    def _payer(self, giver: str, receiver: str) -> str:
        """Whose quota a session ``giver`` makes for ``receiver`` counts in: the giver's when a client
        hands it to a persistent owner (until claimed), else the receiver's."""
        persistent = self.registry.persistent_owners
        return giver if receiver in persistent and giver not in persistent else receiver

    # -- sessions ------------------------------------------------------------------------------
    def clone(
        self,
        owner: str,
        handle: str,
        upto: int,
        *,
        new_owner: str = "",
        expected_digest: bytes = b"",
        wanted: Callable[[], bool] = lambda: True,
    ) -> TakenClone:
        """A new session holding ``[0, upto)`` of ``owner``'s ``handle``, for ``new_owner`` (default the
        caller; one handed to a persistent owner counts against the caller until claimed), only if
        that range holds ``expected_digest`` when given (b"": unchecked); or why not.
        ``wanted()`` False once the clone is made (the caller left): it is released, Cancelled."""
        self._serving()
        receiver = self._receiver(owner, new_owner, "new_owner")
        if upto < 0:
            raise InvalidArgument(f"upto must be >= 0, got {upto}")
        expected = check_digest(expected_digest, "expected_content_digest")
        source = self.registry.resolve(handle, owner)
        position = source.position
        if upto > position:
            return TakenClone(None, CloneRefusal.POSITION, detail=f"upto={upto} is outside [0, {position}]")
        # the payer's quota, before the clone
        child_handle = self.registry.reserve(receiver, upto, payer=self._payer(owner, receiver))
        try:
            future = source.clone_async(upto, expected)
            try:
                child = future.result(timeout=CLONE_TIMEOUT_S)
            except TimeoutError:  # concurrent.futures' is the builtin since 3.11
                close_child_when_done(future)  # nobody will receive it
                raise Unavailable(f"the clone did not complete within {CLONE_TIMEOUT_S} s") from None
        except BaseException:
            self.registry.discard(child_handle)
            raise
        if child is None:
            self.registry.discard(child_handle)
            return TakenClone(None, future.refusal or CloneRefusal.BOUNDARY)
        if not wanted():
            self.registry.discard(child_handle)
            child.close()
            raise Cancelled("the caller left before the clone completed")
        # a matched expected digest is the child's: no second hash
        digest = expected if expected is not None else child.content_digest()
        if not self.registry.fill(child_handle, child):
            child.close()
            raise Stopping("the engine is shutting down")
        return TakenClone(child_handle, content_digest=digest)

    def close(self, owner: str, handle: str) -> None:
        self.registry.remove(handle, owner).close()

    def claim(self, owner: str, handle: str) -> None:
        """``owner`` takes over the quota charge of its ``handle``, a session a client handed to it
        (which counted against that client until now); QuotaExceeded when ``owner`` has no room."""
        self._serving()
        self.registry.claim(handle, owner)

    def release_owner(self, owner: str, keep: Collection[str] = ()) -> int:
        """Close every session ``owner`` holds, or handed over and still pays for, except ``keep``;
        how many."""
        released = self.registry.release_owner(owner, keep=keep)
        for r in released:
            r.value.close()
        return len(released)

    def release_all(self) -> None:
        """Close every session a handle names (shutdown)."""
        for r in self.registry.release_all():
            r.value.close()

    def describe(self, owner: str, handle: str) -> Described:
        session = self.registry.resolve(handle, owner)
        generating = session.generating
        digest = None if generating else session.content_digest()  # changing while it generates
        return Described(session.position, digest, generating)

    def export_session(
        self, owner: str, handle: str, extra: Mapping[str, str], upto: int | None = None
    ) -> EncodedSession:
        return self.transfer.export(owner, handle, extra, upto)  # also while draining: nothing new is held

    def import_session(self, owner: str, chunks: Iterable[bytes]) -> ImportedSnapshot:
        self._serving()
        return self.transfer.import_(owner, chunks)

    # -- model ---------------------------------------------------------------------------------
    def info(self, owner: str) -> EngineInfo:
        load = self.runner.metrics()
        beat = self.heartbeat
        return EngineInfo(
            instance_id=self.registry.instance_id,
            fingerprint=str(self.fingerprint),
            vocab_size=self.limits.vocab_size,
            max_session_tokens=self.limits.max_session_tokens,
            max_sessions=self.limits.max_sessions,
            model=self.model_name,
            cache_kind=self.cache_kind,
            architecture=self.architecture,
            eos_token_ids=self.eos_token_ids,
            chat_template=self.chat is not None and self.chat.available,
            idle_session_timeout_s=self.registry.idle_timeout_s,
            client_quota=self.registry.quota,
            persistent_quota=self.registry.persistent_quota,
            caller=self.registry.usage(owner),
            resident_sessions=self.runner.resident_sessions,
            open_handles=len(self.registry),
            active_generations=load.active_generations,
            queued_commands=load.queued_commands,
            window=self.runner.window_geometry or NO_WINDOW,
            compute_path=self.runner.compute_path,
            slow_path=self.runner.slow_path,
            draining=self.draining,
            heartbeat_age_s=0.0 if beat is None else beat.age_s,
            heartbeat_longest_s=0.0 if beat is None else beat.longest_wait_s,
            pinned_exports=self.runner.pins_exports,
        )

    def tokenize(self, prompt: TextPrompt) -> list[int]:
        return text_tokens(prompt, self.tokenizer, self.chat)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(check_tokens(ids, self.limits.vocab_size, field="ids"))
