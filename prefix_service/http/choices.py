"""A request's ``n`` choices: choice 0 stores the prompt's snapshot as its first tokens come, choices
1..n-1 then start on clones of it (not recomputed, the lookup not counted again) sampling with
``seed + i``; the usage counts the prompt once. Spec: docs/HTTP.md#n-choices-from-clones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from engine_service.api.call_context import CallContext
from prefix_service.fleet.fleet import Fleet
from prefix_service.gateway.calls import GatewayRequest
from prefix_service.http.convert import usage
from prefix_service.http.generation import Delta, Generation
from prefix_service.http.protocol import Usage
from prefix_service.http.responses import Answer

_SEED_LIMIT = 2**64


class Choices:
    """``await start()``, then :meth:`answers` (whole) or :meth:`stream`; :meth:`close` always."""

    def __init__(
        self,
        fleet: Fleet,
        request: GatewayRequest,
        n: int,
        stops: Sequence[str],
        call: CallContext,
    ) -> None:
        self._fleet, self._request, self._n = fleet, request, n
        self._stops, self._call = stops, call
        self.generations: list[Generation] = []

    def _generation(self, index: int) -> Generation:
        request = self._request
        if index:
            seed = (request.config.seed + index) % _SEED_LIMIT
            config = replace(request.config, seed=seed)
            request = replace(request, config=config, store_prompt=False, count_lookup=False)
        generation = Generation(self._fleet, request, self._stops, self._call)
        self.generations.append(generation)
        return generation

    async def start(self) -> None:
        """Start every choice; a refusal of any raises (the caller closes what started)."""
        first = self._generation(0)
        await first.start()
        if self._n == 1:
            return
        await first.prime()  # choice 0's prompt snapshot is stored now
        await asyncio.gather(*(self._generation(i).start() for i in range(1, self._n)))

    async def answers(self) -> list[Answer]:
        return list(await asyncio.gather(*(_answer(i, g) for i, g in enumerate(self.generations))))

    async def stream(self) -> AsyncIterator[tuple[int, Delta | str]]:
        """``(index, Delta)`` as each choice's text comes, then ``(index, finish_reason)`` once per
        choice; the first failure of any choice raises."""
        if len(self.generations) == 1:  # the usual request: no task, no queue per token
            only = self.generations[0]
            async for delta in only.deltas():
                yield 0, delta
            yield 0, only.finish_reason or "stop"
            return
        queue: asyncio.Queue[tuple[int, Delta | str] | BaseException] = asyncio.Queue()

        async def pump(index: int, generation: Generation) -> None:
            try:
                async for delta in generation.deltas():
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, generation.finish_reason or "stop"))
            except Exception as exc:  # noqa: BLE001 - travels to the reader
                queue.put_nowait(exc)

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(self.generations)]
        try:
            ended = 0
            while ended < len(tasks):
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if isinstance(item[1], str):
                    ended += 1
                yield item
        finally:
            for task in tasks:
                task.cancel()

    def usage(self) -> Usage:
        """The prompt once (choice 0's), every choice's completion tokens."""
        total = sum(g.completion_tokens for g in self.generations)
        return usage(self.generations[0].started, total)

    def close(self) -> None:
        for generation in self.generations:
            generation.close()


async def _answer(index: int, generation: Generation) -> Answer:
    texts, logprobs = [], []
    async for delta in generation.deltas():
        texts.append(delta.text)
        logprobs.extend(delta.logprobs)
    return Answer(index, "".join(texts), generation.finish_reason or "stop", tuple(logprobs))
