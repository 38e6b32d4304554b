"""Decode speed and export time of every Hugging Face decoder family, against the Llama family, in rounds.

For each family (llama, llama3, mistral, qwen2, qwen3) a random-weight float32 checkpoint of
SmolLM2-360M's shape (hidden 960, intermediate 2560, 15 heads, 5 KV heads of width 64, vocab 49152, tied
embeddings, max_position_embeddings 8192) is built with transformers (`AutoModelForCausalLM.from_config`,
`torch.manual_seed(0)`) and saved with `save_pretrained`; the families differ only in what makes them
that family:
  llama    plain LlamaConfig, rope_theta 100000
  llama3   the same with llama3 RoPE scaling (factor 8, low/high freq 1/4, original 8192, theta 500000)
  mistral  MistralConfig with sliding_window 256 (the prompt + new tokens stay under the window)
  qwen2    Qwen2Config: q/k/v projection biases
  qwen3    Qwen3Config with head_dim 64: per-head q/k RMSNorm

The machine is shared and noisy, so nothing is measured once. Every round measures every family once,
the order rotated each round: the first --export-rounds rounds time `toolkit export --from CKPT --out DIR`
(default verification against transformers included; wall time of the whole command), and every round
runs `toolkit bench ARTIFACT` (ort-cpu, batch 1) per family. Per family the report gives the median over
rounds of the per-round ratio to llama in the same round (decode fraction of the bandwidth bound; export
seconds per layer) with its min-max. No run is picked and none is dropped. Each bench call probes the
read bandwidth itself and that probe alone moves +-25 % between calls here, so a round's fractions of
the bound all use one bandwidth, the median of the round's probes (a ratio of fractions is then the ratio
of bytes-weighted decode speeds); the ratios with each call's own probe are kept in the JSON too.

Other jobs on the 2 cores (a test suite on both) slow a 2-thread measurement up to 3x, so before each
measurement the script waits (at most --max-wait seconds) until the CPUs have been idle for 2 s, records
the share of the machine's CPU time other processes used while it ran (`other_cpu_share`: system busy
time less this script's children's, over wall x cores), and repeats a measurement during which that share
was over 15 % (at most twice, while --budget seconds of waiting and repeating last). The repeated ones
stay in the JSON; the last attempt counts whatever its share, and the summary counts the contended ones.

    .venv/bin/python benchmarks/bench_families.py [--layers 32] [--rounds 5] [--export-rounds 3] [--keep]
    .venv/bin/python benchmarks/bench_families.py --resummarise RESULTS.json   # recompute, measure nothing

About 30 minutes on an idle 2-core machine at 32 layers (each checkpoint and artifact is about 1.45 GB;
--work needs about 15 GB). Writes benchmarks/results/2026-12-01-families.json unless --json says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = [sys.executable, "-c", "import sys; sys.argv[0] = 'toolkit'; from toolkit.cli import main; main()"]
FAMILIES = ("llama", "llama3", "mistral", "qwen2", "qwen3")
# The other imported architectures, each run against llama in the same rounds (--families).
MORE_FAMILIES = ("llama", "gemma2", "gemma3", "olmo2", "granite", "phi3", "smollm3", "gpt_neox")
REFERENCE = "llama"
# SmolLM2-360M's shape, per layer and overall (its config.json), less the layer count.
SHAPE = {
    "vocab_size": 49152,
    "hidden_size": 960,
    "intermediate_size": 2560,
    "num_attention_heads": 15,
    "num_key_value_heads": 5,
    "tie_word_embeddings": True,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
}
SLIDING_WINDOW = 256
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
    "rope_theta": 500000.0,
}
FEATURES = {
    "llama": "plain Llama",
    "llama3": "llama3 RoPE scaling",
    "mistral": f"sliding window {SLIDING_WINDOW}",
    "qwen2": "q/k/v biases",
    "qwen3": "q/k RMSNorm",
    "gemma2": "GeGLU, sandwich norms, soft caps, alternating windows",
    "gemma3": "Gemma 2's less soft caps, q/k norms, local RoPE base",
    "olmo2": "norms after each branch, full-width q/k norms",
    "granite": "embedding/attention/residual/logits multipliers",
    "phi3": "fused qkv/gate_up split at import, sliding window",
    "smollm3": "no RoPE on every 4th layer",
    "gpt_neox": "LayerNorm, GELU MLP with biases, parallel residual, partial rotary",
}
QUIET_SHARE = 0.15  # the CPUs count as idle below this busy share over a 2 s sample
CONTENDED_SHARE = 0.15  # a measurement during which other processes used more than this is repeated
MAX_REPEATS = 2


def hf_config(family: str, layers: int):
    import transformers

    shape = dict(SHAPE, num_hidden_layers=layers)
    if family == "llama":
        return transformers.LlamaConfig(**shape, rope_theta=100000.0)
    if family == "llama3":
        return transformers.LlamaConfig(**shape, rope_parameters=dict(LLAMA3_ROPE))
    if family == "mistral":
        return transformers.MistralConfig(**shape, head_dim=64, rope_theta=100000.0, sliding_window=SLIDING_WINDOW)
    if family == "qwen2":
        return transformers.Qwen2Config(**shape, rope_theta=100000.0)
    if family == "qwen3":
        return transformers.Qwen3Config(**shape, head_dim=64, rope_theta=100000.0)
    window = dict(sliding_window=SLIDING_WINDOW)
    if family == "gemma2":
        return transformers.Gemma2Config(**shape, head_dim=64, rope_theta=100000.0, query_pre_attn_scalar=64, **window)
    if family == "gemma3":
        return transformers.Gemma3TextConfig(**shape, head_dim=64, query_pre_attn_scalar=64, **window)
    if family == "olmo2":
        return transformers.Olmo2Config(**shape, rope_theta=100000.0)
    if family == "granite":
        multipliers = dict(embedding_multiplier=12.0, attention_multiplier=0.015625, residual_multiplier=0.22)
        return transformers.GraniteConfig(**shape, rope_theta=100000.0, logits_scaling=8.0, **multipliers)
    if family == "phi3":
        return transformers.Phi3Config(**shape, rope_theta=100000.0, **window)
    if family == "smollm3":
        return transformers.SmolLM3Config(
            **shape, rope_theta=100000.0, pad_token_id=None, bos_token_id=None, eos_token_id=None
        )
    if family == "gpt_neox":
        neox = {k: v for k, v in shape.items() if k not in ("num_key_value_heads", "rms_norm_eps")}
        return transformers.GPTNeoXConfig(**neox, rotary_pct=0.25, rope_theta=10000.0, use_parallel_residual=True)
    raise ValueError(family)


def build_checkpoint(family: str, layers: int, out: Path) -> None:
    """Random float32 weights of `family` at `layers` layers, saved as a Hugging Face directory (run in a child)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family, layers), dtype=torch.float32)
    model.save_pretrained(out)


def cpu_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (all cores), from /proc/stat."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Quiet:
    """Waits for idle CPUs before a measurement and repeats a contended one, within a whole-run time budget."""

    def __init__(self, max_wait: float, budget: float):
        self.max_wait, self.left, self.budget = max_wait, budget, budget

    def wait(self) -> dict:
        start = time.perf_counter()
        while True:
            before = cpu_busy_seconds()
            time.sleep(2.0)
            share = (cpu_busy_seconds() - before) / (2.0 * os.cpu_count())
            waited = time.perf_counter() - start
            if share < QUIET_SHARE or waited >= min(self.max_wait, self.left):
                self.left = max(0.0, self.left - waited)
                return {"waited_s": round(waited, 1), "busy_share_before": round(share, 3)}

    def measure(self, command: list[str], what: str, read=None, prepare=None) -> dict:
        """Run a measurement command after waiting for idle CPUs; repeat it (at most MAX_REPEATS times, while
        the budget lasts) when other processes used more than CONTENDED_SHARE of the CPUs during it. Returns
        the last attempt (wall seconds, others' CPU share, `read()`'s numbers) with the earlier ones in
        `contended_attempts`."""
        attempts = []
        while True:
            if prepare:
                prepare()
            gate = self.wait()
            busy0, ours0, t0 = cpu_busy_seconds(), children_cpu_seconds(), time.perf_counter()
            done = subprocess.run(command, cwd=ROOT, text=True, capture_output=True)
            wall = time.perf_counter() - t0
            other = (cpu_busy_seconds() - busy0) - (children_cpu_seconds() - ours0)
            if done.returncode != 0:
                sys.stderr.write(done.stdout + done.stderr)
                raise SystemExit(f"{what} failed with exit status {done.returncode}")
            share = round(max(0.0, other) / (wall * os.cpu_count()), 3)
            attempts.append({"seconds": wall, "other_cpu_share": share, **gate, **(read() if read else {})})
            if share <= CONTENDED_SHARE or len(attempts) > MAX_REPEATS or self.left <= 0:
                return {**attempts[-1], "contended_attempts": attempts[:-1]}
            print(f"  {what}: others used {share:.0%} of the CPUs; measuring again", flush=True)
            self.left = max(0.0, self.left - wall)


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    global FAMILIES
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32, help="every family gets the same count (default 32)")
    parser.add_argument("--rounds", type=int, default=5, help="bench rounds (default 5)")
    parser.add_argument("--export-rounds", type=int, default=3, help="the first N rounds also export (default 3)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-wait", type=float, default=120.0, help="seconds to wait for idle CPUs per measurement")
    parser.add_argument(
        "--budget", type=float, default=600.0, help="seconds of waiting and repeated measurements per run (default 600)"
    )
    parser.add_argument("--no-verify", action="store_true", help="pass --no-verify to toolkit export")
    parser.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated, llama first (default {','.join(FAMILIES)}; the others: {','.join(MORE_FAMILIES)})",
    )
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "bench-families")
    parser.add_argument("--keep", action="store_true", help="leave the checkpoints and artifacts in --work")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "2026-12-01-families.json")
    parser.add_argument("--build", nargs=2, metavar=("FAMILY", "DIR"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--resummarise",
        type=Path,
        metavar="JSON",
        help="recompute the derived numbers of a results file, measure nothing",
    )
    args = parser.parse_args()
    FAMILIES = tuple(args.families.split(","))
    if FAMILIES[0] != REFERENCE or not set(FAMILIES) <= set(FEATURES):
        raise SystemExit(f"--families: {REFERENCE} first, then any of {', '.join(sorted(FEATURES))}")
    if args.resummarise:
        resummarise(args.resummarise)
        return 0
    if args.build:
        build_checkpoint(args.build[0], args.layers, Path(args.build[1]))
        return 0
    if not 1 <= args.export_rounds <= args.rounds:
        raise SystemExit("--export-rounds must be between 1 and --rounds")
    if args.prompt_len + args.new_tokens > SLIDING_WINDOW:
        window_note = "prompt + new tokens reach past mistral's sliding window (the window masks)"
    else:
        window_note = "prompt + new tokens stay under mistral's sliding window (the window never masks)"

    started, load_start = time.perf_counter(), load()
    print(f"load average at start: {load_start}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    checkpoints = {f: args.work / f"{f}-hf" for f in FAMILIES}
    artifacts = {f: args.work / f"{f}-onnx" for f in FAMILIES}
    for family in FAMILIES:
        shutil.rmtree(checkpoints[family], ignore_errors=True)
        command = [sys.executable, __file__, "--build", family, str(checkpoints[family]), "--layers", str(args.layers)]
        if subprocess.run(command, cwd=ROOT).returncode != 0:
            raise SystemExit(f"building the {family} checkpoint failed")
        print(f"built {checkpoints[family]}", flush=True)
    built_s = time.perf_counter() - started

    quiet = Quiet(args.max_wait, args.budget)
    rounds = []
    for k in range(args.rounds):
        order = list(FAMILIES[k % len(FAMILIES) :] + FAMILIES[: k % len(FAMILIES)])
        record = {"round": k + 1, "order": order, "load_average_start": load(), "export": {}, "bench": {}}
        for family in order if k < args.export_rounds else ():
            command = [*TOOLKIT, "export", "--from", str(checkpoints[family]), "--out", str(artifacts[family])]
            command += ["--no-verify"] if args.no_verify else []
            record["export"][family] = quiet.measure(
                command,
                f"export {family}",
                prepare=lambda out=artifacts[family]: shutil.rmtree(out, ignore_errors=True),
            )
        for family in order:
            report_path = args.work / f"bench-{k + 1}-{family}.json"
            command = [*TOOLKIT, "bench", str(artifacts[family]), "--backends", "ort-cpu", "--batch", "1"]
            command += ["--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens)]
            command += ["--repeats", str(args.repeats), "--threads", str(args.threads), "--json", str(report_path)]
            reports = []

            def read(path=report_path, family=family, reports=reports):
                reports.append(json.loads(path.read_text()))
                (result,) = reports[-1]["results"]
                return {
                    **{key: result[key] for key in BENCH_KEYS},
                    "read_bandwidth_gbs": reports[-1]["machine"]["read_bandwidth_gbs"],
                    "artifact_files": sorted(p.name for p in artifacts[family].iterdir()),
                }

            record["bench"][family] = quiet.measure(command, f"bench {family}", read)
            report = reports[-1]
            record.setdefault("machine", report["machine"])
        record["load_average_end"] = load()
        rounds.append(derive(record))
        print_round(record)

    summary = summarise(rounds, args.layers, args.export_rounds)
    total_s = time.perf_counter() - started
    load_end = load()
    machine = {k: v for k, v in rounds[0].pop("machine").items() if "bandwidth" not in k and k != "load_average"}
    for record in rounds[1:]:
        record.pop("machine")
    machine["transformers"] = _version("transformers")
    machine["platform"] = platform.platform()
    command = ".venv/bin/python benchmarks/bench_families.py"
    for flag, value, default in (("--layers", args.layers, 32), ("--rounds", args.rounds, 5)):
        command += "" if value == default else f" {flag} {value}"
    command += "" if args.export_rounds == 3 else f" --export-rounds {args.export_rounds}"
    command += (
        ""
        if args.families == ",".join(("llama", "llama3", "mistral", "qwen2", "qwen3"))
        else (f" --families {args.families}")
    )
    command += " --no-verify" if args.no_verify else ""
    command += f" --json {args.json.relative_to(ROOT) if args.json.is_relative_to(ROOT) else args.json}"
    result = {
        "what": "toolkit export --from + toolkit bench (ort-cpu, batch 1, float32, default lowering) per decoder "
        "family, random weights at SmolLM2-360M's shape; per-round ratios to llama in the same round, "
        "medians (min-max) over rounds",
        "command": command,
        "machine": machine,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "settings": {
            "layers": args.layers,
            "rounds": args.rounds,
            "export_rounds": args.export_rounds,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "repeats": args.repeats,
            "threads": args.threads,
            "batch": 1,
            "backend": "ort-cpu",
            "export_verify": not args.no_verify,
            "shape": SHAPE,
            "llama3_rope": LLAMA3_ROPE,
            "mistral_sliding_window": SLIDING_WINDOW,
            "mistral_window_note": window_note,
            "export_seconds": "wall time of the whole `toolkit export` command (process start, import, "
            + ("export" if args.no_verify else "export, verification against transformers")
            + "), divided by the layer count for per layer",
            "quiet_gate": f"before each measurement, wait (<= {args.max_wait} s) for a 2 s sample with the CPUs "
            f"under {QUIET_SHARE:.0%} busy",
            "contended": f"other processes used > {CONTENDED_SHARE:.0%} of the CPUs during the measurement "
            f"(other_cpu_share); such a measurement is repeated, at most {MAX_REPEATS} times, while the "
            f"{args.budget:.0f} s budget for waiting and repeating lasts; the repeated ones are kept in "
            "contended_attempts, the last attempt counts whatever its share",
            **RATIO_NOTES,
        },
        "build_seconds": built_s,
        "budget_seconds_spent": args.budget - quiet.left,
        "total_seconds": total_s,
        "rounds": rounds,
        "median_over_rounds": summary,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(args.work, ignore_errors=True)
    print(table(summary))
    print(
        f"\n{args.rounds} bench rounds ({args.export_rounds} with exports), {args.layers} layers; load average "
        f"{load_start} at start, {load_end} at the end; total {total_s / 60:.1f} min "
        f"({result['budget_seconds_spent']:.0f} s waiting for idle CPUs or repeating contended measurements); "
        f"{window_note}; wrote {args.json}"
    )
    return 0


def derive(record: dict) -> dict:
    """Add one round's ratios to llama in the same round (from its raw numbers only)."""
    bench = record["bench"]
    # Each `toolkit bench` call probes the read bandwidth itself, and on this machine the probe moves by
    # +-25 % from call to call with the CPUs idle; the round's fractions use one bandwidth, the median of
    # its five probes, so a ratio of fractions is the ratio of bytes-weighted decode speeds.
    bandwidth = statistics.median(bench[f]["read_bandwidth_gbs"] for f in FAMILIES)
    record["round_bandwidth_gbs"] = bandwidth
    record["fraction_of_bound"] = {
        f: bench[f]["decode_tokens_per_s"] * bench[f]["bytes_per_token"] / (bandwidth * 1e9) for f in FAMILIES
    }
    record["fraction_over_llama"] = {
        f: record["fraction_of_bound"][f] / record["fraction_of_bound"][REFERENCE] for f in FAMILIES
    }
    # The same ratio with each call's own probe (what `toolkit bench` prints), probe noise included.
    record["per_call_fraction_over_llama"] = {
        f: bench[f]["bandwidth_fraction"] / bench[REFERENCE]["bandwidth_fraction"] for f in FAMILIES
    }
    record.pop("bytes_weighted_speed_over_llama", None)  # an earlier name of fraction_over_llama
    if record["export"]:
        ref_export = record["export"][REFERENCE]["seconds"]
        record["export_over_llama"] = {f: record["export"][f]["seconds"] / ref_export for f in FAMILIES}
    return record


def print_round(record: dict) -> None:
    bench, export = record["bench"], record["export"]
    print(
        f"round {record['round']} ({', '.join(record['order'])}; {record['round_bandwidth_gbs']:.1f} GB/s; "
        f"load {record['load_average_end']}): "
        + "; ".join(
            f"{f} {bench[f]['decode_tokens_per_s']:.2f} tok/s {100 * record['fraction_of_bound'][f]:.0f}% "
            f"x{record['fraction_over_llama'][f]:.2f} (others {100 * bench[f]['other_cpu_share']:.0f}%)"
            + (f" export {export[f]['seconds']:.1f} s" if export else "")
            for f in FAMILIES
        ),
        flush=True,
    )


def summarise(rounds: list[dict], layers: int, export_rounds: int) -> dict:
    """Per family: medians (min-max) over rounds of the raw numbers and of the per-round ratios to llama."""
    summary, exported = {}, rounds[:export_rounds]
    for family in FAMILIES:
        s = summary[family] = {
            "feature": FEATURES[family],
            "decode_tokens_per_s": spread([r["bench"][family]["decode_tokens_per_s"] for r in rounds]),
            "prefill_ms": spread([r["bench"][family]["prefill_ms"] for r in rounds]),
            "fraction_of_bound": spread([r["fraction_of_bound"][family] for r in rounds]),
            "fraction_over_llama": spread([r["fraction_over_llama"][family] for r in rounds]),
            "per_call_fraction_of_bound": spread([r["bench"][family]["bandwidth_fraction"] for r in rounds]),
            "per_call_fraction_over_llama": spread([r["per_call_fraction_over_llama"][family] for r in rounds]),
            "export_seconds_per_layer": spread([r["export"][family]["seconds"] / layers for r in exported]),
            "export_over_llama": spread([r["export_over_llama"][family] for r in exported]),
            "contended_bench_rounds": sum(r["bench"][family]["other_cpu_share"] > CONTENDED_SHARE for r in rounds),
            "contended_export_rounds": sum(r["export"][family]["other_cpu_share"] > CONTENDED_SHARE for r in exported),
            "repeated_contended_measurements": sum(
                len(r[kind][family].get("contended_attempts", ()))
                for r in rounds
                for kind in ("bench", "export")
                if family in r[kind]
            ),
            "weight_bytes": rounds[0]["bench"][family]["weight_bytes"],
            "bytes_per_token": rounds[0]["bench"][family]["bytes_per_token"],
        }
        s["decode_within_10_percent_of_llama"] = abs(s["fraction_over_llama"]["median"] - 1.0) <= 0.10
        s["export_per_layer_no_worse_than_llama"] = s["export_over_llama"]["median"] <= 1.0
    return summary


def resummarise(path: Path) -> None:
    """Recompute every derived number of a results file from its raw per-round numbers, in place."""
    global FAMILIES
    result = json.loads(path.read_text())
    settings = result["settings"]
    FAMILIES = tuple(result["rounds"][0]["order"])  # the first round runs them in the order given
    rounds = [derive(record) for record in result["rounds"]]
    for record in rounds:
        print_round(record)
    result["median_over_rounds"] = summarise(rounds, settings["layers"], settings["export_rounds"])
    result["settings"].update(RATIO_NOTES)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result["median_over_rounds"]))


RATIO_NOTES = {
    "fraction_of_bound": "decode tok/s x bytes per token (weights + mean KV) / the round's bandwidth, the median "
    "of the read bandwidths the round's five `toolkit bench` calls measured",
    "fraction_over_llama": "per round, a family's fraction_of_bound over llama's (the ratio of bytes-weighted "
    "decode speeds); per_call_fraction_over_llama uses each call's own bandwidth probe instead",
}


BENCH_KEYS = (
    "lowering",
    "decode_tokens_per_s",
    "decode_tokens_per_s_min",
    "decode_tokens_per_s_max",
    "prefill_ms",
    "bandwidth_fraction",
    "decode_bound_tokens_per_s",
    "bytes_per_token",
    "weight_bytes",
    "kv_bytes_per_row",
    "peak_rss_mb",
)


def table(summary: dict) -> str:
    lines = [
        "| family (what differs) | decode tok/s | of bound | / llama's (min-max) | export s/layer | / llama's (min-max) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for family, s in summary.items():
        ratio, export = s["fraction_over_llama"], s["export_over_llama"]
        lines.append(
            f"| {family} ({s['feature']}) | {s['decode_tokens_per_s']['median']:.2f} "
            f"| {100 * s['fraction_of_bound']['median']:.0f}% "
            f"| {ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f}) "
            f"| {s['export_seconds_per_layer']['median']:.2f} "
            f"| {export['median']:.2f} ({export['min']:.2f}-{export['max']:.2f}) |"
        )
    return "\n".join(lines)


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
