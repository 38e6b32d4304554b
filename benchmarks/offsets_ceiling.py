"""How fast a quantized artifact's decode step would be if its per-block offsets cost nothing: the ceiling of
making them cheaper.

A float minimum per block (Q4_1's, the k-quants' with `--zero-points offsets`) is added beside each MatMulNBits
by a block sum, a [blocks, N] MatMul and an Add (exporters/quantize.py _with_offsets). This script writes a copy
of the artifact's graph with those nodes removed, every Add's output taken from its MatMulNBits instead (wrong
numbers, the same shapes), and times one-token decode steps of both graphs in ONNX Runtime (plus any further
artifacts named with --also, as they are), in alternating rounds: batch 1, `--past` cached positions of random
keys and values, 2 intra-op threads. It reports the median and range of the per-round ratios to the artifact as
it is, and the load average. Raw session runs, without the runner's IO binding, so the ratios are what to read.

    .venv/bin/python benchmarks/offsets_ceiling.py /tmp/race-xeon/default --also /tmp/race-xeon/rtn-acc4 \
        --json benchmarks/results/2026-12-03-offsets-ceiling-xeon.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.artifacts import open_artifact  # noqa: E402


def without_offsets(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """(a copy of `proto` whose offset Adds are gone, how many): an Add of a MatMulNBits output and a MatMul by
    a constant is replaced by the MatMulNBits output; nodes nothing reads any more are dropped."""
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    graph = proto.graph
    constants = {i.name for i in graph.initializer}
    made = {output: node for node in graph.node for output in node.output}
    rename = {}
    for node in graph.node:
        if node.op_type != "Add" or len(node.input) != 2:
            continue
        sources = [made.get(name) for name in node.input]
        kinds = [None if s is None else s.op_type for s in sources]
        if sorted(kinds, key=str) != ["MatMul", "MatMulNBits"]:
            continue
        matmul = sources[kinds.index("MatMul")]
        if matmul.input[1] in constants:
            rename[node.output[0]] = sources[kinds.index("MatMulNBits")].output[0]
    kept = [n for n in graph.node if not (n.op_type == "Add" and n.output[0] in rename)]
    for node in kept:
        node.input[:] = [rename.get(name, name) for name in node.input]
    wanted = {o.name for o in graph.output}
    alive = []
    for node in reversed(kept):  # the graph is topologically sorted: readers come after what they read
        if any(output in wanted for output in node.output):
            alive.append(node)
            wanted.update(name for name in node.input if name)
    del graph.node[:]
    graph.node.extend(reversed(alive))
    used = {name for node in graph.node for name in node.input}
    live = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live)
    return proto, len(rename)


def session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def feed(sess, past: int) -> dict:
    rng, values = np.random.default_rng(0), {}
    for spec in sess.get_inputs():
        if spec.name == "input_ids":
            values[spec.name] = np.array([[42]], dtype=np.int64)
        elif spec.name == "position_ids":
            values[spec.name] = np.array([[past]], dtype=np.int64)
        elif spec.name == "past_mask":
            values[spec.name] = np.ones((1, past), dtype=np.int64)
        else:  # past.N.key/value: [batch, kv_heads, past, head_dim]
            shape = [1, spec.shape[1], past, spec.shape[3]]
            values[spec.name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifact", type=Path, help="a quantized artifact whose MatMulNBits carry offsets")
    parser.add_argument("--also", type=Path, action="append", default=[], help="another artifact, timed as it is")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50, help="decode steps per round and graph")
    parser.add_argument("--past", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    artifact = open_artifact(args.artifact)
    with tempfile.TemporaryDirectory() as scratch:
        proto = onnx.load(str(artifact.model_path))
        stripped, removed = without_offsets(proto)
        if removed == 0:
            raise SystemExit(f"{args.artifact}: no offsets beside its MatMulNBits; nothing to measure")
        path = Path(scratch) / "without-offsets.onnx"
        onnx.save(stripped, str(path), save_as_external_data=True, location="without-offsets.onnx.data")
        del proto, stripped
        graphs = {"as it is": artifact.model_path, "offsets removed": path}
        graphs.update({str(p): open_artifact(p).model_path for p in args.also})
        sessions = {name: session(p, args.threads) for name, p in graphs.items()}
        feeds = {name: feed(s, args.past) for name, s in sessions.items()}
        for name, s in sessions.items():
            for _ in range(10):
                s.run(None, feeds[name])
        names, times, loads = list(sessions), {name: [] for name in sessions}, []
        for r in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in names if r % 2 == 0 else names[::-1]:
                start = time.perf_counter()
                for _ in range(args.steps):
                    sessions[name].run(None, feeds[name])
                times[name].append((time.perf_counter() - start) / args.steps * 1e3)
    base = times["as it is"]
    results = {}
    for name in names:
        ratios = [b / t for b, t in zip(base, times[name], strict=True)]
        results[name] = {
            "step_ms_median": statistics.median(times[name]),
            "speed_vs_as_it_is": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        }
        print(f"{name}: {results[name]['step_ms_median']:.2f} ms/step, {statistics.median(ratios):.3f}x", flush=True)
    import onnxruntime

    report = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "artifact": str(args.artifact),
        "offset_adds_removed": removed,
        "settings": {"rounds": args.rounds, "steps": args.steps, "past": args.past, "threads": args.threads},
        "onnxruntime": onnxruntime.__version__,
        "load_average": {"min": min(loads), "max": max(loads)},
        "rounds_ms": times,
        "results": results,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
