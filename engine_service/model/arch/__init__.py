"""Architectures, one module each, behind a registry keyed by GGUF ``general.architecture`` / config.json
``model_type``. Adding one: an :class:`Architecture` subclass and one line in :data:`_MODULES`."""

from __future__ import annotations

from engine_service.api.errors import ModelLoadError
from engine_service.model.arch import gemma3, llama, phi3, qwen
from engine_service.model.arch.base import Architecture

_MODULES: tuple[Architecture, ...] = (
    llama.ARCHITECTURE,
    gemma3.ARCHITECTURE,
    qwen.QWEN2,
    qwen.QWEN3,
    phi3.ARCHITECTURE,
)
BY_NAME = {a.name: a for a in _MODULES}
BY_GGUF = {n: a for a in _MODULES for n in a.gguf_names}
BY_HF = {n: a for a in _MODULES for n in a.hf_model_types}


def architecture(name: str) -> Architecture:
    """The architecture ``ModelConfig.architecture`` names; ValueError listing the known ones."""
    arch = BY_NAME.get(name)
    if arch is None:
        raise ValueError(f"unknown architecture {name!r} (known: {', '.join(sorted(BY_NAME))})")
    return arch


def for_gguf(name: object, path: str) -> Architecture:
    """The architecture of a GGUF's ``general.architecture``; ModelLoadError listing the supported ones."""
    arch = BY_GGUF.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ModelLoadError(
            path, f"unsupported architecture {name!r} (supported: {', '.join(sorted(BY_GGUF))})"
        )
    return arch


def for_model_type(name: object, path: str) -> Architecture:
    """The architecture of a config.json ``model_type``; ModelLoadError listing the supported ones."""
    arch = BY_HF.get(name) if isinstance(name, str) else None
    if arch is None:
        raise ModelLoadError(path, f"unsupported model_type {name!r} (supported: {', '.join(sorted(BY_HF))})")
    return arch


__all__ = ["Architecture", "architecture", "for_gguf", "for_model_type"]
