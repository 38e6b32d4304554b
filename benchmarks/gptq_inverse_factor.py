"""GPTQ's update weights: one factorisation of H (exporters/gptq.py) against factoring, inverting and factoring again.

GPTQ rounds with the upper Cholesky factor U of H^-1 (H^-1 = U^T U). The paper's code reaches it by factoring H,
inverting it from that factor and factoring the inverse (torch.linalg.cholesky, torch.cholesky_inverse,
torch.linalg.cholesky upper: about 4/3 K^3 flops); exporters/gptq._inverse_cholesky factors H with its channels
reversed once and solves the inverse of that factor in blocks of rows (about 2/3 K^3). This times both on one
damped H of width K (a down projection's input: Llama-3.2-1B's is 8192) in alternating rounds (the order reversed
every other round), checks that they agree, and reports each side's median seconds, the median (min-max) of the
per-round ratios textbook / ours, and the load average.

    .venv/bin/python benchmarks/gptq_inverse_factor.py --json benchmarks/results/<date>-gptq-inverse-factor.json
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
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from exporters.gptq import DAMPING, _inverse_cholesky  # noqa: E402


def textbook(h: torch.Tensor) -> torch.Tensor:
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def damped_hessian(k: int, rows: int) -> torch.Tensor:
    """E[x^T x] of `rows` activations with channels of unequal loudness, damped as gptq_blocks damps it."""
    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.standard_normal((rows, k)) * np.exp(rng.standard_normal(k)))
    h = x.T @ x / rows
    torch.diagonal(h).add_(DAMPING * torch.diagonal(h).mean())
    return h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=2048, help="activation rows behind H (the recipe's 8 x 256)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    h = damped_hessian(args.k, args.rows)
    sides = {"textbook": textbook, "ours": _inverse_cholesky}
    times, loads, made = {name: [] for name in sides}, [], {}
    for r in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name in sides if r % 2 == 0 else list(sides)[::-1]:
            start = time.perf_counter()
            made[name] = sides[name](h)
            times[name].append(time.perf_counter() - start)
    difference = float((made["ours"] - made["textbook"]).abs().max() / made["textbook"].abs().max())
    if difference > 1e-10:
        print(f"the factors differ by {difference:.2e} of the largest entry", file=sys.stderr)
        return 1
    ratios = [t / o for t, o in zip(times["textbook"], times["ours"], strict=True)]
    results = {
        "seconds_median": {name: statistics.median(times[name]) for name in sides},
        "textbook_over_ours": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "max_difference_over_largest_entry": difference,
    }
    seconds = results["seconds_median"]
    print(
        f"K {args.k}: textbook {seconds['textbook']:.2f} s, ours {seconds['ours']:.2f} s, "
        f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}); factors agree to {difference:.1e}"
    )
    report = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "settings": {"k": args.k, "rows": args.rows, "rounds": args.rounds, "threads": args.threads},
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": {"min": min(loads), "max": max(loads)},
        "rounds_seconds": times,
        "results": results,
    }
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
