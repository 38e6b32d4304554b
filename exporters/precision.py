"""Reduced-precision exports: rewrite a traced float32 graph to float16 or bfloat16.

The model is always traced in float32; this module then decides, tensor by
tensor, which float32 values become the export dtype and which stay float32:

- parameters (the model's weights) and float graph inputs/outputs are the
  export dtype; so is everything computed from them;
- values that derive from no activation and no parameter (positions cast to
  float, the RoPE inverse frequencies, their cos/sin) stay float32 until they
  meet an activation, where one Cast brings them down: RoPE angles of a long
  context do not survive float16 (its spacing at 2048 is 2.0);
- float32 islands: Softmax, LayerNormalization and reductions take their inputs
  cast up to float32 and cast their outputs back, so exp/sum and mean/variance
  never overflow or lose the small terms (the RMSNorm function body does the
  same inside itself, see exporters.functions.RMSNORM_FLOAT32);
- constants the graph holds (masks' -inf, scales, buffers) follow the dtype of
  the nodes that use them, converted once, statically.

Tensors of other types (integers, bool, float64) are never touched.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from artifact import weightless
from artifact.errors import ExportError
from exporters.functions import reduced_precision_function_protos
from models.ops import CUSTOM_DOMAIN

DTYPES = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
REDUCED = ("float16", "bfloat16")
# Ops that run in float32 whatever the export dtype: their accumulations (exp-sum, mean, variance) are
# where float16 overflows (x^2 > 65504 for |x| > 256) or drops the small terms.
FLOAT32_ISLANDS = frozenset(
    {
        "Softmax",
        "LogSoftmax",
        "LayerNormalization",
        "RMSNormalization",
        "GroupNormalization",
        "ReduceMean",
        "ReduceSum",
        "ReduceSumSquare",
        "ReduceL2",
        "ReduceLogSumExp",
    }
)
_SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan"})


def check_dtype(dtype: str) -> None:
    """Refuse a dtype this module does not export."""
    if dtype not in DTYPES:
        raise ExportError(f"unknown export dtype {dtype!r}; choose one of {', '.join(DTYPES)}")


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of an export dtype (bfloat16 comes from ml_dtypes, which onnx depends on)."""
    check_dtype(dtype)
    return np.dtype(helper.tensor_dtype_to_np_dtype(DTYPES[dtype]))


def input_specs(specs: list[dict], dtype: str) -> list[dict]:
    """Manifest input specs with float32 inputs declared in the export dtype."""
    return [dict(s, dtype=dtype) if s["dtype"] == "float32" else dict(s) for s in specs]


def convert_array(array: np.ndarray, dtype: str, where: str) -> np.ndarray:
    """float32 -> dtype, refusing values the dtype cannot hold (they would silently become inf)."""
    return convert_numpy(array, numpy_dtype(dtype), where)


def convert_numpy(array: np.ndarray, target: np.dtype, where: str) -> np.ndarray:
    """convert_array to a numpy dtype (float16, or ml_dtypes' bfloat16)."""
    dtype = "float16" if target == np.float16 else "bfloat16"
    import ml_dtypes  # numpy's finfo does not know bfloat16; ml_dtypes' covers every float type

    limit = float(ml_dtypes.finfo(target).max)
    peak = _largest_finite(array)
    if peak > limit:
        raise ExportError(
            f"{where}: holds values up to {peak:.4g}, beyond {dtype}'s largest finite value {limit:.6g}; "
            + (
                "export with --dtype bfloat16 (float32's range) or float32"
                if dtype == "float16"
                else "export with float32"
            )
        )
    return array.astype(target)


RANGE_CHUNK = 1 << 22  # elements per step of the range check, whose temporaries are the size of their input


def _largest_finite(array: np.ndarray) -> float:
    """max |x| over the finite elements (0 when there are none), a chunk at a time."""
    flat, peak = array.reshape(-1), 0.0
    for start in range(0, flat.size, RANGE_CHUNK):
        part = flat[start : start + RANGE_CHUNK]
        finite = part[np.isfinite(part)]
        if finite.size:
            peak = max(peak, float(np.max(np.abs(finite))))
    return peak


def to_dtype(
    proto: onnx.ModelProto, dtype: str, parameters: set[str], converted: frozenset[str] = frozenset()
) -> onnx.ModelProto:
    """Rewrite the float32 graph `proto` in place to `dtype` (see the module docstring); return it.

    parameters: names of the initializers that hold model parameters (the export dtype's sources
    together with the float graph inputs). Other float initializers follow their consumers.
    converted: parameter initializers already written in `dtype` (exporters.replicate.WeightFill); the
    rewrite treats them as the float32 parameters they stand for, without converting them again.
    """
    check_dtype(dtype)
    if dtype == "float32":
        return proto
    ready = [init for init in proto.graph.initializer if init.name in converted]
    if any(init.data_type != DTYPES[dtype] for init in ready):
        raise ExportError(f"initializer {ready[0].name!r} is not stored in {dtype} as its converted weights should be")
    for init in ready:  # typed as the float32 parameters they stand for while the rewrite reads the graph
        init.data_type = TensorProto.FLOAT
    rewrite = _Rewrite(proto, dtype)
    for init in ready:
        init.data_type = DTYPES[dtype]
        rewrite.kind[init.name] = "T"
    parameters = parameters - converted
    rewrite.mark_sources(parameters)
    for node in proto.graph.node:
        rewrite.add(node)
    rewrite.install_nodes()
    rewrite.declare_dtype()
    _use_reduced_precision_functions(proto)
    return proto


class _Rewrite:
    """One graph's rewrite to a reduced dtype: what each float32 value becomes, and the rewritten node list."""

    def __init__(self, proto: onnx.ModelProto, dtype: str):
        self.dtype, self.target, self.graph = dtype, DTYPES[dtype], proto.graph
        self.elem = _element_types(proto)  # value -> TensorProto element type, fresh names included
        self.initializers = {init.name: init for init in self.graph.initializer}
        for name, init in self.initializers.items():
            self.elem[name] = init.data_type
        # kind of each float32 tensor: "T" export dtype, "F" float32, "C" constant initializer (undecided)
        self.kind: dict[str, str] = {}
        self.constant_uses: dict[str, list] = {}  # constant initializer -> [(node, input index, "T" or "F")]
        self.cast_cache: dict[tuple[str, int], str] = {}
        self.nodes: list[onnx.NodeProto] = []

    def mark_sources(self, parameters: set[str]) -> None:
        """Mark float inputs and parameters as the export dtype (converting parameters), other float constants "C"."""
        for value in self.graph.input:
            if value.type.tensor_type.elem_type == TensorProto.FLOAT:
                self.kind[value.name] = "T"
        for name, init in self.initializers.items():
            if init.data_type == TensorProto.FLOAT:
                self.kind[name] = "T" if name in parameters else "C"
                if name in parameters:
                    converted = convert_array(numpy_helper.to_array(init), self.dtype, f"weight initializer {name!r}")
                    init.CopyFrom(numpy_helper.from_array(converted, name))

    def is_float(self, name: str) -> bool:
        """Whether `name` is a float32 tensor (an empty name is an omitted optional input)."""
        return bool(name) and self.elem.get(name) == TensorProto.FLOAT

    def add(self, original: onnx.NodeProto) -> None:
        """Append a copy of `original` to the node list, with the casts its float inputs and outputs need."""
        node = onnx.NodeProto()
        node.CopyFrom(original)  # the graph's node list is rebuilt from these copies
        if node.op_type in _SUBGRAPH_OPS:
            raise ExportError(
                f"--dtype {self.dtype}: node {node.name!r} ({node.op_type}) has subgraphs, which the "
                "precision rewrite does not handle; export with --dtype float32"
            )
        float_outputs = [o for o in node.output if self.is_float(o)]
        standard = node.domain in ("", "ai.onnx")
        if standard and node.op_type == "Cast":
            self._add_cast(node, float_outputs)
        elif standard and node.op_type == "CastLike":
            self._add_cast_like(node, float_outputs)
        elif standard and node.op_type in FLOAT32_ISLANDS:
            self._add_island(node)
        else:
            self._add_following_inputs(node, float_outputs)

    def _add_cast(self, node: onnx.NodeProto, float_outputs: list[str]) -> None:
        """Keep an explicit Cast as it is: a cast to float32 (positions) stays float32."""
        if float_outputs:
            self.kind[node.output[0]] = "F"
        self.nodes.append(node)

    def _add_cast_like(self, node: onnx.NodeProto, float_outputs: list[str]) -> None:
        """Keep a CastLike as it is: its float output has its target's kind (float32 for a constant target)."""
        if float_outputs:
            like = self.kind.get(node.input[1])
            self.kind[node.output[0]] = "F" if like in (None, "C") else like
        self.nodes.append(node)

    def _add_island(self, node: onnx.NodeProto) -> None:
        """Run `node` in float32: float inputs cast up, float outputs renamed and cast back to the export dtype."""
        self._bring(node, "F")
        renamed = []
        for i, out in enumerate(node.output):
            if self.is_float(out):
                inner = _fresh(f"{out}__float32", self.elem)
                self.elem[inner] = TensorProto.FLOAT
                node.output[i] = inner
                renamed.append((inner, out))
        self.nodes.append(node)
        for inner, out in renamed:
            self.nodes.append(helper.make_node("Cast", [inner], [out], to=self.target, name=f"{out}__cast"))
            self.kind[out] = "T"

    def _add_following_inputs(self, node: onnx.NodeProto, float_outputs: list[str]) -> None:
        """Run `node` in the export dtype if any float input is in it, else in float32; its float outputs follow."""
        inputs = [self.kind.get(n, "F") for n in node.input if self.is_float(n)]
        compute = "T" if "T" in inputs else "F"
        self._bring(node, compute)
        for out in float_outputs:
            self.kind[out] = compute
        self.nodes.append(node)

    def _bring(self, node: onnx.NodeProto, want: str) -> None:
        """Make every float input of `node` arrive as `want` ("T" or "F"); constants are noted, decided later."""
        for i, name in enumerate(node.input):
            if not self.is_float(name):
                continue
            have = self.kind.get(name, "F")
            if have == "C":
                self.constant_uses.setdefault(name, []).append((node, i, want))
            elif have != want:
                node.input[i] = self._cast(name, self.target if want == "T" else TensorProto.FLOAT)

    def _cast(self, name: str, to: int) -> str:
        """The name of `name` cast to element type `to`, appending the Cast the first time it is asked for."""
        key = (name, to)
        if key not in self.cast_cache:
            suffix = "float32" if to == TensorProto.FLOAT else self.dtype
            out = _fresh(f"{name}__{suffix}", self.elem)
            self.elem[out] = to
            self.nodes.append(helper.make_node("Cast", [name], [out], to=to, name=f"{out}__cast"))
            self.cast_cache[key] = out
        return self.cast_cache[key]

    def install_nodes(self) -> None:
        """Convert the constants their uses need, then replace the graph's nodes with the rewritten list."""
        # Settling rewires inputs of the listed nodes, so it runs before the graph copies them in.
        _settle_constants(self.graph, self.initializers, self.constant_uses, self.dtype)
        del self.graph.node[:]
        self.graph.node.extend(self.nodes)

    def declare_dtype(self) -> None:
        """Declare the float graph outputs and inputs in the export dtype, and drop the stale float32 value types."""
        _outputs_to_dtype(self.graph, self.kind, self.target, self.elem)
        for value in self.graph.input:
            if value.type.tensor_type.elem_type == TensorProto.FLOAT:
                value.type.tensor_type.elem_type = self.target
        del self.graph.value_info[:]  # stale float32 types; the export's shape inference fills them again


def _element_types(proto: onnx.ModelProto) -> dict[str, int]:
    """{value: TensorProto element type} for every value shape inference types in `proto`."""
    # Shape inference serialises the model it is given: the weightless copy, as protobuf refuses one past 2 GiB.
    typed = onnx.shape_inference.infer_shapes(weightless(proto))
    return {
        v.name: v.type.tensor_type.elem_type for v in [*typed.graph.value_info, *typed.graph.input, *typed.graph.output]
    }


def _use_reduced_precision_functions(proto: onnx.ModelProto) -> None:
    """Swap the custom functions' bodies for the ones that accumulate in float32 whatever the dtype."""
    custom = {f.name for f in proto.functions if f.domain == CUSTOM_DOMAIN}
    replacements = {f.name: f for f in reduced_precision_function_protos(custom)}
    for i, function in enumerate(proto.functions):
        if function.domain == CUSTOM_DOMAIN and function.name in replacements:
            proto.functions[i].CopyFrom(replacements[function.name])


def _settle_constants(graph, initializers, uses, dtype) -> None:
    """Convert constant initializers to what their consumers need: in place, or a copy when both are needed."""
    for name, places in uses.items():
        needs = {want for _, _, want in places}
        if "T" not in needs:
            continue  # float32 consumers only: stays float32
        converted = convert_array(numpy_helper.to_array(initializers[name]), dtype, f"initializer {name!r}")
        if needs == {"T"}:
            initializers[name].CopyFrom(numpy_helper.from_array(converted, name))
            continue
        copy = numpy_helper.from_array(converted, f"{name}__{dtype}")
        graph.initializer.append(copy)
        for node, index, want in places:
            if want == "T":
                node.input[index] = copy.name


def _outputs_to_dtype(graph, kind, target, elem) -> None:
    """Declare float graph outputs as `target`, casting a float32-computed one under its own name."""
    for value in graph.output:
        if value.type.tensor_type.elem_type != TensorProto.FLOAT:
            continue
        value.type.tensor_type.elem_type = target
        if kind.get(value.name) == "T":
            continue
        # A float32 result (derived from positions only): cast it under its own name.
        inner = _fresh(f"{value.name}__float32", elem)
        for node in graph.node:
            node.output[:] = [inner if o == value.name else o for o in node.output]
            node.input[:] = [inner if i == value.name else i for i in node.input]
        graph.node.append(helper.make_node("Cast", [inner], [value.name], to=target, name=f"{value.name}__cast"))


def _fresh(base: str, taken: dict) -> str:
    """`base`, or `base_N` with the smallest N that makes it a name not in `taken`."""
    name, n = base, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    return name


def check_supported(dtype: str, lowering: str) -> None:
    """Refuse dtype/lowering combinations this rewrite does not cover, before the slow trace."""
    check_dtype(dtype)
    if dtype != "float32" and lowering != "functions":
        raise ExportError(
            f"--dtype {dtype} with --lowering {lowering} is not supported yet: the float32 islands are built "
            "for the custom-function graph; export with --lowering functions, or with --dtype float32"
        )


def apply(model, protos: dict, entries: list[dict], dtype: str, converted: frozenset[str] = frozenset()) -> None:
    """Rewrite every exported graph to `dtype` and declare it in the manifest entries (in place).

    Runs after the weight map was recorded on the float32 graphs, so the map still names the
    initializer of every weight; the eager reference is rebuilt from the rounded values it holds.
    converted: initializers written in `dtype` already (to_dtype).
    """
    check_dtype(dtype)
    if dtype == "float32":
        return
    parameter_names = {name for name, _ in model.named_parameters()}
    for entry in entries:
        parameters = {place["initializer"] for name, place in entry["weights"].items() if name in parameter_names}
        to_dtype(protos[entry["name"]], dtype, parameters, converted)
        entry["inputs"] = input_specs(entry["inputs"], dtype)
        entry["outputs"] = input_specs(entry["outputs"], dtype)
