"""What a new executor implements (:mod:`.base`), the executors forkline ships (module, embeddings,
prompt lookup), and the pieces they share: the per-batch plan, prepared inputs and sampling.

Nothing here imports :mod:`engine_service.runtime`: the runtime drives executors, not the other way.
"""
