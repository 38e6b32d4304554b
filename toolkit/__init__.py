"""ONNX export and multi-backend cross-checking for transformer decoders."""

__version__ = "0.1.0"
