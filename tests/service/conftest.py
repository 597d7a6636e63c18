"""Service fixtures: real gRPC servers on 127.0.0.1 port 0 over a tiny seeded model.

The tiny model has a 128-token vocabulary; :func:`char_tokenizer` maps ids 3..127 to the ASCII
characters with those codes (one token per character, so tests can reason about positions), with
``<unk>`` 0, ``<bos>`` 1 and ``<eos>`` 2 (the tiny model's BOS / EOS).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

import engine_service  # noqa: F401  (OpenBLAS before mlx)
from engine_service.api.owners import NO_QUOTA, OwnerQuota
from engine_service.executors.options import ExecutorSettings
from engine_service.model.random_init import random_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.model.text.tokenizer import Tokenizer
from engine_service.persistence.snapshot_key import SnapshotKey
from engine_service.rpc.server import EngineServer, create_server
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED, SessionSettings
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import PrefixServer
from prefix_service.rpc.server import create_server as create_prefix_server

SPECIALS = {"<unk>": 0, "<bos>": 1, "<eos>": 2}


def char_tokenizer() -> Tokenizer:
    vocab = dict(SPECIALS) | {chr(i): i for i in range(3, 128)}
    backend = HFTokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIALS))
    return Tokenizer(backend, bos_token_id=1, eos_token_ids=(2,), add_bos=True)


@dataclass
class Engine:
    """An in-process engine server. ``address`` is ``127.0.0.1:port``."""

    server: EngineServer
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def deps(self) -> EngineSessions:
        return self.server.deps

    @property
    def runner(self):
        return self.server.deps.runner

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace, shutdown_runner=True)


def start_engine(
    *,
    port: int = 0,
    cache_kind: str = "batched-sequence",
    max_sessions: int = 8,
    max_session_tokens: int = 256,
    idle_timeout_s: float = 0.0,
    layers: str = "FRFR",
    seed: int = 0,
    prepared_inputs: bool = False,
    quota: OwnerQuota = NO_QUOTA,
    persistent_quota: OwnerQuota = NO_QUOTA,
    persistent_owners: tuple[str, ...] = ("prefix-service",),
    host: str = "127.0.0.1",
    stuck_after_s: float = 30.0,
    snapshot_key: SnapshotKey | None = None,
    metrics: bool = False,
    kv_memory_mib: int = 0,
    role: str = "both",
    kv_dtype: str = "auto",
    speculative: str = "off",
) -> Engine:
    """``quota`` / ``persistent_quota``: the engine's per-owner quotas (default: none; the CLI's
    defaults are ``engine_service.sessions.handles.engine_quotas``). ``host``: where it binds
    (``[::]``: IPv6 and IPv4 alike; ``address`` stays 127.0.0.1). ``stuck_after_s``: the heartbeat's
    (``runtime/heartbeat.py``). ``snapshot_key``: the key its snapshot files are signed with."""
    tokenizer = char_tokenizer()
    deps = EngineSessions.build(
        random_model(layers, 4, seed),
        tokenizer,
        model_name=f"tiny-{layers}-seed{seed}",
        chat=ChatFormatter(name="chatml"),
        executor=ExecutorSettings(
            cache_kind=cache_kind,
            max_sessions=max_sessions,
            max_session_tokens=max_session_tokens,
            prefill_chunk=64,
            kv_memory_mib=kv_memory_mib,
            kv_dtype=kv_dtype,
            speculative=speculative,
        ),
        sessions=SessionSettings(
            idle_timeout_s=idle_timeout_s,
            persistent_owners=persistent_owners,
            quota=quota,
            persistent_quota=persistent_quota,
            prepared_inputs=prepared_inputs,
            snapshot_key=snapshot_key,
            role=role,
        ),
    )
    server, bound = create_server(deps, f"{host}:{port}", stuck_after_s=stuck_after_s, metrics=metrics)
    return Engine(server, bound)


@pytest.fixture
def engine_factory() -> Iterator[Callable[..., Engine]]:
    """``engine_factory(**kw)`` starts an engine server; every one is stopped at teardown."""
    started: list[Engine] = []

    def make(**kwargs) -> Engine:
        engine = start_engine(**kwargs)
        started.append(engine)
        return engine

    yield make
    for engine in started:
        engine.stop(0)


@pytest.fixture
def engine(engine_factory) -> Engine:
    return engine_factory()


@dataclass
class Prefix:
    """An in-process prefix service connected to an engine."""

    server: PrefixServer
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def cache(self):
        return self.server.deps.cache

    def stop(self, grace: float | None = 1.0, *, release: bool = True) -> None:
        self.server.stop(grace, release=release)


def start_prefix(
    engine_address: str,
    *,
    max_entries: int = 16,
    policy: str = "lru",
    port: int = 0,
    owner: str = "prefix-service",
    cache_generated: bool = True,
) -> Prefix:
    deps, channel = connect_engine(
        engine_address, max_entries=max_entries, policy=policy, owner=owner, cache_generated=cache_generated
    )
    server, bound = create_prefix_server(deps, f"127.0.0.1:{port}", channel=channel)
    return Prefix(server, bound)


@pytest.fixture
def prefix_factory() -> Iterator[Callable[..., Prefix]]:
    """``prefix_factory(engine_address, **kw)``; every prefix service is stopped at teardown."""
    started: list[Prefix] = []

    def make(engine_address: str, **kwargs) -> Prefix:
        prefix = start_prefix(engine_address, **kwargs)
        started.append(prefix)
        return prefix

    yield make
    for prefix in started:
        prefix.stop(0, release=False)


@contextmanager
def real_model_services(max_sessions: int) -> Iterator[tuple[Any, EngineSessions, Prefix]]:
    """The packaged SmolLM2 in an in-process engine server and a prefix service over it (slow tests):
    yields (the loaded model, the engine's sessions, the prefix service); both stop at the end."""
    from engine_service.model.loading.loader import load_model

    loaded = load_model()
    deps = EngineSessions.build(
        loaded,
        loaded.tokenizer,
        model_name="smollm2",
        chat=loaded.chat,
        executor=ExecutorSettings(max_sessions=max_sessions, max_session_tokens=512),
        sessions=UNLIMITED,
    )
    server, port = create_server(deps, "127.0.0.1:0")
    prefix = start_prefix(f"127.0.0.1:{port}")
    try:
        yield loaded, deps, prefix
    finally:
        prefix.stop(0)
        server.stop(0, shutdown_runner=True)
