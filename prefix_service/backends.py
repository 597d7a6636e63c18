"""Backends: what the prefix cache and its gateway need from an engine.

The prefix cache treats snapshot handles as opaque: it only clones, closes and inspects them through
a :class:`SessionBackend`. The in-process adapter (``engine_service/sessions/local_backend.py``, which
the CLI wires in) uses engine Session objects as handles; the remote adapter
(``prefix_service/rpc/engine_backend.py``) uses engine session handle strings over gRPC. Both publish
the engine ``fingerprint`` so cache keys never cross models or execution configurations.

The gateway (``gateway.py``) needs more of a remote engine: :class:`GatewayBackend` adds its identity
(``api.engine_info.EngineInfo``), tokenizing, describing and closing sessions on behalf of a caller, and a
Generate call (:class:`EngineGenerate`) answered by a cancellable :class:`EngineStream` of the
engine's stream events (``engine_service/api/stream_events.py``). These are domain types: the rpc layer
converts them to and from protos.

Threading: ``clone`` blocks until the engine answers, so it must never run on the engine thread
(never from a generation callback). ``clone_async`` only queues and is safe there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from engine_service.api.answers import Described, ImportedSnapshot, TakenClone
from engine_service.api.engine_info import EngineInfo
from engine_service.api.errors import ForklineError
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Event

if TYPE_CHECKING:  # runtime import would tie the prefix cache to the engine package layout
    from engine_service.api.config import GenConfig

Handle = Any


@runtime_checkable
class SessionBackend(Protocol):
    """Clone / close / inspect opaque session handles.

    ``clone(handle, upto)``: a new, independent handle holding exactly ``[0, upto)`` of ``handle``, or
    None when refused (boundary unavailable, no room, stopping). A refusal never changes ``handle``.
    ``close(handle)``: release it; closing an already-closed or dead handle is a no-op.
    ``position(handle)``: committed positions. ``valid(handle)``: False once closed or its engine died.
    ``content_digest(handle)``: the engine's ``content.content_digest`` of the token ids the handle's
    committed positions hold (the engine's own record, never the caller's word); None when they hold
    a prepared input. ``fingerprint``: engine model + configuration identity (part of every cache key).
    """

    @property
    def fingerprint(self) -> str: ...

    def clone(self, handle: Handle, upto: int) -> Handle | None: ...

    def close(self, handle: Handle) -> None: ...

    def position(self, handle: Handle) -> int: ...

    def valid(self, handle: Handle) -> bool: ...

    def content_digest(self, handle: Handle) -> bytes | None: ...


@runtime_checkable
class CaptureBackend(SessionBackend, Protocol):
    """A backend that can queue a clone from inside a generation callback (prompt capture).

    ``clone_async(handle, upto)`` enqueues the clone and returns at once; the future settles with the
    new handle or None. Dropping the future unresolved must release a successful child.
    """

    def clone_async(self, handle: Handle, upto: int) -> Future: ...


def clone_with_refusal(backend: SessionBackend, handle: Handle, upto: int) -> TakenClone:
    """``backend.clone``, with the engine's reason when it refused: a backend that can say why
    implements ``clone_or_refusal(handle, upto) -> TakenClone`` (the in-process and the remote
    engine do); any other answers ``TakenClone(child)`` / ``TakenClone(None)``."""
    says_why = getattr(backend, "clone_or_refusal", None)
    if says_why is not None:
        return says_why(handle, upto)
    return TakenClone(backend.clone(handle, upto))


def max_rewind(backend: SessionBackend) -> int | None:
    """How far below a snapshot's own length a clone of it can reach on this backend's engine:
    ``max_write`` when its cache evicts sliding-window rows (``batched-sequence`` with sliding layers:
    the clone floor is the snapshot's high-water mark, at least its length, minus ``max_write``), None
    when any committed position can be cloned (``batched-cell``, no sliding layers) or the backend
    does not say (its optional ``max_rewind`` attribute)."""
    value = getattr(backend, "max_rewind", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def handle_alive(backend: SessionBackend, handle: Handle) -> bool:
    """``backend.valid(handle)``; a failing engine call (e.g. the engine stopped) counts as dead."""
    try:
        return bool(backend.valid(handle))
    except ForklineError:
        return False


def release_handle(backend: SessionBackend, handle: Handle) -> None:
    """Close ``handle``; one already gone with its engine has nothing left to release."""
    with contextlib.suppress(ForklineError):
        backend.close(handle)


# -- the gateway's engine ----------------------------------------------------------------------


@runtime_checkable
class SnapshotBackend(Protocol):
    """An engine that exports and imports snapshot files (the persistent tier, ``snapshot_store.py``).

    ``export_session(handle, extra)``: the file of a handle this backend owns, as chunks of bytes
    (``extra``: strings stored in it), or None when the engine refused (prepared input, boundary).
    ``import_session(chunks)``: load a file into a new session this backend owns."""

    def export_session(self, handle: str, extra: Mapping[str, str]) -> Iterator[bytes] | None: ...

    def import_session(self, chunks: Iterable[bytes]) -> ImportedSnapshot: ...


@dataclass(frozen=True)
class EngineGenerate:
    """One engine Generate call: feed ``tokens`` to ``session`` ("" opens a fresh session).

    ``config.stop_tokens`` empty means the engine's EOS tokens stop the generation, unless
    ``ignore_eos``. ``prompt_snapshot``: the engine clones the session at the end of the prompt and
    sends the handle (owned by the backend's owner) as a ``Snapshot`` event. ``owner``: the caller
    the generation runs for (its session counts against that owner's engine quota; "": the backend).
    """

    session: str
    tokens: tuple[int, ...]
    config: GenConfig
    ignore_eos: bool = False
    prompt_snapshot: bool = False
    owner: str = ""


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
    ``info()``: the engine's current identity and limits; ``refresh()`` also adopts them (a new
    instance forgets every handle of the old one). ``cloning_for(owner)``: within the block,
    ``clone`` gives new sessions to ``owner`` (a lookup clones for its caller).
    ``adopt(handle, position, content_digest)``: record a handle this backend owns (a snapshot
    event's) with what the engine reported it holds (``content_digest`` answers it afterwards).
    ``tokenize(text, owner)``, ``describe(session, owner) -> Described``: engine calls as ``owner``.
    ``take_clone(session, upto, owner, expected_digest)``: clone the caller's session (as ``owner``)
    into a session this backend owns and adopts; with ``expected_digest`` the engine clones only if
    ``[0, upto)`` holds exactly that content (checked atomically there). ``close_as(session, owner)``:
    close as ``owner`` (default: this backend); errors propagate. ``generate(request)``: start an
    engine Generate call (as ``request.owner``). ``reclaim()``: release what this backend's owner
    holds in the engine that the backend does not know (e.g. clones a client handed to it); how many.
    """

    @property
    def owner(self) -> str: ...

    @property
    def instance_id(self) -> str: ...

    def info(self) -> EngineInfo: ...

    def refresh(self) -> EngineInfo: ...

    def cloning_for(self, owner: str) -> contextlib.AbstractContextManager[None]: ...

    def adopt(self, handle: str, position: int, content_digest: bytes | None = None) -> None: ...

    def tokenize(self, text: TextPrompt, owner: str) -> list[int]: ...

    def describe(self, session: str, owner: str) -> Described: ...

    def take_clone(
        self, session: str, upto: int, owner: str, expected_digest: bytes | None = None
    ) -> TakenClone: ...

    def close_as(self, session: str, owner: str | None = None) -> None: ...

    def generate(self, request: EngineGenerate) -> EngineStream: ...

    def reclaim(self) -> int: ...
