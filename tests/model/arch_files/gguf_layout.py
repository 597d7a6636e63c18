"""Tiny GGUF files in llama.cpp's layout (its tensor names; gguf-py's ``MODEL_TENSORS`` / ``TensorNameMap``
are the oracle for them):

- qwen2: ``attn_{q,k,v}.bias``; qwen3: ``attn_{q,k}_norm`` and ``attention.key_length`` != hidden / heads;
- phi3: ``attn_qkv`` (q, k, v rows) and ``ffn_up`` holding gate rows then up rows; a window on every layer;
- gemma3: QK-norm, ``post_attention_norm``, ``ffn_norm`` (pre-FFN), ``post_ffw_norm``, norms stored as
  ``1 + w`` (what the converter writes), six layers so the sixth is global, tied head;
- Q/K rows permuted per head for llama only (the converter permutes no other architecture);
- matrices in the block types of a typical Q4_K_M file (Q8_0 embedding, Q5_0 q/k, Q4_0 v, Q4_1 o, Q4_K
  gate/up, Q6_K down and head): hidden 256, intermediate 512, so every K-quant row is whole super-blocks.
"""

from __future__ import annotations

import numpy as np

from engine_service.model import load_model
from tests.model.arch_files.tiny_archs import EPS, HEADS, HIDDEN, INTER, KV_HEADS, QUANT, Spec, is_norm, role
from tests.model.gguf_writer import QUANTIZERS, BlockQuant, permute_for_gguf, tiny_vocab, write_gguf

# canonical -> llama.cpp's name under blk.i. (convert_hf_to_gguf.py / gguf-py tensor_mapping.py)
GGUF_LAYER = {
    "attn_norm": "attn_norm.weight",
    "q": "attn_q.weight",
    "k": "attn_k.weight",
    "v": "attn_v.weight",
    "qkv": "attn_qkv.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "o": "attn_output.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "gate": "ffn_gate.weight",
    "up": "ffn_up.weight",
    "gate_up": "ffn_up.weight",  # Phi-3: gate rows then up rows in one tensor
    "down": "ffn_down.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
}

GGUF_GLOBAL = {"embed": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of :func:`permute_for_gguf` (GGUF rows -> Hugging Face rows)."""
    out, d_in = w.shape
    return w.reshape(heads, out // heads // 2, 2, d_in).transpose(0, 2, 1, 3).reshape(out, d_in)


def gguf_name(canon: str) -> str:
    if canon in GGUF_GLOBAL:
        return GGUF_GLOBAL[canon]
    _, i, r = canon.split(".")
    return f"blk.{i}.{GGUF_LAYER[r]}"


def to_gguf(
    spec: Spec,
    tensors: dict[str, np.ndarray],
    *,
    quantize: bool = True,
    permute: bool | None = None,
    gemma_norm_offset: float = 0.0,
) -> tuple[dict[str, np.ndarray | BlockQuant], dict[str, np.ndarray]]:
    """(GGUF tensors by llama.cpp name, the canonical values they stand for in Hugging Face order).

    ``permute``: llama.cpp's per-head Q/K row permutation (default: for llama only). Gemma norms are
    written as the multipliers (1 + w, the converter's convention); ``gemma_norm_offset=-1`` writes
    ``w`` instead (a wrong file, for the negative control)."""
    permute = spec.arch == "llama" if permute is None else permute
    out: dict[str, np.ndarray | BlockQuant] = {}
    values = {}
    for canon, w in tensors.items():
        r = role(canon)
        heads = {"q": HEADS, "k": KV_HEADS}.get(r) if permute else None
        stored = permute_for_gguf(w, heads) if heads else w
        if spec.arch == "gemma3" and is_norm(canon):
            stored = stored + np.float32(gemma_norm_offset)
        kind = QUANT.get(r) if quantize else None
        if kind:
            block = QUANTIZERS[kind](stored)
            out[gguf_name(canon)], value = block, block.dequantized
        else:
            out[gguf_name(canon)] = value = stored.astype(np.float32)
        values[canon] = unpermute(value, heads) if heads else value
    return out, values


def gguf_metadata(spec: Spec, arch: str | None = None) -> dict:
    """What llama.cpp's converter writes for these hyper-parameters, plus a gpt2 tokenizer."""
    a = arch or spec.arch
    tokens, merges, types = tiny_vocab()
    meta = {
        "general.architecture": a,
        "general.name": f"tiny-{a}",
        f"{a}.context_length": 4096,
        f"{a}.embedding_length": HIDDEN,
        f"{a}.block_count": spec.layers,
        f"{a}.feed_forward_length": INTER,
        f"{a}.attention.head_count": HEADS,
        f"{a}.attention.head_count_kv": KV_HEADS,
        f"{a}.rope.freq_base": spec.theta,
        f"{a}.attention.layer_norm_rms_epsilon": EPS,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    if spec.head_dim:
        meta[f"{a}.attention.key_length"] = meta[f"{a}.attention.value_length"] = spec.head_dim
    if spec.window:
        meta[f"{a}.attention.sliding_window"] = spec.window
    if a == "phi3":
        meta[f"{a}.rope.dimension_count"] = spec.d
    return meta


def write_and_load(tmp_path, spec: Spec, raw: dict, name: str = "m.gguf", meta: dict | None = None):
    path = str(tmp_path / name)
    write_gguf(path, meta or gguf_metadata(spec), raw)
    return load_model(path, "float32")
