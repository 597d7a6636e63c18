"""Loading a model: packaged names, GGUF files, MLX folders -> config, canonical tensors, tokenizer."""
