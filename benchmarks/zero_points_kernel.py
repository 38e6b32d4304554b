"""One MatMulNBits on ONNX Runtime's CPU kernel with each kind of zero point: is there a fast path for float ones?

Q4_1's float minimum would be held exactly by MatMulNBits' float zero points (-m/d per block), with no offsets
beside the node (exporters/gguf_blocks.py `float-zero-points`). This times one 4-bit MatMulNBits (K 1536, N 576,
block 32: a SmolLM2 down projection; random codes and scales) on one row, as a decode step runs it, with uint8
zero points, float zero points and none, at accuracy levels 4 and 0, in alternating rounds (the order reversed
every other round). It reports each layout's median microseconds per call and the median (min-max) of the
per-round ratios to uint8 zero points at level 4, round-to-nearest's layout, and the load average.

    .venv/bin/python benchmarks/zero_points_kernel.py --json benchmarks/results/<date>-zero-points-kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

K, N, BLOCK = 1536, 576, 32
LAYOUTS = (("uint8", 4), ("float", 4), ("none", 4), ("uint8", 0), ("float", 0))


def session(zero_points: str, level: int, threads: int, rng):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    blocks = K // BLOCK
    inits = [
        numpy_helper.from_array(rng.integers(0, 256, size=(N, blocks, BLOCK // 2), dtype=np.uint8), "B"),
        numpy_helper.from_array((rng.random(N * blocks, dtype=np.float32) * 0.01 + 0.001), "scales"),
    ]
    if zero_points == "uint8":  # two 4-bit zero points per byte
        inits.append(numpy_helper.from_array(rng.integers(0, 256, size=N * ((blocks + 1) // 2), dtype=np.uint8), "zp"))
    elif zero_points == "float":
        inits.append(numpy_helper.from_array((rng.random(N * blocks, dtype=np.float32) * 15), "zp"))
    node = helper.make_node(
        "MatMulNBits",
        ["A", *(i.name for i in inits)],
        ["Y"],
        domain="com.microsoft",
        K=K,
        N=N,
        bits=4,
        block_size=BLOCK,
        accuracy_level=level,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("A", TensorProto.FLOAT, [1, K])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, N])],
        inits,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=2000, help="timed calls per layout and round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    import onnxruntime

    rng = np.random.default_rng(0)
    names = [f"{zp} zero points, level {level}" for zp, level in LAYOUTS]
    sessions = {name: session(zp, level, args.threads, rng) for name, (zp, level) in zip(names, LAYOUTS, strict=True)}
    feed = {"A": rng.standard_normal((1, K)).astype(np.float32)}
    times, loads = {name: [] for name in names}, []
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in names if r % 2 == 0 else names[::-1]:
            run = sessions[name].run
            for _ in range(50):
                run(None, feed)
            start = time.perf_counter()
            for _ in range(args.calls):
                run(None, feed)
            times[name].append((time.perf_counter() - start) / args.calls * 1e6)
    base = times[names[0]]
    results = {}
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        results[name] = {
            "us_median": statistics.median(times[name]),
            "time_vs_uint8_level_4": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        }
        print(f"{name}: {results[name]['us_median']:.1f} us, {statistics.median(ratios):.2f}x uint8 at level 4")
    report = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "shape": {"K": K, "N": N, "block_size": BLOCK, "bits": 4, "rows": 1},
        "settings": {"rounds": args.rounds, "calls": args.calls, "threads": args.threads},
        "onnxruntime": onnxruntime.__version__,
        "load_average": {"min": min(loads), "max": max(loads)},
        "rounds_us": times,
        "results": results,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
