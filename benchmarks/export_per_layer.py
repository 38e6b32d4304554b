"""Export time per layer of each decoder family against the Llama family: the cost of one more layer.

`bench_families.py` divides a whole `toolkit export` by the layer count, so what an export pays once (process
start, imports, tracing one block, which is larger for some families) is spread over the layers. Here each
family is exported at two depths, and the cost of a layer is the difference over the layers added:
(T(deep) - T(shallow)) / (deep - shallow). Checkpoints are bench_families.py's (random float32 weights at
SmolLM2-360M's shape, built with transformers). Every round exports every family at both depths, the order
rotated each round (depths alternating which goes first); each export is the wall time of the whole command
with --no-verify. Per family the report gives the median over rounds of the per-round ratio to llama (the
marginal cost and the whole export at the deep depth), with min-max; nothing is picked or dropped. The load
average is recorded before and after each round.

    .venv/bin/python benchmarks/export_per_layer.py --families llama,gemma2,gemma3,smollm3 --depths 8,24 \\
        --rounds 3 --json benchmarks/results/2026-12-02-export-per-layer.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_families import FEATURES, REFERENCE, SHAPE, TOOLKIT  # noqa: E402


def export_seconds(checkpoint: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    subprocess.run(
        [*TOOLKIT, "export", "--from", str(checkpoint), "--out", str(out), "--no-verify", "--quiet"],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - start
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,gemma2,gemma3,smollm3")
    parser.add_argument("--depths", default="8,24", help="two layer counts, shallow,deep")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/export-per-layer"))
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    families = args.families.split(",")
    if REFERENCE not in families:
        families.insert(0, REFERENCE)
    shallow, deep = (int(d) for d in args.depths.split(","))
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoints = {}
    for family in families:
        for depth in (shallow, deep):
            path = args.work / f"{family}-{depth}-hf"
            if not (path / "config.json").exists():
                build = [sys.executable, str(ROOT / "benchmarks" / "bench_families.py"), "--build", family, str(path)]
                subprocess.run([*build, "--layers", str(depth)], check=True, stdout=subprocess.DEVNULL)
            checkpoints[family, depth] = path
    rounds = []
    for r in range(args.rounds):
        order = families[r % len(families) :] + families[: r % len(families)]
        depths = (shallow, deep) if r % 2 == 0 else (deep, shallow)
        record = {"order": order, "depth_order": list(depths), "load_before": os.getloadavg(), "seconds": {}}
        for family in order:
            for depth in depths:
                seconds = export_seconds(checkpoints[family, depth], args.work / "out")
                record["seconds"][f"{family}@{depth}"] = seconds
        record["load_after"] = os.getloadavg()
        seconds = record["seconds"]
        record["per_layer"] = {
            f: (seconds[f"{f}@{deep}"] - seconds[f"{f}@{shallow}"]) / (deep - shallow) for f in families
        }
        rounds.append(record)
        print(
            f"round {r + 1}: "
            + "; ".join(f"{f} {record['per_layer'][f]:.3f} s/layer, {seconds[f'{f}@{deep}']:.1f} s" for f in families)
            + f"; load {record['load_before'][0]:.2f} -> {record['load_after'][0]:.2f}",
            flush=True,
        )
    summary = {}
    for family in families:
        summary[family] = {
            "what_differs": FEATURES[family],
            "per_layer_seconds": spread([r["per_layer"][family] for r in rounds]),
            "per_layer_vs_llama": spread([r["per_layer"][family] / r["per_layer"][REFERENCE] for r in rounds]),
            "deep_export_seconds": spread([r["seconds"][f"{family}@{deep}"] for r in rounds]),
            "deep_export_vs_llama": spread(
                [r["seconds"][f"{family}@{deep}"] / r["seconds"][f"{REFERENCE}@{deep}"] for r in rounds]
            ),
        }
    result = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "shape": SHAPE,
        "depths": [shallow, deep],
        "rounds": rounds,
        "median_over_rounds": summary,
    }
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(
        "| family | per layer (s) | vs llama's (min-max) | whole export at", deep, "layers (s) | vs llama's (min-max) |"
    )
    for family, row in summary.items():
        p, pv, d, dv = (
            row[k] for k in ("per_layer_seconds", "per_layer_vs_llama", "deep_export_seconds", "deep_export_vs_llama")
        )
        print(
            f"| {family} | {p['median']:.3f} | {pv['median']:.2f} ({pv['min']:.2f}-{pv['max']:.2f}) | "
            f"{d['median']:.1f} | {dv['median']:.2f} ({dv['min']:.2f}-{dv['max']:.2f}) |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
