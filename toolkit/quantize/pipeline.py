"""`toolkit quantize`: weight-only int4/int8 quantization of an artifact, and its measured quality.

The graph rewrite (MatMulNBits, dequantization, the weight map) is exporters/quantize.py;
this module checks the source, writes the artifact atomically and evaluates it. Two kinds of
recipe: rtn and hqq round the float weights (ONNX Runtime's quantizers); gguf takes an artifact's
weights from the blocks of the GGUF it was exported from, as they are (gguf_recipe.py).

Eager reference of a quantized artifact: the model rebuilt with the DEQUANTIZED weights
(w = (q - zero_point) * scale), i.e. exactly the function the quantized graph is meant to
compute. So `toolkit check` on a quantized artifact checks the ONNX graph against that
model with the usual tolerances; the loss against the float model is a separate, reported
quantity (`quality`): logit error, greedy-token agreement and perplexity, float vs
quantized, both on ONNX Runtime CPU.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from artifact.errors import ConfigError, ModelFileError
from artifact.format import CUSTOM_DOMAIN, MANIFEST_FILE, Artifact
from artifact.hashing import sha256_file
from artifact.read import validate_onnx
from artifact.write import PendingWeights, check_output_dir, manifest_bytes, pack_artifact, write_artifact
from exporters.gguf_blocks import Q4_1_LAYOUTS
from exporters.gptq import DAMPING as GPTQ_DAMPING
from exporters.gptq import ZERO_POINTS as GPTQ_ZERO_POINTS
from exporters.gptq import gptq_blocks
from exporters.kquant import ZERO_POINT_MODES, kquant_blocks
from exporters.quantize import (
    ACCURACY_LEVELS,
    ALGORITHMS,
    BITS,
    BLOCK_SIZES,
    HEAD,
    GraphWeights,
    constant_matmul_weights,
    head_copies,
    head_copy,
    prepare_proto,
    quantize_proto,
    quantize_proto_blocks,
    quantized_weight_map,
    quantizer_version,
    torch_weight,
)
from models.artifacts import artifact_config, open_artifact
from models.registry import has_cache
from toolkit.quantize.gguf_recipe import GGUFRecipe, gguf_recipe
from toolkit.quantize.importance import hessians, importance
from toolkit.quantize.rotation import FUNCTION_BOUND, rotate_artifact
from toolkit.quantize.sensitivity import (
    DEFAULT_CALIBRATION_SEED,
    PROMOTED_SHARE,
    calibration,
    measure,
    sampled_calibration,
)
from toolkit.quantize.tuning import TUNE_ROWS, TUNE_TOKENS, tune_scales

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
# --perplexity-text: a user's text, tokenized whole and cut into windows of PERPLEXITY_WINDOW tokens (fewer where
# the model's context is shorter), each fed alone; the first PERPLEXITY_TEXT_TOKENS tokens are measured. The fixed
# text above is 52 tokens with SmolLM2's tokenizer: too few to tell recipes a few percent apart.
PERPLEXITY_WINDOW = 512
PERPLEXITY_TEXT_TOKENS = 8192
# Tokens past the measured ones that a tokenized prefix must reach before it is taken (and a prefix one chunk longer
# must agree on the measured ones): the word cut at the prefix's end changes only tokens near it.
PERPLEXITY_TEXT_SLACK = 64
PERPLEXITY_TEXT_CHUNK = 1 << 16  # bytes read (hashed, decoded) at a time; tokenizing retries as the prefix grows
SEED = 0  # token ids of prompts and text for artifacts without a tokenizer


# gguf: the source GGUF's blocks as they are; kquant: the float weights to searched scales and float minimums
# (exporters/kquant.py); mixed: kquant with the vocabulary projection at 8 bits, as llama.cpp's Q4_K_M and
# Q4_1 files keep their output matrix wider; measured: mixed with the MatMul weights that move the model most
# at 4 bits (measured one by one, toolkit/quantize/sensitivity.py) at 8 bits too; rtn, hqq: the float weights
# re-rounded by ONNX Runtime's node quantizers.
KQUANT_RECIPES = ("kquant", "mixed", "measured")
# gptq: every MatMul weight (the vocabulary projection too) rounded by GPTQ (exporters/gptq.py), the rounding errors
# moved onto the input channels not yet rounded by E[x^T x] on the calibration text; integer zero points unless
# --zero-points offsets or auto (GPTQ_ZERO_POINTS, the first the default), so by default round-to-nearest's layout
# and speed.
GPTQ = "gptq"
# GPTQ's E[x^T x] needs many more tokens than a weight has input channels (up to a few thousand); the calibration
# text is about a hundred, so the float model continues it: GPTQ_ROWS sequences of GPTQ_TOKENS, sampled. On
# SmolLM2's permuted draw 0 (--rotate 0, four calibration seeds each) 64 rows against 8 lowered the median KL from
# float by 11 % and narrowed its range, and 32 rows fell between (README).
GPTQ_ROWS, GPTQ_TOKENS = 64, 256
RECIPES = ("gguf", *KQUANT_RECIPES, GPTQ, *ALGORITHMS)
HEAD_BITS = 8  # the mixed recipe's width for the vocabulary projection
# --head-bits: the vocabulary projection's width for the recipes that round it themselves. mixed and measured hold it
# at HEAD_BITS; kquant and gptq at --bits unless asked (gptq then keeps round-to-nearest's layout). SmolLM2's head is
# a fifth of its MatMul weights: over six draws of benchmarks/recipes_offgrid.py's proxies an 8-bit head lowers
# GPTQ's perplexity rise by 2.0-3.7 points in five and raises it by 0.3 in one.
HEAD_BITS_RECIPES = ("kquant", "mixed", "measured", "gptq")
# Without --recipe, float weights take the recipe that keeps the model best at each width without measuring it,
# on SmolLM2 with weights on and off a 4-bit grid (benchmarks/recipes_offgrid.py): mixed at 4 bits (rtn's
# perplexity rise is 3x mixed's); rtn at 8 bits, where a float minimum gains nothing measurable and its offsets
# cost decode time. measured keeps more off the grid but takes 1.6x the time and decodes at 0.89x mixed.
DEFAULT_RECIPES = {4: "mixed", 8: "rtn"}
# The k-quant recipes weight their search by each input channel's mean square unless --no-imatrix: on SmolLM2
# off the 4-bit grid (noise 0.08, benchmarks/recipes_offgrid.py) it cuts mixed's perplexity rise from 18 % to
# 4 % and on the grid changes nothing measurable, for one forward pass of the float model.
DEFAULT_IMATRIX = True
# The k-quant recipes' block minimum (exporters/kquant.py kquant_blocks): "integer" is MatMulNBits' own uint8 zero
# point, round-to-nearest's layout; "offsets" a float minimum, held as a block sum, a [blocks, N] MatMul and an Add
# beside each MatMulNBits; "auto" searches both and keeps integer zero points unless their importance-weighted
# error exceeds the float minimums' by AUTO_TOLERANCE: a weight whose loud input channels read small weights (only
# a float minimum can place a level on them), or a GGUF export's weights on its blocks' grid of float minimums
# (Q4_1, Q4_K), which only offsets recover. Off a 4-bit grid (SmolLM2 at noise 0.08, benchmarks/recipes_offgrid.py)
# integer zero points keep perplexity as well as offsets, and mixed with them decodes 1.30x faster on SmolLM2 and
# 1.22x at 1B (benchmarks/int4_vs_llamacpp.py).
ZERO_POINTS = ZERO_POINT_MODES
DEFAULT_ZERO_POINTS = "auto"
# int8 activations: ONNX Runtime's fast MatMulNBits kernels (level 0 has none for 8-bit or float-zero-point
# weights) and what llama.cpp computes with quantized weights. Level 0 stays a flag: toolkit check holds its
# graph to the dequantized weights exactly.
DEFAULT_ACCURACY_LEVEL = 4


@dataclass
class QuantizeResult:
    artifact: Artifact
    quality: dict
    quantized_weights: int
    recipe: str
    notes: list[str]  # hints for the user (printed by the command)


def quantize_artifact(source_dir, out_dir, **options) -> QuantizeResult:
    """_quantize_artifact, with what it holds until it returns (--rotate's float artifact) let go however it ends."""
    with contextlib.ExitStack() as stack:
        return _quantize_artifact(source_dir, out_dir, stack=stack, **options)


def _quantize_artifact(
    source_dir,
    out_dir,
    *,
    stack: contextlib.ExitStack,
    bits: int | None,
    block_size: int | None = None,
    accuracy_level: int | None = None,
    algorithm: str | None = None,
    recipe: str | None = None,
    q4_1: str | None = None,
    head_bits: int | None = None,
    promote_share: float | None = None,
    imatrix: bool | None = None,
    zero_points: str | None = None,
    rotate: int | None = None,
    tune_scales: int | None = None,
    calibration_seed: int | None = None,
    gptq_damping: float | None = None,
    greedy_tokens: int = GREEDY_TOKENS,
    perplexity_text=None,
    progress=None,
) -> QuantizeResult:
    """Quantize every constant-weight MatMul of the artifact at `source_dir` into `out_dir` (atomically).

    recipe: "gguf" takes each weight's blocks from the GGUF the artifact was exported from, as they are
    (toolkit/quantize/gguf_recipe.py; `bits`, if given, must be the GGUF's own width); "kquant", "mixed", "measured",
    "rtn" or "hqq" (the last two also spelled `algorithm`) quantize the float weights at `bits` and `block_size`
    (default 32). Unnamed, a GGUF export takes the gguf recipe where the file's blocks can be taken as they are
    at `bits`, and DEFAULT_RECIPES[bits] otherwise (the notes say why); any other artifact takes
    DEFAULT_RECIPES[bits]. accuracy_level: None is DEFAULT_ACCURACY_LEVEL (int8 activations) for every recipe;
    0 computes with float32 activations. q4_1: the GGUF recipe's Q4_1 layout (exporters/gguf_blocks.Q4_1_LAYOUTS;
    None is "offsets", bit for bit; the others are there to be measured). head_bits: the vocabulary projection's
    width for HEAD_BITS_RECIPES (None: HEAD_BITS for mixed and measured, `bits` for kquant and gptq). promote_share:
    the measured recipe's largest share of the MatMul weights' elements at 8 bits (default PROMOTED_SHARE). imatrix: weight the k-quant recipes' search by each input
    channel's mean square on a calibration text (toolkit/quantize/importance.py); None is DEFAULT_IMATRIX.
    zero_points: the k-quant recipes' and gptq's block minimum, "integer" (MatMulNBits' uint8 zero points),
    "offsets" (a float minimum added beside each MatMulNBits) or "auto" (per weight, ZERO_POINTS' comment, and
    for gptq by each weight's output error on the calibration text, exporters/gptq.py); None is DEFAULT_ZERO_POINTS for the k-quant recipes and "integer" for gptq. rotate: turn the residual stream by the rotation this
    seed draws (a randomized Hadamard matrix, rotation.rotation_matrix) before quantizing (toolkit/quantize/rotation.py: the same function in other
    weights), for the recipes that round float weights. tune_scales: fit each block's scale to the float model's
    next-token distributions in this many steps once the weights are rounded (toolkit/quantize/tuning.py), codes and
    zero points unchanged; not with the gguf recipe. calibration_seed: the seed of the sampler that writes the text
    gptq and tune_scales calibrate on (sampled_calibration; None is DEFAULT_CALIBRATION_SEED), refused where neither
    runs. gptq_damping: gptq's share of H's mean diagonal added to its diagonal (None is exporters/gptq.DAMPING),
    refused for the other recipes. perplexity_text: a UTF-8 text file on which the quality report measures perplexity
    (read_perplexity_text) in place of the fixed text.
    progress(message): called as each step starts."""
    progress = progress or (lambda message: None)
    named = recipe is not None or algorithm is not None
    recipe = _recipe(recipe, algorithm, block_size)
    if bits is not None and bits not in BITS:
        raise ConfigError(f"--bits: expected one of {', '.join(map(str, BITS))}, got {bits!r}")
    if block_size is not None and block_size not in BLOCK_SIZES:
        raise ConfigError(f"--block-size: expected one of {', '.join(map(str, BLOCK_SIZES))}, got {block_size!r}")
    if recipe in (*KQUANT_RECIPES, GPTQ, *ALGORITHMS) and bits is None:
        raise ConfigError(f"--bits is required with --recipe {recipe}")
    if recipe == "measured" and bits == 8:
        raise ConfigError("--recipe measured keeps chosen 4-bit weights at 8 bits; with --bits 8 use mixed or rtn")
    if head_bits is not None and recipe not in HEAD_BITS_RECIPES:
        raise ConfigError(
            f"--head-bits applies to --recipe {', '.join(HEAD_BITS_RECIPES)}, not "
            f"{recipe or 'the default recipe (name one with --recipe)'}"
        )
    if head_bits is not None and head_bits not in BITS:
        raise ConfigError(f"--head-bits: expected one of {', '.join(map(str, BITS))}, got {head_bits!r}")
    if head_bits is not None and bits is not None and head_bits < bits:
        raise ConfigError(f"--head-bits {head_bits} is narrower than --bits {bits}; give at least {bits}")
    if promote_share is not None and recipe != "measured":
        raise ConfigError(f"--promote-share applies to --recipe measured, not {recipe or 'the default recipe'}")
    if imatrix is not None and recipe not in KQUANT_RECIPES:
        raise ConfigError(
            f"--imatrix applies to --recipe {', '.join(KQUANT_RECIPES)}, not {recipe or 'the default recipe'}"
        )
    if zero_points is not None and zero_points not in ZERO_POINTS:
        raise ConfigError(f"--zero-points: expected one of {', '.join(ZERO_POINTS)}, got {zero_points!r}")
    if zero_points is not None and recipe not in (*KQUANT_RECIPES, GPTQ):
        raise ConfigError(
            f"--zero-points applies to --recipe {', '.join((*KQUANT_RECIPES, GPTQ))}, not "
            f"{recipe or 'the default recipe'}"
        )
    if promote_share is not None and not 0 < promote_share <= 1:
        raise ConfigError(f"--promote-share: expected a share in (0, 1], got {promote_share!r}")
    if recipe == "hqq" and bits != 4:
        raise ConfigError(
            f"--algorithm hqq with --bits {bits}: HQQ's float zero points are supported by ONNX Runtime's "
            "CPU MatMulNBits at 4 bits only; use --algorithm rtn for 8 bits"
        )
    if q4_1 is not None and q4_1 not in Q4_1_LAYOUTS:
        raise ConfigError(f"--q4-1: expected one of {', '.join(Q4_1_LAYOUTS)}, got {q4_1!r}")
    if q4_1 is not None and (recipe not in (None, "gguf") or block_size is not None):
        other = f"--recipe {recipe}" if recipe not in (None, "gguf") else f"--block-size {block_size}"
        raise ConfigError(
            f"--q4-1 {q4_1} applies to --recipe gguf (the default for a GGUF export), not with {other}; drop one of them"
        )
    if accuracy_level is not None and accuracy_level not in ACCURACY_LEVELS:
        raise ConfigError(f"--accuracy-level: expected one of {ACCURACY_LEVELS}, got {accuracy_level!r}")
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    source = open_artifact(source_dir)
    if source.directory is None:
        raise ModelFileError(f"{source_dir}: a lone .onnx file; pass the artifact directory from `toolkit export`")
    if source.manifest.quantization:
        raise ModelFileError(
            f"{source_dir}: already quantized ({source.manifest.quantization['bits']}-bit); "
            "quantize the float artifact it came from"
        )
    _check_language_model(source)
    text = None if perplexity_text is None else read_perplexity_text(source, perplexity_text)
    if out_dir.resolve() == source_dir.resolve():
        raise ModelFileError(f"--out {out_dir} is the source artifact; choose another directory")
    check_output_dir(out_dir)  # before the slow part
    gguf, notes = _gguf_source(source, recipe, bits, q4_1 or "offsets", not named and block_size is None)
    if q4_1 is not None and gguf is None:
        why = notes[-1].removeprefix("note: ") if notes else "it was not exported from a GGUF file"
        raise ConfigError(f"--q4-1 {q4_1} applies to the gguf recipe, which cannot take this artifact: {why}")
    if gguf is None and bits is None:
        why = f" ({notes[-1].removeprefix('note: ')})" if notes else ""
        raise ConfigError(f"--bits is required{why}")
    recipe = "gguf" if gguf is not None else recipe or DEFAULT_RECIPES[bits]
    if rotate is not None and recipe == "gguf":
        raise ConfigError(
            "--rotate turns the float weights, so they would no longer be the GGUF's blocks; name a recipe that "
            "rounds float weights (--recipe gptq)"
        )
    if tune_scales is not None and recipe == "gguf":
        raise ConfigError(
            "--tune-scales moves the blocks' scales, so they would no longer be the GGUF's; name a recipe that "
            "rounds float weights (--recipe gptq)"
        )
    if tune_scales is not None and tune_scales < 1:
        raise ConfigError(f"--tune-scales: expected a number of steps of at least 1, got {tune_scales!r}")
    sampled = recipe == GPTQ or tune_scales is not None  # the steps that calibrate on a text the float model writes
    if calibration_seed is not None and not sampled:
        raise ConfigError(
            f"--calibration-seed seeds the text that --recipe gptq and --tune-scales calibrate on; --recipe {recipe} "
            "without --tune-scales writes none: drop --calibration-seed"
        )
    if calibration_seed is not None and calibration_seed < 0:
        raise ConfigError(f"--calibration-seed: expected a seed of at least 0, got {calibration_seed!r}")
    if sampled and calibration_seed is None:
        calibration_seed = DEFAULT_CALIBRATION_SEED
    if gptq_damping is not None and recipe != GPTQ:
        raise ConfigError(f"--gptq-damping is GPTQ's; --recipe {recipe} does not run GPTQ: drop --gptq-damping")
    if gptq_damping is not None and not 0 < gptq_damping < float("inf"):
        raise ConfigError(f"--gptq-damping: expected a finite share of H's mean diagonal above 0, got {gptq_damping!r}")
    if recipe == GPTQ and gptq_damping is None:
        gptq_damping = GPTQ_DAMPING
    imatrix = (DEFAULT_IMATRIX if imatrix is None else imatrix) and recipe in KQUANT_RECIPES
    if recipe in KQUANT_RECIPES:
        zero_points = zero_points or DEFAULT_ZERO_POINTS
    elif recipe == GPTQ:
        zero_points = zero_points or GPTQ_ZERO_POINTS[0]
    else:
        zero_points = None
    algorithm = "rtn" if recipe == "gguf" else recipe
    if recipe in HEAD_BITS_RECIPES and head_bits is None:
        head_bits = bits if recipe in ("kquant", GPTQ) else HEAD_BITS
    block_size = block_size or 32
    if accuracy_level is None:
        accuracy_level = DEFAULT_ACCURACY_LEVEL
    float_source, rotation = source, None
    if rotate is not None:
        source, rotation = _rotated(source, out_dir, rotate, stack, progress)

    manifest = copy.deepcopy(source.manifest.to_dict())
    files: dict[str, object] = {}
    pending = PendingWeights()  # the quantized graphs' weights, held beside them until written
    total, untied, promotion = 0, False, None
    chosen = {"integer": 0, "offsets": 0}  # the k-quant weights' zero points, as made
    texts = {}  # {(rows, tokens, seed): the token ids of a sampled calibration text}, so the fit reuses GPTQ's
    for k, (entry, graph) in enumerate(zip(manifest["graphs"], source.graphs, strict=False)):
        progress(f"reading graph {k + 1} of {len(source.graphs)} ({graph.model_path.name})")
        proto = validate_onnx(graph.model_path)  # without its external data: weights are read one at a time
        base_dir = str(graph.model_path.parent)
        originals = GraphWeights(proto, base_dir, graph.model_path)
        weights = GraphWeights(proto, base_dir, graph.model_path, pending)
        prepared, folded = prepare_proto(proto, weights)
        matmul_b = {n.input[1] for n in prepared.graph.node if n.op_type == "MatMul" and len(n.input) > 1}
        head = graph.entry.data["weights"].get(HEAD)
        copies = head_copies(weights, matmul_b, None if head is None else torch_weight(originals, head))
        matmuls = sum(1 for n in prepared.graph.node if n.op_type == "MatMul")
        blocks, bounds = None, None
        if gguf is not None:  # every MatMul weight is planned before any is converted
            blocks = gguf.blocks(prepared, weights, graph.entry.data["weights"], folded, copies, originals)
            progress(f"taking {graph.model_path.name}'s {matmuls} MatMul weights from {gguf.path.name}'s blocks")
            bounds = gguf.bounds
        elif recipe in KQUANT_RECIPES:
            head_b = None if head is None else head_copy(copies, torch_weight(originals, head))
            wide = {head_b}  # not measured by the measured recipe
            weighted = {}
            # The float model is built once for both (and let go before the weights are quantized).
            calibrated = calibration(source) if imatrix or recipe == "measured" else None
            if imatrix:
                progress(f"measuring the input channels of {matmuls} MatMul weights on a calibration text")
                weighted = importance(calibrated, matmul_b, graph.entry.data["weights"], folded)
            if recipe == "measured":
                progress(f"measuring each of {matmuls} MatMul weights' effect at {bits} bits on the float model")
                source_map = graph.entry.data["weights"]
                share = PROMOTED_SHARE if promote_share is None else promote_share
                promotion = measure(
                    calibrated,
                    weights,
                    matmul_b - wide,
                    source_map,
                    folded,
                    bits=bits,
                    block_size=block_size,
                    share=share,
                    importance=weighted,
                    zero_points=zero_points,
                )
                wide |= promotion.promoted
            del calibrated

            def blocks(
                b,
                weights=weights,
                wide=wide,
                made=promotion.four_bit if promotion else {},
                weighted=weighted,
                head_b=head_b,
            ):
                if b in made:
                    weight = made.pop(b)
                else:
                    width = head_bits if b == head_b else HEAD_BITS if b in wide else bits
                    weight = kquant_blocks(weights.array(b), width, block_size, weighted.get(b), zero_points)
                chosen["integer" if weight.offsets is None else "offsets"] += 1
                return weight

            progress(f"quantizing {graph.model_path.name}: {matmuls} MatMuls to {bits}-bit ({recipe}, k-quant search)")
        elif recipe == GPTQ:
            head_b = None if head is None else head_copy(copies, torch_weight(originals, head))
            constant = set(constant_matmul_weights(prepared, weights))
            order = [n.input[1] for n in prepared.graph.node if n.op_type == "MatMul" and n.input[1] in constant]
            blocks = _gptq(
                source, weights, constant, graph.entry.data["weights"], folded, head_b, progress, order=order,
                bits=bits, head_bits=head_bits, block_size=block_size, zero_points=zero_points, chosen=chosen,
                seed=calibration_seed, texts=texts, damping=gptq_damping,
            )  # fmt: skip
            progress(f"quantizing {graph.model_path.name}: {matmuls} MatMuls to {bits}-bit (GPTQ)")
        if blocks is not None:
            quantized, count = quantize_proto_blocks(prepared, weights, blocks, accuracy_level=accuracy_level)
        else:
            progress(f"quantizing {graph.model_path.name}: {matmuls} MatMuls to {bits}-bit ({algorithm})")
            quantized, count = quantize_proto(
                prepared, weights, bits=bits, block_size=block_size, accuracy_level=accuracy_level, algorithm=algorithm
            )
        total += count
        entry["weights"] = quantized_weight_map(
            graph.entry.data["weights"],
            folded,
            copies,
            quantized,
            weights,
            originals,
            bits if gguf is None else gguf.bits,
            prefer_quantized=(HEAD,),
            algorithm=algorithm,
            bounds=bounds,
        )
        weights.detach(quantized)  # the float tensors that stay are read from the source now
        del originals, proto
        if manifest["config"].get("tie_embeddings") and "quantized" in entry["weights"].get(HEAD, {}):
            # The graph multiplies by a quantized copy of the embedding while Gather reads the float one:
            # two different matrices, so the model this artifact describes has an untied head.
            manifest["config"]["tie_embeddings"] = False
            untied = True
        entry["custom_ops"] = sorted({n.op_type for n in quantized.graph.node if n.domain == CUSTOM_DOMAIN})
        files[entry["name"]] = quantized  # serialised below, once the manifest is final
    if total == 0:
        raise ModelFileError(f"{source_dir}: no MatMul with a constant weight to quantize")
    manifest["custom_ops"] = sorted({op for e in manifest["graphs"] for op in e["custom_ops"]})
    recipe = "gguf" if gguf is not None else algorithm
    manifest["quantization"] = {
        "recipe": recipe,
        "bits": gguf.bits if gguf is not None else bits,
        "block_size": block_size,
        "symmetric": False,
        "algorithm": recipe,
        "accuracy_level": accuracy_level,
        "quantized_matmuls": total,
        "quantizer": gguf.version() if gguf is not None else quantizer_version(algorithm, imatrix, zero_points),
        "source": {"directory": str(source_dir.resolve()), "manifest_sha256": sha256_file(source_dir / MANIFEST_FILE)},
        "head_bits": head_bits,  # the vocabulary projection's width where the recipe rounds it itself, else None
        "imatrix": imatrix,  # the k-quant search weighted by each input channel's mean square
        "zero_points": zero_points,  # k-quant and gptq block minimums: integer zero points, float offsets or auto
        "calibration_seed": calibration_seed,  # the sampled calibration text's seed where gptq or the fit used one
        "gptq_damping": gptq_damping,  # gptq's share of H's mean diagonal added to its diagonal, else None
        "eager_reference": "the model rebuilt with the dequantized weights",
        "untied_head": untied,
    }
    if gguf is not None:
        manifest["quantization"]["gguf"] = gguf.report()
    if promotion is not None:
        manifest["quantization"]["promotion"] = promotion.report()
    if zero_points is not None:
        manifest["quantization"]["zero_points_chosen"] = chosen  # {"integer": weights, "offsets": weights}
    if rotation is not None:
        manifest["quantization"]["rotation"] = rotation
    extra = {name: (source_dir / name).read_bytes() for name in manifest.get("extra_files") or {}}

    # The quantized artifact is written once, to a scratch directory beside out_dir, and its graphs and weights
    # let go of before it is measured; the measured files are then moved into out_dir with the quality report
    # added to manifest.json (the graphs embed the manifest without it, so they are the same bytes).
    check_output_dir(out_dir)
    parent = out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.eval-", dir=parent) as scratch:
        scratch_dir = Path(scratch) / "artifact"
        progress(f"writing the {total} quantized weights")
        write_artifact(scratch_dir, _serialise(manifest, files, extra, pending))
        del files, pending
        fitted = None
        if tune_scales is not None:
            sampled_text = texts.get((TUNE_ROWS, TUNE_TOKENS, calibration_seed))
            scratch_dir, fitted = _tuned(
                source, scratch_dir, Path(scratch) / "tuned", tune_scales, calibration_seed, progress, sampled_text
            )
        progress("measuring logits error, greedy agreement, perplexity and KL against the float model on ort-cpu")
        measured = open_artifact(scratch_dir)
        log_probs = Path(scratch) / "float-log-probs"  # beside the artifact, as large as the text's float logits
        quality = evaluate_quality(float_source, measured, greedy_tokens=greedy_tokens, text=text, scratch=log_probs)
        written = json.loads((scratch_dir / MANIFEST_FILE).read_text())
        written["quantization"]["quality"] = quality
        if fitted is not None:
            written["quantization"]["scales_tuned"] = fitted
        progress(f"writing {out_dir}")
        write_artifact(out_dir, {MANIFEST_FILE: manifest_bytes(written)}, verify=open_artifact, move_from=scratch_dir)
    return QuantizeResult(open_artifact(out_dir), quality, total, recipe, notes)


def _tuned(
    source: Artifact, quantized_dir: Path, out_dir: Path, steps: int, seed: int, progress, text
) -> tuple[Path, dict]:
    """(the directory of `quantized_dir`'s artifact with its scales fitted to `source` (tuning.py) on `text`, the
    fit's report): `out_dir`, written beside it, where the fit is kept; `quantized_dir` itself where it is not."""
    quantized = open_artifact(quantized_dir)
    tuned, report = tune_scales(source, quantized, steps, progress, seed, text)
    if not tuned:
        progress("keeping the rounded scales: fitting did not lower the KL")
        return quantized_dir, report
    progress("writing the fitted scales")
    graph = quantized.graphs[0]
    proto = validate_onnx(graph.model_path)
    weights = GraphWeights(proto, str(graph.model_path.parent), graph.model_path, PendingWeights())
    for name, values in tuned.items():
        weights.hold(weights.tensors[name], values.reshape(weights.array(name).shape))
    weights.detach(proto)
    manifest = quantized.manifest.to_dict()
    extra = {name: (quantized_dir / name).read_bytes() for name in manifest.get("extra_files") or {}}
    write_artifact(out_dir, pack_artifact(manifest, {graph.name: proto}, extra, pending=weights.pending))
    return out_dir, report


def _rotated(source: Artifact, out_dir: Path, seed: int, stack: contextlib.ExitStack, progress):
    """(the rotated float artifact, its report): `source` with its residual stream turned (rotation.py), written
    beside out_dir for as long as `stack` holds it, and checked to compute the source's logits."""
    progress(f"turning the residual stream by the rotation seed {seed} draws, into a float artifact")
    parent = out_dir.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.rotated-", dir=parent)))
    report = rotate_artifact(source, directory / "artifact", seed)
    rotated = open_artifact(directory / "artifact")
    progress(f"turned by a {report['rotation'].split(':')[0]} matrix of order {report['width']}")
    progress("checking that the rotated float model computes the float model's logits")
    report["logits_max_abs_vs_float"], report["logits_max_abs"] = moved, largest = _logits_moved(source, rotated)
    if moved > FUNCTION_BOUND * largest:
        raise ConfigError(
            f"--rotate: the rotated float model's logits moved by {moved:.3g} (largest |logit| {largest:.3g}, bound "
            f"{FUNCTION_BOUND} of it): the graph computes something on the residual stream the rotation does not "
            "follow; quantize without --rotate"
        )
    return rotated, report


def _gptq(
    source: Artifact,
    weights: GraphWeights,
    matmul_b: set[str],
    source_map,
    folded,
    head_b,
    progress,
    *,
    order: list[str],
    bits: int,
    head_bits: int,
    block_size: int,
    zero_points: str,
    chosen: dict[str, int],
    seed: int,
    texts: dict,
    damping: float,
):
    """The blocks(b) function of the gptq recipe for the constant MatMul weights `matmul_b` (head_b: the one that
    holds a tied head's values, found by head_copies; `order`: them in the order blocks(b) is asked for them):
    E[x^T x] of each one's input measured on the calibration text the sampler seeded with `seed` writes (its token
    ids kept in `texts` under (GPTQ_ROWS, GPTQ_TOKENS, seed) for the fit), then each weight rounded by GPTQ with
    `damping` as it is written (counted in `chosen` by its zero points). The second moments are measured in as few
    forward passes as hold them in half the memory available once the float model is loaded, each pass for the next
    weights in `order`, when the first of them is asked for; a weight whose own would not fit is refused up front."""
    from toolkit.memory import available_memory

    dims = {b: list(weights.tensors[b].dims) for b in matmul_b}
    need = {b: 8 * dims[b][0] ** 2 for b in matmul_b}
    largest = max(sorted(need), key=need.get)

    def refuse_beyond(free):
        if free is not None and need[largest] > free / 2:
            raise ConfigError(
                f"--recipe gptq holds E[x^T x] of each MatMul input: {largest!r} (K {dims[largest][0]}) alone takes "
                f"{need[largest] / 2**30:.1f} GiB, more than half of the {free / 2**30:.1f} GiB available; use "
                "--recipe mixed"
            )

    refuse_beyond(available_memory())
    progress(
        f"writing a calibration text of {GPTQ_ROWS} x {GPTQ_TOKENS} tokens with the float model on ort-cpu"
        + (
            ""
            if has_cache(source.input_specs)
            else f" (no KV cache in this {source.variant} export: every row is fed whole at each token, about "
            f"{GPTQ_TOKENS // 2}x the tokens a --variant serving export feeds)"
        )
    )
    calibrated = sampled_calibration(source, calibration(source), GPTQ_ROWS, GPTQ_TOKENS, seed)
    texts[GPTQ_ROWS, GPTQ_TOKENS, seed] = calibrated.feed["input_ids"]
    free = available_memory()
    refuse_beyond(free)
    passes = _passes(order, need, None if free is None else free // 2)
    progress(
        f"measuring E[x^T x] of the inputs of {len(matmul_b)} MatMul weights on it"
        + (f", in {len(passes)} passes to fit half the memory available" if len(passes) > 1 else "")
    )
    held = {"calibrated": calibrated}
    del calibrated
    moments = {}

    def blocks(b):
        if b not in moments:
            group = next(g for g in passes if b in g)
            passes.remove(group)
            also = {head_b: HEAD} if head_b in group else {}
            moments.update(hessians(held["calibrated"], group, source_map, folded, also))
            if not passes:
                held.clear()  # the float model goes once every second moment is measured
        weight = gptq_blocks(
            weights.array(b), moments.pop(b), head_bits if b == head_b else bits, block_size, zero_points, damping
        )
        chosen["integer" if weight.offsets is None else "offsets"] += 1
        return weight

    return blocks


def _passes(order: list[str], need: dict[str, int], budget: int | None) -> list[set[str]]:
    """`order` cut into consecutive groups whose `need` sums to at most `budget` (one group when None), every
    weight in one group even where `order` misses it (at the end)."""
    order = list(dict.fromkeys(order)) + sorted(set(need) - set(order))
    groups, size = [], 0
    for b in order:
        if not groups or (budget is not None and size + need[b] > budget):
            groups.append(set())
            size = 0
        groups[-1].add(b)
        size += need[b]
    return groups


def _recipe(recipe: str | None, algorithm: str | None, block_size: int | None) -> str | None:
    """The recipe asked for, once --recipe, --algorithm and --block-size agree; None when none is named."""
    if recipe is not None and recipe not in RECIPES:
        raise ConfigError(f"--recipe: expected one of {', '.join(RECIPES)}, got {recipe!r}")
    if algorithm is not None and algorithm not in ALGORITHMS:
        raise ConfigError(f"--algorithm: expected one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if recipe is not None and algorithm is not None and recipe != algorithm:
        raise ConfigError(f"--recipe {recipe} with --algorithm {algorithm}: give one of them")
    if recipe == "gguf" and block_size is not None:
        raise ConfigError(f"--block-size {block_size} with --recipe gguf: the GGUF's blocks decide (32 values each)")
    return recipe or algorithm


def _gguf_source(
    source: Artifact, recipe: str | None, bits: int | None, q4_1: str, unnamed: bool
) -> tuple[GGUFRecipe | None, list[str]]:
    """(the GGUF recipe, notes) for --recipe gguf (its refusals are errors) and, when no recipe, algorithm or
    block size is named, for a GGUF export whose blocks the recipe takes as they are at `bits`; otherwise
    (None, notes), the notes saying why a GGUF export is re-rounded."""
    if recipe == "gguf":
        return gguf_recipe(source, bits, q4_1), []
    if (source.manifest.source or {}).get("format") != "gguf":
        return None, []
    if not unnamed:
        return None, [
            "note: this artifact came from a GGUF file; the gguf recipe (the default without --recipe, "
            "--algorithm or --block-size) takes its weights from the file's blocks as they are instead of "
            "re-rounding them"
        ]
    try:
        return gguf_recipe(source, bits, q4_1), []
    except (ModelFileError, ConfigError) as exc:  # GGUFRecipeError, or the file moved or changed since export
        instead = "" if bits is None else f" with {DEFAULT_RECIPES[bits]}"
        return None, [
            f"note: quantizing the float weights{instead}, since the gguf recipe cannot take this GGUF as it is: {exc}"
        ]


def _check_language_model(artifact: Artifact) -> None:
    if len(artifact.graphs) != 1:
        raise ModelFileError(
            f"{artifact.location}: {artifact.family} artifacts have {len(artifact.graphs)} graphs; "
            "quantize supports decoder-only language models (one graph, input_ids -> logits)"
        )
    graph = artifact.graphs[0]
    names = [s.name for s in graph.input_specs]
    if "input_ids" not in names or "logits" not in graph.output_names:
        raise ModelFileError(
            f"{artifact.location}: a {artifact.family} artifact with inputs {names}; quantize "
            "supports decoder-only language models (input_ids -> logits)"
        )


def _serialise(manifest: dict, protos: dict, extra: dict[str, bytes], pending: PendingWeights) -> dict[str, bytes]:
    """The artifact's files (the quality report is added to manifest.json once measured; the graphs embed the
    manifest without it). The protos and pending weights are taken: each graph's are let go once written."""
    return pack_artifact(manifest, protos, extra, pending=pending)


# --------------------------------------------------------------------------- quality


@dataclass
class PerplexityText:
    """A --perplexity-text file as the quality report measures it: its first token ids cut into windows."""

    name: str
    sha256: str  # of the whole file
    tokens: int  # the file's first tokens that the windows hold
    whole_file: bool  # False: the file goes on past those tokens (and was tokenized only a little further)
    windows: list[list[int]]

    def report(self) -> dict:
        return {
            "file": self.name,
            "sha256": self.sha256,
            "tokens_used": self.tokens,
            "whole_file": self.whole_file,
            "windows": len(self.windows),
        }


def read_perplexity_text(artifact: Artifact, path) -> PerplexityText:
    """The file at `path` tokenized by `artifact`'s tokenizer (BOS first where it adds one), its first
    PERPLEXITY_TEXT_TOKENS tokens cut into windows of PERPLEXITY_WINDOW (or the model's context, if shorter);
    a last window of one token, which predicts nothing, is dropped. The whole file is hashed and checked to be
    UTF-8 a chunk at a time, but only as much of it is tokenized as the measured tokens need, so a large file costs
    a read, not its tokenization: a prefix is taken once it gives PERPLEXITY_TEXT_SLACK tokens more than those and
    a prefix one chunk longer gives the same measured tokens (a BPE merge can reach back from where the text is
    cut). ConfigError for an artifact without a tokenizer, a path that is not a regular file, a file that is not
    UTF-8 text, or one of fewer than two tokens."""
    import codecs
    import stat

    from models.tokenizer import TextTokenizer

    path = Path(path)
    directory = artifact.directory
    if directory is None or not (directory / "tokenizer.json").is_file():
        raise ConfigError(
            f"--perplexity-text: {artifact.location} has no tokenizer.json to tokenize {path} with; export it from "
            "a checkpoint with a tokenizer, or leave --perplexity-text out (the report then uses fixed token ids)"
        )
    tokenizer = TextTokenizer.from_artifact(directory)
    wanted, measured = PERPLEXITY_TEXT_TOKENS + PERPLEXITY_TEXT_SLACK, PERPLEXITY_TEXT_TOKENS
    digest, decoder = hashlib.sha256(), codecs.getincrementaldecoder("utf-8")()
    pieces, ids, candidate, offset = [], None, None, 0
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO or a device (/dev/zero) would be read forever
            raise ConfigError(f"--perplexity-text: {path} is not a regular file; give a text file")
        with open(path, "rb") as handle:
            while True:
                chunk = handle.read(PERPLEXITY_TEXT_CHUNK)
                digest.update(chunk)
                pending = len(decoder.getstate()[0])
                try:
                    piece = decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as exc:
                    at = offset - pending + exc.start
                    bad = exc.object[exc.start : exc.start + 1]
                    raise ConfigError(f"--perplexity-text: {path} is not UTF-8 text (byte {at}: {bad!r})") from None
                offset += len(chunk)
                if ids is None:
                    pieces.append(piece)
                    if not chunk:
                        ids, whole = tokenizer.encode("".join(pieces)), True
                    elif len(prefix := tokenizer.encode("".join(pieces))) >= wanted:
                        if candidate is not None and candidate[:measured] == prefix[:measured]:
                            ids, whole = prefix, False
                        candidate = prefix
                if not chunk:
                    break
    except OSError as exc:
        raise ConfigError(f"--perplexity-text: cannot read {path}: {exc.strerror or exc}") from None
    if len(ids) < 2:
        raise ConfigError(f"--perplexity-text: {path} is {len(ids)} token(s); perplexity needs at least 2")
    width = max(min(PERPLEXITY_WINDOW, artifact_config(artifact).max_positions), 2)
    kept = ids[:measured]
    windows = [kept[i : i + width] for i in range(0, len(kept), width)]
    if len(windows[-1]) < 2:
        windows.pop()
    used = sum(len(window) for window in windows)
    return PerplexityText(path.name, digest.hexdigest(), used, whole and len(ids) == used, windows)


def evaluate_quality(
    float_artifact: Artifact,
    quantized_artifact: Artifact,
    *,
    greedy_tokens: int = GREEDY_TOKENS,
    text: PerplexityText | None = None,
    scratch: Path | None = None,
) -> dict:
    """Quantized vs float, both on ONNX Runtime CPU, on fixed prompts and a fixed text (or `text`).

    - logits: max / mean abs difference over every position of the prompts + greedy continuations;
    - greedy agreement: the float model's greedy continuation of each prompt is fed to both models
      (teacher forcing); the fraction of those positions where the quantized arg-max equals the float one;
    - perplexity of each model on a fixed text, or on `text`'s windows, each fed alone (next-token, natural log
      base e, the mean over every predicted token of every window);
    - KL from float: the mean over those same predicted tokens of KL(float || quantized) between the two
      next-token distributions, in nats. Perplexity rewards a model that puts more mass on the text's own next
      token, which a quantized model can do by moving away from the float one; the KL measures the distance.

    The float model's log-probabilities at those tokens wait for the quantized model's on disk (float16, one file
    per window) in `scratch`, or in a temporary directory: the two sessions are never held at once, and the
    log-probabilities of a 49k-token vocabulary over 8k tokens are 0.75 GB.
    """
    from runners.registry import create_runner

    config = artifact_config(float_artifact)
    prompts, text_ids, tokenized = _fixed_inputs(float_artifact, config)
    budget = config.max_positions
    windows = text.windows if text is not None else [text_ids[:budget]]
    # The float model runs first and is dropped before the quantized one loads: the two sessions are never
    # held at once. Its weights are held once, not prepacked beside themselves: at real sizes the float session
    # is the largest thing a quantization holds (a 3B float32 model's prepacked session would not fit in 24 GiB).
    float_runner = create_runner("ort-cpu", float_artifact, prepack=False)
    fed_sequences, float_logits, starts = [], [], []
    for prompt in prompts:
        prompt = prompt[: max(budget - 1, 1)]
        steps = max(min(greedy_tokens, budget - len(prompt)), 0)
        sequence = list(prompt)
        for _ in range(steps):  # greedy continuation by the float model (full recompute: tiny and exact)
            logits = _logits(float_runner, sequence)
            sequence.append(int(np.argmax(logits[-1])))
        fed = sequence[:-1] if steps else sequence
        fed_sequences.append(fed)
        float_logits.append(_logits(float_runner, fed))
        starts.append(len(prompt) - 1 if steps else None)
    with contextlib.ExitStack() as stack:
        if scratch is None:
            scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="toolkit-float-log-probs-")))
        scratch.mkdir(parents=True, exist_ok=True)
        float_losses, _ = _text_terms(float_runner, windows, store=scratch)
        del float_runner
        quant_runner = create_runner("ort-cpu", quantized_artifact)
        quant_losses, kl = _text_terms(quant_runner, windows, reference=scratch)
    max_diff, sum_diff, count_diff, agree, positions = 0.0, 0.0, 0, 0, 0
    for fed, reference, start in zip(fed_sequences, float_logits, starts, strict=True):
        quantized = _logits(quant_runner, fed)
        diff = np.abs(reference.astype(np.float64) - quantized)
        max_diff = max(max_diff, float(diff.max()))
        sum_diff += float(diff.sum())
        count_diff += diff.size
        if start is not None:
            window = slice(start, len(fed))
            agreed, counted = greedy_agreement_counts(reference[window], quantized[window])
            agree += agreed
            positions += counted
    return {
        "prompts": len(prompts),
        "inputs": "tokenizer" if tokenized else f"fixed token ids (seed {SEED}), no tokenizer in the artifact",
        "greedy_tokens_per_prompt": greedy_tokens,
        "logits_max_abs": max_diff,
        "logits_mean_abs": sum_diff / max(count_diff, 1),
        "greedy_agreement": agree / positions if positions else float("nan"),
        "greedy_positions": positions,
        "perplexity_tokens": len(float_losses),
        "perplexity_text": text.report() if text is not None else "fixed",
        "perplexity_float": float(math.exp(float_losses.mean())),
        "perplexity_quantized": float(math.exp(quant_losses.mean())),
        "kl_from_float": float(kl.mean()),
    }


def _text_terms(
    runner, windows: list[list[int]], *, store: Path | None = None, reference: Path | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """(next-token loss, KL from the reference or None), each [predicted tokens], over every window fed alone.

    store: each window's log-probabilities at its predicted tokens are written there (window i as i.npy, float16);
    reference: a directory so written, read back and renormalised (float16 rounding moves each row's total by up to
    about 1e-3) as p, with the runner's own as q, for KL(p || q) at each predicted token."""
    losses, kls = [], []
    for i, window in enumerate(windows):
        log_probs = log_softmax(_logits(runner, window)[:-1])
        losses.append(-log_probs[np.arange(len(window) - 1), window[1:]])
        if store is not None:
            np.save(store / f"{i}.npy", log_probs.astype(np.float16))
        if reference is not None:
            kls.append(kl_divergences(log_softmax(np.load(reference / f"{i}.npy")), log_probs))
    return np.concatenate(losses), np.concatenate(kls) if reference is not None else None


def _logits_moved(float_artifact: Artifact, other: Artifact) -> tuple[float, float]:
    """(max |logit difference|, max |logit|) of `other` against `float_artifact` on the fixed prompts, both on ONNX
    Runtime CPU, one session at a time."""
    from runners.registry import create_runner

    config = artifact_config(float_artifact)
    prompts = [ids[: config.max_positions] for ids in _fixed_inputs(float_artifact, config)[0]]
    runner = create_runner("ort-cpu", float_artifact, prepack=False)
    reference = [_logits(runner, ids).astype(np.float64) for ids in prompts]
    del runner
    runner = create_runner("ort-cpu", other, prepack=False)
    moved = max(float(np.abs(_logits(runner, ids) - r).max()) for ids, r in zip(prompts, reference, strict=True))
    return moved, max(float(np.abs(r).max()) for r in reference)


def _fixed_inputs(artifact: Artifact, config):
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


def greedy_agreement_counts(float_logits: np.ndarray, quant_logits: np.ndarray) -> tuple[int, int]:
    """(positions where the arg-max over the last axis agrees, positions): both [T, V] over the same tokens."""
    float_logits, quant_logits = np.asarray(float_logits), np.asarray(quant_logits)
    if float_logits.shape != quant_logits.shape or float_logits.ndim != 2:
        raise ValueError(f"expected two [T, V] logits of one shape, got {float_logits.shape} and {quant_logits.shape}")
    agreed = np.argmax(float_logits, -1) == np.argmax(quant_logits, -1)
    return int(agreed.sum()), int(agreed.size)


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp(mean over t of -log softmax(logits[t])[ids[t+1]]): next-token perplexity, natural log, float64.

    logits: [T, V] for the T tokens `ids`; the last row predicts nothing inside the text and is unused.
    """
    return float(math.exp(negative_log_likelihoods(logits, ids).mean()))


def negative_log_likelihoods(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """[T - 1] float64: -log softmax(logits[t])[ids[t+1]] for each t (perplexity's terms)."""
    logits = np.asarray(logits)
    if logits.ndim != 2 or len(logits) != len(ids) or len(ids) < 2:
        raise ValueError(f"expected [T, V] logits for T >= 2 ids, got {logits.shape} for {len(ids)} ids")
    log_probs = log_softmax(logits[:-1])
    return -log_probs[np.arange(len(ids) - 1), np.asarray(ids[1:])]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """float64 log softmax over the last axis."""
    logits = np.asarray(logits, dtype=np.float64)
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def kl_divergences(reference_log_probs: np.ndarray, log_probs: np.ndarray) -> np.ndarray:
    """KL(p || q) = sum over the last axis of p (log p - log q), p = exp(reference_log_probs), q = exp(log_probs):
    one per row, float64. A token p gives no probability (log p = -inf, as float16 stores a very unlikely one)
    adds 0, its limit, not 0 * -inf."""
    reference_log_probs = np.asarray(reference_log_probs, dtype=np.float64)
    p = np.exp(reference_log_probs)
    with np.errstate(invalid="ignore"):  # -inf - -inf where neither gives the token any probability
        gap = np.where(p > 0, reference_log_probs - np.asarray(log_probs, dtype=np.float64), 0.0)
    return (p * gap).sum(-1)
