"""The k-quant zero-point modes with and without the importance matrix on a model with loud input channels.

The planted model of tests/toolkit/quantize/test_importance.py: one input channel in each block of 32 of one
layer's down projection carries 100x larger activations, and the weights that read it are 100x smaller (the
same function). `--recipe kquant` at 4 bits, accuracy level 0, with --zero-points offsets, integer and auto,
each with and without --imatrix; the quality report's mean and max absolute logit error against the float
model, and how many weights kept integer zero points. Deterministic (no timing), so one run each.

    .venv/bin/python benchmarks/zero_points_planted.py --work /tmp/planted --json benchmarks/results/<date>-zero-points-planted.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.toolkit.quantize.planted import export_planted  # noqa: E402
from tests.toolkit.quantize.test_importance import LOUD, LOUDER  # noqa: E402
from toolkit.quantize.pipeline import ZERO_POINTS, quantize_artifact  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    source = args.work / "float"
    if not (source / "manifest.json").exists():
        export_planted(source, 1, LOUD, 1 / LOUDER)
    rows = {}
    for zero_points in ZERO_POINTS:
        for imatrix in (True, False):
            out = args.work / f"{zero_points}-{'imatrix' if imatrix else 'plain'}"
            shutil.rmtree(out, ignore_errors=True)
            result = quantize_artifact(
                source, out, bits=4, recipe="kquant", accuracy_level=0, zero_points=zero_points, imatrix=imatrix
            )
            made = result.artifact.manifest.quantization
            rows[f"{zero_points}, {'imatrix' if imatrix else 'no imatrix'}"] = {
                "logits_mean_abs": result.quality["logits_mean_abs"],
                "logits_max_abs": result.quality["logits_max_abs"],
                "greedy_agreement": result.quality["greedy_agreement"],
                "zero_points_chosen": made["zero_points_chosen"],
            }
            row = rows[f"{zero_points}, {'imatrix' if imatrix else 'no imatrix'}"]
            print(f"{zero_points}, imatrix {imatrix}: mean logit error {row['logits_mean_abs']:.3f}", flush=True)
    report = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": "tests/toolkit/quantize/planted.py export_planted(1 layer, loud channels "
        f"{LOUD}, weights x 1/{LOUDER})",
        "rows": rows,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
