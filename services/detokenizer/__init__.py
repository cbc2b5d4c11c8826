"""Detokenizer service: incremental text, stop strings, routing to the owning tokenizer replica."""
