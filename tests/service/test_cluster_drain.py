"""What a pod's engine does when Kubernetes stops it or its loop hangs, with real gRPC servers.

- SIGTERM to a real engine process (``held_engine.py``: the engine's main over the tiny model) during a
  stream held in flight: readiness says NOT_SERVING (not UNAVAILABLE: the server still answers),
  liveness SERVING (a draining pod is not restarted), Info says draining, a new Generate gets
  UNAVAILABLE; once released, the stream ends with its done event and every token. Negative control:
  a grace that runs out while the stream is held cuts it. The prefix service drains alike.
- The engine thread's heartbeat: a forward that never returns turns readiness and ``forkline.liveness``
  NOT_SERVING within ``stuck_after_s``, SERVING again once it returns; an engine busy for longer than
  ``stuck_after_s`` with forwards that return stays SERVING (the control).

Every wait is for a state (first tokens, a health status, the stream's end, the exit) with a deadline
reached only on failure: the streams are held by the test, never raced against the clock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine_service.serving.drain import LIVENESS_SERVICE
from protos import engine_pb2 as epb
from protos import engine_pb2_grpc, prefix_pb2, prefix_pb2_grpc
from tests.service.held_engine import HOLD_ENV
from tests.service.helpers import wait_for
from tests.service.test_engine_restart import ServiceProcess
from tests.service.tiny_engine import STEP_ENV

ENGINE_SERVICE = "forkline.engine.v1.Engine"
PREFIX_SERVICE = "forkline.prefix.v1.PrefixCache"
STATUS = health_pb2.HealthCheckResponse
OWNER = (("forkline-owner", "client"),)
NEW_TOKENS = 120
HOLD_AFTER = 10  # forwards a stream runs before its hold: its first tokens, far from its end
PATIENCE_S = 120.0  # the deadline of every wait for a state: reached only when the state never comes
GRACE_S = 300.0  # covers the checks while the stream is held, on a loaded machine
HELD_STUCK_AFTER_S = 3600.0  # a held forward is the test's doing, not a stuck engine


def health(channel: grpc.Channel, service: str) -> int | None:
    """The status health reports for ``service``; None while the server does not answer."""
    try:
        request = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status
    except grpc.RpcError:
        return None


def becomes(channel: grpc.Channel, service: str, status: int, proc: subprocess.Popen | None = None) -> None:
    """Wait until ``service``'s health is ``status``; fail saying what it was instead."""
    seen: list[int | None] = []
    if not wait_for(lambda: seen.append(health(channel, service)) or seen[-1] == status, PATIENCE_S):
        exit_code = None if proc is None else proc.poll()
        raise AssertionError(f"{service}: health stayed {seen[-3:]}, not {status} (exit code {exit_code})")


def generate_request(n: int) -> epb.GenerateRequest:
    return epb.GenerateRequest(
        tokens=epb.TokenIds(ids=[ord(c) for c in "A long answer follows. "]),
        config=epb.GenerationConfig(max_new_tokens=n, temperature=0.0, ignore_eos=True),
    )


class Stream:
    """A server stream read on its own thread: its token count, done event or error code."""

    def __init__(self, events: Iterator) -> None:
        self.tokens, self.done, self.error = 0, None, None
        self.first, self.ended = threading.Event(), threading.Event()
        threading.Thread(target=self._read, args=(events,), daemon=True).start()

    def _read(self, events: Iterator) -> None:
        try:
            for event in events:
                if event.HasField("tokens"):
                    self.tokens += len(event.tokens.ids)
                    self.first.set()
                if event.HasField("done"):
                    self.done = event.done
        except grpc.RpcError as exc:
            self.error = exc.code()
        self.ended.set()
        self.first.set()


class HeldEngineProcess(ServiceProcess):
    """``tests.service.held_engine`` in its own process; its forwards stop at ``hold`` (see hold_after)
    and each takes ``step_s`` seconds more."""

    def __init__(self, hold: Path, grace: float, step_s: float = 0.0) -> None:
        self.hold = hold
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.service.held_engine", "--port", "0", "--grace", str(grace)]
            + ["--stuck_after", str(HELD_STUCK_AFTER_S), "--log_level", "WARNING"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(os.environ, **{HOLD_ENV: str(hold), STEP_ENV: str(step_s)}),
        )

    def hold_after(self, forwards: int) -> None:
        """From now, forwards after the ``forwards``-th wait until :meth:`release`."""
        part = self.hold.with_suffix(".part")
        part.write_text(str(forwards))
        part.replace(self.hold)  # whole, at once

    def release(self) -> None:
        self.hold.unlink(missing_ok=True)

    def kill(self) -> None:
        self.release()
        super().kill()


@contextmanager
def engine_with_a_held_stream(tmp_path: Path, grace: float):
    """(engine process, its channel, its stub, a Generate stream held after its first tokens)."""
    engine = HeldEngineProcess(tmp_path / "hold", grace)
    try:
        with grpc.insecure_channel(engine.listening(PATIENCE_S)) as channel:
            stub = engine_pb2_grpc.EngineStub(channel)
            engine.hold_after(HOLD_AFTER)
            stream = Stream(
                stub.Generate(generate_request(NEW_TOKENS), metadata=OWNER, timeout=5 * PATIENCE_S)
            )
            assert stream.first.wait(PATIENCE_S) and stream.error is None
            yield engine, channel, stub, stream
    finally:
        engine.kill()


def test_sigterm_during_a_long_stream_finishes_it_within_the_grace(tmp_path) -> None:
    with engine_with_a_held_stream(tmp_path, GRACE_S) as (engine, channel, stub, stream):
        engine.proc.send_signal(signal.SIGTERM)
        becomes(channel, ENGINE_SERVICE, STATUS.NOT_SERVING, engine.proc)
        assert health(channel, LIVENESS_SERVICE) == STATUS.SERVING
        assert stub.Info(epb.InfoRequest(), metadata=OWNER, timeout=PATIENCE_S).draining
        with pytest.raises(grpc.RpcError) as refused:  # admitted, it would wait for the held engine
            next(stub.Generate(generate_request(2), metadata=OWNER, timeout=PATIENCE_S))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not stream.ended.is_set() and stream.tokens < NEW_TOKENS  # in flight through every check
        engine.release()
        assert stream.ended.wait(PATIENCE_S)
        assert stream.error is None and stream.done is not None and stream.tokens == NEW_TOKENS
        assert engine.proc.wait(PATIENCE_S) == 0


def test_a_grace_shorter_than_the_stream_cuts_it(tmp_path) -> None:
    with engine_with_a_held_stream(tmp_path, grace=0.3) as (engine, _, _, stream):  # the negative control
        engine.proc.send_signal(signal.SIGTERM)
        assert stream.ended.wait(PATIENCE_S)  # the grace ran out with the stream held
        assert stream.done is None and stream.error is not None and stream.tokens < NEW_TOKENS


STUCK_AFTER_S = 3.0
PACE_S = 0.1  # one forward: far below stuck_after_s, so a busy engine answers its heartbeat in time
BUSY_FORWARDS = 40  # busy for at least 4 s > stuck_after_s before the forward that does not return


def test_a_stuck_engine_thread_turns_readiness_and_liveness_not_serving(engine_factory) -> None:
    engine = engine_factory(stuck_after_s=STUCK_AFTER_S)
    executor = engine.runner._engine._executor
    execute, forwards, seen = executor.execute, [0], {}
    stuck, unstick = threading.Event(), threading.Event()
    with grpc.insecure_channel(engine.address) as channel:

        def paced(batch):
            forwards[0] += 1
            if forwards[0] == BUSY_FORWARDS:  # the control, asked on the engine thread: busy is not stuck
                seen["busy"] = (health(channel, ENGINE_SERVICE), health(channel, LIVENESS_SERVICE))
                stuck.set()
                unstick.wait()  # this forward does not return until the test says so
            else:
                time.sleep(PACE_S)
            return execute(batch)

        executor.execute = paced
        try:
            stub = engine_pb2_grpc.EngineStub(channel)
            stream = Stream(stub.Generate(generate_request(BUSY_FORWARDS + 5), metadata=OWNER, timeout=600))
            assert stuck.wait(PATIENCE_S)
            assert seen["busy"] == (STATUS.SERVING, STATUS.SERVING)
            becomes(channel, LIVENESS_SERVICE, STATUS.NOT_SERVING)
            assert health(channel, ENGINE_SERVICE) == STATUS.NOT_SERVING
            info = stub.Info(epb.InfoRequest(), metadata=OWNER, timeout=PATIENCE_S)
            assert info.heartbeat_age_s >= STUCK_AFTER_S
            unstick.set()
            becomes(channel, LIVENESS_SERVICE, STATUS.SERVING)
            assert health(channel, ENGINE_SERVICE) == STATUS.SERVING
            assert stream.ended.wait(PATIENCE_S) and stream.done is not None and stream.error is None
        finally:
            unstick.set()


def test_sigterm_to_a_prefix_replica_finishes_its_gateway_stream_and_refuses_new_work(tmp_path) -> None:
    """The prefix service drains alike: NOT_SERVING (liveness SERVING), a new Lookup UNAVAILABLE at once
    (a replicated client moves to another replica), Stats still served, the running gateway stream
    ends with its done event."""
    engine = HeldEngineProcess(tmp_path / "hold", GRACE_S)
    prefix = None
    try:
        address = engine.listening(PATIENCE_S)
        prefix = ServiceProcess("prefix_service", "--engine", address, "--port", "0", "--grace", str(GRACE_S))
        channel = grpc.insecure_channel(prefix.listening(PATIENCE_S))
        stub = prefix_pb2_grpc.PrefixCacheStub(channel)
        request = prefix_pb2.GatewayGenerateRequest(
            tokens=generate_request(NEW_TOKENS).tokens, config=generate_request(NEW_TOKENS).config
        )
        engine.hold_after(HOLD_AFTER)
        stream = Stream(stub.Generate(request, metadata=OWNER, timeout=5 * PATIENCE_S))
        assert stream.first.wait(PATIENCE_S) and stream.error is None
        prefix.proc.send_signal(signal.SIGTERM)
        becomes(channel, PREFIX_SERVICE, STATUS.NOT_SERVING, prefix.proc)
        assert health(channel, LIVENESS_SERVICE) == STATUS.SERVING
        lookup = prefix_pb2.LookupRequest(tokens=epb.TokenIds(ids=[65, 66, 67]))
        with pytest.raises(grpc.RpcError) as refused:
            stub.Lookup(lookup, metadata=OWNER, timeout=PATIENCE_S)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        stats = stub.Stats(prefix_pb2.StatsRequest(), metadata=OWNER, timeout=PATIENCE_S)  # still served
        assert stats.misses == 1  # the stream's own lookup: the refused one never ran
        assert not stream.ended.is_set() and stream.tokens < NEW_TOKENS  # in flight through every check
        engine.release()
        assert stream.ended.wait(PATIENCE_S)
        assert stream.error is None and stream.done is not None and stream.tokens == NEW_TOKENS
        assert prefix.proc.wait(PATIENCE_S) == 0
        channel.close()
    finally:
        if prefix is not None:
            prefix.kill()
        engine.kill()
