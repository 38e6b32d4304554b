"""`toolkit serve --replicas`: the same app as a Ray Serve application, one engine per replica.

Each replica builds the app that single-process serve runs (`create_app` behind `guarded`): one ONNX Runtime
session, one continuous-batching engine, its KV cache inside it, and the API key, request limits and
metrics checked there as they are in one process. Ray's HTTP proxy accepts the connections and hands each
request to a replica (the one with fewer requests in flight); a streamed answer crosses the proxy an event
at a time.

What does not live in one replica:

- Metrics. Each replica pushes its Prometheus text every PUSH_SECONDS to a named detached actor (MetricsHub);
  /metrics in any replica pushes its own first, then answers every replica's series that reported within
  STALE_SECONDS, each labelled replica="<id>", plus `toolkit_replicas` (how many are shown). A replica that
  dies drops out of /metrics within STALE_SECONDS, as a scrape target would.
- Shutdown. SIGTERM to `toolkit serve` sets the hub's drain flag; each replica learns it at its next push
  and drains as one process does (new requests 503, running ones end with a final event at
  --shutdown-grace). Once every live replica has been told and none has work left (or the grace is over),
  Serve, the hub and a cluster started here are shut down.
- Connection limits. They belong to the proxy's uvicorn: --keep-alive and --request-timeout map to Ray's
  HTTPOptions; --header-timeout and --max-connections have no equivalent there, so a value other than the
  default is refused (`connection_options`).

`import ray` happens inside the functions: the toolkit runs without the [ray] extra.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from artifact.errors import ConfigError
from toolkit.serve.guard import Exposure, Limits, send_error

APP_NAME = "toolkit"  # the Serve application and its one deployment
NAMESPACE = "toolkit"  # the Ray namespace of the metrics hub
HUB_NAME = "toolkit-metrics"
PUSH_SECONDS = 1.0  # how often a replica sends its metrics (and learns of a drain)
STALE_SECONDS = 10.0  # a replica silent this long is gone from /metrics
HEALTH_CHECK_SECONDS = 2.0  # Serve's check of each replica: a dead one is replaced within a few of these
# Requests a replica takes beyond its engine's rows and queue: /health, /metrics and requests refused before
# the engine, so a full engine answers its own 429 with Retry-After rather than Ray queueing in front of it.
HEADROOM = 8
# Ray's proxy deadline comes this long after the app's own --request-timeout, so the app's 504 (an OpenAI
# error, counted in /metrics) is what a client sees; Ray's covers time spent queued in front of the replicas.
PROXY_TIMEOUT_MARGIN = 5.0
# A cluster started here: the object store carries only requests and metrics text.
LOCAL_OBJECT_STORE_BYTES = 256 << 20
INSTALL = "pip install 'onnx-decoder-toolkit[ray]'"
DEFAULTS = Limits()


# --------------------------------------------------------------------------- options, checked before Ray starts


@dataclass(frozen=True)
class Replicas:
    """--replicas: a fixed count (minimum == maximum) or an autoscaling range."""

    minimum: int
    maximum: int

    @property
    def autoscaling(self) -> bool:
        return self.minimum != self.maximum

    def __str__(self) -> str:
        return f"{self.minimum}-{self.maximum}" if self.autoscaling else str(self.minimum)

    @classmethod
    def parse(cls, text: str) -> Replicas:
        match = re.fullmatch(r"\s*(\d{1,4})\s*(?:-\s*(\d{1,4})\s*)?", text)
        if match is None:
            raise ConfigError(f"--replicas {text!r:.40}: expected a count N or a range MIN-MAX, e.g. 2 or 1-4")
        low, high = int(match[1]), int(match[2] or match[1])
        if low < 1:
            raise ConfigError(f"--replicas {text.strip()}: at least 1 replica (each one holds the model)")
        if high < low:
            raise ConfigError(f"--replicas {text.strip()}: the range's MIN {low} is above its MAX {high}")
        return cls(low, high)


def connection_options(host: str, port: int, limits: Limits) -> dict:
    """Ray Serve's HTTPOptions for the flags that uvicorn enforces in one process; ConfigError for a flag
    Ray's proxy has no equivalent of, unless it is at its default."""
    for flag, name, unit in (
        ("--header-timeout", "header_timeout", "s"),
        ("--max-connections", "max_connections", ""),
    ):
        value, default = getattr(limits, name), getattr(DEFAULTS, name)
        if value != default:
            raise ConfigError(
                f"{flag} {value:g}{unit}: Ray Serve's HTTP proxy has no such limit, so --replicas cannot enforce "
                f"it; leave it at {default:g}{unit} or serve without --replicas"
            )
    if limits.keep_alive != int(limits.keep_alive):
        raise ConfigError(f"--keep-alive {limits.keep_alive:g}: Ray Serve's proxy takes whole seconds")
    if port == 0:
        raise ConfigError("--port 0: Ray Serve's proxy needs a fixed port; choose one")
    return {
        "host": host,
        "port": port,
        "keep_alive_timeout_s": int(limits.keep_alive),
        "request_timeout_s": limits.request_timeout + PROXY_TIMEOUT_MARGIN,
    }


def deployment_options(replicas: Replicas, *, max_batch: int, max_queue: int, limits: Limits, cpus: float) -> dict:
    """serve.deployment's options: a fixed replica count, or autoscaling that aims at --max-batch requests
    in flight per replica (its rows; more means requests wait in its engine's queue)."""
    options = {
        "name": APP_NAME,
        "max_ongoing_requests": max_batch + max_queue + HEADROOM,
        # Past every replica's headroom Ray itself queues, bounded like the engine's own queue (Ray answers
        # 503 beyond it).
        "max_queued_requests": max_queue,
        # The replica drains at --shutdown-grace (a final event for what still runs); Ray waits a little longer
        # before it kills the actor.
        "graceful_shutdown_timeout_s": limits.shutdown_grace + PROXY_TIMEOUT_MARGIN,
        "health_check_period_s": HEALTH_CHECK_SECONDS,
        "ray_actor_options": {"num_cpus": cpus},
        # A replica that cannot load the model fails the same way every time: report it, do not retry 20 times.
        "max_constructor_retry_count": 1,
    }
    if replicas.autoscaling:
        options["autoscaling_config"] = {
            "min_replicas": replicas.minimum,
            "initial_replicas": replicas.minimum,
            "max_replicas": replicas.maximum,
            "target_ongoing_requests": max_batch,
        }
    else:
        options["num_replicas"] = replicas.minimum
    return options


# --------------------------------------------------------------------------- metrics across replicas


class MetricsHub:
    """The named detached actor that holds each replica's latest Prometheus text, and the drain flag."""

    def __init__(self):
        self.latest: dict[str, tuple[float, str]] = {}
        self.draining = False
        self.told: set[str] = set()

    def reset(self) -> None:
        """A new deployment: forget the series and the drain flag of one before it (the actor is detached)."""
        self.latest, self.draining, self.told = {}, False, set()

    def push(self, replica: str, text: str) -> bool:
        """Store `replica`'s metrics; True when the server is shutting down (the replica then drains)."""
        self.latest[replica] = (time.monotonic(), text)
        if self.draining:
            self.told.add(replica)
        return self.draining

    def untold(self) -> list[str]:
        """The live replicas that have not yet been told to drain."""
        return sorted(set(self.texts()) - self.told)

    def texts(self) -> dict[str, str]:
        """The metrics of every replica that reported within STALE_SECONDS."""
        now = time.monotonic()
        self.latest = {r: (t, text) for r, (t, text) in self.latest.items() if now - t <= STALE_SECONDS}
        return {r: text for r, (_, text) in sorted(self.latest.items())}

    def drain(self) -> None:
        self.draining = True


def labelled_exposition(texts: dict[str, str]) -> str:
    """Every replica's series in one Prometheus text, each sample labelled replica="<id>"."""
    from prometheus_client import CollectorRegistry, Gauge, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(
                family.name, Metric(family.name, family.documentation, family.type, family.unit)
            )
            for sample in family.samples:
                merged.add_sample(sample.name, {**sample.labels, "replica": replica}, sample.value, sample.timestamp)

    class Snapshot:
        def collect(self):
            return list(families.values())

    registry = CollectorRegistry()
    registry.register(Snapshot())
    Gauge("toolkit_replicas", "replicas whose series this answer holds", registry=registry).set(len(texts))
    return generate_latest(registry).decode()


class ClusterMetrics:
    """The app with GET /metrics answered from every replica (the guard in front still checks the key)."""

    def __init__(self, app, exposition):
        self.app, self.exposition = app, exposition

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") != "/metrics" or scope.get("method") not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        from fastapi.responses import PlainTextResponse

        try:
            text = await asyncio.wait_for(self.exposition(), 10.0)
        except Exception as exc:  # the hub is gone or unreachable: say so, not half the series
            message = f"metrics: the replicas' metrics actor did not answer ({type(exc).__name__}); retry later"
            return await send_error(send, 503, message, headers={"Retry-After": "1"})
        response = PlainTextResponse(text, media_type="text/plain; version=0.0.4")
        await response(scope, receive, send)


# --------------------------------------------------------------------------- the replica


@dataclass(frozen=True)
class AppSpec:
    """What a replica needs to build the app; pickled to every replica."""

    artifact_dir: str
    backend: str
    max_batch: int
    max_queue: int
    max_tokens: int
    limits: Limits
    exposure: Exposure


class Replica:
    """One Serve replica: the single-process app (engine, guard, metrics) and the metrics push."""

    def __init__(self, spec: AppSpec):
        self.spec = spec
        self.server = self.hub = self.pusher = None
        self.replica = ""

    async def __serve_build_asgi_app__(self):
        import ray
        from ray import serve

        from toolkit.serve.app import create_app, guarded

        spec = self.spec
        # Loading the model takes seconds: off the replica's event loop, which Serve's health checks use.
        app = await asyncio.to_thread(
            create_app,
            spec.artifact_dir,
            backend=spec.backend,
            max_batch=spec.max_batch,
            max_queue=spec.max_queue,
            max_tokens=spec.max_tokens,
            limits=spec.limits,
            exposure=spec.exposure,
        )
        self.server = app.state.server
        self.replica = serve.get_replica_context().replica_tag
        self.hub = ray.get_actor(HUB_NAME, namespace=NAMESPACE)
        self.pusher = asyncio.get_running_loop().create_task(self.push_forever())
        return dataclasses.replace(guarded(app), app=ClusterMetrics(app, self.exposition))

    async def push(self) -> None:
        server = self.server
        text = server.metrics.exposition(server.engine.queue_depth, server.engine.active)
        if await self.hub.push.remote(self.replica, text) and not server.draining:
            server.drain()

    async def push_forever(self) -> None:
        log = logging.getLogger("ray.serve")
        failing = False
        while True:
            try:
                await self.push()
                failing = False
            except Exception as exc:  # the hub restarting or gone at shutdown: the replica keeps serving
                if not failing:
                    log.warning("toolkit replica %s: metrics push failed (%s)", self.replica, exc)
                failing = True
            await asyncio.sleep(PUSH_SECONDS)

    async def exposition(self) -> str:
        await self.push()
        return labelled_exposition(await self.hub.texts.remote())


# --------------------------------------------------------------------------- the driver


@dataclass
class RayServe:
    """Starts (or joins) a Ray cluster, deploys the app on it, and takes it all down again."""

    spec: AppSpec
    replicas: Replicas
    host: str
    port: int
    ray_address: str | None = None
    replica_cpus: float = 1.0
    started_cluster: bool = False
    address: str = ""
    stopping: threading.Event = dataclasses.field(default_factory=threading.Event)
    handlers: dict = dataclasses.field(default_factory=dict)

    def start(self) -> None:
        try:
            import ray
            from ray import serve
        except ImportError as exc:
            raise ConfigError(f"--replicas needs Ray Serve ({exc}); install it: {INSTALL}") from None
        http = connection_options(self.host, self.port, self.spec.limits)
        self.check_artifact()
        if not self.ray_address:
            self.check_fits(os.cpu_count() or 1)
        # Ray reports usage to its developers unless told not to; a server started here keeps to itself.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if self.ray_address:
            try:
                ray.init(address=self.ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ConfigError(f"--ray-address {self.ray_address}: cannot join the cluster ({exc})") from None
        else:
            with own_process_group():
                ray.init(
                    address="local",
                    namespace=NAMESPACE,
                    num_cpus=os.cpu_count(),
                    object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                    include_dashboard=False,
                    logging_level=logging.WARNING,
                )
            self.started_cluster = True
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
        # ray.init put Ray's handler on SIGTERM (a stack dump, then death); from here on a signal means an
        # orderly stop, also while the replicas are still starting.
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.handlers[sig] = signal.signal(sig, lambda *_: self.stopping.set())
        self.address = ray.get_runtime_context().gcs_address
        try:
            self.check_fits(ray.cluster_resources().get("CPU", 0.0))
        except ConfigError:
            self.stop_ray()
            raise
        if not self.started_cluster and (serve.status().proxies or serve.status().applications):
            self.stop_ray()
            raise ConfigError(
                f"--ray-address {self.ray_address}: Ray Serve already runs on that cluster, with its own HTTP host, "
                "port and timeouts that a second serve.start cannot change; shut it down (`serve shutdown`) or "
                "give the toolkit a cluster of its own"
            )
        try:
            hub = ray.remote(num_cpus=0)(MetricsHub).options(
                name=HUB_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True
            )
            self.hub = hub.remote()
            ray.get(self.hub.reset.remote(), timeout=60)
            serve.start(http_options=http, logging_config={"log_level": "WARNING", "enable_access_log": False})
            options = deployment_options(
                self.replicas,
                max_batch=self.spec.max_batch,
                max_queue=self.spec.max_queue,
                limits=self.spec.limits,
                cpus=self.replica_cpus,
            )
            deployment = serve.deployment(**options)(serve.ingress()(Replica))
            serve.run(
                deployment.bind(self.spec),
                name=APP_NAME,
                route_prefix="/",
                logging_config={"log_level": "WARNING", "enable_access_log": False},
            )
        except BaseException as exc:
            self.stop()
            if isinstance(exc, RuntimeError):  # Serve's report of a replica that failed to start
                first = next((line for line in str(exc).splitlines() if line.strip()), "no message")
                raise ConfigError(f"{self.spec.artifact_dir}: the replicas did not start ({first[:300]})") from None
            raise

    def check_fits(self, cpus: float) -> None:
        """Serve would wait forever for replicas the cluster has no CPUs for; the first ones must fit."""
        if cpus < self.replicas.minimum * self.replica_cpus:
            raise ConfigError(
                f"--replicas {self.replicas}: {self.replicas.minimum} x {self.replica_cpus:g} CPUs do not fit the "
                f"cluster's {cpus:g}; lower --replicas or --replica-cpus"
            )

    def check_artifact(self) -> None:
        """The checks create_app makes before loading weights, here, so a bad directory is one line at once
        rather than a replica failing to start on the cluster."""
        from artifact.errors import BackendUnavailableError, ModelFileError
        from models.artifacts import open_artifact
        from models.tokenizer import load_tokenizer
        from runners.registry import artifact_dtype, check_backend, unsupported_backends

        directory, backend = self.spec.artifact_dir, self.spec.backend
        artifact = open_artifact(directory)
        load_tokenizer(artifact, directory)
        if not self.ray_address:  # on a joined cluster the replicas' nodes have the backends, not this one
            check_backend(backend, artifact_dtype(artifact))
        why = unsupported_backends(artifact.manifest).get(backend)
        if why:
            raise BackendUnavailableError(f"backend {backend!r} cannot run {directory}: {why}")
        inputs = {spec.name for graph in artifact.manifest.graphs for spec in graph.inputs}
        if "past_mask" not in inputs:
            raise ModelFileError(f"{directory}: not a batched KV-cache artifact; export it with --variant serving")

    def drain(self, grace: float) -> None:
        """Tell every replica to drain, and wait until they report nothing running or `grace` passes."""
        import ray

        deadline = time.monotonic() + grace
        try:
            ray.get(self.hub.drain.remote(), timeout=10)
            told = time.monotonic() + STALE_SECONDS  # a replica silent this long is gone anyway
            while time.monotonic() < told and ray.get(self.hub.untold.remote(), timeout=10):
                time.sleep(0.1)
            while time.monotonic() < deadline and not self.idle():
                time.sleep(0.2)
        except Exception:  # the cluster is already going (its processes got the signal too): nothing to drain
            return

    def idle(self) -> bool:
        import ray
        from prometheus_client.parser import text_string_to_metric_families

        busy = 0.0
        for text in ray.get(self.hub.texts.remote(), timeout=10).values():
            for family in text_string_to_metric_families(text):
                if family.name in ("toolkit_queue_depth", "toolkit_active_requests"):
                    busy += sum(s.value for s in family.samples)
        return busy == 0

    def stop(self) -> None:
        """Serve, the hub, and the cluster when it was started here (joined clusters are left running)."""
        import ray
        from ray import serve

        if not ray.is_initialized():
            return
        try:
            serve.shutdown()
        finally:
            try:
                ray.kill(ray.get_actor(HUB_NAME, namespace=NAMESPACE))
            except ValueError:  # never created
                pass
            self.stop_ray()

    def stop_ray(self) -> None:
        import ray

        ray.shutdown()
        for sig, handler in self.handlers.items():
            signal.signal(sig, handler)
        self.handlers.clear()


@contextlib.contextmanager
def own_process_group():
    """Start the processes of a local cluster in a process group of their own, then rejoin ours.

    A signal sent to our whole group (`timeout`, `kill -- -PGID`) would otherwise reach Ray's GCS and raylet
    at the same moment as this driver, and the orderly shutdown below would find the cluster gone (its
    replicas then linger until Ray's own timeouts). Ray blocks SIGINT in its processes, so Ctrl-C needs no
    help. A driver that leads its group (a shell job) keeps it: it cannot leave without orphaning the group."""
    original = os.getpgrp()
    if original == os.getpid():
        yield
        return
    try:
        os.setpgid(0, 0)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.setpgid(0, original)


def run(cluster: RayServe, say) -> None:
    """Deploy, then serve until SIGTERM or SIGINT: drain for --shutdown-grace, shut down, return."""
    cluster.start()
    try:
        where = "a local cluster started here" if cluster.started_cluster else f"the cluster at {cluster.address}"
        say(f"ray: {cluster.replicas} replicas on {where} (address {cluster.address})")
        cluster.stopping.wait()
        cluster.drain(cluster.spec.limits.shutdown_grace)
    finally:
        cluster.stop()


def artifact_path(directory: str) -> str:
    """The directory as every node opens it: absolute, since a replica's working directory is not ours."""
    return str(Path(directory).resolve())
