"""The values of gateway calls, shared by the gateway, the fleet and the doors (rpc/, http/): a request,
a lookup's answer, the events a client reads, the stats."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from engine_service.api.config import GenConfig
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Done, Started, Tokens
from prefix_service.cache.budget import DEFAULT_ENGINE_SHARE
from prefix_service.cache.outcomes import LookupOutcome, PrefixStats

Prompt = Sequence[int] | TextPrompt  # token ids, or text the engine tokenizes
GatewayEvent = Started | Tokens | Done  # what a gateway stream hands its client (snapshots stay here)


@dataclass(frozen=True)
class PromptLookup:
    """A lookup's answer: the prompt's ``tokens`` (the text's tokenization) and the ``outcome``;
    ``engine``: the engine that holds the match (set by the fleet)."""

    tokens: tuple[int, ...]
    outcome: LookupOutcome
    engine: str = ""


@dataclass(frozen=True)
class GatewayRequest:
    """One gateway Generate: ``prompt`` under ``namespace``, sampled and stopped per ``config``
    (``ignore_eos``: see ``EngineGenerate``). ``store_prompt``: insert the prompt snapshot (and its
    checkpoints). ``source``: the text ``prompt`` was tokenized from when ``prompt`` is already token
    ids (the fleet tokenizes to route): a chat prompt's message ends become checkpoints.
    ``count_lookup``: False for a further choice of a request whose first choice's lookup was counted
    (an HTTP ``n``): its lookup clones as usual but adds nothing to the hit / miss counters."""

    namespace: str
    prompt: Prompt
    config: GenConfig
    ignore_eos: bool = False
    store_prompt: bool = True
    metadata: Mapping[str, str] = field(default_factory=dict)
    source: TextPrompt | None = None
    count_lookup: bool = True


@dataclass(frozen=True)
class GatewayStats:
    """The cache's counters plus the service's: entries dropped on engine restarts, the engine
    instance the entries belong to, the retention policy's name, the share of the engine, entries
    evicted and requests retried under pressure, unknown handles reclaimed, and lookup misses by
    the reason the caller was told (``MissReason`` values; they add up to ``cache.misses``)."""

    cache: PrefixStats
    dropped_on_restart: int
    engine_instance_id: str
    policy: str
    engine_share: float = DEFAULT_ENGINE_SHARE
    pressure_evictions: int = 0
    pressure_retries: int = 0
    reclaimed: int = 0
    misses_by_reason: dict[str, int] = field(default_factory=dict)
