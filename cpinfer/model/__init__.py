"""Llama-3 model family (no distributed code: attention is injected)."""
