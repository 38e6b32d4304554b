"""`toolkit depth`: the pre-norm vs post-norm depth experiment."""

from __future__ import annotations

import json

import click

from models.experiments import depth_experiment, render_table
from toolkit.explain.depth import plot


@click.command("depth")
@click.option("--layers", type=click.IntRange(min=1), default=12, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="Also write a PNG chart here.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(layers, seed, plot_file, fmt):
    """Activation RMS after each of N stacked blocks on random input, pre-norm vs post-norm."""
    result = depth_experiment(layers=layers, seed=seed)
    click.echo(json.dumps(result, indent=2) if fmt == "json" else render_table(result))
    if plot_file:
        plot(result, plot_file)
        click.echo(f"wrote {plot_file}")
