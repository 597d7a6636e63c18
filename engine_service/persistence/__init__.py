"""Sessions that outlive their engine: a session's K/V and recorded content as one file, checked before
anything enters a cache.

- :mod:`.snapshot`: :class:`~.snapshot.SessionSnapshot` (a session taken out of the engine: its cache
  kind's arrays, what its positions hold, the fingerprint and layout it was taken under) and the
  header checks a load makes against the engine that would hold it;
- :mod:`.snapshot_file`: the file's tensors and checksum, and its reader, which refuses anything it
  cannot vouch for (names, header, atomic writes and refusal reasons: ``api/snapshot_files.py``).

``sessions/session_files.py`` drives the runner to save and load them. Nothing in the engine loop
waits on a disk: files are written, read and hashed on the caller's thread.
"""
