"""`toolkit quantize --imatrix`: weight each block's k-quant search by how much each input channel carries.

A MatMul y = x W sums over the K input channels; an error in row k of W moves y by x_k times that error, so
on average by E[x_k^2] times its square. llama.cpp's importance matrix measures E[x_k^2] per input channel of
every weight on a calibration text and weights the quantizer's least squares by it. Here the float model (the
eager reference rebuilt from the artifact) runs the calibration text of the `measured` recipe (not the quality
report's perplexity text), every F.linear call records the mean square of its input per channel, and each
MatMul weight's search (exporters/kquant.search) weights value (k, n) by importance[k] times
sqrt(2 mean(block^2) + w^2), llama.cpp's weighting with an importance matrix (quantize_row_q4_K_impl). The
8-bit weights of `mixed` and `measured` take it too.

`--recipe gptq` reads the same inputs for the whole second moment E[x^T x] of each weight's input (hessians()).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from artifact.errors import ConfigError
from toolkit.quantize.sensitivity import Calibration, weights_of


class _LinearInputs(TorchFunctionMode):
    """Sums statistic(x) (x: float64 [rows, K]), and counts rows, over every F.linear call whose weight is one of
    `watched`, by the weight's id (a tied head's weight is the embedding's, under two names). Sums and means are
    made in place: gptq's E[x^T x] of every weight is what sizes its passes, and a second copy of them all (a new
    sum per call, a new mean per weight) would double that."""

    def __init__(self, watched: set[int], statistic):
        super().__init__()
        self.watched, self.statistic = watched, statistic
        self.sums: dict[int, torch.Tensor] = {}
        self.rows: dict[int, int] = {}
        self.means: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            if id(weight) in self.watched:
                flat = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)  # (rows, K)
                statistic = self.statistic(flat)
                if id(weight) in self.sums:
                    self.sums[id(weight)] += statistic
                else:
                    self.sums[id(weight)] = statistic
                self.rows[id(weight)] = self.rows.get(id(weight), 0) + flat.shape[0]
        return func(*args, **kwargs)

    def mean(self, key: int) -> torch.Tensor | None:
        """The mean of `key`'s statistic, divided in the sum's own memory (the sum is let go of)."""
        if key in self.sums:
            self.means[key] = self.sums.pop(key).div_(self.rows[key])
        return self.means.get(key)


def importance(calibrated: Calibration, matmul_b: set[str], source_map: dict, folded: dict) -> dict:
    """{B: float32 [K], the mean square of each input channel of the torch weight(s) B holds} over the
    calibration text, for the MatMul weights `matmul_b` of the calibrated graph. A fused B (QKV, gate/up) holds
    weights that read the same input. A B whose weight the float model never multiplies through F.linear is an
    error (its search would be weighted by nothing); kquant_blocks refuses an importance of another K."""
    held = weights_of(matmul_b, source_map, folded)
    parameters = dict(calibrated.model.named_parameters(remove_duplicate=False))
    with _LinearInputs({id(parameters[e["name"]]) for entries in held.values() for e in entries}, _squares) as seen:
        _run_in_rows(calibrated)
    found = {}
    for b, entries in held.items():
        means = [m for m in (seen.mean(id(parameters[e["name"]])) for e in entries) if m is not None]
        if not means:
            raise ConfigError(f"--imatrix: the float model never multiplies by {entries[0]['name']} (MatMul {b})")
        found[b] = means[0].numpy().astype(np.float32)
    return found


# Rows of a calibration text run through the float model at once. Beyond the statistics' sums a forward pass holds
# its logits, rows x tokens x vocabulary float32: 0.4 GB for 8 of SmolLM2's 256-token rows.
PASS_ROWS = 8


def _run_in_rows(calibrated: Calibration) -> None:
    """The float model run over calibrated's text PASS_ROWS rows at a time (the statistics sum over the passes)."""
    feed = calibrated.feed
    rows = len(feed["input_ids"])
    for start in range(0, rows, PASS_ROWS):
        part = {
            name: value[start : start + PASS_ROWS] if np.ndim(value) and len(value) == rows else value
            for name, value in feed.items()
        }
        with torch.no_grad():
            calibrated.runner.run(part)


def _squares(flat: torch.Tensor) -> torch.Tensor:
    return (flat * flat).sum(dim=0)  # [K]


def _gram(flat: torch.Tensor) -> torch.Tensor:
    return flat.T @ flat  # [K, K]


def hessians(
    calibrated: Calibration, matmul_b: set[str], source_map: dict, folded: dict, also: dict[str, str] | None = None
) -> dict:
    """{B: float64 [K, K], E[x^T x] of the input of the torch weight(s) B holds} over the calibration text (GPTQ's
    H, exporters/gptq.py), for the MatMul weights `matmul_b`, the vocabulary projection's too; one per B, since a
    fused B's weights read the same input. `also`: {B: torch name} for a B the weight map does not name (a tied
    head's folded transpose). An error, as for importance(), when a B is neither, or the float model never
    multiplies by its weight."""
    held = weights_of(matmul_b, source_map, folded, head=True)
    for b, name in (also or {}).items():
        held.setdefault(b, [{"name": name}])
    unnamed = sorted(matmul_b - set(held))
    if unnamed:
        raise ConfigError(f"--recipe gptq: MatMul weight {unnamed[0]} holds no weight of the model's weight map")
    parameters = dict(calibrated.model.named_parameters(remove_duplicate=False))
    key = {b: id(parameters[entries[0]["name"]]) for b, entries in held.items()}
    with _LinearInputs(set(key.values()), _gram) as seen:
        _run_in_rows(calibrated)
    found = {}
    for b, entries in held.items():
        mean = seen.mean(key[b])
        if mean is None:
            raise ConfigError(f"--recipe gptq: the float model never multiplies by {entries[0]['name']} (MatMul {b})")
        found[b] = mean.numpy()
    return found
