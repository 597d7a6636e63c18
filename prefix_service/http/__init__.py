"""The OpenAI-compatible HTTP door of the prefix service (``forkline-prefix --http_port PORT``).

It runs in the prefix service process and calls the domain :class:`~prefix_service.fleet.fleet.Fleet`
directly: ``protocol.py`` (request/response models), ``convert.py`` (requests -> gateway calls),
``generation.py`` + ``bridge.py`` (the blocking gateway driven from asyncio), ``responses.py``
(response and chunk bodies), ``errors.py`` (the one place errors become OpenAI's error JSON),
``app.py`` (the Starlette routes), ``server.py`` (uvicorn on a background thread).
"""
