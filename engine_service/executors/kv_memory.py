"""The engine's K/V memory budget (``--kv_memory_mib``) and what it bounds: the bytes one committed
position of one session costs, and the positions the engine's K/V may hold in all. Spec: docs/ENGINE.md
(K/V memory and sessions)."""

from __future__ import annotations

import os
from pathlib import Path

from engine_service.api.checks import checked_int
from engine_service.cache.config import CacheConfig

MIB = 1 << 20
# 0 (auto): a quarter of physical memory, at most 8 GiB -- 6 GiB on a 24 GiB machine, ~280k positions of
# SmolLM2-135M at float16 (22.5 KiB each), while the weights, the prefix service and the OS keep the rest
AUTO_SHARE = 0.25
AUTO_CAP_MIB = 8192
AUTO_FLOOR_MIB = 256  # where physical memory cannot be read


CGROUP_LIMITS = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))


def physical_memory_bytes(limits: tuple[Path, ...] = CGROUP_LIMITS) -> int:
    """The memory this process may use: physical memory, or the cgroup's limit when lower (a container
    sees its node's memory); 0 when neither says."""
    try:
        physical = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        physical = 0
    for path in limits:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            physical = min(physical, int(text)) if physical else int(text)
    return physical


def accelerator_memory_bytes() -> int:
    """The accelerator's memory where MLX runs on one and says (``mx.device_info()``), else 0."""
    from engine_service.model.formats.weights import gpu_available

    if not gpu_available():
        return 0
    import mlx.core as mx

    try:
        return int(mx.device_info().get("memory_size", 0))
    except Exception:  # noqa: BLE001 - a device query failing only means "not known"
        return 0


def auto_kv_memory_mib(physical: int | None = None) -> int:
    """The budget ``--kv_memory_mib 0`` means: :data:`AUTO_SHARE` of ``physical`` bytes (this machine's,
    or its accelerator's when smaller, when None), at most :data:`AUTO_CAP_MIB`, at least
    :data:`AUTO_FLOOR_MIB`."""
    if physical is None:
        physical = min(filter(None, (physical_memory_bytes(), accelerator_memory_bytes())), default=0)
    return max(AUTO_FLOOR_MIB, min(AUTO_CAP_MIB, int(AUTO_SHARE * physical) // MIB))


def kv_memory_mib(value: int) -> int:
    """``--kv_memory_mib``: an int >= 0 (0: :func:`auto_kv_memory_mib`); InvalidArgument naming the flag."""
    value = checked_int("kv_memory_mib", value, lo=0)
    return value or auto_kv_memory_mib()


def kv_bytes_per_position(config: CacheConfig) -> int:
    """Bytes one committed position of one session costs: K and V rows of every layer, kv_heads x
    head_dim x the K/V dtype. Ring layers (batched-sequence) count too: a ring holds at most window +
    max_write rows, so past that a session holds less than counted (the bound stays an upper one)."""
    return len(config.layers) * 2 * config.kv_heads * config.head_dim * config.dtype.size


def clone_shared_bytes_per_position(config: CacheConfig, cache_kind: str) -> int:
    """Of :func:`kv_bytes_per_position`, the bytes a clone shares with its source: every layer's on
    ``batched-cell`` (shared cells), the flat layers' on ``batched-sequence`` (frozen pieces; its ring
    layers too below :func:`clone_shared_ring_positions`)."""
    layers = len(config.layers) if cache_kind == "batched-cell" else sum(not s.sliding for s in config.layers)
    return layers * 2 * config.kv_heads * config.head_dim * config.dtype.size


def clone_shared_ring_positions(config: CacheConfig, cache_kind: str) -> int:
    """Positions below which a ``batched-sequence`` clone shares its sliding layers too (the fewest ring
    slots: they stay laid out flat until then); 0 elsewhere (``batched-cell`` shares every layer)."""
    slots = [config.ring_slots(s.window) for s in config.layers if s.sliding]
    return min(slots) if cache_kind == "batched-sequence" and slots else 0


def position_bytes(config: CacheConfig, cache_kind: str) -> tuple[int, int, int]:
    """(:func:`kv_bytes_per_position`, :func:`clone_shared_bytes_per_position`,
    :func:`clone_shared_ring_positions`)."""
    return (
        kv_bytes_per_position(config),
        clone_shared_bytes_per_position(config, cache_kind),
        clone_shared_ring_positions(config, cache_kind),
    )


def positions_bound(memory_mib: int, bytes_per_position: int) -> int:
    """Positions ``memory_mib`` MiB of K/V hold at ``bytes_per_position`` each."""
    checked_int("kv_memory_mib", memory_mib, lo=1)
    checked_int("kv_bytes_per_position", bytes_per_position, lo=1)
    return memory_mib * MIB // bytes_per_position
