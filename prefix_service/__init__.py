"""forkline prefix cache: prompt snapshots as opaque session handles, with pluggable retention.

It imports only the engine's ``engine_service.api`` and ``engine_service.serving`` (whose package loads
OpenBLAS before anything imports mlx)."""
