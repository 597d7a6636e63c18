"""A model-free Executor for runner tests.

Its prediction is a hash of the session's whole committed history plus the generation's seed, so a
token fed out of order, a lost pending token, a wrong rewind or an inherited sampler all show up as
different tokens. ``reference`` computes the same predictions without any runner, as the independent
expectation.

Knobs: capacity (``max_sessions``), clone refusal / clone exceptions, failing batches and per-input
errors for chosen sids, a gate that blocks ``execute`` until the test releases it, accepted prepared
kinds, and a *speculative* mode in which every output-producing input commits one accepted draft
(returns 2 tokens) and physically writes one rejected row past it, so ``written > position``.
Every call records the calling thread, so tests can assert it is the engine thread.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from engine_service.api.limits import EngineLimits
from engine_service.executors.base import ExecInput, ExecOutput, Executor
from engine_service.executors.prepared_input import PreparedInput, PreparedKind
from engine_service.executors.sampling import SamplingParams

_MASK = (1 << 64) - 1


def _mix(h: int, value: int) -> int:
    """splitmix64 step over (h, value): order-sensitive, deterministic across processes."""
    z = (h + 0x9E3779B97F4A7C15 + (value & _MASK) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def predict(history: Sequence[int], seed: int, vocab: int) -> int:
    h = 0
    for tok in history:
        h = _mix(h, tok)
    return _mix(h, seed + 1) % vocab


def reference(history: Iterable[int], seed: int, n: int, vocab: int) -> list[int]:
    """The n tokens a greedy run predicts after ``history`` (no runner involved)."""
    hist = list(history)
    out: list[int] = []
    for _ in range(n):
        tok = predict(hist, seed, vocab)
        out.append(tok)
        hist.append(tok)
    return out


class FakePrepared(PreparedInput):
    """A prepared input whose positions are pseudo token values (offset so they never equal real ids)."""

    KIND: ClassVar[PreparedKind] = PreparedKind("fake-prepared")
    OFFSET: ClassVar[int] = 1_000_000

    def __init__(self, values: Sequence[int]) -> None:
        self.values = tuple(values)

    def size(self) -> int:
        return len(self.values)

    def chunk(self, start: int, stop: int) -> FakePrepared:
        if not 0 <= start < stop <= self.size():
            raise ValueError(f"chunk [{start}, {stop}) outside [0, {self.size()})")
        return FakePrepared(self.values[start:stop])

    def history_values(self) -> tuple[int, ...]:
        return tuple(self.OFFSET + v for v in self.values)


class OtherPrepared(FakePrepared):
    KIND: ClassVar[PreparedKind] = PreparedKind("other-prepared")


@dataclass
class FakeSeq:
    history: list[int] = field(default_factory=list)
    written: int = 0  # physical high-water mark: may exceed len(history) in speculative mode
    seed: int | None = None


class FakeExecutor(Executor):
    def __init__(
        self,
        *,
        vocab_size: int = 97,
        max_sessions: int = 16,
        max_session_tokens: int = 256,
        preferred_batch_tokens: int = 512,
        clones: bool = True,
        speculative: bool = False,
        accepts: tuple[PreparedKind, ...] = (FakePrepared.KIND,),
    ) -> None:
        self.vocab_size = vocab_size
        self.max_sessions = max_sessions
        self.max_session_tokens = max_session_tokens
        self.preferred = preferred_batch_tokens
        self.clones = clones
        self.speculative = speculative
        self.accepted_kinds = accepts
        self.seqs: dict[int, FakeSeq] = {}
        self._next_sid = 100
        self.lock = threading.Lock()  # guards the call log read by the test thread
        self.calls: list[tuple] = []
        self.threads: set[int] = set()
        self.batches: list[list[ExecInput]] = []
        # failure knobs
        self.refuse_clone = False
        self.clone_raises: BaseException | None = None
        self.raise_for_sids: set[int] = set()
        self.error_for_sids: set[int] = set()
        self.gate: threading.Event | None = None
        self.entered = threading.Event()  # set when execute is entered (for gate tests)

    def _log(self, *call: object) -> None:
        with self.lock:
            self.calls.append(call)
            self.threads.add(threading.get_ident())

    def calls_named(self, name: str) -> list[tuple]:
        with self.lock:
            return [c for c in self.calls if c[0] == name]

    # ---------------------------------------------------------------- Executor

    def limits(self) -> EngineLimits:
        self._log("limits")
        return EngineLimits(self.max_sessions, self.max_session_tokens, self.vocab_size)

    def fingerprint(self) -> str:
        self._log("fingerprint")
        return f"fake/v{self.vocab_size}"

    def preferred_batch_tokens(self) -> int:
        self._log("preferred_batch_tokens")
        return self.preferred

    def open_session(self) -> int | None:
        self._log("open")
        if len(self.seqs) >= self.max_sessions:
            return None
        return self._new(FakeSeq())

    def _new(self, seq: FakeSeq) -> int:
        sid = self._next_sid
        self._next_sid += 1
        self.seqs[sid] = seq
        return sid

    def close_session(self, sid: int) -> None:
        self._log("close", sid)
        self.seqs.pop(sid, None)

    def clone(self, sid: int, upto: int) -> int | None:
        self._log("clone", sid, upto)
        if self.clone_raises is not None:
            raise self.clone_raises
        if not self.clones or self.refuse_clone or len(self.seqs) >= self.max_sessions:
            return None
        src = self.seqs[sid]
        # Deliberately careless: authorizes by the physical high-water mark, so only the runner's
        # accepted-position check keeps a speculative row from being cloned.
        if not 0 <= upto <= src.written:
            return None
        history = src.history[:upto] + [-1] * max(0, upto - len(src.history))  # -1: a rejected draft row
        return self._new(FakeSeq(history=history, written=upto))

    def set_sampling(self, sid: int, params: SamplingParams, seed: int) -> None:
        self._log("set_sampling", sid, params, seed)
        self.seqs[sid].seed = seed

    def accepts(self, prepared: PreparedInput) -> bool:
        self._log("accepts", prepared.kind())
        return any(prepared.kind() is k for k in self.accepted_kinds)

    def execute(self, batch: Sequence[ExecInput]) -> list[ExecOutput]:
        self._log("execute", tuple(batch))
        with self.lock:
            self.batches.append(list(batch))
        gate = self.gate
        self.entered.set()
        if gate is not None:
            gate.wait(10)
        if any(inp.sid in self.raise_for_sids for inp in batch):
            raise RuntimeError("fake batch failure")
        return [self._run_one(inp) for inp in batch]

    def _run_one(self, inp: ExecInput) -> ExecOutput:
        seq = self.seqs.get(inp.sid)
        if seq is None:
            return ExecOutput(inp.sid, error=f"unknown sid {inp.sid}")
        if inp.sid in self.error_for_sids:
            return ExecOutput(inp.sid, error="fake input failure")
        if inp.start > len(seq.history):
            return ExecOutput(inp.sid, error=f"gap: start {inp.start} > length {len(seq.history)}")
        del seq.history[inp.start :]  # a start below the length rewinds
        values = inp.tokens if inp.tokens is not None else inp.prepared.history_values()
        seq.history.extend(values)
        seq.written = max(seq.written, len(seq.history))
        if len(seq.history) > self.max_session_tokens:
            return ExecOutput(inp.sid, error="session overflow")
        if not inp.want_output:
            return ExecOutput(inp.sid)
        if seq.seed is None:
            return ExecOutput(inp.sid, error="no sampler set for this session")
        first = predict(seq.history, seq.seed, self.vocab_size)
        if not self.speculative:
            return ExecOutput(inp.sid, tokens=(first,))
        seq.history.append(first)  # accepted draft: committed
        second = predict(seq.history, seq.seed, self.vocab_size)
        seq.written = max(seq.written, len(seq.history) + 1)  # one rejected draft row written past it
        return ExecOutput(inp.sid, tokens=(first, second))
