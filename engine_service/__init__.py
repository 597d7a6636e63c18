"""forkline engine: MLX generation with sessions cloneable at an exact committed token.

Importing this package loads OpenBLAS (when present) before MLX; see :mod:`engine_service.blas`.
"""

from engine_service.blas import load_openblas as _load_openblas

_load_openblas()
