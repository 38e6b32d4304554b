"""ONNX export and multi-backend cross-checking for transformer decoders: the CLI and its applications."""

from artifact.format import TOOLKIT_VERSION as __version__

__all__ = ["__version__"]
