"""`toolkit quantize --imatrix`: weight each block's k-quant search by how much each input channel carries.

A MatMul y = x W sums over the K input channels; an error in row k of W moves y by x_k times that error, so
on average by E[x_k^2] times its square. llama.cpp's importance matrix measures E[x_k^2] per input channel of
every weight on a calibration text and weights the quantizer's least squares by it. Here the float model (the
eager reference rebuilt from the artifact) runs the calibration text of the `measured` recipe (not the quality
report's perplexity text), every F.linear call records the mean square of its input per channel, and each
MatMul weight's search (exporters/kquant.search) weights value (k, n) by importance[k] times
sqrt(2 mean(block^2) + w^2), llama.cpp's weighting with an importance matrix (quantize_row_q4_K_impl). The
8-bit weights of `mixed` and `measured` take it too.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from artifact.errors import ConfigError
from toolkit.quantize.sensitivity import Calibration, weights_of


class _InputSquares(TorchFunctionMode):
    """Sums x^2 per input channel, and counts rows, of every F.linear call whose weight is one of `watched`."""

    def __init__(self, watched: dict[int, str]):
        super().__init__()
        self.watched = watched
        self.sums: dict[str, torch.Tensor] = {}
        self.rows: dict[str, int] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            name = self.watched.get(id(weight))
            if name is not None:
                flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)  # (rows, K)
                self.sums[name] = self.sums.get(name, 0) + (flat * flat).sum(dim=0)
                self.rows[name] = self.rows.get(name, 0) + flat.shape[0]
        return func(*args, **kwargs)


def importance(calibrated: Calibration, matmul_b: set[str], source_map: dict, folded: dict) -> dict:
    """{B: float32 [K], the mean square of each input channel of the torch weight(s) B holds} over the
    calibration text, for the MatMul weights `matmul_b` of the calibrated graph. A fused B (QKV, gate/up) holds
    weights that read the same input. A B whose weight the float model never multiplies through F.linear is an
    error (its search would be weighted by nothing); kquant_blocks refuses an importance of another K."""
    held = weights_of(matmul_b, source_map, folded)
    parameters = dict(calibrated.model.named_parameters(remove_duplicate=False))
    watched = {id(parameters[e["name"]]): e["name"] for entries in held.values() for e in entries}
    with _InputSquares(watched) as squares, torch.no_grad():
        calibrated.runner.run(calibrated.feed)
    found = {}
    for b, entries in held.items():
        names = [e["name"] for e in entries if e["name"] in squares.sums]
        if not names:
            raise ConfigError(f"--imatrix: the float model never multiplies by {entries[0]['name']} (MatMul {b})")
        found[b] = (squares.sums[names[0]] / squares.rows[names[0]]).numpy().astype(np.float32)
    return found
