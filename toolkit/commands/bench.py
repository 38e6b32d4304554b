"""`toolkit bench`: prefill and decode speed of eager PyTorch and ONNX Runtime artifacts, side by side."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import click

from artifact.errors import ModelFileError
from toolkit.bench.bench import BenchSettings, bench, parse_batches, smollm2_gguf, time_export
from toolkit.bench.report import bench_table, write_png
from toolkit.commands.common import split_backends, write_text_atomically
from toolkit.plotting import pyplot


@click.command("bench")
@click.argument("artifact_dirs", nargs=-1, type=click.Path())
@click.option(
    "--backends",
    default="eager,ort-cpu",
    show_default=True,
    help="Comma-separated: eager (once, on the first float artifact), ort-cpu, ort-cuda.",
)
@click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option(
    "--new-tokens",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Greedy decode steps after the prefill.",
)
@click.option("--batch", "batches", default="1,8", show_default=True, help="Comma-separated batch sizes.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True)
@click.option(
    "--threads",
    type=click.IntRange(min=1),
    default=os.cpu_count() or 1,
    show_default=True,
    help="ONNX Runtime intra-op threads, torch threads and bandwidth-probe threads.",
)
@click.option(
    "--in-process",
    is_flag=True,
    help="Measure in this process instead of one subprocess per measurement (peak RSS is then the "
    "process's peak so far, not per backend).",
)
@click.option("--json", "json_file", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--png", "png_file", type=click.Path(dir_okay=False), help="Write a chart here (needs matplotlib).")
@click.option(
    "--export",
    "time_the_export",
    is_flag=True,
    help="Also time importing + exporting the SmolLM2 GGUF (or --from) to ONNX.",
)
@click.option("--from", "checkpoint", type=click.Path(), help="Checkpoint for --export (default: the SmolLM2 GGUF).")
def command(
    artifact_dirs,
    backends,
    prompt_len,
    new_tokens,
    batches,
    repeats,
    warmup,
    threads,
    in_process,
    json_file,
    png_file,
    time_the_export,
    checkpoint,
):
    """Benchmark ARTIFACT_DIR... (KV-cache exports, float or quantized) against eager and the bandwidth bound."""
    settings = BenchSettings(
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        batches=parse_batches(batches),
        repeats=repeats,
        warmup=warmup,
        threads=threads,
    )
    if checkpoint and not time_the_export:
        raise click.UsageError("--from only names the checkpoint for --export; add --export")
    if png_file:
        pyplot("--png")  # no chart library: say so before minutes of measuring
    if time_the_export:  # a missing checkpoint fails now, not after minutes of measuring
        checkpoint = str(checkpoint or smollm2_gguf())
        if not Path(checkpoint).exists():
            raise ModelFileError(
                f"--from {checkpoint}: no such file or directory; give a GGUF file or a Hugging Face directory"
            )
    report = bench(
        list(artifact_dirs),
        backends=split_backends(backends),
        settings=settings,
        isolate=not in_process,
        progress=lambda line: click.echo(f"measuring {line}", err=True),
    )
    if time_the_export:
        with tempfile.TemporaryDirectory(prefix="toolkit-bench-export-") as tmp:
            report["export"] = time_export(checkpoint, Path(tmp) / "artifact")
    click.echo(bench_table(report))
    if "export" in report:
        e = report["export"]
        click.echo(
            f"export of {e['checkpoint']} to ONNX: {e['seconds']:.1f} s wall "
            f"(import {e['import_seconds']:.1f} s, trace + write {e['export_seconds']:.1f} s)"
        )
    if json_file:
        write_text_atomically(json_file, json.dumps(report, indent=2) + "\n")
    if png_file:
        write_png(report, png_file)
