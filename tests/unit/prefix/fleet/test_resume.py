"""ResumingStream over scripted engine streams: what the client sees across a mid-stream failure (one
Started, every token once, one merged Done), the request each resume starts (prompt + streamed ids, the
rest of the budget, ``drawn_tokens``, the failed engine avoided), and when it does not resume (a stop
token or the whole budget already sent: a Done; the client gone; resumes spent: the error)."""

from __future__ import annotations

import pytest

from engine_service.api.config import GenConfig
from engine_service.api.errors import ForklineError, ResourceExhausted, Unavailable
from engine_service.api.stream_events import Done, FinishReason, Started, Tokens
from prefix_service.fleet.resume import ResumingStream
from prefix_service.gateway.calls import GatewayRequest

PROMPT = [5, 6, 7]
EOS = 2


class Scripted:
    """A started stream that yields ``events`` (an exception among them is raised there)."""

    def __init__(self, engine: str, events: list) -> None:
        self.engine, self.events, self.stopped = engine, events, False

    def stop(self) -> None:
        self.stopped = True

    def __iter__(self):
        for event in self.events:
            if isinstance(event, Exception):
                raise event
            yield event


def done(generated: int, reason: FinishReason = FinishReason.LENGTH) -> Done:
    return Done(reason, 9, 0, generated, 20, 0.1, 50.0, 1.0)


def streams(*scripts: Scripted):
    calls: list[tuple[GatewayRequest, frozenset[str]]] = []
    queue = list(scripts)

    def start(request: GatewayRequest, avoid: frozenset[str]):
        calls.append((request, avoid))
        if not queue:
            raise Unavailable("no engine left")
        return queue.pop(0)

    return start, calls


def request(n: int = 6) -> GatewayRequest:
    return GatewayRequest("ns", list(PROMPT), GenConfig(max_new_tokens=n, temperature=1.0, seed=4))


def test_a_failure_mid_stream_continues_on_another_engine() -> None:
    start, calls = streams(
        Scripted("a", [Started("", 0, 3), Tokens((1, 3), "ab"), Unavailable("connection lost")]),
        Scripted("b", [Started("", 0, 5), Tokens((4,), "c"), Tokens((8, 9, 10), "def"), done(4)]),
    )
    events = list(ResumingStream(start, request(), (EOS,), max_resumes=2))
    assert [type(e) for e in events] == [Started, Tokens, Tokens, Tokens, Done]
    assert events[0] == Started("", 0, 3)  # the first attempt's: what was reused
    assert [i for e in events if isinstance(e, Tokens) for i in e.ids] == [1, 3, 4, 8, 9, 10]
    resumed, avoid = calls[1]
    assert resumed.prompt == [*PROMPT, 1, 3] and avoid == {"a"}
    assert (resumed.config.max_new_tokens, resumed.config.drawn_tokens, resumed.config.seed) == (4, 2, 4)
    assert not resumed.count_lookup and calls[0][0].count_lookup
    last = events[-1]
    assert (last.resumes, last.resumed_positions, last.generated_tokens) == (1, 5, 6)
    assert (last.prompt_positions, last.reused_positions) == (3, 0)


def test_a_stream_cut_with_a_status_of_no_forkline_meaning_is_resumed() -> None:
    """A killed process's stream can end INTERNAL or UNKNOWN (a plain ForklineError), not UNAVAILABLE."""
    start, calls = streams(
        Scripted("a", [Started("", 0, 3), Tokens((1,), ""), ForklineError("RST_STREAM with error code 2")]),
        Scripted("b", [Started("", 0, 4), Tokens((3,), ""), done(1)]),
    )
    events = list(ResumingStream(start, request(2), (EOS,), max_resumes=1))
    assert len(calls) == 2 and events[-1].resumes == 1


def test_a_cut_after_the_last_token_ends_without_a_resume() -> None:
    for tokens, reason in (((1, EOS), FinishReason.STOP), ((1, 3, 4, 5, 6, 7), FinishReason.LENGTH)):
        start, calls = streams(Scripted("a", [Started("", 0, 3), Tokens(tokens, ""), Unavailable("gone")]))
        events = list(ResumingStream(start, request(), (EOS,), max_resumes=2))
        assert len(calls) == 1 and events[-1].finish_reason is reason
        assert events[-1].generated_tokens == len(tokens)


def test_an_engine_cancelling_is_a_failure_a_client_stop_is_not() -> None:
    cancelled = done(1, FinishReason.CANCELLED)
    start, calls = streams(
        Scripted("a", [Started("", 0, 3), Tokens((1,), ""), cancelled]),
        Scripted("b", [Started("", 0, 4), Tokens((3,), ""), done(1)]),
    )
    events = list(ResumingStream(start, request(2), (EOS,), max_resumes=1))
    assert len(calls) == 2 and events[-1].finish_reason is FinishReason.LENGTH
    start, calls = streams(Scripted("a", [Started("", 0, 3), Tokens((1,), ""), cancelled]))
    stream = ResumingStream(start, request(2), (EOS,), max_resumes=1)
    stream.stop()
    assert list(stream)[-1] is cancelled and len(calls) == 1


@pytest.mark.parametrize("max_resumes", [0, 1])
def test_spent_resumes_and_no_engine_left_raise_the_error(max_resumes) -> None:
    start, calls = streams(
        Scripted("a", [Started("", 0, 3), Tokens((1,), ""), Unavailable("first")]),
        Scripted("b", [Started("", 0, 4), Unavailable("second")]),
    )
    with pytest.raises(Unavailable, match="first" if max_resumes == 0 else "second"):
        list(ResumingStream(start, request(), (EOS,), max_resumes=max_resumes))
    assert len(calls) == 1 + max_resumes
    start, _ = streams(Scripted("a", [Started("", 0, 3), Unavailable("first")]))
    with pytest.raises(Unavailable, match="first"):  # no engine to resume on: the original error
        list(ResumingStream(start, request(), (EOS,), max_resumes=2))
    start, _ = streams(Scripted("a", [Started("", 0, 3), ResourceExhausted("full")]))
    with pytest.raises(ResourceExhausted):  # not a failure of the engine: never resumed
        list(ResumingStream(start, request(), (EOS,), max_resumes=2))


def test_a_split_generation_is_handed_off_after_its_first_token() -> None:
    """The prefill half ends with its one token (LENGTH): the rest starts from the hand-off with the
    prefill engine as the snapshot's source; a later failure resumes through the hand-off too."""
    handed: list[tuple[GatewayRequest, frozenset[str], str]] = []
    decode = [
        Scripted("d1", [Started("", 4, 1), Tokens((3, 4), ""), Unavailable("gone")]),
        Scripted("d2", [Started("", 0, 7), Tokens((8,), ""), done(1)]),
    ]

    def hand_off(request: GatewayRequest, avoid: frozenset[str], source: str):
        handed.append((request, avoid, source))
        return decode.pop(0)

    start, calls = streams(Scripted("p", [Started("", 0, 3), Tokens((1,), ""), done(1)]))
    events = list(ResumingStream(start, request(4), (EOS,), max_resumes=1, hand_off=hand_off))
    assert [i for e in events if isinstance(e, Tokens) for i in e.ids] == [1, 3, 4, 8]
    assert [type(e) for e in events].count(Started) == 1 and len(calls) == 1
    (first, avoid, source), (second, avoid2, source2) = handed
    assert source == "p" and avoid == set() and first.prompt == [*PROMPT, 1]
    assert (first.config.max_new_tokens, first.config.drawn_tokens) == (3, 1)
    assert source2 == "" and avoid2 == {"d1"} and second.prompt == [*PROMPT, 1, 3, 4]
    last = events[-1]
    assert (last.generated_tokens, last.resumes, last.resumed_positions) == (4, 1, 7)


def test_a_first_token_that_ends_the_answer_is_not_handed_off() -> None:
    start, _ = streams(Scripted("p", [Started("", 0, 3), Tokens((EOS,), ""), done(1, FinishReason.STOP)]))
    events = list(ResumingStream(start, request(4), (EOS,), max_resumes=1, hand_off=lambda *a: 1 / 0))
    assert events[-1].finish_reason is FinishReason.STOP
