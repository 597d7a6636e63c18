"""The OpenAI-compatible HTTP door of the prefix service (``--http_port``), in its process, over the
:class:`~prefix_service.fleet.fleet.Fleet`: ``app.py`` routes, ``protocol.py`` bodies, ``convert.py``
requests, ``generation.py`` / ``bridge.py`` the blocking fleet from asyncio, ``errors.py`` errors."""
