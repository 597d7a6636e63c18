"""The OpenAI Agents SDK (``openai-agents``, unmodified) running an agent with one function tool against
the door's Responses API: the first turn is forced to call the tool (``tool_choice="required"``, a
constrained call), the SDK runs it and sends its result back (a ``function_call_output`` item the
next request carries), that turn answers text and the run completes."""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import pytest

from tests.service.http_door.calls import MODEL

agents = pytest.importorskip("agents")


def test_an_agent_calls_its_tool_and_uses_the_result(door) -> None:
    from openai import AsyncOpenAI

    _, _, base = door
    calls: list[str] = []
    seen: list[dict] = []  # the request bodies the door received, as the SDK sent them

    @agents.function_tool
    def weather(city: Literal["Paris"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return "sunny-42"

    async def run() -> agents.RunResult:
        async def record(request) -> None:
            if request.method == "POST":
                seen.append(json.loads(request.content))

        import httpx

        http = httpx.AsyncClient(event_hooks={"request": [record]}, timeout=60)
        client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, http_client=http)
        agent = agents.Agent(
            name="forecaster",
            instructions="Answer with the weather.",
            tools=[weather],
            model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=200),
            output_type=bool,  # the last turn answers constrained JSON: it ends (the tiny model never would)
        )
        try:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        finally:
            await http.aclose()

    agents.set_tracing_disabled(True)
    result = asyncio.run(run())
    assert calls == ["Paris"]  # the constrained call named the tool with valid arguments
    assert len(seen) == 2
    assert seen[0]["tool_choice"] == "required" and seen[1].get("tool_choice") in (None, "auto")
    outputs = [i for i in seen[1]["input"] if i.get("type") == "function_call_output"]
    assert [o["output"] for o in outputs] == ["sunny-42"]  # the tool's result is the next turn's input
    assert seen[1]["text"]["format"]["type"] == "json_schema"
    assert isinstance(result.final_output, bool)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
