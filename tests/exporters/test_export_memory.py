"""An import's export holds one copy of the weights (exporters.replicate.WeightFill, artifact.write.PendingWeights):
the graphs take the model's weights over as they are written, in the export dtype, and the artifact's files
are the same bytes as an export that keeps the model whole."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from exporters.onnx_export import export_model
from models.checkpoints import import_checkpoint
from tests.models.test_checkpoints import hf_llama

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "llama"
    hf_llama(tie=True, seed=3).save_pretrained(directory)
    return import_checkpoint(directory)


def weights_of(artifact) -> dict[str, bytes]:
    out = {}
    for graph in artifact.graphs:
        proto = onnx.load(str(graph.model_path))  # external data loaded from beside the graph
        out.update({t.name: (t.data_type, tuple(t.dims), t.raw_data) for t in proto.graph.initializer})
    return out


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("external", [True, False])
def test_a_released_export_writes_what_a_kept_one_writes(imported, tmp_path, dtype, external):
    kept_model, released_model = copy.deepcopy(imported.model), copy.deepcopy(imported.model)
    args = (imported.family, imported.config)
    options = dict(variant="serving", dtype=dtype, external_data=external)
    kept = export_model(kept_model, *args, tmp_path / "kept", **options)
    released = export_model(released_model, *args, tmp_path / "released", release_weights=True, **options)
    # The weights went into the graphs: the released model holds none, the kept one all of its own.
    assert all(p.numel() == 0 for p in released_model.parameters())
    assert all(p.numel() > 0 for p in kept_model.parameters())
    ours, theirs = weights_of(released), weights_of(kept)
    assert ours.keys() == theirs.keys() and ours == theirs
    for a, b in zip(released.manifest.graphs, kept.manifest.graphs, strict=True):
        assert (a.weights, a.inputs, a.outputs, a.external_data.keys()) == (
            b.weights,
            b.inputs,
            b.outputs,
            b.external_data.keys(),
        )


def test_a_float16_export_holds_float16_weights_only(imported, tmp_path):
    artifact = export_model(
        copy.deepcopy(imported.model),
        imported.family,
        imported.config,
        tmp_path / "half",
        variant="serving",
        dtype="float16",
        release_weights=True,
    )
    big = [t for t in weights_of(artifact).values() if np.prod(t[1]) >= 64]
    assert big and all(t[0] == onnx.TensorProto.FLOAT16 for t in big)


CHILD = """
import json, resource, sys
from click.testing import CliRunner
from toolkit.cli import main
args = ["export", "--from", sys.argv[1], "--out", sys.argv[2], "--no-verify", "--quiet", "--external-data"]
result = CliRunner().invoke(main, args)
assert result.exit_code == 0, result.output
print(json.dumps({"peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def export_peak(tmp_path: Path, layers: int) -> tuple[int, int]:
    """(peak resident bytes of `toolkit export --from` in a child process, the checkpoint's float32 weight bytes)."""
    directory = tmp_path / f"hf{layers}"
    model = hf_llama(width=512, heads=8, kv_heads=2, ff=1408, layers=layers, vocab=32000, seed=1)
    model.save_pretrained(directory)
    weights = sum(p.numel() for p in model.parameters()) * 4
    del model
    code = [sys.executable, "-c", CHILD, str(directory), str(tmp_path / f"artifact{layers}")]
    out = subprocess.run(code, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"], weights


@pytest.mark.slow
def test_exporting_more_layers_costs_about_one_copy_of_their_weights(tmp_path):
    """Two checkpoints that differ only in depth (2 and 30 layers, 0.15 and 0.45 GB): the export's extra peak
    memory per extra weight byte stays under 1.4. The fixed costs (interpreter, trace, embedding) cancel; holding
    the model and the graph's copy at once costs 2, the serialised graph beside them 3."""
    shallow, shallow_weights = export_peak(tmp_path, 2)
    deep, deep_weights = export_peak(tmp_path, 30)
    ratio = (deep - shallow) / (deep_weights - shallow_weights)
    print(
        f"peaks {shallow / 2**20:.0f} and {deep / 2**20:.0f} MiB for {shallow_weights / 2**20:.0f} and "
        f"{deep_weights / 2**20:.0f} MiB of weights: {ratio:.2f} bytes per extra weight byte"
    )
    assert deep_weights - shallow_weights > 250e6
    assert ratio < 1.4, f"each extra weight byte cost {ratio:.2f} bytes of peak memory"
