"""`toolkit quantize`: weight-only int4/int8 (ONNX Runtime MatMulNBits) with a measured quality report."""

from __future__ import annotations

import json

import click

from exporters.quantize import ACCURACY_LEVELS, ALGORITHMS, BITS, BLOCK_SIZES
from toolkit.commands.common import write_text_atomically
from toolkit.progress import Progress
from toolkit.quantize.pipeline import GREEDY_TOKENS, quantize_artifact


@click.command("quantize")
@click.argument("artifact_dir", type=click.Path())
@click.option("--bits", type=click.Choice([str(b) for b in BITS]), required=True, help="Weight bits.")
@click.option(
    "--block-size",
    type=click.Choice([str(b) for b in BLOCK_SIZES]),
    default="32",
    show_default=True,
    help="Weights per quantization block along K (one scale and zero point each).",
)
@click.option(
    "--algorithm",
    type=click.Choice(ALGORITHMS),
    default="rtn",
    show_default=True,
    help="rtn: round-to-nearest (uint8 zero points); hqq: half-quadratic (float zero points, slower to "
    "quantize, usually closer to float at 4 bits).",
)
@click.option(
    "--accuracy-level",
    type=click.Choice([str(a) for a in ACCURACY_LEVELS]),
    default="0",
    show_default=True,
    help="MatMulNBits compute: 0 float32 activations, 4 int8 activations (faster).",
)
@click.option(
    "--greedy-tokens",
    type=click.IntRange(min=1),
    default=GREEDY_TOKENS,
    show_default=True,
    help="Greedy tokens per fixed prompt for the agreement score.",
)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Artifact directory to write.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Also write the quality report here.")
@click.option("--quiet", is_flag=True, help="No progress lines on stderr (shown on a terminal by default).")
def command(artifact_dir, bits, block_size, algorithm, accuracy_level, greedy_tokens, out_dir, json_file, quiet):
    """Quantize the MatMul weights of ARTIFACT_DIR to --bits and report the quality lost against it."""
    result = quantize_artifact(
        artifact_dir,
        out_dir,
        bits=int(bits),
        block_size=int(block_size),
        accuracy_level=int(accuracy_level),
        algorithm=algorithm,
        greedy_tokens=greedy_tokens,
        progress=Progress("quantize", quiet),
    )
    q = result.quality
    click.echo(
        f"quantized {result.quantized_weights} MatMul weights of {artifact_dir} to {bits}-bit "
        f"(block {block_size}, {algorithm}, MatMulNBits, accuracy level {accuracy_level}) -> {out_dir}"
    )
    click.echo(f"quality vs the float model on ort-cpu ({q['prompts']} fixed prompts, {q['inputs']}):")
    click.echo(f"  logits abs error:  max {q['logits_max_abs']:.4g}, mean {q['logits_mean_abs']:.4g}")
    click.echo(
        f"  greedy agreement:  {q['greedy_agreement']:.1%} of {q['greedy_positions']} positions "
        f"({q['greedy_tokens_per_prompt']} greedy tokens per prompt, teacher-forced)"
    )
    click.echo(
        f"  perplexity:        float {q['perplexity_float']:.4g}, quantized {q['perplexity_quantized']:.4g} "
        f"({q['perplexity_tokens']} tokens)"
    )
    if json_file:
        report = {
            "artifact": str(out_dir),
            "source": str(artifact_dir),
            **{k: v for k, v in result.artifact.manifest.quantization.items() if k != "quality"},
            "quality": q,
        }
        write_text_atomically(json_file, json.dumps(report, indent=2, sort_keys=True) + "\n")
