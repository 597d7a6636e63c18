"""The values of gateway calls, shared by the gateway, the fleet and the doors (rpc/, http/): a request,
a lookup's answer, the events a client reads, the stats."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from engine_service.api.config import GenConfig
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Done, Started, Tokens
from prefix_service.cache.budget import DEFAULT_ENGINE_SHARE
from prefix_service.cache.outcomes import LookupOutcome, PrefixStats
from prefix_service.gateway.inflight import JoinStats

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
    """One gateway Generate: ``prompt`` under ``namespace``, sampled and stopped per ``config``."""

    namespace: str
    prompt: Prompt
    config: GenConfig
    ignore_eos: bool = False  # see ``EngineGenerate``
    store_prompt: bool = True  # store the prompt snapshot (its checkpoints, the generated one)
    metadata: Mapping[str, str] = field(default_factory=dict)
    # where the messages of the chat a token-id ``prompt`` was tokenized from end (the fleet tokenizes
    # to route and asks the engine for them): checkpoints on an engine whose window evicts rows
    message_ends: tuple[int, ...] = ()
    # explicit prefill breakpoints (positions in the tokenized prompt, an API's cache_control): a
    # snapshot is stored at each one past the reused prefix, on any engine (``generation_start.py``)
    breakpoints: tuple[int, ...] = ()
    count_lookup: bool = True  # False: a further choice of a counted request (an HTTP ``n``)
    # False once the client left (a wait for a prefix in flight ends then: ``inflight.py``)
    caller_active: Callable[[], bool] = field(default=lambda: True, compare=False, repr=False)


@dataclass(frozen=True)
class GatewayStats:
    """The cache's counters plus the service's."""

    cache: PrefixStats
    dropped_on_restart: int  # entries dropped on engine restarts
    engine_instance_id: str  # the instance the entries belong to
    policy: str  # the retention policy's name
    engine_share: float = DEFAULT_ENGINE_SHARE
    pressure_evictions: int = 0  # entries evicted for a live request (a full engine)
    pressure_retries: int = 0
    reclaimed: int = 0  # unknown handles released
    misses_by_reason: dict[str, int] = field(default_factory=dict)  # as told the callers: sum = cache.misses
    joins: JoinStats = field(default_factory=JoinStats)  # waits for prefixes in flight (``inflight.py``)
