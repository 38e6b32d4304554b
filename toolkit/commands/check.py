"""`toolkit check`: cross-check backends stage by stage; the exit status is the verdict."""

from __future__ import annotations

import click

from runners.registry import DEFAULT_BACKENDS, check_backend
from toolkit.check.driver import CheckRequest, run_check, write_reports
from toolkit.check.oracle import ORACLES
from toolkit.check.reports import placement_lines, text_table
from toolkit.commands.common import SEED_MAX, load_npz, split_backends


@click.command("check")
@click.argument("artifact_dir", required=False, type=click.Path())
@click.option("--preset", help="Export this preset to a temporary directory and check it (instead of ARTIFACT_DIR).")
@click.option(
    "--backends",
    help=f"Comma-separated backends [default: {','.join(DEFAULT_BACKENDS)}, less those the "
    "artifact cannot run on, e.g. onnx-reference for --lowering ort].",
)
@click.option("--inputs", "inputs_file", type=click.Path(dir_okay=False), help=".npz feed (default: preset/random).")
@click.option("--batch", type=int, help="Batch size of the random feed.")
@click.option("--seq-len", type=int, help="Sequence length of the random feed.")
@click.option(
    "--seed", type=click.IntRange(min=0, max=SEED_MAX), default=0, show_default=True, help="Seed of the random feed."
)
@click.option(
    "--decode-steps",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="KV-cache artifacts: also compare N greedy decode steps, each backend through its own cache.",
)
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--junit", "junit_file", type=click.Path(dir_okay=False), help="Write a JUnit XML report here.")
@click.option(
    "--html",
    "html_file",
    type=click.Path(dir_okay=False),
    help="Write a self-contained HTML report (table, error plots, attention heat maps; needs matplotlib).",
)
@click.option(
    "--golden",
    "golden_dir",
    type=click.Path(file_okay=False),
    help="Compare with golden outputs saved earlier by --save-golden (their inputs are used).",
)
@click.option(
    "--save-golden",
    "save_golden_dir",
    type=click.Path(file_okay=False),
    help="Save this (passing) check's inputs and outputs as golden outputs in this directory, atomically.",
)
@click.option("--localize", is_flag=True, help="For each failing ONNX backend, name the first ONNX node that diverges.")
@click.option(
    "--tolerances",
    "tolerances_file",
    type=click.Path(dir_okay=False),
    help="Tolerance file (TOML or .json): per dtype defaults and per stage globs.",
)
@click.option(
    "--allow-cpu-fallback",
    is_flag=True,
    help="GPU ONNX Runtime backends: accept compute nodes that ONNX Runtime placed on the CPU.",
)
@click.option(
    "--oracle",
    type=click.Choice(ORACLES),
    help="Also compare with the original model, loaded from the checkpoint the manifest records (hashes checked). "
    "transformers, for imports of a Hugging Face directory: embeddings, every layer's residual stream, final norm, "
    "logits and decode steps (pip install '.[oracle]'). llama.cpp, for GGUF imports: logits on the prompt and on "
    "--decode-steps (default 8) greedy steps through llama.cpp's cache, held to a relative RMS error set by the "
    "GGUF's weight types, with greedy agreement (pip install '.[llamacpp]').",
)
def command(
    artifact_dir,
    preset,
    backends,
    inputs_file,
    batch,
    seq_len,
    seed,
    decode_steps,
    json_file,
    junit_file,
    html_file,
    golden_dir,
    save_golden_dir,
    localize,
    tolerances_file,
    allow_cpu_fallback,
    oracle,
):
    """Compare every backend with the float64 eager oracle; exit 0 only if all match.

    With no ARTIFACT_DIR the built-in worked example is exported to a temporary
    directory and checked. Exit status: 0 all match, 1 a backend diverges, 2 usage error.
    """
    names = split_backends(backends) if backends is not None else None
    for name in names or []:
        check_backend(name)  # before any export, so a typo costs nothing
    request = CheckRequest(
        artifact_dir=artifact_dir,
        preset=preset,
        backends=names,
        inputs=load_npz(inputs_file) if inputs_file else None,
        batch=batch,
        seq_len=seq_len,
        seed=seed,
        decode_steps=decode_steps,
        tolerances_file=tolerances_file,
        golden_dir=golden_dir,
        save_golden_dir=save_golden_dir,
        localize=localize,
        allow_cpu_fallback=allow_cpu_fallback,
        html=bool(html_file),
        oracle=oracle,
    )
    report = run_check(request, notify=click.echo)
    click.echo(text_table(report))
    for line in placement_lines(report):
        click.echo(line)
    write_reports(report, json_file=json_file, junit_file=junit_file, html_file=html_file)
    if save_golden_dir:
        click.echo(f"saved golden outputs to {save_golden_dir}")
    if not report.passed:
        click.get_current_context().exit(1)
