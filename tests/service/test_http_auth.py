"""The HTTP door with auth on: bearer tokens map to owners as on gRPC (a fake table, then the
services' real token tables end to end with the caller's token forwarded to the engine, over HTTPS)."""

from __future__ import annotations

import httpx
import openai
import pytest

MODEL = "tiny"
TOKEN = "alice-token-0123456789"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


class Tokens:
    """A token table as the door needs it (``owner_for``)."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = table

    def owner_for(self, token: str) -> str | None:
        return self.table.get(token)


def test_bearer_tokens_map_to_owners(engine_factory, prefix_factory) -> None:
    engine = engine_factory()
    prefix = prefix_factory(engine.address)
    port = prefix.server.start_http("127.0.0.1", 0, model_name=MODEL, auth=Tokens({TOKEN: "alice"}))
    base = f"http://127.0.0.1:{port}"
    for key in ("wrong-token-0123456789", "short"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0).models.list()
    missing = httpx.get(base + "/v1/models")
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(base + "/health").status_code == 200  # probes need no token
    alice = openai.OpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0)
    answer = alice.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, temperature=0)
    assert answer.usage.completion_tokens == 2


def test_real_tokens_are_forwarded_and_https_uses_the_grpc_certificate(tmp_path) -> None:
    """The services' own token tables: an HTTP caller's token is forwarded to the engine (which knows
    alice, not carol: carol passes the prefix service but the engine refuses her, 401), over HTTPS
    with the gRPC side's certificate."""
    import ssl

    from engine_service.executors.options import ExecutorSettings
    from engine_service.model.random_init import random_model
    from engine_service.model.text.chat import ChatFormatter
    from engine_service.rpc.server import create_server
    from engine_service.serving.auth import ClientSecurity, ServerSecurity
    from engine_service.serving.tokens import TokenTable
    from engine_service.sessions.engine import EngineSessions
    from engine_service.sessions.settings import UNLIMITED
    from prefix_service.engines.connect import connect_engine
    from prefix_service.rpc.server import create_server as create_prefix_server
    from tests.service.conftest import char_tokenizer
    from tests.service.pki import write_test_pki

    def table(name: str, pairs: dict[str, str]) -> TokenTable:
        (tmp_path / name).write_text("".join(f"{token} {owner}\n" for token, owner in pairs.items()))
        return TokenTable.load(str(tmp_path / name))

    service_token, carol = "prefix-service-0123456789", "carol-token-0123456789"
    prefix_tokens = table("prefix.txt", {TOKEN: "alice", carol: "carol"})
    engine_security = ServerSecurity(table("engine.txt", {TOKEN: "alice", service_token: "prefix-service"}))
    pki = write_test_pki(tmp_path)
    deps = EngineSessions.build(
        random_model("FRFR", 4, 0),
        char_tokenizer(),
        model_name="tiny",
        chat=ChatFormatter(name="chatml"),
        executor=ExecutorSettings(max_sessions=8, max_session_tokens=256, prefill_chunk=64),
        sessions=UNLIMITED,
    )
    engine, engine_port = create_server(deps, "127.0.0.1:0", security=engine_security)
    gateway, channel = connect_engine(
        f"127.0.0.1:{engine_port}", engine_security=ClientSecurity(service_token)
    )
    prefix, _ = create_prefix_server(
        gateway, "127.0.0.1:0", channel=channel, security=ServerSecurity(prefix_tokens)
    )
    try:
        port = prefix.start_http(
            "127.0.0.1", 0, auth=prefix_tokens, tls_cert=pki.server_cert, tls_key=pki.server_key
        )

        def client(token: str) -> openai.OpenAI:
            https = httpx.Client(verify=ssl.create_default_context(cafile=pki.ca))
            return openai.OpenAI(
                base_url=f"https://127.0.0.1:{port}/v1", api_key=token, max_retries=0, http_client=https
            )

        answer = client(TOKEN).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
        assert answer.usage.completion_tokens == 2
        assert [m.id for m in client(carol).models.list()] == ["tiny"]  # the door lets carol in...
        with pytest.raises(openai.AuthenticationError):  # ...the engine, checking her token, does not
            client(carol).chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
        with pytest.raises(httpx.TransportError):  # plaintext to the HTTPS port
            httpx.get(f"http://127.0.0.1:{port}/health").raise_for_status()
    finally:
        prefix.stop(0)
        engine.stop(0, shutdown_runner=True)
