"""`toolkit inspect`: what is inside an artifact."""

from __future__ import annotations

import json

import click

from toolkit.inspection import describe


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


@click.command("inspect")
@click.argument("path", type=click.Path())
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def command(path, fmt):
    """Inputs, outputs, op histogram, custom functions, parameters and manifest of PATH (dir or .onnx)."""
    info = describe(path)
    if fmt == "json":
        click.echo(json.dumps(info, indent=2))
        return
    manifest = info["manifest"]
    click.echo(f"{info['path']}: family {info['family']}, variant {info['variant']}, preset {manifest.get('preset')}")
    click.echo("opsets: " + ", ".join(f"{d} {v}" for d, v in info["opset_imports"].items()))
    click.echo("inputs:")
    for spec in info["inputs"]:
        click.echo(f"  {spec['name']:<32} {spec['dtype']:<8} {_shape(spec['shape'])}")
    click.echo("outputs:")
    for spec in info["outputs"]:
        click.echo(f"  {spec['name']:<32} {spec['dtype']:<8} {_shape(spec['shape'])}")
    click.echo("op histogram: " + ", ".join(f"{op} x{n}" for op, n in info["op_histogram"].items()))
    click.echo("custom functions:")
    for fn in info["functions"]:
        click.echo(f"  {fn['name']}({', '.join(fn['inputs'])}) attrs {fn['attributes']}: {fn['nodes']} nodes, "
                   f"opsets {fn['opset_imports']}")
    ledger = info["parameters"]
    click.echo(f"parameters: {ledger['total']:,} in {ledger['tensor_count']} tensors "
               f"(formula {ledger['formula']:,}, bias-free: {ledger['bias_free']})")
    for tensor in ledger["tensors"]:
        click.echo(f"  {tensor['name']:<44} {_shape(tensor['shape']):<12} {tensor['scalars']:>8,}")
    click.echo(f"initializers: {info['initializers']['count']} ({info['initializers']['bytes']:,} bytes)")
    click.echo("manifest: " + json.dumps(manifest, sort_keys=True))
