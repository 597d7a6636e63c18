"""What a pod's engine does when Kubernetes stops it or its loop hangs, with real gRPC servers.

- SIGTERM to a real engine process (``tiny_engine.py``: the engine's main over the tiny model, each
  forward slowed so a generation lasts seconds) during a long stream: the stream ends with its done
  event and every token within ``--grace``; meanwhile readiness says NOT_SERVING (not UNAVAILABLE:
  the server still answers), liveness SERVING (a draining pod is not restarted), Info says draining
  and a new Generate gets UNAVAILABLE at once. Negative control: a grace shorter than the stream cuts
  it (no done event), so the test sees a cut stream when there is one.
- The engine thread's heartbeat: an engine whose forward never returns turns readiness and
  ``forkline.liveness`` NOT_SERVING within ``stuck_after_s``, and SERVING again once it answers; a
  busy engine whose forwards return stays SERVING (the control).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.serving.drain import LIVENESS_SERVICE
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc, prefix_pb2, prefix_pb2_grpc
from tests.service.helpers import wait_for
from tests.service.test_engine_restart import ServiceProcess

ENGINE_SERVICE = "forkline.engine.v1.Engine"
PREFIX_SERVICE = "forkline.prefix.v1.PrefixCache"
STATUS = health_pb2.HealthCheckResponse
OWNER = (("forkline-owner", "client"),)
STEP_S = 0.03  # per forward: 120 tokens take ~3.6 s
NEW_TOKENS = 120


def health(channel: grpc.Channel, service: str) -> int:
    return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        .status
    )


def generate_request(n: int) -> epb.GenerateRequest:
    return epb.GenerateRequest(
        tokens=epb.TokenIds(ids=[ord(c) for c in "A long answer follows. "]),
        config=epb.GenerationConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True),
    )


class TinyEngineProcess(ServiceProcess):
    def __init__(self, grace: float) -> None:
        env = dict(os.environ, FORKLINE_TEST_STEP_S=str(STEP_S))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.service.tiny_engine", "--port", "0", "--grace", str(grace)]
            + ["--log_level", "WARNING"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )


def stream_through_sigterm(grace: float) -> dict:
    """Start a long stream, SIGTERM the engine after its first tokens; what everyone saw."""
    engine = TinyEngineProcess(grace)
    seen: dict = {"tokens": 0, "done": None, "error": None}
    try:
        channel = grpc.insecure_channel(engine.listening())
        stub = engine_pb2_grpc.EngineStub(channel)
        first = threading.Event()

        def read() -> None:
            try:
                for event in stub.Generate(generate_request(NEW_TOKENS), metadata=OWNER, timeout=60):
                    if event.HasField("tokens"):
                        seen["tokens"] += len(event.tokens.ids)
                        first.set()
                    if event.HasField("done"):
                        seen["done"] = event.done
            except grpc.RpcError as exc:
                seen["error"] = exc.code()
            first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30)
        started = time.monotonic()
        engine.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(channel, ENGINE_SERVICE) == STATUS.NOT_SERVING, timeout=5)
        seen["liveness"] = health(channel, LIVENESS_SERVICE)
        seen["draining"] = stub.Info(epb.InfoRequest(), metadata=OWNER, timeout=5).draining
        try:
            next(iter(stub.Generate(generate_request(2), metadata=OWNER, timeout=5)))
        except grpc.RpcError as exc:
            seen["new_generate"] = exc.code()
        reader.join(60)
        seen["stream_s"] = time.monotonic() - started
        seen["exit"] = engine.proc.wait(30)
        channel.close()
    finally:
        engine.kill()
    return seen


def test_sigterm_during_a_long_stream_finishes_it_within_the_grace() -> None:
    seen = stream_through_sigterm(grace=20.0)
    assert seen["error"] is None and seen["done"] is not None and seen["tokens"] == NEW_TOKENS
    assert seen["liveness"] == STATUS.SERVING and seen["draining"] is True
    assert seen["new_generate"] == grpc.StatusCode.UNAVAILABLE
    assert seen["stream_s"] < 20.0 and seen["exit"] == 0


def test_a_grace_shorter_than_the_stream_cuts_it() -> None:
    seen = stream_through_sigterm(grace=0.3)  # the negative control
    assert seen["done"] is None and seen["error"] is not None and seen["tokens"] < NEW_TOKENS


@pytest.fixture
def stuck_engine(engine_factory):
    """An engine (stuck_after_s 1.0) whose forwards wait on ``gate`` while it is cleared."""
    engine = engine_factory(stuck_after_s=1.0)
    executor = engine.runner._engine._executor
    execute = executor.execute
    gate = threading.Event()
    gate.set()

    def gated(batch):
        gate.wait()
        time.sleep(0.02)  # 200 tokens: ~4 s of forwards
        return execute(batch)

    executor.execute = gated
    yield engine, gate
    gate.set()


def test_a_stuck_engine_thread_turns_readiness_and_liveness_not_serving(stuck_engine) -> None:
    engine, gate = stuck_engine
    with grpc.insecure_channel(engine.address) as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        stream = stub.Generate(generate_request(200), metadata=OWNER, timeout=60)
        next(stream)  # started: the engine thread runs forwards of ~20 ms, answering between them
        time.sleep(2.5)  # past stuck_after_s: a busy but answering engine
        assert health(channel, ENGINE_SERVICE) == STATUS.SERVING  # control: busy is not stuck
        assert health(channel, LIVENESS_SERVICE) == STATUS.SERVING
        gate.clear()  # the next forward never returns
        assert wait_for(lambda: health(channel, LIVENESS_SERVICE) == STATUS.NOT_SERVING, timeout=5)
        assert health(channel, ENGINE_SERVICE) == STATUS.NOT_SERVING
        info = stub.Info(epb.InfoRequest(), metadata=OWNER, timeout=5)
        assert info.heartbeat_age_s >= 1.0
        gate.set()
        assert wait_for(lambda: health(channel, LIVENESS_SERVICE) == STATUS.SERVING, timeout=5)
        assert health(channel, ENGINE_SERVICE) == STATUS.SERVING
        events = list(stream)
        assert events[-1].HasField("done")


def test_sigterm_to_a_prefix_replica_finishes_its_gateway_stream_and_refuses_new_work() -> None:
    """The prefix service drains alike: NOT_SERVING (liveness SERVING), a new Lookup UNAVAILABLE at once
    (a replicated client moves to another replica), Stats still served, the running gateway stream
    ends with its done event; before, the prefix server stopped at once and health went UNAVAILABLE."""
    engine = TinyEngineProcess(grace=20.0)
    prefix = None
    try:
        engine_address = engine.listening()
        prefix = ServiceProcess("prefix_service", "--engine", engine_address, "--port", "0", "--grace", "20")
        channel = grpc.insecure_channel(prefix.listening())
        stub = prefix_pb2_grpc.PrefixCacheStub(channel)
        request = prefix_pb2.GatewayGenerateRequest(
            tokens=generate_request(NEW_TOKENS).tokens, config=generate_request(NEW_TOKENS).config
        )
        seen: dict = {"tokens": 0, "done": None, "error": None}
        first = threading.Event()

        def read() -> None:
            try:
                for event in stub.Generate(request, metadata=OWNER, timeout=60):
                    if event.HasField("tokens"):
                        seen["tokens"] += len(event.tokens.ids)
                        first.set()
                    if event.HasField("done"):
                        seen["done"] = event.done
            except grpc.RpcError as exc:
                seen["error"] = exc.code()
            first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(30)
        prefix.proc.send_signal(signal.SIGTERM)
        assert wait_for(lambda: health(channel, PREFIX_SERVICE) == STATUS.NOT_SERVING, timeout=5)
        assert health(channel, LIVENESS_SERVICE) == STATUS.SERVING
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(
                prefix_pb2.LookupRequest(tokens=epb.TokenIds(ids=[65, 66, 67])), metadata=OWNER, timeout=5
            )
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        stats = stub.Stats(prefix_pb2.StatsRequest(), metadata=OWNER, timeout=5)  # still served
        assert stats.misses == 1  # the stream's own lookup: the refused one never ran
        reader.join(60)
        assert seen["error"] is None and seen["done"] is not None and seen["tokens"] == NEW_TOKENS
        assert prefix.proc.wait(30) == 0
        channel.close()
    finally:
        if prefix is not None:
            prefix.kill()
        engine.kill()
