"""Refusals a program acts on travel as data (issue 20 "Also" 1): a ``google.rpc.ErrorInfo`` detail
(reason, domain ``forkline.engine.v1``, metadata) on the status, read back into the same typed
exception with its fields, over real gRPC servers on port 0 -- and the prefix service decides on
those fields, never on the message: rewording the engine's message changes nothing it does.
"""

from __future__ import annotations

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api import errors as e
from engine_service.api.config import GenConfig
from engine_service.api.owners import OwnerQuota
from engine_service.serving.auth import OWNER_METADATA_KEY
from engine_service.serving.errors import error_for
from engine_service.sessions import handles
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc
from tests.service.helpers import PROMPT

QUOTA = OwnerQuota(2, 0)


def raw_error_info(exc: grpc.RpcError) -> error_details_pb2.ErrorInfo | None:
    status = rpc_status.from_call(exc)
    if status is None:
        return None
    (detail,) = status.details
    info = error_details_pb2.ErrorInfo()
    assert detail.Unpack(info)
    return info


def hold(client: EngineClient, n: int) -> list[str]:
    return [
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
        for _ in range(n)
    ]


def test_a_sessions_quota_refusal_carries_error_info_on_the_wire(engine_factory) -> None:
    engine = engine_factory(quota=QUOTA)
    hold(EngineClient(engine.address, owner="mallory"), 2)
    stub = engine_pb2_grpc.EngineStub(grpc.insecure_channel(engine.address))
    request = pb.GenerateRequest(tokens=pb.TokenIds(ids=PROMPT), keep_session=True)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.Generate(request, metadata=((OWNER_METADATA_KEY, "mallory"),)))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info = raw_error_info(caught.value)
    assert (info.reason, info.domain) == ("OWNER_SESSIONS_QUOTA", "forkline.engine.v1")
    assert dict(info.metadata) == {
        "owner": "mallory",
        "unit": "sessions",
        "held": "2",
        "needed": "1",
        "limit": "2",
        "quota": "owner_max_sessions",
    }


def test_the_client_raises_the_typed_refusal_with_its_fields(engine_factory) -> None:
    engine = engine_factory(max_session_tokens=4096, quota=OwnerQuota(0, 300))
    client = EngineClient(engine.address, owner="alice")
    session = (
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    with pytest.raises(e.QuotaExceeded) as caught:
        client.generate(
            PROMPT, config=GenConfig(max_new_tokens=500)
        ).collect()  # input + 256 (the first reservation)
    refusal = caught.value
    assert refusal.reason == e.ErrorReason.OWNER_POSITIONS_QUOTA
    assert (refusal.owner, refusal.unit, refusal.quota, refusal.limit) == (
        "alice",
        "positions",
        "owner_max_positions",
        300,
    )
    assert refusal.held == len(PROMPT) and refusal.needed == len(PROMPT) + 256
    client.close(session)


def test_a_full_engine_and_a_stopping_engine_are_typed_too(engine_factory) -> None:
    engine = engine_factory(max_sessions=2)
    client = EngineClient(engine.address, owner="bob")
    hold(client, 2)
    with pytest.raises(e.EngineFull) as full:
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    assert full.value.reason == e.ErrorReason.ENGINE_FULL and full.value.max_sessions == 2
    engine.server.deps.drain()
    with pytest.raises(e.Stopping) as stopping:
        client.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    assert stopping.value.reason == e.ErrorReason.STOPPING and isinstance(stopping.value, e.Unavailable)


def test_negative_control_a_status_without_a_detail_is_the_plain_category() -> None:
    plain = error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "owner 'x' holds 2 sessions, owner_max_sessions=2")
    assert type(plain) is e.ResourceExhausted  # the message alone never makes a QuotaExceeded
    info = error_details_pb2.ErrorInfo(
        reason="OWNER_SESSIONS_QUOTA", domain=e.ERROR_DOMAIN, metadata={"owner": "x", "unit": "sessions"}
    )
    assert (
        type(error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "m", info)) is e.ResourceExhausted
    )  # fields missing
    assert type(error_for(grpc.StatusCode.NOT_FOUND, "m", info)) is e.NotFound  # not that code's reason
    info.domain = "another.domain"
    assert type(error_for(grpc.StatusCode.RESOURCE_EXHAUSTED, "m", info)) is e.ResourceExhausted
    newer = error_details_pb2.ErrorInfo(reason="SOMETHING_NEW", domain=e.ERROR_DOMAIN)
    assert type(error_for(grpc.StatusCode.UNAVAILABLE, "m", newer)) is e.Unavailable


# ------------------------------------------------------------------ the prefix service reads fields


class Reworded(e.QuotaExceeded):
    """The engine's quota refusal with a message nobody could parse (same fields, same detail)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.args = ("quota full, try again later",)


@pytest.fixture(params=[False, True], ids=["engine-message", "reworded-message"])
def reworded(request, monkeypatch) -> bool:
    if request.param:
        monkeypatch.setattr(handles, "QuotaExceeded", Reworded)
    return request.param


@pytest.fixture
def services(engine_factory, prefix_factory):
    """An engine whose clients hold 2 sessions and whose prefix service 4, and that prefix service."""
    engine = engine_factory(quota=QUOTA, persistent_quota=OwnerQuota(4, 0))
    return engine, prefix_factory(engine.address)


def test_a_caller_over_its_quota_evicts_nothing_however_the_message_reads(reworded, services) -> None:
    # Pressure handling acts on the typed owner: bob's own quota is no reason to evict (the freed room
    # would not be his). Parsing the English message, a rewording made it evict and retry.
    engine, prefix = services
    alice = PrefixClient(prefix.address, owner="alice")
    alice.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()  # cached
    bob_engine, bob = EngineClient(engine.address, owner="bob"), PrefixClient(prefix.address, owner="bob")
    held = hold(bob_engine, 2)
    with pytest.raises(e.QuotaExceeded) as lookup:
        bob.lookup(PROMPT)  # the clone would be bob's: the engine's typed refusal, passed on
    assert (lookup.value.owner, lookup.value.held, lookup.value.limit) == ("bob", 2, 2)
    assert (str(lookup.value) == "quota full, try again later") == reworded
    with pytest.raises(e.QuotaExceeded):
        bob.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()  # the live session would be bob's
    stats = bob.stats()
    assert (stats.entries, stats.pressure_evictions, stats.pressure_retries) == (1, 0, 0)
    bob_engine.close(held[0])
    assert (
        bob.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect().done.reused_positions
        == len(PROMPT) - 1
    )


def test_the_service_reclaims_its_own_quota_however_the_message_reads(reworded, services) -> None:
    # The service's own persistent budget is full of sessions it never heard of (a crashed earlier
    # process of the service left them: hand-overs from clients count against the clients until
    # claimed, so only the service's owner fills its budget): it reclaims them (its owner, read from
    # the detail) and stores. Parsing the message, a rewording made it give up.
    engine, prefix = services
    earlier = EngineClient(engine.address, owner="prefix-service")
    session = (
        earlier.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    for i in range(3):
        assert earlier.clone(session, 40 + i)
    bob_engine, bob = EngineClient(engine.address, owner="bob"), PrefixClient(prefix.address, owner="bob")
    kept = (
        bob_engine.generate(PROMPT, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    handed = bob_engine.clone(kept, len(PROMPT))
    bob_engine.close(kept)  # the service's clone counts in bob's quota until the service claims it
    assert bob.insert_detailed(PROMPT, handed).stored
    assert bob.stats().reclaimed == 4 and engine.deps.registry.count("prefix-service") == 1
