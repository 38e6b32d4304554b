"""`toolkit presets`: list the named presets."""

from __future__ import annotations

import json

import click

from models.presets import PRESETS
from models.registry import get_family
from toolkit.explain.inspect import parameter_ledger


def preset_rows() -> list[dict]:
    rows = []
    for p in PRESETS.values():
        ledger = parameter_ledger(p.build(), p.family, p.config)  # checks the formula too
        rows.append(
            {
                "name": p.name,
                "family": p.family,
                "parameters": ledger["total"],
                "switches": get_family(p.family).switches(p.config),
                "config": p.config.to_dict(),
                "description": p.description,
            }
        )
    return rows


@click.command("presets")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(fmt):
    """List every preset: name, family, parameter count, switches, description."""
    rows = preset_rows()
    if fmt == "json":
        click.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        switches = ", ".join(f"{k}={v}" for k, v in row["switches"].items())
        click.echo(f"{row['name']:<20} {row['family']:<16} {row['parameters']:>8,} params  {row['description']}")
        click.echo(f"{'':<20} {switches}")
