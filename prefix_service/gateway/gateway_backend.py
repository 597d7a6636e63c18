"""What the gateway needs from an engine, beyond the cache's
:class:`~prefix_service.cache.session_backend.SessionBackend`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from engine_service.api.answers import Described, TakenClone
from engine_service.api.engine_info import EngineInfo
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Event
from prefix_service.cache.session_backend import SessionBackend

if TYPE_CHECKING:
    from engine_service.api.config import GenConfig


@dataclass(frozen=True)
class EngineGenerate:
    """One engine Generate call: feed ``tokens`` to ``session`` ("" opens a fresh session).

    ``config.stop_tokens`` empty means the engine's EOS tokens stop the generation, unless
    ``ignore_eos``. ``prompt_snapshot``: the engine clones the session at the end of the prompt and
    sends the handle (owned by the backend's owner) as a ``Snapshot`` event. ``owner``: the caller
    the generation runs for (its session counts against that owner's engine quota; "": the backend).
    ``close_session``: the engine closes ``session`` when the call ends, however it ends (a refused
    call leaves it).
    """

    session: str
    tokens: tuple[int, ...]
    config: GenConfig
    ignore_eos: bool = False
    prompt_snapshot: bool = False
    owner: str = ""
    close_session: bool = False


class EngineStream(Protocol):
    """A running engine Generate call. Iterating yields its events (``Started``, ``Tokens``,
    ``Snapshot``: a handle owned by the backend's owner, ``Done``) and continues where an earlier
    iteration stopped; a failed or cancelled call raises a ForklineError. ``cancel()`` ends it from
    any thread; it is idempotent."""

    def __iter__(self) -> Iterator[Event]: ...

    def __next__(self) -> Event: ...

    def cancel(self) -> None: ...


@runtime_checkable
class GatewayBackend(SessionBackend, Protocol):
    """A remote engine as the gateway uses it; handles are engine session handle strings.

    ``owner``: this backend's owner id in the engine (it holds the stored snapshots).
    ``instance_id``: the engine instance its handles belong to (as of the last ``refresh``).
    ``info()``: the engine's current identity and limits; ``refresh(info=None)`` adopts them (read
    now when not given; a new instance forgets every handle of the old one). ``await_serving()``: return once the engine serves
    (at once while it does), Unavailable when it stays down longer than the current call may wait;
    no engine call. ``cloning_for(owner)``: within the block,
    ``clone`` gives new sessions to ``owner`` (a lookup clones for its caller).
    ``adopt(handle, position, content_digest)``: record a handle this backend owns (a snapshot
    event's) with what the engine reported it holds (``content_digest`` answers it afterwards).
    ``tokenize(text, owner)``, ``describe(session, owner) -> Described``: engine calls as ``owner``.
    ``take_clone(session, upto, owner, expected_digest)``: clone the caller's session (as ``owner``)
    into a session this backend owns and adopts; with ``expected_digest`` the engine clones only if
    ``[0, upto)`` holds exactly that content (checked atomically there). ``close_as(session, owner)``:
    close as ``owner`` (default: this backend); errors propagate. ``generate(request)``: start an
    engine Generate call (as ``request.owner``). ``claim(handle)``: take over the engine quota charge
    of a handle a caller handed to this backend's owner (a take_clone's, a snapshot event's), which
    counts against that caller until then (QuotaExceeded when the owner's budget has no room).
    ``reclaim()``: release what this backend's owner holds in the engine that the backend does not
    know (e.g. clones a client handed to it); how many.
    """

    @property
    def owner(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    def info(self) -> EngineInfo: ...

    def refresh(self, info: EngineInfo | None = None) -> EngineInfo: ...

    def await_serving(self) -> None: ...

    def cloning_for(self, owner: str) -> contextlib.AbstractContextManager[None]: ...

    def adopt(self, handle: str, position: int, content_digest: bytes | None = None) -> None: ...

    def tokenize(self, text: TextPrompt, owner: str) -> list[int]: ...

    def describe(self, session: str, owner: str) -> Described: ...

    def take_clone(
        self, session: str, upto: int, owner: str, expected_digest: bytes | None = None
    ) -> TakenClone: ...

    def close_as(self, session: str, owner: str | None = None) -> None: ...

    def generate(self, request: EngineGenerate) -> EngineStream: ...

    def claim(self, handle: str) -> None: ...

    def reclaim(self) -> int: ...
