"""Model loading (GGUF, MLX folders), the tokenizer, chat formatting and the MLX transformer."""

from engine_service.model.config import ModelConfig
from engine_service.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer"]
