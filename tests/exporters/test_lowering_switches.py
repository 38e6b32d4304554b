"""The llama family's switches through the standard and ort lowerings (exporters/lowering_attention.py).

The kernels' semantics the rewrite relies on are pinned against numpy; whole exports with every switch on are
judged stage by stage (attention probabilities included) and on padded batches against the float64 eager
oracle. tests/models/test_hf_decoders_lowerings.py holds each architecture to transformers."""

from __future__ import annotations

import collections
import dataclasses
import types

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from artifact.errors import ExportError
from artifact.format import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION
from exporters.lowerings import MS_DOMAIN, _Rewriter, check_supported, lowering_support
from exporters.onnx_export import export_model
from models.encoder_decoder import EncoderDecoderConfig
from models.gpt import GPTConfig
from models.llama import LlamaConfig
from models.registry import build_model
from runners.registry import create_runner
from tests.exporters.test_lowerings import BACKENDS, assert_padded_batch_matches_the_oracle
from toolkit.check.crosscheck import cross_check

GQA = "com.microsoft::GroupQueryAttention"
SEQUENCE = 12  # past every window below
# Head width 8: GroupQueryAttention with q, k and v apart (the per-head q/k norm sits between projection and
# rotation), com.microsoft RotaryEmbedding on 4 of the 8 dims. Gemma 3's and Qwen2's per-layer differences:
# sliding layers with their own RoPE base, a full layer without RoPE.
HEAD_8 = LlamaConfig(
    vocab_size=64,
    layers=3,
    width=32,
    heads=4,
    kv_heads=2,
    ff_width=48,
    max_positions=32,
    rope_pairing="half",
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=3,
    local_rope_base=50.0,
    rope_scaling={"rope_type": "linear", "factor": 2.0},
    no_rope_layers=[1, 0, 1],
    rotary_dim=4,
    attention_bias="qkv",
    qk_norm="head",
    attention_scale=0.2,
    attention_softcap=3.0,
    norm_placement="sandwich",
    ffn_activation="gelu_tanh",
    residual_scale=0.7,
    embedding_scale=2.0,
    final_softcap=20.0,
)
# Head width 32, rotated width 16: the packed, biased QKV goes straight into GroupQueryAttention, which rotates,
# windows and caps; the second layer has no RoPE (do_rotary off there). SwiGLU, post-norm.
PACKED = LlamaConfig(
    vocab_size=64,
    layers=2,
    width=64,
    heads=2,
    kv_heads=1,
    ff_width=48,
    max_positions=32,
    rotary_dim=16,
    no_rope_layers=[1, 0],
    sliding_window=4,
    attention_bias="all",
    attention_scale=0.1,
    attention_softcap=4.0,
    norm_placement="post",
    residual_scale=0.5,
)
# Head width 6: the opset-23 Attention kernel in both lowerings. GPT-NeoX's parallel residual with RMSNorms (two
# norms read one residual sum), OLMo 2's q/k norm over all heads, a plain GELU MLP with biases.
PARALLEL = LlamaConfig(
    vocab_size=64,
    layers=2,
    width=24,
    heads=4,
    kv_heads=2,
    ff_width=40,
    max_positions=32,
    sliding_window=3,
    attention_bias="all",
    qk_norm="full",
    norm_placement="parallel",
    ffn_gated=False,
    ffn_activation="gelu",
)
CONFIGS = {"head-8": HEAD_8, "packed": PACKED, "parallel": PARALLEL}


def ops(artifact) -> collections.Counter:
    proto = onnx.load(str(artifact.model_path))
    return collections.Counter((n.domain, n.op_type) for n in proto.graph.node)


def node_attributes(artifact, op_type: str) -> list[dict]:
    proto = onnx.load(str(artifact.model_path))
    return [
        {a.name: helper.get_attribute_value(a) for a in n.attribute} for n in proto.graph.node if n.op_type == op_type
    ]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """{(config name, lowering, variant): artifact}; the packed config's standard export is the head-8 path's."""
    out = {}
    for name, config in CONFIGS.items():
        model = build_model("llama", config, seed=7)
        for lowering in ("standard", "ort"):
            for variant in ("stages", "serving"):
                if name == "packed" and lowering == "standard" and variant == "serving":
                    continue  # the standard lowering does not depend on the head width
                path = tmp_path_factory.mktemp(f"{name}-{lowering}-{variant}") / "a"
                out[name, lowering, variant] = export_model(
                    model, "llama", config, path, variant=variant, lowering=lowering
                )
    return out


# --------------------------------------------------------------------------- the kernels, against numpy


def numpy_attention(q, k, v, scale, softcap, allowed):
    """softmax(cap * tanh(q k^T * scale / cap), masked) v for one head; q (T, d), k and v (S, d), allowed (T, S)."""
    scores = q.astype(np.float64) @ k.T.astype(np.float64) * scale
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    scores = np.where(allowed, scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return probs @ v, probs


def window_mask(queries, keys, window):
    """Query at position p sees keys p - window < j <= p (transformers' sliding window)."""
    distance = queries[:, None] - keys[None, :]
    return (distance >= 0) & (distance < window)


@pytest.mark.parametrize("past", [0, 6])  # a prefill, and a chunk after a cache longer than the window
def test_group_query_attention_local_window_admits_the_last_window_keys(past):
    window, new, width = 3, 5, 8
    rng = np.random.default_rng(past)
    q, k, v = (rng.standard_normal((1, new, width)).astype(np.float32) for _ in range(3))
    past_k, past_v = (rng.standard_normal((1, 1, past, width)).astype(np.float32) for _ in range(2))
    names = ["q", "k", "v", "past_k", "past_v", "seqlens", "total"]
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["out", "present_k", "present_v", "probs"],
        domain=MS_DOMAIN,
        num_heads=1,
        kv_num_heads=1,
        local_window_size=window,
        softcap=2.0,
        scale=0.3,
        qk_output=2,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.INT32 if n in ("seqlens", "total") else TensorProto.FLOAT, None)
         for n in names],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "present_k", "present_v", "probs")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid(MS_DOMAIN, 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = dict(q=q, k=k, v=v, past_k=past_k, past_v=past_v)
    feed.update(seqlens=np.array([past + new - 1], np.int32), total=np.array(past + new, np.int32))
    out, _, _, probs = session.run(None, feed)
    keys = np.concatenate([past_k[0, 0], k[0]])
    values = np.concatenate([past_v[0, 0], v[0]])
    allowed = window_mask(np.arange(past, past + new), np.arange(past + new), window)
    want_out, want_probs = numpy_attention(q[0], keys, values, 0.3, 2.0, allowed)
    np.testing.assert_allclose(probs[0, 0], want_probs, atol=1e-6)
    np.testing.assert_allclose(out[0], want_out, atol=1e-5)


@pytest.mark.parametrize("backend", ["ort-cpu", "onnx-reference"])
def test_attention_op_caps_the_scores_before_the_boolean_mask(backend):
    """Opset-23 Attention with scale, softcap and a windowed causal mask: masked keys get probability 0."""
    new, width = 6, 8
    rng = np.random.default_rng(1)
    q, k, v = (3 * rng.standard_normal((1, new, width)).astype(np.float32) for _ in range(3))
    allowed = window_mask(np.arange(new), np.arange(new), 3)
    node = helper.make_node(
        "Attention", ["q", "k", "v", "mask"], ["out", "", "", "probs"], q_num_heads=1, kv_num_heads=1, scale=0.3,
        softcap=2.0, qk_matmul_output_mode=3,
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in "qkv"]
        + [helper.make_tensor_value_info("mask", TensorProto.BOOL, None)],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("out", "probs")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    if backend == "ort-cpu":
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    else:
        session = ReferenceEvaluator(model)
    out, probs = session.run(None, dict(q=q, k=k, v=v, mask=allowed[None, None]))
    want_out, want_probs = numpy_attention(q[0], k[0], v[0], 0.3, 2.0, allowed)
    np.testing.assert_allclose(probs[0, 0], want_probs, atol=1e-6)
    np.testing.assert_allclose(out[0], want_out, atol=1e-5)


# --------------------------------------------------------------------------- whole exports, against float64 eager


def assert_stages_pass_check(artifact, lowering: str, layers: int) -> None:
    """Every stage of a stages export against float64 eager on the lowering's backends, the last layer's
    attention probabilities included."""
    report = cross_check(artifact, BACKENDS[lowering], sequence=SEQUENCE)
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends if not b.passed]
    assert f"block.{layers - 1}.attention_weights" in report.stages


@pytest.mark.parametrize("lowering", ["standard", "ort"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_switch_passes_check_stage_by_stage_and_on_decode_steps(exports, name, lowering):
    """Attention probabilities of windowed, capped, per-layer-RoPE layers included; then cached decode steps."""
    assert_stages_pass_check(exports[name, lowering, "stages"], lowering, CONFIGS[name].layers)
    serving = exports.get((name, lowering, "serving"))
    if serving is not None:
        report = cross_check(serving, BACKENDS[lowering], sequence=SEQUENCE - 2, decode_steps=2)
        assert report.passed, [(b.name, b.first_divergence) for b in report.backends if not b.passed]


@pytest.mark.parametrize(
    "name,lowering", [("head-8", "standard"), ("head-8", "ort"), ("packed", "ort"), ("parallel", "ort")]
)
def test_windows_on_a_left_padded_batch_match_the_oracle(exports, name, lowering):
    """Rows with different histories (the continuous batcher's left padding), 3 new tokens after a cache of 5:
    windows of 3 and 4 reach into the cache and not past the padding."""
    assert_padded_batch_matches_the_oracle(exports[name, lowering, "serving"], [[3, 4, 5], [5, 6, 7]], seed=2)


def test_the_attention_mask_counts_only_the_kept_keys_as_the_model_does(exports):
    """A cache with padding inside a row's history: the standard lowering's window counts the keys past_mask
    keeps (models/ops.attention), not the slots."""
    artifact = exports["head-8", "standard", "serving"]
    c = HEAD_8
    rng = np.random.default_rng(4)
    feed = {
        "input_ids": rng.integers(0, c.vocab_size, (2, 2)),
        "past_mask": np.array([[1, 0, 1, 0, 1], [1, 1, 0, 0, 1]], dtype=np.int64),
        "position_ids": np.array([[3, 4], [3, 4]], dtype=np.int64),
    }
    for i in range(c.layers):
        for kind in ("key", "value"):
            feed[f"past.{i}.{kind}"] = rng.standard_normal((2, c.kv_heads, 5, c.head_width)).astype(np.float32)
    oracle = create_runner("eager-f64", artifact).run(feed)
    for backend in BACKENDS["standard"][1:]:
        got = create_runner(backend, artifact).run(feed)
        for name, expected in oracle.items():
            np.testing.assert_allclose(got[name], expected, rtol=1e-4, atol=1e-4, err_msg=f"{backend} {name}")


def test_ort_kernels_and_attributes_per_layer(exports):
    head_8, packed = exports["head-8", "ort", "stages"], exports["packed", "ort", "serving"]
    assert head_8.graphs[0].entry.attention_op == packed.graphs[0].entry.attention_op == GQA
    # Windows on the sliding layers only; the scale and cap everywhere.
    attrs = node_attributes(head_8, "GroupQueryAttention")
    assert [a.get("local_window_size") for a in attrs] == [3, None, 3]
    assert all(a["scale"] == pytest.approx(0.2) and a["softcap"] == pytest.approx(3.0) for a in attrs)
    # Two layers rotate 4 of 8 dims of q and k; the middle layer has no RoPE.
    rotary = node_attributes(head_8, "RotaryEmbedding")
    assert sorted((a["rotary_embedding_dim"], a["num_heads"]) for a in rotary) == [(4, 2), (4, 2), (4, 4), (4, 4)]
    # GeGLU keeps its tanh GELU and gets one gate/up MatMul: qkv, o, gate/up and down per layer, and the head.
    counts = ops(head_8)
    assert (counts["", "MatMul"], counts["", "Split"], counts["", "Gelu"]) == (4 * 3 + 1, 2 * 3, 3)
    # Packed: the fused QKV (its bias added) feeds the kernel, which rotates where the layer has RoPE.
    proto = onnx.load(str(packed.model_path))
    producers = {o: n for n in proto.graph.node for o in n.output}
    gqa = [n for n in proto.graph.node if n.op_type == "GroupQueryAttention"]
    assert [producers[n.input[0]].op_type for n in gqa] == ["Add", "Add"]
    assert [{a.name: helper.get_attribute_value(a) for a in n.attribute}.get("do_rotary", 0) for n in gqa] == [1, 0]
    assert [n.input[7:9] != ["", ""] for n in gqa] == [True, False]
    assert ops(packed)["", "Split"] == PACKED.layers  # gate/up only: nothing splits Q/K/V


def test_standard_graphs_are_plain_opset_23_with_masks_for_windows(exports):
    artifact = exports["head-8", "standard", "stages"]
    proto = onnx.load(str(artifact.model_path))
    assert {(o.domain, o.version) for o in proto.opset_import} == {("", 23)}
    attention = [n for n in proto.graph.node if n.op_type == "Attention"]
    # No cache: the full layer is causal by attribute, the sliding layers take a mask.
    assert [len(n.input) for n in attention] == [4, 3, 4]
    counts = ops(artifact)
    assert counts["", "RotaryEmbedding"] == 4 and counts["", "RMSNormalization"] == 6 + 12 + 1


def test_skip_norm_fuses_only_residual_sums(exports):
    """Sandwich: the pre-norms after the first read residual sums (fused, 2 x 3 - 1) and so does the final norm;
    the post-norms read o_proj and down_proj, the q/k norms projections (6 + 6), the first norm the scaled
    embedding. Parallel: both norms of the second block read one sum (one fuses, one stays) and the final norm."""
    head_8 = ops(exports["head-8", "ort", "stages"])
    assert head_8[MS_DOMAIN, "SkipSimplifiedLayerNormalization"] == 6
    assert head_8["", "RMSNormalization"] == 13
    parallel = ops(exports["parallel", "ort", "stages"])
    assert parallel[MS_DOMAIN, "SkipSimplifiedLayerNormalization"] == 2
    assert parallel["", "RMSNormalization"] == 3 + 4


# --------------------------------------------------------------------------- what a lowering refuses


def test_lowering_support_names_the_lowerings_a_model_admits():
    for config in CONFIGS.values():
        assert lowering_support("llama", config) == {"functions": None, "standard": None, "ort": None}
    assert lowering_support("gpt", GPTConfig()) == {"functions": None, "standard": None, "ort": None}
    seq2seq = lowering_support("encoder-decoder", EncoderDecoderConfig())
    assert seq2seq["functions"] is None
    for lowering in ("standard", "ort"):
        assert seq2seq[lowering].startswith(f"lowering '{lowering}' cannot express the encoder-decoder family's")
        assert seq2seq[lowering].endswith("export it with --lowering functions") and "\n" not in seq2seq[lowering]


def test_the_manifest_records_which_lowerings_the_model_admits(tmp_path):
    from artifact import load_artifact
    from tests.toolkit.test_cli import invoke

    for preset, admits in (("decoder-small", True), ("gpt-tiny", True), ("vaswani-2017", False)):
        result = invoke("export", "--preset", preset, "--out", tmp_path / preset)
        assert result.exit_code == 0, result.output
        recorded = load_artifact(tmp_path / preset).manifest.lowerings
        assert recorded["functions"] is None
        for lowering in ("standard", "ort"):
            assert (recorded[lowering] is None) == admits, recorded


@dataclasses.dataclass
class FutureConfig(LlamaConfig):
    """The llama family with a switch added after the rewrite was written."""

    attention_sinks: int | None = None


def test_a_switch_the_rewrite_does_not_know_is_refused_by_name_when_set():
    assert lowering_support("llama", FutureConfig())["ort"] is None  # off: the model is the one the rewrite knows
    config = FutureConfig(attention_sinks=4)
    support = lowering_support("llama", config)
    assert support["functions"] is None
    for lowering in ("standard", "ort"):
        assert support[lowering] == (
            f"lowering '{lowering}' does not rebuild the switch attention_sinks=4 (the rewrite does not know it); "
            "export it with --lowering functions"
        )
        with pytest.raises(ExportError) as info:
            check_supported("llama", config, lowering)
        assert str(info.value) == support[lowering]


def test_fused_biases_map_back_to_the_torch_tensors(exports):
    """The ort lowering's fused QKV bias: each projection's bias is a slice of it, in the manifest."""
    artifact = exports["packed", "ort", "serving"]
    weights = artifact.graphs[0].weights
    q, k, v = (weights[f"block.0.attention.{p}_proj.bias"] for p in "qkv")
    assert q.initializer == k.initializer == v.initializer
    assert (q.slice, k.slice, v.slice) == ((0, 0, 64), (0, 64, 96), (0, 96, 128))
    assert not q.transpose
    fused = numpy_helper.to_array(
        next(i for i in onnx.load(str(artifact.model_path)).graph.initializer if i.name == q.initializer)
    )
    model = build_model("llama", PACKED, seed=7)
    want = np.concatenate([getattr(model.block[0].attention, f"{p}_proj").bias.detach().numpy() for p in "qkv"])
    np.testing.assert_array_equal(fused, want)


def test_skip_norm_leaves_a_broadcasting_sum_to_a_plain_norm():
    """SkipSimplifiedLayerNormalization adds skip to input elementwise: a norm of x + bias-shaped y stays an Add
    and an RMSNormalization, a norm of x + z of x's shape fuses; both against numpy on ONNX Runtime."""
    eps = 1e-5
    width = 4
    norm = dict(domain=CUSTOM_DOMAIN, epsilon=eps)
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "y"], ["broadcast_sum"]),
            helper.make_node("RMSNorm", ["broadcast_sum", "w"], ["broadcast_norm"], **norm),
            helper.make_node("Add", ["x", "z"], ["residual_sum"]),
            helper.make_node("RMSNorm", ["residual_sum", "w"], ["residual_norm"], **norm),
        ],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "sequence", width]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, width]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, ["batch", "sequence", width]),
        ],
        [
            helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", "sequence", width])
            for n in ("broadcast_norm", "residual_norm", "residual_sum")
        ],
        [numpy_helper.from_array(np.array([1.0, 2.0, 0.5, -1.0], np.float32), "w")],
    )
    proto = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION)]
    )
    config = types.SimpleNamespace(layers=0, head_width=8)  # norms only: no attention or feed-forward to rebuild
    lowered, _, _ = _Rewriter(proto, "ort", config, {}).run()
    counts = collections.Counter(n.op_type for n in lowered.graph.node)
    assert (counts["SkipSimplifiedLayerNormalization"], counts["RMSNormalization"], counts["Add"]) == (1, 1, 1)
    rng = np.random.default_rng(5)
    x, z = (rng.standard_normal((2, 3, width)).astype(np.float32) for _ in range(2))
    y = rng.standard_normal((1, 1, width)).astype(np.float32)
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    names = ("broadcast_norm", "residual_norm", "residual_sum")
    got = dict(zip(names, session.run(list(names), dict(x=x, y=y, z=z)), strict=True))

    def rms(v):
        return v / np.sqrt((v.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * [1.0, 2.0, 0.5, -1.0]

    np.testing.assert_allclose(got["broadcast_norm"], rms(x + y), atol=1e-5)
    np.testing.assert_allclose(got["residual_norm"], rms(x + z), atol=1e-5)
    np.testing.assert_allclose(got["residual_sum"], x + z, atol=1e-6)
