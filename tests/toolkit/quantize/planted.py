"""A two-layer decoder with one feed-forward rescaled inside (the same function, other weights), shared by the
recipe tests that plant what a recipe must find."""

from __future__ import annotations

import torch

from exporters.onnx_export import export_model
from models.registry import build_model, get_family

CONFIG = {"vocab_size": 96, "layers": 2, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 128, "max_positions": 64}


def planted_model(layer: int, channels, factor: float, dtype=torch.float32):
    """The decoder with layer `layer`'s down projection reading input `channels` `factor` times stronger and its
    up projection writing them `factor` times weaker (the product, and so the function, unchanged)."""
    config = get_family("llama").config_from_dict(CONFIG)
    model = build_model("llama", config, seed=0).to(dtype)
    with torch.no_grad():
        parameters = dict(model.named_parameters())
        parameters[f"block.{layer}.feed_forward.down_proj.weight"][:, channels] *= factor  # [width, ff]: K columns
        parameters[f"block.{layer}.feed_forward.up_proj.weight"][channels, :] /= factor  # [ff, width]: down's K rows
    return config, model


def export_planted(directory, layer: int, channels, factor: float):
    config, model = planted_model(layer, channels, factor)
    export_model(model, "llama", config, directory, variant="serving")
    return directory
