"""The Triton model repository, validated against Triton's own model-config schema, and the client protocol of
examples/triton_client.py run against the real serving graph on ONNX Runtime (no Triton server here: the
tests check the config against the rules Triton's sources apply and emulate its state carry)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from artifact.errors import ExportError, ModelFileError
from artifact.format import is_cache_input, present_name
from exporters.onnx_export import export_model
from exporters.triton import INITIAL_SLOTS, config_pbtxt, write_triton_repo
from models.artifacts import open_artifact
from models.presets import get_preset
from tests.optional import missing
from toolkit.cli import main

ROOT = Path(__file__).resolve().parents[2]


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


def _client():
    """examples/triton_client.py, loaded from its file (examples/ is not a package)."""
    module_spec = importlib.util.spec_from_file_location("triton_client", ROOT / "examples" / "triton_client.py")
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


DTYPE = {onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.INT64: "TYPE_INT64"}
NUMPY = {"TYPE_FP32": np.float32, "TYPE_INT64": np.int64}


def _onnx_dims(value) -> list[int]:
    # Triton's dims leave out the batch axis; symbolic axes are -1, fixed ones keep their size.
    return [d.dim_value if d.dim_value else -1 for d in value.type.tensor_type.shape.dim][1:]


def _assert_declared(schema, declared, values):
    assert [t.name for t in declared] == [v.name for v in values]
    for tensor, value in zip(declared, values, strict=True):
        assert schema.DataType.Name(tensor.data_type) == DTYPE[value.type.tensor_type.elem_type]
        assert list(tensor.dims) == _onnx_dims(value)


def test_server_cache_pairs_every_past_input_with_its_present_output(exported, tmp_path):
    artifact = exported("decoder-small-gqa", "serving")
    target = write_triton_repo(artifact, tmp_path / "repo", "tiny")
    config = _parse((target / "config.pbtxt").read_text())
    graph = onnx.load(str(target / "1" / "model.onnx")).graph
    schema = _schema()
    assert config.name == "tiny" and config.backend == "onnxruntime" and config.max_batch_size > 0
    assert config.WhichOneof("scheduling_choice") == "sequence_batching"
    batching = config.sequence_batching

    # The client sends the graph's other inputs and gets logits; the cache is state, never on the wire.
    _assert_declared(schema, config.input, [v for v in graph.input if not is_cache_input(v.name)])
    _assert_declared(schema, config.output, [v for v in graph.output if not v.name.startswith("present.")])
    past = [v for v in graph.input if is_cache_input(v.name)]
    outputs = {v.name: v for v in graph.output}
    assert past and [s.input_name for s in batching.state] == [v.name for v in past]
    for state, value in zip(batching.state, past, strict=True):
        present = outputs[state.output_name]
        assert state.output_name == present_name(state.input_name)
        for side in (value, present):
            assert schema.DataType.Name(state.data_type) == DTYPE[side.type.tensor_type.elem_type]
            assert list(state.dims) == _onnx_dims(side)
        # Triton's rules for initial_state (core sequence_batch_scheduler.cc, GenerateInitialStateData):
        # one entry with a name, the state's dtype and rank, no -1, fixed dims as the state's.
        (initial,) = state.initial_state
        assert initial.name and initial.data_type == state.data_type and initial.WhichOneof("state_data") == "zero_data"
        assert len(initial.dims) == len(state.dims) and -1 not in initial.dims
        # A starting state's shape is the state dims with -1 as 1 (core sequence_state.cc), so the zeroed
        # rows must be exactly that many for the data to fill the shape Triton gives the model.
        assert list(initial.dims) == [1 if d == -1 else d for d in state.dims] and list(state.dims).count(-1) == 1

    # The onnxruntime backend loads the model only when the config's inputs, control inputs and states
    # together are the graph's inputs, and every control input is one of them (onnxruntime.cc).
    names = {v.name for v in graph.input}
    assert len(config.input) + len(batching.control_input) + len(batching.state) == len(graph.input)
    assert all(control.name in names for control in batching.control_input)
    assert not batching.control_input  # the graph takes no START/END/READY/CORRID input
    assert batching.WhichOneof("strategy_choice") == "oldest" and batching.oldest.max_candidate_sequences >= 1
    assert batching.max_sequence_idle_microseconds > 1_000_000  # Triton's default, 1 s, drops paused clients
    assert config.instance_group[0].kind == schema.ModelInstanceGroup.KIND_CPU
    assert (target / "1" / "model.onnx").read_bytes() == artifact.model_path.read_bytes()


def test_client_cache_is_the_stateless_layout(exported, tmp_path):
    artifact = exported("decoder-small-gqa", "serving")
    target = write_triton_repo(artifact, tmp_path / "repo", "tiny", kv_cache="client")
    config = _parse((target / "config.pbtxt").read_text())
    graph = onnx.load(str(target / "1" / "model.onnx")).graph
    _assert_declared(_schema(), config.input, graph.input)
    _assert_declared(_schema(), config.output, graph.output)
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"


def test_a_graph_without_a_cache(exported):
    artifact = exported("block-small", "serving")
    config = _parse(config_pbtxt(artifact, "block"))
    assert [t.name for t in config.input] == ["hidden_states"]
    assert config.WhichOneof("scheduling_choice") == "dynamic_batching"
    with pytest.raises(ExportError, match="no KV cache"):
        config_pbtxt(artifact, "block", kv_cache="server")


def test_sequences_need_the_server_cache(exported):
    artifact = exported("decoder-small-gqa", "serving")
    config = _parse(config_pbtxt(artifact, "m", sequences=3))
    assert config.sequence_batching.oldest.max_candidate_sequences == 3
    with pytest.raises(ExportError, match="--triton-cache server"):
        config_pbtxt(artifact, "m", kv_cache="client", sequences=3)


def test_gpu_instances(exported):
    config = _parse(config_pbtxt(exported("decoder-small", "serving"), "m", device="gpu", instances=2))
    group = config.instance_group[0]
    assert group.kind == _schema().ModelInstanceGroup.KIND_GPU and group.count == 2


def test_external_data_travels_with_the_graph(tmp_path):
    spec = get_preset("decoder-small")
    artifact = export_model(
        spec.build(), spec.family, spec.config, tmp_path / "a", variant="serving", seed=spec.seed, external_data=True
    )
    (data,) = artifact.graph().entry.external_data
    target = write_triton_repo(artifact, tmp_path / "repo", "tiny")
    assert (target / "1" / data).read_bytes() == (artifact.model_path.parent / data).read_bytes()
    # The copy loads on its own: ONNX Runtime finds the weights beside the graph.
    session = ort.InferenceSession(str(target / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()][0] == "input_ids"


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
    args = ["export", "--preset", "decoder-small", "--variant", "serving", "--out", str(tmp_path / "a")]
    result = CliRunner().invoke(main, [*args, "--triton-repo", str(tmp_path / "repo"), "--triton-sequences", "3"])
    assert result.exit_code == 0, result.output
    assert "KV cache on the server" in result.output
    config = _parse((tmp_path / "repo" / "decoder-small" / "config.pbtxt").read_text())
    assert [t.name for t in config.input] == ["input_ids", "position_ids", "past_mask"]
    assert config.sequence_batching.oldest.max_candidate_sequences == 3


def test_cli_cache_options_need_a_repository(tmp_path):
    result = CliRunner().invoke(main, ["export", "--out", str(tmp_path / "a"), "--triton-cache", "client"])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and "give --triton-repo" in lines[0], result.output
    assert not (tmp_path / "a").exists()  # refused before the export


class TritonState:
    """What Triton does for one sequence of the "server" layout, on the real graph: the request must carry
    exactly the config's inputs; sequence_start gives the model the config's initial_state; each response's
    present.* become the next request's past.*; sequence_end frees them; a request of a sequence that was
    not started is refused."""

    def __init__(self, session, config):
        self.session, self.config = session, config
        self.outputs = [o.name for o in session.get_outputs()]
        self.state: dict | None = None
        self.flags: list[tuple[bool, bool]] = []

    @staticmethod
    def _initial(state) -> np.ndarray:
        # Triton shapes a starting state as the state dims with -1 as 1 (core sequence_state.cc) and fills it
        # with the initial_state's data, which must therefore be exactly that size.
        shape = [1] + [1 if d == -1 else d for d in state.dims]
        data = np.zeros([1, *state.initial_state[0].dims], NUMPY[_schema().DataType.Name(state.data_type)])
        assert data.size == np.prod(shape), "the initial state does not fill the shape Triton gives it"
        return data.reshape(shape)

    def infer(self, inputs: dict[str, np.ndarray], start: bool, end: bool) -> np.ndarray:
        declared = {t.name: t for t in self.config.input}
        assert set(inputs) == set(declared)
        for name, array in inputs.items():
            data_type = _schema().DataType.Name(declared[name].data_type)
            assert (
                array.dtype == NUMPY[data_type] and array.shape[0] == 1 and array.ndim == len(declared[name].dims) + 1
            )
        self.flags.append((start, end))
        if start:
            self.state = {s.input_name: self._initial(s) for s in self.config.sequence_batching.state}
        assert self.state is not None, "a request for a sequence that was not started"
        values = dict(zip(self.outputs, self.session.run(None, {**inputs, **self.state}), strict=True))
        self.state = {s.input_name: values[s.output_name] for s in self.config.sequence_batching.state}
        if end:
            self.state = None
        return values["logits"]


def _full_cache_decode(session, prompt: list[int], steps: int) -> tuple[list[int], list[np.ndarray]]:
    """The stateless protocol: an empty cache first, then the whole cache sent back every step."""
    outputs = [o.name for o in session.get_outputs()]
    cache = {
        i.name: np.zeros([1, i.shape[1], 0, i.shape[3]], np.float32)
        for i in session.get_inputs()
        if is_cache_input(i.name)
    }
    tokens, rows, new, held = [], [], list(prompt), 0
    for _ in range(steps):
        feed = {
            "input_ids": np.array([new], np.int64),
            "position_ids": np.arange(held, held + len(new), dtype=np.int64)[None],
            "past_mask": np.ones([1, held], np.int64),
            **cache,
        }
        values = dict(zip(outputs, session.run(None, feed), strict=True))
        held += len(new)
        cache = {name: values[present_name(name)] for name in cache}
        rows.append(values["logits"][0, -1])
        tokens.append(int(np.argmax(rows[-1])))
        new = [tokens[-1]]
    return tokens, rows


@pytest.mark.parametrize("lowering", ["functions", "ort"])
def test_sending_only_new_tokens_decodes_like_the_full_cache(exported, tmp_path, lowering):
    from google.protobuf import json_format

    if lowering == "functions":
        artifact = exported("decoder-small-gqa", "serving")
    else:  # GroupQueryAttention, whose cache is a shared buffer: the state carry must hold for it too
        spec = get_preset("decoder-small-gqa")
        export_model(spec.build(), spec.family, spec.config, tmp_path / "a", variant="serving", lowering=lowering)
        artifact = open_artifact(tmp_path / "a")
    target = write_triton_repo(artifact, tmp_path / "repo", "tiny")
    config = _parse((target / "config.pbtxt").read_text())
    session = ort.InferenceSession(str(target / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    client = _client()
    # As the client reads it from the server: gRPC get_model_config(as_json=True) is this JSON mapping.
    starting = client.starting_rows(json_format.MessageToDict(config, preserving_proto_field_name=True))
    assert starting == INITIAL_SLOTS

    prompt, steps = [3, 17, 5, 40, 2], 8
    expected, rows = _full_cache_decode(session, prompt, steps)
    server = TritonState(session, config)
    logits = []

    def infer(inputs, start, end):
        logits.append(server.infer(inputs, start, end)[0, -1])
        return logits[-1][None, None]

    assert client.generate(infer, prompt, steps, starting) == expected
    np.testing.assert_allclose(np.stack(logits), np.stack(rows), rtol=1e-4, atol=1e-5)
    assert server.flags == [(True, False)] + [(False, False)] * (steps - 2) + [(False, True)]
    assert server.state is None

    # A stop token ends the sequence early: one more request carries sequence_end.
    early = TritonState(session, config)
    tokens = client.generate(early.infer, prompt, steps, starting, stop=[expected[2]])
    assert tokens == expected[: expected.index(expected[2]) + 1]
    assert early.flags[-1] == (False, True) and len(early.flags) == len(tokens) + 1 and early.state is None


def test_request_tensors_carry_the_config_datatypes(exported):
    client = _client()
    config = _parse(config_pbtxt(exported("decoder-small-gqa", "serving"), "m"))
    inputs = client.step_inputs([7], held=4, starting=INITIAL_SLOTS)
    tensors = {t.name(): t for t in client.request_tensors(inputs)}
    for declared in config.input:
        tensor = tensors[declared.name]
        assert "TYPE_" + tensor.datatype() == _schema().DataType.Name(declared.data_type)
        assert tensor.shape() == list(inputs[declared.name].shape)
    assert inputs["past_mask"].tolist() == [[0, 1, 1, 1, 1]] and inputs["position_ids"].tolist() == [[4]]
