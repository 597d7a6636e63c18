"""The engine's K/V memory budget over gRPC: Info reports the bytes one position costs and the positions
the budget holds (hand-computed from the tiny model's geometry), and past that bound the engine refuses
new positions with RESOURCE_EXHAUSTED naming it -- while slots are still free (a session is cheap)."""

from __future__ import annotations

import pytest

from clients.engine_client import EngineClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import QuotaExceeded, ResourceExhausted
from engine_service.executors.cache_setup import resolve_kv_dtype
from tests.service.helpers import PROMPT

LONG = PROMPT * 2  # 180 positions


def per_position() -> int:
    # the tiny model: 4 layers ("FRFR", every one counted), 2 K/V heads of 16 (hidden 64 / 4 heads)
    return 4 * 2 * 2 * 16 * resolve_kv_dtype("auto").size


def test_info_reports_bytes_per_position_and_the_engines_positions_bound(engine_factory) -> None:
    engine = engine_factory(max_sessions=64, max_session_tokens=256, kv_memory_mib=1)
    info = EngineClient(engine.address, owner="alice").info()
    assert info.kv_bytes_per_position == per_position()
    assert info.max_positions == (1 << 20) // per_position() < 64 * 256  # the memory binds, not the slots
    roomy = EngineClient(engine_factory(max_sessions=2, max_session_tokens=256).address).info()
    assert roomy.max_positions == 2 * 256  # negative control: the slots bind when memory is ample


def test_past_the_positions_bound_the_engine_refuses_with_resource_exhausted(engine_factory) -> None:
    engine = engine_factory(max_sessions=64, max_session_tokens=256, kv_memory_mib=1)
    client = EngineClient(engine.address, owner="alice")
    bound = client.info().max_positions
    kept, refused = [], None
    for _ in range(64):
        try:
            run = client.generate(LONG, config=GenConfig(max_new_tokens=1), keep_session=True).collect()
        except ResourceExhausted as exc:
            refused = exc
            break
        kept.append(run.started.session)
    assert refused is not None and not isinstance(refused, QuotaExceeded)
    assert "max_positions=" + str(bound) in str(refused) and "--kv_memory_mib" in str(refused)
    assert len(kept) == bound // (len(LONG) + 1) < 64  # each holds its prompt and one reserved position
    assert client.info().resident_sessions == len(kept)  # slots were free: memory refused
    client.close(kept.pop())
    again = client.generate(LONG, config=GenConfig(max_new_tokens=1)).collect()  # room again
    assert again.done is not None
    assert client.clone(kept[0], len(LONG)) is not None  # the freed room holds one clone ...
    with pytest.raises(ResourceExhausted, match="K/V memory"):
        client.clone(kept[0], len(LONG))  # ... not two: a clone weighs its positions too
