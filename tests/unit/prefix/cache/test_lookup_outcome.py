"""A lookup's outcome is the cache's own: hit, or the miss reason of *this* lookup.

The services used to guess a miss reason after the fact: read the cache's global clone-refusal
counter, look up, read it again, and call the miss "boundary_refused" when the counter moved. With
lookups running concurrently (the prefix service serves many at once) the counter also moves for
*another* caller's refused clone, so a lookup that simply diverged was reported as refused. The
cache now decides the reason inside the lookup, under its lock.
"""

from __future__ import annotations

import threading

import pytest

from prefix_service.cache.outcomes import CLONE_REFUSED, LookupOutcome, Match, MissReason
from prefix_service.cache.prefix_cache import PrefixCache
from tests.unit.prefix.fakes import FakeBackend

NS = "app"
PROMPT = tuple(range(10, 20))  # 10 tokens


def test_a_hit_reports_its_match_and_where_the_request_leaves_it(backend, cache):
    cache.insert(NS, PROMPT, backend.open(PROMPT))
    outcome = cache.lookup(NS, PROMPT[:4] + (77, 78))
    assert outcome.reason is None and outcome.reused == outcome.diverged_at == 4
    assert outcome.session.tokens == PROMPT[:4]
    assert cache.lookup(NS, PROMPT[:4] + (77, 78)).match.reused == 4  # lookup: the same call, Match | None


@pytest.mark.parametrize(
    ("request_tokens", "namespace", "reason"),
    [
        ((), NS, MissReason.TOO_SHORT),
        ((10,), NS, MissReason.TOO_SHORT),
        ((11, 12, 13), NS, MissReason.DIVERGED),  # entries exist, none starts with 11
        (PROMPT, "other", MissReason.EMPTY),  # nothing under that namespace
    ],
)
def test_miss_reasons(backend, cache, request_tokens, namespace, reason):
    cache.insert(NS, PROMPT, backend.open(PROMPT))
    assert cache.lookup(namespace, request_tokens) == LookupOutcome.miss(reason)
    assert cache.stats().misses == 1


def test_disabled_and_empty(backend):
    assert PrefixCache(backend, 0).lookup(NS, PROMPT).reason == MissReason.DISABLED
    assert PrefixCache(backend, 4).lookup(NS, PROMPT).reason == MissReason.EMPTY


@pytest.mark.parametrize("failure", ["refused", "error"])
def test_a_refused_or_failed_clone_is_boundary_refused_where_the_match_ends(backend, cache, failure):
    floor = 8 if failure == "refused" else 0  # rows below 8 are gone: a clone at 5 is refused
    cache.insert(NS, PROMPT, backend.open(PROMPT, floor=floor))
    backend.fail_next = 1 if failure == "error" else 0
    outcome = cache.lookup(NS, PROMPT[:5] + (1, 2))
    assert outcome == LookupOutcome.miss(MissReason.BOUNDARY_REFUSED, 5)
    assert cache.lookup(NS, PROMPT + (1,)).reused == 10  # above the floor: a hit (control)


def test_an_entry_dropped_as_dead_leaves_the_namespace_empty(backend, cache):
    snapshot = backend.open(PROMPT)
    cache.insert(NS, PROMPT, snapshot)
    snapshot.closed = True  # e.g. the engine expired it
    assert cache.lookup(NS, PROMPT).reason == MissReason.EMPTY and len(cache) == 0


def test_outcome_is_a_hit_or_a_miss_never_both():
    with pytest.raises(ValueError, match="exactly one"):
        LookupOutcome(Match(object(), 2), MissReason.EMPTY)
    with pytest.raises(ValueError, match="exactly one"):
        LookupOutcome(None, None)


# -- concurrent lookups ---------------------------------------------------------------------------

ROUNDS = 1000
REFUSED_REQUEST = PROMPT[:3] + (99,)  # matches PROMPT, whose rows below 8 are gone: clone refused
DIVERGING_REQUEST = (50, 51, 52)  # shares nothing with PROMPT


class HandshakeBackend(FakeBackend):
    """Forces the interleaving the counter-based reasons got wrong, every round: a lookup of the
    diverging thread, once it started (after whatever its caller read before it), waits at
    ``rendezvous`` until the refusing thread has finished one whole refused lookup. The hook is the
    fingerprint, which the cache reads for the key's scope before it takes its lock."""

    def __init__(self) -> None:
        super().__init__()
        self.rendezvous = threading.Barrier(2, timeout=10)
        self.armed = threading.local()

    @property
    def fingerprint(self) -> str:
        if getattr(self.armed, "on", False):
            self.armed.on = False
            self.rendezvous.wait()  # 1: the diverging lookup has started
            self.rendezvous.wait()  # 2: the refused lookup has finished
        return self._fingerprint

    @fingerprint.setter
    def fingerprint(self, value: str) -> None:
        self._fingerprint = value


def reason_from_the_cache(cache: PrefixCache, tokens: tuple[int, ...]) -> MissReason | None:
    return cache.lookup(NS, tokens).reason


def reason_from_the_refusal_counter(cache: PrefixCache, tokens: tuple[int, ...]) -> MissReason | None:
    """The old servicer's way: a refusal counted anywhere during the lookup makes it "refused"."""
    before = cache.stats().refusals.get(CLONE_REFUSED, 0)
    if cache.lookup(NS, tokens).match is not None:
        return None
    if cache.stats().refusals.get(CLONE_REFUSED, 0) > before:
        return MissReason.BOUNDARY_REFUSED
    return MissReason.DIVERGED if cache.entries(NS) else MissReason.EMPTY


def concurrent_reasons(derive) -> dict[str, list[MissReason | None]]:
    backend = HandshakeBackend()
    cache = PrefixCache(backend, max_entries=8)
    assert cache.insert(NS, PROMPT, backend.open(PROMPT, floor=8)).stored
    reasons: dict[str, list[MissReason | None]] = {"refused": [], "diverged": []}
    failures: list[BaseException] = []

    def refusing() -> None:
        for _ in range(ROUNDS):
            backend.rendezvous.wait()
            reasons["refused"].append(derive(cache, REFUSED_REQUEST))
            backend.rendezvous.wait()

    def diverging() -> None:
        for _ in range(ROUNDS):
            backend.armed.on = True
            reasons["diverged"].append(derive(cache, DIVERGING_REQUEST))

    def guarded(body):
        def run() -> None:
            try:
                body()
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                failures.append(exc)
                backend.rendezvous.abort()

        return run

    threads = [threading.Thread(target=guarded(body)) for body in (refusing, diverging)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures, failures
    return reasons


def test_concurrent_lookups_each_get_their_own_reason():
    reasons = concurrent_reasons(reason_from_the_cache)
    assert reasons["refused"] == [MissReason.BOUNDARY_REFUSED] * ROUNDS
    assert reasons["diverged"] == [MissReason.DIVERGED] * ROUNDS


def test_negative_control_the_refusal_counter_blames_the_wrong_lookup():
    """The same interleaving fails the old derivation: every diverging lookup sees the other
    thread's refusal and reports it as its own."""
    reasons = concurrent_reasons(reason_from_the_refusal_counter)
    assert reasons["refused"] == [MissReason.BOUNDARY_REFUSED] * ROUNDS
    assert reasons["diverged"] == [MissReason.BOUNDARY_REFUSED] * ROUNDS
