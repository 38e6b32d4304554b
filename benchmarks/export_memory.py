"""Peak memory and time of `toolkit export --from` on a random-weight Llama checkpoint of a real width.

Builds a LlamaForCausalLM with transformers (hidden 1024, 16 heads, 4 KV heads, intermediate 2816, vocab 32000,
untied; LAYERS layers), saves it as safetensors, then exports it in a child process and reads the child's
peak resident set size (getrusage RUSAGE_CHILDREN) and wall time. The ratio to the weight bytes is the figure
issue 16 targets (at most 1.3x).

    .venv/bin/python benchmarks/export_memory.py --layers 20 --json benchmarks/results/2026-12-01-export-memory.json

--from PATH exports that checkpoint instead (its weight bytes are the data file's size), --lowering and --dtype
are the export's, and --repeats N runs the export N times, each in a fresh child, reporting the median.
--baseline DIR (a worktree of another commit) also exports with that commit's code in every round, the order
alternating, and reports the median and spread of the per-round peak and wall-time ratios:

    git worktree add /tmp/before e1ed432
    .venv/bin/python benchmarks/export_memory.py --from /tmp/rs/llama-3.2-1b/hf --dtype bfloat16 --repeats 3 \
        --baseline /tmp/before --json /tmp/rs/1b-bf16.json

    .venv/bin/python benchmarks/gguf_shape.py llama-3.2-1b --type q4_0 --out /tmp/race-1b/llama-3.2-1b-shape.Q4_0.gguf
    .venv/bin/python benchmarks/export_memory.py --from /tmp/race-1b/llama-3.2-1b-shape.Q4_0.gguf --lowering ort \
        --repeats 3 --json benchmarks/results/2026-12-02-export-memory-1b-ort.json
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

ROOT = Path(__file__).resolve().parents[1]


def build(directory: Path, layers: int) -> int:
    code = (
        "import sys, torch, transformers\n"
        "c = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, "
        f"num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512, "
        "tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)\n"
        "torch.manual_seed(0)\n"
        "m = transformers.LlamaForCausalLM(c)\n"
        "m.save_pretrained(sys.argv[1])\n"
        "print(sum(p.numel() for p in m.parameters()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(directory)], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def export_once(
    toolkit: list[str], source: Path, out: Path, lowering: str, dtype: str | None = None, code: Path | None = None
) -> tuple[int, float]:
    """(peak RSS bytes, seconds) of one `toolkit export` in a fresh child (measured by `time -v`'s getrusage);
    `code`: a checkout of another commit whose packages the child imports instead of this one's."""
    start = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=str(code)) if code else None
    done = subprocess.run(
        ["/usr/bin/time", "-f", "%M", *toolkit, "export", "--from", str(source), "--out", str(out), "--no-verify",
         "--lowering", lowering, *(("--dtype", dtype) if dtype else ())],
        check=True, cwd=ROOT, capture_output=True, text=True, env=env,
    )  # fmt: skip
    return int(done.stderr.strip().splitlines()[-1]) * 1024, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--from", dest="source", type=Path, help="export this checkpoint instead of building one")
    parser.add_argument("--lowering", default="functions")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", help="the export's --dtype (default: the toolkit's choice for the checkpoint)")
    parser.add_argument(
        "--baseline",
        type=Path,
        help="a checkout of another commit (git worktree add DIR COMMIT): each round also exports with its code, "
        "the two in alternating order, and the per-round ratios of the peaks are reported",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    toolkit = [str(Path(sys.executable).parent / "toolkit")]
    runs = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        source = args.source or Path(tmp) / "hf"
        parameters = None if args.source else build(source, args.layers)
        for k in range(args.repeats):
            sides = [("ours", None)] + ([("baseline", args.baseline)] if args.baseline else [])
            run = {}
            for side, code in sides if k % 2 == 0 else sides[::-1]:
                out = Path(tmp) / f"art{k}-{side}"
                load_before = os.getloadavg()
                peak, seconds = export_once(toolkit, source, out, args.lowering, args.dtype, code)
                files = {p.name: p.stat().st_size for p in out.iterdir()}
                run[side] = {"peak_rss_bytes": peak, "export_seconds": seconds, "files": files,
                             "load_average_before": load_before, "load_average_after": os.getloadavg()}  # fmt: skip
                shutil.rmtree(out)
            runs.append({**run["ours"], **({"baseline": run["baseline"]} if args.baseline else {})})
    # the weights written: the float32 parameters built here, or an export's external data file (the graph file
    # when they are inside it)
    data = [size for name, size in files.items() if name.endswith(".data")] or [files["model.onnx"]]
    weights = parameters * 4 if parameters else max(data)
    peak = statistics.median(r["peak_rss_bytes"] for r in runs)
    compared = {}
    if args.baseline:
        ratios = [r["peak_rss_bytes"] / r["baseline"]["peak_rss_bytes"] for r in runs]
        seconds = [r["export_seconds"] / r["baseline"]["export_seconds"] for r in runs]
        base_peak = statistics.median(r["baseline"]["peak_rss_bytes"] for r in runs)
        compared = {
            "baseline": str(args.baseline),
            "baseline_commit": subprocess.run(
                ["git", "-C", str(args.baseline), "rev-parse", "HEAD"], capture_output=True, text=True
            ).stdout.strip(),
            "baseline_peak_rss_bytes": base_peak,
            "baseline_peak_rss_over_weights": base_peak / weights,
            "peak_over_baseline_median": statistics.median(ratios),
            "peak_over_baseline_spread": [min(ratios), max(ratios)],
            "seconds_over_baseline_median": statistics.median(seconds),
            "seconds_over_baseline_spread": [min(seconds), max(seconds)],
        }
    result = {
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "source": str(source) if args.source else f"random Llama, {args.layers} layers",
        "dtype": args.dtype,
        "weight_bytes": weights,
        **compared,
        "lowering": args.lowering,
        "layers": args.layers if not args.source else None,
        "parameters": parameters,
        "peak_rss_bytes": peak,
        "peak_rss_over_weights": peak / weights,
        "peak_rss_over_weights_spread": [
            min(r["peak_rss_bytes"] for r in runs) / weights,
            max(r["peak_rss_bytes"] for r in runs) / weights,
        ],  # fmt: skip
        "export_seconds": statistics.median(r["export_seconds"] for r in runs),
        "runs": runs,
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
