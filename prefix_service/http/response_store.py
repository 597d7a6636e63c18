"""The stored responses of ``/v1/responses`` (``store``: true), per owner (the caller's cache scope, its
``cache_salt`` included) and bounded: at most ``per_owner`` each and ``total`` in all, the oldest
dropped first -- when the total is reached, the oldest of the owner holding the most, so one owner
never pushes out another's. Each keeps its items and its exact token ids; its session snapshot lives
in the prefix cache (``--cache_generated``), under that cache's budget. Spec: docs/HTTP.md#v1responses."""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_PER_OWNER = 128
DEFAULT_TOTAL = 2048


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its JSON ``body``, this request's ``input_items``, every item of the
    conversation so far (``conversation``: the earlier turns', this input's and this output's), the
    ``turns`` its prompt rendered, and the token ids the engine ran (``prompt``) and generated."""

    id: str
    body: dict
    input_items: tuple[dict, ...]
    conversation: tuple[dict, ...]
    turns: tuple[tuple[str, str], ...]
    prompt_bytes: bytes
    generated_bytes: bytes
    stopped: bool  # the generation ended at an end-of-sequence token (its last generated id)

    @property
    def prompt(self) -> tuple[int, ...]:
        return _ids(self.prompt_bytes)

    @property
    def generated(self) -> tuple[int, ...]:
        return _ids(self.generated_bytes)


def packed(ids: Sequence[int]) -> bytes:
    """Token ids as 4 bytes each (what a stored response keeps)."""
    return array("I", ids).tobytes()


def _ids(data: bytes) -> tuple[int, ...]:
    values = array("I")
    values.frombytes(data)
    return tuple(values)


class ResponseStore:
    """Thread-safe; an id another owner stored reads as missing."""

    def __init__(self, per_owner: int = DEFAULT_PER_OWNER, total: int = DEFAULT_TOTAL) -> None:
        if per_owner < 1 or total < 1:
            raise ValueError("the response store needs room for at least one response")
        self.per_owner, self.total = per_owner, total
        self._lock = threading.Lock()
        self._owners: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._count = 0

    def put(self, owner: str, response: StoredResponse) -> None:
        with self._lock:
            mine = self._owners.setdefault(owner, OrderedDict())
            mine[response.id] = response
            self._count += 1
            if len(mine) > self.per_owner:
                self._drop_oldest(owner)
            if self._count > self.total:
                self._drop_oldest(max(self._owners, key=lambda o: len(self._owners[o])))

    def get(self, owner: str, response_id: str) -> StoredResponse | None:
        with self._lock:
            return self._owners.get(owner, {}).get(response_id)

    def delete(self, owner: str, response_id: str) -> bool:
        with self._lock:
            mine = self._owners.get(owner)
            if mine is None or mine.pop(response_id, None) is None:
                return False
            self._count -= 1
            if not mine:
                del self._owners[owner]
            return True

    def __len__(self) -> int:
        return self._count

    def _drop_oldest(self, owner: str) -> None:
        mine = self._owners[owner]
        mine.popitem(last=False)
        self._count -= 1
        if not mine:
            del self._owners[owner]
