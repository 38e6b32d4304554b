"""`toolkit export`: build or import a model and write an artifact directory."""

from __future__ import annotations

import contextvars
import threading
from pathlib import Path

import click

from artifact.errors import ConfigError
from exporters.lowerings import DEFAULT_LOWERING, LOWERINGS
from exporters.onnx_export import VARIANTS, export_model
from models.presets import get_preset, load_config_file
from toolkit.check.oracle import import_transformers, recorded_source, verified_export, why_not_verify
from toolkit.progress import command_progress


def resolve_model(preset: str | None, config: str | None):
    """(preset object, registered preset name or None) from --preset / --config."""
    if preset and config:
        raise ConfigError("give either --preset or --config, not both")
    if config:
        return load_config_file(config), None
    spec = get_preset(preset or "worked-example")
    return spec, spec.name


def checkpoint_dtype(stored: str | None, requested: str | None) -> tuple[str, str | None]:
    """The export dtype of a checkpoint stored in `stored` when --dtype gave `requested` (None: not given), and
    a note saying why when the default is not float32 or differs from the checkpoint's."""
    if requested is not None:
        return requested, None
    if stored == "float16":
        return "float16", "the checkpoint's dtype (--dtype float32 for float32)"
    if stored == "bfloat16":
        return "float32", (
            "the checkpoint is bfloat16, which ONNX Runtime's CPU provider does not run; --dtype bfloat16 keeps "
            "it for eager and onnx-reference"
        )
    return "float32", None


EXPORT_OVERHEAD_BYTES = 1 << 30  # interpreter, torch, the one-block trace and a tensor in flight (measured < 1 GiB)
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}


def export_memory(parameters: int, stored: str, written: str, lowering: str) -> int:
    """Bytes `toolkit export --from` needs at its peak for a checkpoint of `parameters` stored as `stored` and
    written as `written`. The default lowering holds one copy of the weights, the larger of the stored and the
    written one; the others rebuild the weights beside the model's float32 copy."""
    stored_bytes = min(DTYPE_BYTES[stored], 4)  # the import keeps float16/bfloat16 and reads the rest as float32
    width = DTYPE_BYTES[written]
    per_parameter = max(stored_bytes, width) if lowering == DEFAULT_LOWERING else 4 + 2 * width
    return parameters * per_parameter + EXPORT_OVERHEAD_BYTES


def check_memory(weights: tuple[int, str], dtype: str | None, lowering: str) -> None:
    """Refuse, before reading a weight, an export that cannot fit in this machine's available memory."""
    from toolkit.memory import available_memory

    parameters, stored = weights
    available = available_memory()
    if not parameters or available is None:
        return
    written = checkpoint_dtype(stored, dtype)[0]
    needed = export_memory(parameters, stored, written, lowering)
    if needed <= available:
        return
    smaller = ""
    half = export_memory(parameters, stored, "bfloat16", lowering)
    if written == "float32" and half < needed:
        smaller = f"; as bfloat16 (--dtype bfloat16) it would need about {half / 2**30:.1f} GiB"
    raise ConfigError(
        f"exporting {parameters / 1e9:.2f}B parameters as {written} needs about {needed / 2**30:.1f} GiB of memory "
        f"and {available / 2**30:.1f} GiB is available{smaller}; free memory or export on a larger machine"
    )


@click.command("export")
@click.option("--preset", help="Named preset (see `toolkit presets`); default: worked-example.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="JSON file: {family, seed, config}.")
@click.option(
    "--from",
    "checkpoint",
    type=click.Path(),
    help="Import a checkpoint: a Hugging Face directory (llama, gpt2) or a GGUF file (llama).",
)
@click.option(
    "--variant",
    type=click.Choice(VARIANTS),
    help="stages: every stage as an output (default for presets); serving: logits only, or for "
    "language models the KV-cache graph (default with --from).",
)
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Artifact directory to write.")
@click.option(
    "--triton-repo",
    type=click.Path(file_okay=False),
    help="Also write a Triton model repository (onnxruntime backend) here.",
)
@click.option(
    "--triton-device",
    type=click.Choice(["cpu", "gpu"]),
    default="cpu",
    show_default=True,
    help="Instance group kind in the Triton config.",
)
@click.option("--triton-instances", type=click.IntRange(min=1), default=1, show_default=True)
@click.option(
    "--triton-cache",
    type=click.Choice(["server", "client"]),
    default=None,
    help="Where a language model's KV cache lives between requests. server (the default with a KV cache): "
    "Triton keeps each sequence's cache as implicit state and clients send only new tokens "
    "(examples/triton_client.py); client: a stateless model whose clients send the whole cache every step, "
    "so any replica serves any step.",
)
@click.option(
    "--triton-sequences",
    type=click.IntRange(min=1),
    default=None,
    help="With --triton-cache server: the sequences each instance keeps a cache for at once (more wait in "
    "Triton's backlog). Default: the max batch size, 8.",
)
@click.option(
    "--lowering",
    type=click.Choice(LOWERINGS),
    default=DEFAULT_LOWERING,
    show_default=True,
    help="functions: portable custom ops with function bodies; standard: ONNX opset 23 RMSNormalization/"
    "RotaryEmbedding/Attention; ort: ONNX Runtime's fused com.microsoft kernels.",
)
@click.option(
    "--dtype",
    type=click.Choice(["float32", "float16", "bfloat16"]),
    default=None,
    help="Weights and activations in this dtype; norm statistics and softmax accumulate in float32. Default: "
    "float32, or with --from a float16 checkpoint's float16 (a bfloat16 checkpoint exports as float32, said "
    "why, since ONNX Runtime's CPU provider does not run bfloat16).",
)
@click.option(
    "--external-data/--no-external-data",
    default=None,
    help="Keep each graph's weights in a .data file beside it (page-aligned, mapped by ONNX Runtime), or inside "
    "the graph. Default: beside it when a graph's weights exceed $TOOLKIT_EXTERNAL_DATA_BYTES (1 GiB); a graph "
    "file cannot exceed 2 GiB.",
)
@click.option("--quiet", is_flag=True, help="No progress lines on stderr (shown on a terminal by default).")
@click.option(
    "--verify/--no-verify",
    default=None,
    help="--from a Hugging Face directory: hold the export's logits on a few tokens to the original loaded with "
    "transformers, and fail (writing nothing) when they disagree. Default: on when transformers is installed and "
    "the original fits in memory beside the export.",
)
def command(
    preset,
    config_file,
    checkpoint,
    variant,
    out_dir,
    triton_repo,
    triton_device,
    triton_instances,
    triton_cache,
    triton_sequences,
    dtype,
    lowering,
    external_data,
    quiet,
    verify,
):
    """Export a model to ONNX (graph files + manifest.json) in OUT."""
    if (triton_cache or triton_sequences) and not triton_repo:
        raise ConfigError("--triton-cache and --triton-sequences shape the --triton-repo model; give --triton-repo")
    progress = command_progress("export", quiet)
    if checkpoint:
        if preset or config_file:
            raise ConfigError("give --from on its own, not with --preset or --config")
        from models.checkpoints import checkpoint_weights, open_checkpoint

        stored_weights = checkpoint_weights(checkpoint)
        check_memory(stored_weights, dtype, lowering)
        progress(f"importing {checkpoint}")
        # The weights are read by the export, after it traces: converted tensor by tensor as they are written.
        imported = open_checkpoint(checkpoint, keep_dtype=True)
        progress(f"checked its config and tensors ({imported.config.layers} layers)")
        dtype, dtype_note = checkpoint_dtype(imported.source.get("dtype"), dtype)
        extra = imported.tokenizer.files() if imported.tokenizer else {}
        if verify and imported.source.get("format") != "huggingface":
            raise ConfigError(
                f"--verify loads the original with transformers, which reads Hugging Face directories, not "
                f"{imported.source.get('format')} checkpoints; drop --verify"
            )
        skip = None
        if verify is None:
            skip = why_not_verify(imported.source, stored_weights[0])
        elif verify:
            import_transformers()  # --verify without transformers: say how to get it, before the export
        # The checkpoint's files are hashed for the manifest on a thread of their own while the export traces and
        # writes: hashlib and file reads release the GIL, so with a second core the hashing adds no wall time.
        hashed = Background(recorded_source, imported.source, checkpoint)

        def write(target):
            return export_model(
                imported.read_model,
                imported.family,
                imported.config,
                target,
                variant=variant or "serving",
                source=hashed.result,
                extra_files=extra,
                lowering=lowering,
                dtype=dtype,
                external_data=external_data,
                progress=progress,
                release_weights=True,  # the model read is written once and not used again
            )

        if verify is False or skip is not None:
            artifact = write(out_dir)
        else:
            artifact, verified = verified_export(write, out_dir, Path(checkpoint).resolve())
        label = f"{checkpoint} ({imported.source['format']} {imported.source['architecture']})"
    else:
        if verify:
            raise ConfigError("--verify checks a --from import against the original checkpoint; drop it")
        spec, name = resolve_model(preset, config_file)
        dtype, dtype_note = dtype or "float32", None
        artifact = export_model(
            spec.build(),
            spec.family,
            spec.config,
            out_dir,
            variant=variant or "stages",
            preset=name,
            seed=spec.seed,
            lowering=lowering,
            dtype=dtype,
            external_data=external_data,
            progress=progress,
        )
        label = name or spec.name
    precision = "" if dtype == "float32" else f", {dtype}"
    click.echo(f"exported {label} ({artifact.family}, {artifact.variant}{precision}) to {out_dir}:")
    if dtype_note:
        click.echo(f"  dtype {dtype}: {dtype_note}")
    for graph in artifact.graphs:
        if graph.entry.external_data:
            click.echo(f"  {graph.model_path.name}: weights in {', '.join(graph.entry.external_data)}")
    if lowering != DEFAULT_LOWERING:
        click.echo(
            f"  lowering {lowering}: "
            + "; ".join(f"{g.model_path.name} attention {g.entry.attention_op}" for g in artifact.graphs)
        )
    for graph in artifact.graphs:
        click.echo(
            f"  {graph.model_path.name}: {len(graph.output_names)} outputs, custom ops "
            f"{', '.join(graph.entry.custom_ops) or 'none'}, sha256 {graph.entry.sha256[:12]}"
        )
    if checkpoint and verify is not False:
        click.echo(
            f"  verified against the original: {verified}"
            if skip is None
            else f"  not verified against the original: {skip}"
        )
    if triton_repo:
        from exporters.triton import kv_cache_layout, write_triton_repo

        name = artifact.manifest.preset or Path(out_dir).name
        target = write_triton_repo(
            artifact,
            triton_repo,
            name,
            device=triton_device,
            instances=triton_instances,
            kv_cache=triton_cache,
            sequences=triton_sequences,
        )
        layout = kv_cache_layout(artifact, triton_cache)
        cache = f", KV cache on the {layout}" if layout else ""
        click.echo(f"wrote Triton model {name!r} to {target} ({triton_device}, {triton_instances} instance(s){cache})")


class Background:
    """fn(*args) on a daemon thread, in a copy of the caller's context (so that its progress lines show); result()
    waits for it and returns its value or raises its exception. Daemon: a command that fails or is interrupted
    exits at once instead of waiting for the work it no longer needs (an executor's threads are joined at exit)."""

    def __init__(self, fn, *args):
        self._done = threading.Event()
        self._value, self._error = None, None
        context = contextvars.copy_context()
        threading.Thread(target=self._run, args=(context, fn, args), name=fn.__name__, daemon=True).start()

    def _run(self, context, fn, args) -> None:
        try:
            self._value = context.run(fn, *args)
        except BaseException as exc:  # handed to the caller of result(), whatever it is
            self._error = exc
        finally:
            self._done.set()

    def result(self):
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value
