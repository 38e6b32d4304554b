"""ONNX function bodies for the custom-domain ops, one function per op.

The model emits single `onnx_toolkit::RMSNorm` / `onnx_toolkit::SwiGLU` nodes
during export; these FunctionProtos are attached afterwards so any runtime can
expand them (ONNX Runtime inlines them, the reference evaluator runs them).
"""

import onnx
import onnxscript
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
def SwiGLU(x, gate_proj, up_proj, down_proj):
    """torch: F.linear(F.silu(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj).

    Weights keep torch's [out_features, in_features] layout.
    """
    # silu(g) = g * sigmoid(g)
    gate = op.MatMul(x, op.Transpose(gate_proj, perm=[1, 0]))
    up = op.MatMul(x, op.Transpose(up_proj, perm=[1, 0]))
    hidden = op.Mul(op.Mul(gate, op.Sigmoid(gate)), up)
    return op.MatMul(hidden, op.Transpose(down_proj, perm=[1, 0]))


FUNCTIONS = {"RMSNorm": RMSNorm, "SwiGLU": SwiGLU}


def function_protos(used_ops: set[str]) -> list[onnx.FunctionProto]:
    """FunctionProtos for the custom ops a graph uses, in a stable order."""
    return [FUNCTIONS[name].to_function_proto() for name in sorted(used_ops) if name in FUNCTIONS]
