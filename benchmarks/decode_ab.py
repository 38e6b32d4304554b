"""Decode speed of two artifacts side by side: `toolkit bench` on each in every round, alternating which goes first.

For a change that should leave decode alone (a different graph for the same math), export one checkpoint with
the old and the new code and give both artifacts here. Each round runs `toolkit bench ARTIFACT --backends
ort-cpu --batch 1` on A and on B, in the order A, B on odd rounds and B, A on even ones, and records decode
tokens/s, prefill ms and peak RSS of both with the load average before each. The report is the median of the
per-round ratios B / A with their min-max; no round is picked or dropped.

    .venv/bin/python benchmarks/decode_ab.py /tmp/ab/old /tmp/ab/new --rounds 8 --new-tokens 64 \
        --json benchmarks/results/2026-12-04-gemma2-geglu-decode-ab-script.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOOLKIT = Path(sys.executable).with_name("toolkit")


def bench(artifact: Path, args, out: Path) -> dict:
    command = [str(TOOLKIT), "bench", str(artifact), "--backends", "ort-cpu", "--batch", "1"]
    command += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
    command += ["--repeats", str(args.repeats), "--threads", str(args.threads), "--json", str(out)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    row = json.loads(out.read_text())["results"][0]
    return {k: row[k] for k in ("decode_tokens_per_s", "prefill_ms", "peak_rss_mb")}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="the baseline artifact")
    parser.add_argument("b", type=Path, help="the artifact compared with it")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for r in range(1, args.rounds + 1):
            order = ("a", "b") if r % 2 else ("b", "a")
            row = {"round": r, "order": list(order), "load_average": {}}
            for side in order:
                row["load_average"][side] = list(os.getloadavg())
                row[side] = bench(getattr(args, side), args, Path(work) / f"{side}.json")
            row["decode_ratio_b_over_a"] = row["b"]["decode_tokens_per_s"] / row["a"]["decode_tokens_per_s"]
            row["prefill_ratio_a_over_b"] = row["a"]["prefill_ms"] / row["b"]["prefill_ms"]
            print(
                f"round {r} ({', '.join(order)}): a {row['a']['decode_tokens_per_s']:.2f} tok/s, "
                f"b {row['b']['decode_tokens_per_s']:.2f} tok/s, b/a {row['decode_ratio_b_over_a']:.3f}",
                flush=True,
            )
            rounds.append(row)
    report = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"processor": platform.processor(), "cpus": os.cpu_count()},
        "a": str(args.a),
        "b": str(args.b),
        "settings": {k: getattr(args, k) for k in ("rounds", "prompt_len", "new_tokens", "repeats", "threads")},
        "rounds": rounds,
        "summary": {
            "decode_ratio_b_over_a": spread([r["decode_ratio_b_over_a"] for r in rounds]),
            "prefill_speed_ratio_b_over_a": spread([r["prefill_ratio_a_over_b"] for r in rounds]),
        },
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
