"""`toolkit run`: run one backend on an artifact and print or save its outputs."""

from __future__ import annotations

import click
import numpy as np

from models.artifacts import open_artifact
from runners.registry import create_runner
from toolkit.check.crosscheck import default_inputs, graph_feed
from toolkit.commands.common import SEED_MAX, load_npz, save_npz_atomically


@click.command("run")
@click.argument("artifact_dir", type=click.Path())
@click.option("--backend", required=True, help="Backend name, e.g. ort-cpu (see `toolkit check --help`).")
@click.option("--inputs", "inputs_file", type=click.Path(dir_okay=False), help=".npz feed (default: preset/random).")
@click.option("--save", "save_file", type=click.Path(dir_okay=False), help="Write every output to this .npz.")
@click.option(
    "--seed", type=click.IntRange(min=0, max=SEED_MAX), default=0, show_default=True, help="Seed of the random feed."
)
def command(artifact_dir, backend, inputs_file, save_file, seed):
    """Run ARTIFACT_DIR on one backend; graphs run in order, each fed by the ones before it."""
    artifact = open_artifact(artifact_dir)
    if inputs_file:
        inputs, source = load_npz(inputs_file), inputs_file
    else:
        inputs, source = default_inputs(artifact, None, None, seed)
    unknown = sorted(set(inputs) - {s.name for g in artifact.graphs for s in g.input_specs})
    outputs: dict[str, np.ndarray] = {}
    for graph in artifact.graphs:
        runner = create_runner(backend, artifact, graph.name)
        feed = graph_feed(graph, inputs, outputs)
        if unknown and graph is artifact.graphs[0]:
            feed.update({name: inputs[name] for name in unknown})  # let the feed check name them
        outputs.update(runner.run(feed))
        click.echo(
            f"{graph.name}: {runner.name} on {runner.device}, {runner.last_inference_time * 1e3:.2f} ms, "
            f"inputs {source}"
        )
    for name, value in outputs.items():
        flat = np.asarray(value).ravel()
        preview = ", ".join(_number(x) for x in flat[:4]) + (", ..." if flat.size > 4 else "")
        click.echo(f"  {name:<40} {str(value.dtype):<8} {'x'.join(map(str, value.shape)):<12} [{preview}]")
    if save_file:
        # .npz has no bfloat16: numpy would store ml_dtypes' bfloat16 as raw 2-byte voids, unreadable as
        # numbers; widening to float32 is exact.
        widened = [name for name, value in outputs.items() if value.dtype.name == "bfloat16"]
        save_npz_atomically(
            save_file, {name: value.astype(np.float32) if name in widened else value for name, value in outputs.items()}
        )
        note = " (bfloat16 stored as float32, exactly: .npz has no bfloat16)" if widened else ""
        click.echo(f"saved {len(outputs)} outputs to {save_file}{note}")


def _number(x) -> str:
    """One preview value. Integers as they are; every float (float16 and ml_dtypes' bfloat16 included, whose
    scalars have no numeric format codes of their own) through a Python float."""
    if isinstance(x, (np.integer, np.bool_)):
        return str(x)
    return f"{float(x):.4g}"
