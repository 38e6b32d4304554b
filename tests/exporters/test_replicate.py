"""One traced block replicated N times must be the same model as the whole model traced."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from exporters import onnx_export, replicate
from models.gpt import GPTConfig
from models.layers import NO_WINDOW
from models.llama import LlamaConfig
from models.registry import build_model, get_family
from runners.registry import create_runner
from toolkit.check.crosscheck import default_inputs, graph_feed

CASES = {
    # GQA with half pairing is the SmolLM2 shape; the serving graph threads per-block cache inputs.
    "llama-serving": ("llama", LlamaConfig(layers=3, kv_heads=2, rope_pairing="half"), "serving"),
    # GPT: LayerNorm, learned positions, biases, and every per-block stage as a graph output.
    "gpt-stages": ("gpt", GPTConfig(layers=3), "stages"),
    # Two kinds of layer (Gemma's local windowed layers with their own RoPE base, and global ones), not in a
    # regular pattern: two traced blocks, each the template of its kind.
    "layer-kinds-serving": (
        "llama",
        LlamaConfig(
            layers=5,
            kv_heads=2,
            sliding_window=3,
            local_rope_base=100.0,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "sliding_attention",
                "full_attention",
            ],
        ),
        "serving",
    ),
    # SmolLM3's layers without RoPE, every stage an output.
    "no-rope-stages": ("llama", LlamaConfig(layers=4, no_rope_layers=[1, 1, 1, 0]), "stages"),
}


def _export_both(tmp_path, monkeypatch, family, config, variant):
    model = build_model(family, config, seed=3)
    replicated = onnx_export.export_model(model, family, config, tmp_path / "replicated", variant=variant)
    with monkeypatch.context() as patch:
        patch.setattr(replicate, "replicable", lambda *args: False)
        traced = onnx_export.export_model(model, family, config, tmp_path / "traced", variant=variant)
    return replicated, traced


@pytest.mark.parametrize("case", sorted(CASES))
def test_replicated_graph_computes_what_the_full_trace_computes(case, tmp_path, monkeypatch):
    family, config, variant = CASES[case]
    replicated, traced = _export_both(tmp_path, monkeypatch, family, config, variant)
    assert replicated.graphs[0].entry.data["traced_blocks"] == len(replicate.layer_kinds(config)[1])
    assert len(replicate.layer_kinds(config)[1]) < config.layers
    assert traced.graphs[0].entry.data["traced_blocks"] == config.layers
    assert replicated.graphs[0].input_specs == traced.graphs[0].input_specs
    assert replicated.graphs[0].output_names == traced.graphs[0].output_names

    inputs, _ = default_inputs(traced, batch=2, sequence=4, seed=1)
    feed = graph_feed(traced.graphs[0], inputs, {})
    if variant == "serving":  # a non-empty cache, so every block's past input is exercised
        rng = np.random.default_rng(2)
        prefill = create_runner("ort-cpu", traced).run(feed)
        feed = {
            "input_ids": rng.integers(0, config.vocab_size, (2, 1)),
            "position_ids": np.full((2, 1), 4),
            "past_mask": np.ones((2, 4), np.int64),
            **{name.replace("present", "past"): value for name, value in prefill.items() if "present" in name},
        }
    want = create_runner("ort-cpu", traced).run(feed)
    got = create_runner("ort-cpu", replicated).run(feed)
    for name, value in want.items():
        # Same ops on the same inputs; only ONNX Runtime's fusion choices may reorder float32 sums.
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    # The eager reference is rebuilt from the replicated file's own initializers.
    eager = create_runner("eager", replicated).run(feed)
    np.testing.assert_allclose(eager["logits"], want["logits"], rtol=1e-4, atol=1e-4)
    # The weight map replicate wrote is the one a byte search of the file finds (tied names included).
    model = build_model(family, config, seed=3)
    proto = onnx.load(replicated.graphs[0].model_path)
    assert replicated.graphs[0].entry.data["weights"] == onnx_export._weight_map(model, proto)
    assert set(replicated.graphs[0].weights) == set(model.state_dict())


def test_every_block_gets_its_own_weights(tmp_path):
    config = LlamaConfig(layers=3)
    model = build_model("llama", config, seed=5)
    artifact = onnx_export.export_model(model, "llama", config, tmp_path / "a", variant="serving")
    proto = onnx.load(artifact.graphs[0].model_path)
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    for name, where in artifact.graphs[0].weights.items():
        stored = initializers[where.initializer]
        expected = model.state_dict()[name].numpy()
        np.testing.assert_array_equal(stored.T if where.transpose else stored, expected, err_msg=name)
    # ... and each block's nodes read that block's initializers, not block 0's copies.
    consumed = {x for node in proto.graph.node for x in node.input}
    names = [artifact.graphs[0].weights[f"block.{i}.attention.q_proj.weight"].initializer for i in range(3)]
    assert len(set(names)) == 3 and set(names) <= consumed
    for i in range(3):
        block = [n for n in proto.graph.node if names[i] in n.input]
        assert block and all(n.name.endswith(f"__block{i}") == (i > 0) for n in block), (i, [n.name for n in block])


def test_a_value_leaving_the_block_sideways_makes_it_trace_the_whole_model():
    config = LlamaConfig(layers=2)
    model = build_model("llama", config, seed=0)
    small_config, small = replicate.one_block_model(model, "llama", config)
    (graph,) = get_family("llama").graphs(small_config)
    inputs, names, run = graph.variant("stages")
    proto = onnx_export._trace(onnx_export._NamedOutputs(small, run, names), small_config, "model", inputs, names)
    full_inputs, full_names, _ = get_family("llama").graphs(config)[0].variant("stages")
    assert replicate.replicate(model, small, proto, config, [s.name for s in full_inputs], list(full_names))
    inner = next(n for n in proto.graph.node if "model.block.0" in replicate._scopes(n) and n.op_type == "MatMul")
    proto.graph.node.append(onnx.helper.make_node("Identity", [inner.output[0]], ["leak"]))
    assert replicate.replicate(model, small, proto, config, [s.name for s in full_inputs], list(full_names)) is None


def test_layers_that_differ_in_window_and_rope_are_one_traced_block_with_their_own_values(tmp_path):
    # Gemma 3's pattern (local layers: a window and their own RoPE base) and SmolLM3's (a layer without RoPE)
    # together: the differences are each layer's buffers, so one block is traced and every copy reads its own.
    types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    config = LlamaConfig(
        layers=4, sliding_window=3, local_rope_base=100.0, layer_types=types, no_rope_layers=[1, 1, 0, 1]
    )
    assert config.per_layer_data == ("window", "inv_freq")
    assert replicate.layer_kinds(config) == ([0, 0, 0, 0], [0])
    model = build_model("llama", config, seed=3)
    artifact = onnx_export.export_model(model, "llama", config, tmp_path / "a", variant="serving")
    assert artifact.graphs[0].entry.data["traced_blocks"] == 1
    proto = onnx.load(artifact.graphs[0].model_path)
    initializers = {t.name: onnx.numpy_helper.to_array(t) for t in proto.graph.initializer}
    consumed = {x for node in proto.graph.node for x in node.input}
    exponents = np.arange(0, config.head_width, 2) / config.head_width  # inv_freq = base^(-2i/d)
    local, full = 100.0**-exponents, config.rope_base**-exponents
    for i, kind in enumerate(types):
        window = initializers[f"model.block.{i}.attention.window"]
        assert int(window) == (3 if kind == "sliding_attention" else NO_WINDOW), i
        expected = np.zeros_like(full) if i == 2 else local if kind == "sliding_attention" else full
        np.testing.assert_allclose(initializers[f"model.block.{i}.attention.inv_freq"], expected, rtol=1e-6)
        assert {f"model.block.{i}.attention.window", f"model.block.{i}.attention.inv_freq"} <= consumed
    # Not weights: the eager reference computes them from the config, so the weight map leaves them out.
    assert not any("window" in name or "inv_freq" in name for name in artifact.graphs[0].weights)


def test_a_rotation_by_zero_frequencies_leaves_queries_and_keys_bit_for_bit():
    # A layer without RoPE among layers with it rotates by zero frequencies: cos 1, sin 0, so q and k are the
    # same bits as not rotating at all (in the float64 oracle as in float32).
    config = LlamaConfig(layers=2, no_rope_layers=[1, 0])
    assert config.per_layer_data == ("inv_freq",)  # no window differs: no window buffer, no mask
    model = build_model("llama", config, seed=1).double()
    plain = build_model("llama", LlamaConfig(layers=1, no_rope_layers=[0]), init=False).double()
    plain.load_state_dict(
        {k.replace("block.1.", "block.0."): v for k, v in model.state_dict().items() if not k.startswith("block.0.")},
        strict=True,
    )
    x = torch.randn(2, 5, config.width, dtype=torch.float64)
    assert torch.equal(model.block[1](x)["output"], plain.block[0](x)["output"])
    assert model.block[1].attention.layer_data == ("inv_freq",) and not plain.block[0].attention.rope
    assert not hasattr(model.block[1].attention, "window")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(300, 257), (1, 5), (5, 1), (129, 128)])
def test_weights_are_written_as_the_tensor_holds_them_transposed_or_not(dtype, shape):
    """_weight_array's strip-by-strip transposed copy against torch's own contiguous copy, for strips that do and
    do not divide the width, in every written dtype."""
    import ml_dtypes

    weight = torch.randn(shape).to(dtype)
    written = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}[dtype]
    for transposed in (False, True):
        expected = (weight.T if transposed else weight).contiguous().float().numpy()
        array = replicate._weight_array(weight, transposed, np.dtype(written), "w")
        assert array.flags.c_contiguous and array.dtype == written
        np.testing.assert_array_equal(array.astype(np.float32), expected)
        widened = replicate._weight_array(weight, transposed, np.dtype(np.float32), "w")
        np.testing.assert_array_equal(widened, expected)
