"""What the gateway needs from an engine: the engine calls it makes for a call to the prefix service."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine_service.api.answers import Described, TakenClone
from engine_service.api.call_context import CallContext
from engine_service.api.engine_info import EngineInfo
from engine_service.api.prompts import TextPrompt
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
    ends (a refused call leaves it). Empty ``config.stop_tokens``: EOS stops, unless ``ignore_eos``."""

    session: str
    tokens: tuple[int, ...]
    config: GenConfig
    ignore_eos: bool = False
    prompt_snapshot: bool = False
    call: CallContext | None = None
    close_session: bool = False


class EngineStream(Protocol):
    """A running engine Generate: iterating yields its events (a failed or cancelled call raises a
    ForklineError) and continues where an earlier iteration stopped; ``cancel()`` is idempotent."""

    def __iter__(self) -> Iterator[Event]: ...

    def __next__(self) -> Event: ...

    def cancel(self) -> None: ...


@runtime_checkable
class GatewayBackend(Protocol):
    """A remote engine as the gateway calls it; handles are engine session handle strings.

    ``sessions``: the same engine's handles as the cache holds them. ``refresh(info)`` adopts an Info
    (a new instance forgets every handle). ``await_serving(call)``: return once the engine serves
    (Unavailable when it stays down longer than ``call`` may wait). ``adopt``: record a handle the
    backend owns (a snapshot event's). ``tokenize`` / ``describe`` / ``take_clone`` / ``close_as``: as
    ``call``'s caller; ``take_clone`` with ``expected_digest`` clones only that content. ``clone_for``:
    a stored snapshot cloned into ``call``'s owner's session. ``claim``: take over the quota charge of
    a handle handed to the backend (QuotaExceeded when its budget has no room). ``reclaim``: release
    what the backend's owner holds and does not know; how many. ``snapshot_files(call)``: the tier's
    files for ``call`` (None: an engine without them)."""

    @property
    def owner(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def sessions(self) -> SessionBackend: ...

    def info(self, call: CallContext | None = None) -> EngineInfo: ...

    def refresh(self, info: EngineInfo | None = None) -> EngineInfo: ...

    def await_serving(self, call: CallContext | None = None) -> None: ...

    def adopt(self, handle: str, position: int, content_digest: bytes | None = None) -> None: ...

    def snapshot_files(self, call: CallContext | None = None) -> SnapshotBackend | None: ...

    def tokenize(self, text: TextPrompt, call: CallContext) -> list[int]: ...

    def describe(self, session: str, call: CallContext) -> Described: ...

    def take_clone(
        self, session: str, upto: int, call: CallContext, expected_digest: bytes | None = None
    ) -> TakenClone: ...

    def clone_for(self, handle: str, upto: int, call: CallContext) -> TakenClone: ...

    def close_as(self, session: str, call: CallContext | None = None) -> None: ...

    def generate(self, request: EngineGenerate) -> EngineStream: ...

    def claim(self, handle: str, call: CallContext | None = None) -> None: ...

    def reclaim(self, call: CallContext | None = None) -> int: ...
