"""`toolkit quantize --recipe kquant`: float weights to MatMulNBits blocks with a searched scale and zero point.

Round-to-nearest takes each block's range as it is: scale (max - min) / (2^bits - 1) and an integer zero point,
so a block's minimum moves to the nearest multiple of its scale. This recipe keeps what llama.cpp's k-quants
keep instead: per block of 32 values along K, w ~ s q + m with q in 0..2^bits - 1, a float32 scale s and a
float32 minimum m, chosen by a search over candidate scales, each followed by the weighted least-squares s and m
for the q it rounds to (weights rms(block) + |w|, which favour the large values; the search of llama.cpp's
make_qkx and of ONNX Runtime's k_quant algorithm). The float minimum is held as MatMulNBits' scale plus per-block
offsets (exporters/gguf_blocks.py, exporters/quantize.py _with_offsets), the layout the GGUF recipe gives Q4_1.

The offsets cost three more nodes beside each MatMulNBits at every decode step. search_zero_point is the same
search for MatMulNBits' own integer zero point (round-to-nearest's layout, no offsets); kquant_blocks' "auto"
runs both and keeps the integer one unless its weighted error is more than AUTO_TOLERANCE times the other's.
"""

from __future__ import annotations

import numpy as np
import torch

from exporters.gguf_blocks import NBitsWeight, pack4

SEARCH_STEPS = 20  # candidate scales: (levels - 1 + delta) / range for delta in -1.0, -0.9, ..., +1.0
SEARCH_DELTA = 0.1
SLAB_VALUES = 1 << 22  # values searched at a time (the candidates' arrays are a few times this in float32)
ZERO_POINT_MODES = ("auto", "integer", "offsets")
# "auto" keeps a weight's integer zero points unless their weighted squared error is this many times the float
# minimums'. On heavy-tailed weights the ratio is about 1.2 (tests/exporters/test_kquant.py's fixture); a weight
# whose loud input channels meet small weights (what the importance matrix protects) is far above it.
AUTO_TOLERANCE = 1.5


def pad_last_block(
    rows: np.ndarray, importance: np.ndarray | None, block_size: int
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(rows, importance, valid) of rows [N, K] whose last block K leaves short, padded as MatMulNBits pads it: the
    padding repeats that block's smallest value (so the block's range is its own), weighs 0 in `importance` [K]
    and is False in `valid` [K + pad]; unchanged, with valid None, where K fills its blocks."""
    k = rows.shape[1]
    if k % block_size == 0:
        return rows, importance, None
    pad = block_size - k % block_size
    last = rows[:, k - (block_size - pad) :].min(axis=1, keepdims=True)
    rows = np.concatenate([rows, np.repeat(last, pad, axis=1)], axis=1)
    if importance is not None:
        importance = np.concatenate([importance, np.zeros(pad, dtype=importance.dtype)])
    return rows, importance, np.arange(k + pad) < k


def kquant_blocks(
    weight: np.ndarray,
    bits: int = 4,
    block_size: int = 32,
    importance: np.ndarray | None = None,
    zero_points: str = "offsets",
) -> NBitsWeight:
    """The MatMulNBits weight of float `weight` [K, N] (a MatMul's B). A K that does not fill its last block is
    padded, as MatMulNBits pads it: the padding repeats the block's smallest value (so the block's range is its
    own) with no weight in the search, and its codes are 0. importance: [K], how much each input channel carries
    (toolkit/quantize/importance.py), which weights the search's least squares. zero_points: "offsets" searches a
    float minimum per block (`search`; held as offsets beside the MatMulNBits), "integer" MatMulNBits' own uint8
    zero point (`search_zero_point`: round-to-nearest's layout, and its decode speed), "auto" both, keeping integer
    zero points unless their weighted squared error is more than AUTO_TOLERANCE times the float minimums'."""
    if zero_points not in ZERO_POINT_MODES:
        raise ValueError(f"zero_points: expected one of {', '.join(ZERO_POINT_MODES)}, got {zero_points!r}")
    k, n = weight.shape
    if importance is not None and importance.shape != (k,):
        raise ValueError(f"importance: expected shape ({k},), got {importance.shape}")
    rows = np.ascontiguousarray(weight.T, dtype=np.float32)  # [N, K]: one row of blocks per output column
    rows, importance, valid = pad_last_block(rows, importance, block_size)
    if valid is not None:
        k_real, k = k, rows.shape[1]
    modes = ("integer", "offsets") if zero_points == "auto" else (zero_points,)
    # Per mode: codes [N, K], scales [N, blocks], minimums or integer zero points [N, blocks], weighted error.
    made = {mode: [np.empty((n, k), np.uint8), np.empty((n, k // block_size), np.float32), None, 0.0] for mode in modes}
    for parts in made.values():
        parts[2] = np.empty_like(parts[1])
    slab = max(1, SLAB_VALUES // k)
    for start in range(0, n, slab):
        chunk = rows[start : start + slab]
        blocks = chunk.reshape(-1, block_size)
        mask = None if valid is None else np.broadcast_to(valid, chunk.shape).reshape(-1, block_size)
        held = None if importance is None else np.broadcast_to(importance, chunk.shape).reshape(-1, block_size)
        stop = start + len(chunk)
        weighted = _weighted(blocks, mask, held) if len(made) > 1 else None  # once for both errors
        for mode, parts in made.items():
            found = (search_zero_point if mode == "integer" else search)(blocks, (1 << bits) - 1, mask, held)
            parts[0][start:stop] = found[0].reshape(stop - start, k)
            parts[1][start:stop] = found[1].reshape(stop - start, -1)
            parts[2][start:stop] = found[2].reshape(stop - start, -1)
            if weighted is not None:
                parts[3] += _weighted_error(*weighted, mode, found)
    mode = modes[0]
    if len(modes) > 1 and made["integer"][3] > AUTO_TOLERANCE * made["offsets"][3]:
        mode = "offsets"
    q, scales, minimums, _ = made.pop(mode)
    del made
    if valid is not None:
        q[:, k_real:] = 0
    packed = q.reshape(n, -1, block_size)
    if bits == 4:
        packed = pack4(packed)
    partial = None if valid is None else k_real
    if mode == "integer":
        zeros = minimums.astype(np.uint8)
        if bits == 4:  # two per byte, low nibble first; an odd count of blocks leaves the last high nibble 0
            zeros = pack4(np.pad(zeros, ((0, 0), (0, zeros.shape[1] % 2))))
        return NBitsWeight(bits, packed, scales.reshape(-1), zeros.reshape(-1), False, None, block_size, partial)
    return NBitsWeight(
        bits, packed, scales.reshape(-1), None, False, held_offsets(minimums, scales, bits), block_size, partial
    )


def held_offsets(minimums: np.ndarray, scales: np.ndarray, bits: int) -> np.ndarray:
    """The flat offsets of blocks s u + m (u in 0..2^bits - 1) under MatMulNBits' default zero point, the centre:
    (u - centre) s + (m + centre s), the integer part spread like the weights."""
    return (minimums + np.float32(1 << (bits - 1)) * scales).reshape(-1)


def _weighted_error(x: torch.Tensor, w: torch.Tensor, mode: str, found) -> float:
    """The search's objective summed over blocks x [B, L] with weights w (`_weighted`) for what a search `found`
    (q, s, and m or z)."""
    q, s, third = (torch.from_numpy(np.ascontiguousarray(a)).to(torch.float32) for a in found)
    values = s[:, None] * (q - third[:, None]) if mode == "integer" else s[:, None] * q + third[:, None]
    return float((w * (values - x) ** 2).sum(dtype=torch.float64))


def search(
    x: np.ndarray, top: int, valid: np.ndarray | None = None, importance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [B, L] uint8 in 0..top, s [B] float32, m [B] float32) minimising sum(w (s q + m - x)^2) per block of
    x [B, L] over the candidate scales, w = rms(block) + |x|, or with importance [B, L] (each value's input
    channel's mean square) w = importance sqrt(2 mean(block^2) + x^2), llama.cpp's weighting with an importance
    matrix. A constant block is s = 0, m = its value. valid [B, L] (bool): the values that count (w = 0 and the
    block's statistics without the others); the others must lie in the block's range.

    Computed with torch, whose elementwise kernels use every intra-op thread (numpy's use one): the search
    dominates a k-quant recipe's time, about 2x faster here on 2 cores."""
    x, w = _weighted(x, valid, importance)
    low, high = x.amin(dim=1), x.amax(dim=1)
    span = high - low
    flat = span == 0
    span = torch.where(flat, 1.0, span)
    from_low = x - low[:, None]
    # Every candidate's [B, L] arrays are written into these three: a fresh array per operation is fresh pages
    # for the kernel to fault in, and made kquant_blocks about 1.8x slower.
    q, wq, work = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def rounded(levels):  # q for the candidate scale span / levels, from the block's minimum
        return torch.mul(from_low, (levels / span)[:, None], out=q).round_().clamp_(0, top)

    def weighted_error(q, s, m):  # sum(w (s q + m - x)^2) per block
        return torch.mul(q, s[:, None], out=work).add_(m[:, None]).sub_(x).square_().mul_(w).sum(dim=1)

    best_q = rounded(torch.tensor(float(top))).clone()
    best_s, best_m = span / top, low
    best = weighted_error(best_q, best_s, best_m)
    sum_w, sum_wx = w.sum(dim=1), (w * x).sum(dim=1)
    for step in range(SEARCH_STEPS + 1):
        rounded(torch.tensor(top - 1 + SEARCH_DELTA * step, dtype=torch.float32))
        torch.mul(w, q, out=wq)
        sum_q = wq.sum(dim=1)
        sum_qq, sum_qx = torch.mul(wq, q, out=work).sum(dim=1), torch.mul(wq, x, out=work).sum(dim=1)
        det = sum_w * sum_qq - sum_q * sum_q
        ok = det > 0
        det = torch.where(ok, det, 1.0)
        s = (sum_w * sum_qx - sum_q * sum_wx) / det
        m = (sum_qq * sum_wx - sum_q * sum_qx) / det
        error = weighted_error(q, s, m)
        better = ok & (s > 0) & (error < best)
        best = torch.where(better, error, best)
        best_s, best_m = torch.where(better, s, best_s), torch.where(better, m, best_m)
        best_q = torch.where(better[:, None], q, best_q)
    best_s, best_m = torch.where(flat, 0.0, best_s), torch.where(flat, low, best_m)
    best_q = torch.where(flat[:, None], 0.0, best_q)
    return best_q.to(torch.uint8).numpy(), best_s.numpy(), best_m.numpy()


def search_zero_point(
    x: np.ndarray, top: int, valid: np.ndarray | None = None, importance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q [B, L] uint8 in 0..top, s [B] float32, z [B] uint8 in 0..top) minimising sum(w (s (q - z) - x)^2) per
    block, with w as in `search`: the same search over candidate scales for MatMulNBits' integer zero points.

    An integer zero point puts 0 on the grid, so each candidate spans the block's range widened to hold 0 (as
    round-to-nearest does); z is the nearest integer to where 0 falls, and with z fixed each candidate's s is
    refitted by weighted least squares twice, rounding q again after each fit. The first candidate is the
    min-max grid itself, so no block ends worse than round-to-nearest's s and z by the weighted error."""
    x, w = _weighted(x, valid, importance)
    low, high = x.amin(dim=1).clamp(max=0), x.amax(dim=1).clamp(min=0)
    span = high - low
    flat = span == 0  # every value 0
    span = torch.where(flat, 1.0, span)

    # The candidates' [B, L] arrays are written into these three (see `search`).
    d, wd, work = torch.empty_like(x), torch.empty_like(x), torch.empty_like(x)

    def steps(s, z):  # d = q - z for scale s and zero point z
        return torch.div(x, s[:, None], out=d).round_().clamp_(-z[:, None], top - z[:, None])

    def codes(s, z):  # q for scale s and zero point z (in d), and its weighted error sum(w (s d - x)^2)
        steps(s, z)
        error = torch.mul(d, s[:, None], out=work).sub_(x).square_().mul_(w).sum(dim=1)
        return d.add_(z[:, None]), error

    def fitted(s):  # (q, s, z, weighted error) for a starting scale s, after refitting s with z fixed
        z = torch.clamp(torch.round(-low / s), 0, top)
        for _ in range(2):  # the refits need no error
            torch.mul(w, steps(s, z), out=wd)
            num, den = torch.mul(wd, x, out=work).sum(dim=1), torch.mul(wd, d, out=work).sum(dim=1)
            s = torch.where((den > 0) & (num > 0), num / torch.where(den > 0, den, 1.0), s)
        return s, z, *codes(s, z)

    best_s = span / top  # round-to-nearest: the min-max grid as it is
    best_z = torch.clamp(torch.round(-low / best_s), 0, top)
    best_q, best = codes(best_s, best_z)
    best_q = best_q.clone()
    # The min-max grid's own levels first (ties keep the earlier candidate), then the others: its step of the
    # sweep, top - 1 + 1.0, is the same candidate and is not fitted twice.
    sweep = [top - 1 + SEARCH_DELTA * step for step in range(SEARCH_STEPS + 1)]
    for levels in [float(top)] + [levels for levels in sweep if levels != top]:
        s, z, q, error = fitted(span / levels)
        better = error < best
        best = torch.where(better, error, best)
        best_s, best_z = torch.where(better, s, best_s), torch.where(better, z, best_z)
        best_q = torch.where(better[:, None], q, best_q)
    best_s = torch.where(flat, 0.0, best_s)
    best_q, best_z = torch.where(flat[:, None], 0.0, best_q), torch.where(flat, 0.0, best_z)
    return best_q.to(torch.uint8).numpy(), best_s.numpy(), best_z.to(torch.uint8).numpy()


def _weighted(x: np.ndarray, valid: np.ndarray | None, importance: np.ndarray | None):
    """(x, w) as torch float32 [B, L]: the search's weight of each value (see `search`), 0 where not valid."""
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    counted = None if valid is None else torch.from_numpy(np.ascontiguousarray(valid)).to(torch.float32)
    if counted is None:
        square = (x * x).mean(dim=1, keepdim=True)
    else:
        square = (x * x * counted).sum(dim=1, keepdim=True) / counted.sum(dim=1, keepdim=True)
    if importance is None:
        w = square.sqrt() + x.abs()
    else:
        w = torch.from_numpy(np.ascontiguousarray(importance, dtype=np.float32)) * (2 * square + x * x).sqrt()
    if counted is not None:
        w = w * counted
    return x, w
