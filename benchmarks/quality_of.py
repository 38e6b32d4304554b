"""The quantize command's quality report (logit error, greedy agreement, perplexity, KL from float) of artifacts that
already exist, against their float artifact: to measure what an earlier quantization was not, without redoing it.

Each artifact is measured with `evaluate_quality`, the report `toolkit quantize` writes into its manifest, on the
same text (`--text`, as --perplexity-text; the fixed text without it); the numbers are those the command would
report for it today. The float log-probabilities wait on disk beside `--json` between the two models (about
0.75 GB for SmolLM2 on 8k tokens).

    .venv/bin/python benchmarks/quality_of.py /tmp/rot/permutation/ort /tmp/q/gptq-tuned \
        --text /usr/share/common-licenses/GPL-3 --json /tmp/quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.artifacts import open_artifact  # noqa: E402
from toolkit.quantize.pipeline import evaluate_quality, read_perplexity_text  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("float", type=Path, help="the float artifact the quantized ones came from")
    parser.add_argument("quantized", type=Path, nargs="+", help="quantized artifacts of it")
    parser.add_argument("--text", type=Path, help="the perplexity text (--perplexity-text)")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    reference = open_artifact(args.float)
    text = read_perplexity_text(reference, args.text) if args.text is not None else None
    results = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "float": str(args.float),
        "artifacts": {},
    }
    for path in args.quantized:
        artifact = open_artifact(path)
        load, start = os.getloadavg()[0], time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=".quality-of-", dir=args.json.resolve().parent) as scratch:
            quality = evaluate_quality(reference, artifact, text=text, scratch=Path(scratch))
        results["artifacts"][str(path)] = {
            "quantization": {k: v for k, v in artifact.manifest.quantization.items() if k != "quality"},
            "quality": quality,
            "seconds": round(time.perf_counter() - start, 1),
            "load_average": load,
        }
        print(
            f"{path}: agreement {quality['greedy_agreement']:.1%}, perplexity {quality['perplexity_quantized']:.3f} "
            f"({quality['perplexity_quantized'] / quality['perplexity_float'] - 1:+.2%} of float "
            f"{quality['perplexity_float']:.3f}), KL from float {quality['kl_from_float']:.4f}",
            flush=True,
        )
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
