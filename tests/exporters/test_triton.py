"""The Triton model repository, validated against Triton's own model-config schema."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import onnx
import pytest
from click.testing import CliRunner

from artifact.errors import ExportError, ModelFileError
from exporters.triton import config_pbtxt, write_triton_repo
from tests.optional import missing
from toolkit.cli import main


def _schema():
    """tritonclient's ModelConfig protobuf, loaded from its file (the grpc package itself needs grpcio)."""
    spec = importlib.util.find_spec("tritonclient")
    if spec is None:
        missing("tritonclient is not installed (test extra); it carries Triton's model-config schema")
    path = Path(spec.submodule_search_locations[0]) / "grpc" / "model_config_pb2.py"
    module_spec = importlib.util.spec_from_file_location("triton_model_config_pb2", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def _parse(text: str):
    from google.protobuf import text_format

    return text_format.Parse(text, _schema().ModelConfig())


DTYPE = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.INT64: "TYPE_INT64"}


def test_config_matches_the_onnx_graph(exported, tmp_path):
    artifact = exported("decoder-small-gqa", "serving")
    target = write_triton_repo(artifact, tmp_path / "repo", "tiny")
    config = _parse((target / "config.pbtxt").read_text())
    proto = onnx.load(str(target / "1" / "model.onnx"))
    assert config.name == "tiny" and config.backend == "onnxruntime" and config.max_batch_size > 0
    schema = _schema()
    for declared, values in ((config.input, proto.graph.input), (config.output, proto.graph.output)):
        assert [t.name for t in declared] == [v.name for v in values]
        for tensor, value in zip(declared, values, strict=False):
            assert schema.DataType.Name(tensor.data_type) == DTYPE[value.type.tensor_type.elem_type]
            # Triton's dims leave out the batch axis; symbolic axes are -1, fixed ones keep their size.
            onnx_dims = [d.dim_value if d.dim_value else -1 for d in value.type.tensor_type.shape.dim][1:]
            assert list(tensor.dims) == onnx_dims
    assert config.instance_group[0].kind == schema.ModelInstanceGroup.KIND_CPU
    assert config.HasField("dynamic_batching")
    assert (target / "1" / "model.onnx").read_bytes() == artifact.model_path.read_bytes()


def test_gpu_instances(exported):
    config = _parse(config_pbtxt(exported("decoder-small", "serving"), "m", device="gpu", instances=2))
    group = config.instance_group[0]
    assert group.kind == _schema().ModelInstanceGroup.KIND_GPU and group.count == 2


def test_refuses_a_directory_that_is_not_a_triton_model(exported, tmp_path):
    (tmp_path / "repo" / "tiny").mkdir(parents=True)
    (tmp_path / "repo" / "tiny" / "notes.txt").write_text("mine")
    with pytest.raises(ModelFileError, match="not a Triton model directory"):
        write_triton_repo(exported("decoder-small", "serving"), tmp_path / "repo", "tiny")
    assert (tmp_path / "repo" / "tiny" / "notes.txt").read_text() == "mine"


def test_multi_graph_artifacts_are_refused(exported, tmp_path):
    with pytest.raises(ExportError, match="single-graph"):
        write_triton_repo(exported("vaswani-2017", "serving"), tmp_path / "repo", "ed")


def test_cli_writes_the_repository(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "export",
            "--preset",
            "decoder-small",
            "--variant",
            "serving",
            "--out",
            str(tmp_path / "a"),
            "--triton-repo",
            str(tmp_path / "repo"),
        ],
    )
    assert result.exit_code == 0, result.output
    config = _parse((tmp_path / "repo" / "decoder-small" / "config.pbtxt").read_text())
    assert [t.name for t in config.input][:3] == ["input_ids", "position_ids", "past_mask"]
