"""ONNX Runtime's com.microsoft operators that an artifact of this toolkit may hold, for onnx.reference.

The reference evaluator knows only the standard domains. A weight-only quantized artifact holds
MatMulNBits, so without this the `onnx-reference` backend and node localisation (which re-evaluates
nodes on onnx.reference) could not open it. The implementation follows the operator's published
contract (onnxruntime docs/ContribOperators.md): Y = A @ dequantize(B) + bias, with the weight
dequantized per K-block and the product taken in float64 or the activations' own width, whichever is
wider, so it is the exact value a kernel's rounding is judged against. From accuracy level 4 the activations
are first rounded to int8 per block as ONNX Runtime's CPU kernel rounds them (runners.activations).

One standard operator is here too: Gelu, which the evaluator cannot expand inside a local function (the GeGLU
body). `Evaluator` is the reference evaluator with these operators, in the model's functions as well.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from exporters.quantize import dequantize_nbits
from runners.activations import int8_activations, rounds_activations


class MatMulNBits(OpRun):
    op_domain = "com.microsoft"

    def _run(self, a, b, scales, zero_points=None, g_idx=None, bias=None, **attributes):
        # onnx.reference passes each of the node's attributes as a keyword argument of its name
        k, n, bits, block_size = (attributes.get(name) for name in ("K", "N", "bits", "block_size"))
        if g_idx is not None and g_idx.size:
            # act-order (GPTQ) column permutations: no artifact of this toolkit writes them
            raise NotImplementedError("MatMulNBits with g_idx is not supported by the reference implementation")
        if a.shape[-1] != k:
            raise ValueError(f"MatMulNBits: A's last dimension is {a.shape[-1]}, K is {k}")
        dtype = a.dtype
        zero_points = zero_points if zero_points is not None and zero_points.size else None
        zero_dtype = None if zero_points is None else zero_points.dtype
        if rounds_activations(attributes.get("accuracy_level"), zero_dtype, bits, block_size):
            # float64 holds the rounded values times their scales exactly; the output keeps A's dtype
            a = int8_activations(torch.from_numpy(a.astype(np.float64)), block_size).numpy()
        weight = dequantize_nbits(
            b,
            scales,
            zero_points,
            bits=bits,
            block_size=block_size,
            k=k,
            n=n,
        )
        wide = np.promote_types(a.dtype, weight.dtype)
        y = a.astype(wide) @ weight.astype(wide)
        if bias is not None and bias.size:
            y = y + bias.astype(wide)
        return (y.astype(dtype),)


class Gelu(OpRun):
    """ONNX Gelu (opset 20): onnx.reference expands it from its context-dependent function body, which needs the
    input's type from shape inference and so fails inside a local function (the GeGLU body). Computed here in
    float64 from the operator's definition and returned in the input's dtype."""

    op_domain = ""

    def _run(self, x, approximate="none"):
        z = x.astype(np.float64)
        if approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
            y = 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))
        elif approximate == "none":  # x Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
            y = 0.5 * z * (1.0 + torch.special.erf(torch.from_numpy(z / np.sqrt(2.0))).numpy())
        else:
            raise ValueError(f"Gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
        return (y.astype(x.dtype),)


# The operators the evaluator is given: com.microsoft's, and the standard ones it cannot run everywhere an
# artifact holds them.
CONTRIB_OPS = [MatMulNBits, Gelu]


class Evaluator(ReferenceEvaluator):
    """onnx.reference.ReferenceEvaluator with CONTRIB_OPS, in the model's local functions too: the evaluator builds
    each function's own evaluator as `self.__class__(function, ...)`, without the new_ops it was given."""

    def __init__(self, proto, *args, new_ops=None, **kwargs):
        super().__init__(proto, *args, new_ops=CONTRIB_OPS if new_ops is None else new_ops, **kwargs)
