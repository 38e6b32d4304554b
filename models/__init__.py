"""PyTorch models whose every stage can be inspected and exported."""

from models.llama import BlockConfig, Decoder, DecoderBlock, DecoderConfig, ProbedBlock, ProbedBlockConfig

__all__ = ["BlockConfig", "Decoder", "DecoderBlock", "DecoderConfig", "ProbedBlock", "ProbedBlockConfig"]
