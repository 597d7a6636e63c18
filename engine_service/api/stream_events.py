"""The events of an engine Generate stream as domain values (no protos), in the order they come.

:class:`Started` first, then :class:`Tokens` and :class:`Snapshot` events, then :class:`Done` (a
failed generation ends with an error instead). The rpc layer converts them to and from
``GenerateEvent`` messages; clients and the prefix gateway read these types.

A snapshot's ``kind`` says why it was taken where it was (``engine_service/snapshot_kinds.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Started:
    """The generation runs on ``session``, which held ``position`` positions (reused, not
    recomputed); ``input_positions`` will be prefilled."""

    session: str
    position: int
    input_positions: int


@dataclass(frozen=True)
class Tokens:
    """New tokens, in order, and the text they add."""

    ids: tuple[int, ...]
    text: str


@dataclass(frozen=True)
class Snapshot:
    """A session holding ``[0, position)`` cloned for the caller (``handle`` None: refused, see
    ``refusal``). ``kind``: ``snapshot_kinds.PROMPT`` or ``BREAKPOINT``. ``content_digest``: the
    engine's ``content.content_digest`` of what the session holds (None when refused, or when it
    holds a prepared input). ``reason``: why it was refused (a ``runtime.clone.CloneRefusal`` value;
    None when it was not)."""

    handle: str | None
    position: int
    kind: str
    refusal: str = ""
    content_digest: bytes | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Done:
    """The last event: why the generation finished, what it processed, and its timings."""

    finish_reason: str
    prompt_positions: int
    reused_positions: int
    generated_tokens: int
    position: int
    time_to_first_token_s: float
    decode_tokens_per_s: float
    total_s: float
    engine: str = ""  # set by the prefix service's gateway: the engine that served (its name there)


Event = Started | Tokens | Snapshot | Done
