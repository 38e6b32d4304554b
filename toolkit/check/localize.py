"""Divergence localisation: which ONNX node broke, not just which stage.

When a stage fails for a backend, the graph is inlined (the custom-domain
functions' bodies become ordinary nodes, so a fault inside RMSNorm is visible),
every intermediate value in the failing stage's cone is made a graph output,
and two independent questions are asked node by node, in topological order:

1. Does the *backend* compute this node correctly? The node is re-evaluated in
   float64 by onnx.reference on the backend's *own* float32 inputs, and the
   difference is held to the node's own float32 rounding bound. Re-evaluating
   on the backend's inputs (rather than comparing accumulated values) isolates
   each node's local error from error propagated from upstream, so an op whose
   kernel is wrong is named even when a later op amplifies the damage (softmax,
   cancellation). This answers runtime faults (a provider kernel, reduced
   precision).
2. Does the *graph* compute what PyTorch computes? The same graph converted to
   float64 (initializers, inputs, Cast targets, constants) runs on
   onnx.reference, and each node's value is matched against the tensors the
   eager float64 model materialises (captured op by op with a TorchDispatchMode).
   The same graph in float64 cannot be its own oracle for an export fault (an
   Add turned into a Sub is a Sub in float64 too), and the exporter's value
   names are not the FX node names (it renumbers them), so values are matched
   by content: a node is wrong when its value matches no eager tensor of the
   same shape *and* nothing downstream of it in the failing stage matches
   either (a value eager never materialises, like the Sigmoid inside silu, is
   vindicated by a matching consumer). This answers export faults.

Per-node tolerances are derived from float32 rounding, see `node_scale`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import onnx
import onnx.inliner
from onnx import TensorProto, helper, numpy_helper

from artifact import GraphArtifact, load_onnx
from artifact.errors import BackendUnavailableError, ComparisonError
from exporters.quantize import dequantize_nbits
from models.artifacts import artifact_config
from runners.contrib_ops import CONTRIB_OPS, Evaluator

EPS32 = float(np.finfo(np.float32).eps)  # 2^-23: one float32 ulp at 1.0, twice the unit roundoff

# Ops that only move or select values: a correct backend reproduces its inputs' bits exactly.
EXACT_OPS = {
    "Identity",
    "Reshape",
    "Transpose",
    "Slice",
    "Concat",
    "Gather",
    "GatherElements",
    "Unsqueeze",
    "Squeeze",
    "Expand",
    "Where",
    "Split",
    "Tile",
    "Flatten",
    "Pad",
    "ReduceMax",
    "ReduceMin",
    "Max",
    "Min",
    "Relu",
    "Neg",
    "Abs",
    "Trilu",
    "ScatterND",
    "DepthToSpace",
    "SpaceToDepth",
}
# IEEE correctly rounded: one rounding of the result, at most half an ulp.
ROUNDED_OPS = {"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Cast", "CastLike"}
# Library approximations (MLAS, CUDA math) are accurate to a few ulps; 8 ulps covers them with room.
TRANSCENDENTAL_ULPS = 8
CONTRACTING_OPS = {
    "MatMul",
    "Gemm",
    "ReduceSum",
    "ReduceMean",
    "Softmax",
    "LogSoftmax",
    "LayerNormalization",
    "ReduceL2",
    "ReduceSumSquare",
}
SHAPE_ONLY_OPS = {"Shape", "Size"}


@dataclass
class NodeFinding:
    """The first node whose output leaves tolerance, and why it is blamed."""

    cause: str  # "backend" (its kernel is wrong on its own inputs) or "graph" (the graph is not the model)
    index: int  # position in the inlined graph's topological order
    op_type: str
    name: str
    inputs: list[str]
    outputs: list[str]
    function: str | None  # "onnx_toolkit::RMSNorm call node__symbolic" when the node came from a function body
    max_abs: float
    allowed: float
    detail: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)

    def describe(self) -> str:
        where = f" (inside {self.function})" if self.function else ""
        return (
            f"node #{self.index} {self.op_type} {self.name!r}{where}, inputs {self.inputs} -> {self.outputs}: "
            f"{self.detail}"
        )


@dataclass
class Localization:
    backend: str
    stage: str
    graph: str
    finding: NodeFinding | None
    nodes_checked: int
    note: str = ""
    suspects: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "stage": self.stage,
            "graph": self.graph,
            "nodes_checked": self.nodes_checked,
            "finding": None if self.finding is None else self.finding.to_dict(),
            "note": self.note,
        }

    def describe(self) -> str:
        head = (
            f"localize {self.backend} at stage {self.stage} ({self.graph} graph, {self.nodes_checked} nodes checked): "
        )
        if self.finding is None:
            return head + (self.note or "no node leaves tolerance")
        blame = (
            "the backend computes it wrongly on its own inputs"
            if self.finding.cause == "backend"
            else "the graph differs from the PyTorch model here (an export fault)"
        )
        return head + f"first divergent {self.finding.describe()}; {blame}"


# --------------------------------------------------------------------------- graph preparation


def inline_with_origins(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str | None]]:
    """Inline the model's local functions; for each inlined node, the call it came from (None if original)."""
    inlined = onnx.inliner.inline_local_functions(model)
    functions = {(f.domain, f.name) for f in model.functions}
    calls = iter([n for n in model.graph.node if (n.domain, n.op_type) in functions])
    survivors = {n.name for n in model.graph.node if (n.domain, n.op_type) not in functions}
    origins: list[str | None] = []
    call, pending = None, set()
    for node in inlined.graph.node:
        if call is None and node.name in survivors:
            origins.append(None)
            continue
        # A call's body replaces it in place: the run of new nodes up to the one producing all of the
        # call's outputs belongs to the next call in the original order.
        if call is None:
            call = next(calls)
            pending = set(call.output)
        origins.append(f"{call.domain}::{call.op_type} call {call.name}")
        pending -= set(node.output)
        if not pending:
            call = None
    return inlined, origins


def _float_input_names(graph) -> set[str]:
    return {i.name for i in graph.input if i.type.tensor_type.elem_type == TensorProto.FLOAT}


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same (inlined) graph computing in float64: initializers, inputs, constants and Cast targets."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    for init in graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for value in list(graph.input) + list(graph.output):
        if value.type.tensor_type.elem_type == TensorProto.FLOAT:
            value.type.tensor_type.elem_type = TensorProto.DOUBLE
    del graph.value_info[:]
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float64), attr.t.name))
        if node.op_type == "Constant":
            for attr in node.attribute:
                # A float attribute has no dtype of its own; make it a float64 tensor.
                if attr.name in ("value_float", "value_floats"):
                    value = attr.f if attr.name == "value_float" else list(attr.floats)
                    node.ClearField("attribute")
                    tensor = numpy_helper.from_array(np.array(value, np.float64))
                    node.attribute.append(helper.make_attribute("value", tensor))
                    break
    return model


def with_all_outputs(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy whose graph outputs are `names` (typed by shape inference) so every value can be read back."""
    inferred = onnx.shape_inference.infer_shapes(model)
    graph = inferred.graph
    types = {v.name: v for v in list(graph.value_info) + list(graph.output) + list(graph.input)}
    model = onnx.ModelProto.FromString(model.SerializeToString())
    del model.graph.output[:]
    for name in names:
        if name in types:
            model.graph.output.append(types[name])
        else:
            model.graph.output.append(helper.make_empty_tensor_value_info(name))
    return model


# --------------------------------------------------------------------------- tolerances


def node_scale(op_type: str, inputs: list, output: np.ndarray, attributes: dict | None = None) -> tuple[float, int]:
    """(magnitude, rounding steps) of a node: its float32 error bound is steps * EPS32 * magnitude.

    Elementwise correctly rounded ops: one rounding of the result, steps 1, magnitude max|out|
    (EPS32 is twice the unit roundoff u, a 2x margin). Transcendentals: library accuracy of a few ulps.
    Contractions over K terms: Higham's bound |fl(sum) - sum| <= gamma_K sum|a_i b_i|, gamma_K ~ K u, so
    steps K + 1 and magnitude max(|A| @ |B|) for a MatMul, K * max|x| for a sum, max|x| for a mean;
    a softmax adds the exp's few ulps and the division. MatMulNBits (`attributes` gives its layout) is a
    MatMul by its dequantized weight. Data movement: 0, any difference is a fault.
    """
    out_max = _finite_max(output)
    floats = [
        np.asarray(x, dtype=np.float64)
        for x in inputs
        if x is not None and np.issubdtype(np.asarray(x).dtype, np.floating)
    ]
    if op_type in EXACT_OPS:
        return out_max, 0
    if op_type in ROUNDED_OPS:
        return out_max, 1
    if op_type == "MatMul" and len(floats) >= 2:
        a, b = np.abs(floats[0]), np.abs(floats[1])
        return (float(np.max(np.matmul(a, b))) if a.size and b.size else 0.0), a.shape[-1] + 1
    if op_type == "MatMulNBits" and attributes and len(inputs) >= 3 and inputs[0] is not None:
        zero_points = inputs[3] if len(inputs) > 3 and inputs[3] is not None and np.size(inputs[3]) else None
        weight = dequantize_nbits(
            np.asarray(inputs[1]),
            np.asarray(inputs[2]),
            None if zero_points is None else np.asarray(zero_points),
            bits=attributes["bits"],
            block_size=attributes["block_size"],
            k=attributes["K"],
            n=attributes["N"],
        )
        a = np.abs(np.asarray(inputs[0], dtype=np.float64))
        return (float(np.max(a @ np.abs(weight))) if a.size else 0.0), attributes["K"] + 1
    if op_type in CONTRACTING_OPS and floats:
        x = floats[0]
        k = max(int(x.size // max(np.size(output), 1)), 1) if op_type.startswith("Reduce") else x.shape[-1]
        if op_type in ("Softmax", "LogSoftmax"):
            return max(out_max, 1.0), k + TRANSCENDENTAL_ULPS + 1
        if op_type in ("ReduceMean", "LayerNormalization"):
            return max(out_max, _finite_max(x)), k + TRANSCENDENTAL_ULPS
        return max(out_max, k * _finite_max(x)), k + 1
    # Transcendentals and anything unlisted: a few ulps of the larger of output and inputs.
    return max([out_max] + [_finite_max(x) for x in floats]), TRANSCENDENTAL_ULPS


def attributes_of(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _finite_max(array) -> float:
    values = np.abs(np.asarray(array, dtype=np.float64))
    values = values[np.isfinite(values)]
    return float(values.max()) if values.size else 0.0


def differ(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want|, with equal infinities counted as equal and a NaN/inf mismatch as infinite."""
    got = np.asarray(got, dtype=np.float64)
    want = np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    same = (got == want) | (np.isnan(got) & np.isnan(want))
    with np.errstate(invalid="ignore"):  # inf - inf where one side is finite is a real mismatch, kept as inf
        diff = np.where(same, 0.0, np.abs(got - want))
    diff = np.where(np.isnan(diff), np.inf, diff)
    return float(diff.max()) if diff.size else 0.0


# --------------------------------------------------------------------------- backends


def run_backend_all(backend: str, model: onnx.ModelProto, feed: dict) -> dict[str, np.ndarray]:
    """Run the float32 inlined graph (every value an output) on `backend`."""
    names = [o.name for o in model.graph.output]
    if backend == "onnx-reference":
        return dict(zip(names, Evaluator(model).run(None, feed), strict=True))
    if backend.startswith("ort-"):
        import onnxruntime

        from runners.ort import PROVIDERS

        provider = PROVIDERS[backend]
        session = onnxruntime.InferenceSession(model.SerializeToString(), providers=[provider])
        return dict(zip(names, session.run(names, feed), strict=True))
    raise BackendUnavailableError(
        f"--localize: backend {backend!r} does not run the ONNX graph, so it has no ONNX nodes to localise; "
        "localise an ONNX backend (ort-cpu, onnx-reference, ort-cuda)"
    )


def evaluate_node64(node: onnx.NodeProto, opsets: dict[str, int], inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    """One node in float64 on the given input values (float32 inputs widened exactly)."""

    node64 = onnx.NodeProto.FromString(node.SerializeToString())
    for attr in node64.attribute:
        if node64.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
            attr.i = TensorProto.DOUBLE
    return Evaluator(node64, opsets=opsets).run(None, widened(inputs))


def widened(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """float32 arrays widened to float64 (exactly); every other array as it is."""
    return {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in values.items()}


# --------------------------------------------------------------------------- eager capture


def eager_tensors(artifact, graph_name: str, feed: dict) -> list[np.ndarray]:
    """Every floating tensor the float64 eager model materialises while computing `graph_name` on `feed`."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from models.registry import get_family
    from runners.eager import model_from_artifact

    model = model_from_artifact(artifact).to(torch.float64).eval()
    spec = {g.name: g for g in get_family(artifact.family).graphs(artifact_config(artifact))}[graph_name]
    run = spec.variant(artifact.variant)[2]
    graph = artifact.graph(graph_name)
    args = []
    for s in graph.input_specs:
        tensor = torch.from_numpy(np.asarray(feed[s.name]))
        args.append(tensor.to(torch.float64) if tensor.is_floating_point() else tensor)
    captured: list[np.ndarray] = [np.asarray(a.numpy(), dtype=np.float64) for a in args if a.is_floating_point()]

    class Capture(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for value in result if isinstance(result, (tuple, list)) else (result,):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel():
                    captured.append(value.detach().to(torch.float64).numpy().copy())
            return result

    with torch.no_grad(), Capture():
        stages = run(model, *args)
    captured.extend(np.asarray(v.detach().numpy(), dtype=np.float64) for v in stages.values())
    return captured


def _key(array: np.ndarray) -> tuple:
    return tuple(d for d in np.shape(array) if d != 1)


# --------------------------------------------------------------------------- the failing stage's cone


@dataclass
class StageCone:
    """The failing stage's computation in the inlined graph: the nodes both questions walk, and their values'
    sources besides the nodes themselves (initializers and the graph's feed)."""

    graph: GraphArtifact  # the artifact's graph that outputs the stage
    model: onnx.ModelProto  # that graph with its functions inlined
    nodes: list[onnx.NodeProto]  # every node of `model`, in its (topological) order
    origins: list[str | None]  # per node, the function call it was inlined from
    order: list[int]  # the indices of the nodes the stage depends on, in topological order
    data: set[str]  # the values that depend on the data; only these are judged
    feed: dict[str, np.ndarray]
    initializers: dict[str, np.ndarray]

    @property
    def value_names(self) -> list[str]:
        return [out for i in self.order for out in self.nodes[i].output if out]

    @property
    def opsets(self) -> dict[str, int]:
        return {o.domain: o.version for o in self.model.opset_import}

    def value(self, name: str, values: dict):
        """A value as a node reads it: computed (`values`), else an initializer, else a graph input."""
        if name in values:
            return values[name]
        if name in self.initializers:
            return self.initializers[name]
        return self.feed.get(name)

    def judged_outputs(self, node: onnx.NodeProto, values: dict) -> list[str]:
        """The node's outputs that depend on the data and hold floats in `values`."""
        return [o for o in node.output if o in self.data and np.issubdtype(np.asarray(values[o]).dtype, np.floating)]

    def consumers(self) -> dict[str, list[int]]:
        """For each value, the cone's nodes that read it."""
        readers: dict[str, list[int]] = {}
        for i in self.order:
            for x in self.nodes[i].input:
                readers.setdefault(x, []).append(i)
        return readers

    def finding(self, cause: str, i: int, max_abs: float, allowed: float, detail: str) -> NodeFinding:
        node = self.nodes[i]
        return NodeFinding(
            cause,
            i,
            node.op_type,
            node.name,
            list(node.input),
            list(node.output),
            self.origins[i],
            max_abs,
            allowed,
            detail,
        )


def stage_graph(artifact, stage: str, graph_name: str | None = None) -> GraphArtifact:
    """The graph named `graph_name`, or by default the graph that outputs `stage`."""
    if graph_name is not None:
        return artifact.graph(graph_name)
    graph = next((g for g in artifact.graphs if stage in g.output_names), None)
    if graph is None:
        raise ComparisonError(f"--localize: stage {stage!r} is not an output of any graph of {artifact.location}")
    return graph


def stage_cone(graph: GraphArtifact, stage: str, feed: dict) -> StageCone:
    """Inline `graph` and collect the nodes `stage` depends on; `feed` may hold other graphs' inputs too."""
    inlined, origins = inline_with_origins(load_onnx(graph.model_path))
    nodes = list(inlined.graph.node)
    order = cone_order(nodes, stage)
    return StageCone(
        graph=graph,
        model=inlined,
        nodes=nodes,
        origins=origins,
        order=order,
        data=data_dependent(inlined.graph, nodes, order),
        feed={s.name: feed[s.name] for s in graph.input_specs},
        initializers={i.name: numpy_helper.to_array(i) for i in inlined.graph.initializer},
    )


def cone_order(nodes: list[onnx.NodeProto], stage: str) -> list[int]:
    """The indices of every node `stage` depends on, in the graph's (topological) order."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.output}
    cone, todo = set(), [stage]
    while todo:
        value = todo.pop()
        i = producer.get(value)
        if i is None or i in cone:
            continue
        cone.add(i)
        todo.extend(x for x in nodes[i].input if x)
    return sorted(cone)


def data_dependent(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], order: list[int]) -> set[str]:
    """The graph inputs and every value computed from them (not only from shapes and constants).

    Integer inputs count: a language model's hidden states are gathered from its weights by `input_ids`,
    and everything up to the KV cache is computed from them (only float values are judged)."""
    initializers = {i.name for i in graph.initializer}
    data = {i.name for i in graph.input if i.name not in initializers}
    for i in order:
        node = nodes[i]
        # Shape reads only the shape, CastLike's second input only its dtype.
        carried = node.input[:1] if node.op_type == "CastLike" else node.input
        if node.op_type not in SHAPE_ONLY_OPS and any(x in data for x in carried):
            data.update(node.output)
    return data


def float64_values(cone: StageCone) -> dict[str, np.ndarray]:
    """Every value of the cone computed by the graph converted to float64, on onnx.reference."""

    names = cone.value_names
    model64 = with_all_outputs(to_float64(cone.model), names)
    return dict(zip(names, Evaluator(model64).run(None, widened(cone.feed)), strict=True))


# --------------------------------------------------------------------------- question 1: runtime faults


def find_backend_fault(cone: StageCone, backend_values: dict) -> tuple[NodeFinding | None, int]:
    """The first node whose backend output differs from float64 on the backend's own inputs by more than the
    node's float32 rounding bound (None if none does), and how many nodes were judged."""
    checked = 0
    for i in cone.order:
        outputs = cone.judged_outputs(cone.nodes[i], backend_values)
        if not outputs:
            continue
        checked += 1
        finding = backend_node_fault(cone, i, outputs, backend_values)
        if finding is not None:
            return finding, checked
    return None, checked


def backend_node_fault(cone: StageCone, i: int, outputs: list[str], backend_values: dict) -> NodeFinding | None:
    """Node i re-evaluated in float64 on the backend's inputs; a finding for the first of `outputs` out of bound."""
    node = cone.nodes[i]
    ins = {x: np.asarray(cone.value(x, backend_values)) for x in node.input if x}
    expected = evaluate_node64(node, cone.opsets, ins)
    for name, want in zip(node.output, expected, strict=False):
        if name not in outputs:
            continue
        got = backend_values[name]
        magnitude, steps = node_scale(node.op_type, [ins.get(x) for x in node.input], want, attributes_of(node))
        allowed = steps * EPS32 * magnitude
        error = differ(got, want)
        if not error <= allowed:
            return cone.finding(
                "backend",
                i,
                error,
                allowed,
                f"output {name!r}: max abs {error:.3g} vs float64 on the backend's own inputs, "
                f"allowed {allowed:.3g} ({steps} x float32 eps x magnitude {magnitude:.3g})",
            )
    return None


# --------------------------------------------------------------------------- question 2: export faults


def eager_by_shape(artifact, graph_name: str, feed: dict) -> dict[tuple, list[np.ndarray]]:
    """The eager float64 model's tensors for `graph_name` on `feed`, grouped by shape without unit axes."""
    captured: dict[tuple, list[np.ndarray]] = {}
    for array in eager_tensors(artifact, graph_name, feed):
        captured.setdefault(_key(array), []).append(array)
    return captured


def eager_matches(cone: StageCone, values64: dict, captured: dict[tuple, list[np.ndarray]]) -> dict[int, tuple]:
    """For each judged node: (max abs difference of its float64 value to the closest eager tensor, allowed)."""
    depth: dict[str, int] = {}
    matches: dict[int, tuple[float, float]] = {}
    for i in cone.order:
        node = cone.nodes[i]
        depth_here = 1 + max((depth.get(x, 0) for x in node.input), default=0)
        for out in node.output:
            depth[out] = depth_here
        outs = cone.judged_outputs(node, values64)
        if not outs:
            continue
        value = values64[outs[0]]
        magnitude, _ = node_scale(
            node.op_type, [cone.value(x, values64) for x in node.input], value, attributes_of(node)
        )
        # The float64 graph and float64 eager differ only where the graph holds float32-rounded constants
        # (e.g. a scale or an epsilon): to first order each of the depth operations on the path can carry one
        # such relative rounding, so (depth + 1) float32 ulps of the node's magnitude.
        allowed = (depth_here + 1) * EPS32 * max(magnitude, float(np.finfo(np.float64).tiny))
        best = min(
            (differ(value.reshape(c.shape), c) for c in captured.get(_key(value), []) if c.size == value.size),
            default=float("inf"),
        )
        matches[i] = (best, allowed)
    return matches


def all_downstream_unmatched(
    cone: StageCone, consumers: dict[str, list[int]], matched: dict[int, bool], i: int
) -> bool:
    """No node fed, directly or not, by node i matches an eager tensor (unjudged nodes are passed through)."""
    seen, todo = set(), [i]
    while todo:
        j = todo.pop()
        for out in cone.nodes[j].output:
            for k in consumers.get(out, []):
                if k in seen:
                    continue
                seen.add(k)
                if matched.get(k):
                    return False
                todo.append(k)
    return True


def find_graph_fault(
    cone: StageCone, values64: dict, captured: dict[tuple, list[np.ndarray]], stage: str
) -> NodeFinding | None:
    """The first node whose float64 value matches no eager tensor while nothing downstream of it matches either."""
    matches = eager_matches(cone, values64, captured)
    matched = {i: best <= allowed for i, (best, allowed) in matches.items()}
    consumers = cone.consumers()
    for i in cone.order:
        if i in matched and not matched[i] and all_downstream_unmatched(cone, consumers, matched, i):
            best, allowed = matches[i]
            detail = (
                f"its float64 value matches no tensor of the eager float64 model (closest max abs "
                f"{best:.3g}, allowed {allowed:.3g}), and nothing downstream of it in {stage!r} matches either"
            )
            return cone.finding("graph", i, best, allowed, detail)
    return None


# --------------------------------------------------------------------------- the analysis


def localize_stage(artifact, backend: str, stage: str, feed: dict, *, graph_name: str | None = None) -> Localization:
    """Name the first ONNX node of `stage`'s computation that `backend` (or the graph itself) gets wrong."""
    cone = stage_cone(stage_graph(artifact, stage, graph_name), stage, feed)
    known = {(op.op_domain, op.__name__) for op in CONTRIB_OPS}
    foreign = sorted(
        {f"{n.domain}::{n.op_type}" for n in cone.model.graph.node if n.domain and (n.domain, n.op_type) not in known}
    )
    if foreign:  # each node is judged on the reference evaluator, which has no kernel for these
        return Localization(
            backend,
            stage,
            cone.graph.name,
            None,
            0,
            note=f"not localised: the graph holds {', '.join(foreign)}, which the ONNX reference evaluator does not "
            "implement; re-export with --lowering standard or functions to localise",
        )
    backend_values = run_backend_all(backend, with_all_outputs(cone.model, cone.value_names), cone.feed)
    values64 = float64_values(cone)
    finding, checked = find_backend_fault(cone, backend_values)
    if finding is None:
        finding = find_graph_fault(cone, values64, eager_by_shape(artifact, cone.graph.name, cone.feed), stage)
    if finding is None:
        return Localization(
            backend,
            stage,
            cone.graph.name,
            None,
            checked,
            note="every node agrees with float64 on its own inputs and with the eager model's tensors",
        )
    return Localization(backend, stage, cone.graph.name, finding, checked)


def localize_report(report, artifact) -> list[Localization]:
    """For every failing ONNX backend of a CheckReport, localise its first failing stage."""
    results = []
    for backend in report.backends:
        failure = backend.comparison.first_failure
        if failure is None:
            continue
        if backend.name.startswith("eager"):
            results.append(
                Localization(
                    backend.name,
                    failure.name,
                    "-",
                    None,
                    0,
                    note="an eager backend runs no ONNX graph; nothing to localise",
                )
            )
            continue
        if failure.name.startswith("decode."):
            results.append(
                Localization(
                    backend.name,
                    failure.name,
                    "-",
                    None,
                    0,
                    note="decode steps are not localised; localise the prefill stages",
                )
            )
            continue
        feeds = report.arrays.get("feeds", {})
        feed = {}
        for graph_feed in feeds.values():
            feed.update(graph_feed)
        results.append(localize_stage(artifact, backend.name, failure.name, feed))
    return results


# --------------------------------------------------------------------------- the node audit


@dataclass
class NodeAudit:
    """Question 1 over whole graphs: every node of a backend against float64 on the backend's own inputs."""

    backend: str
    nodes_checked: int
    finding: NodeFinding | None = None
    note: str = ""

    @property
    def passed(self) -> bool:
        return self.finding is None

    def to_dict(self) -> dict:
        return {
            "backend": self.backend,
            "nodes_checked": self.nodes_checked,
            "finding": None if self.finding is None else self.finding.to_dict(),
            "note": self.note,
        }

    def describe(self) -> str:
        head = f"node audit {self.backend} ({self.nodes_checked} nodes): "
        if self.finding is None:
            return head + (self.note or "every node within float32 rounding of float64 on its own inputs")
        return head + f"FAIL at {self.finding.describe()}; the backend computes it wrongly on its own inputs"


def audit_nodes(artifact, backend: str, feeds: dict[str, list[dict]]) -> NodeAudit:
    """Every node of every graph of `backend`, re-evaluated in float64 on the backend's own inputs and held to its
    float32 rounding bound, on each of the graph's `feeds` (by graph name); the first node out of bound fails.

    This is the tight verdict where the stages' cannot be: a graph that rounds activations to int8
    (runners.activations) turns float32 noise into whole rounding steps that cascade through the layers, yet
    one node at a time, on the same inputs, the rounding is reproduced exactly.
    """
    known = {(op.op_domain, op.__name__) for op in CONTRIB_OPS}
    checked = 0
    for graph in artifact.graphs:
        stage = "logits" if "logits" in graph.output_names else graph.output_names[0]
        cone = None
        for feed in feeds.get(graph.name, []):
            cone = stage_cone(graph, stage, feed) if cone is None else replace(cone, feed=feed)
            foreign = sorted(
                {f"{n.domain}::{n.op_type}" for n in cone.nodes if n.domain and (n.domain, n.op_type) not in known}
            )
            if foreign:
                return NodeAudit(
                    backend,
                    checked,
                    note=f"not audited: {graph.name} holds {', '.join(foreign)}, which the ONNX reference "
                    "evaluator does not implement",
                )
            values = run_backend_all(backend, with_all_outputs(cone.model, cone.value_names), cone.feed)
            finding, count = find_backend_fault(cone, values)
            checked += count
            if finding is not None:
                return NodeAudit(backend, checked, finding)
    return NodeAudit(backend, checked)
