"""A GGUF file's quantized blocks as com.microsoft MatMulNBits weights, taken as they are (no re-rounding).

A GGUF matrix's rows are output features and its blocks run along the input (K) axis, which is the layout of
MatMulNBits' B ([N, blocks, blob]: one row of blocks per output column), so each GGUF row becomes a row of B.

Every type taken here is, per sub-block of b values along K, w = s * q + o: an integer q in a range of 2^n
values, a float32 scale s and, for the types with a minimum, a float32 offset o (gguf_parts; s and o are the
products gguf.quants itself forms, an fp16 times a small integer, so they are exact):

    type  w                          q            b   MatMulNBits
    Q4_0  d (q - 8)                  -8..7        32  4-bit, scale d, default zero point 8: bit for bit
    Q8_0  d q                        -128..127    32  8-bit, zero point 128: bit for bit
    Q5_0  d (q - 16)                 -16..15      32  8-bit, zero point 128: bit for bit
    Q6_K  (d sc) (q - 32)            -32..31      16  8-bit, block 16, scale d sc: bit for bit
    Q4_1  d q + m                    0..15        32  4-bit + offsets
    Q4_K  (d sc) q - dmin m          0..15        32  4-bit + offsets
    Q5_1  d q + m                    0..31        32  8-bit + offsets
    Q5_K  (d sc) q - dmin m          0..31        32  8-bit + offsets

MatMulNBits computes (u - Z) s with an integer zero point Z, which cannot hold a float minimum. "+ offsets":
u = q - c + Z with c the middle of q's range, and o + c s added beside MatMulNBits as (the sum of the
activations over each block) x (o + c s), a [blocks, N] MatMul (exporters/quantize.py _with_offsets), which is
the arithmetic of llama.cpp's own Q4_1 x Q8_1 dot product (its Q8_1 blocks carry their sums for the same
term). Centring u keeps the integer part as spread as the weights themselves, so that int8 activations
(accuracy level 4) round against it as they do for Q4_0. The sum (u - Z) s + (o + c s) equals gguf.quants'
s q + o exactly in float32 unless s and o are more than about 2^9 apart in magnitude; `exact` says whether
every value of a tensor is.

Pieces of one MatMul weight (a fused QKV or gate/up of the `ort` lowering) of different types are taken at the
widest of their bits and the smallest of their blocks (a Q4_K attn_q beside a Q6_K attn_v: 8-bit, block 16,
with offsets where any piece has them), which holds every value as exactly.

For Q4_1 two other layouts stay available (to_nbits' q4_1) for measurement:
          "int8-grid": 8-bit, scale d/k (k the largest power of two <= 16 whose grid reaches m, so
          s is exact) and u = k * q + round(m/s) + z; off by at most s/2 = d/32 (k = 16) of a Q4_1 step.
          "float-zero-points": 4-bit, scale d, float zero point -m/d; off by float32 rounding only, but ONNX
          Runtime's CPU kernel has no fast path for float zero points at any accuracy level.

Float tensors (F32, F16, BF16) stay float MatMuls: that is what llama.cpp computes with them. The values
compared here are gguf.quants.dequantize's, which is what the GGUF import stores as the float artifact.
Q2_K, Q3_K and the IQ types are refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from artifact.errors import ModelFileError
from exporters.quantize import CHECK_SLAB_BYTES, dequantize_nbits

QK_K = 256  # values per K-quant super-block
# type: (values per sub-block b, the middle c of q's range, MatMulNBits bits, bytes per GGUF block)
GGUF_LAYOUTS = {
    "Q4_0": (32, 0, 4, 2 + 16),
    "Q8_0": (32, 0, 8, 2 + 32),
    "Q5_0": (32, 0, 8, 2 + 4 + 16),
    "Q6_K": (16, 0, 8, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),
    "Q4_1": (32, 8, 4, 4 + 16),
    "Q4_K": (32, 8, 4, 4 + 12 + QK_K // 2),
    "Q5_1": (32, 16, 8, 4 + 4 + 16),
    "Q5_K": (32, 16, 8, 4 + 12 + QK_K // 8 + QK_K // 2),
}
GGUF_NBITS_TYPES = tuple(GGUF_LAYOUTS)  # the types taken as MatMulNBits blocks
GGUF_FLOAT_TYPES = ("F32", "F16", "BF16")  # kept as float MatMuls
Q4_1_LAYOUTS = ("offsets", "int8-grid", "float-zero-points")
GRID_MULTIPLES = (1, 2, 4, 8, 16)  # Q4_1 on the 8-bit grid: scale d/k, exact in float32 for a power of two k


@dataclass
class NBitsWeight:
    """A MatMulNBits B for N output columns: packed [N, blocks, blob] uint8, scales [N * blocks] float32, zero points
    None (the default 2^(bits-1)), uint8 (one per block at 8 bits, two per byte at 4) or float32 [N * blocks];
    offsets None or float32 [N * blocks], added to every value of their block (a float minimum). K is the blocks'
    span unless `partial_k` gives a smaller one (the last block padded, as MatMulNBits allows)."""

    bits: int
    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    exact: bool  # bit for bit the GGUF's dequantized values
    offsets: np.ndarray | None = None
    block_size: int = 32
    partial_k: int | None = None

    @property
    def n(self) -> int:
        return self.packed.shape[0]

    @property
    def k(self) -> int:
        return self.partial_k or self.packed.shape[1] * self.block_size

    def rows(self, start: int, stop: int) -> NBitsWeight:
        """Output columns [start, stop) of this weight (its rows of blocks, scales and zero points)."""

        def part(array):
            return None if array is None else array.reshape(self.n, -1)[start:stop].reshape(-1)

        return NBitsWeight(
            self.bits,
            self.packed[start:stop],
            part(self.scales),
            part(self.zero_points),
            self.exact,
            part(self.offsets),
            self.block_size,
            self.partial_k,
        )

    def dequantize(self) -> np.ndarray:
        """[K, N] float32, as MatMulNBits' contract defines it (plus the offsets)."""
        weight = dequantize_nbits(
            self.packed, self.scales, self.zero_points, bits=self.bits, block_size=self.block_size, k=self.k, n=self.n
        )
        if self.offsets is not None:
            weight += np.repeat(self.offsets.reshape(self.n, -1).T, self.block_size, axis=0)[: self.k]
        return weight


def target_layout(kinds) -> tuple[int, int, bool]:
    """(bits, block size, offsets) one MatMulNBits weight takes pieces of GGUF types `kinds` at: the widest
    bits, the smallest sub-block, offsets where any type has a minimum."""
    layouts = [GGUF_LAYOUTS[kind] for kind in kinds]
    return max(x[2] for x in layouts), min(x[0] for x in layouts), any(x[1] for x in layouts)


def to_nbits(
    kind: str, raw: np.ndarray, q4_1: str = "offsets", layout: tuple[int, int, bool] | None = None
) -> NBitsWeight:
    """The MatMulNBits weight of GGUF rows `raw` ([N, row bytes] uint8, whole blocks of type `kind`), at the
    type's own layout or at `layout` (target_layout of the pieces it is fused with)."""
    if kind not in GGUF_LAYOUTS:
        raise ValueError(f"GGUF type {kind} has no MatMulNBits layout here; mappable: {', '.join(GGUF_LAYOUTS)}")
    if kind == "Q4_1" and q4_1 != "offsets" and layout is None:
        n = raw.shape[0]
        blocks = raw.reshape(n, -1, GGUF_LAYOUTS[kind][3])
        d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        q = _gguf_nibbles(blocks[..., 4:])
        return _q4_1_float_zero_points(q, d, m) if q4_1 == "float-zero-points" else _q4_1_grid(q, d, m)
    bits, block, with_offsets = layout or target_layout([kind])
    sub, centre, _, block_bytes = GGUF_LAYOUTS[kind]
    if sub % block:
        raise ValueError(f"{kind}: block {block} does not divide its sub-blocks of {sub}")
    # A slab of rows at a time (CHECK_SLAB_BYTES of float32 values), so a vocabulary-sized head's unpacked
    # values and the exactness check never exist whole beside the packed result.
    values = raw.shape[1] // block_bytes * (QK_K if kind.endswith("_K") else 32)  # K: a GGUF block's values
    slab = max(1, CHECK_SLAB_BYTES // (4 * values))
    if raw.shape[0] > slab:
        layout = (bits, block, with_offsets)
        return concat_columns([to_nbits(kind, raw[i : i + slab], q4_1, layout) for i in range(0, len(raw), slab)])
    q, s, o = gguf_parts(kind, raw)  # [N, K] int16, [N, K / sub] float32, same or None
    n, k = q.shape
    s = np.repeat(s, sub // block, axis=1)  # one scale per MatMulNBits block
    o = None if o is None else np.repeat(o, sub // block, axis=1)
    zero = 1 << (bits - 1)
    u = (q - centre + zero).astype(np.uint8).reshape(n, k // block, block)
    want = s[..., None] * q.reshape(n, -1, block).astype(np.float32)
    if o is not None:
        want = want + o[..., None]
    rebuilt = s[..., None] * (u.astype(np.float32) - np.float32(zero))
    offsets = None
    if with_offsets:
        offsets = (np.zeros_like(s) if o is None else o) + np.float32(centre) * s
        rebuilt = rebuilt + offsets[..., None]
    exact = bool(np.array_equal(rebuilt, want))
    packed = pack4(u) if bits == 4 else u
    flat = None if offsets is None else offsets.reshape(-1)
    return NBitsWeight(bits, packed, s.reshape(-1), None, exact, flat, block)


def gguf_parts(kind: str, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q [N, K] int16, s [N, K / b] float32, o [N, K / b] float32 or None) with w = s q + o per sub-block of b:
    the GGUF rows `raw` unpacked as gguf.quants unpacks them, before it multiplies."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, GGUF_LAYOUTS[kind][3])

    def half(start):  # an fp16 field at byte `start` of every block, as float32
        return blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32)

    if kind == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).astype(np.int16).reshape(n, -1), half(0), None
    if kind == "Q4_0":
        return _gguf_nibbles(blocks[..., 2:]).astype(np.int16).reshape(n, -1) - 8, half(0), None
    if kind == "Q4_1":
        return _gguf_nibbles(blocks[..., 4:]).astype(np.int16).reshape(n, -1), half(0), half(2)
    if kind in ("Q5_0", "Q5_1"):
        at = 2 if kind == "Q5_0" else 4
        high = np.unpackbits(blocks[..., at : at + 4], axis=-1, bitorder="little")  # bit j: element j's 5th bit
        q = (_gguf_nibbles(blocks[..., at + 4 :]) | (high << 4)).astype(np.int16).reshape(n, -1)
        return (q - 16, half(0), None) if kind == "Q5_0" else (q, half(0), half(2))
    if kind in ("Q4_K", "Q5_K"):
        import gguf

        d, dmin = half(0), half(2)
        sc, mn = gguf.quants.Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
        s = d[..., None] * sc.reshape(n, -1, 8).astype(np.float32)  # [N, super-blocks, 8]
        o = -(dmin[..., None] * mn.reshape(n, -1, 8).astype(np.float32))
        nibbles = np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        if kind == "Q4_K":
            q = ((blocks[..., 16:].reshape(n, -1, 4, 1, 32) >> nibbles) & 0x0F).reshape(n, -1)
        else:
            qh = blocks[..., 16 : 16 + QK_K // 8].reshape(n, -1, 1, 32)
            qh = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1  # [N, super, 8, 32]
            ql = (blocks[..., 16 + QK_K // 8 :].reshape(n, -1, 4, 1, 32) >> nibbles) & 0x0F
            q = (ql.reshape(n, -1, 8, 32) | (qh << 4)).reshape(n, -1)
        return q.astype(np.int16), s.reshape(n, -1), o.reshape(n, -1)
    if kind == "Q6_K":
        nibbles = np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
        ql = ((blocks[..., : QK_K // 2].reshape(n, -1, 2, 1, 64) >> nibbles) & 0x0F).reshape(n, -1, 8, 32)
        qh = blocks[..., QK_K // 2 : QK_K // 2 + QK_K // 4].reshape(n, -1, 2, 1, 32)
        qh = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 3).reshape(n, -1, 8, 32)
        q = (ql | (qh << 4)).astype(np.int16).reshape(n, -1) - 32
        at = QK_K // 2 + QK_K // 4
        scales = blocks[..., at : at + QK_K // 16].copy().view(np.int8)
        d = half(at + QK_K // 16)
        return q, (d[..., None] * scales.astype(np.float32)).reshape(n, -1), None
    raise ValueError(f"GGUF type {kind} has no MatMulNBits layout here; mappable: {', '.join(GGUF_LAYOUTS)}")


def _gguf_nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 32] values 0..15 in K order from GGUF's 16 bytes per block: low nibbles are elements 0-15, high 16-31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> 4], axis=-1)


def pack4(values: np.ndarray) -> np.ndarray:
    """MatMulNBits' 4-bit packing of [..., block] values: element 2i in the low nibble of byte i, 2i + 1 high."""
    return values[..., 0::2] | (values[..., 1::2] << 4)


def _q4_1_float_zero_points(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> NBitsWeight:
    """4-bit, scale d, float zero point -m/d: (q + m/d) * d. A block with d = 0 holds m alone: q = 0, scale m,
    zero point -1 (zero when m is 0 too)."""
    flat = d == 0
    scales = np.where(flat, m, d)
    with np.errstate(divide="ignore", invalid="ignore"):
        zero = np.where(flat, np.where(m == 0, 0.0, -1.0), -m / d).astype(np.float32)
    q = np.where(flat[..., None], np.uint8(0), q)
    return NBitsWeight(4, pack4(q), scales.reshape(-1), zero.reshape(-1), False)


def _q4_1_grid(q: np.ndarray, d: np.ndarray, m: np.ndarray) -> NBitsWeight:
    """8-bit, scale d/k and u = k * q + o + z with o = round(m k / d) and z = max(0, -o): (u - z) * d/k = d q + o d/k,
    exact in float32 (an 8-bit integer times an fp16 scale over a power of two). k is the largest of GRID_MULTIPLES
    whose u stays in 0..255; a block no k fits (its minimum more than 240 steps from zero) is rounded onto a grid
    spanning its values and zero instead."""
    multiple = np.zeros(d.shape, dtype=np.float32)
    offset = np.zeros(d.shape, dtype=np.float32)
    for k in GRID_MULTIPLES:  # ascending: a larger k that fits replaces a smaller one
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            o = np.rint(np.float32(k) * m / d)
        fits = (d != 0) & np.isfinite(o) & (o >= -255) & (o <= 255 - 15 * k)
        multiple[fits], offset[fits] = k, o[fits]
    grid = multiple > 0
    zero = np.where(grid, np.maximum(0, -offset), 0)
    u = multiple[..., None] * q + (offset + zero)[..., None]
    scales = np.where(grid, d / np.where(grid, multiple, 1), 0).astype(np.float32)
    if not grid.all():
        values = d[..., None] * q.astype(np.float32) + m[..., None]  # gguf.quants' order of operations
        low, high = np.minimum(values.min(-1), 0), np.maximum(values.max(-1), 0)
        span = ((high - low) / 255).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            z = np.where(span > 0, np.rint(-low / span), 0)
            rounded = np.clip(np.rint(values / np.where(span > 0, span, 1)[..., None]) + z[..., None], 0, 255)
        u = np.where(grid[..., None], u, rounded)
        zero, scales = np.where(grid, zero, z), np.where(grid, scales, span)
    return NBitsWeight(8, u.astype(np.uint8), scales.reshape(-1), zero.astype(np.uint8).reshape(-1), False)


def concat_columns(parts: list[NBitsWeight]) -> NBitsWeight:
    """One B from several GGUF tensors' rows, in output-column order (a fused QKV or gate/up initializer)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    layouts = {
        (p.bits, p.block_size, None if p.zero_points is None else p.zero_points.dtype.str, p.offsets is not None, p.k)
        for p in parts
    }
    if len(layouts) > 1:
        raise ValueError(
            "columns of different MatMulNBits layouts (bits, block, zero points, offsets, K): "
            f"{sorted(map(str, layouts))}"
        )

    def joined(field):
        return None if getattr(first, field) is None else np.concatenate([getattr(p, field) for p in parts])

    return NBitsWeight(
        first.bits,
        np.concatenate([p.packed for p in parts]),
        np.concatenate([p.scales for p in parts]),
        joined("zero_points"),
        all(p.exact for p in parts),
        joined("offsets"),
        first.block_size,
    )


def deviation(weight: NBitsWeight, kind: str, raw: np.ndarray) -> dict:
    """How far `weight` is from gguf.quants.dequantize of the same rows: whether it is identical, the largest
    absolute difference and the largest in the GGUF's own steps (the scale s of each sub-block; sub-blocks with
    s = 0 count in the absolute figure only). Compared a slab of rows at a time (CHECK_SLAB_BYTES of float32
    each)."""
    import gguf

    identical, max_abs, max_steps = True, 0.0, 0.0
    slab = max(1, CHECK_SLAB_BYTES // (4 * weight.k))
    sub = GGUF_LAYOUTS[kind][0]
    for start in range(0, weight.n, slab):
        rows, part = raw[start : start + slab], weight.rows(start, start + slab)
        want = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[kind]).reshape(part.n, -1)  # [rows, K]
        ours = part.dequantize().T
        identical = identical and bool(np.array_equal(ours, want))
        diff = np.abs(ours - want).reshape(part.n, -1, sub).max(-1)  # [rows, sub-blocks]
        step = np.abs(gguf_parts(kind, rows)[1])
        with np.errstate(divide="ignore", invalid="ignore"):
            steps = np.where(step > 0, diff / np.where(step > 0, step, 1), 0)
        max_abs, max_steps = max(max_abs, float(diff.max())), max(max_steps, float(steps.max()))
    return {"identical": identical, "max_abs": max_abs, "max_steps": max_steps}


class GGUFRecipeError(ModelFileError):
    """The GGUF recipe cannot take this artifact's weights from its GGUF as they are (the reason is the message)."""


@dataclass(frozen=True)
class Piece:
    """Output columns [start, stop) of a MatMul's B: rows `rows` of GGUF tensor `tensor` (torch weight `weight`)."""

    weight: str
    tensor: str
    rows: tuple[int, int] | None
    start: int
    stop: int


def plan_matmuls(
    matmuls: dict[str, tuple[int, int]],
    float32: set[str],
    weight_map: dict,
    folded: dict[str, str],
    head_b: str | None,
    sources: dict,
    tensors: dict,
) -> dict[str, list[Piece]]:
    """{B: its pieces in column order} for every MatMul weight of the prepared graph (`matmuls`: {B: (K, N)}).

    A B is found through the weight map (a weight stored transposed as B, or as a column slice of a fused B, or
    whose initializer was folded into B by prepare_proto) or, for the head, `head_b` (the transposed copy the
    export folded, found by its values). `sources` is gguf_sources of the file, `tensors` its GGUFTensors.
    GGUFRecipeError when a B is not float32, not covered exactly by model weights, or comes from a tensor of
    a type or shape its blocks cannot be taken from."""
    placed: dict[str, dict[tuple[int, int], Piece]] = {b: {} for b in matmuls}

    def place(b, name, start, stop):
        source = sources.get(name)
        if source is None:
            raise GGUFRecipeError(
                f"MatMul weight {b!r} holds {name!r}, which the GGUF import does not read from a tensor"
            )
        placed[b].setdefault((start, stop), Piece(name, source.tensor, source.rows, start, stop))

    for name, entry in weight_map.items():
        location, transpose = entry["initializer"], bool(entry.get("transpose"))
        if location not in matmuls and folded.get(location) in matmuls and not entry.get("slice"):
            location, transpose = folded[location], not transpose
        if location not in matmuls:
            continue  # a norm gain, a bias, the embedding Gather's table
        columns = entry.get("slice") or [1, 0, matmuls[location][1]]
        if not transpose or columns[0] != 1:
            raise GGUFRecipeError(f"weight {name!r} is stored in MatMul weight {location!r} in a layout other than W^T")
        place(location, name, columns[1], columns[2])
    if head_b in matmuls and not placed[head_b]:
        place(head_b, "lm_head.weight", 0, matmuls[head_b][1])
    return {b: _checked_pieces(b, matmuls[b], b in float32, placed[b], tensors) for b in matmuls}


def _checked_pieces(b: str, shape: tuple[int, int], is_float32: bool, placed: dict, tensors: dict) -> list[Piece]:
    """`placed`'s pieces of B in column order, once they tile its columns with rows of one mappable GGUF type."""
    k, n = shape
    pieces = sorted(placed.values(), key=lambda piece: (piece.start, piece.stop))
    if not pieces:
        raise GGUFRecipeError(f"MatMul weight {b!r} holds no weight the GGUF import read")
    if [p.start for p in pieces] != [0] + [p.stop for p in pieces[:-1]] or pieces[-1].stop != n:
        raise GGUFRecipeError(f"MatMul weight {b!r}'s columns are not covered once each by the model's weights")
    kinds = set()
    for piece in pieces:
        tensor = tensors[piece.tensor]
        kind, rows = tensor.tensor_type.name, piece.rows or (0, tensor.shape[0])
        if kind not in GGUF_NBITS_TYPES + GGUF_FLOAT_TYPES:
            raise GGUFRecipeError(
                f"tensor {piece.tensor!r} is {kind}, which MatMulNBits cannot hold as it is "
                f"(taken as they are: {', '.join(GGUF_NBITS_TYPES)}; kept float: {', '.join(GGUF_FLOAT_TYPES)})"
            )
        if len(tensor.shape) != 2 or tensor.shape[1] != k or rows[1] - rows[0] != piece.stop - piece.start:
            raise GGUFRecipeError(
                f"tensor {piece.tensor!r} {tensor.shape} does not match MatMul weight {b!r} [{k}, {n}]"
            )
        kinds.add(kind)
    if kinds - set(GGUF_FLOAT_TYPES) and not is_float32:
        raise GGUFRecipeError(f"MatMul weight {b!r} is not float32; the GGUF recipe quantizes a float32 export")
    if kinds & set(GGUF_FLOAT_TYPES) and kinds - set(GGUF_FLOAT_TYPES):
        raise GGUFRecipeError(
            f"MatMul weight {b!r} fuses float and quantized GGUF tensors ({', '.join(sorted(kinds))})"
        )
    return pieces


def piece_kind(piece: Piece, tensors: dict) -> str:
    return tensors[piece.tensor].tensor_type.name


def piece_bytes(piece: Piece, tensors: dict) -> np.ndarray:
    """The GGUF bytes of a piece's rows ([rows, row bytes] uint8, a view of the file)."""
    data = tensors[piece.tensor].data
    return data if piece.rows is None else data[piece.rows[0] : piece.rows[1]]
