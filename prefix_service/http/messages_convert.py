"""Messages API bodies -> the engine's chat prompt (tools, system, turns), its prefill breakpoints
(``cache_control``), the gateway request and the usage counts. Pure functions. Spec:
docs/HTTP.md#anthropics-messages-api."""

from __future__ import annotations

import json
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

from engine_service.api.config import GenConfig
from engine_service.api.prompts import TextPrompt
from engine_service.api.stream_events import Started
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.http.convert import served
from prefix_service.http.errors import BadField
from prefix_service.http.messages_protocol import (
    MAX_BREAKPOINTS,
    CountTokensRequest,
    MessageParam,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from prefix_service.http.tools import ToolPlan, call_text, tool_plan, tool_response, tools_prompt

MAX_STOP_SEQUENCES = 16
BLOCK_SEPARATOR = "\n"  # between two text blocks of one message (tool blocks join without one)
OFFER_SEPARATOR = "\n\n"  # between the tools' offer and the system text


@dataclass(frozen=True)
class Segment:
    """A piece of one turn's text; ``mark``: the field of its block when it carries cache_control."""

    text: str
    mark: str = ""


@dataclass(frozen=True)
class Cut:
    """A breakpoint: ``field`` (the marked block), ``prompt`` the conversation up to that block's end."""

    field: str
    prompt: TextPrompt


@dataclass(frozen=True)
class Rendering:
    """A request's prompt, its tool plan, and its breakpoints (in request order)."""

    prompt: TextPrompt
    plan: ToolPlan
    cuts: tuple[Cut, ...]


def render(request: CountTokensRequest, chat_template: bool = True) -> Rendering:
    """The conversation the engine's template renders: a system turn (the offered tools first, then
    the system text, so a breakpoint on a tool is a prefix of one on the system, as Anthropic orders
    its cache), then the turns. Without ``chat_template`` (a base model) the prompts are plain text
    (``convert.served``)."""
    plan = tools_of(request)
    turns: list[tuple[str, list[Segment]]] = []
    system = _offer(request, plan) + _system(request, bool(plan.active))
    if system:
        turns.append(("system", system))
    for i, message in enumerate(request.messages):
        turns.append((message.role, _message(message, i)))
    if request.messages[-1].role != "user":
        raise BadField(f"messages[{len(request.messages) - 1}].role", "the last message must be the user's")
    if request.cache_control is not None:  # top level: the last block of the last message
        role, segments = turns[-1]
        turns[-1] = (role, [*segments[:-1], Segment(segments[-1].text, "cache_control")])
    marks = [(t, k) for t, (_, segs) in enumerate(turns) for k, s in enumerate(segs) if s.mark]
    if len(marks) > MAX_BREAKPOINTS:
        t, k = marks[MAX_BREAKPOINTS]
        raise BadField(
            turns[t][1][k].mark,
            f"at most {MAX_BREAKPOINTS} blocks with cache_control per request, found {len(marks)}",
        )
    cuts = tuple(
        Cut(turns[t][1][k].mark, served(_prompt(turns[:t] + [_head(turns[t], k)]), chat_template))
        for t, k in marks
    )
    return Rendering(served(_prompt(turns), chat_template), plan, cuts)


def _prompt(turns: Sequence[tuple[str, Sequence[Segment]]]) -> TextPrompt:
    messages = tuple((role, "".join(s.text for s in segs)) for role, segs in turns)
    return TextPrompt("", chat=True, messages=messages)


def _head(turn: tuple[str, list[Segment]], k: int) -> tuple[str, list[Segment]]:
    return turn[0], turn[1][: k + 1]


def tools_of(request: CountTokensRequest) -> ToolPlan:
    """The tools and tool_choice as the door's tool machinery takes them (``tools.py``)."""
    tools = [
        {
            "type": "function",
            "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
        }
        for t in request.tools or ()
    ]
    choice = request.tool_choice
    if choice is None:
        wanted: str | dict | None = None
    elif choice.type == "tool":
        if not choice.name:
            raise BadField("tool_choice.name", "is required with type 'tool'")
        if choice.name not in {t.name for t in request.tools or ()}:
            raise BadField("tool_choice.name", f"no tool is named {choice.name!r}")
        wanted = {"type": "function", "function": {"name": choice.name}}
    else:
        if choice.name is not None:
            raise BadField("tool_choice.name", f"only with type 'tool', not {choice.type!r}")
        wanted = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    if not tools and choice is not None and choice.type != "none":
        raise BadField("tool_choice", "needs tools")
    try:
        return tool_plan(tools or None, wanted)
    except BadField as exc:
        field = exc.param.replace(".function.", ".").replace(".parameters", ".input_schema")
        raise BadField(field, str(exc).split(": ", 1)[-1]) from None


def _offer(request: CountTokensRequest, plan: ToolPlan) -> list[Segment]:
    """The tools' offer (``tools.tools_prompt``) cut after each tool's line (its breakpoint)."""
    offer = tools_prompt(plan)
    if not offer:
        return []
    marked = {t.name: f"tools[{i}]" for i, t in enumerate(request.tools or ()) if t.cache_control}
    segments, start = [], 0
    for tool in plan.tools:
        end = offer.index(tool.offer(), start) + len(tool.offer())
        segments.append(Segment(offer[start:end], marked.get(tool.name, "")))
        start = end
    return [*segments, Segment(offer[start:])]


def _system(request: CountTokensRequest, after_offer: bool) -> list[Segment]:
    system = request.system
    if system is None or system == [] or system == "":
        return []
    blocks = [TextBlock(type="text", text=system)] if isinstance(system, str) else system
    lead = OFFER_SEPARATOR if after_offer else ""
    return [
        Segment((lead if j == 0 else BLOCK_SEPARATOR) + b.text, f"system[{j}]" if b.cache_control else "")
        for j, b in enumerate(blocks)
    ]


def _message(message: MessageParam, i: int) -> list[Segment]:
    if isinstance(message.content, str):
        return [Segment(message.content)]
    segments: list[Segment] = []
    previous_text = False
    for j, block in enumerate(message.content):
        where = f"messages[{i}].content[{j}]"
        mark = where if block.cache_control else ""
        if isinstance(block, TextBlock):
            segments.append(Segment((BLOCK_SEPARATOR if previous_text else "") + block.text, mark))
        elif isinstance(block, ToolUseBlock):
            if message.role != "assistant":
                raise BadField(f"{where}.type", "tool_use blocks belong to assistant messages")
            call = {"function": {"name": block.name, "arguments": json.dumps(block.input)}}
            segments.append(Segment(call_text([call], i), mark))
        else:
            if message.role != "user":
                raise BadField(f"{where}.type", "tool_result blocks belong to user messages")
            segments.append(Segment(tool_response(_result_text(block), block.tool_use_id), mark))
        previous_text = isinstance(block, TextBlock)
    return segments or [Segment("")]


def _result_text(block: ToolResultBlock) -> str:
    content = block.content
    text = content if isinstance(content, str) else BLOCK_SEPARATOR.join(b.text for b in content)
    return f"Error: {text}" if block.is_error else text


# -- the generation -------------------------------------------------------------------------------


def stop_sequences(request: MessagesRequest) -> tuple[str, ...]:
    stops = tuple(request.stop_sequences or ())
    if len(stops) > MAX_STOP_SEQUENCES:
        raise BadField("stop_sequences", f"at most {MAX_STOP_SEQUENCES}, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise BadField(f"stop_sequences[{i}]", "must not be empty")
    return stops


def gateway_request(
    request: MessagesRequest, rendering: Rendering, breakpoints: tuple[int, ...], namespace: str
) -> GatewayRequest:
    """The gateway call: the rendered prompt, the breakpoints to store snapshots at, the sampling."""
    config = GenConfig(
        max_new_tokens=request.max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=1.0 if request.top_p is None else request.top_p,
        top_k=request.top_k or 0,
        seed=secrets.randbelow(2**63),
        json_schema=rendering.plan.schema,
    )
    return GatewayRequest(
        namespace=namespace, prompt=rendering.prompt, config=config, breakpoints=breakpoints
    )


def breakpoint_position(prompt_ids: Sequence[int], cut_ids: Sequence[int]) -> int:
    """Where a breakpoint lies in the prompt: the common prefix of the prompt's tokens with those of the
    conversation up to the marked block (a template's closing tokens or a BPE merge across the block's
    end make it shorter than the block's own tokens; every such prefix is exact)."""
    n = min(len(prompt_ids), len(cut_ids))
    return next((i for i in range(n) if prompt_ids[i] != cut_ids[i]), n)


@dataclass(frozen=True)
class MessagesUsage:
    """Anthropic's usage, exact positions: with ``L`` the last breakpoint (0: none) and ``R`` the
    positions the cache reused, ``cache_read = min(R, L)``, ``cache_creation = L - cache_read`` (computed
    here and stored at the breakpoints), ``input = total - L``; the three sum to the prompt."""

    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int
    output_tokens: int

    def body(self) -> dict[str, int]:
        return {
            "input_tokens": self.input_tokens,
            "cache_creation_input_tokens": self.cache_creation_input_tokens,
            "cache_read_input_tokens": self.cache_read_input_tokens,
            "output_tokens": self.output_tokens,
        }


def usage(started: Started, breakpoints: Sequence[int], output_tokens: int) -> MessagesUsage:
    total = started.position + started.input_positions
    last = min(max(breakpoints, default=0), total)
    read = min(started.position, last)
    return MessagesUsage(total - last, last - read, read, output_tokens)
