"""The graph rewrite of weight-only int4/int8 quantization with ONNX Runtime's MatMulNBits.

Per graph: inline the custom-domain functions (onnx.inliner) -> fold Transpose nodes of
constant weights (SwiGLU's and GeGLU's bodies transpose their [out, in] weights) -> quantize each MatMul's
constant B with ONNX Runtime's node quantizers (round-to-nearest or HQQ, block-wise along K), or
with blocks made elsewhere (quantize_proto_blocks: a GGUF's own, exporters/gguf_blocks.py).

Only MatMul nodes whose B is a constant initializer are quantized (the projections and
the LM head); attention's activation x activation MatMuls, the embedding Gather and the
norm gains stay float. `quantized_weight_map` records where each model parameter lives
afterwards, and `dequantize_weight` gives the float matrix a MatMulNBits weight stands
for: the eager reference of a quantized artifact is the model with those weights.

Weights stream: the graph is read without its external data, and every weight is read from
the artifact's data file when it is needed, one at a time. What the rewrite creates (folded
transposes, quantized blocks) is held beside the graph as pending initializers
(artifact.write.PendingWeights), never inside the protobuf message, which cannot give back
the memory of a field it clears. So a quantization holds one float weight at a time, the
quantized weights and the float tensors that stay (the embedding table).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

from artifact.errors import ConfigError, ExternalDataError, ModelFileError
from artifact.format import CUSTOM_DOMAIN
from artifact.hashing import array_digest
from artifact.write import EXTERNAL_MIN_TENSOR_BYTES, PENDING_LOCATION, PendingWeights, is_pending

BITS = (4, 8)
# rtn: round-to-nearest, asymmetric, uint8 zero points (DefaultWeightOnlyQuantConfig);
# hqq: half-quadratic quantization, float zero points optimised per block without data (HQQWeightOnlyQuantConfig).
ALGORITHMS = ("rtn", "hqq")
BLOCK_SIZES = (32, 64, 128)
# ONNX Runtime's MatMulNBits attribute: 0 = unset (float32 activations), 4 = int8 activations (faster on CPU).
ACCURACY_LEVELS = (0, 1, 4)
INT8_ACTIVATIONS_LEVEL = 4  # MatMulNBits rounds its input to int8 per block from this level on
FLOAT_TYPES = (1, 10, 16)  # TensorProto FLOAT, FLOAT16, BFLOAT16
HEAD = "lm_head.weight"  # the vocabulary projection in every decoder family (models/llama.py, models/gpt.py)
MS_DOMAIN = "com.microsoft"  # MatMulNBits' domain (opset 1)
CHECK_SLAB_BYTES = 1 << 26  # float32 bytes of a dequantized weight compared at a time (quantized_weight_map)
# The initializers a MatMulNBits weight's spec names: B, scales, zero points and (the GGUF recipe's Q4_1 layout)
# per-block offsets added through a block-sum MatMul beside it.
SPEC_PARTS = ("weight", "scales", "zero_points", "offsets")
OFFSETS = "_offsets"  # suffix of the offsets initializer of MatMul weight B: f"{B}{OFFSETS}", [blocks, N] float32


class GraphWeights:
    """The initializers of one graph as arrays, read one at a time: from inside the graph, from its external data
    (locations and byte ranges already confined by artifact.read.validate_onnx), as a permutation of another
    initializer (a folded Transpose, computed when read), or from the pending arrays the rewrite holds beside
    the graph. Nothing is cached: an array read is the caller's until it drops it."""

    def __init__(self, proto, base_dir: str, where, pending: PendingWeights | None = None):
        self.tensors = {tensor.name: tensor for tensor in proto.graph.initializer}
        self.origin = dict(self.tensors)  # the source graph's, readable after the rewrite drops them
        self.derived: dict[str, tuple[str, list[int] | None]] = {}  # folded transposes: (source, perm)
        self.base_dir, self.where = base_dir, where
        self.pending = PendingWeights() if pending is None else pending

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def track(self, proto) -> None:
        """Follow `proto`'s initializers (the graph after a rewrite)."""
        self.tensors = {tensor.name: tensor for tensor in proto.graph.initializer}

    def array(self, name: str) -> np.ndarray:
        import onnx
        from onnx import numpy_helper

        if name in self.derived:
            source, perm = self.derived[name]
            return np.ascontiguousarray(np.transpose(self.array(source), perm))
        tensor = self.tensors.get(name) or self.origin[name]
        if is_pending(tensor):
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type)
            return self.pending.array(name).view(dtype).reshape(tuple(tensor.dims))
        try:
            return numpy_helper.to_array(tensor, base_dir=self.base_dir)
        except (OSError, ValueError) as exc:
            raise ExternalDataError(f"{self.where}: cannot read initializer {name!r} ({exc})") from None

    def derive(self, tensor, source: str, perm: list[int] | None) -> None:
        """Declare `tensor` (name, data_type and dims set) the transpose of initializer `source` by `perm`: held
        as the recipe, its values are computed when read (quantized, it is never held whole)."""
        del tensor.external_data[:]
        tensor.external_data.add(key="location", value=PENDING_LOCATION)
        tensor.data_location = tensor.EXTERNAL
        self.derived[tensor.name] = (source, perm)
        self.tensors[tensor.name] = tensor

    def hold(self, tensor, array: np.ndarray) -> None:
        """Keep `tensor`'s values as `array` beside the graph (pending) when large, inside it when small."""
        from onnx import numpy_helper

        if array.nbytes >= EXTERNAL_MIN_TENSOR_BYTES:
            for data in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
                tensor.ClearField(data)  # a tensor held inside the source graph: its old values would be written
            self.pending.add(tensor, array)
        else:
            tensor.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(array), tensor.name))
        self.tensors[tensor.name] = tensor

    def detach(self, proto) -> None:
        """Read now every initializer that still points at the source's external data or is a folded transpose
        (the graph keeps them float), as pending arrays: the graph no longer depends on the source's files."""
        from artifact.protobuf import is_external

        for tensor in proto.graph.initializer:
            if tensor.name in self.derived or (is_external(tensor) and not is_pending(tensor)):
                array = self.array(tensor.name)
                self.derived.pop(tensor.name, None)
                self.pending.add(tensor, array if array.flags.c_contiguous else np.ascontiguousarray(array))

    def drop_unused(self, proto) -> None:
        """Remove initializers no node or output reads (and the pending bytes of those held beside the graph)."""
        used = {name for node in proto.graph.node for name in node.input} | {o.name for o in proto.graph.output}
        unused = [tensor for tensor in proto.graph.initializer if tensor.name not in used]
        for tensor in unused:
            if is_pending(tensor):
                self.pending.pop(tensor.name, None)
                self.derived.pop(tensor.name, None)
            self.tensors.pop(tensor.name, None)
            proto.graph.initializer.remove(tensor)


def prepare_proto(proto, weights: GraphWeights):
    """(graph, {initializer: its folded transpose}): custom-domain functions inlined and constant transposes
    folded, so weights are MatMul's constant B. `proto` is read without its external data; the prepared graph
    declares the same external initializers (references, not bytes), and `weights` follows it."""
    import onnx.inliner

    from artifact.protobuf import weightless

    # The inliner serialises the model it is given, which protobuf refuses above 2 GiB: it inlines the weightless
    # graph (weights declared as inputs, which it does not rename), and the weights are put back after.
    skeleton = weightless(proto)
    moved = {v.name for v in skeleton.graph.input} - {v.name for v in proto.graph.input}
    inlined = onnx.inliner.inline_local_functions(skeleton)
    del skeleton
    inputs = [v for v in inlined.graph.input if v.name not in moved]
    del inlined.graph.input[:]
    inlined.graph.input.extend(inputs)
    kept = {t.name for t in inlined.graph.initializer}
    inlined.graph.initializer.extend(t for t in proto.graph.initializer if t.name not in kept)
    prepared = inlined
    del prepared.functions[:]
    kept = [o for o in prepared.opset_import if o.domain != CUSTOM_DOMAIN]
    del prepared.opset_import[:]
    prepared.opset_import.extend(kept)
    weights.track(prepared)
    folded = fold_constant_transposes(prepared, weights)
    return prepared, folded


def quantize_proto(
    proto, weights: GraphWeights, *, bits: int, block_size: int, accuracy_level: int = 0, algorithm: str = "rtn"
):
    """(quantized ModelProto, number of MatMulNBits nodes) of a prepared graph (see prepare_proto), rewritten in
    place. Each MatMul's B is read, handed to ONNX Runtime's node quantizer in a graph of its own and dropped, so
    one float weight is held at a time; the quantized blocks are held beside the graph in `weights`."""
    import onnx
    from onnx import numpy_helper

    node_quantizer = _node_quantizer(bits, block_size, accuracy_level, algorithm)

    def replace(node, b):
        scratch = onnx.GraphProto()  # the quantizer looks B up here and appends its weights after it
        scratch.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weights.array(b)), b))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # HQQ wraps read-only numpy weights in torch tensors; it only reads them
            replaced = node_quantizer.quantize(node, [scratch])
        for made in scratch.initializer[1:]:
            _hold(proto, weights, made.name, numpy_helper.to_array(made))
        return replaced

    return _rewrite_matmuls(proto, weights, replace, accuracy_level)


def quantize_proto_blocks(proto, weights: GraphWeights, blocks, *, accuracy_level: int = 0):
    """quantize_proto with given blocks: `blocks(b)` is the NBitsWeight (exporters/gguf_blocks.py) of MatMul weight
    `b`, built when asked (one at a time), or None to keep that MatMul float."""
    import onnx

    ranks = _input_ranks(proto)
    block_sums: dict[tuple[str, int], list] = {}  # {(A, K): the nodes summing A's blocks} shared by its MatMuls

    def replace(node, b):
        weight = blocks(b)
        if weight is None:
            return [node]
        names = [f"{b}_Q{weight.bits}", f"{b}_scales"]
        _hold(proto, weights, names[0], weight.packed)
        _hold(proto, weights, names[1], weight.scales)
        if weight.zero_points is not None:
            names.append(f"{b}_zero_points")
            _hold(proto, weights, names[2], weight.zero_points)
        attributes = {"K": weight.k, "N": weight.n, "bits": weight.bits, "block_size": weight.block_size}
        if accuracy_level:
            attributes["accuracy_level"] = accuracy_level
        outputs = list(node.output) if weight.offsets is None else [f"{node.output[0]}_nbits"]
        made = [
            onnx.helper.make_node(
                "MatMulNBits",
                [node.input[0], *names],
                outputs,
                name=f"{node.name}_Q{weight.bits}",
                domain=MS_DOMAIN,
                **attributes,
            )
        ]
        if weight.offsets is not None:
            made = _with_offsets(proto, weights, node, b, weight, made, ranks, block_sums)
        return made

    return _rewrite_matmuls(proto, weights, replace, accuracy_level)


def _with_offsets(proto, weights, node, b: str, weight, made: list, ranks: dict, block_sums: dict) -> list:
    """`made` (the MatMulNBits node) plus what adds the per-block offsets: y = A B' + sum_blocks(A) C, with C
    ([blocks, N], initializer f"{b}{OFFSETS}") the offset of each block of each output column. MatMulNBits
    holds only an integer zero point per block; the sums of A over each block, times C, add the float part.
    The block sums of one A are computed once for all its MatMuls: a Reshape to [..., blocks, block] and a
    ReduceSum where A's rank is known and K fills its blocks, else a MatMul with a 0/1 [K, blocks] matrix (which
    also sums a last, partial block)."""
    import onnx

    a, k, block = node.input[0], weight.k, weight.block_size
    blocks = -(-k // block)
    key = (a, k)
    if key not in block_sums:
        sums = f"{a}_block_sums{block}"
        rank = ranks.get(a)
        if rank is not None and rank >= 2 and k % block == 0:
            shape = f"{b}_block_shape"
            _hold(proto, weights, shape, np.array([0] * (rank - 1) + [blocks, block], dtype=np.int64))
            axis = f"{b}_block_axis"
            _hold(proto, weights, axis, np.array([-1], dtype=np.int64))
            block_sums[key] = [
                onnx.helper.make_node("Reshape", [a, shape], [f"{sums}_blocks"], name=f"{node.name}_blocks"),
                onnx.helper.make_node(
                    "ReduceSum", [f"{sums}_blocks", axis], [sums], name=f"{node.name}_block_sums", keepdims=0
                ),
            ]
        else:
            ones = f"{b}_block_ones"
            indicator = np.zeros((k, blocks), dtype=np.float32)
            indicator[np.arange(k), np.arange(k) // block] = 1
            _hold(proto, weights, ones, indicator)
            block_sums[key] = [onnx.helper.make_node("MatMul", [a, ones], [sums], name=f"{node.name}_block_sums")]
        made = block_sums[key] + made
    sums = block_sums[key][-1].output[0]
    offsets = f"{b}{OFFSETS}"
    _hold(proto, weights, offsets, np.ascontiguousarray(weight.offsets.reshape(weight.n, blocks).T))
    return made + [
        onnx.helper.make_node("MatMul", [sums, offsets], [f"{node.output[0]}_offsets"], name=f"{node.name}_offsets"),
        onnx.helper.make_node(
            "Add",
            [made[-1].output[0], f"{node.output[0]}_offsets"],
            list(node.output),
            name=f"{node.name}_plus_offsets",
        ),
    ]


def _input_ranks(proto) -> dict[str, int]:
    """{value name: rank} where shape inference of the weightless graph knows it."""
    import onnx

    from artifact.protobuf import weightless

    try:
        inferred = onnx.shape_inference.infer_shapes(weightless(proto))
    except Exception:  # noqa: BLE001 - ranks are an optimisation; without them the block sums take a MatMul
        return {}
    values = [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]
    return {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in values
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")
    }


def _hold(proto, weights: GraphWeights, name: str, array: np.ndarray) -> None:
    """Add initializer `name` with `array`'s values, held beside the graph (GraphWeights.hold)."""
    import onnx

    data_type = onnx.helper.np_dtype_to_tensor_dtype(array.dtype)
    proto.graph.initializer.append(onnx.TensorProto(name=name, data_type=data_type, dims=list(array.shape)))
    weights.hold(proto.graph.initializer[-1], array)


def _rewrite_matmuls(proto, weights: GraphWeights, replace, accuracy_level: int):
    """Every MatMul whose B is a constant 2-D float initializer becomes replace(node, b) (a list of nodes whose
    initializers it holds); then the com.microsoft opset, the accuracy level, unused weights dropped, checked."""
    import onnx

    from artifact.protobuf import weightless

    nodes, count = [], 0
    for node in proto.graph.node:
        b = _constant_b(node, weights)
        if b is None:
            nodes.append(node)
            continue
        replaced = replace(node, b)
        count += sum(1 for n in replaced if n.op_type == "MatMulNBits")
        nodes.extend(replaced)
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    if not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.add(domain=MS_DOMAIN, version=1)
    if accuracy_level:  # the HQQ quantizer does not set it
        for node in proto.graph.node:
            if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
    weights.drop_unused(proto)
    onnx.checker.check_model(weightless(proto))  # serialised whole, a graph over 2 GiB could not be checked
    return proto, count


def constant_matmul_weights(proto, weights: GraphWeights) -> dict[str, tuple[int, int]]:
    """{B: (K, N)} of the MatMuls _rewrite_matmuls replaces."""
    found = (_constant_b(node, weights) for node in proto.graph.node)
    return {b: tuple(weights.tensors[b].dims) for b in found if b is not None}


def _constant_b(node, weights: GraphWeights) -> str | None:
    """The B of a MatMul whose B is a constant 2-D float initializer (a weight to quantize), else None."""
    if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx"):
        return None
    tensor = weights.tensors.get(node.input[1])
    if tensor is None or tensor.data_type not in FLOAT_TYPES or len(tensor.dims) != 2:
        return None
    return node.input[1]


def _node_quantizer(bits: int, block_size: int, accuracy_level: int, algorithm: str):
    try:
        from onnxruntime.quantization import matmul_nbits_quantizer as nbits
    except ImportError as exc:
        raise ConfigError(
            f"onnxruntime's quantization tooling is not importable ({exc}); install onnxruntime"
        ) from None
    # The quantizer logs every node it visits at INFO; the command prints its own summary.
    logging.getLogger(nbits.__name__).setLevel(logging.WARNING)
    if algorithm == "hqq":
        return nbits.HQQWeightOnlyQuantizer(nbits.HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits))
    config = nbits.DefaultWeightOnlyQuantConfig(
        block_size=block_size, is_symmetric=False, accuracy_level=accuracy_level or None, bits=bits
    )
    return nbits.DefaultWeightOnlyQuantizer(config)


def fold_constant_transposes(proto, weights: GraphWeights) -> dict[str, str]:
    """Replace Transpose(initializer) by a transposed initializer, so MatMul sees a constant B.

    Only Transpose is folded (exact: a permutation of the stored values); the transposed initializer is a recipe
    (GraphWeights.derive) computed when read. Returns {source initializer: its 2-D transposed copy} so weight locations can follow the rename.
    """
    import onnx

    kept, folded = [], {}
    for node in proto.graph.node:
        if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and node.input[0] in weights:
            source = weights.tensors[node.input[0]]
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            dims = list(source.dims)
            dims = [dims[i] for i in perm] if perm is not None else dims[::-1]
            proto.graph.initializer.append(onnx.TensorProto(name=node.output[0], data_type=source.data_type, dims=dims))
            weights.derive(proto.graph.initializer[-1], node.input[0], perm)
            if len(dims) == 2:
                folded.setdefault(node.input[0], node.output[0])
        else:
            kept.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(kept)
    weights.drop_unused(proto)
    return folded


def _reconstruct(stored: np.ndarray, entry: dict) -> np.ndarray:
    """The torch-layout weight from its stored initializer: the manifest's slice (fused QKV / gate-up
    initializers of a lowering, in stored axes), then its transpose."""
    if entry.get("slice"):
        axis, start, stop = entry["slice"]
        stored = np.take(stored, np.arange(start, stop), axis=axis)
    return stored.T if entry.get("transpose") else stored


def torch_weight(source: GraphWeights, entry: dict) -> np.ndarray:
    """One torch weight (its weight-map entry) in torch layout, read from the source graph's initializers."""
    return _reconstruct(source.array(entry["initializer"]), entry)


def head_copies(prepared: GraphWeights, matmul_b: set[str], head: np.ndarray | None) -> dict[tuple, str]:
    """{digest: initializer} of the prepared graph's MatMul weights (`matmul_b`) that hold `head` transposed:
    where a tied head's values live once the export folded its transpose. Taken before quantization rewrites
    the graph."""
    if head is None or head.ndim != 2:
        return {}
    wanted = tuple(reversed(head.shape))
    return {
        array_digest(prepared.array(name)): name
        for name, tensor in prepared.tensors.items()
        if name in matmul_b and tensor.data_type in FLOAT_TYPES and tuple(tensor.dims) == wanted
    }


def quantized_weight_map(
    source_map: dict,
    folded: dict[str, str],
    copies: dict[tuple, str],
    quantized,
    arrays: GraphWeights,
    source: GraphWeights,
    bits: int,
    prefer_quantized: tuple[str, ...] = (),
    algorithm: str = "rtn",
    bounds: dict[str, float] | None = None,
) -> dict[str, dict]:
    """Where each torch weight lives after quantization, following the initializers it was stored in.

    A source initializer may have been replaced by its folded transpose (prepare_proto), then by the
    quantizer's `<name>_Q<bits>` MatMulNBits weight; a weight's slice (fused initializers) carries over,
    since the dequantized B has the stored float layout. A quantized location is accepted only if it
    reconstructs the float weight (read from `source`, one at a time) to within half a quantization step.
    Names in prefer_quantized (the LM head) take a quantized location when one holds their values: a tied
    head's source entry points at the embedding table, while the graph multiplies by a separate (now
    quantized) transposed copy, found in `copies` (head_copies of the prepared graph). `arrays` reads the
    quantized graph's initializers. `bounds` ({MatMulNBits weight: steps}, 0 for bit for bit) replaces the
    algorithm's bound where given (the GGUF recipe's blocks, of any width, are named `<name>_Q<their bits>`).
    """
    names = {init.name for init in quantized.graph.initializer}
    specs = {
        quantized_spec(n, names)["weight"]: quantized_spec(n, names)
        for n in quantized.graph.node
        if n.op_type == "MatMulNBits"
    }
    mapping = {}
    for name, entry in source_map.items():
        location, transpose = entry["initializer"], bool(entry.get("transpose"))
        # Followed to its folded transpose only when the original is gone: a tied embedding table stays (the
        # Gather reads it) while its folded transpose, the head's B, is quantized.
        if location in folded and location not in names:
            location, transpose = folded[location], not transpose
        extra = {k: v for k, v in entry.items() if k not in ("initializer", "transpose")}
        options = []
        if location in names:
            options.append({"initializer": location, "transpose": transpose, **extra})
        made = _quantized_name(location, specs)
        if made is not None:
            options.append({"initializer": made, "transpose": transpose, **extra, "quantized": specs[made]})
        weight = None
        if name in prefer_quantized and not extra:
            weight = torch_weight(source, entry)
            copy_made = _quantized_name(head_copy(copies, weight), specs)
            if copy_made is not None:
                options.insert(0, {"initializer": copy_made, "transpose": True, "quantized": specs[copy_made]})
            options.sort(key=lambda option: "quantized" not in option)
        if not options:
            raise ModelFileError(
                f"weight {name!r}: its initializer {entry['initializer']!r} is neither kept nor "
                "quantized; the eager reference could not be rebuilt"
            )
        chosen = options[0]
        if "quantized" in chosen:
            spec = chosen["quantized"]
            weight = torch_weight(source, entry) if weight is None else weight
            parts = {key: arrays.array(spec[key]) for key in SPEC_PARTS if key in spec}
            # Round-to-nearest is off by at most half a step (0.51 absorbs float32 rounding of the scale); HQQ
            # moves scale and zero point to lower the overall error, so only the block's range bounds it.
            bound = 0.51 if algorithm == "rtn" else 2.0**bits
            bound = (bounds or {}).get(spec["weight"], bound)
            if not _within_steps(spec, parts, chosen, weight, bound):
                within = "bit for bit to" if bound == 0 else f"to within {bound} steps of"
                raise ModelFileError(
                    f"weight {name!r}: its {spec['bits']}-bit MatMulNBits weight {spec['weight']!r} does "
                    f"not dequantize {within} the float weight"
                )
        mapping[name] = chosen
        del weight
    return mapping


def _quantized_name(location: str | None, specs: dict) -> str | None:
    """The MatMulNBits weight made from initializer `location` (`<location>_Q<bits>`), if there is one."""
    if location is None:
        return None
    return next((f"{location}_Q{b}" for b in BITS if f"{location}_Q{b}" in specs), None)


def head_copy(copies: dict[tuple, str], head: np.ndarray) -> str | None:
    """The prepared graph's MatMul weight that holds the torch-layout `head` transposed (see head_copies), if any."""
    return copies.get(array_digest(np.ascontiguousarray(head.T))) if head.ndim == 2 else None


def _within_steps(spec: dict, parts: dict, chosen: dict, weight: np.ndarray, bound: float) -> bool:
    """Whether the MatMulNBits weight (`parts`: its weight, scales and zero points arrays) dequantizes to within
    `bound` quantization steps of the float `weight` (torch layout) at every element (bound 0: equal, bit for
    bit). Compared a slab of output columns at a time (CHECK_SLAB_BYTES of float32), so an embedding-sized head
    is never held dequantized whole; a sliced (fused) location is compared whole."""
    k, n = spec["K"], spec["N"]
    slack = 0.0 if bound == 0 else 1e-7  # float32 rounding of the scale, where a bound is allowed at all
    expected = tuple(reversed((k, n))) if chosen.get("transpose") else (k, n)
    if chosen.get("slice"):
        rebuilt = _reconstruct(dequantize_weight(_columns(parts, spec, 0, n), spec), chosen)
        step = _reconstruct(_step(spec, parts["scales"]), chosen)
        return rebuilt.shape == weight.shape and bool(np.all(np.abs(rebuilt - weight) <= bound * step + slack))
    if weight.shape != expected:
        return False
    slab = max(1, CHECK_SLAB_BYTES // (4 * k))
    for start in range(0, n, slab):
        stop = min(start + slab, n)
        columns = dict(spec, N=stop - start)
        rebuilt = dequantize_weight(_columns(parts, spec, start, stop), columns)  # [K, stop - start]
        step = _step(columns, parts["scales"].reshape(n, -1)[start:stop])
        wanted = weight[start:stop].T if chosen.get("transpose") else weight[:, start:stop]
        if not np.all(np.abs(rebuilt - wanted) <= bound * step + slack):
            return False
    return True


def _columns(parts: dict, spec: dict, start: int, stop: int) -> dict:
    """{initializer name: array} of output columns [start, stop) of a MatMulNBits weight, keyed as `spec` names
    them (its B, scales and zero points are laid out one row per output column)."""
    n = spec["N"]
    return {
        spec[key]: array[:, start:stop] if key == "offsets" else array.reshape(n, -1)[start:stop]
        for key, array in parts.items()
    }


def quantized_spec(node, initializers=()) -> dict:
    """The MatMulNBits node's weight: its initializers (SPEC_PARTS; offsets where `initializers`, the graph's
    initializer names, hold f"{B}{OFFSETS}" for its B) and attributes."""
    attrs = {a.name: a.i for a in node.attribute}
    spec = {
        "weight": node.input[1],
        "scales": node.input[2],
        "bits": attrs["bits"],
        "block_size": attrs["block_size"],
        "K": attrs["K"],
        "N": attrs["N"],
    }
    if len(node.input) > 3 and node.input[3]:
        spec["zero_points"] = node.input[3]
    base = node.input[1].rsplit("_Q", 1)[0]
    if f"{base}{OFFSETS}" in initializers:
        spec["offsets"] = f"{base}{OFFSETS}"
    return spec


def dequantize_weight(initializers: dict, spec: dict) -> np.ndarray:
    """The float32 [K, N] matrix the MatMulNBits weight described by `spec` stands for (see `dequantize_nbits`);
    `initializers` maps names to TensorProtos or arrays."""
    from onnx import numpy_helper

    def array(name):  # TensorProtos, or arrays already read from external data
        value = initializers[name]
        return value if isinstance(value, np.ndarray) else numpy_helper.to_array(value)

    zero_points, offsets = spec.get("zero_points"), spec.get("offsets")
    weight = dequantize_nbits(
        array(spec["weight"]),
        array(spec["scales"]),
        None if zero_points is None else array(zero_points),
        bits=spec["bits"],
        block_size=spec["block_size"],
        k=spec["K"],
        n=spec["N"],
    ).astype(np.float32, copy=False)
    if offsets is not None:  # [blocks, N]: each block's offset added to its K rows
        weight += np.repeat(array(offsets).astype(np.float32), spec["block_size"], axis=0)[: spec["K"]]
    return weight


def dequantize_nbits(
    packed: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    bits: int,
    block_size: int,
    k: int,
    n: int,
) -> np.ndarray:
    """The [K, N] matrix a MatMulNBits B stands for: w = (q - zero_point) * scale, per K-block, in the
    scales' float dtype (at least float32).

    Layout (com.microsoft MatMulNBits): B [N, blocks, block_size * bits / 8] uint8, values in K order,
    4-bit values two per byte low nibble first; scales [N, blocks]; zero points uint8 packed the same way,
    or float [N, blocks] (HQQ), default 2^(bits-1) when absent.
    """
    blocks = -(-k // block_size)
    dtype = np.promote_types(scales.dtype, np.float32)
    values = _unpack(packed.reshape(n, blocks, -1), bits).reshape(n, blocks, block_size).astype(dtype)
    scale = scales.reshape(n, blocks).astype(dtype)
    if zero_points is None:
        zero = np.full((n, blocks), 2 ** (bits - 1), dtype=dtype)
    elif zero_points.dtype == np.uint8:
        zero = _unpack(zero_points.reshape(n, -1), bits)[:, :blocks].astype(dtype)
    else:  # float zero points (HQQ): one per block, not packed
        zero = zero_points.reshape(n, -1)[:, :blocks].astype(dtype)
    weight = (values - zero[..., None]) * scale[..., None]  # (N, blocks, block)
    return np.ascontiguousarray(weight.reshape(n, blocks * block_size)[:, :k].T)  # (K, N)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    if bits == 8:
        return packed
    low, high = packed & 0x0F, packed >> 4
    return np.stack([low, high], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _step(spec: dict, scales: np.ndarray) -> np.ndarray:
    """[K, N]: the quantization step (scale) of each element's block."""
    k, n, block = spec["K"], spec["N"], spec["block_size"]
    return np.repeat(scales.reshape(n, -1).astype(np.float32).T, block, axis=0)[:k]


def quantizer_version(algorithm: str, imatrix: bool = False, zero_points: str | None = None) -> dict:
    """The manifest's quantizer entry; imatrix: the k-quant search weighted by input channels' mean squares;
    zero_points: the k-quants' block minimums, "integer", "offsets" (float) or "auto" (per weight)."""
    import onnxruntime

    described = {
        "rtn": "DEFAULT (round-to-nearest, asymmetric, uint8 zero points, block-wise along K)",
        "hqq": "HQQ (half-quadratic, float zero points, block-wise along K)",
        "kquant": "k-quant search (weighted least-squares scale and float minimum per block, held as offsets)",
        "mixed": "k-quant search, the vocabulary projection at 8 bits",
        "measured": "k-quant search, the vocabulary projection and the most sensitive weights (measured) at 8 bits",
        "gptq": "GPTQ (rounding errors moved onto the rows not yet rounded by E[x^T x] on a calibration text), "
        "each block's scale and zero point by the k-quant search",
    }
    ours = algorithm in ("kquant", "mixed", "measured", "gptq")
    weighting = "; the search weighted by each input channel's mean square on a calibration text" if imatrix else ""
    if zero_points == "integer":
        weighting += "; integer zero points searched in place of float minimums (no offsets)"
    elif zero_points == "offsets" and algorithm == "gptq":
        weighting += "; float minimums searched in place of integer zero points (held as offsets)"
    elif zero_points == "auto" and algorithm == "gptq":
        weighting += (
            "; per weight, integer zero points unless their output error on the calibration text is far above "
            "float minimums'"
        )
    elif zero_points == "auto":
        weighting += "; per weight, integer zero points unless their weighted error is far above float minimums'"
    return {
        "tool": ("exporters.gptq" if algorithm == "gptq" else "exporters.kquant")
        if ours
        else "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer",
        "algorithm": described[algorithm] + weighting,
        "onnxruntime": onnxruntime.__version__,
    }
