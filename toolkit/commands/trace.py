"""`toolkit trace`: walk through the worked example stage by stage."""

from __future__ import annotations

import json

import click

from toolkit.explain.walkthrough import render_text, worked_example_trace


@click.command("trace")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(fmt):
    """Shapes, every stage row, attention, residuals, probe logits, causality, ledger, gradient check."""
    trace = worked_example_trace()
    click.echo(json.dumps(trace, indent=2) if fmt == "json" else render_text(trace))
    if not (trace["causality"]["passed"] and trace["gradient_check"]["passed"]):
        click.get_current_context().exit(1)
