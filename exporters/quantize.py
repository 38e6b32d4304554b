"""The graph rewrite of weight-only int4/int8 quantization with ONNX Runtime's MatMulNBits.

Per graph: inline the custom-domain functions (onnx.inliner) -> fold Transpose nodes of
constant weights (SwiGLU's body transposes its [out, in] weights) -> ONNX Runtime's
MatMulNBitsQuantizer (round-to-nearest or HQQ, block-wise along K).

Only MatMul nodes whose B is a constant initializer are quantized (the projections and
the LM head); attention's activation x activation MatMuls, the embedding Gather and the
norm gains stay float. `quantized_weight_map` records where each model parameter lives
afterwards, and `dequantize_weight` gives the float matrix a MatMulNBits weight stands
for: the eager reference of a quantized artifact is the model with those weights.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

from artifact.errors import ConfigError, ModelFileError
from artifact.format import CUSTOM_DOMAIN
from artifact.hashing import array_digest

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


def prepare_proto(proto):
    """(graph, {initializer: its folded transpose}): custom-domain functions inlined and constant transposes
    folded, so weights are MatMul's constant B."""
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
    proto = inlined
    del proto.functions[:]
    kept = [o for o in proto.opset_import if o.domain != CUSTOM_DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(kept)
    folded = fold_constant_transposes(proto)
    return proto, folded


def quantize_proto(proto, *, bits: int, block_size: int, accuracy_level: int = 0, algorithm: str = "rtn"):
    """(quantized ModelProto, number of MatMulNBits nodes) of a prepared graph (see prepare_proto).

    The quantizer rewrites the graph it is given: `proto` is consumed (no copy, so the weights are held once).
    """
    import onnx

    from artifact.protobuf import weightless

    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:
        raise ConfigError(
            f"onnxruntime's quantization tooling is not importable ({exc}); install onnxruntime"
        ) from None
    # The quantizer logs every node it visits at INFO; the command prints its own summary.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    if algorithm == "hqq":
        from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig

        config = HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits)
        quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, algo_config=config)
    else:
        quantizer = MatMulNBitsQuantizer(
            proto, bits=bits, block_size=block_size, is_symmetric=False, accuracy_level=accuracy_level or None
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HQQ wraps read-only numpy weights in torch tensors; it only reads them
        quantizer.process()
    result = quantizer.model.model
    if accuracy_level:  # the HQQ path does not set it
        for node in result.graph.node:
            if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
    count = sum(1 for n in result.graph.node if n.op_type == "MatMulNBits")
    onnx.checker.check_model(weightless(result))  # serialised whole, a graph over 2 GiB could not be checked
    return result, count


def fold_constant_transposes(proto) -> dict[str, str]:
    """Replace Transpose(initializer) by a transposed initializer, so MatMul sees a constant B.

    Only Transpose is folded (exact: a permutation of the stored values). Returns {source initializer:
    its 2-D transposed copy} so weight locations can follow the rename.
    """
    from onnx import numpy_helper

    initializers = {init.name: init for init in proto.graph.initializer}
    kept, folded = [], {}
    for node in proto.graph.node:
        if node.op_type == "Transpose" and node.domain in ("", "ai.onnx") and node.input[0] in initializers:
            array = numpy_helper.to_array(initializers[node.input[0]])
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            transposed = np.ascontiguousarray(np.transpose(array, perm))
            proto.graph.initializer.append(numpy_helper.from_array(transposed, node.output[0]))
            initializers[node.output[0]] = proto.graph.initializer[-1]
            if array.ndim == 2:
                folded.setdefault(node.input[0], node.output[0])
        else:
            kept.append(node)
    del proto.graph.node[:]
    proto.graph.node.extend(kept)
    used = {name for node in proto.graph.node for name in node.input} | {o.name for o in proto.graph.output}
    unused = [init for init in proto.graph.initializer if init.name not in used]
    for init in unused:
        proto.graph.initializer.remove(init)
    return folded


def _reconstruct(stored: np.ndarray, entry: dict) -> np.ndarray:
    """The torch-layout weight from its stored initializer: the manifest's slice (fused QKV / gate-up
    initializers of a lowering, in stored axes), then its transpose."""
    if entry.get("slice"):
        axis, start, stop = entry["slice"]
        stored = np.take(stored, np.arange(start, stop), axis=axis)
    return stored.T if entry.get("transpose") else stored


def torch_weights(proto, weight_map: dict) -> dict[str, np.ndarray]:
    """{torch weight name: array in torch layout} from the source graph's initializers."""
    from onnx import numpy_helper

    initializers = {init.name: init for init in proto.graph.initializer}
    return {
        name: _reconstruct(numpy_helper.to_array(initializers[entry["initializer"]]), entry)
        for name, entry in weight_map.items()
    }


def head_copies(prepared, head: np.ndarray | None) -> dict[tuple, str]:
    """{digest: initializer} of the prepared graph's MatMul weights that hold `head` transposed: where a tied
    head's values live once the export folded its transpose. Taken before quantization rewrites the graph."""
    from onnx import numpy_helper

    if head is None or head.ndim != 2:
        return {}
    b_inputs = {n.input[1] for n in prepared.graph.node if n.op_type == "MatMul" and len(n.input) > 1}
    wanted = tuple(reversed(head.shape))
    return {
        array_digest(numpy_helper.to_array(init)): init.name
        for init in prepared.graph.initializer
        if init.name in b_inputs and init.data_type in FLOAT_TYPES and tuple(init.dims) == wanted
    }


def quantized_weight_map(
    source_map: dict,
    folded: dict[str, str],
    copies: dict[tuple, str],
    quantized,
    weights: dict[str, np.ndarray],
    bits: int,
    prefer_quantized: tuple[str, ...] = (),
    algorithm: str = "rtn",
) -> dict[str, dict]:
    """Where each torch weight lives after quantization, following the initializers it was stored in.

    A source initializer may have been replaced by its folded transpose (prepare_proto), then by the
    quantizer's `<name>_Q<bits>` MatMulNBits weight; a weight's slice (fused initializers) carries over,
    since the dequantized B has the stored float layout. A quantized location is accepted only if it
    reconstructs the float weight to within half a quantization step. Names in prefer_quantized (the
    LM head) take a quantized location when one holds their values: a tied head's source entry points at
    the embedding table, while the graph multiplies by a separate (now quantized) transposed copy, found in
    `copies` (head_copies of the prepared graph).
    """
    initializers = {init.name: init for init in quantized.graph.initializer}
    specs = {quantized_spec(n)["weight"]: quantized_spec(n) for n in quantized.graph.node if n.op_type == "MatMulNBits"}
    mapping = {}
    for name, entry in source_map.items():
        location, transpose = entry["initializer"], bool(entry.get("transpose"))
        # Followed to its folded transpose only when the original is gone: a tied embedding table stays (the
        # Gather reads it) while its folded transpose, the head's B, is quantized.
        if location in folded and location not in initializers:
            location, transpose = folded[location], not transpose
        extra = {k: v for k, v in entry.items() if k not in ("initializer", "transpose")}
        options = []
        if location in initializers:
            options.append({"initializer": location, "transpose": transpose, **extra})
        if f"{location}_Q{bits}" in specs:
            options.append(
                {
                    "initializer": f"{location}_Q{bits}",
                    "transpose": transpose,
                    **extra,
                    "quantized": specs[f"{location}_Q{bits}"],
                }
            )
        if name in prefer_quantized and weights[name].ndim == 2 and not extra:
            head = np.ascontiguousarray(weights[name].T)
            copy_name = copies.get(array_digest(head))
            if copy_name is not None and f"{copy_name}_Q{bits}" in specs:
                options.insert(
                    0,
                    {
                        "initializer": f"{copy_name}_Q{bits}",
                        "transpose": True,
                        "quantized": specs[f"{copy_name}_Q{bits}"],
                    },
                )
            options.sort(key=lambda option: "quantized" not in option)
        if not options:
            raise ModelFileError(
                f"weight {name!r}: its initializer {entry['initializer']!r} is neither kept nor "
                "quantized; the eager reference could not be rebuilt"
            )
        chosen = options[0]
        if "quantized" in chosen:
            spec = chosen["quantized"]
            rebuilt = _reconstruct(dequantize_weight(initializers, spec), chosen)
            step = _reconstruct(_step(spec, initializers), chosen)
            # Round-to-nearest is off by at most half a step (0.51 absorbs float32 rounding of the scale); HQQ
            # moves scale and zero point to lower the overall error, so only the block's range bounds it.
            bound = 0.51 if algorithm == "rtn" else 2.0**bits
            if rebuilt.shape != weights[name].shape or not np.all(
                np.abs(rebuilt - weights[name]) <= bound * step + 1e-7
            ):
                raise ModelFileError(
                    f"weight {name!r}: its {bits}-bit MatMulNBits weight {spec['weight']!r} does "
                    f"not dequantize to within {bound} steps of the float weight"
                )
        mapping[name] = chosen
    return mapping


def quantized_spec(node) -> dict:
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
    return spec


def dequantize_weight(initializers: dict, spec: dict) -> np.ndarray:
    """The float32 [K, N] matrix the MatMulNBits weight described by `spec` stands for (see `dequantize_nbits`);
    `initializers` maps names to TensorProtos or arrays."""
    from onnx import numpy_helper

    def array(name):  # TensorProtos, or arrays already read from external data
        value = initializers[name]
        return value if isinstance(value, np.ndarray) else numpy_helper.to_array(value)

    zero_points = spec.get("zero_points")
    return dequantize_nbits(
        array(spec["weight"]),
        array(spec["scales"]),
        None if zero_points is None else array(zero_points),
        bits=spec["bits"],
        block_size=spec["block_size"],
        k=spec["K"],
        n=spec["N"],
    ).astype(np.float32, copy=False)


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


def _step(spec: dict, initializers: dict) -> np.ndarray:
    """[K, N]: the quantization step (scale) of each element's block."""
    from onnx import numpy_helper

    k, n, block = spec["K"], spec["N"], spec["block_size"]
    scales = numpy_helper.to_array(initializers[spec["scales"]]).reshape(n, -1).astype(np.float32)
    return np.repeat(scales.T, block, axis=0)[:k]


def quantizer_version(algorithm: str) -> dict:
    import onnxruntime

    described = {
        "rtn": "DEFAULT (round-to-nearest, asymmetric, uint8 zero points, block-wise along K)",
        "hqq": "HQQ (half-quadratic, float zero points, block-wise along K)",
    }
    return {
        "tool": "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer",
        "algorithm": described[algorithm],
        "onnxruntime": onnxruntime.__version__,
    }
