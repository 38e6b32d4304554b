"""An import's export holds one copy of the weights (exporters.replicate.WeightFill, artifact.write.PendingWeights):
the graphs take the model's weights over as they are written, in the export dtype, and the artifact's files
are the same bytes as an export that keeps the model whole."""

from __future__ import annotations

import collections
import copy
import os
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

from artifact import spans
from exporters import onnx_export
from exporters.onnx_export import export_model
from models.checkpoints import import_checkpoint, open_checkpoint, safetensors_reader
from tests.models.test_checkpoints import hf_llama
from tests.peak_memory import assert_cost_per_extra_byte, checkpoint, command_peak
from toolkit.cli import main


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


@pytest.mark.parametrize(
    ("dtype", "lowering"),
    [("float32", "functions"), ("float16", "functions"), ("float32", "ort"), ("float32", "standard")],
)
@pytest.mark.parametrize("external", [True, False])
def test_a_released_export_writes_what_a_kept_one_writes(imported, tmp_path, dtype, lowering, external):
    """The ort and standard lowerings fuse and move weights read from the released bytes: the same files and
    the same weight map as when they read a model kept whole."""
    kept_model, released_model = copy.deepcopy(imported.model), copy.deepcopy(imported.model)
    args = (imported.family, imported.config)
    options = dict(variant="serving", dtype=dtype, external_data=external, lowering=lowering)
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


@pytest.fixture(scope="module")
def depths(tmp_path_factory):
    """depths(layers) -> (directory, float32 weight bytes) of a `layers`-layer checkpoint, written once per module:
    the three peak tests read the same two."""
    made = {}

    def get(layers: int) -> tuple[Path, int]:
        if layers not in made:
            directory = tmp_path_factory.mktemp(f"hf{layers}")
            made[layers] = directory, checkpoint(directory, layers)
        return made[layers]

    return get


def export_peak(
    tmp_path: Path, depths, layers: int, lowering: str = "functions", external: bool = True
) -> tuple[int, int]:
    """(peak resident bytes of `toolkit export --from` in a child process, the checkpoint's float32 weight bytes)."""
    directory, weights = depths(layers)
    out = tmp_path / f"artifact{layers}-{lowering}"
    where = ("--external-data",) if external else ()  # inline: under the external-data threshold by default
    return command_peak(
        "export", "--from", directory, "--out", out, "--no-verify", "--quiet", *where, "--lowering", lowering
    ), weights


@pytest.mark.slow
@pytest.mark.parametrize(("lowering", "bound"), [("functions", 0.4), ("ort", 1.4)])
def test_exporting_more_layers_costs_at_most_one_copy_of_their_weights(tmp_path, depths, lowering, bound):
    """Two float32 checkpoints that differ only in depth (2 and 30 layers, 0.15 and 0.45 GB): the fixed costs
    (interpreter, trace, embedding) cancel in the extra peak memory per extra weight byte.

    functions: the weights stay in the checkpoint file, mapped, and are copied from it into the data file
    (artifact.spans); only the attention projections, which the graph's MatMuls take transposed, are held as
    transposed copies until written: measured 0.21, and 1.03 with every weight read into memory (the mapping
    off), 1.04 with the finiteness check's pages left resident. ort: the lowering fuses q/k/v and gate/up from weights it reads, and the fused copies are held until
    written, the originals a layer at a time only: measured 1.08; holding the model and the graph's copy at once
    costs 2, the serialised graph beside them 3."""
    shallow, deep = export_peak(tmp_path, depths, 2, lowering), export_peak(tmp_path, depths, 30, lowering)
    assert_cost_per_extra_byte(shallow, deep, bound)


@pytest.mark.slow
def test_an_inline_export_holds_no_copy_of_its_mapped_weights(tmp_path, depths):
    """The same two checkpoints with the weights inside the graph file: serialising lays the graph out as chunks,
    the mapped weights as their file spans (artifact.protobuf.serialize_chunks), hashes them from the file and
    copies them into the graph file as it is written; the verification reads the graph back without the weights
    (artifact.protobuf.read_skeleton). Measured 0.20 bytes of peak per extra weight byte (the transposed attention
    projections); with every weight read into memory 1.03, and with the verification parsing the whole file (as
    a runner that reads the weights does) 2.03."""
    shallow = export_peak(tmp_path, depths, 2, external=False)
    assert_cost_per_extra_byte(shallow, export_peak(tmp_path, depths, 30, external=False), 0.4)


def test_the_weights_are_read_after_the_one_block_trace(tmp_path, monkeypatch):
    """Given the function that reads an opened checkpoint's weights, export_model traces first: the trace's
    small model, folded copies and working memory come and go before the weights are read, instead of sitting
    on top of them (at a 1B shape in bfloat16 the export's peak went from 1.46x to 1.22x the weights;
    benchmarks/results/2026-12-02-export-memory-trace-first.json). The artifact is the one a read model gives."""
    directory = tmp_path / "hf"
    hf_llama(tie=True, seed=3).save_pretrained(directory)
    events = []
    trace = onnx_export._trace_program
    monkeypatch.setattr(onnx_export, "_trace_program", lambda *a, **k: events.append("trace") or trace(*a, **k))
    opened = open_checkpoint(directory)

    def read():
        events.append("read")
        return opened.read_model()

    options = dict(variant="serving", release_weights=True)
    ours = export_model(read, opened.family, opened.config, tmp_path / "traced-first", **options)
    assert events == ["trace", "read"]
    theirs = export_model(opened.read_model(), opened.family, opened.config, tmp_path / "read-first", **options)
    assert weights_of(ours) == weights_of(theirs)
    assert [g.weights for g in ours.manifest.graphs] == [g.weights for g in theirs.manifest.graphs]


def test_the_one_block_trace_keeps_no_copy_of_the_small_models_weights(imported):
    """The trace's weight initializers are traced back to the small model before serialising and then dropped,
    with the small model's parameters: the replicated graph fills every weight from the full model."""
    small, proto, sources = onnx_export._trace_template(
        copy.deepcopy(imported.model), imported.family, imported.config, "model", "serving"
    )
    weights = [t for t in proto.graph.initializer if t.name in sources]
    assert len(weights) >= 9 and not any(t.raw_data or t.float_data for t in weights)
    assert all(p.numel() == 0 for p in small.parameters())


@pytest.fixture(scope="module")
def mapped_checkpoints(tmp_path_factory):
    """A bfloat16 and a float32 checkpoint whose embedding and projections are large enough to be mapped
    (models.checkpoints.safetensors_reader.MAP_MIN_BYTES) and whose norms are not."""
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        name = str(dtype).removeprefix("torch.")
        out[name] = tmp_path_factory.mktemp("mapped") / name
        model = hf_llama(width=256, heads=4, kv_heads=2, ff=512, layers=2, vocab=512, tie=True, seed=5)
        model.to(dtype).save_pretrained(out[name])
    return out


def export_cli(*args) -> None:
    result = CliRunner().invoke(main, ["export", *map(str, args), "--no-verify", "--quiet"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("external", [True, False])
def test_weights_mapped_from_the_checkpoint_export_the_bytes_that_read_ones_do(
    mapped_checkpoints, tmp_path, monkeypatch, dtype, external
):
    """Weights kept as stored are views of the checkpoint file's pages and go into the artifact as copies of
    their file ranges (artifact.spans): the same files, byte for byte, as when every weight is read into memory,
    with the graph inline and with its data beside it."""
    source, where = mapped_checkpoints[dtype], "--external-data" if external else "--no-external-data"
    mapped, read = [], []
    map_span, chunks = safetensors_reader.map_span, spans.FileSpan.chunks
    where_in = lambda span: (span.path, span.offset, span.length)  # noqa: E731
    monkeypatch.setattr(safetensors_reader, "map_span", lambda span: mapped.append(where_in(span)) or map_span(span))
    monkeypatch.setattr(spans.FileSpan, "chunks", lambda span, *a: read.append(where_in(span)) or chunks(span, *a))
    export_cli("--from", source, "--dtype", dtype, where, "--out", tmp_path / "mapped")
    monkeypatch.setattr(safetensors_reader, "MAP_MIN_BYTES", 1 << 62)
    export_cli("--from", source, "--dtype", dtype, where, "--out", tmp_path / "read")
    # The embedding and every projection are mapped (15 tensors). The embedding and the MLP projections (7) are
    # read from the file twice each, hashed and then written; the attention projections, which the graph's
    # MatMuls take transposed, and the tied head are transposed copies. The read export maps nothing.
    copied = collections.Counter(read)
    assert len(mapped) == 15 and len(copied) == 7 and set(copied.values()) == {2} and set(copied) <= set(mapped)
    files = sorted(p.name for p in (tmp_path / "read").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "mapped").iterdir())
    assert ("model.onnx.data" in files) == external
    for name in files:
        assert (tmp_path / "mapped" / name).read_bytes() == (tmp_path / "read" / name).read_bytes(), name


@pytest.mark.parametrize("change", ["cut", "replaced"])
def test_a_checkpoint_that_changes_during_the_export_is_refused_and_nothing_is_written(
    mapped_checkpoints, tmp_path, monkeypatch, change
):
    """The mapped weights are read from the file again as they are written: a checkpoint cut short meanwhile, or
    replaced by a file of the same size with other weights (a rename, as downloads land), is one line, exit 2,
    and no artifact."""
    source = tmp_path / "hf"
    shutil.copytree(mapped_checkpoints["float32"], source)
    pack = onnx_export.pack_artifact

    def change_then_pack(*args, **kwargs):
        weights = source / "model.safetensors"
        if change == "cut":
            os.truncate(weights, weights.stat().st_size // 2)
        else:
            other = tmp_path / "other.safetensors"
            shutil.copy(mapped_checkpoints["float32"] / "model.safetensors", other)
            with open(other, "r+b") as handle:  # the last weight's bytes, not its header
                handle.seek(-4096, os.SEEK_END)
                handle.write(bytes(4096))
            other.replace(weights)
        return pack(*args, **kwargs)

    monkeypatch.setattr(onnx_export, "pack_artifact", change_then_pack)
    args = ["export", "--from", str(source), "--out", str(tmp_path / "out"), "--quiet", "--no-verify"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 2, result.output
    assert result.output.count("\n") == 1 and "model.safetensors" in result.output, result.output
    assert "the file changed while it was being exported" in result.output
    assert "leave it unchanged and export again" in result.output
    assert not (tmp_path / "out").exists()
