"""The workload bench's request shapes, deterministic from a seed: SGLang's generated-shared-prefix, a
multi-turn chat, LMCache's long-doc QA, n-way branching and a synthetic Mooncake-format trace.

Text is built from a word pool of single-token words (`` word`` is one token and words never merge on
the model's tokenizer), so a run of N words is exactly N tokens: a prompt's length is what the shape says
plus the template's few tokens.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MOONCAKE_BLOCK = 512  # tokens per hash_id block, as Mooncake's published traces
MAX_BLOCKS, MAX_INPUT = 4, 1900  # a trace prompt fits forkline's default max_session_tokens (2048)


@dataclass(frozen=True)
class Item:
    """One client job: a conversation whose user ``turns`` are sent in order, each after the previous
    answer (appended as returned). ``raw``: ``system`` is the whole prompt, sent as plain text;
    ``at_s``: arrival time for a timed (trace) replay."""

    system: str
    turns: tuple[str, ...]
    max_tokens: int
    raw: bool = False
    at_s: float | None = None


@dataclass(frozen=True)
class Workload:
    """``stages`` run one after another; a stage's items go to ``clients`` concurrent clients in order
    (timed items: each at its ``at_s`` from the stage's start, however many are in flight)."""

    name: str
    clients: int
    stages: tuple[tuple[Item, ...], ...]
    shape: dict


class Words:
    """Single-token words of one tokenizer; ``text(rng, n)`` is exactly n tokens (leading space)."""

    def __init__(self, tokenizer, size: int = 3000) -> None:
        pool = []
        for i in range(tokenizer.vocab_size):
            s = tokenizer.decode([i])
            if re.fullmatch(r" [a-z]{3,9}", s) and tokenizer.encode(s) == [i]:
                pool.append(s)
                if len(pool) == size:
                    break
        if len(pool) < 100:
            raise ValueError(f"tokenizer: only {len(pool)} single-token words, need 100")
        self.pool = pool

    def text(self, rng: random.Random, n: int) -> str:
        return "".join(rng.choice(self.pool) for _ in range(n))


def shared_prefix(words: Words, seed: int, quick: bool) -> Workload:
    """SGLang's generated-shared-prefix: groups of questions under one long group prompt, shuffled."""
    groups, questions = (4, 3) if quick else (8, 6)
    rng = random.Random(seed)
    items = []
    for g in range(groups):
        prompt = f"Group {g} reference.{words.text(rng, 680)}"
        items += [Item(prompt, (f"Question:{words.text(rng, 40)}?",), 16) for _ in range(questions)]
    rng.shuffle(items)
    shape = {"groups": groups, "questions": questions, "group_tokens": 680, "question_tokens": 40}
    return Workload("shared_prefix", 4, (tuple(items),), shape | {"max_tokens": 16, "clients": 4})


def multi_turn(words: Words, seed: int, quick: bool) -> Workload:
    """Conversations of several turns: each turn appends the previous answer and a new user message."""
    convs, turns = (3, 3) if quick else (6, 4)
    rng = random.Random(seed + 1)
    items = tuple(
        Item(
            f"Conversation {c}.{words.text(rng, 300)}",
            tuple(f"Message {t}:{words.text(rng, 60)}" for t in range(turns)),
            48,
        )
        for c in range(convs)
    )
    shape = {"conversations": convs, "turns": turns, "system_tokens": 300, "message_tokens": 60}
    return Workload("multi_turn", 3, (items,), shape | {"max_tokens": 48, "clients": 3})


def long_doc_qa(words: Words, seed: int, quick: bool) -> Workload:
    """LMCache's long-document QA: every document asked about once per pass, passes shuffled."""
    docs, passes = (3, 2) if quick else (5, 3)
    rng = random.Random(seed + 2)
    texts = [f"Document {d}.{words.text(rng, 1100)}" for d in range(docs)]
    items = []
    for _ in range(passes):
        one = [Item(t, (f"Question:{words.text(rng, 20)}?",), 16) for t in texts]
        rng.shuffle(one)
        items += one
    shape = {"documents": docs, "passes": passes, "document_tokens": 1100, "question_tokens": 20}
    return Workload("long_doc_qa", 2, (tuple(items),), shape | {"max_tokens": 16, "clients": 2})


def branching(words: Words, seed: int, quick: bool) -> Workload:
    """One long context answered once, then n continuations from it sent together."""
    n = 4 if quick else 8
    rng = random.Random(seed + 3)
    context = f"Shared context.{words.text(rng, 1500)}"
    first = (Item(context, (f"Branch root:{words.text(rng, 20)}",), 32),)
    rest = tuple(Item(context, (f"Branch {b}:{words.text(rng, 20)}",), 32) for b in range(n))
    shape = {"context_tokens": 1500, "branches": n, "branch_tokens": 20, "max_tokens": 32, "clients": 4}
    return Workload("branching", 4, (first, rest), shape)


def mooncake_trace(seed: int, quick: bool) -> list[dict]:
    """A small synthetic trace in Mooncake's format (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids`` of 512-token blocks): sessions re-sending a shared system block and
    their own growing history, plus one-off requests."""
    rng = random.Random(seed + 4)
    n, span_ms = (10, 120_000) if quick else (24, 240_000)
    next_id, system_ids = 2, [0, 1]  # blocks 0-1: a system prompt every session shares
    sessions: list[list[int]] = []
    rows = []
    for i in range(n):
        if rng.random() < 0.25 or not sessions:  # a one-off request, or a new session
            if rng.random() < 0.5:
                ids = list(range(next_id, next_id + rng.randint(1, MAX_BLOCKS - 1)))
                next_id += len(ids)
            else:
                sessions.append(system_ids + [next_id])
                next_id += 1
                ids = sessions[-1]
        else:  # an existing session's next turn: its history plus one new block
            s = rng.randrange(len(sessions))
            if len(sessions[s]) < MAX_BLOCKS:
                sessions[s] = sessions[s] + [next_id]
                next_id += 1
            ids = sessions[s]
        tail = rng.randint(64, min(MOONCAKE_BLOCK, MAX_INPUT - (len(ids) - 1) * MOONCAKE_BLOCK))
        rows.append(
            {
                "timestamp": round(i * span_ms / n + rng.uniform(0, span_ms / n / 2)),
                "input_length": (len(ids) - 1) * MOONCAKE_BLOCK + tail,
                "output_length": rng.choice((8, 16, 32)),
                "hash_ids": list(ids),
            }
        )
    return rows


def trace_workload(words: Words, rows: list[dict], seed: int, time_scale: float) -> Workload:
    """Mooncake ``rows`` replayed at ``timestamp * time_scale``; each hash_id a deterministic block."""
    blocks: dict[int, str] = {}

    def block(h: int) -> str:
        if h not in blocks:
            blocks[h] = words.text(random.Random(seed * 1_000_003 + h), MOONCAKE_BLOCK)
        return blocks[h]

    items = []
    for row in rows:
        whole = "".join(block(h) for h in row["hash_ids"])
        text = "".join(re.findall(r" [a-z]+", whole)[: row["input_length"]])  # exactly input_length
        items.append(
            Item(text, ("",), row["output_length"], raw=True, at_s=row["timestamp"] / 1000 * time_scale)
        )
    shape = {"requests": len(rows), "block_tokens": MOONCAKE_BLOCK, "time_scale": time_scale, "trace": rows}
    return Workload("mooncake_trace", 0, (tuple(items),), shape)


def workloads(words: Words, seed: int, quick: bool, names: tuple[str, ...]) -> list[Workload]:
    """The named shapes in the bench's order."""
    builders = {
        "shared_prefix": lambda: shared_prefix(words, seed, quick),
        "multi_turn": lambda: multi_turn(words, seed, quick),
        "long_doc_qa": lambda: long_doc_qa(words, seed, quick),
        "branching": lambda: branching(words, seed, quick),
        "mooncake_trace": lambda: trace_workload(words, mooncake_trace(seed, quick), seed, 0.25),
    }
    return [builders[n]() for n in names]


NAMES = ("shared_prefix", "multi_turn", "long_doc_qa", "branching", "mooncake_trace")
