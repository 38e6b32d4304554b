"""Bounded load test for `toolkit serve` (loopback only).

Runs the same fixed workload with 1 client and with N concurrent clients in one
invocation, so the aggregate-throughput ratio is measured side by side:

    python benchmarks/load_test.py --url http://127.0.0.1:8000 --clients 1,8 --requests 16 --max-tokens 32

Then, with --burst N, fires N requests at once to show what happens past the
queue limit (429 with Retry-After, never an unbounded queue).
Every run is bounded by --requests and --time-limit.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "Write one sentence about the sea.",
    "Name three colours.",
    "What is two plus two?",
    "Describe a cat in a few words.",
    "Give me a short greeting.",
    "What is the capital of France?",
    "List two fruits.",
    "Say something about mountains.",
]


def _loopback(url: str) -> str:
    host = urlparse(url).hostname or ""
    if not (host == "localhost" or host.startswith("127.") or host == "::1"):
        raise SystemExit(f"refusing {url}: this load test only targets loopback addresses")
    return url.rstrip("/")


def _one(client: httpx.Client, url: str, i: int, max_tokens: int, deadline: float) -> dict:
    if time.monotonic() > deadline:
        return {"status": "skipped"}
    body = {
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    start = time.perf_counter()
    try:
        response = client.post(f"{url}/v1/chat/completions", json=body, timeout=max(1.0, deadline - time.monotonic()))
    except httpx.HTTPError as exc:
        return {"status": type(exc).__name__, "latency": time.perf_counter() - start}
    latency = time.perf_counter() - start
    tokens = response.json().get("usage", {}).get("completion_tokens", 0) if response.status_code == 200 else 0
    return {
        "status": response.status_code,
        "latency": latency,
        "tokens": tokens,
        "retry_after": response.headers.get("retry-after"),
    }


def run(url: str, clients: int, requests: int, max_tokens: int, time_limit: float) -> dict:
    deadline = time.monotonic() + time_limit
    start = time.perf_counter()
    with httpx.Client() as client, ThreadPoolExecutor(max_workers=clients) as pool:
        results = list(pool.map(lambda i: _one(client, url, i, max_tokens, deadline), range(requests)))
    wall = time.perf_counter() - start
    ok = [r for r in results if r["status"] == 200]
    latencies = sorted(r["latency"] for r in ok)

    def pct(p):
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] if latencies else None

    errors: dict[str, int] = {}
    for r in results:
        if r["status"] != 200:
            errors[str(r["status"])] = errors.get(str(r["status"]), 0) + 1
    tokens = sum(r["tokens"] for r in ok)
    return {
        "clients": clients,
        "requests": requests,
        "succeeded": len(ok),
        "errors": errors,
        "wall_s": wall,
        "requests_per_s": len(ok) / wall,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": pct(50),
        "latency_p95_s": pct(95),
        "latency_p99_s": pct(99),
    }


def burst(url: str, count: int, max_tokens: int, time_limit: float) -> dict:
    barrier = threading.Barrier(count)
    deadline = time.monotonic() + time_limit

    def fire(i):
        barrier.wait(timeout=time_limit)
        with httpx.Client() as client:
            return _one(client, url, i, max_tokens, deadline)

    with ThreadPoolExecutor(max_workers=count) as pool:
        results = list(pool.map(fire, range(count)))
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    retry = sorted({r["retry_after"] for r in results if r.get("retry_after")})
    return {"burst": count, "statuses": statuses, "retry_after": retry}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--clients", default="1,8", help="comma-separated client counts, run one after another")
    parser.add_argument("--requests", type=int, default=16, help="requests per client count")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--time-limit", type=float, default=300.0, help="seconds per run")
    parser.add_argument("--burst", type=int, default=0, help="also fire this many requests at once")
    parser.add_argument("--json", dest="json_file")
    args = parser.parse_args(argv)
    url = _loopback(args.url)
    runs = [run(url, int(c), args.requests, args.max_tokens, args.time_limit) for c in args.clients.split(",")]
    report = {"url": url, "max_tokens": args.max_tokens, "runs": runs}
    for r in runs:
        print(
            f"{r['clients']:>3} clients: {r['succeeded']}/{r['requests']} ok, errors {r['errors'] or 'none'}, "
            f"{r['requests_per_s']:.2f} req/s, {r['tokens_per_s']:.1f} tokens/s, latency p50 "
            f"{r['latency_p50_s'] or float('nan'):.2f} s p95 {r['latency_p95_s'] or float('nan'):.2f} s "
            f"p99 {r['latency_p99_s'] or float('nan'):.2f} s"
        )
    if len(runs) > 1 and runs[0]["tokens_per_s"] > 0:
        report["throughput_ratio"] = runs[-1]["tokens_per_s"] / runs[0]["tokens_per_s"]
        print(
            f"aggregate tokens/s ratio {runs[-1]['clients']} vs {runs[0]['clients']} clients: "
            f"{report['throughput_ratio']:.2f}x"
        )
    if args.burst:
        report["burst"] = burst(url, args.burst, args.max_tokens, args.time_limit)
        print(
            f"burst of {args.burst}: statuses {report['burst']['statuses']}, Retry-After {report['burst']['retry_after']}"
        )
    if args.json_file:
        with open(args.json_file, "w") as handle:
            json.dump(report, handle, indent=2)
    failed = sum(sum(r["errors"].values()) for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
