"""A response's prompt as token ids, and ``previous_response_id`` made exact: the new prompt is the
earlier response's own ids (the prompt the engine ran and what it generated) followed by the template's
continuation, so the prefix cache's snapshot at the earlier response's last generated token is reused
whole. Spec: docs/HTTP.md#previous_response_id-an-exact-continuation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.api.call_context import CallContext
from engine_service.api.errors import Unavailable
from engine_service.api.prompts import TextPrompt, Tokenized
from prefix_service.fleet.fleet import Fleet
from prefix_service.http.convert import served
from prefix_service.http.response_store import StoredResponse
from prefix_service.http.responses_convert import Turn, item_turns


@dataclass(frozen=True)
class PromptIds:
    """The ids to run, where their messages end (checkpoints), and whether they continue the
    previous response's ids exactly (``continued``) or re-render the conversation."""

    ids: tuple[int, ...]
    message_ends: tuple[int, ...] = ()
    continued: bool = False


def prompt_ids(
    fleet: Fleet, call: CallContext, turns: Sequence[Turn], previous: StoredResponse | None
) -> PromptIds:
    """The ids of the conversation ``turns`` (blocking: engine Tokenize calls): the exact continuation
    of ``previous`` where it applies (:func:`continuation`), else the template's rendering."""
    wanted = max((m.gateway.message_ends_wanted for m in fleet.members()), default=0)
    if previous is not None:
        spliced = continuation(fleet, call, turns, previous, wanted)
        if spliced is not None:
            return spliced
    rendered = tokenize(fleet, _chat(fleet, turns), call, wanted)
    return PromptIds(rendered.ids, rendered.message_ends)


def continuation(
    fleet: Fleet, call: CallContext, turns: Sequence[Turn], previous: StoredResponse, wanted: int = 0
) -> PromptIds | None:
    """``previous``'s prompt ids + its generated ids + the template's tokens after its answer, when
    ``turns`` are ``previous``'s turns, its answer, then new turns; None (re-render instead) otherwise
    or when the template does not render the emptied answer as a continuation. Spec: docs/HTTP.md
    (previous_response_id: an exact continuation)."""
    k = len(previous.turns)
    answer = item_turns(previous.body["output"])
    if tuple(turns[:k]) != previous.turns or len(answer) != 1 or len(turns) <= k + 1 or turns[k] != answer[0]:
        return None
    before = tokenize(fleet, _chat(fleet, previous.turns), call).ids
    emptied = tokenize(fleet, _chat(fleet, (*turns[:k], ("assistant", ""), *turns[k + 1 :])), call, wanted)
    if emptied.ids[: len(before)] != before or len(emptied.ids) == len(before):
        return None
    generated = previous.generated
    kept = previous.prompt + (generated[:-1] if previous.stopped else generated)
    shift = len(kept) - len(before)
    ends = tuple(end + shift for end in emptied.message_ends if end > len(before))
    return PromptIds(kept + emptied.ids[len(before) :], ends, continued=True)


def tokenize(fleet: Fleet, prompt: TextPrompt, call: CallContext, wanted_ends: int = 0) -> Tokenized:
    """``prompt`` tokenized by the first engine of the fleet's fingerprint that answers."""
    members = fleet.members()
    serving = [m for m in members if m.serving and m.fingerprint == fleet.fingerprint] or members[:1]
    if not serving:
        raise Unavailable("no engine is known yet")
    for i, member in enumerate(serving):
        try:
            return member.gateway.tokenized(prompt, call, wanted_ends)
        except Unavailable:
            if i == len(serving) - 1:
                raise
    raise Unavailable("no engine answered")  # not reached


def _chat(fleet: Fleet, turns: Sequence[Turn]) -> TextPrompt:
    return served(TextPrompt("", chat=True, messages=tuple(turns)), fleet.chat_template)
