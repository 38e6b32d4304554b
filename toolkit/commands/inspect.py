"""`toolkit inspect`: what is inside an artifact."""

from __future__ import annotations

import json

import click

from toolkit.explain.inspect import describe


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@click.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Batch for the memory ledger.")
@click.option("--seq-len", type=click.IntRange(min=1), help="Sequence length for the memory ledger (default: max).")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(path, batch, seq_len, fmt):
    """Graphs, op histograms, custom functions, parameter and memory ledgers, manifest of PATH (dir or .onnx)."""
    info = describe(path, batch, seq_len)
    if fmt == "json":
        click.echo(json.dumps(info, indent=2))
        return
    manifest = info["manifest"]
    click.echo(f"{info['path']}: family {info['family']}, variant {info['variant']}, preset {manifest.get('preset')}")
    for graph in info["graphs"]:
        click.echo(
            f"graph {graph['name']} ({graph['file']}), opsets "
            + ", ".join(f"{d} {v}" for d, v in graph["opset_imports"].items())
        )
        click.echo("  inputs:")
        for spec in graph["inputs"]:
            click.echo(f"    {spec['name']:<40} {spec['dtype']:<8} {_shape(spec['shape'])}")
        click.echo("  outputs:")
        for spec in graph["outputs"]:
            click.echo(f"    {spec['name']:<40} {spec['dtype']:<8} {_shape(spec['shape'])}")
        click.echo("  op histogram: " + ", ".join(f"{op} x{n}" for op, n in graph["op_histogram"].items()))
        click.echo("  custom functions:")
        for fn in graph["functions"]:
            click.echo(
                f"    {fn['name']}({', '.join(fn['inputs'])}) attrs {fn['attributes']}: {fn['nodes']} nodes, "
                f"opsets {fn['opset_imports']}"
            )
        click.echo(f"  initializers: {graph['initializers']['count']} ({graph['initializers']['bytes']:,} bytes)")
    ledger = info["parameters"]
    click.echo(
        f"parameters: {ledger['total']:,} in {ledger['tensor_count']} tensors; formula {ledger['formula']:,} "
        f"(checked); bias-free: {ledger['bias_free']}"
    )
    for group, row in ledger["groups"].items():
        click.echo(f"  {group:<20} {row['tensors']:>3} tensors {row['scalars']:>12,}")
    for tensor in ledger["tensors"]:
        click.echo(f"    {tensor['name']:<52} {_shape(tensor['shape']):<12} {tensor['scalars']:>10,}")
    memory = info["memory"]
    click.echo(f"memory (batch {memory['batch']}, sequence {memory['sequence']}):")
    click.echo(f"  training state {memory['training_state_bytes']:,} bytes ({memory['training_state_note']})")
    scores = memory["attention_scores_per_layer"]
    click.echo(f"  attention scores per layer B*h*T*T = {scores['elements']:,} ({scores['bytes']:,} bytes float32)")
    if memory["logits"]:
        click.echo(f"  logits B*T*V = {memory['logits']['elements']:,} ({memory['logits']['bytes']:,} bytes float32)")
    click.echo(f"  training FLOPs per step ~ {memory['training_flops_per_step_estimate']:,} ({memory['flops_note']})")
    click.echo("manifest: " + json.dumps(manifest, sort_keys=True))
