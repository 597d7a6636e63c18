"""Model loading (GGUF, MLX folders), the tokenizer, chat formatting and the MLX transformer."""

from engine_service.model.config import ModelConfig
from engine_service.model.loading.loader import LoadedModel, load_model
from engine_service.model.text.chat import ChatFormatter
from engine_service.model.text.tokenizer import Tokenizer
from engine_service.model.transformer import Transformer

__all__ = ["ChatFormatter", "LoadedModel", "ModelConfig", "Tokenizer", "Transformer", "load_model"]
