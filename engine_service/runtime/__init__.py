"""The engine thread's runtime: the Runner, sessions and generations, the typed commands it drains, the
engine loop that runs one batch at a time, its per-session state, and the scheduler that packs a batch.

Executors live in :mod:`engine_service.executors`; this package talks to them only through
:class:`engine_service.executors.base.Executor`.
"""
