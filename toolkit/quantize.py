"""Weight-only int4/int8 quantization of an artifact with ONNX Runtime's MatMulNBits.

Pipeline (one graph at a time):
  inline the custom-domain functions (onnx.inliner) -> fold Transpose nodes of
  constant weights (SwiGLU's body transposes its [out, in] weights) -> ONNX
  Runtime's MatMulNBitsQuantizer (round-to-nearest, block-wise along K) ->
  a normal artifact directory, written atomically.

Only MatMul nodes whose B is a constant initializer are quantized (the
projections and the LM head); attention's activation x activation MatMuls,
the embedding Gather and the norm gains stay float32. Graph inputs and outputs
(stages or the KV-cache serving graph) are unchanged.

Eager reference of a quantized artifact: the model rebuilt with the
DEQUANTIZED weights (w = (q - zero_point) * scale, see `dequantize_weight`),
i.e. exactly the function the quantized graph is meant to compute. So
`toolkit check` on a quantized artifact checks the ONNX graph against that
model with the usual tolerances; the loss against the float model is a
separate, reported quantity (`quality`): logit error, greedy-token agreement
and perplexity, float vs quantized, both on ONNX Runtime CPU.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.ops import CUSTOM_DOMAIN
from toolkit import artifacts
from toolkit.errors import ConfigError, ModelFileError

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

# Quality evaluation: fixed so two runs (or two quantizations) report comparable numbers.
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at a temperature of",
)
PERPLEXITY_TEXT = (
    "The quick brown fox jumps over the lazy dog. Machine learning models learn patterns from data, "
    "and a language model predicts the next word from the words before it. Quantization stores each "
    "weight with fewer bits, which saves memory and time, at some cost in accuracy."
)
GREEDY_TOKENS = 16
SEED = 0  # token ids of prompts and text for artifacts without a tokenizer


@dataclass
class QuantizeResult:
    artifact: artifacts.Artifact
    quality: dict
    quantized_weights: int


def quantize_artifact(source_dir, out_dir, *, bits: int, block_size: int = 32, accuracy_level: int = 0,
                      algorithm: str = "rtn", greedy_tokens: int = GREEDY_TOKENS) -> QuantizeResult:
    """Quantize every constant-weight MatMul of the artifact at `source_dir` into `out_dir` (atomically)."""
    if bits not in BITS:
        raise ConfigError(f"--bits: expected one of {', '.join(map(str, BITS))}, got {bits!r}")
    if block_size not in BLOCK_SIZES:
        raise ConfigError(f"--block-size: expected one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size!r}")
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"--algorithm: expected one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if algorithm == "hqq" and bits != 4:
        raise ConfigError(f"--algorithm hqq with --bits {bits}: HQQ's float zero points are supported by ONNX Runtime's "
                          "CPU MatMulNBits at 4 bits only; use --algorithm rtn for 8 bits")
    if accuracy_level not in ACCURACY_LEVELS:
        raise ConfigError(f"--accuracy-level: expected one of {ACCURACY_LEVELS}, got {accuracy_level!r}")
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    source = artifacts.load_artifact(source_dir)
    if source.directory is None:
        raise ModelFileError(f"{source_dir}: a lone .onnx file; pass the artifact directory from `toolkit export`")
    if source.manifest.get("quantization"):
        raise ModelFileError(f"{source_dir}: already quantized ({source.manifest['quantization']['bits']}-bit); "
                             "quantize the float artifact it came from")
    _check_language_model(source)
    if out_dir.resolve() == source_dir.resolve():
        raise ModelFileError(f"--out {out_dir} is the source artifact; choose another directory")
    artifacts.check_output_dir(out_dir)  # before the slow part

    manifest = copy.deepcopy(source.manifest)
    files: dict[str, bytes] = {}
    total, untied = 0, False
    for entry, graph in zip(manifest["graphs"], source.graphs):
        proto = artifacts.load_onnx(graph.model_path)
        weights = _torch_weights(proto, graph.weights)
        prepared, folded = prepare_proto(proto)
        proto, count = quantize_proto(prepared, bits=bits, block_size=block_size, accuracy_level=accuracy_level,
                                      algorithm=algorithm)
        total += count
        entry["weights"] = _weight_map(graph.weights, folded, prepared, proto, weights, bits, prefer_quantized=(HEAD,),
                                       algorithm=algorithm)
        del prepared
        if manifest["config"].get("tie_embeddings") and "quantized" in entry["weights"].get(HEAD, {}):
            # The graph multiplies by a quantized copy of the embedding while Gather reads the float one:
            # two different matrices, so the model this artifact describes has an untied head.
            manifest["config"]["tie_embeddings"] = False
            untied = True
        entry["custom_ops"] = sorted({n.op_type for n in proto.graph.node if n.domain == CUSTOM_DOMAIN})
        files[entry["file"]] = proto  # serialised below, once the manifest is final
    if total == 0:
        raise ModelFileError(f"{source_dir}: no MatMul with a constant weight to quantize")
    manifest["custom_ops"] = sorted({op for e in manifest["graphs"] for op in e["custom_ops"]})
    manifest["quantization"] = {
        "bits": bits,
        "block_size": block_size,
        "symmetric": False,
        "algorithm": algorithm,
        "accuracy_level": accuracy_level,
        "quantized_matmuls": total,
        "quantizer": _quantizer_version(algorithm),
        "source": {"directory": str(source_dir.resolve()),
                   "manifest_sha256": artifacts.sha256_file(source_dir / artifacts.MANIFEST_FILE)},
        "eager_reference": "the model rebuilt with the dequantized weights",
        "untied_head": untied,
    }
    extra = {name: (source_dir / name).read_bytes() for name in manifest.get("extra_files") or {}}

    # Evaluate the quantized graphs from a scratch artifact, then write the final one (quality in its manifest).
    artifacts.check_output_dir(out_dir)
    parent = out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.eval-", dir=parent) as scratch:
        scratch_dir = Path(scratch) / "artifact"
        artifacts.write_artifact(scratch_dir, _serialise(manifest, files, extra))
        quality = evaluate_quality(source, artifacts.load_artifact(scratch_dir), greedy_tokens=greedy_tokens)
    manifest["quantization"]["quality"] = quality
    artifacts.write_artifact(out_dir, _serialise(manifest, files, extra), verify=artifacts.load_artifact)
    return QuantizeResult(artifacts.load_artifact(out_dir), quality, total)


def _check_language_model(artifact: artifacts.Artifact) -> None:
    if len(artifact.graphs) != 1:
        raise ModelFileError(f"{artifact.location}: {artifact.family} artifacts have {len(artifact.graphs)} graphs; "
                             "quantize supports decoder-only language models (one graph, input_ids -> logits)")
    graph = artifact.graphs[0]
    names = [s["name"] for s in graph.input_specs]
    if "input_ids" not in names or "logits" not in graph.output_names:
        raise ModelFileError(f"{artifact.location}: a {artifact.family} artifact with inputs {names}; quantize "
                             "supports decoder-only language models (input_ids -> logits)")


def _serialise(manifest: dict, protos: dict, extra: dict[str, bytes]) -> dict[str, bytes]:
    manifest = copy.deepcopy(manifest)
    files = {}
    for entry in manifest["graphs"]:
        proto = protos[entry["file"]]
        del proto.metadata_props[:]
        embedded = {k: v for k, v in manifest.items() if k != "quantization"}
        embedded["quantization"] = {k: v for k, v in manifest["quantization"].items() if k != "quality"}
        proto.metadata_props.add(key=artifacts.METADATA_KEY, value=json.dumps(dict(embedded, graph=entry["name"]),
                                                                             sort_keys=True))
        data = proto.SerializeToString()
        entry["sha256"] = artifacts.sha256_bytes(data)
        files[entry["file"]] = data
    files.update(extra)
    files[artifacts.MANIFEST_FILE] = (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()
    return files


def prepare_proto(proto):
    """(graph, {initializer: its folded transpose}): custom-domain functions inlined and constant transposes
    folded, so weights are MatMul's constant B."""
    import onnx.inliner

    proto = onnx.inliner.inline_local_functions(proto)
    del proto.functions[:]
    kept = [o for o in proto.opset_import if o.domain != CUSTOM_DOMAIN]
    del proto.opset_import[:]
    proto.opset_import.extend(kept)
    folded = fold_constant_transposes(proto)
    return proto, folded


def quantize_proto(proto, *, bits: int, block_size: int, accuracy_level: int = 0, algorithm: str = "rtn"):
    """(quantized ModelProto, number of MatMulNBits nodes) of a prepared graph (see prepare_proto)."""
    import onnx

    proto = copy.deepcopy(proto)
    try:
        from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer
    except ImportError as exc:
        raise ConfigError(f"onnxruntime's quantization tooling is not importable ({exc}); install onnxruntime") from None
    # The quantizer logs every node it visits at INFO; the command prints its own summary.
    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)
    if algorithm == "hqq":
        from onnxruntime.quantization.matmul_nbits_quantizer import HQQWeightOnlyQuantConfig

        config = HQQWeightOnlyQuantConfig(block_size=block_size, bits=bits)
        quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, algo_config=config)
    else:
        quantizer = MatMulNBitsQuantizer(proto, bits=bits, block_size=block_size, is_symmetric=False,
                                         accuracy_level=accuracy_level or None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HQQ wraps read-only numpy weights in torch tensors; it only reads them
        quantizer.process()
    result = quantizer.model.model
    if accuracy_level:  # the HQQ path does not set it
        for node in result.graph.node:
            if node.op_type == "MatMulNBits" and not any(a.name == "accuracy_level" for a in node.attribute):
                node.attribute.append(onnx.helper.make_attribute("accuracy_level", accuracy_level))
    count = sum(1 for n in result.graph.node if n.op_type == "MatMulNBits")
    onnx.checker.check_model(result)
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


def _torch_weights(proto, weight_map: dict) -> dict[str, np.ndarray]:
    """{torch weight name: array in torch layout} from the source graph's initializers."""
    from onnx import numpy_helper

    initializers = {init.name: init for init in proto.graph.initializer}
    return {name: _reconstruct(numpy_helper.to_array(initializers[entry["initializer"]]), entry)
            for name, entry in weight_map.items()}


def _weight_map(source_map: dict, folded: dict[str, str], prepared, quantized, weights: dict[str, np.ndarray],
                bits: int, prefer_quantized: tuple[str, ...] = (), algorithm: str = "rtn") -> dict[str, dict]:
    """Where each torch weight lives after quantization, following the initializers it was stored in.

    A source initializer may have been replaced by its folded transpose (prepare_proto), then by the
    quantizer's `<name>_Q<bits>` MatMulNBits weight; a weight's slice (fused initializers) carries over,
    since the dequantized B has the stored float layout. A quantized location is accepted only if it
    reconstructs the float weight to within half a quantization step. Names in prefer_quantized (the
    LM head) take a quantized location when one holds their values: a tied head's source entry points at
    the embedding table, while the graph multiplies by a separate (now quantized) transposed copy.
    """
    from onnx import numpy_helper

    initializers = {init.name: init for init in quantized.graph.initializer}
    specs = {quantized_spec(n)["weight"]: quantized_spec(n) for n in quantized.graph.node if n.op_type == "MatMulNBits"}
    transposed_copies: dict[tuple, str] = {}  # head search: float32 bytes of prepared initializers
    if prefer_quantized:
        for init in prepared.graph.initializer:
            if init.data_type in FLOAT_TYPES and f"{init.name}_Q{bits}" in specs:
                array = numpy_helper.to_array(init)
                transposed_copies[artifacts.array_digest(array)] = init.name
    mapping = {}
    for name, entry in source_map.items():
        location, transpose = entry["initializer"], bool(entry.get("transpose"))
        if location in folded:
            location, transpose = folded[location], not transpose
        extra = {k: v for k, v in entry.items() if k not in ("initializer", "transpose")}
        options = []
        if location in initializers:
            options.append({"initializer": location, "transpose": transpose, **extra})
        if f"{location}_Q{bits}" in specs:
            options.append({"initializer": f"{location}_Q{bits}", "transpose": transpose, **extra,
                            "quantized": specs[f"{location}_Q{bits}"]})
        if name in prefer_quantized and weights[name].ndim == 2 and not extra:
            head = np.ascontiguousarray(weights[name].T)
            copy_name = transposed_copies.get(artifacts.array_digest(head))
            if copy_name is not None:
                options.insert(0, {"initializer": f"{copy_name}_Q{bits}", "transpose": True,
                                   "quantized": specs[f"{copy_name}_Q{bits}"]})
            options.sort(key=lambda option: "quantized" not in option)
        if not options:
            raise ModelFileError(f"weight {name!r}: its initializer {entry['initializer']!r} is neither kept nor "
                                 "quantized; the eager reference could not be rebuilt")
        chosen = options[0]
        if "quantized" in chosen:
            spec = chosen["quantized"]
            rebuilt = _reconstruct(dequantize_weight(initializers, spec), chosen)
            step = _reconstruct(_step(spec, initializers), chosen)
            # Round-to-nearest is off by at most half a step (0.51 absorbs float32 rounding of the scale); HQQ
            # moves scale and zero point to lower the overall error, so only the block's range bounds it.
            bound = 0.51 if algorithm == "rtn" else 2.0 ** bits
            if rebuilt.shape != weights[name].shape or not np.all(np.abs(rebuilt - weights[name]) <= bound * step + 1e-7):
                raise ModelFileError(f"weight {name!r}: its {bits}-bit MatMulNBits weight {spec['weight']!r} does "
                                     f"not dequantize to within {bound} steps of the float weight")
        mapping[name] = chosen
    return mapping


def quantized_spec(node) -> dict:
    attrs = {a.name: a.i for a in node.attribute}
    spec = {"weight": node.input[1], "scales": node.input[2], "bits": attrs["bits"], "block_size": attrs["block_size"],
            "K": attrs["K"], "N": attrs["N"]}
    if len(node.input) > 3 and node.input[3]:
        spec["zero_points"] = node.input[3]
    return spec


def dequantize_weight(initializers: dict, spec: dict) -> np.ndarray:
    """The float32 [K, N] matrix a MatMulNBits B stands for: w = (q - zero_point) * scale, per K-block.

    Layout (com.microsoft MatMulNBits): B [N, blocks, block_size * bits / 8] uint8, values in K order,
    4-bit values two per byte low nibble first; scales [N, blocks]; zero points uint8 packed the same way,
    or float [N, blocks] (HQQ), default 2^(bits-1) when absent.
    """
    from onnx import numpy_helper

    bits, block, k, n = spec["bits"], spec["block_size"], spec["K"], spec["N"]
    blocks = -(-k // block)
    packed = numpy_helper.to_array(initializers[spec["weight"]]).reshape(n, blocks, -1)
    values = _unpack(packed, bits).reshape(n, blocks, block).astype(np.float32)
    scales = numpy_helper.to_array(initializers[spec["scales"]]).reshape(n, blocks).astype(np.float32)
    if "zero_points" in spec:
        zp_raw = numpy_helper.to_array(initializers[spec["zero_points"]]).reshape(n, -1)
        if zp_raw.dtype == np.uint8:
            zero = _unpack(zp_raw, bits)[:, :blocks].astype(np.float32)
        else:  # float zero points (HQQ): one per block, not packed
            zero = zp_raw[:, :blocks].astype(np.float32)
    else:
        zero = np.full((n, blocks), 2 ** (bits - 1), dtype=np.float32)
    weight = (values - zero[..., None]) * scales[..., None]  # (N, blocks, block)
    return np.ascontiguousarray(weight.reshape(n, blocks * block)[:, :k].T)  # (K, N)


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


def _quantizer_version(algorithm: str) -> dict:
    import onnxruntime

    described = {"rtn": "DEFAULT (round-to-nearest, asymmetric, uint8 zero points, block-wise along K)",
                 "hqq": "HQQ (half-quadratic, float zero points, block-wise along K)"}
    return {"tool": "onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer",
            "algorithm": described[algorithm], "onnxruntime": onnxruntime.__version__}


# --------------------------------------------------------------------------- quality


def evaluate_quality(float_artifact: artifacts.Artifact, quantized_artifact: artifacts.Artifact, *,
                     greedy_tokens: int = GREEDY_TOKENS) -> dict:
    """Quantized vs float, both on ONNX Runtime CPU, on fixed prompts and a fixed text.

    - logits: max / mean abs difference over every position of the prompts + greedy continuations;
    - greedy agreement: the float model's greedy continuation of each prompt is fed to both models
      (teacher forcing); the fraction of those positions where the quantized arg-max equals the float one;
    - perplexity of each model on a fixed text (next-token, natural log base e).
    """
    from runners.registry import create_runner

    config = float_artifact.config()
    float_runner = create_runner("ort-cpu", float_artifact)
    quant_runner = create_runner("ort-cpu", quantized_artifact)
    prompts, text_ids, tokenized = _fixed_inputs(float_artifact, config)
    budget = config.max_positions
    max_diff, sum_diff, count_diff, agree, positions = 0.0, 0.0, 0, 0, 0
    for prompt in prompts:
        prompt = prompt[: max(budget - 1, 1)]
        steps = max(min(greedy_tokens, budget - len(prompt)), 0)
        sequence = list(prompt)
        for _ in range(steps):  # greedy continuation by the float model (full recompute: tiny and exact)
            logits = _logits(float_runner, sequence)
            sequence.append(int(np.argmax(logits[-1])))
        fed = sequence[:-1] if steps else sequence
        float_logits, quant_logits = _logits(float_runner, fed), _logits(quant_runner, fed)
        diff = np.abs(float_logits.astype(np.float64) - quant_logits)
        max_diff = max(max_diff, float(diff.max()))
        sum_diff += float(diff.sum())
        count_diff += diff.size
        if steps:
            window = slice(len(prompt) - 1, len(fed))
            agree += int(np.sum(np.argmax(float_logits[window], -1) == np.argmax(quant_logits[window], -1)))
            positions += len(fed) - len(prompt) + 1
    text_ids = text_ids[:budget]
    return {
        "prompts": len(prompts),
        "inputs": "tokenizer" if tokenized else f"fixed token ids (seed {SEED}), no tokenizer in the artifact",
        "greedy_tokens_per_prompt": greedy_tokens,
        "logits_max_abs": max_diff,
        "logits_mean_abs": sum_diff / max(count_diff, 1),
        "greedy_agreement": agree / positions if positions else float("nan"),
        "greedy_positions": positions,
        "perplexity_tokens": len(text_ids) - 1,
        "perplexity_float": _perplexity(_logits(float_runner, text_ids), text_ids),
        "perplexity_quantized": _perplexity(_logits(quant_runner, text_ids), text_ids),
    }


def _fixed_inputs(artifact: artifacts.Artifact, config):
    directory = artifact.directory
    if directory is not None and (directory / "tokenizer.json").is_file():
        from models.tokenizer import TextTokenizer

        tokenizer = TextTokenizer.from_artifact(directory)
        return [tokenizer.encode(p) for p in PROMPTS], tokenizer.encode(PERPLEXITY_TEXT), True
    rng = np.random.default_rng(SEED)
    prompt_length = max(min(8, config.max_positions // 4), 1)
    prompts = [rng.integers(0, config.vocab_size, prompt_length).tolist() for _ in PROMPTS]
    return prompts, rng.integers(0, config.vocab_size, config.max_positions).tolist(), False


def _logits(runner, ids: list[int]) -> np.ndarray:
    """Logits [T, V] of one sequence fed in one call (empty cache for KV-cache graphs)."""
    from models.registry import lm_defaults

    feed = np.asarray([ids], dtype=np.int64)
    return runner.run({"input_ids": feed, **lm_defaults(runner.input_specs, feed)})["logits"][0]


def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    # ppl = exp(mean_t -log softmax(logits_t)[ids_{t+1}]), in float64
    logits = logits[:-1].astype(np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    nll = -log_probs[np.arange(len(ids) - 1), np.asarray(ids[1:])]
    return float(math.exp(nll.mean()))
