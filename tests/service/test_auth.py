"""Authenticated owners on real servers (127.0.0.1, port 0): bearer tokens on the engine and the prefix
service, the prefix service's own token and forwarded caller tokens, TLS and mutual TLS with a test CA
generated here, health without a token, and the warning for an unauthenticated non-loopback server.

Decision tested here: with tokens on, a ``forkline-owner`` header next to a valid token is ignored (the
token's owner is used); without a valid token the header is refused (UNAUTHENTICATED).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument, NotFound, Unauthenticated, Unavailable
from engine_service.executors.options import ExecutorSettings
from engine_service.model.random_init import random_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.rpc.server import create_server
from engine_service.serving.auth import ClientSecurity, ServerSecurity, server_credentials
from engine_service.serving.tokens import TokenTable
from engine_service.sessions.engine import EngineSessions
from engine_service.sessions.settings import UNLIMITED
from prefix_service.engines.connect import connect_engine
from prefix_service.rpc.server import create_server as create_prefix_server
from protos import engine_pb2 as pb
from protos import engine_pb2_grpc
from tests.service.conftest import char_tokenizer
from tests.service.pki import Pki, write_test_pki

ALICE = "alice-0123456789abcdefghij"
BOB = "bob-0123456789abcdefghijkl"
PREFIX = "prefix-service-0123456789abcdef"
PROMPT = [ord(c) for c in "The quick brown fox jumps over the lazy dog."]


def token_file(tmp_path, name: str, pairs: dict[str, str]) -> TokenTable:
    path = tmp_path / name
    path.write_text("".join(f"{token} {owner}\n" for token, owner in pairs.items()), encoding="utf-8")
    return TokenTable.load(str(path))


@dataclass
class Running:
    server: object
    port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@pytest.fixture
def servers():
    """``servers.engine(security)`` / ``servers.prefix(engine, ...)``; all stopped at teardown."""
    started: list = []

    class Make:
        @staticmethod
        def engine(security: ServerSecurity | None = None, host: str = "127.0.0.1") -> Running:
            deps = EngineSessions.build(
                random_model("FRFR", 4, 0),
                char_tokenizer(),
                model_name="tiny-auth",
                chat=ChatFormatter(name="chatml"),
                executor=ExecutorSettings(
                    cache_kind="batched-sequence", max_sessions=8, max_session_tokens=256, prefill_chunk=64
                ),
                sessions=UNLIMITED,
            )
            server, port = create_server(deps, f"{host}:0", security=security)
            started.append(lambda: server.stop(0, shutdown_runner=True))
            return Running(server, port)

        @staticmethod
        def prefix(
            engine: Running,
            engine_security: ClientSecurity | None = None,
            security: ServerSecurity | None = None,
        ) -> Running:
            gateway, channel = connect_engine(  # prompts only: the 4 entries its share holds are counted
                engine.address,
                max_entries=8,
                engine_security=engine_security,
                ready_timeout=10,
                cache_generated=False,
            )
            server, port = create_prefix_server(gateway, "127.0.0.1:0", channel=channel, security=security)
            started.append(lambda: server.stop(0, release=False))
            return Running(server, port)

    yield Make
    for stop in reversed(started):
        stop()


@pytest.fixture
def engine_tokens(tmp_path) -> TokenTable:
    return token_file(tmp_path, "engine-tokens", {ALICE: "alice", BOB: "bob", PREFIX: "prefix-service"})


def raw_describe(address: str, session: str, metadata) -> pb.DescribeResponse:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineStub(channel).Describe(
            pb.DescribeRequest(session=session), metadata=metadata, timeout=10
        )


def kept_session(client: EngineClient) -> str:
    outcome = client.generate(PROMPT, config=GenConfig(max_new_tokens=2), keep_session=True).collect()
    return outcome.started.session


# -- the engine -----------------------------------------------------------------------------------
def test_engine_refuses_calls_without_a_valid_token(servers, engine_tokens) -> None:
    engine = servers.engine(ServerSecurity(tokens=engine_tokens))
    for client in (
        EngineClient(engine.address),
        EngineClient(engine.address, owner="alice"),
        EngineClient(engine.address, token="wrong-0123456789abcdefgh"),
    ):
        with client:
            with pytest.raises(Unauthenticated):
                client.info()
            with pytest.raises(Unauthenticated):  # a stream is refused before its handler runs
                client.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    owner_only = (("forkline-owner", "alice"),)
    with pytest.raises(grpc.RpcError) as info:
        raw_describe(engine.address, "x", owner_only)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "forkline-owner alone is not a credential" in info.value.details()
    for bad in (
        (("authorization", ALICE),),
        (("authorization", f"Basic {ALICE}"),),
        (("authorization", "Bearer"),),
        (("authorization", "Bearer short"),),
        (("authorization", f"Bearer {ALICE}"), ("authorization", f"Bearer {ALICE}")),
    ):
        with pytest.raises(grpc.RpcError) as info:
            raw_describe(engine.address, "x", bad)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, bad


def test_engine_owner_comes_from_the_token(servers, engine_tokens) -> None:
    engine = servers.engine(ServerSecurity(tokens=engine_tokens))
    # alice declares herself "bob": the header is ignored, the token decides
    with (
        EngineClient(engine.address, owner="bob", token=ALICE) as alice,
        EngineClient(engine.address, owner="alice", token=BOB) as bob,
    ):
        session = kept_session(alice)
        assert alice.describe(session)[0] > 0
        assert raw_describe(engine.address, session, (("authorization", f"bearer {ALICE}"),)).position > 0
        with pytest.raises(NotFound):  # another owner's handle (bob's token, header says "alice")
            bob.describe(session)
        with pytest.raises(NotFound):
            bob.generate([65], session=session, config=GenConfig(max_new_tokens=1)).collect()
        with pytest.raises(NotFound):
            bob.clone(session, 3)
        with pytest.raises(NotFound):
            bob.close(session)
        assert bob.release_owner() == 0
        assert alice.release_owner() == 1


def test_health_and_reflection_need_no_token(servers, engine_tokens) -> None:
    engine = servers.engine(ServerSecurity(tokens=engine_tokens))
    with EngineClient(engine.address) as anonymous:
        assert anonymous.health() == "SERVING"
        assert anonymous.health("forkline.engine.v1.Engine") == "SERVING"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(engine.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = list(
            stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
            )
        )
    assert "forkline.engine.v1.Engine" in {s.name for s in replies[0].list_services_response.service}


def test_auth_off_is_as_before(servers) -> None:
    engine = servers.engine()
    with (
        EngineClient(engine.address, owner="alice") as alice,
        EngineClient(engine.address, owner="bob") as bob,
    ):
        session = kept_session(alice)
        assert alice.describe(session)[0] > 0
        with pytest.raises(NotFound):
            bob.describe(session)
    # a token sent to a server without tokens is not read: the header decides
    assert (
        raw_describe(
            engine.address,
            session,
            (("forkline-owner", "alice"), ("authorization", "Bearer whatever-0123456789")),
        ).position
        > 0
    )


def test_warning_for_a_non_loopback_server_without_auth(servers, engine_tokens, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="engine_service.serving.grpc_server"):
        servers.engine(host="0.0.0.0")
    assert any("without authentication" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="engine_service.serving.grpc_server"):
        servers.engine(ServerSecurity(tokens=engine_tokens), host="0.0.0.0")
        servers.engine()
    assert not [r for r in caplog.records if "without authentication" in r.getMessage()]


# -- the prefix service ---------------------------------------------------------------------------
@pytest.fixture
def secured_pair(servers, tmp_path, engine_tokens):
    """An engine and a prefix service, both with tokens; the prefix service has its own engine token."""
    engine = servers.engine(ServerSecurity(tokens=engine_tokens))
    prefix_tokens = token_file(tmp_path, "prefix-tokens", {ALICE: "alice", BOB: "bob"})
    prefix = servers.prefix(engine, ClientSecurity(token=PREFIX), ServerSecurity(tokens=prefix_tokens))
    return engine, prefix


def test_prefix_service_refuses_calls_without_a_valid_token(secured_pair) -> None:
    _, prefix = secured_pair
    for client in (
        PrefixClient(prefix.address),
        PrefixClient(prefix.address, owner="prefix-service"),
        PrefixClient(prefix.address, token="wrong-0123456789abcdefgh"),
        PrefixClient(prefix.address, token=PREFIX),
    ):  # not a client token here
        with client:
            with pytest.raises(Unauthenticated):
                client.lookup(PROMPT)
            with pytest.raises(Unauthenticated):
                client.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    with PrefixClient(prefix.address) as anonymous:
        assert (
            anonymous._unary(
                health_pb2_grpc.HealthStub(anonymous.channel).Check, health_pb2.HealthCheckRequest()
            ).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_gateway_end_to_end_with_auth(secured_pair) -> None:
    engine, prefix = secured_pair
    with (
        PrefixClient(prefix.address, token=ALICE) as alice,
        EngineClient(engine.address, token=ALICE) as alice_e,
        EngineClient(engine.address, token=BOB) as bob_e,
        PrefixClient(prefix.address, token=BOB) as bob,
    ):
        first = alice.generate(text="Once upon a time", config=GenConfig(max_new_tokens=3)).collect()
        second = alice.generate(text="Once upon a time", config=GenConfig(max_new_tokens=3)).collect()
        assert first.done.reused_positions == 0 and second.done.reused_positions > 0
        assert second.tokens == first.tokens
        # alice's namespace is hers (tests/service/test_tenancy.py): bob computes his own
        assert (
            bob.generate(text="Once upon a time", config=GenConfig(max_new_tokens=3))
            .collect()
            .done.reused_positions
            == 0
        )
        # Lookup (text: Tokenize is forwarded as the caller) hands a clone owned by the caller
        hit = alice.lookup(text="Once upon a time")
        assert hit.session is not None and hit.reused > 0
        assert alice_e.describe(hit.session)[0] == hit.reused
        with pytest.raises(NotFound):
            bob_e.describe(hit.session)
        # Insert of alice's own session: Describe + Clone forwarded with alice's token
        outcome = alice_e.generate(PROMPT, config=GenConfig(max_new_tokens=2), keep_session=True).collect()
        position = alice_e.describe(outcome.started.session)[0]
        held = (PROMPT + outcome.tokens)[:position]
        with pytest.raises(NotFound):  # bob cannot store alice's session: the engine sees bob's token
            bob.insert(held, outcome.started.session, namespace="n")
        entries = alice.stats().entries  # her own entries (Stats is the caller's)
        assert alice.insert(held, outcome.started.session, namespace="n") is True
        assert alice.stats().entries == entries + 1


def test_only_the_prefix_service_token_claims_its_owner(secured_pair) -> None:
    engine, prefix = secured_pair
    with PrefixClient(prefix.address, token=ALICE) as alice:
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    held = [entry.snapshot for entry in prefix.server.gateway.cache.entries()]
    assert held, "the gateway stored the prompt"
    # alice's token runs as alice whatever the header says
    with EngineClient(engine.address, owner="prefix-service", token=ALICE) as claims, pytest.raises(NotFound):
        claims.describe(held[0])
    with pytest.raises(grpc.RpcError) as info:
        raw_describe(engine.address, held[0], (("forkline-owner", "prefix-service"),))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with EngineClient(engine.address, token=PREFIX) as service:  # the service's own token does
        assert service.describe(held[0])[0] == len(PROMPT)


def test_engine_must_list_the_forwarded_client_tokens(servers, tmp_path) -> None:
    """Calls the prefix service makes for a caller carry the caller's token: an engine whose token file
    lists only the prefix service refuses them (UNAUTHENTICATED reaches the caller)."""
    engine = servers.engine(ServerSecurity(tokens=token_file(tmp_path, "e", {PREFIX: "prefix-service"})))
    prefix = servers.prefix(
        engine,
        ClientSecurity(token=PREFIX),
        ServerSecurity(tokens=token_file(tmp_path, "p", {ALICE: "alice"})),
    )
    with PrefixClient(prefix.address, token=ALICE) as alice:
        assert alice.lookup(PROMPT).session is None  # token ids: no engine call as alice
        with pytest.raises(Unauthenticated):
            alice.lookup(text="hello")  # Tokenize runs as alice on the engine


def test_prefix_service_without_its_token_cannot_start(servers, engine_tokens) -> None:
    engine = servers.engine(ServerSecurity(tokens=engine_tokens))
    with pytest.raises(Unauthenticated):
        connect_engine(engine.address, engine_security=ClientSecurity(), ready_timeout=10)
    with pytest.raises(Unauthenticated):
        connect_engine(engine.address, engine_security=ClientSecurity(token=BOB[::-1]), ready_timeout=10)


# -- TLS -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return write_test_pki(tmp_path_factory.mktemp("pki"))


def test_tls_round_trip(servers, pki) -> None:
    engine = servers.engine(ServerSecurity(credentials=server_credentials(pki.server_cert, pki.server_key)))
    with EngineClient(engine.address, owner="alice", tls_ca=pki.ca, timeout=10) as alice:
        session = kept_session(alice)
        assert alice.describe(session)[0] > 0
        assert alice.health() == "SERVING"
    for client in (
        EngineClient(engine.address, timeout=5),  # plaintext to a TLS port
        EngineClient(engine.address, tls_ca=pki.other_ca, timeout=5),
    ):  # a CA that did not sign it
        with pytest.raises(Unavailable), client:
            client.info()


def test_mutual_tls_with_tokens_and_the_prefix_service(servers, pki, engine_tokens, tmp_path) -> None:
    creds = server_credentials(pki.server_cert, pki.server_key, client_ca=pki.ca)
    engine = servers.engine(ServerSecurity(tokens=engine_tokens, credentials=creds))
    with (
        EngineClient(engine.address, tls_ca=pki.ca, token=ALICE, timeout=5) as no_cert,
        pytest.raises(Unavailable),
    ):
        no_cert.info()
    tls = {"tls_ca": pki.ca, "tls_cert": pki.client_cert, "tls_key": pki.client_key}
    with EngineClient(engine.address, timeout=10, **tls) as no_token, pytest.raises(Unauthenticated):
        no_token.info()
    prefix = servers.prefix(
        engine,
        ClientSecurity(token=PREFIX, **tls),
        ServerSecurity(
            tokens=token_file(tmp_path, "p", {ALICE: "alice"}),
            credentials=server_credentials(pki.server_cert, pki.server_key),
        ),
    )
    with (
        PrefixClient(prefix.address, token=ALICE, tls_ca=pki.ca, timeout=10) as alice,
        EngineClient(engine.address, token=ALICE, timeout=10, **tls) as alice_e,
    ):
        alice.generate(PROMPT, config=GenConfig(max_new_tokens=2)).collect()
        hit = alice.lookup(PROMPT)
        assert hit.session is not None and alice_e.describe(hit.session)[0] == hit.reused


# -- the flags -------------------------------------------------------------------------------------
def test_bad_auth_flags_fail_before_anything_starts(tmp_path) -> None:
    from engine_service.__main__ import parse_args as engine_args
    from engine_service.__main__ import start_engine
    from prefix_service.__main__ import connect_and_serve
    from prefix_service.__main__ import parse_args as prefix_args

    bad = tmp_path / "tokens"
    bad.write_text(f"{ALICE} alice\n{ALICE} bob\n", encoding="utf-8")
    with pytest.raises(InvalidArgument, match=f"{bad}:2: this token is already listed on line 1"):
        start_engine(engine_args(["--auth_tokens", str(bad)]))  # before the model loads
    with pytest.raises(InvalidArgument, match="--tls_cert and --tls_key must be given together"):
        start_engine(engine_args(["--tls_cert", str(bad)]))
    with pytest.raises(InvalidArgument, match="--tls_client_ca needs --tls_cert"):
        start_engine(engine_args(["--tls_client_ca", str(bad)]))
    with pytest.raises(InvalidArgument, match="--tls_key: cannot read"):
        start_engine(engine_args(["--tls_cert", str(bad), "--tls_key", str(tmp_path / "absent")]))
    with pytest.raises(InvalidArgument, match="whitespace"):  # the prefix service's own token file
        connect_and_serve(prefix_args(["--engine", "127.0.0.1:1", "--engine_token_file", str(bad)]))
