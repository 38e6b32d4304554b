"""ONNX function bodies for the custom-domain ops, one function per op.

The model emits single `onnx_toolkit::RMSNorm` / `onnx_toolkit::SwiGLU` / `onnx_toolkit::GeGLU` nodes
during export; these FunctionProtos are attached afterwards so any runtime can
expand them (ONNX Runtime inlines them, the reference evaluator runs them).
"""

import onnx
import onnxscript
from onnxscript import FLOAT
from onnxscript import opset20 as op

from models.ops import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION

OPSET = 20  # the default-domain opset of every exported model and of these bodies
custom = onnxscript.values.Opset(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION)


@onnxscript.script(custom, default_opset=op)
def RMSNorm(x, weight, epsilon: float):
    """torch: x / sqrt(mean(x ** 2, dim=-1, keepdim=True) + epsilon) * weight."""
    # y = x / sqrt(mean(x^2) + eps) * weight
    eps = op.CastLike(op.Constant(value_float=epsilon), x)
    mean_square = op.ReduceMean(op.Mul(x, x), op.Constant(value_ints=[-1]), keepdims=1)
    return op.Mul(op.Div(x, op.Sqrt(op.Add(mean_square, eps))), weight)


@onnxscript.script(custom, default_opset=op)
def RMSNormFloat32(x, weight, epsilon: float):
    """torch: (x.float() / sqrt(mean(x.float() ** 2, dim=-1, keepdim=True) + epsilon) * weight.float()).to(x.dtype).

    The body reduced-precision exports (float16, bfloat16) attach as `RMSNorm`: the statistics are
    accumulated in float32, where x^2 does not overflow (float16 does for |x| > 256) and the mean keeps
    its small terms; only the result is cast back to the input's dtype.
    """
    # y = cast_like(x32 / sqrt(mean(x32^2) + eps) * weight32, x)
    x32 = op.Cast(x, to=FLOAT.dtype)
    eps = op.Constant(value_float=epsilon)
    mean_square = op.ReduceMean(op.Mul(x32, x32), op.Constant(value_ints=[-1]), keepdims=1)
    y32 = op.Mul(op.Div(x32, op.Sqrt(op.Add(mean_square, eps))), op.Cast(weight, to=FLOAT.dtype))
    return op.CastLike(y32, x)


@onnxscript.script(custom, default_opset=op)
def SwiGLU(x, gate_proj, up_proj, down_proj):
    """torch: F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj).

    Weights keep torch's [out_features, in_features] layout.
    """
    # silu(g) = g * sigmoid(g)
    gate = op.MatMul(x, op.Transpose(gate_proj, perm=[1, 0]))
    up = op.MatMul(x, op.Transpose(up_proj, perm=[1, 0]))
    hidden = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
    return op.MatMul(hidden, op.Transpose(down_proj, perm=[1, 0]))


@onnxscript.script(custom, default_opset=op)
def GeGLU(x, gate_proj, up_proj, down_proj, approximate: str):
    """torch: F.linear(F.gelu(F.linear(x, gate_proj), approximate=approximate) * F.linear(x, up_proj), down_proj).

    Weights keep torch's [out_features, in_features] layout, as SwiGLU's do. approximate: "tanh" (Gemma's
    gelu_pytorch_tanh) or "none" (the erf GELU), ONNX Gelu's attribute.
    """
    gate = op.MatMul(x, op.Transpose(gate_proj, perm=[1, 0]))
    up = op.MatMul(x, op.Transpose(up_proj, perm=[1, 0]))
    hidden = op.Mul(op.Gelu(gate, approximate=approximate), up)
    return op.MatMul(hidden, op.Transpose(down_proj, perm=[1, 0]))


FUNCTIONS = {"RMSNorm": RMSNorm, "SwiGLU": SwiGLU, "GeGLU": GeGLU}
# Bodies that replace FUNCTIONS' in float16/bfloat16 exports (same op name and signature).
REDUCED_PRECISION_FUNCTIONS = {"RMSNorm": RMSNormFloat32}


def function_protos(used_ops: set[str]) -> list[onnx.FunctionProto]:
    """FunctionProtos for the custom ops a graph uses, in a stable order."""
    return [FUNCTIONS[name].to_function_proto() for name in sorted(used_ops) if name in FUNCTIONS]


def reduced_precision_function_protos(used_ops: set[str]) -> list[onnx.FunctionProto]:
    """The float32-accumulating bodies for the custom ops a reduced-precision graph uses, named as the op."""
    protos = []
    for name in sorted(used_ops):
        if name in REDUCED_PRECISION_FUNCTIONS:
            proto = REDUCED_PRECISION_FUNCTIONS[name].to_function_proto()
            proto.name = name
            protos.append(proto)
    return protos
