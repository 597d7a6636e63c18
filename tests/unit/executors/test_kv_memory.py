"""The K/V memory budget: bytes per position from the cache geometry, the auto default from physical
memory, the engine's positions bound, and the flag's checks -- each against numbers worked out by hand."""

from __future__ import annotations

import mlx.core as mx
import pytest

from engine_service.__main__ import executor_settings, parse_args
from engine_service.api.errors import InvalidArgument
from engine_service.cache.config import CacheConfig, LayerSpec
from engine_service.executors.cache_setup import cache_config
from engine_service.executors.kv_memory import (
    auto_kv_memory_mib,
    kv_bytes_per_position,
    kv_memory_mib,
    physical_memory_bytes,
    positions_bound,
)
from engine_service.executors.module import ModuleExecutor

GIB = 1 << 30


def test_bytes_per_position_count_k_and_v_of_every_layer_at_the_kv_dtype() -> None:
    layers = (LayerSpec(), LayerSpec("sliding", 4), LayerSpec())
    f16 = CacheConfig(capacity=8, max_seqs=1, layers=layers, kv_heads=3, head_dim=64, dtype=mx.float16)
    assert kv_bytes_per_position(f16) == 3 * 2 * 3 * 64 * 2 == 2304
    # SmolLM2-135M: 30 layers, 3 K/V heads of 64, float16 -> 22.5 KiB a position
    smol = CacheConfig(
        capacity=8, max_seqs=1, layers=(LayerSpec(),) * 30, kv_heads=3, head_dim=64, dtype=mx.float16
    )
    assert kv_bytes_per_position(smol) == 23040
    f32 = CacheConfig(capacity=8, max_seqs=1, layers=layers, kv_heads=3, head_dim=64, dtype=mx.float32)
    assert kv_bytes_per_position(f32) == 2 * 2304


def test_the_auto_budget_is_a_quarter_of_memory_capped() -> None:
    assert auto_kv_memory_mib(24 * GIB) == 6144  # a 24 GiB machine: 6 GiB
    assert auto_kv_memory_mib(128 * GIB) == 8192  # capped
    assert auto_kv_memory_mib(0) == 256  # unknown: the floor
    assert kv_memory_mib(100) == 100 and kv_memory_mib(0) == auto_kv_memory_mib()
    assert positions_bound(6144, 23040) == 6144 * (1 << 20) // 23040 == 279620
    with pytest.raises(InvalidArgument, match="kv_memory_mib"):
        kv_memory_mib(-1)


def test_a_cgroup_limit_below_physical_memory_wins(tmp_path) -> None:
    physical = physical_memory_bytes(())
    assert physical > 0
    (tmp_path / "v2").write_text(f"{GIB}\n")
    (tmp_path / "v1").write_text("max\n")  # unlimited: ignored
    assert physical_memory_bytes((tmp_path / "v2", tmp_path / "v1")) == min(physical, GIB)
    assert physical_memory_bytes((tmp_path / "v1", tmp_path / "missing")) == physical


def test_the_auto_budget_takes_the_smaller_of_host_and_accelerator_memory(monkeypatch) -> None:
    from engine_service.executors import kv_memory

    monkeypatch.setattr(kv_memory, "physical_memory_bytes", lambda: 128 * GIB)
    monkeypatch.setattr(kv_memory, "accelerator_memory_bytes", lambda: 16 * GIB)
    assert auto_kv_memory_mib() == 4096  # a quarter of the 16 GiB accelerator
    monkeypatch.setattr(kv_memory, "accelerator_memory_bytes", lambda: 0)  # the CPU: the host's, capped
    assert auto_kv_memory_mib() == 8192


def test_the_cache_holds_what_the_budget_holds_or_what_the_slots_hold(tiny_model) -> None:
    config = tiny_model("FRFR", window=4).config  # 4 layers x 2 x 2 heads x 16 at float32: 1 KiB
    assert (config.num_kv_heads, config.head_dim) == (2, 16)
    mem = cache_config(config, max_sessions=64, max_session_tokens=256, kv_dtype="float32", kv_memory=1)
    assert mem.capacity == 1024  # 1 MiB / 1 KiB: memory binds
    slots = cache_config(config, max_sessions=2, max_session_tokens=256, kv_dtype="float32", kv_memory=1)
    assert slots.capacity == 512  # the slots bind (negative control)
    with pytest.raises(
        InvalidArgument, match="kv_memory_mib=1 holds 1024 positions .* max_session_tokens=2048"
    ):
        cache_config(config, max_sessions=1, max_session_tokens=2048, kv_dtype="float32", kv_memory=1)
    ex = ModuleExecutor.create(
        tiny_model("FRFR", window=4),
        max_sessions=64,
        max_session_tokens=256,
        kv_dtype="float32",
        kv_memory_mib=1,
    )
    limits = ex.limits()
    assert (limits.max_positions, limits.kv_bytes_per_position) == (1024, 1024)
    assert ex.cache.capacity == 1024


def test_the_flag_reaches_the_settings_and_a_bad_value_names_it() -> None:
    assert executor_settings(parse_args(["--kv_memory_mib", "512"])).kv_memory_mib == 512
    assert executor_settings(parse_args([])).kv_memory_mib == 0  # auto
    with pytest.raises(InvalidArgument, match="kv_memory_mib must be >= 0, got -1"):
        executor_settings(parse_args(["--kv_memory_mib", "-1"]))
