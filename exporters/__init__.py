"""ONNX export of the toolkit's models."""
