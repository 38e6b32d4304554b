"""`toolkit serve --replicas`: the app on a real local Ray cluster, through Ray Serve's HTTP proxy.

One `toolkit serve --replicas 2 --api-key KEY` process for the module (its Ray cluster starts once) beside a
single-process `toolkit serve` of the same tiny artifact (tests/toolkit/serve/test_server.py's), which is the
oracle: greedy answers through Ray must be the single process's, byte for byte. The tests that need Ray's
side of things (which replica actors exist, killing one, Serve's replica count) join the cluster as a second
driver for as long as they need it. The last test SIGTERMs the server and looks for any process of its
cluster left behind.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from tests.optional import RAY, import_or_skip
from tests.runners.decoding.test_batching import MAX_POSITIONS
from tests.toolkit.serve.test_server import PROMPTS, SERVER_MAX_TOKENS, Server, error_of, lm  # noqa: F401
from tests.toolkit.serve.test_server_hardening import AUTH, KEY, metrics
from toolkit.cli import main
from toolkit.serve.guard import Limits
from toolkit.serve.ray_serve import PUSH_SECONDS

REPLICAS = 2
START_SECONDS = 240  # a cold Ray cluster and two model loads on 2 busy cores
REQUEST_SECONDS = 60


def completion(url: str, prompt: str, max_tokens: int, headers=AUTH, **extra) -> httpx.Response:
    payload = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    return httpx.post(url + "/v1/completions", json=payload, headers=headers, timeout=REQUEST_SECONDS)


def answered(response: httpx.Response) -> tuple[str, str, int]:
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]


def message_of(response: httpx.Response) -> str:
    """An OpenAI error's message, or the start of any other body (Ray's proxy answers in plain text)."""
    try:
        return response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return response.text[:80]


def by_replica(samples: dict, name: str, **labels) -> dict[str, float]:
    """{replica: value} of one series in metrics() output."""
    found = {}
    for (sample, pairs), value in samples.items():
        given = dict(pairs)
        if sample == name and "replica" in given and all(given.get(k) == v for k, v in labels.items()):
            found[given["replica"]] = value
    return found


def settled_metrics(server, timeout: float = 30.0) -> dict:
    """metrics() once two reads a push apart agree: each replica's series reach /metrics at its next push
    (PUSH_SECONDS), so a read right after a request may not hold it yet."""
    deadline = time.monotonic() + timeout
    last = metrics(server)
    while True:
        time.sleep(PUSH_SECONDS * 1.5)
        now = metrics(server)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


def decoding_replicas(server, timeout: float = 30.0) -> dict[str, float]:
    """{replica: rows decoding} from the first /metrics read in which some replica is decoding.

    The clients' requests all ask for the same number of tokens, so a replica's batch finishes together and
    the replica idles while the next requests cross the proxy; one read can land in that gap on both."""
    deadline = time.monotonic() + timeout
    while True:
        active = by_replica(metrics(server), "toolkit_active_requests")
        if (active and max(active.values()) > 0) or time.monotonic() > deadline:
            return active
        time.sleep(0.05)


def descendants(pid: int) -> dict[int, str]:
    """{pid: command line} of every process below `pid` (Ray's GCS, raylet and workers for a local cluster)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                stat = (entry / "stat").read_text()
                children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry.name))
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            with contextlib.suppress(OSError):
                found[child] = (Path("/proc") / str(child) / "cmdline").read_bytes().decode(errors="replace")
                todo.append(child)
    return found


def alive(pid: int, cmdline: str) -> bool:
    """The same process still there (not a reused pid, not a zombie)."""
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace") == cmdline
    except OSError:
        return False


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def ray_server(lm, tmp_path_factory):  # noqa: F811
    import_or_skip("ray", "the [ray] extra runs `toolkit serve --replicas`", RAY)
    logs = tmp_path_factory.mktemp("ray-serve")
    started = time.monotonic()
    server = Server(
        lm.directory,
        logs / "ray.log",
        "--replicas",
        str(REPLICAS),
        "--api-key",
        KEY,
        "--max-tokens",
        str(SERVER_MAX_TOKENS),
    )
    try:
        deadline = time.monotonic() + START_SECONDS
        while "\nserving " not in "\n" + server.output():
            if server.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"toolkit serve --replicas did not start:\n{server.output()[-4000:]}")
            time.sleep(0.2)
        server.wait_ready(timeout=30)
        server.address = re.search(r"\(address ([^)\s]+)\)", server.output())[1]
        server.start_seconds = time.monotonic() - started
        yield server
    finally:
        if server.proc.poll() is None:  # the SIGTERM test did not run: the same orderly stop, given its time
            server.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(90)
        server.stop()


@pytest.fixture(scope="module")
def single(lm, tmp_path_factory):  # noqa: F811
    server = Server(
        lm.directory, tmp_path_factory.mktemp("single") / "single.log", "--max-tokens", str(SERVER_MAX_TOKENS)
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


# A second driver on the server's cluster, in a process of its own (Ray reads its auth mode once per process):
# it prints "ready", then for each replica tag read from stdin ray.kill()s that replica's actor, prints
# "killed", and waits until Serve runs the full count again without it, printing the state as JSON.
KILLER = r"""
import json, sys, time
import ray
from ray import serve

ray.init(address=sys.argv[1], logging_level="WARNING", log_to_driver=False)
replicas = int(sys.argv[2])


def live():
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == "serve"]
    return sorted(n.rsplit("#", 1)[1] for n in names if n.startswith("SERVE_REPLICA::toolkit#toolkit#"))


print("ready", json.dumps(live()), flush=True)
victim = sys.stdin.readline().strip()
ray.kill(ray.get_actor("SERVE_REPLICA::toolkit#toolkit#" + victim, namespace="serve"), no_restart=True)
killed = time.monotonic()
print("killed", flush=True)
while True:
    state = serve.status().applications["toolkit"].deployments["toolkit"]
    now = live()
    if state.replica_states.get("RUNNING") == replicas and len(now) == replicas and victim not in now:
        break
    if time.monotonic() - killed > 120:
        break
    time.sleep(0.5)
print(json.dumps({"seconds": time.monotonic() - killed, "running": state.replica_states, "replicas": now}), flush=True)
ray.shutdown()
"""


def killer(server) -> subprocess.Popen:
    env = dict(os.environ, RAY_AUTH_MODE="token")  # the local cluster's token is in ~/.ray/auth_token
    return subprocess.Popen(
        [sys.executable, "-c", KILLER, server.address, str(REPLICAS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line of `proc`'s output, or a failure after `timeout` seconds (never a hang)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        try:
            line = pool.submit(proc.stdout.readline).result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            proc.kill()
            pytest.fail(f"the Ray driver said nothing for {timeout} s")
    assert line, f"the Ray driver exited with {proc.wait()}"
    return line.strip()


# --------------------------------------------------------------------------- serving


def test_two_replicas_answer_concurrent_requests(ray_server):
    before = settled_metrics(ray_server)
    barrier = threading.Barrier(8, timeout=30)

    def ask(prompt):
        barrier.wait()
        return answered(completion(ray_server.url, prompt, 60))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, PROMPTS[:8], timeout=REQUEST_SECONDS * 2))
    assert all(tokens > 0 for _, _, tokens in results)
    after = settled_metrics(ray_server)
    served = by_replica(after, "toolkit_requests_total", endpoint="/v1/completions", status="200")
    earlier = by_replica(before, "toolkit_requests_total", endpoint="/v1/completions", status="200")
    counts = {replica: served[replica] - earlier.get(replica, 0.0) for replica in served}
    assert sum(counts.values()) == 8, counts
    assert len([n for n in counts.values() if n > 0]) == REPLICAS, f"one replica answered everything: {counts}"


def test_greedy_answers_equal_single_process_serve(ray_server, single):
    prompts = PROMPTS[:6]
    alone = [answered(completion(single.url, p, 50, headers={})) for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        through_ray = list(pool.map(lambda p: answered(completion(ray_server.url, p, 50)), prompts))
    assert through_ray == alone
    messages = [{"role": "user", "content": "what is the capital of france?"}]
    chat = {"messages": messages, "max_tokens": 30, "temperature": 0}
    one = httpx.post(single.url + "/v1/chat/completions", json=chat, timeout=REQUEST_SECONDS)
    two = httpx.post(ray_server.url + "/v1/chat/completions", json=chat, headers=AUTH, timeout=REQUEST_SECONDS)
    assert one.status_code == two.status_code == 200, two.text
    assert two.json()["choices"] == one.json()["choices"] and two.json()["usage"] == one.json()["usage"]


def test_streaming_works_through_the_proxy(ray_server, single):
    prompt = PROMPTS[4]
    whole = answered(completion(single.url, prompt, 40, headers={}))
    payload = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", ray_server.url + "/v1/completions", json=payload, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    assert len(chunks) > 2
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole[0]
    assert chunks[-1]["choices"][0]["finish_reason"] == whole[1]
    assert chunks[-1]["usage"]["completion_tokens"] == whole[2]


def test_the_guard_runs_in_every_replica_behind_the_proxy(ray_server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = completion(ray_server.url, "hello", 4, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert error_of(r)["code"] == "invalid_api_key"
        assert httpx.get(ray_server.url + "/metrics", headers=headers, timeout=10).status_code == 401
    assert httpx.get(ray_server.url + "/health", timeout=10).status_code == 200
    assert completion(ray_server.url, "hello", 4).status_code == 200
    too_big = completion(ray_server.url, "x" * (Limits().max_body_bytes + 1), 4)
    assert too_big.status_code == 413 and "--max-body-bytes" in error_of(too_big)["message"]
    assert httpx.get(ray_server.url + "/", headers={"Host": "evil.example"}, timeout=10).status_code == 400


def test_metrics_show_every_replica_labelled(ray_server):
    before = settled_metrics(ray_server)
    assert before[("toolkit_replicas", ())] == REPLICAS
    assert len(by_replica(before, "toolkit_queue_depth")) == REPLICAS
    r = completion(ray_server.url, "a cache keeps", 10)
    tokens = answered(r)[2]
    bad = completion(ray_server.url, "hello", SERVER_MAX_TOKENS + 1)
    assert bad.status_code == 400
    after = settled_metrics(ray_server)

    def grew(name, **labels):
        now, then = by_replica(after, name, **labels), by_replica(before, name, **labels)
        return sum(now.values()) - sum(then.values())

    assert grew("toolkit_requests_total", endpoint="/v1/completions", status="200") == 1
    assert grew("toolkit_requests_total", endpoint="/v1/completions", status="400") == 1
    assert grew("toolkit_tokens_generated_total") == tokens
    assert set(by_replica(after, "toolkit_tokens_generated_total")) == set(by_replica(after, "toolkit_queue_depth"))


# --------------------------------------------------------------------------- a replica dies


def test_killing_a_replica_mid_load_loses_no_request_and_serve_replaces_it(ray_server, single, lm):  # noqa: F811
    prompts = [p for p in PROMPTS if len(lm.tokenizer.encode(p)) + 100 <= MAX_POSITIONS][:6]
    expected = {p: answered(completion(single.url, p, 100, headers={})) for p in prompts}
    ray = killer(ray_server)
    failures: list[str] = []
    lock = threading.Lock()
    answers = threading.Semaphore(0)
    stop = threading.Event()

    def client(prompt):
        """Requests in a row until told to stop; a failed attempt is retried, as an OpenAI client does."""
        results, attempts = [], 0
        while not stop.is_set() or attempts:
            try:
                r = completion(ray_server.url, prompt, 100)
            except httpx.HTTPError as exc:  # a timeout or a dropped connection: a failure of its own
                r = type(exc).__name__
            if not isinstance(r, str) and r.status_code == 200:
                results.append(answered(r))
                answers.release()
                attempts = 0
                continue
            with lock:
                failures.append(r if isinstance(r, str) else str(r.status_code))
            attempts += 1
            if attempts == 5:
                pytest.fail(f"{prompt!r}: five attempts in a row failed: {failures}")
        return results

    try:
        assert len(json.loads(read_line(ray, 60).removeprefix("ready "))) == REPLICAS
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            try:  # the clients stop whatever happens here, or leaving the block would wait for them forever
                futures = {pool.submit(client, p): p for p in prompts}
                for _ in range(len(prompts) * 2):  # every client is under way
                    assert answers.acquire(timeout=REQUEST_SECONDS)
                active = decoding_replicas(ray_server)
                assert active, "no replica's series in /metrics"
                victim = max(active, key=active.get)
                assert active[victim] > 0, f"no replica was decoding when the kill came: {active}"
                ray.stdin.write(victim + "\n")
                ray.stdin.flush()
                assert read_line(ray, 30) == "killed"
                time.sleep(3)  # the load goes on while Serve notices and replaces the replica
            finally:
                stop.set()
            results = {futures[f]: f.result(timeout=REQUEST_SECONDS * 5) for f in futures}
        replaced = json.loads(read_line(ray, 150))
    finally:
        stop.set()
        if ray.poll() is None:
            ray.kill()
        ray.wait(30)
    for prompt, got in results.items():
        assert got and set(got) == {expected[prompt]}, prompt
    assert set(failures) <= {"500", "502", "503", "504"}, failures
    print(f"killed replica {victim} ({active[victim]:g} rows decoding); failed attempts, each retried: {failures}")
    print(f"replaced in {replaced['seconds']:.1f} s: {replaced}")
    assert replaced["running"] == {"RUNNING": REPLICAS} and victim not in replaced["replicas"], replaced
    assert answered(completion(ray_server.url, prompts[0], 100)) == expected[prompts[0]]


# --------------------------------------------------------------------------- shutdown


def test_sigterm_shuts_down_cleanly_leaving_no_ray_process(ray_server):
    tree = descendants(ray_server.proc.pid)
    assert any("raylet" in c for c in tree.values()) and any("ServeReplica" in c for c in tree.values()), tree
    payload = {"prompt": "hello", "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", ray_server.url + "/v1/completions", json=payload, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        signalled = time.monotonic()
        ray_server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert [first, *rest][-1] == "data: [DONE]", rest[-3:]
    health = []  # what the replicas answer while the server drains, until the proxy is gone
    while ray_server.proc.poll() is None and time.monotonic() - signalled < 60:
        try:
            r = httpx.get(ray_server.url + "/health", timeout=5)
            health.append((r.status_code, message_of(r)))
        except httpx.HTTPError as exc:
            health.append((type(exc).__name__, ""))
        time.sleep(0.05)
    try:
        code = ray_server.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.monotonic() - signalled
    left = {pid: c for pid, c in tree.items() if alive(pid, c)}
    deadline = time.monotonic() + 10  # a worker may still be exiting
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {pid: c for pid, c in left.items() if alive(pid, c)}
    print(f"start {ray_server.start_seconds:.1f} s, shutdown {seconds:.1f} s, {len(tree)} cluster processes")
    print("health while draining:", {f"{c} {m}": health.count((c, m)) for c, m in dict.fromkeys(health)})
    assert (503, "shutting down") in health, "no replica drained before Serve shut down"
    assert code == 0, ray_server.output()[-3000:]
    assert not left, left
    assert "Traceback" not in ray_server.output()


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "args, names",
    [
        (["--replicas", "0"], "--replicas 0"),
        (["--replicas", "3-1"], "--replicas 3-1"),
        (["--replicas", "x"], "--replicas 'x'"),
        (["--replicas", "2-"], "--replicas '2-'"),
        (["--ray-address", "auto"], "--ray-address"),
        (["--replica-cpus", "0.5"], "--replica-cpus"),
        (["--replicas", "2", "--max-connections", "10"], "--max-connections"),
        (["--replicas", "2", "--header-timeout", "3"], "--header-timeout"),
        (["--replicas", "2", "--keep-alive", "2.5"], "--keep-alive"),
        (["--replicas", "2", "--port", "0"], "--port 0"),
    ],
)
def test_bad_ray_options_exit_2_with_one_line(tmp_path, args, names):
    result = CliRunner().invoke(main, ["serve", str(tmp_path / "nothing"), *args])
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: ") and names in lines[0], result.stderr


def test_autoscaling_and_connection_options_are_valid_ray_config():
    import_or_skip("ray", "Ray's own config classes check the options", RAY)
    from ray.serve.config import AutoscalingConfig, HTTPOptions

    from toolkit.serve.ray_serve import Replicas, connection_options, deployment_options

    limits = Limits(keep_alive=7.0, request_timeout=100.0)
    scaled = deployment_options(Replicas.parse("1-4"), max_batch=8, max_queue=32, limits=limits, cpus=0.5)
    config = AutoscalingConfig(**scaled["autoscaling_config"])
    assert (config.min_replicas, config.max_replicas, config.target_ongoing_requests) == (1, 4, 8)
    assert "num_replicas" not in scaled and scaled["ray_actor_options"] == {"num_cpus": 0.5}
    assert scaled["max_ongoing_requests"] > 8 + 32  # the engine's own 429 comes before Ray queues
    fixed = deployment_options(Replicas.parse("3"), max_batch=4, max_queue=4, limits=limits, cpus=1.0)
    assert fixed["num_replicas"] == 3 and "autoscaling_config" not in fixed
    http = HTTPOptions(**connection_options("127.0.0.1", 8000, limits))
    assert http.keep_alive_timeout_s == 7 and http.request_timeout_s > limits.request_timeout
