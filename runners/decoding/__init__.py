"""Decoding on any runner: KV-cache feeds, sampling, generation and continuous batching."""
