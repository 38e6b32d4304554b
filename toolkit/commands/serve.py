"""`toolkit serve`: an OpenAI-compatible HTTP server over ONNX Runtime."""

from __future__ import annotations

import click


@click.command("serve")
@click.argument("artifact_dir", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--backend", default="ort-cpu", show_default=True, help="ort-cpu or ort-cuda (or eager).")
@click.option("--max-batch", type=click.IntRange(min=1), default=8, show_default=True, help="Rows per decode step.")
@click.option(
    "--max-queue",
    type=click.IntRange(min=1),
    default=32,
    show_default=True,
    help="Waiting requests beyond the batch; more get 429 with Retry-After.",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Largest max_tokens a request may ask for.",
)
def command(artifact_dir, host, port, backend, max_batch, max_queue, max_tokens):
    """Serve ARTIFACT_DIR (exported with --from) with /v1/completions and /v1/chat/completions."""
    import contextlib
    import signal

    import uvicorn

    from toolkit.serve.app import create_app

    class Server(uvicorn.Server):
        """uvicorn re-raises the captured signal after its graceful shutdown, so a SIGTERM'd server
        would die with -15; here the signal only starts the shutdown and the process exits 0."""

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    app = create_app(artifact_dir, backend=backend, max_batch=max_batch, max_queue=max_queue, max_tokens=max_tokens)
    click.echo(f"serving {artifact_dir} on http://{host}:{port} ({backend}, batch {max_batch}, queue {max_queue})")
    # uvicorn stops accepting on SIGTERM, waits for in-flight requests (up to the grace period) and exits 0.
    Server(uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)).run()
