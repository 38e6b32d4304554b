"""Export time per layer as the slope over depth: what one more layer costs, apart from a once-per-export cost.

bench_families.py reports whole-export seconds over layers, which charges a family for costs paid once per
export (tracing its one block, importing the checkpoint's modules) as if they grew with depth. This script
builds each family's random-weight checkpoint at SmolLM2-360M's shape (bench_families.hf_config) at two
depths, then in every round exports each family at both (`toolkit export --from CKPT --out DIR --no-verify
--quiet`, wall time of the whole command, after bench_families' wait for idle CPUs, a contended
measurement repeated), the family order rotated each round and the depth order reversed every other round.
Per round and family: the slope (seconds at the deeper depth less at the shallower) / (depth difference) and
the intercept; the report gives the median over rounds of the per-round ratio of each family's slope to
llama's in the same round, with its min-max. No run is picked and none is dropped.

    .venv/bin/python benchmarks/export_slope.py --families llama,gemma2,gemma3 --depths 8,24 --rounds 4 \
        --json benchmarks/results/2026-12-03-export-slope.json

About 12 minutes on an idle 2-core machine for those three families; --work needs about 5 GB.
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
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_families import FEATURES, REFERENCE, ROOT, TOOLKIT, Quiet, load, spread  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="llama,gemma2,gemma3", help=f"{REFERENCE} first (default %(default)s)")
    parser.add_argument("--depths", default="8,24", help="two layer counts (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for idle CPUs per export")
    parser.add_argument("--budget", type=float, default=600.0, help="seconds of waiting and repeating in all")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "export-slope")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    families = tuple(args.families.split(","))
    if families[0] != REFERENCE or not set(families) <= set(FEATURES):
        raise SystemExit(f"--families: {REFERENCE} first, then any of {', '.join(sorted(FEATURES))}")
    shallow, deep = sorted(int(d) for d in args.depths.split(","))
    if not 1 <= shallow < deep:
        raise SystemExit("--depths: two different positive layer counts")

    load_start = load()
    print(f"load average at start: {load_start}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoints = {(f, d): args.work / f"{f}-{d}-hf" for f in families for d in (shallow, deep)}
    for (family, depth), directory in checkpoints.items():
        shutil.rmtree(directory, ignore_errors=True)
        build = [sys.executable, str(ROOT / "benchmarks" / "bench_families.py"), "--build", family, str(directory)]
        if subprocess.run([*build, "--layers", str(depth)], cwd=ROOT).returncode != 0:
            raise SystemExit(f"building the {family} checkpoint at {depth} layers failed")
    out = args.work / "out"
    quiet = Quiet(args.max_wait, args.budget)
    rounds = []
    for k in range(args.rounds):
        order = list(families[k % len(families) :] + families[: k % len(families)])
        depths = (shallow, deep) if k % 2 == 0 else (deep, shallow)
        record = {"round": k + 1, "order": order, "depth_order": list(depths), "load_average_start": load()}
        record["export"] = {f: {} for f in families}
        for family in order:
            for depth in depths:
                command = [*TOOLKIT, "export", "--from", str(checkpoints[family, depth]), "--out", str(out)]
                record["export"][family][str(depth)] = quiet.measure(
                    [*command, "--no-verify", "--quiet"],
                    f"export {family} at {depth} layers",
                    prepare=lambda: shutil.rmtree(out, ignore_errors=True),
                )
        record["load_average_end"] = load()
        record["slope_s_per_layer"], record["intercept_s"] = {}, {}
        for family in families:
            t_shallow, t_deep = (record["export"][family][str(d)]["seconds"] for d in (shallow, deep))
            slope = (t_deep - t_shallow) / (deep - shallow)
            record["slope_s_per_layer"][family] = slope
            record["intercept_s"][family] = t_shallow - slope * shallow
        record["slope_vs_llama"] = {
            f: s / record["slope_s_per_layer"][REFERENCE] for f, s in record["slope_s_per_layer"].items()
        }
        print(
            f"round {k + 1}: "
            + ", ".join(
                f"{f} {record['slope_s_per_layer'][f]:.3f} s/layer ({record['slope_vs_llama'][f]:.2f}x), "
                f"+{record['intercept_s'][f]:.1f} s"
                for f in families
            ),
            flush=True,
        )
        rounds.append(record)
    shutil.rmtree(out, ignore_errors=True)

    summary = {}
    for family in families:
        slopes = [r["slope_s_per_layer"][family] for r in rounds]
        summary[family] = {
            "slope_s_per_layer": round(statistics.median(slopes), 4),
            "slope_vs_llama": spread([r["slope_vs_llama"][family] for r in rounds]),
            "intercept_s": round(statistics.median(r["intercept_s"][family] for r in rounds), 2),
            "whole_export_s_per_layer_at_deep": round(
                statistics.median(r["export"][family][str(deep)]["seconds"] for r in rounds) / deep, 4
            ),
        }
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count()},
        "depths": [shallow, deep],
        "load_average_start": load_start,
        "load_average_end": load(),
        "contended_measurements": sum(
            1 for r in rounds for f in families for d in r["export"][f].values() if d["contended_attempts"]
        ),
        "summary": summary,
        "rounds": rounds,
    }
    args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
