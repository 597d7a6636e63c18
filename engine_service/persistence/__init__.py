"""Sessions that outlive their engine: a session's K/V and recorded content as one file, checked before
anything enters a cache.

- :mod:`.snapshot`: :class:`~.snapshot.SessionSnapshot` (a session taken out of the engine: its cache
  kind's arrays, what its positions hold, the fingerprint and layout it was taken under) and the
  header checks a load makes against the engine that would hold it;
- :mod:`.snapshot_file`: the file's tensors and checksum, and its reader, which refuses anything it
  cannot vouch for (names, header, atomic writes and refusal reasons: ``api/snapshot_files.py``);
- :mod:`.sessions`: ``save_session`` / ``load_session``, the two calls a caller needs (they drive the
  runner's snapshot commands, :mod:`engine_service.runtime.snapshots`).

Nothing in the engine loop waits on a disk: the engine thread only exports (a copy of the session's
arrays) and imports (arrays already read, verified and copied into MLX); files are written, read and
hashed on the caller's thread.
"""
