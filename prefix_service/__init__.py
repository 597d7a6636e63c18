"""forkline prefix cache: prompt snapshots as opaque session handles, with pluggable retention."""

import engine_service as _engine_service  # noqa: F401  (loads OpenBLAS before anything imports mlx)
