"""Recovery after an engine restart: a real engine process is killed and restarted on the same port
while Lookups keep arriving at the prefix service; the first Lookup sent after the new engine reports
SERVING succeeds within a second (a miss: ENGINE_RESTARTED), and the cache hits again after a store.

Before the fix the prefix service's channel fell into gRPC's growing reconnect backoff (1 s x 1.6 per
failure, up to 120 s) and kept failing Lookups fast with UNAVAILABLE for seconds after the engine
was back.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from clients.engine_client import EngineClient
from clients.prefix_client import PrefixClient
from engine_service.api import errors
from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.rpc.server import SERVICE_NAME as ENGINE_SERVICE
from engine_service.serving.auth import call_context
from prefix_service.engines.engine_watch import (
    OUTAGE_WAIT_S,
    RECONNECT_OPTIONS,
    EngineWatch,
    OutageAllowance,
    RpcCall,
    call_timeout,
    outage_of,
)
from prefix_service.rpc.server import SERVICE_NAME as PREFIX_SERVICE
from protos import engine_pb2, engine_pb2_grpc
from tests.service.helpers import PROMPT, wait_for

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the afternoon sun."
RECOVERY_S = 1.0  # the promise: the first Lookup after the engine reports SERVING completes within this


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServiceProcess:
    """A service's console entry (``python -m engine_service`` / ``prefix_service``) in its own process:
    its own gRPC channels, as in a deployment (channels in one process share their connections)."""

    def __init__(self, module: str, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args, "--log_level", "WARNING"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def listening(self, timeout: float = 60.0) -> str:
        """Wait for the "listening on HOST:PORT" line; returns HOST:PORT."""
        assert self.proc.stdout is not None
        lines: list[str] = []
        timer = threading.Timer(timeout, self.proc.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                lines.append(line)
                if " listening on " in line:
                    threading.Thread(
                        target=self.proc.stdout.read, daemon=True
                    ).start()  # keep the pipe drained
                    return line.rsplit(" ", 1)[1].strip()
        finally:
            timer.cancel()
        raise AssertionError("service did not start:\n" + "".join(lines[-20:]))

    def kill(self) -> None:
        """SIGKILL: a crash, nothing drained."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)


class EngineProcess(ServiceProcess):
    """The engine (the packaged model) on a fixed port, so that a restart comes back at the same address."""

    def __init__(self, port: int) -> None:
        super().__init__(
            "engine_service", "--port", str(port), "--max_sessions", "8", "--max_session_tokens", "256"
        )
        self.port = port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


def serving(address: str) -> bool:
    """Ask the engine's own health service directly (a fresh channel: no reconnect backoff of its own)."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=ENGINE_SERVICE), timeout=5
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def wait_serving(engine: EngineProcess, timeout: float = 60.0) -> float:
    """Poll until the engine reports SERVING; returns that moment (time.monotonic())."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serving(engine.address):
            return time.monotonic()
        assert engine.proc.poll() is None, f"engine exited with {engine.proc.returncode}"
        time.sleep(0.01)
    raise AssertionError(f"engine on {engine.address} not SERVING within {timeout} s")


@dataclass(frozen=True)
class Attempt:
    sent: float
    ended: float
    reason: str | None  # the Lookup's miss reason ("unspecified" on a hit); None when the call failed
    error: str = ""


class LookupLoop:
    """A client thread sending Lookups back to back (bounded: at most ``limit``), recording each."""

    def __init__(self, address: str, engine_address: str, limit: int = 2000) -> None:
        self.client = PrefixClient(address, owner="alice", timeout=5.0)
        self.engine = EngineClient(engine_address, owner="alice", timeout=2.0)  # closes the hits' clones
        self.attempts: list[Attempt] = []
        self._stop = threading.Event()
        self._limit = limit
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.attempts) < self._limit:
            sent = time.monotonic()
            try:
                result = self.client.lookup(text=TEXT)
                self.attempts.append(Attempt(sent, time.monotonic(), result.reason))
            except errors.ForklineError as exc:
                self.attempts.append(Attempt(sent, time.monotonic(), None, f"{type(exc).__name__}: {exc}"))
            else:
                if result.session:
                    with contextlib.suppress(errors.ForklineError):
                        self.engine.close(result.session)
            time.sleep(0.02)

    def stop(self) -> list[Attempt]:
        self._stop.set()
        self._thread.join(30)
        return self.attempts


def restart_and_measure(
    engine: EngineProcess, prefix_address: str, outage_s: float
) -> tuple[EngineProcess, float, float]:
    """Kill the engine, keep it down ``outage_s`` (plus its load time) while the loop keeps sending
    Lookups, restart it on the same port; returns the new engine, the moment it reported SERVING and
    the seconds from then to the end of the first Lookup sent after it, which must succeed as a
    restart miss."""
    engine.kill()
    time.sleep(outage_s)
    engine = EngineProcess(engine.port)
    back = wait_serving(engine)
    try:
        first = PrefixClient(prefix_address, owner="bob", timeout=10.0).lookup(text=TEXT)
    except errors.ForklineError as exc:
        raise AssertionError(
            f"the first Lookup {time.monotonic() - back:.2f} s after SERVING failed: {exc!r}"
        ) from None
    recovery = time.monotonic() - back
    assert (first.session, first.reason) == (None, "engine_restarted")
    return engine, back, recovery


@pytest.mark.slow
def test_lookups_recover_within_a_second_after_an_engine_restart() -> None:
    engine = EngineProcess(free_port())
    prefix = None
    loop = None
    try:
        wait_serving(engine)
        prefix = ServiceProcess("prefix_service", "--engine", engine.address, "--port", "0")
        prefix_address = prefix.listening()
        gateway = PrefixClient(prefix_address, owner="alice", timeout=30.0)
        gateway.generate(text=TEXT, config=GenConfig(max_new_tokens=1)).collect()
        hit = gateway.lookup(text=TEXT)
        assert hit.reason == "unspecified" and hit.session
        EngineClient(engine.address, owner="alice").close(hit.session)
        loop = LookupLoop(prefix_address, engine.address)
        recoveries, backs, kills = [], [], []
        for outage_s in (1.0, 0.5):  # each outage also spans the new engine's model load (~3 s)
            before = len(loop.attempts)
            kills.append(time.monotonic())
            engine, back, recovery = restart_and_measure(engine, prefix_address, outage_s)
            recoveries.append(recovery)
            backs.append(back)
            # ...and it caches again after a store
            gateway.generate(text=TEXT, config=GenConfig(max_new_tokens=1)).collect()
            assert wait_for_attempt(loop, before, "unspecified"), loop.attempts[before:][-5:]
        attempts = loop.stop()
        kills.append(time.monotonic())
        assert all(r < RECOVERY_S for r in recoveries), recoveries
        assert (
            sum(a.error.startswith("Unavailable") for a in attempts) > 0
        )  # the loop did run into the outages
        for back, next_kill in zip(
            backs, kills[1:], strict=True
        ):  # the loop's view: after SERVING nothing failed
            after = [a for a in attempts if back <= a.sent and a.ended < next_kill]
            assert after and after[0].ended - back < RECOVERY_S and after[0].reason == "engine_restarted", (
                after[:3]
            )
            assert not [a for a in after if a.error], [a for a in after if a.error][:3]
        stats = gateway.stats()
        assert stats.dropped_on_restart == 2 and stats.entries == 1
        print(f"recovery after SERVING: {', '.join(f'{r:.3f} s' for r in recoveries)}")
    finally:
        if loop is not None:
            loop.stop()
        if prefix is not None:
            prefix.kill()
        engine.kill()


def wait_for_attempt(loop: LookupLoop, start: int, reason: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(a.reason == reason for a in loop.attempts[start:]):
            return True
        time.sleep(0.02)
    return False


# --------------------------------------------------------------------------- in-process, fast


def test_old_channel_settings_stay_down_after_the_engine_is_back(engine_factory) -> None:
    """Negative control at the channel level: two channels to one engine, both failing for 3.4 s while
    it is down. gRPC's default backoff (attempts at 0, 0.8-1.2, 2.08-3.12, 4.13-6.19 s, ...) leaves a
    call just after the restart failing fast with UNAVAILABLE; the service's options with
    wait_for_ready connect within a second."""
    engine = engine_factory()
    port = engine.port
    local = (("grpc.use_local_subchannel_pool", 1),)  # no connection shared with another channel
    old = grpc.insecure_channel(engine.address, options=local)
    new = grpc.insecure_channel(engine.address, options=local + RECONNECT_OPTIONS)
    stubs = {"old": (engine_pb2_grpc.EngineStub(old), False), "new": (engine_pb2_grpc.EngineStub(new), True)}
    try:
        for stub, ready in stubs.values():
            stub.Info(engine_pb2.InfoRequest(), timeout=5, wait_for_ready=ready)
        engine.stop(0)
        down = time.monotonic()
        while time.monotonic() - down < 3.4:
            for stub, ready in stubs.values():
                with contextlib.suppress(grpc.RpcError):
                    stub.Info(engine_pb2.InfoRequest(), timeout=0.05, wait_for_ready=ready)
            time.sleep(0.02)
        engine_factory(port=port)  # serving from here on
        back = time.monotonic()
        # the old channel first: its next default retry (4.13 s after down at the earliest) is near
        stub, ready = stubs["old"]
        with pytest.raises(grpc.RpcError) as failed:
            stub.Info(engine_pb2.InfoRequest(), timeout=3 * RECOVERY_S, wait_for_ready=ready)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - back < 3 * RECOVERY_S
        stub, ready = stubs["new"]
        stub.Info(engine_pb2.InfoRequest(), timeout=3 * RECOVERY_S, wait_for_ready=ready)
        assert time.monotonic() - back < 3 * RECOVERY_S
    finally:
        old.close()
        new.close()


def test_engine_outage_seen_by_the_watch(engine_factory, prefix_factory) -> None:
    """While the engine is down a Lookup waits about ``outage_wait_s`` and answers UNAVAILABLE, and the
    prefix service reports its own service NOT_SERVING; when the engine serves again the watch runs
    the restart check before any call (the dead instance's entries are dropped) and health recovers."""
    engine = engine_factory()
    prefix = prefix_factory(engine.address)
    alice = PrefixClient(prefix.address, owner="alice", timeout=10.0)
    alice.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    watch = prefix.server.engine_watch
    assert watch is not None and prefix.server.engine_serving and prefix_health(prefix.address) == "SERVING"
    engine.stop(0)
    assert wait_for(lambda: not prefix.server.engine_serving, 60)
    assert prefix_health(prefix.address) == "NOT_SERVING" and prefix_health(prefix.address, "") == "SERVING"
    start = time.monotonic()
    with pytest.raises(errors.Unavailable, match="not serving"):
        alice.lookup(PROMPT)
    assert 0.8 * OUTAGE_WAIT_S <= time.monotonic() - start < OUTAGE_WAIT_S + 5.0  # the claim: it waited
    start = time.monotonic()
    with pytest.raises(errors.ForklineError):  # a caller's shorter deadline bounds the wait
        PrefixClient(prefix.address, owner="alice", timeout=0.2).lookup(PROMPT)
    assert time.monotonic() - start < 0.8 * OUTAGE_WAIT_S  # bounded by the caller's 0.2 s, not the allowance
    engine_factory(port=engine.port)
    assert wait_for(lambda: prefix.server.engine_serving, 60)
    assert wait_for(lambda: alice.stats().dropped_on_restart == 1, 60)  # no Lookup needed to notice
    assert prefix_health(prefix.address) == "SERVING"
    assert alice.lookup(PROMPT).reason == "engine_restarted"
    alice.generate(PROMPT, config=GenConfig(max_new_tokens=1)).collect()
    assert alice.lookup(PROMPT).reused == len(PROMPT) - 1


def prefix_health(address: str, service: str = PREFIX_SERVICE) -> str:
    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class FakeContext:
    def __init__(self, remaining: float) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float:
        return self.remaining

    def invocation_metadata(self) -> tuple:
        return (("forkline-owner", "alice"),)


def test_engine_calls_carry_the_callers_deadline() -> None:
    assert call_timeout(60.0) == 60.0 and call_timeout(None) is None  # outside an RPC: the cap
    call = call_context(FakeContext(2.0))  # type: ignore[arg-type]
    assert call.owner == "alice" and call.credential == ""
    assert 1.9 < call_timeout(60.0, call) <= 2.0 and 1.9 < call_timeout(None, call) <= 2.0
    assert call_timeout(0.5, call) == 0.5
    no_deadline = call_context(FakeContext(9.2e18))  # type: ignore[arg-type]  # grpc's "no deadline"
    assert no_deadline.deadline is None
    assert call_timeout(60.0, no_deadline) == 60.0 and call_timeout(None, no_deadline) is None
    assert dict(RECONNECT_OPTIONS)["grpc.max_reconnect_backoff_ms"] <= 500


def test_one_rpc_waits_for_a_down_engine_once() -> None:
    """The outage allowance is per incoming RPC: its second engine call does not wait again."""
    watch = EngineWatch(grpc.insecure_channel("127.0.0.1:1"), outage_wait_s=2.0)
    watch._set(False)
    call = RpcCall.of(CallContext("alice", deadline=time.monotonic() + 60.0))
    start = time.monotonic()
    for _ in range(3):
        with pytest.raises(errors.Unavailable):
            watch.await_serving(call_timeout(60.0, call), outage_of(call))
    assert 1.9 < time.monotonic() - start < 4.0  # one wait of 2 s, not three (6 s)
    # negative control: calls without a shared allowance (a plain CallContext) each wait it out
    start = time.monotonic()
    for _ in range(2):
        with pytest.raises(errors.Unavailable):
            watch.await_serving(None, outage_of(CallContext("alice")))
    assert time.monotonic() - start > 3.6  # two waits of 2 s
    threading.Timer(0.1, watch._set, (True,)).start()
    watch.await_serving(None, OutageAllowance())  # a new allowance: it comes back within it
    assert watch.serving and watch.transitions == 2


def test_the_restart_check_runs_before_the_waiting_calls_go_on() -> None:
    """Requests read no Info of their own, so a call that waited out an outage must find the restart
    check done: a transition to SERVING runs ``on_serving`` first, then releases the waiting calls.
    (Released first, a waiting call would have gone on while the check was still running.)"""
    watch = EngineWatch(grpc.insecure_channel("127.0.0.1:1"), outage_wait_s=5.0)
    watch._set(False)
    released = threading.Event()

    def waiting_call() -> None:
        watch.await_serving(None)
        released.set()

    seen_during_check: list[bool] = []

    def restart_check() -> None:
        time.sleep(0.2)  # an Info call to the engine
        seen_during_check.append(released.is_set())

    watch._on_serving = restart_check
    caller = threading.Thread(target=waiting_call)
    caller.start()
    time.sleep(0.05)
    watch._set(True)
    caller.join(5)
    assert seen_during_check == [False] and released.is_set()
