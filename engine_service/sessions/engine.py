"""EngineSessions: the engine's operations over a Runner, each for one owner, in ``api`` values (what
the gRPC servicer delegates to). Spec: docs/ENGINE.md, docs/SECURITY.md."""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_service.api import prompts
from engine_service.api.answers import Described, ImportedSnapshot, TakenClone
from engine_service.api.checks import checked_int
from engine_service.api.content import check_digest
from engine_service.api.engine_info import NO_WINDOW, EngineInfo
from engine_service.api.errors import InvalidArgument, Stopping
from engine_service.api.limits import EngineLimits, check_tokens
from engine_service.api.prompts import MAX_MESSAGE_ENDS, TextPrompt, Tokenized, text_tokens
from engine_service.executors.options import DEFAULTS, ExecutorSettings
from engine_service.model.text.token_bytes import token_bytes
from engine_service.persistence.snapshot_key import SnapshotKey
from engine_service.sessions.clones import take_clone
from engine_service.sessions.generation_call import GenerationCall
from engine_service.sessions.generations import GenerationRequest, start_generation
from engine_service.sessions.handles import HandleRegistry
from engine_service.sessions.ownership import payer_of, receiver_of
from engine_service.sessions.reservation import STEP_ROOM, default_growth
from engine_service.sessions.session_files import EncodedSession
from engine_service.sessions.settings import SessionSettings
from engine_service.sessions.transfer import SessionTransfer

if TYPE_CHECKING:  # annotations only: the model, tokenizer and runner are built by whoever builds these
    from engine_service.model.loading.loader import LoadedModel
    from engine_service.model.text.chat import ChatFormatter
    from engine_service.model.text.tokenizer import Tokenizer
    from engine_service.model.transformer import Transformer
    from engine_service.runtime.heartbeat import EngineHeartbeat
    from engine_service.runtime.runner import Runner
    from engine_service.runtime.session import Session

__all__ = ["EngineSessions", "GenerationRequest"]


@dataclass
class EngineSessions:
    """What the engine serves over ``runner`` (started and owned by whoever built this). None fields
    default to the runner's fingerprint, ``default_growth``, unchecked embeddings, unsigned files."""

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
    role: str = "both"  # --role, reported in Info
    speculative: str = "off"  # --speculative and --num_drafts (0: off), reported in Info
    num_drafts: int = 0
    heartbeat: EngineHeartbeat | None = field(default=None, repr=False)  # set by the server that runs it

    @classmethod
    def build(
        cls,
        model: Transformer | LoadedModel,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        chat: ChatFormatter | None = None,
        executor: ExecutorSettings = DEFAULTS,
        sessions: SessionSettings = SessionSettings(),  # noqa: B008 - frozen: one shared default is safe
    ) -> EngineSessions:
        """An executor over ``model`` (an EmbeddingsExecutor with ``sessions.prepared_inputs``, else a
        ModuleExecutor) and a started Runner; the defaults are ``forkline-engine``'s."""
        from engine_service.executors.embeddings import EmbeddingsExecutor
        from engine_service.executors.module import ModuleExecutor
        from engine_service.runtime.runner import Runner

        executor_cls, extra = speculative_executor(executor, sessions.prepared_inputs)
        executor_cls = executor_cls or (EmbeddingsExecutor if sessions.prepared_inputs else ModuleExecutor)
        built = executor_cls.create(
            model,
            executor.cache_kind,
            executor.max_sessions,
            executor.max_session_tokens,
            executor.kv_dtype,
            prefill_chunk=executor.prefill_chunk,
            kv_memory_mib=executor.kv_memory_mib,
            **extra,
        )
        runner = Runner(
            built,
            max_decode_sequences=executor.max_decode_sequences,
            shared_batch_tokens=executor.shared_batch_tokens,
        )
        # the token byte table logprobs and json_schema need (0.3 s for 49k tokens, ~15 s for Gemma's
        # 262k on 2 busy cores), built while the engine starts rather than in the first such request
        threading.Thread(
            target=token_bytes, args=(tokenizer,), name="forkline-token-bytes", daemon=True
        ).start()
        quota, persistent_quota = sessions.quotas(executor)
        eos = sessions.eos_token_ids
        return cls(
            runner=runner,
            tokenizer=tokenizer,
            limits=runner.limits,
            model_name=model_name,
            cache_kind=executor.cache_kind,
            eos_token_ids=tokenizer.eos_token_ids if eos is None else eos,
            chat=chat,
            registry=HandleRegistry(
                idle_timeout_s=sessions.idle_timeout_s,
                persistent_owners=sessions.persistent_owners,
                quota=quota,
                persistent_quota=persistent_quota,
                max_positions=runner.limits.max_positions,
            ),
            hidden_size=built.config.hidden_size,
            architecture=built.config.architecture,
            snapshot_key=sessions.snapshot_key,
            role=sessions.role,
            speculative=executor.speculative,
            num_drafts=executor.num_drafts if executor.speculative != "off" else 0,
        )

    def __post_init__(self) -> None:
        if self.fingerprint is None:
            self.fingerprint = str(self.runner.fingerprint)
        if self.reservation_growth is None:
            self.reservation_growth = default_growth(self.limits.max_session_tokens)
        checked_int("reservation_growth", self.reservation_growth, lo=2 * STEP_ROOM)
        self.eos_token_ids = tuple(int(t) for t in self.eos_token_ids)
        self.transfer = SessionTransfer(
            self.runner, self.registry, self.limits.max_session_tokens, key=self.snapshot_key
        )
        self._draining = threading.Event()

    def drain(self) -> None:
        """Refuse new work (``Stopping``); calls in flight, Info, Close, Describe and exports go on."""
        self._draining.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def _serving(self) -> None:
        if self._draining.is_set():
            raise Stopping("the engine is shutting down")

    # -- generation ----------------------------------------------------------------------------
    def generate(self, owner: str, request: GenerationRequest) -> GenerationCall:
        """The call (``generations.start_generation``); its ``finish`` must run however it ends."""
        self._serving()
        return start_generation(self, owner, request)

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
        """A session holding ``[0, upto)`` of ``handle`` for ``new_owner`` (default the caller), if it
        holds ``expected_digest`` (b"": unchecked); or why not (``clones.take_clone``)."""
        self._serving()
        persistent = self.registry.persistent_owners
        receiver = receiver_of(owner, new_owner, "new_owner", persistent)
        checked_int("upto", upto, lo=0)
        expected = check_digest(expected_digest, "expected_content_digest")
        source = self.registry.resolve(handle, owner)
        payer = payer_of(owner, receiver, persistent)
        return take_clone(
            self.registry, source, upto, expected, receiver=receiver, payer=payer, wanted=wanted
        )

    def close(self, owner: str, handle: str) -> None:
        self.registry.remove(handle, owner).close()

    def claim(self, owner: str, handle: str) -> None:
        """``owner`` takes over the quota charge of a session a client handed it; QuotaExceeded."""
        self._serving()
        self.registry.claim(handle, owner)

    def release_owner(self, owner: str, keep: Collection[str] = (), *, paid_only: bool = False) -> int:
        """Close what ``owner`` holds or still pays for (``paid_only``: pays for), except ``keep``; how many."""
        released = self.registry.release_owner(owner, keep=keep, paid_only=paid_only)
        for r in released:
            r.value.close()
        return len(released)

    def release_all(self) -> None:
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
            max_positions=self.limits.max_positions,
            kv_bytes_per_position=self.limits.kv_bytes_per_position,
            clone_shared_bytes_per_position=self.limits.clone_shared_bytes_per_position,
            clone_shared_ring_positions=self.limits.clone_shared_ring_positions,
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
            role=self.role,
            speculative=self.speculative,
            num_drafts=self.num_drafts,
            draft_tokens=self.runner.draft_counts[0],
            accepted_draft_tokens=self.runner.draft_counts[1],
        )

    def tokenize(self, prompt: TextPrompt, message_ends: int = 0, owner: str = "") -> Tokenized:
        """``prompt``'s ids and, for a chat prompt, where its latest ``message_ends`` messages end
        (through ``owner``'s cache of text pieces)."""
        most = checked_int("message_ends", message_ends, lo=0, hi=MAX_MESSAGE_ENDS)  # renders cost O(ends)
        encoder = self.tokenizer.scoped(owner)
        ids = text_tokens(prompt, encoder, self.chat)
        ends = prompts.message_ends(prompt, ids, encoder, self.chat, most) if prompt.chat else ()
        return Tokenized(tuple(ids), ends)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(check_tokens(ids, self.limits.vocab_size, field="ids"))


def speculative_executor(settings: ExecutorSettings, prepared_inputs: bool) -> tuple[type | None, dict]:
    """The executor class ``--speculative`` asks for and its keywords ((None, {}): the plain one)."""
    if settings.speculative == "off":
        return None, {}
    if prepared_inputs:
        raise InvalidArgument("--speculative works on token inputs only: not with --prepared_inputs")
    from engine_service.executors.prompt_lookup import PromptLookupExecutor

    return PromptLookupExecutor, {
        "num_drafts": settings.num_drafts,
        "suffix": settings.speculative == "suffix",
    }
