"""PyTorch models whose every stage can be inspected and exported."""

from models.llama import BlockConfig, LlamaBlock, LlamaConfig, LlamaDecoder, ProbedBlock, ProbedBlockConfig

__all__ = ["BlockConfig", "LlamaDecoder", "LlamaBlock", "LlamaConfig", "ProbedBlock", "ProbedBlockConfig"]
