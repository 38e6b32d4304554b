"""`toolkit presets`: list the named presets."""

from __future__ import annotations

import json

import click

from toolkit.configs import PRESETS
from toolkit.inspection import parameter_count


@click.command("presets")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(fmt):
    """List every preset: name, family, parameter count, description."""
    rows = [
        {"name": p.name, "family": p.family, "parameters": parameter_count(p.build()),
         "config": p.config.to_dict(), "description": p.description}
        for p in PRESETS.values()
    ]
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        click.echo(f"{row['name']:<20} {row['family']:<8} {row['parameters']:>8,} params  {row['description']}")
