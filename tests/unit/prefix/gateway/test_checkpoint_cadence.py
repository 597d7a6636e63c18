"""CheckpointCadence: the decode checkpoints' stride leaves room for the measured write lag, so the
positions a resume recomputes (stride + lag) stay within N; without a directory it is N as asked."""

from __future__ import annotations

from prefix_service.gateway.checkpoint_cadence import DEFAULT_LAG, RECENT, CheckpointCadence


def test_no_checkpoints_and_no_directory_keep_the_stride_asked() -> None:
    assert CheckpointCadence(0, measured=True).stride() == 0
    assert CheckpointCadence(32, measured=False).stride() == 32


def test_the_stride_leaves_room_for_the_largest_recent_lag() -> None:
    cadence = CheckpointCadence(32, measured=True)
    assert cadence.stride() == 32 - DEFAULT_LAG  # nothing measured yet
    for lag in (1, 3, 2):
        cadence.landed(lag)
    assert cadence.stride() == 29 and cadence.stride() + max(cadence.lags()) <= 32


def test_an_old_lag_leaves_the_window() -> None:
    cadence = CheckpointCadence(32, measured=True)
    cadence.landed(9)
    assert cadence.stride() == 23
    for _ in range(RECENT):
        cadence.landed(1)
    assert cadence.stride() == 31


def test_a_slow_disk_never_takes_the_stride_below_half() -> None:
    cadence = CheckpointCadence(32, measured=True)
    cadence.landed(100)
    assert cadence.stride() == 16
    tiny = CheckpointCadence(1, measured=True)
    tiny.landed(5)
    assert tiny.stride() == 1


class _Host:
    """A gateway whose directory holds a checkpoint after ``written_after`` checks."""

    def __init__(self, written_after: int) -> None:
        self.cadence = CheckpointCadence(8, measured=True)
        self.checks, self.written_after, self.stored = 0, written_after, []

    def store_snapshot(self, snapshot, request, tokens, room) -> None:
        self.stored.append((snapshot.position, tokens[: snapshot.position]))

    def close_session(self, session, call) -> bool:
        return True

    def written(self, request, tokens) -> bool:
        assert tuple(tokens) == self.stored[-1][1]  # the checkpoint's key: prompt + ids before it
        self.checks += 1
        return self.checks > self.written_after


class _Stream:
    """An engine stream read once (the gateway drains what the client did not read)."""

    def __init__(self, events: list) -> None:
        self._events = iter(events)

    def __iter__(self):
        return self._events

    def cancel(self) -> None:
        pass


def test_a_stream_measures_how_far_it_got_while_its_checkpoint_was_written() -> None:
    """Prompt of 4, a checkpoint at position 6 (the ids streamed: 3); the directory holds it from the
    third token event on: the stream had held 4 + 5 = 9 ids, 3 past the checkpoint."""
    from engine_service.api.call_context import CallContext
    from engine_service.api.config import GenConfig
    from engine_service.api.stream_events import Snapshot, SnapshotKind, Tokens
    from prefix_service.gateway.calls import GatewayRequest
    from prefix_service.gateway.stream import GatewayStream

    host = _Host(written_after=2)
    events = [Tokens((10,), ""), Tokens((11,), ""), Tokens((12,), "")]
    events += [Snapshot("h", 6, SnapshotKind.GENERATED)]
    events += [Tokens((13 + i,), "") for i in range(5)]
    request = GatewayRequest("ns", [1, 2, 3, 4], GenConfig(max_new_tokens=8))
    stream = GatewayStream(host, _Stream(events), request, [1, 2, 3, 4], None, CallContext("o"))
    assert [e.ids for e in stream if isinstance(e, Tokens)][-1] == (17,)
    assert host.stored == [(6, (1, 2, 3, 4, 10, 11))]
    assert host.cadence.lags() == (3,) and host.checks == 3  # no checks once it landed
