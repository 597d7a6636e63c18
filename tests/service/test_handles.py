"""HandleRegistry: unguessable per-owner handles, release per owner, idle expiry (no gRPC)."""

from __future__ import annotations

import pytest

from engine_service.api.errors import InvalidArgument, NotFound
from engine_service.api.handle_names import handle_instance, new_instance_id
from engine_service.sessions.handles import HandleRegistry


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_handle_carries_instance_and_128_random_bits() -> None:
    reg: HandleRegistry[str] = HandleRegistry()
    handles = {reg.register("v", "alice") for _ in range(200)}
    assert len(handles) == 200
    for h in handles:
        inst, rand = h.split(".")
        assert inst == reg.instance_id and handle_instance(h) == inst
        assert len(rand) == 32 and int(rand, 16) >= 0
    # 200 random 128-bit values: every hex position varies (a counter would not)
    assert all(len({h.split(".")[1][i] for h in handles}) > 1 for i in range(32))


def test_resolve_only_for_owner_and_errors_look_alike() -> None:
    reg: HandleRegistry[int] = HandleRegistry()
    h = reg.register(7, "alice")
    assert reg.resolve(h, "alice") == 7
    messages = []
    for handle, owner in [(h, "bob"), (h[:-1] + ("0" if h[-1] != "0" else "1"), "alice"), ("junk", "alice")]:
        with pytest.raises(NotFound) as info:
            reg.resolve(handle, owner)
        messages.append(str(info.value))
    assert all(m.startswith("unknown session handle") for m in messages)


def test_handle_from_another_instance_says_restarted() -> None:
    old: HandleRegistry[int] = HandleRegistry()
    new: HandleRegistry[int] = HandleRegistry(instance_id=new_instance_id())
    h = old.register(1, "alice")
    with pytest.raises(NotFound, match="restarted"):
        new.resolve(h, "alice")


def test_remove_and_release_owner() -> None:
    reg: HandleRegistry[int] = HandleRegistry()
    a1, a2, b1 = reg.register(1, "a"), reg.register(2, "a"), reg.register(3, "b")
    assert reg.remove(a1, "a") == 1
    with pytest.raises(NotFound):
        reg.remove(a1, "a")
    released = reg.release_owner("a")
    assert [(r.handle, r.value) for r in released] == [(a2, 2)]
    assert reg.resolve(b1, "b") == 3 and len(reg) == 1 and reg.count("a") == 0


def test_idle_expiry_respects_pins_and_use() -> None:
    clock = FakeClock()
    reg: HandleRegistry[str] = HandleRegistry(idle_timeout_s=10.0, clock=clock)
    idle, used, pinned = reg.register("idle", "o"), reg.register("used", "o"), reg.register("pinned", "o")
    reg.pin(pinned, "o")
    clock.now += 6
    reg.resolve(used, "o")
    clock.now += 6
    assert [r.value for r in reg.expire_idle()] == ["idle"]
    clock.now += 20
    assert [r.value for r in reg.expire_idle()] == ["used"]
    reg.unpin(pinned)
    assert reg.expire_idle() == []  # expiry counts from the unpin
    clock.now += 11
    assert [r.value for r in reg.expire_idle()] == ["pinned"]
    with pytest.raises(NotFound):
        reg.resolve(idle, "o")


def test_persistent_owner_never_expires() -> None:
    clock = FakeClock()
    reg: HandleRegistry[str] = HandleRegistry(
        idle_timeout_s=1.0, clock=clock, persistent_owners=frozenset({"svc"})
    )
    reg.register("kept", "svc")
    reg.register("client", "c")
    clock.now += 5
    assert [r.value for r in reg.expire_idle()] == ["client"]
    assert reg.count("svc") == 1


def test_zero_timeout_never_expires() -> None:
    clock = FakeClock()
    reg: HandleRegistry[int] = HandleRegistry(idle_timeout_s=0, clock=clock)
    reg.register(1, "o")
    clock.now += 1e9
    assert reg.expire_idle() == [] and len(reg) == 1


@pytest.mark.parametrize(
    ("field", "kwargs"), [("instance_id", {"instance_id": "xyz"}), ("idle_timeout_s", {"idle_timeout_s": -1})]
)
def test_validation(field: str, kwargs: dict) -> None:
    with pytest.raises(InvalidArgument, match=field):
        HandleRegistry(**kwargs)
    with pytest.raises(InvalidArgument, match="owner"):
        HandleRegistry().register(1, "")
