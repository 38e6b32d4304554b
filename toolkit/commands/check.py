"""`toolkit check`: cross-check backends stage by stage; the exit status is the verdict."""

from __future__ import annotations

import tempfile
from pathlib import Path

import click

from exporters.lowerings import unsupported_backends
from exporters.onnx_export import export_model
from runners.compare import load_tolerances
from runners.registry import DEFAULT_BACKENDS, check_backend, artifact_dtype, dtype_unsupported
from runners.ort import placement_line
from models.artifacts import open_artifact
from toolkit.check.crosscheck import cross_check
from toolkit.commands.common import load_npz, split_backends, write_text_atomically
from models.presets import get_preset
from artifact.errors import BackendUnavailableError, ConfigError
from toolkit.check.golden import check_inputs_fit, compare_with_golden, load_golden, save_golden
from toolkit.check.html_report import render_html
from toolkit.plotting import pyplot
from toolkit.check.localize import localize_report
from toolkit.check.reports import text_table, to_json, to_junit


@click.command("check")
@click.argument("artifact_dir", required=False, type=click.Path())
@click.option("--preset", help="Export this preset to a temporary directory and check it (instead of ARTIFACT_DIR).")
@click.option("--backends", help=f"Comma-separated backends [default: {','.join(DEFAULT_BACKENDS)}, less those the "
                                 "artifact cannot run on, e.g. onnx-reference for --lowering ort].")
@click.option("--inputs", "inputs_file", type=click.Path(dir_okay=False), help=".npz feed (default: preset/random).")
@click.option("--batch", type=int, help="Batch size of the random feed.")
@click.option("--seq-len", type=int, help="Sequence length of the random feed.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the random feed.")
@click.option("--decode-steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="KV-cache artifacts: also compare N greedy decode steps, each backend through its own cache.")
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--junit", "junit_file", type=click.Path(dir_okay=False), help="Write a JUnit XML report here.")
@click.option("--html", "html_file", type=click.Path(dir_okay=False),
              help="Write a self-contained HTML report (table, error plots, attention heat maps; needs matplotlib).")
@click.option("--golden", "golden_dir", type=click.Path(file_okay=False),
              help="Compare with golden outputs saved earlier by --save-golden (their inputs are used).")
@click.option("--save-golden", "save_golden_dir", type=click.Path(file_okay=False),
              help="Save this (passing) check's inputs and outputs as golden outputs in this directory, atomically.")
@click.option("--localize", is_flag=True, help="For each failing ONNX backend, name the first ONNX node that diverges.")
@click.option("--tolerances", "tolerances_file", type=click.Path(dir_okay=False),
              help="Tolerance file (TOML or .json): per dtype defaults and per stage globs.")
@click.option("--allow-cpu-fallback", is_flag=True,
              help="GPU ONNX Runtime backends: accept compute nodes that ONNX Runtime placed on the CPU.")
def command(artifact_dir, preset, backends, inputs_file, batch, seq_len, seed, decode_steps, json_file, junit_file,
            html_file, golden_dir, save_golden_dir, localize, tolerances_file, allow_cpu_fallback):
    """Compare every backend with the float64 eager oracle; exit 0 only if all match.

    With no ARTIFACT_DIR the built-in worked example is exported to a temporary
    directory and checked. Exit status: 0 all match, 1 a backend diverges, 2 usage error.
    """
    names = split_backends(backends) if backends is not None else []
    for name in names:
        check_backend(name)  # before any export, so a typo costs nothing
    inputs = load_npz(inputs_file) if inputs_file else None
    if artifact_dir and preset:
        raise ConfigError("give either ARTIFACT_DIR or --preset, not both")
    tolerances = load_tolerances(tolerances_file) if tolerances_file else None
    golden = None
    if golden_dir:
        if inputs_file or batch is not None or seq_len is not None:
            raise ConfigError("--golden uses the golden directory's stored inputs; drop --inputs/--batch/--seq-len")
        golden = load_golden(golden_dir)
        inputs = golden.inputs
    if html_file:
        pyplot("--html")  # a missing matplotlib fails now, not after the check
    with tempfile.TemporaryDirectory(prefix="toolkit-check-") as tmp:
        if artifact_dir is None:
            spec = get_preset(preset or "worked-example")
            artifact_dir = Path(tmp) / spec.name
            export_model(spec.build(), spec.family, spec.config, artifact_dir, preset=spec.name, seed=spec.seed)
            click.echo(f"exported preset {spec.name!r} to a temporary directory")
        artifact = open_artifact(artifact_dir)
        unsupported = unsupported_backends(artifact.manifest)
        unsupported.update(dtype_unsupported(artifact_dtype(artifact)))
        if backends is None:
            names = [name for name in DEFAULT_BACKENDS if name not in unsupported]
            for name, why in unsupported.items():
                if name in DEFAULT_BACKENDS:
                    click.echo(f"not checking {name}: {why}")
        for name in names:
            if name in unsupported:
                raise BackendUnavailableError(f"backend {name!r} cannot run {artifact.location}: {unsupported[name]}")
        if golden is not None:
            check_inputs_fit(golden, artifact)
        if tolerances is not None:
            tolerances.check_patterns(list(artifact.output_names))
        report = cross_check(artifact, names, inputs=inputs, batch=batch, sequence=seq_len,
                             seed=seed, decode_steps=decode_steps, tolerances=tolerances,
                             allow_cpu_fallback=allow_cpu_fallback)
        if golden is not None:
            report.input_source = f"golden inputs from {golden_dir}"
            compare_with_golden(report, golden, artifact, tolerances)
        if localize:
            report.localizations = localize_report(report, artifact)
        if save_golden_dir:
            save_golden(report, artifact, save_golden_dir)
    click.echo(text_table(report))
    for backend in report.backends:
        if backend.placement is not None:
            click.echo(f"placement {backend.name}: {placement_line(backend.placement)}")
    if json_file:
        write_text_atomically(json_file, to_json(report))
    if junit_file:
        write_text_atomically(junit_file, to_junit(report))
    if html_file:
        write_text_atomically(html_file, render_html(report))
    if save_golden_dir:
        click.echo(f"saved golden outputs to {save_golden_dir}")
    if not report.passed:
        click.get_current_context().exit(1)
