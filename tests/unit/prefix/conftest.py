"""Fixtures of the prefix-cache unit tests: a fake backend and a cache of 8 entries over it (a test
module may override ``backend``, e.g. with a deferred one); a fake engine and a gateway over it."""

from __future__ import annotations

import pytest

from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway.gateway import Gateway
from tests.unit.prefix.fake_engine import FakeEngine
from tests.unit.prefix.fakes import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def cache(backend) -> PrefixCache:
    return PrefixCache(backend, max_entries=8)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def gateway(engine) -> Gateway:
    return Gateway(PrefixCache(engine, max_entries=8), engine, "lru")
