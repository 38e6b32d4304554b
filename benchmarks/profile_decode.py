"""Where a decode step's time goes, by ONNX operator: ONNX Runtime's own profiler over one-token steps.

Runs ARTIFACT/model.onnx (a KV-cache graph of `toolkit export`) for one new token after a random past of
--past positions, --warmup steps then --steps profiled ones, and prints each operator type's kernel time per
step, its node count and its share. A profile, not a benchmark: the profiler adds its own time, so the
shares are what it says, and the tok/s figures belong to `toolkit bench`.

    .venv/bin/python benchmarks/profile_decode.py ARTIFACT [--json FILE]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def profile(model: Path, past: int, warmup: int, steps: int, threads: int) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.enable_profiling = True
    options.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "decode")
    session = ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {
        "input_ids": np.array([[5]], np.int64),
        "position_ids": np.array([[past]], np.int64),
        "past_mask": np.ones((1, past), np.int64),
    }
    for spec in session.get_inputs():
        if spec.name.startswith("past."):
            feed[spec.name] = rng.random((1, spec.shape[1], past, spec.shape[3]), dtype=np.float32)
    for _ in range(warmup):
        session.run(None, feed)
    start = time.perf_counter()
    for _ in range(steps):
        session.run(None, feed)
    step_ms = (time.perf_counter() - start) / steps * 1e3
    trace = session.end_profiling()
    events = json.loads(Path(trace).read_text())
    os.remove(trace)
    runs = warmup + steps
    micros, nodes = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            micros[event["args"]["op_name"]] += event["dur"]
            nodes[event["args"]["op_name"]] += 1
    total = sum(micros.values())
    return {
        "step_ms_profiled": step_ms,
        "kernel_ms_per_step": total / runs / 1e3,
        "operators": [
            {"op": op, "ms_per_step": us / runs / 1e3, "nodes": nodes[op] // runs, "share": us / total}
            for op, us in micros.most_common()
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", type=Path, nargs="+")
    parser.add_argument("--past", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    report = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "load_average_start": os.getloadavg(),
        "artifacts": {},
    }
    for artifact in args.artifacts:
        result = profile(artifact / "model.onnx", args.past, args.warmup, args.steps, args.threads)
        report["artifacts"][str(artifact)] = result
        print(f"== {artifact}: {result['step_ms_profiled']:.2f} ms per step (profiled)")
        for row in result["operators"][:8]:
            print(f"  {row['op']:34s} {row['ms_per_step']:7.3f} ms  {row['nodes']:4d} nodes  {row['share']:6.1%}")
    report["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
