"""`toolkit export`: build a model from a preset or config file and write an artifact directory."""

from __future__ import annotations

import click

from exporters.onnx_export import VARIANTS, export_model
from toolkit.configs import get_preset, load_config_file
from toolkit.errors import ConfigError


def resolve_model(preset: str | None, config: str | None):
    """(preset object, registered preset name or None) from --preset / --config."""
    if preset and config:
        raise ConfigError("give either --preset or --config, not both")
    if config:
        return load_config_file(config), None
    spec = get_preset(preset or "worked-example")
    return spec, spec.name


@click.command("export")
@click.option("--preset", help="Named preset (see `toolkit presets`); default: worked-example.")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), help="JSON file: {family, seed, config}.")
@click.option("--variant", type=click.Choice(VARIANTS), default="stages", show_default=True,
              help="stages: every stage as an output; serving: logits only.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False), help="Artifact directory to write.")
def command(preset, config_file, variant, out_dir):
    """Export a model to ONNX (model.onnx + manifest.json) in OUT."""
    spec, name = resolve_model(preset, config_file)
    artifact = export_model(spec.build(), spec.family, spec.config, out_dir, variant=variant, preset=name,
                            seed=spec.seed)
    click.echo(f"exported {name or spec.name} ({spec.family}, {variant}) to {out_dir}:")
    for graph in artifact.graphs:
        click.echo(f"  {graph.model_path.name}: {len(graph.output_names)} outputs, custom ops "
                   f"{', '.join(graph.entry['custom_ops']) or 'none'}, sha256 {graph.entry['sha256'][:12]}")
