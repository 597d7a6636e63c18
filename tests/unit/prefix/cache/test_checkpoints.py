"""Checkpoints inside a stored prompt on a sliding-window engine (``prefix_service/cache/checkpoints.py``),
against the fakes: where a capture asks for them, how a lookup diverging inside a stored prompt walks
to the longest one it can clone, the ``window`` miss without them, and that they are ordinary entries
of the budget and the retention policy.

The fakes model ``batched-sequence`` rings: a snapshot of ``n`` positions clones only at
``p >= n - max_write`` (``floor``); below, the engine refuses with ``CloneRefusal.WINDOW``."""

from __future__ import annotations

import pytest

from engine_service.api.call_context import CallContext
from engine_service.api.config import GenConfig
from engine_service.api.errors import InvalidArgument
from engine_service.api.prompts import TextPrompt, Tokenized
from prefix_service.cache.checkpoints import CheckpointPlan, checkpoint_positions
from prefix_service.cache.outcomes import LookupOutcome, MissReason
from prefix_service.cache.prefix_cache import PrefixCache
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.gateway.gateway import Gateway
from tests.unit.prefix.fake_engine import FakeEngine, WindowBackend

NS = "app"
LONG = tuple(range(10, 210))  # 200 tokens
MAX_WRITE = 64


def diverging(at: int, length: int = 200) -> tuple[int, ...]:
    """A prompt sharing LONG's first ``at`` tokens, then different ones."""
    return LONG[:at] + tuple(range(600, 600 + length - at))


# -- where checkpoints go -----------------------------------------------------------------------


def test_stride_positions_lie_strictly_between_the_reused_part_and_the_prompt_end():
    plan = CheckpointPlan(stride=64, max_checkpoints=8)
    assert checkpoint_positions(plan, 200, 0) == (64, 128, 192)
    assert checkpoint_positions(plan, 192, 0) == (64, 128)  # the prompt end is the prompt snapshot
    assert checkpoint_positions(plan, 200, 64) == (128, 192)  # reused positions are not computed again
    assert checkpoint_positions(plan, 200, 130) == (192,)
    assert checkpoint_positions(plan, 200, 199) == ()


def test_message_ends_come_first_and_stride_points_are_thinned_evenly():
    plan = CheckpointPlan(stride=10, max_checkpoints=4)
    # 18 stride points in (0, 200) besides the end at 150; 2 message ends leave room for 2: every 9th
    assert checkpoint_positions(plan, 200, 0, message_ends=(37, 150)) == (37, 90, 150, 190)
    # outside (reused, prompt end): ignored; 19 stride points, room for 3: evenly spaced, the last kept
    assert checkpoint_positions(plan, 200, 0, message_ends=(0, 37, 200, 250)) == (37, 60, 120, 190)
    assert checkpoint_positions(CheckpointPlan(256, 2), 1440, 0) == (512, 1280)  # of 256 .. 1280
    assert checkpoint_positions(CheckpointPlan(256, 1), 1440, 0) == (1280,)
    assert checkpoint_positions(CheckpointPlan(10, 2), 200, 0, message_ends=(5, 37, 150)) == (37, 150)


def test_a_zero_cap_turns_checkpoints_off_a_zero_stride_keeps_ends_and_branch_points():
    assert checkpoint_positions(CheckpointPlan(0, 0), 2000, 0, message_ends=(37,)) == ()
    assert checkpoint_positions(CheckpointPlan(64, 0), 2000, 0) == ()
    assert checkpoint_positions(CheckpointPlan(0, 8), 2000, 0) == ()  # the default stride: off
    assert checkpoint_positions(CheckpointPlan(0, 8), 2000, 0, (37,), (900, 37, 2000)) == (37, 900)
    with pytest.raises(InvalidArgument, match="stride"):
        CheckpointPlan(-1)


def render(messages, add_generation_prompt=True) -> str:
    """A chatml-like template (what the engine renders)."""
    text = "".join(f"<{role}>{content}</>" for role, content in messages)
    return text + ("<assistant>" if add_generation_prompt else "")


def char_tokenize(prompt: TextPrompt) -> list[int]:
    return [ord(c) for c in render(prompt.messages)]


def rendered_ends(prompt: TextPrompt, most: int) -> tuple[int, ...]:
    """The engine's message ends, computed independently: where each shorter rendering (a generation
    prompt after it) stops agreeing with the whole one, as characters."""
    full, ends = render(prompt.messages), []
    for count in range(len(prompt.messages) - 1, 0, -1)[:most]:
        head = render(prompt.messages[:count])
        ends.append(next((i for i, (a, b) in enumerate(zip(head, full, strict=False)) if a != b), len(head)))
    return tuple(sorted(ends))


class RenderingEngine(FakeEngine):
    """The window engine, tokenizing chat text as the engine does and answering its message ends;
    ``asked`` records each Tokenize's ``message_ends``."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.asked: list[int] = []

    def tokenize(self, text: TextPrompt, call: CallContext, message_ends: int = 0) -> Tokenized:
        self.asked.append(message_ends)
        return Tokenized(tuple(char_tokenize(text)), rendered_ends(text, message_ends))


# -- lookups diverging inside a stored prompt -------------------------------------------------------


def store_long(cache: PrefixCache, backend: WindowBackend, checkpoints=(96, 192)) -> None:
    assert cache.insert(NS, LONG, backend.snapshot(LONG)).stored
    for c in checkpoints:
        assert cache.insert(NS, LONG[:c], backend.snapshot(LONG[:c]), {"boundary": "breakpoint"}).stored


@pytest.mark.parametrize("max_rewind", [MAX_WRITE, None])
def test_a_divergence_past_the_window_reuses_the_longest_checkpoint_at_or_before_it(max_rewind):
    backend = WindowBackend(max_write=MAX_WRITE, max_rewind=max_rewind)
    cache = PrefixCache(backend, 16)
    store_long(cache, backend)
    outcome = cache.lookup(NS, diverging(120))
    # 200 (floor 136) and 192 (floor 128) cannot clone at 120: checkpoint 96 serves
    assert outcome.reused == 96 and outcome.session.tokens == LONG[:96]
    clones = [upto for _, upto in backend.clone_calls]
    if max_rewind is None:  # nothing known about the window: the engine refuses 192 and 200 first
        assert clones == [120, 120, 96]
    else:  # known: no clone call for a candidate below its ring's floor
        assert clones == [96]


def test_a_divergence_within_max_write_of_a_later_checkpoint_reuses_every_shared_position():
    backend = WindowBackend(max_write=MAX_WRITE)
    cache = PrefixCache(backend, 16)
    store_long(cache, backend)
    assert cache.lookup(NS, diverging(150)).reused == 150  # 192's floor is 128
    assert cache.lookup(NS, diverging(60)).reused == 60  # 96's floor is 32


@pytest.mark.parametrize("max_rewind", [MAX_WRITE, None])
def test_without_checkpoints_a_divergence_past_the_window_is_a_window_miss(max_rewind):
    backend = WindowBackend(max_write=MAX_WRITE, max_rewind=max_rewind)
    cache = PrefixCache(backend, 16)
    store_long(cache, backend, checkpoints=())
    assert cache.lookup(NS, diverging(120)) == LookupOutcome.miss(MissReason.WINDOW, 120)
    assert cache.reusable(NS, diverging(120)) == (0 if max_rewind else 120)  # what routing scores
    assert cache.lookup(NS, diverging(150)).reused == 150  # above the floor: a hit (control)


def test_a_refusal_for_room_is_boundary_refused_not_window():
    """A refusal that evicting could cure must stay BOUNDARY_REFUSED (the gateway relieves pressure
    for it), even when another candidate was refused for the window."""
    backend = WindowBackend(max_write=MAX_WRITE, max_rewind=None)
    cache = PrefixCache(backend, 16)
    store_long(cache, backend, checkpoints=(96,))
    backend.capacity = len(backend.live)  # the next clone finds the engine full
    outcome = cache.lookup(NS, diverging(120))
    assert outcome == LookupOutcome.miss(MissReason.BOUNDARY_REFUSED, 120)


def test_an_engine_that_does_not_say_why_reports_boundary_refused():
    engine = FakeEngine()
    engine.say_window = False
    cache = PrefixCache(engine, 8)
    assert cache.insert(NS, LONG, engine.open(LONG, floor=136)).stored
    assert cache.lookup(NS, diverging(120)).reason is MissReason.BOUNDARY_REFUSED
    engine.say_window = True
    assert cache.lookup(NS, diverging(120)).reason is MissReason.WINDOW


# -- the gateway asks for them --------------------------------------------------------------------


def window_gateway(
    window_evicts=True, max_entries=16, policy="lru", engine_class=FakeEngine, **kwargs
) -> tuple[FakeEngine, Gateway]:
    engine = engine_class(max_session_tokens=1024)
    engine.window_evicts, engine.max_write = window_evicts, MAX_WRITE
    gateway = Gateway(
        PrefixCache(engine, max_entries, policy, **kwargs),
        engine,
        policy,
        checkpoints=CheckpointPlan(stride=96, max_checkpoints=8),
    )
    return engine, gateway


def generate(gateway: Gateway, prompt, **kwargs) -> list:
    return list(
        gateway.generate(
            GatewayRequest(NS, prompt, GenConfig(max_new_tokens=3), **kwargs), CallContext("alice")
        )
    )


def stored(gateway: Gateway) -> dict[int, str]:
    return {len(e.tokens): e.metadata.get("boundary", "prompt") for e in gateway.cache.entries()}


def test_the_gateway_asks_for_checkpoints_past_the_match_and_stores_them():
    engine, gateway = window_gateway()
    generate(gateway, LONG)
    assert engine.requests[0].config.prefill_breakpoints == (96, 192)
    assert stored(gateway) == {96: "breakpoint", 192: "breakpoint", 200: "prompt"}
    done = generate(gateway, diverging(120, 260))[-1]
    assert done.reused_positions == 96  # the longest checkpoint at or before the divergence
    assert engine.requests[1].tokens == diverging(120, 260)[96:]
    # only what the engine computes: the stride point and where it leaves LONG (a branch point)
    assert engine.requests[1].config.prefill_breakpoints == (120, 192)
    assert gateway.stats().misses_by_reason == {"empty": 1}


def test_without_checkpoints_the_same_divergence_is_a_window_miss():
    engine, gateway = window_gateway()
    gateway.checkpoints = CheckpointPlan(max_checkpoints=0)
    generate(gateway, LONG)
    assert engine.requests[0].config.prefill_breakpoints == () and stored(gateway) == {200: "prompt"}
    assert generate(gateway, diverging(120, 260))[-1].reused_positions == 0
    assert gateway.stats().misses_by_reason == {"empty": 1, "window": 1}


def test_by_default_a_checkpoint_goes_where_stored_prompts_diverged_before():
    engine, gateway = window_gateway()
    gateway.checkpoints = CheckpointPlan()  # no stride points
    generate(gateway, LONG)
    assert engine.requests[0].config.prefill_breakpoints == () and stored(gateway) == {200: "prompt"}
    generate(gateway, diverging(120, 260))  # a window miss; it leaves LONG at 120: a checkpoint there
    assert engine.requests[1].config.prefill_breakpoints == (120,)
    assert stored(gateway)[120] == "breakpoint"
    third = diverging(120, 260)[:140] + tuple(range(900, 960))  # past both snapshots' reach at 120+
    assert generate(gateway, third)[-1].reused_positions == 120


def test_an_engine_that_keeps_every_row_gets_no_checkpoints():
    """batched-cell (window.evicts False): the prompt snapshot clones at any earlier position."""
    engine, gateway = window_gateway(window_evicts=False)
    generate(gateway, LONG)
    assert engine.requests[0].config.prefill_breakpoints == () and stored(gateway) == {200: "prompt"}
    assert generate(gateway, diverging(120, 260))[-1].reused_positions == 120


def test_chat_message_ends_become_checkpoints():
    engine, gateway = window_gateway(engine_class=RenderingEngine)
    gateway.checkpoints = CheckpointPlan()  # the default: message ends (and branch points) only
    messages = (("system", "s" * 150), ("user", "q" * 100))
    text = TextPrompt("", chat=True, messages=messages)
    generate(gateway, text)
    system_end = len("<system>" + "s" * 150 + "</><")
    assert engine.requests[0].config.prefill_breakpoints == (system_end,)
    # the fleet passes token ids and the message ends its Tokenize returned
    other = TextPrompt("", chat=True, messages=(messages[0], ("user", "r" * 90)))
    done = generate(gateway, char_tokenize(other), message_ends=rendered_ends(other, 8))[-1]
    assert done.reused_positions == system_end


def test_a_chat_costs_one_tokenize_and_asks_for_ends_only_where_the_window_evicts():
    """The message ends come with the prompt's own tokenization (no call per message), asked for only
    on an engine whose ring evicts rows, at most the plan's checkpoints (fewer than half the cache)."""
    text = TextPrompt("", chat=True, messages=(("system", "s" * 150), ("user", "q" * 100), ("user", "x")))
    engine, gateway = window_gateway(engine_class=RenderingEngine)
    generate(gateway, text)
    generate(gateway, text)  # a full hit: still the one call
    assert engine.asked == [7, 7]  # 16 entries: at most 16 // 2 - 1 checkpoints per prompt
    small, gateway = window_gateway(engine_class=RenderingEngine, max_entries=6)
    generate(gateway, text)
    assert small.asked == [2]  # 6 entries: at most 6 // 2 - 1 checkpoints per prompt
    full, gateway = window_gateway(window_evicts=False, engine_class=RenderingEngine)
    generate(gateway, text)
    assert full.asked == [0] and full.requests[0].config.prefill_breakpoints == ()


# -- the budget and the retention policy ------------------------------------------------------------


def test_checkpoints_weigh_their_positions_and_are_evicted_like_entries():
    engine, gateway = window_gateway(max_entries=16, max_positions=550)
    generate(gateway, LONG)  # 96 + 192 + 200 = 488 positions
    assert gateway.cache.positions == 488 and len(gateway.cache) == 3
    before = {e.snapshot for e in gateway.cache.entries()}
    other = tuple(range(300, 390))  # 90 more (no checkpoint): the LRU victim is LONG's oldest entry, 96
    generate(gateway, other)
    assert gateway.cache.positions == 192 + 200 + 90 and gateway.cache.stats().evictions == 1
    left = {e.tokens for e in gateway.cache.entries()}
    assert left == {LONG[:192], LONG, other}
    evicted = before - {e.snapshot for e in gateway.cache.entries()}
    assert [s.tokens for s in evicted] == [LONG[:96]] and all(s.closed for s in evicted)  # released
    # the evicted checkpoint no longer serves: the divergence at 120 inside LONG is a window miss now
    assert gateway.lookup(NS, diverging(120, 260), CallContext("alice")).outcome == LookupOutcome.miss(
        MissReason.WINDOW, 120
    )
    assert gateway.stats().misses_by_reason.get("window") == 1


def test_checkpoints_count_against_max_entries_and_the_priority_policy_keeps_them_longer():
    others = [tuple(range(start, start + 50)) for start in (300, 400, 500, 800)]  # prompts, no checkpoints
    engine, gateway = window_gateway(max_entries=6, policy="priority")
    generate(gateway, LONG)
    for other in others:
        generate(gateway, other)
    held = {e.tokens for e in gateway.cache.entries()}
    # the 7th entry evicts the lowest priority: prompt snapshots before checkpoints, LRU among them
    assert len(held) == 6 and LONG not in held and {LONG[:96], LONG[:192]} <= held
    assert generate(gateway, diverging(120, 260))[-1].reused_positions == 96
    engine, gateway = window_gateway(max_entries=6, policy="lru")
    generate(gateway, LONG)
    for other in others:
        generate(gateway, other)
    held = {e.tokens for e in gateway.cache.entries()}
    assert LONG[:96] not in held and LONG in held  # LRU: the oldest entry, a checkpoint, went first


def test_one_prompt_takes_at_most_half_the_cache():
    engine, gateway = window_gateway(max_entries=4)  # one checkpoint at most (with the prompt: half)
    generate(gateway, LONG)
    assert engine.requests[0].config.prefill_breakpoints == (192,)
    assert stored(gateway) == {192: "breakpoint", 200: "prompt"}
    engine, gateway = window_gateway(max_entries=2)
    generate(gateway, LONG)
    assert engine.requests[0].config.prefill_breakpoints == () and stored(gateway) == {200: "prompt"}


def test_a_prompt_extending_a_stored_one_gets_checkpoints_only_past_it():
    engine, gateway = window_gateway()
    generate(gateway, LONG)
    done = generate(gateway, LONG + tuple(range(700, 800)))[-1]
    assert done.reused_positions == 200
    assert engine.requests[1].config.prefill_breakpoints == (288,)


# -- in process: a real tiny model over a Runner (the CLI's embedded path) --------------------------


@pytest.mark.parametrize("kind", ["batched-sequence", "batched-cell"])
def test_in_process_checkpoints_on_a_real_ring(kind):
    """A Runner over the tiny FRFR model (window 4, max_write 16): capture.observer clones at the
    prefill breakpoints; a prompt diverging at 60 inside a stored 100-token prompt reuses the
    checkpoint at 50 on batched-sequence (the prompt's floor is 84) and its logits equal a cold run's;
    without the checkpoint the miss is ``window``. batched-cell clones the prompt at 60 itself."""
    import numpy as np

    from clients.runner_backend import RunnerBackend
    from engine_service.api.config import GenConfig
    from engine_service.executors.module import ModuleExecutor
    from engine_service.model.random_init import random_model
    from engine_service.runtime.runner import Runner

    class Recording(ModuleExecutor):
        """Keeps the logits behind every output token, in order."""

        def execute(self, batch):
            outs = super().execute(batch)
            self.log.extend(np.array(o.logits) for o in outs if o.tokens)
            return outs

    def executor():
        ex = Recording.create(
            random_model("FRFR", 4, 0), kind, 8, 256, "float32", prefill_chunk=16, keep_logits=True
        )
        ex.log = []
        return ex

    stored_prompt = [3 + (i * 37) % 120 for i in range(100)]
    query = stored_prompt[:60] + [100 + i % 20 for i in range(20)]
    warm_ex, cold_ex = executor(), executor()
    runner, cold_runner = Runner(warm_ex), Runner(cold_ex)
    try:
        backend = RunnerBackend(runner)
        assert backend.max_rewind == (16 if kind == "batched-sequence" else None)
        results = {}
        for checkpoints in ((50,), ()):
            cache = PrefixCache(backend, 8)
            source = runner.open_session()
            capture = cache.capture_prompt(source, stored_prompt)
            config = GenConfig(max_new_tokens=2, prefill_breakpoints=checkpoints)
            source.generate_async(stored_prompt, config, capture.wrap(None)).wait(30)
            assert capture.collect(NS) == 1 + len(checkpoints)
            source.close()
            results[checkpoints] = cache.lookup(NS, query)
            if results[checkpoints].match is not None:
                hit = results[checkpoints].match
                warm_ex.log.clear()
                warm = hit.session.generate_async(query[hit.reused :], GenConfig(max_new_tokens=1)).wait(30)
                with cold_runner.open_session() as cold_session:
                    cold = cold_session.generate_async(query, GenConfig(max_new_tokens=1)).wait(30)
                assert warm.tokens == cold.tokens
                np.testing.assert_allclose(warm_ex.log[-1], cold_ex.log[-1], atol=1e-4)
                cold_ex.log.clear()
                hit.session.close()
            cache.clear()
        if kind == "batched-sequence":
            assert results[(50,)].reused == 50
            assert results[()] == LookupOutcome.miss(MissReason.WINDOW, 60)
        else:
            assert results[(50,)].reused == 60 and results[()].reused == 60
    finally:
        runner.shutdown(10)
        cold_runner.shutdown(10)
