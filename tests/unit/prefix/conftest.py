"""Fixtures of the prefix-cache unit tests: a fake backend and a cache of 8 entries over it (a test
module may override ``backend``, e.g. with a deferred one)."""

from __future__ import annotations

import pytest

from prefix_service.prefix_cache import PrefixCache
from tests.unit.prefix.fakes import FakeBackend


@pytest.fixture
def backend() -> FakeBackend:
    return FakeBackend()


@pytest.fixture
def cache(backend) -> PrefixCache:
    return PrefixCache(backend, max_entries=8)
