"""Prefix-cache poisoning over the real services (issue 10): nobody can store one prompt's snapshot
under another prompt's tokens, because the engine, not the caller, says what a session holds.

Mallory generates "What is the capital of Italy?" with a kept session and asks the prefix service to
store it under the token ids of "What is the capital of France?" (the same length). Before content
verification it was stored, and every other client's gateway request for the France question reused
it and continued the Italy prompt. Now the insert is refused (CONTENT_MISMATCH), her clone released,
and Bob's request runs cold and equals an in-process cold run. The negative controls store honest
snapshots and reuse them.
"""

from __future__ import annotations

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from tests.service.helpers import in_process_tokens, sampled, wait_for

FRANCE = [ord(c) for c in "What is the capital of France?"]
ITALY = [ord(c) for c in " What is the capital of Italy?"]  # same length (one token per character)
N = 10


def cold(prompt: list[int]) -> list[int]:
    return in_process_tokens(prompt, N, temperature=10.0, seed=7)


def kept_session(engine_client: EngineClient, prompt: list[int]) -> str:
    """A session holding exactly ``prompt`` (max_new_tokens 1: the one new token stays pending)."""
    out = engine_client.generate(prompt, config=GenConfig(max_new_tokens=1), keep_session=True).collect()
    assert engine_client.describe(out.started.session) == (len(prompt), False)
    return out.started.session


def test_the_attack_would_be_visible() -> None:
    """What Bob would get from Mallory's snapshot differs from the France answer (not vacuous)."""
    assert len(FRANCE) == len(ITALY)
    assert cold(ITALY[:-1] + FRANCE[-1:]) != cold(FRANCE)


def test_mallory_cannot_store_italy_under_france(engine, prefix_factory) -> None:
    prefix = prefix_factory(engine.address)
    mallory_engine = EngineClient(engine.address, owner="mallory")
    mallory = PrefixClient(prefix.address, owner="mallory")
    italy = kept_session(mallory_engine, ITALY)
    resident, handles = engine.runner.resident_sessions, len(engine.deps.registry)
    result = mallory.insert_detailed(FRANCE, italy)
    assert (result.stored, result.reason) == (False, "content_mismatch")
    # her clone was never made (or was released): the engine holds what it held before
    assert wait_for(
        lambda: (engine.runner.resident_sessions, len(engine.deps.registry)) == (resident, handles)
    )
    assert mallory_engine.describe(italy) == (len(ITALY), False)  # her own session is untouched
    stats = mallory.stats()
    assert stats.entries == 0 and stats.refusals == {"content_mismatch": 1}
    # Bob's gateway request for the France question does not reuse her snapshot
    bob = PrefixClient(prefix.address, owner="bob")
    assert bob.lookup(FRANCE).reason == "empty"
    out = bob.generate(FRANCE, **sampled(N)).collect()
    assert out.done.reused_positions == 0 and out.tokens == cold(FRANCE)
    # a snapshot Mallory got from the engine's capture is refused the same way
    snap = (
        mallory_engine.generate(ITALY, config=GenConfig(max_new_tokens=2), prompt_snapshot=True)
        .collect()
        .snapshots[0]
        .handle
    )
    assert mallory.insert_detailed(FRANCE, snap, namespace="other").reason == "content_mismatch"
    assert PrefixClient(prefix.address, owner="bob").lookup(FRANCE, namespace="other").reason == "empty"


def test_negative_control_honest_inserts_are_stored_and_reused(engine, prefix_factory) -> None:
    prefix = prefix_factory(engine.address)
    mallory_engine = EngineClient(engine.address, owner="mallory")
    mallory = PrefixClient(prefix.address, owner="mallory")
    italy = kept_session(mallory_engine, ITALY)
    result = mallory.insert_detailed(ITALY, italy)
    assert (result.stored, result.reason) == (True, "unspecified")
    again = mallory.insert_detailed(ITALY, italy)
    assert (again.stored, again.reason) == (False, "duplicate")
    bob = PrefixClient(prefix.address, owner="bob")
    out = bob.generate(ITALY, **sampled(N)).collect()
    assert out.done.reused_positions == len(ITALY) - 1 and out.tokens == cold(ITALY)
    # and the France question: Bob's cold run is stored by the gateway, then reused by Carol
    first = bob.generate(FRANCE, **sampled(N)).collect()
    second = PrefixClient(prefix.address, owner="carol").generate(FRANCE, **sampled(N)).collect()
    assert first.done.reused_positions == 0 and second.done.reused_positions == len(FRANCE) - 1
    assert first.tokens == second.tokens == cold(FRANCE)
    assert mallory.stats().refusals.get("content_mismatch", 0) == 0


def test_a_session_holding_a_prepared_input_is_never_stored(engine_factory, prefix_factory) -> None:
    import mlx.core as mx
    import numpy as np

    from engine_service.model.random_init import random_model
    from protos import engine_pb2 as pb

    engine = engine_factory(prepared_inputs=True)
    prefix = prefix_factory(engine.address)
    client = EngineClient(engine.address, owner="mallory")
    # the embeddings of the France tokens: the same computation, but not token ids the engine fed
    rows = np.array(random_model("FRFR", 4, 0).embed(mx.array(FRANCE, dtype=mx.int32)), dtype="<f4")
    prepared = pb.PreparedInput(kind="embeddings", payload=rows.tobytes(), shape=list(rows.shape))
    session = (
        client.generate(prepared=prepared, config=GenConfig(max_new_tokens=1), keep_session=True)
        .collect()
        .started.session
    )
    resident = engine.runner.resident_sessions
    result = PrefixClient(prefix.address, owner="mallory").insert_detailed(FRANCE, session)
    assert (result.stored, result.reason) == (False, "prepared_input")
    assert engine.runner.resident_sessions == resident
    # control: the token path is stored
    honest = kept_session(client, FRANCE)
    assert PrefixClient(prefix.address, owner="mallory").insert(FRANCE, honest)
