"""What a 4-bit vocabulary projection would cost a GGUF import's int4 in quality: the gguf recipe with only the head
re-rounded.

`toolkit quantize --bits 4` on a GGUF export takes every MatMul weight's blocks from the file as they are
(toolkit/quantize/gguf_recipe.py); SmolLM2's Q4_1 file keeps its tied embedding, the vocabulary projection, in
Q8_0, which is the largest single GEMV of a decode step. This script quantizes the artifact with that recipe
except the head: the file's dequantized head values go through the k-quant search (exporters/kquant.py) at 4 bits,
once per `--variants` entry (zero points integer|offsets, block 32|16), and records the quantize command's own
quality report (greedy agreement and perplexity against the float export, mean and max logit error) beside the
file-exact artifact's. The head is re-rounded here, in the benchmark, not by the product: it is an experiment on
the recipe, not an option of it. Quality only; time decode steps of the artifacts it keeps (`--keep DIR`) with
benchmarks/offsets_ceiling.py --also.

    .venv/bin/python benchmarks/head_bits.py /tmp/race-izp/float32 --keep /tmp/head-bits \
        --json benchmarks/results/2026-12-03-head-bits.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporters.gguf_blocks import piece_bytes, piece_kind  # noqa: E402
from exporters.kquant import kquant_blocks  # noqa: E402
from toolkit.quantize import gguf_recipe  # noqa: E402
from toolkit.quantize.pipeline import quantize_artifact  # noqa: E402

HEAD_TENSORS = ("output.weight", "token_embd.weight")  # the GGUF's untied head, or the tied embedding
VARIANTS = ("file", "integer-32", "offsets-32", "integer-16", "offsets-16")


def head_rerounded(zero_points: str, block_size: int):
    """A GGUFRecipe._convert that re-rounds the head's file values to 4 bits and converts the rest as it does."""
    import gguf

    convert = gguf_recipe.GGUFRecipe._convert

    def _convert(self, b, pieces):
        if len(pieces) != 1 or pieces[0].tensor not in HEAD_TENSORS:
            return convert(self, b, pieces)
        piece = pieces[0]
        kind = piece_kind(piece, self.tensors)
        rows = gguf.quants.dequantize(piece_bytes(piece, self.tensors), gguf.GGMLQuantizationType[kind])
        values = np.ascontiguousarray(rows.reshape(rows.shape[0], -1).T, dtype=np.float32)  # [K, N], MatMul's B
        weight = kquant_blocks(values, 4, block_size, zero_points=zero_points)
        error = weight.dequantize() - values
        self.tensor_report[piece.tensor] = {
            "type": kind,
            "matmul": b,
            "rerounded": f"4-bit k-quant search, zero points {zero_points}, block {block_size}",
            "rms_error": float(np.sqrt(np.mean(np.square(error, dtype=np.float64)))),
            "max_abs_error": float(np.abs(error).max()),
        }
        self.bounds[f"{b}_Q4"] = 16.0  # searched: any point of the block's grid
        return weight

    return _convert


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="a float artifact exported from a GGUF (toolkit export --from)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--keep", type=Path, help="keep each quantized artifact in DIR/VARIANT")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; expected some of {', '.join(VARIANTS)}")

    results = {}
    original = gguf_recipe.GGUFRecipe._convert
    with tempfile.TemporaryDirectory() as scratch:
        for variant in variants:
            out = (args.keep or Path(scratch)) / variant
            shutil.rmtree(out, ignore_errors=True)
            if variant != "file":
                zero_points, block = variant.split("-")
                gguf_recipe.GGUFRecipe._convert = head_rerounded(zero_points, int(block))
            start = time.perf_counter()
            try:
                made = quantize_artifact(args.artifact, out, bits=4)
            finally:
                gguf_recipe.GGUFRecipe._convert = original
            manifest = json.loads((out / "manifest.json").read_text())["quantization"]
            quality = made.quality
            head = {k: v for k, v in manifest["gguf"]["tensors"].items() if k in HEAD_TENSORS}
            results[variant] = {
                "recipe": made.recipe,
                "seconds": round(time.perf_counter() - start, 1),
                "greedy_agreement": quality["greedy_agreement"],
                "greedy_positions": quality["greedy_positions"],
                "perplexity": quality["perplexity_quantized"],
                "perplexity_float": quality["perplexity_float"],
                "logits_mean_abs": quality["logits_mean_abs"],
                "logits_max_abs": quality["logits_max_abs"],
                "head": head,
            }
            print(
                f"{variant}: agreement {quality['greedy_agreement']:.1%}, perplexity "
                f"{quality['perplexity_quantized']:.2f} (float {quality['perplexity_float']:.2f}), mean logit error "
                f"{quality['logits_mean_abs']:.3f}",
                flush=True,
            )
    report = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "artifact": str(args.artifact),
        "load_average": os.getloadavg(),
        "results": results,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
