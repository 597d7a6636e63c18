"""Sessions that outlive their engine: a session's K/V and recorded content as one file, checked before
anything enters a cache.

- :mod:`.snapshot`: :class:`~.snapshot.SessionSnapshot` (a session taken out of the engine: its cache
  kind's arrays, what its positions hold, the fingerprint and layout it was taken under), the refusal
  reasons, and the header checks a load makes against the engine that would hold it;
- :mod:`.snapshot_file`: the file format (safetensors, one file per snapshot, written atomically) and
  its reader, which refuses anything it cannot vouch for;
- :mod:`.sessions`: ``save_session`` / ``load_session``, the two calls a caller needs (they drive the
  runner's snapshot commands, :mod:`engine_service.runtime.snapshots`).

Nothing in the engine loop waits on a disk: the engine thread only exports (a copy of the session's
arrays) and imports (arrays already read, verified and copied into MLX); files are written, read and
hashed on the caller's thread.
"""
