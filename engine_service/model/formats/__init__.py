"""Weight formats: ggml block types, the q8_0 / q4_1 kernel blocks, MLX affine quantization."""
