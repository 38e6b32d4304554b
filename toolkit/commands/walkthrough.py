"""`toolkit trace`: walk through the worked example stage by stage (the command keeps its name; the library
calls it a walkthrough, since nothing is traced in an exporter's sense)."""

from __future__ import annotations

import json

import click

from toolkit.explain.walkthrough import render_text, worked_example_walkthrough


@click.command("trace")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(fmt):
    """Shapes, every stage row, attention, residuals, probe logits, causality, ledger, gradient check."""
    walkthrough = worked_example_walkthrough()
    click.echo(json.dumps(walkthrough, indent=2) if fmt == "json" else render_text(walkthrough))
    if not (walkthrough["causality"]["passed"] and walkthrough["gradient_check"]["passed"]):
        click.get_current_context().exit(1)
