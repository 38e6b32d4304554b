"""`toolkit quantize`: weight-only int4/int8 (ONNX Runtime MatMulNBits) with a measured quality report."""

from __future__ import annotations

import json

import click

from exporters.gguf_blocks import Q4_1_LAYOUTS
from exporters.gptq import DAMPING as GPTQ_DAMPING
from exporters.kquant import AUTO_TOLERANCE
from exporters.quantize import ACCURACY_LEVELS, ALGORITHMS, BITS, BLOCK_SIZES
from toolkit.commands.common import write_text_atomically
from toolkit.progress import command_progress
from toolkit.quantize.pipeline import (
    DEFAULT_IMATRIX,
    DEFAULT_ZERO_POINTS,
    GREEDY_TOKENS,
    PERPLEXITY_TEXT_TOKENS,
    PERPLEXITY_WINDOW,
    RECIPES,
    ZERO_POINTS,
    quantize_artifact,
)
from toolkit.quantize.sensitivity import DEFAULT_CALIBRATION_SEED, PROMOTED_SHARE
from toolkit.quantize.tuning import TUNE_BATCH


@click.command("quantize")
@click.argument("artifact_dir", type=click.Path())
@click.option(
    "--bits",
    type=click.Choice([str(b) for b in BITS]),
    help="Weight bits (required unless the gguf recipe applies). With the gguf recipe the GGUF decides each "
    "tensor's layout and --bits must be the file's width (4 where a MatMul tensor is Q4_0/Q4_1/Q4_K, else 8).",
)
@click.option(
    "--recipe",
    type=click.Choice(RECIPES),
    help="gguf: take each MatMul weight's blocks from the GGUF the artifact was exported from, as they are "
    "bit for bit (Q4_0/Q4_1/Q4_K 4-bit, Q5_0/Q5_1/Q5_K/Q6_K/Q8_0 8-bit, float minimums as per-block "
    "offsets; F16/F32 kept float); the file must be where the manifest says, unchanged. kquant: float weights to a "
    "searched scale and zero point per block (--zero-points); mixed: kquant with the vocabulary "
    "projection at 8 bits; measured: mixed with the weights that move the model most at 4 bits, each measured "
    "alone on a calibration text, at 8 bits too (up to 15% of the weights). rtn, hqq: re-round the float "
    "weights (as --algorithm). Default: gguf for an artifact exported from a GGUF whose blocks it can take "
    "at --bits (the command says why when it cannot); otherwise mixed at 4 bits and rtn at 8.",
)
@click.option(
    "--block-size",
    type=click.Choice([str(b) for b in BLOCK_SIZES]),
    help="Weights per quantization block along K (one scale and zero point each) for rtn, hqq, kquant, mixed and measured. "
    "[default: 32; the GGUF's own (32) with --recipe gguf]",
)
@click.option(
    "--algorithm",
    type=click.Choice(ALGORITHMS),
    help="rtn: round-to-nearest (uint8 zero points); hqq: half-quadratic (float zero points, slower to "
    "quantize, usually closer to float at 4 bits). Same as --recipe rtn|hqq.",
)
@click.option(
    "--accuracy-level",
    type=click.Choice([str(a) for a in ACCURACY_LEVELS]),
    help="MatMulNBits compute: 4 int8 activations (ONNX Runtime's fast kernels; llama.cpp's own arithmetic for "
    "quantized weights), 0 float32 activations (slower, much slower for 8-bit, mixed and hqq weights; toolkit "
    "check then holds every stage tightly to the dequantized weights; at 4 it audits ort-cpu node by node). "
    "[default: 4]",
)
@click.option(
    "--head-bits",
    type=click.Choice([str(b) for b in BITS]),
    help="--recipe kquant|mixed|measured|gptq: the vocabulary projection's width, apart from --bits (a fifth of a "
    "small model's weights). [default: 8 for mixed and measured, --bits for kquant and gptq]",
)
@click.option(
    "--promote-share",
    type=click.FloatRange(min=0, max=1, min_open=True),
    help=f"--recipe measured: the largest share of the MatMul weights' elements kept at 8 bits. [default: "
    f"{PROMOTED_SHARE}]",
)
@click.option(
    "--imatrix/--no-imatrix",
    default=None,
    help="--recipe kquant|mixed|measured: weight each block's search by how much each input channel carries, the "
    "mean square of the weight's input on a calibration text run through the float model (llama.cpp's importance "
    f"matrix). [default: {'on' if DEFAULT_IMATRIX else 'off'}]",
)
@click.option(
    "--zero-points",
    type=click.Choice(ZERO_POINTS),
    help="--recipe kquant|mixed|measured|gptq: each block's minimum as MatMulNBits' integer zero point (integer: "
    "round-to-nearest's layout and decode speed), as a float minimum added by offsets beside each MatMulNBits "
    "(offsets: slower to decode), or per weight the integer one unless its weighted error is more than "
    f"{AUTO_TOLERANCE}x the float one's (auto; for gptq its output error on the calibration text). "
    f"[default: {DEFAULT_ZERO_POINTS}; integer for gptq]",
)
@click.option(
    "--rotate",
    "rotate",
    type=click.IntRange(min=0),
    metavar="SEED",
    help="Before rounding, turn the residual stream by a randomized Hadamard matrix whose signs SEED draws "
    "(QuaRot's transform: the same function and graph, so the same decode speed, with a trained model's loud "
    "channels spread over all of them). For the recipes that round float weights. On SmolLM2 with its channels "
    "permuted, gptq with integer zero points kept more with it on every draw, and rtn far less (README).",
)
@click.option(
    "--tune-scales",
    "tune_scales",
    type=click.IntRange(min=1),
    metavar="STEPS",
    help="Once rounded, fit each block's scale to the float model's next-token distributions in STEPS steps of "
    f"{TUNE_BATCH} rows of text the float model writes (codes, zero points and graph unchanged, so the same decode "
    "speed); kept only where it lowers the KL on rows held out. Not with the gguf recipe.",
)
@click.option(
    "--calibration-seed",
    "calibration_seed",
    type=click.IntRange(min=0),
    metavar="SEED",
    help="The seed of the sampling that writes the text --recipe gptq and --tune-scales calibrate on (the float "
    "model's own continuations). Each seed is another text and so another rounding: on SmolLM2 four seeds moved one "
    "recipe's perplexity over about two points (README); compare recipes over several. [default: "
    f"{DEFAULT_CALIBRATION_SEED}]",
)
@click.option(
    "--gptq-damping",
    "gptq_damping",
    type=click.FloatRange(min=0, min_open=True),
    metavar="FRACTION",
    help="--recipe gptq: the share of H's mean diagonal added to its diagonal before it is inverted (GPTQ's paper "
    "adds 0.01). Lower follows the calibration text more closely, and on few tokens fits it. [default: "
    f"{GPTQ_DAMPING}]",
)
@click.option(
    "--q4-1",
    "q4_1",
    type=click.Choice(Q4_1_LAYOUTS),
    help="--recipe gguf: how a Q4_1 tensor's float minimum is held. offsets: 4-bit blocks plus per-block offsets "
    "beside each MatMulNBits, bit for bit; int8-grid: 8-bit blocks on a grid up to 16 times finer, no offsets, off "
    "by at most a 32nd of a Q4_1 step where the block's minimum is within 15 steps of zero (the manifest gives each "
    "tensor's deviation); float-zero-points: 4-bit with float zero points, which ONNX Runtime's CPU kernel "
    "computes on a slow path. [default: offsets]",
)
@click.option(
    "--greedy-tokens",
    type=click.IntRange(min=1),
    default=GREEDY_TOKENS,
    show_default=True,
    help="Greedy tokens per fixed prompt for the agreement score.",
)
@click.option(
    "--perplexity-text",
    type=click.Path(dir_okay=False),
    help="A UTF-8 text file on which the report measures both models' perplexity, in place of a fixed sentence: "
    f"tokenized by the artifact's tokenizer, its first {PERPLEXITY_TEXT_TOKENS} tokens cut into windows of "
    f"{PERPLEXITY_WINDOW} (or the model's context), each fed alone. A few thousand tokens tell recipes apart "
    "where the fixed sentence (about 50 tokens) cannot.",
)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Artifact directory to write.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Also write the quality report here.")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr (shown on a terminal by default).")
def command(
    artifact_dir,
    bits,
    recipe,
    block_size,
    algorithm,
    accuracy_level,
    head_bits,
    promote_share,
    imatrix,
    zero_points,
    rotate,
    tune_scales,
    calibration_seed,
    gptq_damping,
    q4_1,
    greedy_tokens,
    perplexity_text,
    out_dir,
    json_file,
    quiet,
):
    """Quantize the MatMul weights of ARTIFACT_DIR to --bits and report the quality lost against it."""
    result = quantize_artifact(
        artifact_dir,
        out_dir,
        bits=None if bits is None else int(bits),
        block_size=None if block_size is None else int(block_size),
        accuracy_level=None if accuracy_level is None else int(accuracy_level),
        algorithm=algorithm,
        recipe=recipe,
        head_bits=None if head_bits is None else int(head_bits),
        promote_share=promote_share,
        imatrix=imatrix,
        zero_points=zero_points,
        rotate=rotate,
        tune_scales=tune_scales,
        calibration_seed=calibration_seed,
        gptq_damping=gptq_damping,
        q4_1=q4_1,
        greedy_tokens=greedy_tokens,
        perplexity_text=perplexity_text,
        progress=command_progress("quantize", quiet),
    )
    q, made = result.quality, result.artifact.manifest.quantization
    accuracy_level = made["accuracy_level"]
    for note in result.notes:
        click.echo(note)
    if result.recipe == "gguf":
        tensors = made["gguf"]["tensors"].values()
        layouts = sorted({f"{t['type']} -> {t.get('bits', 'float')}" for t in tensors})
        held = (
            "as they are"
            if all(t.get("exact", True) for t in tensors)
            else "(not all bit for bit: see each tensor's deviation in the manifest)"
        )
        q4_1 = made["gguf"].get("q4_1", "offsets")
        layouts += [f"Q4_1 as {q4_1}"] if q4_1 != "offsets" and any(t["type"] == "Q4_1" for t in tensors) else []
        click.echo(
            f"took {result.quantized_weights} MatMul weights of {artifact_dir} from the GGUF's blocks {held} "
            f"({', '.join(layouts)}; MatMulNBits, accuracy level {accuracy_level}) -> {out_dir}"
        )
        slow = _slow_at_level_0(tensors)
    else:
        head = made.get("head_bits")
        wider = f", {head}-bit head" if head and head != made["bits"] else ""
        click.echo(
            f"quantized {result.quantized_weights} MatMul weights of {artifact_dir} to {made['bits']}-bit "
            f"(block {made['block_size']}, {result.recipe}{', imatrix' if made.get('imatrix') else ''}{wider}, "
            f"MatMulNBits, accuracy level {accuracy_level}) -> {out_dir}"
        )
        slow = made["bits"] == 8 or head == 8 or result.recipe in ("measured", "hqq")
        chosen = made.get("zero_points_chosen")
        if chosen:
            click.echo(
                f"zero points ({made['zero_points']}): {chosen['integer']} weights with integer zero points, "
                f"{chosen['offsets']} with float minimums (offsets)"
            )
    rotation = made.get("rotation")
    if rotation:
        click.echo(
            f"rotated first (--rotate {rotation['seed']}): {rotation['rotation'].split(':')[0]} of order "
            f"{rotation['width']}; the rotated float model's logits moved by {rotation['logits_max_abs_vs_float']:.2g} "
            f"(largest {rotation['logits_max_abs']:.3g})"
        )
    tuned = made.get("scales_tuned")
    if tuned:
        click.echo(
            f"scales {'fitted' if tuned['kept'] else 'left as rounded'} (--tune-scales {tuned['steps']}): KL from the "
            f"float model on {tuned['held_out_rows']} held-out rows {tuned['held_out_kl_before']:.4g} -> "
            f"{tuned['held_out_kl_after']:.4g} nats per token"
            + ("" if tuned["kept"] else " (not lower, so the rounded scales are kept)")
        )
    promotion = made.get("promotion")
    if promotion:
        first = ", ".join(promotion["promoted"][:3]) + (", ..." if len(promotion["promoted"]) > 3 else "")
        click.echo(
            f"measured: {len(promotion['promoted'])} of {len(promotion['sensitivity'])} MatMul weights at 8 bits "
            f"({promotion['share_promoted']:.0%} of their elements), most sensitive first: {first}"
        )
    if accuracy_level == 0 and slow:
        click.echo(
            "note: ONNX Runtime's CPU MatMulNBits has no fast float32-activation kernel for 8-bit or "
            "float-zero-point weights; --accuracy-level 4 (int8 activations) decodes much faster"
        )
    click.echo(f"quality vs the float model on ort-cpu ({q['prompts']} fixed prompts, {q['inputs']}):")
    click.echo(f"  logits abs error:  max {q['logits_max_abs']:.4g}, mean {q['logits_mean_abs']:.4g}")
    click.echo(
        f"  greedy agreement:  {q['greedy_agreement']:.1%} of {q['greedy_positions']} positions "
        f"({q['greedy_tokens_per_prompt']} greedy tokens per prompt, teacher-forced)"
    )
    click.echo(
        f"  perplexity:        float {q['perplexity_float']:.4g}, quantized {q['perplexity_quantized']:.4g} "
        f"({q['perplexity_tokens']} tokens{_text_source(q['perplexity_text'])})"
    )
    click.echo(f"  KL from float:     {q['kl_from_float']:.4g} nats per token over those tokens")
    if json_file:
        report = {
            "artifact": str(out_dir),
            "source": str(artifact_dir),
            **{k: v for k, v in result.artifact.manifest.quantization.items() if k != "quality"},
            "quality": q,
        }
        write_text_atomically(json_file, json.dumps(report, indent=2, sort_keys=True) + "\n")


def _text_source(text) -> str:
    if not isinstance(text, dict):
        return ""
    which = "all" if text["whole_file"] else "the first"
    return f" of {text['file']}: {text['windows']} windows, {which} {text['tokens_used']} tokens of the file"


def _slow_at_level_0(tensors) -> bool:
    """Whether any GGUF tensor became an 8-bit or float-zero-point MatMulNBits weight (no fast kernel at level 0)."""
    return any(t.get("bits") == 8 or t.get("zero_points") == "float32" for t in tensors)
