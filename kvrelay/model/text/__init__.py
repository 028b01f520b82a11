"""Text in and out: the tokenizer with its chat template, GGUF tokenizers, incremental
detokenization."""
