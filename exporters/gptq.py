"""`toolkit quantize --recipe gptq`: float weights to MatMulNBits blocks that keep the layer's output, not the weight.

Round-to-nearest and the k-quant search each round a block as well as it can be rounded alone. GPTQ (Frantar et
al., 2022, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers") rounds a
MatMul y = x W one input channel (row k of W [K, N]) at a time and moves the rounding error of row k onto the
rows not yet rounded, weighted by the inverse of H = E[x^T x] measured on a calibration text, so that the
layer's output on such inputs, not each weight, stays close: it minimises E|x (W - Q)|^2 row by row.

Each block of 32 rows (one MatMulNBits block per output column) takes its scale and integer zero point when its
first row comes up, from the rows as the earlier errors have moved them, by the k-quant search
(exporters/kquant.search_zero_point, weighted by H's diagonal, each channel's mean square); the rows are then
rounded onto that grid. With integer zero points (the default) the result is round-to-nearest's layout (uint8
zero points, no offsets), so it decodes at round-to-nearest's speed. With float minimums ("offsets") each block's
scale and minimum come from the k-quant search for a float minimum (exporters/kquant.search, the same weighting),
held as offsets beside the MatMulNBits as the k-quant recipes hold them: slower to decode, and a grid that can put
a level where integer zero points cannot.
"""

from __future__ import annotations

import numpy as np
import torch

from exporters.gguf_blocks import NBitsWeight, pack4
from exporters.kquant import AUTO_TOLERANCE, held_offsets, pad_last_block, search, search_zero_point

# Of H's mean diagonal, added to its diagonal. GPTQ's paper adds 1 %, for H from 128 x 2048 tokens; from the
# recipe's 2048 sampled tokens H is close to singular for a K of 1536, and at 1 % GPTQ fits the calibration text
# (layer 5's down projection of SmolLM2 off its grid: output error 0.24x the k-quant search's on the text,
# 1.7-2.3x on other text); 30 % keeps q, o, gate and down at 0.6-1.2x on other text (benchmarks/gptq_heldout.py).
DAMPING = 0.3
BATCH = 128  # rows whose error moves onto the rest in one product (GPTQ's lazy batch updates)
INVERSE_ROWS = 2048  # rows of the inverse Cholesky factor solved in one triangular solve (_inverse_cholesky)
ZERO_POINTS = ("integer", "offsets", "auto")  # the first the default


def gptq_blocks(
    weight: np.ndarray,
    hessian: np.ndarray,
    bits: int = 4,
    block_size: int = 32,
    zero_points: str = "integer",
    damping: float = DAMPING,
) -> NBitsWeight:
    """The MatMulNBits weight of float `weight` [K, N] (a MatMul's B) whose input x has second moment `hessian`
    [K, K] = E[x^T x] on a calibration text; zero_points: each block's minimum, "integer" (uint8 zero points),
    "offsets" (a float minimum) or "auto" (both rounded, the integer ones kept unless their output error on the
    calibration text, tr((W - Q)^T H (W - Q)), is more than AUTO_TOLERANCE times the float minimums'); damping:
    the share of H's mean diagonal added to its diagonal."""
    if zero_points not in ZERO_POINTS:
        raise ValueError(f"zero_points: expected one of {ZERO_POINTS}, got {zero_points!r}")
    if not 0 < damping < float("inf"):
        raise ValueError(f"damping: expected a finite share of H's mean diagonal above 0, got {damping!r}")
    k, n = weight.shape
    if hessian.shape != (k, k):
        raise ValueError(f"hessian: expected shape ({k}, {k}), got {hessian.shape}")
    w = torch.from_numpy(np.ascontiguousarray(weight.T, dtype=np.float32)).to(torch.float64)  # [N, K]
    h = torch.from_numpy(np.ascontiguousarray(hessian, dtype=np.float64)).clone()
    dead = torch.diagonal(h) == 0  # a channel the text never moved: its rows round alone, their error kept
    h[dead, dead] = 1.0
    torch.diagonal(h).add_(damping * torch.diagonal(h).mean())
    upper = _inverse_cholesky(h)  # H^-1 = U^T U, U upper: row k's update weights for the rows after it
    importance = torch.diagonal(h).to(torch.float32).numpy()
    del h
    if zero_points != "auto":
        return _rounded(w, upper, importance, bits, block_size, zero_points == "offsets")
    # The second rounding moves w itself: only the first needs a copy ([N, K] float64; 0.8 GB for a 1B head).
    made = {"integer": _rounded(w.clone(), upper, importance, bits, block_size, False)}
    made["offsets"] = _rounded(w, upper, importance, bits, block_size, True)
    measured = torch.from_numpy(np.ascontiguousarray(hessian, dtype=np.float64))
    error = {mode: _output_error(weight, made[mode], measured) for mode in made}
    return made["offsets" if error["integer"] > AUTO_TOLERANCE * error["offsets"] else "integer"]


def _output_error(weight: np.ndarray, made: NBitsWeight, hessian: torch.Tensor) -> float:
    """tr(D^T H D), D = weight - made's values: E|x D|^2 summed over the outputs on the calibration text."""
    d = torch.from_numpy(weight.astype(np.float64) - made.dequantize())  # [K, N]
    return float((d * (hessian @ d)).sum())


def _rounded(
    w: torch.Tensor, upper: torch.Tensor, importance: np.ndarray, bits: int, block_size: int, offsets: bool
) -> NBitsWeight:
    """GPTQ's rounding of w [N, K] (float64, moved in place) with update weights `upper` (the upper Cholesky
    factor of the damped H^-1) and each block's grid searched with weighting `importance` [K]."""
    n, k = w.shape
    blocks = -(-k // block_size)  # the last one padded where K does not fill it, as kquant_blocks pads it
    top = (1 << bits) - 1
    codes = np.zeros((n, blocks * block_size), np.uint8)  # a padded block's padding keeps code 0
    scales = np.empty((n, blocks), np.float32)
    zeros = np.empty((n, blocks), np.uint8)
    minimums = np.empty((n, blocks), np.float32)
    for start in range(0, k, BATCH):
        stop = min(start + BATCH, k)
        rows = w[:, start:stop].clone()  # [N, batch]
        errors = torch.zeros_like(rows)
        u = upper[start:stop, start:stop]
        for i in range(stop - start):
            at = start + i
            if at % block_size == 0:  # this block's grid, from its rows as the earlier errors left them
                group, weighting, mask = _block(
                    rows[:, i : i + block_size], importance[at : at + block_size], block_size
                )
                if offsets:
                    _, s, m = search(group, top, mask, weighting)
                    minimums[:, at // block_size] = m
                    low = torch.from_numpy(m).to(torch.float64)
                else:
                    _, s, z = search_zero_point(group, top, mask, weighting)
                    zeros[:, at // block_size] = z
                    zero = torch.from_numpy(z.astype(np.float64))
                scales[:, at // block_size] = s
                scale = torch.from_numpy(s).to(torch.float64)
                safe = torch.where(scale > 0, scale, 1.0)
            column = rows[:, i]
            if offsets:
                q = torch.clamp(torch.round((column - low) / safe), 0, top)
                value = scale * q + low
            else:
                q = torch.clamp(torch.round(column / safe) + zero, 0, top)
                value = scale * (q - zero)
            codes[:, at] = q.to(torch.uint8).numpy()
            error = (column - value) / u[i, i]
            rows[:, i:] -= error[:, None] * u[i, i:][None, :]
            errors[:, i] = error
        w[:, stop:] -= errors @ upper[start:stop, stop:]
    packed = codes.reshape(n, -1, block_size)
    if bits == 4:
        packed = pack4(packed)
    partial = k if k % block_size else None
    if offsets:
        return NBitsWeight(
            bits, packed, scales.reshape(-1), None, False, held_offsets(minimums, scales, bits), block_size, partial
        )
    if bits == 4:
        zeros = pack4(np.pad(zeros, ((0, 0), (0, zeros.shape[1] % 2))))
    return NBitsWeight(bits, packed, scales.reshape(-1), zeros.reshape(-1), False, None, block_size, partial)


def _block(rows: torch.Tensor, importance: np.ndarray, block_size: int):
    """(values [N, block_size] float32, their search weighting, the mask of real values or None) of one block's
    rows [N, r]: a block that K leaves short (r < block_size) is padded as kquant_blocks pads it."""
    group, importance, valid = pad_last_block(rows.to(torch.float32).numpy(), importance, block_size)
    mask = None if valid is None else np.broadcast_to(valid, group.shape)
    return group, np.broadcast_to(importance, group.shape), mask


def _inverse_cholesky(h: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor U of H^-1 (GPTQ's Hinv): H^-1 = U^T U, from one factorisation. With J the
    reversal of the channels, J H J = M M^T (M lower) gives H^-1 = (J M^-1 J)^T (J M^-1 J), and J M^-1 J is upper
    with a positive diagonal, so it is U. Rows of M^-1 are solved INVERSE_ROWS at a time against the leading block
    of M they reach (M^-1 is lower), near a triangular inverse's third of K^3; factoring H, inverting it and
    factoring again takes 1.64x as long at K 8192 (benchmarks/gptq_inverse_factor.py)."""
    k = h.shape[0]
    m = torch.linalg.cholesky(h.flip(0, 1))  # J H J = M M^T
    upper = torch.zeros_like(h)  # J M^-1 J, written as each block of M^-1's rows is solved (no second K x K copy)
    for start in range(0, k, INVERSE_ROWS):
        stop = min(start + INVERSE_ROWS, k)
        rows = torch.zeros((stop - start, stop), dtype=h.dtype)  # I's rows start:stop, up to column stop
        rows[:, start:stop] = torch.eye(stop - start, dtype=h.dtype)
        # M^-1[start:stop, :stop], the rest of those rows being 0
        solved = torch.linalg.solve_triangular(m[:stop, :stop], rows, upper=False, left=False)
        upper[k - stop : k - start, k - stop :] = solved.flip(0, 1)
    return upper
