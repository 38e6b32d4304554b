"""`toolkit serve`: an OpenAI-compatible HTTP server over ONNX Runtime."""

from __future__ import annotations

import os

import click

from artifact.errors import ConfigError

API_KEY_VARIABLE = "TOOLKIT_API_KEY"
SECONDS = click.FloatRange(min=0.001)


def limit(name: str, kind, default, text: str):
    return click.option(name, type=kind, default=default, show_default=True, help=text)


def read_api_key(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key from --api-key, --api-key-file or $TOOLKIT_API_KEY (one of them); None when none is set."""
    given = [name for name, value in (("--api-key", api_key), ("--api-key-file", api_key_file)) if value]
    if len(given) > 1:
        raise ConfigError("--api-key and --api-key-file both given; use one")
    if api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as handle:
                api_key = handle.read(4097).strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--api-key-file {api_key_file}: cannot read it ({exc})") from None
        if not api_key:
            raise ConfigError(f"--api-key-file {api_key_file}: the file is empty; put the key in it")
    elif api_key is None:
        api_key = os.environ.get(API_KEY_VARIABLE) or None
    if api_key is not None and (len(api_key) > 4096 or not api_key.isprintable() or " " in api_key):
        raise ConfigError("API key: expected one line of printable characters without spaces, at most 4096")
    return api_key


@click.command("serve")
@click.argument("artifact_dir", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--backend", default="ort-cpu", show_default=True, help="ort-cpu or ort-cuda (or eager).")
@limit("--max-batch", click.IntRange(min=1), 8, "Rows per decode step.")
@limit("--max-queue", click.IntRange(min=1), 32, "Waiting requests beyond the batch; more get 429 with Retry-After.")
@limit("--max-tokens", click.IntRange(min=1), 256, "Largest max_tokens a request may ask for.")
@click.option(
    "--api-key", default=None, help=f"Require 'Authorization: Bearer KEY' on /v1/* (also ${API_KEY_VARIABLE})."
)
@click.option("--api-key-file", type=click.Path(), default=None, help="Read the API key from this file.")
@click.option("--public-metrics", is_flag=True, help="Serve /metrics without the API key.")
@click.option(
    "--allowed-hosts",
    default=None,
    help="Comma-separated Host names to answer besides the bound address (default: the loopback names).",
)
@click.option("--allowed-origins", default=None, help="Comma-separated origins for CORS (default: CORS off).")
@click.option("--docs", is_flag=True, help="Serve /docs and /openapi.json.")
@limit("--max-body-bytes", click.IntRange(min=1024), 1 << 21, "Largest request body; more get 413.")
@limit("--max-prompt-chars", click.IntRange(min=1), None, "Longest prompt in characters [default: 64 per position].")
@limit("--max-stops", click.IntRange(min=0), 16, "Most stop strings in a request.")
@limit("--max-stop-chars", click.IntRange(min=1), 256, "Longest stop string.")
@limit("--max-choices", click.IntRange(min=1), 16, "Most choices (prompts x n) in a request.")
@limit("--header-timeout", SECONDS, 10.0, "Seconds a connection has to send a request's headers.")
@limit("--body-timeout", SECONDS, 30.0, "Seconds a request has to send its body.")
@limit("--keep-alive", SECONDS, 5.0, "Seconds an idle keep-alive connection stays open.")
@limit("--max-connections", click.IntRange(min=1), 256, "Open connections; more get 503.")
@limit("--request-timeout", SECONDS, 600.0, "Seconds an answer may take; longer ones end with 504.")
@limit("--shutdown-grace", click.FloatRange(min=0), 30.0, "Seconds running requests get on SIGTERM.")
@click.option(
    "--replicas",
    default=None,
    help="Serve with Ray Serve: N replicas, or MIN-MAX to autoscale, each with its own engine (one ONNX Runtime "
    "session and KV cache) behind Ray's HTTP proxy. Autoscaling aims at --max-batch requests in flight per "
    "replica (Ray's target_ongoing_requests): more than that waiting means another replica, at Ray's pace "
    "(up after 30 s, down after 600 s). Ray's proxy has no --header-timeout or --max-connections: they keep "
    "their defaults, unenforced. Needs the [ray] extra. [default: one process, no Ray]",
)
@click.option(
    "--ray-address",
    default=None,
    help="With --replicas: join this Ray cluster (auto, or HOST:PORT) instead of starting a local one; the "
    "artifact must be at the same path on every node.",
)
@limit("--replica-cpus", click.FloatRange(min=0.01), 1.0, "With --replicas: Ray CPUs each replica reserves.")
def command(artifact_dir, host, port, backend, max_batch, max_queue, max_tokens, **options):
    """Serve ARTIFACT_DIR (exported with --from) with /v1/completions and /v1/chat/completions."""
    from toolkit.serve.app import create_app, guarded
    from toolkit.serve.guard import Exposure, Limits
    from toolkit.serve.http import serve

    replicas, ray_address, replica_cpus = (
        options.pop("replicas"),
        options.pop("ray_address"),
        options.pop("replica_cpus"),
    )
    if replicas is None and (ray_address is not None or replica_cpus != 1.0):
        given = "--ray-address" if ray_address is not None else "--replica-cpus"
        raise ConfigError(f"{given} applies to Ray Serve only; add --replicas N (or MIN-MAX)")
    if replicas is not None:
        from toolkit.serve.ray_serve import Replicas

        replicas = Replicas.parse(replicas)  # before anything loads
    names = [n.strip().lower() for n in (options.pop("allowed_hosts") or "").split(",") if n.strip()]
    origins = tuple(o.strip() for o in (options.pop("allowed_origins") or "").split(",") if o.strip())
    exposure = Exposure(
        api_key=read_api_key(options.pop("api_key"), options.pop("api_key_file")),
        public_metrics=options.pop("public_metrics"),
        allowed_hosts=Exposure.hosts_for(host, tuple(names)),
        allowed_origins=origins,
        docs=options.pop("docs"),
    )
    limits = Limits(**options)
    if replicas is not None:
        from toolkit.serve.ray_serve import AppSpec, artifact_path

        spec = AppSpec(artifact_path(artifact_dir), backend, max_batch, max_queue, max_tokens, limits, exposure)
        return serve_on_ray(spec, replicas, host, port, ray_address, replica_cpus)
    app = create_app(
        artifact_dir,
        backend=backend,
        max_batch=max_batch,
        max_queue=max_queue,
        max_tokens=max_tokens,
        limits=limits,
        exposure=exposure,
    )
    warn_if_open(host, exposure)
    click.echo(f"serving {artifact_dir} on http://{host}:{port} ({backend}, batch {max_batch}, queue {max_queue})")
    # SIGTERM stops accepting, lets running requests finish for --shutdown-grace seconds, ends the rest with
    # a final event, and exits 0.
    serve(guarded(app), host=host, port=port, limits=limits, on_shutdown=app.state.server.drain)


def warn_if_open(host: str, exposure) -> None:
    from toolkit.serve.guard import is_loopback

    if not is_loopback(host) and exposure.api_key is None:
        click.secho(
            f"WARNING: serving on {host}, beyond this machine, without an API key: anyone who can reach the port "
            f"can use the model. Set --api-key, --api-key-file or ${API_KEY_VARIABLE}.",
            err=True,
            fg="red",
            bold=True,
        )


def serve_on_ray(spec, replicas, host: str, port: int, address: str | None, cpus: float) -> None:
    """--replicas: the same app on Ray Serve (toolkit/serve/ray_serve.py)."""
    from toolkit.serve import ray_serve

    ray_serve.connection_options(host, port, spec.limits)  # a flag Ray cannot enforce fails before Ray starts
    cluster = ray_serve.RayServe(spec, replicas, host, port, ray_address=address, replica_cpus=cpus)
    warn_if_open(host, spec.exposure)
    click.echo(
        "note: under Ray Serve, Ray's HTTP proxy holds the connections: --header-timeout and --max-connections "
        "are not enforced (it has no such limits); the other limits are, in every replica",
        err=True,
    )

    def ready(line: str) -> None:
        click.echo(line)
        click.echo(
            f"serving {spec.artifact_dir} on http://{host}:{port} ({spec.backend}, batch {spec.max_batch}, "
            f"queue {spec.max_queue}, replicas {replicas})"
        )

    ray_serve.run(cluster, ready)
