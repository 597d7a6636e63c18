"""EnginePool and EngineTargets with fakes and a fake clock: DNS finds engines and never removes one;
a failed or empty resolution keeps the last answer up to the staleness bound; an engine is its
instance id (a second address of a member is an alias, a different instance a member of its own);
a member leaves when it drains (after its streams) or stays away past the grace."""

from __future__ import annotations

from dataclasses import dataclass, replace
from types import SimpleNamespace

from engine_service.api.engine_info import EngineInfo
from prefix_service.engines.engine_pool import EnginePool, RemoteMember
from prefix_service.engines.engine_targets import EngineTargets, Resolution
from prefix_service.fleet.fleet import Fleet


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class StubDns:
    """What EngineTargets needs of a DnsTarget: ``answer`` (None: the resolution fails)."""

    host = "engines.test"

    def __init__(self, answer: set[str] | None) -> None:
        self.answer = answer

    def lookup(self) -> Resolution:
        if self.answer is None:
            return Resolution(frozenset(), "SERVFAIL")
        return Resolution(frozenset(self.answer))


@dataclass
class FakeEngine:
    """One engine process: its Info, whether its health says SERVING, whether it answers at all."""

    info: EngineInfo
    serving: bool = True
    answers: bool = True
    cleared: int = 0


class Opened:
    def __init__(self, address: str, engine: FakeEngine) -> None:
        self.address, self.engine, self.info = address, engine, engine.info
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Member(RemoteMember):
    def __init__(self, address: str, engine: FakeEngine) -> None:
        gateway = SimpleNamespace(
            instance_id=engine.info.instance_id,
            fingerprint="fp",
            clear=self._clear,
            check_engine=lambda: None,
            last_info=None,
        )
        super().__init__(address, gateway, None, lambda: None)
        self._serving = lambda: engine.serving and engine.answers
        self.engine = engine

    def _clear(self) -> int:
        self.engine.cleared += 1
        return 0

    def probe(self) -> EngineInfo | None:
        return self.engine.info if self.engine.answers else None


def info(instance: str, **kw) -> EngineInfo:
    return EngineInfo(instance_id=instance, fingerprint="fp", vocab_size=128, max_session_tokens=256, **kw)


def pool_over(engines: dict[str, FakeEngine], targets, clock: Clock, leave_after_s: float = 60.0):
    fleet = Fleet()
    opened: list[Opened] = []

    def open_at(address: str, timeout: float) -> Opened:
        from engine_service.api.errors import Unavailable

        engine = engines.get(address)
        if engine is None or not engine.answers:
            raise Unavailable(f"{address} does not answer")
        opened.append(Opened(address, engine))
        return opened[-1]

    def join(o: Opened) -> Member:
        return Member(o.address, o.engine)

    pool = EnginePool(fleet, targets, open_at, join, leave_after_s=leave_after_s, clock=clock)
    return fleet, pool, opened


def names(fleet: Fleet) -> list[str]:
    return sorted(m.name for m in fleet.members())


def test_a_failed_or_empty_resolution_keeps_the_last_answer_until_it_is_stale() -> None:
    clock = Clock()
    dns = StubDns({"10.0.0.1:7", "10.0.0.2:7"})
    targets = EngineTargets({"10.0.0.9:7"}, dns, stale_after_s=30.0, clock=clock)
    assert targets() == {"10.0.0.1:7", "10.0.0.2:7", "10.0.0.9:7"}
    dns.answer = None
    clock.now = 29.0
    assert targets() == {"10.0.0.1:7", "10.0.0.2:7", "10.0.0.9:7"} and not targets.stale
    dns.answer = set()  # answered, but nothing: as a failure
    assert targets() == {"10.0.0.1:7", "10.0.0.2:7", "10.0.0.9:7"}
    assert targets.failures == 2 and targets.answer_age_s() == 29.0
    clock.now = 31.0
    assert targets() == {"10.0.0.9:7"} and targets.stale  # past the bound: only the static ones
    dns.answer = {"10.0.0.3:7"}
    assert targets() == {"10.0.0.3:7", "10.0.0.9:7"} and not targets.stale and targets.answer_age_s() == 0.0


def test_dns_never_removes_an_engine_and_a_second_address_is_an_alias() -> None:
    clock = Clock()
    a = FakeEngine(info("inst-a"))
    b = FakeEngine(info("inst-b"))
    engines = {"10.0.0.1:7": a, "[fd00::1]:7": a, "10.0.0.2:7": b}
    wanted = {"10.0.0.1:7", "[fd00::1]:7"}
    fleet, pool, opened = pool_over(engines, lambda: set(wanted), clock)
    pool.sync()
    assert names(fleet) == ["10.0.0.1:7"]  # one engine, two addresses
    member = fleet.members()[0]
    assert member.addresses == {"10.0.0.1:7", "[fd00::1]:7"} and pool.aliases == 1
    assert a.cleared == 0 and [o.closed for o in opened] == [False, True]  # the alias' channel closed
    pool.sync()
    assert len(opened) == 2  # the alias is known: not opened again
    wanted.add("10.0.0.2:7")  # a different instance: an engine of its own
    pool.sync()
    assert names(fleet) == ["10.0.0.1:7", "10.0.0.2:7"]
    wanted.clear()  # the name answers nothing (or fails): nobody leaves
    pool.sync()
    pool.check_departures()
    assert names(fleet) == ["10.0.0.1:7", "10.0.0.2:7"] and a.cleared == b.cleared == 0
    assert fleet.members()[0].addresses == {"10.0.0.1:7"}  # the alias that went is forgotten


def test_a_member_leaves_when_it_drains_after_its_streams_or_stays_away_past_the_grace() -> None:
    clock = Clock()
    a, b, c = FakeEngine(info("inst-a")), FakeEngine(info("inst-b")), FakeEngine(info("inst-c"))
    engines = {"a:7": a, "b:7": b, "c:7": c}
    fleet, pool, _ = pool_over(engines, lambda: set(engines), clock, leave_after_s=60.0)
    pool.sync()
    assert names(fleet) == ["a:7", "b:7", "c:7"]
    # a drains (SIGTERM): health NOT_SERVING, Info draining; one of this service's streams still runs
    a.serving, a.info = False, replace(a.info, draining=True)
    fleet.member("a:7").started()
    pool.check_departures()
    assert "a:7" in names(fleet)
    fleet.member("a:7").ended()
    pool.check_departures()
    assert "a:7" not in names(fleet) and a.cleared == 1
    pool.sync()  # still resolvable while it drains: not joined again
    assert "a:7" not in names(fleet)
    # b stops answering: it stays for the grace (its snapshots come back if it does), then leaves
    b.answers = False
    pool.check_departures()
    clock.now = 59.0
    pool.check_departures()
    assert "b:7" in names(fleet)
    clock.now = 60.5
    pool.check_departures()
    assert "b:7" not in names(fleet)
    # c is NOT_SERVING for a while (a stuck engine thread) and recovers inside the grace: the clock restarts
    c.serving = False
    pool.check_departures()  # away since 60.5
    clock.now = 100.0
    c.serving = True
    pool.check_departures()
    c.serving = False
    pool.check_departures()  # away since 100
    clock.now = 150.0
    pool.check_departures()
    assert "c:7" in names(fleet)  # 89.5 s since it first went, 50 s since it last went
    clock.now = 160.5
    pool.check_departures()
    assert "c:7" not in names(fleet)
    assert pool.stats().departures == {"draining": 1, "unreachable": 2}
