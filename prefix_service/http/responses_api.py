"""OpenAI's Responses API, /v1/responses (not yet served)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.routing import Route


def routes(door: Any, answering_errors: Callable) -> list[Route]:
    """The routes over ``door`` (app.py's _Door), each wrapped by ``answering_errors``."""
    return []
