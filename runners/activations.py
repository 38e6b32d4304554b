"""What ONNX Runtime's CPU MatMulNBits computes at accuracy level 4: the product of int8-rounded activations.

At `accuracy_level` 4 the CPU kernel (MLAS SQNBitGemm, compute type CompInt8) rounds each row of A to int8 per
K-block of the weight's `block_size` before its integer dot products, in float32:

    amax = max |a| over the block,  scale = amax / 127,  q = round_half_even(a * (127 / amax)),

q = 0 where amax = 0, the padding past K left out; the result is (q * scale) @ dequantize(B), up to the float
order of the sums (onnxruntime/core/mlas/lib/sqnbitgemm_kernel_avx512.cpp, QuantizeARow_CompInt8_avx512).
The eager models and the reference MatMulNBits compute with the same rounded activations where ONNX Runtime
does, so `toolkit check` holds a level-4 artifact to float tolerances around what the kernel computes, not
to the rounding's own error. Which layouts take that path depends on the build and the CPU, so it is asked of
the installed ONNX Runtime once per layout (`kernel_rounds`); one with float zero points (HQQ) has none and is
computed on float activations at every level, here as there. A GPU kernel ignores the level (float activations),
so a level-4 artifact is only comparable this way on the CPU.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from exporters.quantize import INT8_ACTIVATIONS_LEVEL

_INT8_MAX = 127.0
# A float32 backend's activations differ from the float64 oracle's in their last bits, so a value within this
# relative distance of a half step may round either way in the backend: 2^-16 is 128 float32 ulps, far beyond
# the few ulps a float32 pass drifts, yet it holds under a thousandth of the values.
AMBIGUITY = 2.0**-16
_AWAY: ContextVar[bool] = ContextVar("round_ambiguous_away", default=False)


@contextmanager
def rounding_ambiguous_away():
    """Inside it, Int8Activations rounds every ambiguous value (within AMBIGUITY of a half step) the other way:
    the oracle run that measures how far a backend may land by rounding those values otherwise."""
    token = _AWAY.set(True)
    try:
        yield
    finally:
        _AWAY.reset(token)


def rounds_activations(accuracy_level: int | None, zero_points_dtype, bits: int = 4, block_size: int = 32) -> bool:
    """Whether ONNX Runtime's CPU MatMulNBits with this level and layout (zero-point dtype, None: none) rounds A
    to int8: from level 4, where this machine's kernels have an int8 path for the layout (`kernel_rounds`)."""
    if (accuracy_level or 0) < INT8_ACTIVATIONS_LEVEL:
        return False
    kind = "none" if zero_points_dtype is None else "float" if np.dtype(zero_points_dtype).kind == "f" else "uint8"
    return kernel_rounds(bits, block_size, kind)


@functools.cache
def kernel_rounds(bits: int, block_size: int, zero_points: str) -> bool:
    """Whether this machine's ONNX Runtime CPU MatMulNBits at level 4 multiplies int8-rounded activations for
    `bits`, `block_size` and zero points "none", "uint8" or "float", found by running one.

    The int8 path depends on the build and the CPU's instruction sets (no layout with float zero points has
    one), so it is asked, not assumed. One row of A is chosen so that rounding it moves the product by far
    more than float32 does: a block's maximum 1 and the rest a third of a step, which int8 rounds to 0."""
    import onnxruntime
    from onnx import TensorProto, helper, numpy_helper

    from exporters.quantize import dequantize_nbits

    k, n = 2 * block_size, 4
    blocks = k // block_size
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, size=(n, blocks, block_size * bits // 8), dtype=np.uint8)
    scales = np.full(n * blocks, 0.01, dtype=np.float32)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales")]
    zero = None
    if zero_points == "uint8":
        zero = np.full(n * -(-blocks * bits // 8), 0x88 if bits == 4 else 0x80, dtype=np.uint8)
    elif zero_points == "float":
        zero = np.full(n * blocks, 2.0 ** (bits - 1), dtype=np.float32)
    if zero is not None:
        inits.append(numpy_helper.from_array(zero, "zero_points"))
    inputs = ["A", "B", "scales"] + (["zero_points"] if zero is not None else [])
    node = helper.make_node(
        "MatMulNBits",
        inputs,
        ["Y"],
        domain="com.microsoft",
        K=k,
        N=n,
        bits=bits,
        block_size=block_size,
        accuracy_level=INT8_ACTIVATIONS_LEVEL,
    )
    graph = helper.make_graph(
        [node],
        "probe",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, k])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, n])],
        inits,
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=10)
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # a refused layout is an answer here, not an error to print
    options.intra_op_num_threads = 1
    try:
        session = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except onnxruntime.capi.onnxruntime_pybind11_state.Fail:  # a layout the CPU kernel refuses (8 bits, float zero)
        return False
    a = np.full((1, k), 1.0 / (3 * _INT8_MAX), dtype=np.float32)
    a[0, ::block_size] = 1.0
    got = session.run(None, {"A": a})[0].astype(np.float64)
    weight = dequantize_nbits(packed, scales, zero, bits=bits, block_size=block_size, k=k, n=n).astype(np.float64)
    rounded = int8_activations(torch.from_numpy(a.astype(np.float64)), block_size).numpy() @ weight
    return bool(np.abs(got - rounded).max() < np.abs(got - a.astype(np.float64) @ weight).max())


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [..., K] zero-padded to whole blocks: [..., blocks, block_size]."""
    pad = -x.shape[-1] % block_size
    return F.pad(x, (0, pad)).unflatten(-1, (-1, block_size))


def int8_activations(x: torch.Tensor, block_size: int, away: bool = False) -> torch.Tensor:
    """x [..., K] as the level-4 kernel multiplies it: rounded to int8 per K-block in float32, then scaled back,
    in x's dtype (the float64 oracle keeps the scaled values exact). away: the values within AMBIGUITY of a
    half step round to the other neighbour."""
    k = x.shape[-1]
    blocks = _blocks(x.to(torch.float32), block_size)  # (..., blocks, block_size)
    amax = blocks.abs().amax(-1, keepdim=True)
    # 127 / amax in one float32 division, as the kernel does: 1 / (amax / 127) can differ by an ulp and flip
    # a value that lies on a half step
    # (torch computes a Python number over a tensor as a reciprocal times the number: two roundings)
    nonzero = amax.clamp_min(torch.finfo(torch.float32).tiny)
    inverse = torch.where(amax != 0, torch.full_like(amax, _INT8_MAX) / nonzero, 0.0)
    scaled = blocks * inverse  # float32 product
    q = torch.round(scaled)  # half to even
    if away:
        low = torch.floor(scaled)
        ambiguous = (scaled - (low + 0.5)).abs() <= AMBIGUITY * scaled.abs()
        q = torch.where(ambiguous, torch.where(q == low, low + 1, low), q)
    scale = amax / torch.full_like(amax, _INT8_MAX)
    return (q.to(x.dtype) * scale.to(x.dtype)).flatten(-2)[..., :k]


def block_sums(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [..., K] summed per K-block: [..., blocks]."""
    return _blocks(x, block_size).sum(-1)


@dataclass(frozen=True)
class RoundedWeight:
    """A weight [N, K] whose MatMulNBits rounds its activations: its block size, and its per-block offsets
    [blocks, N] (a float-minimum layout) where it has them, which ONNX Runtime applies to the float
    activations in a MatMul of its own."""

    block_size: int
    offsets: torch.Tensor | None = None


class Int8Activations(torch.overrides.TorchFunctionMode):
    """Inside it, F.linear by one of `weights` (id -> RoundedWeight) computes on int8-rounded activations.

    linear(x, W) with W = W_nbits + offsets (repeated over each block's rows) becomes
    linear(x', W) + block_sums(x - x') @ offsets, which is x' @ W_nbits + block_sums(x) @ offsets: the
    MatMulNBits on the rounded activations and the offsets MatMul on the float ones, as the graph computes.
    """

    def __init__(self, weights: dict[int, RoundedWeight]):
        super().__init__()
        self.weights = weights

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs.get("weight")
            rounded = self.weights.get(id(weight))
            if rounded is not None:
                x_int8 = int8_activations(x, rounded.block_size, away=_AWAY.get())
                y = func(x_int8, *args[1:], **kwargs)
                if rounded.offsets is not None:
                    residual = block_sums(x - x_int8, rounded.block_size)  # (..., blocks)
                    y = y + residual @ rounded.offsets.to(device=y.device, dtype=y.dtype)
                return y
        return func(*args, **kwargs)
