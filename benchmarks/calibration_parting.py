"""Where the sampled calibration text parts when the float model's logits move in their last bits.

GPTQ and --tune-scales calibrate on text the float model writes by sampling (toolkit/quantize/sensitivity.py
sampled_calibration). A token is drawn from the softmax of the logits, so two computations of the same function
that differ in float32 rounding (another runtime, another kernel, another machine) draw the same tokens until a
draw lands within that difference of a boundary between two tokens; from there the row continues differently.
This samples the text of a float artifact on ONNX Runtime twice (is it deterministic here?) and once with each
other backend given (the eager PyTorch model in float32 or float64: the same function, rounded differently), and
reports per row the first position where each parts from ONNX Runtime's text, with the load average.

    .venv/bin/python benchmarks/calibration_parting.py /tmp/rot/permutation/ort --rows 8 --json ...
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.artifacts import open_artifact  # noqa: E402
from toolkit.quantize.sensitivity import DEFAULT_CALIBRATION_SEED, calibration, sampled_calibration  # noqa: E402


def parting(a: np.ndarray, b: np.ndarray) -> list:
    """Per row, the first position where rows of a and b differ, or None where they do not."""
    return [int(np.argmax(x != y)) if (x != y).any() else None for x, y in zip(a, b, strict=True)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=DEFAULT_CALIBRATION_SEED)
    parser.add_argument("--backends", default="eager,eager-f64", help="comma-separated runners to part from ort-cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    source = open_artifact(args.artifact)
    base = calibration(source)
    texts, seconds = {}, {}
    for backend in ["ort-cpu", "ort-cpu again", *args.backends.split(",")]:
        start = time.perf_counter()
        sampled = sampled_calibration(source, base, args.rows, args.tokens, args.seed, backend.split(" ")[0])
        texts[backend], seconds[backend] = sampled.feed["input_ids"], round(time.perf_counter() - start, 1)
    prompt = max(min(len(base.feed["input_ids"][0]) // args.rows, texts["ort-cpu"].shape[1] - 1), 1)
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average": os.getloadavg(),
        "rows": args.rows,
        "tokens": int(texts["ort-cpu"].shape[1]),
        "prompt_tokens_per_row": prompt,
        "seed": args.seed,
        "first_parting_from_ort_cpu": {b: parting(texts["ort-cpu"], t) for b, t in texts.items() if b != "ort-cpu"},
        "seconds": seconds,
    }
    for backend, where in results["first_parting_from_ort_cpu"].items():
        parted = [w for w in where if w is not None]
        print(f"{backend}: {len(parted)} of {args.rows} rows part from ort-cpu's text, at {parted}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
