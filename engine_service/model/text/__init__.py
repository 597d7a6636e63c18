"""Text: tokenizers (from GGUF metadata or tokenizer.json), detokenization, chat formatting."""
