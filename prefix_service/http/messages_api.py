"""Anthropic's Messages API, /v1/messages (not yet served)."""

from __future__ import annotations

from typing import Any

from starlette.routing import Route


def routes(door: Any) -> list[Route]:
    """The routes over ``door`` (app.py's _Door); they answer errors in Anthropic's shape."""
    return []
