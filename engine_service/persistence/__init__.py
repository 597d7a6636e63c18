"""Sessions that outlive their engine: a session's K/V and content as one file, checked before anything
enters a cache; files are written, read and hashed on the caller's thread, never the engine's."""
