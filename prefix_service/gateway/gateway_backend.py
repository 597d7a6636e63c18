"""What the gateway needs from an engine: the engine calls it makes for a call to the prefix service."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine_service.api.answers import Described, TakenClone
from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo
from engine_service.api.prompts import TextPrompt, Tokenized
from engine_service.api.stream_events import Event
from prefix_service.cache.session_backend import SessionBackend
from prefix_service.tier.snapshot_backend import SnapshotBackend

if TYPE_CHECKING:
    from engine_service.api.config import GenConfig


@dataclass(frozen=True)
class EngineGenerate:
    """One engine Generate: feed ``tokens`` to ``session`` ("" opens a fresh one) for ``call`` (its
    caller's quota; None: the backend's own). ``prompt_snapshot``: the engine sends a ``Snapshot`` of
    the prompt end, owned by the backend. ``close_session``: the engine closes ``session`` as the call
    ends (a refused call leaves it). Empty ``config.stop_tokens``: EOS stops, unless ``ignore_eos``.
    ``final_snapshot``: also a ``Snapshot`` (kind GENERATED) at the last committed token, before Done;
    ``checkpoint_every`` N: one every N generated tokens too (decode checkpoints)."""

    session: str
    tokens: tuple[int, ...]
    config: GenConfig
    ignore_eos: bool = False
    prompt_snapshot: bool = False
    call: CallContext | None = None
    close_session: bool = False
    final_snapshot: bool = False
    checkpoint_every: int = 0


class EngineStream(Protocol):
    """A running engine Generate: iterating yields its events (a failed or cancelled call raises a
    ForklineError) and continues where an earlier iteration stopped; ``cancel()`` is idempotent."""

    def __iter__(self) -> Iterator[Event]: ...

    def __next__(self) -> Event: ...

    def cancel(self) -> None: ...


@runtime_checkable
class GatewayBackend(Protocol):
    """A remote engine as the gateway calls it; handles are engine session handle strings. Calls made
    for ``call`` carry its deadline; ``tokenize``, ``describe``, ``take_clone``, ``close_as`` and
    ``generate`` run as its caller (credential forwarded), the others as the backend's owner."""

    @property
    def owner(self) -> str: ...  # the backend's owner id in the engine (it holds the stored snapshots)

    @property
    def instance_id(self) -> str: ...  # the engine instance its handles belong to, as last refreshed

    @property
    def sessions(self) -> SessionBackend: ...  # the same engine's handles as the cache holds them

    def info(self, call: CallContext | None = None) -> EngineInfo: ...

    def refresh(
        self, info: EngineInfo | None = None
    ) -> EngineInfo: ...  # a new instance forgets every handle

    # return once the engine serves; Unavailable when it stays down longer than ``call`` may wait
    def await_serving(self, call: CallContext | None = None) -> None: ...

    # record a handle the backend owns (a snapshot event's) and what the engine said it holds
    def adopt(self, handle: str, position: int, content_digest: bytes | None = None) -> None: ...

    def snapshot_files(self, call: CallContext | None = None) -> SnapshotBackend | None: ...  # None: none

    # ids, and where the latest ``message_ends`` messages of a chat prompt end (one engine call)
    def tokenize(self, text: TextPrompt, call: CallContext, message_ends: int = 0) -> Tokenized: ...

    def detokenize(self, ids: Sequence[int], call: CallContext) -> str: ...  # the engine's text of ``ids``

    def describe(self, session: str, call: CallContext) -> Described: ...

    # the caller's session cloned into one the backend owns; with ``expected_digest`` only that content
    def take_clone(
        self, session: str, upto: int, call: CallContext, expected_digest: bytes | None = None
    ) -> TakenClone: ...

    def clone_for(self, handle: str, upto: int, call: CallContext) -> TakenClone: ...  # into call's owner's

    def close_as(self, session: str, call: CallContext | None = None) -> None: ...

    def generate(self, request: EngineGenerate) -> EngineStream: ...

    # take over the quota charge of a handle handed to the backend (QuotaExceeded: its budget is full)
    def claim(self, handle: str, call: CallContext | None = None) -> None: ...

    def reclaim(self, call: CallContext | None = None) -> int: ...  # release what it holds and does not know
