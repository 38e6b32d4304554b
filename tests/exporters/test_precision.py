"""Reduced-precision exports: the graph rewrite, the float32-accumulating RMSNorm body, and whole presets.

Oracles are float64 numpy written from the math and the float64 eager model; float16 runs on ONNX
Runtime CPU and onnx.reference, bfloat16 on onnx.reference (ONNX Runtime CPU has no bfloat16 MatMul).
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from artifact.errors import BackendUnavailableError, ExportError
from exporters.functions import OPSET, function_protos, reduced_precision_function_protos
from exporters.onnx_export import export_model
from exporters.precision import check_supported, convert_array, to_dtype
from models.ops import CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION
from models.presets import get_preset
from runners.eager import model_from_artifact
from runners.registry import check_backend, create_runner
from toolkit.check.crosscheck import cross_check
from toolkit.cli import main

ELEM = {"float32": TensorProto.FLOAT, "float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
NP = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Unit roundoff of each dtype: a correct result is within a few of these, relative to its scale.
ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def _model(nodes, inputs, outputs, initializers=(), functions=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(CUSTOM_DOMAIN, CUSTOM_DOMAIN_VERSION)],
        functions=list(functions),
    )
    model.ir_version = 10
    return model


def rmsnorm_model(dtype: str, functions) -> onnx.ModelProto:
    node = helper.make_node("RMSNorm", ["x", "w"], ["y"], domain=CUSTOM_DOMAIN, epsilon=1e-6)
    return _model(
        [node],
        [helper.make_tensor_value_info("x", ELEM[dtype], [2, 8]), helper.make_tensor_value_info("w", ELEM[dtype], [8])],
        [helper.make_tensor_value_info("y", ELEM[dtype], [2, 8])],
        functions=functions,
    )


def rms_norm64(x, w, eps=1e-6):
    x, w = x.astype(np.float64), w.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


# |x| in 300..1000: x^2 up to 1e6, far beyond float16's largest value 65504.
LARGE = np.random.default_rng(0).uniform(300, 1000, (2, 8)) * np.array([1, -1] * 4)


@pytest.mark.parametrize("backend", ["onnxruntime", "onnx-reference"])
def test_float16_rmsnorm_body_does_not_overflow_where_squares_exceed_float16(backend):
    x, w = LARGE.astype(np.float16), np.linspace(0.5, 2, 8).astype(np.float16)
    model = rmsnorm_model("float16", reduced_precision_function_protos({"RMSNorm"}))
    onnx.checker.check_model(model, full_check=True)
    if backend == "onnxruntime":
        y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x, "w": w}
        )[0]
    else:
        y = ReferenceEvaluator(model).run(None, {"x": x, "w": w})[0]
    assert y.dtype == np.float16 and np.isfinite(y).all()
    want = rms_norm64(x, w)
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=0, atol=4 * ROUNDOFF["float16"] * np.abs(want).max())


def test_plain_rmsnorm_body_in_float16_overflows_on_the_same_inputs():
    """The failure the float32 body prevents: the float32 export's body run on float16 values."""
    x, w = LARGE.astype(np.float16), np.ones(8, np.float16)
    y = ReferenceEvaluator(rmsnorm_model("float16", function_protos({"RMSNorm"}))).run(None, {"x": x, "w": w})[0]
    assert not np.allclose(y.astype(np.float64), rms_norm64(x, w), atol=0.1)  # x^2 -> inf, y -> 0


def test_bfloat16_rmsnorm_body_matches_float64():
    x, w = LARGE.astype(ml_dtypes.bfloat16), np.linspace(0.5, 2, 8).astype(ml_dtypes.bfloat16)
    y = ReferenceEvaluator(rmsnorm_model("bfloat16", reduced_precision_function_protos({"RMSNorm"}))).run(
        None, {"x": x, "w": w}
    )[0]
    assert y.dtype == ml_dtypes.bfloat16
    want = rms_norm64(x.astype(np.float64), w.astype(np.float64))
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=0, atol=4 * ROUNDOFF["bfloat16"] * np.abs(want).max())


def rope_softmax_graph(n: int = 4096) -> tuple[onnx.ModelProto, dict]:
    """positions -> Cast(float) * inv_freq -> Cos, times an activation x (scaled by weight), masked with
    -inf, then Softmax over n logits; the shapes of a RoPE + attention path in a few nodes."""
    inv_freq = np.full((n,), 1e-3, np.float32)
    weight = np.full((n,), 1.0, np.float32)
    neg_inf = np.array(-np.inf, np.float32)
    nodes = [
        helper.make_node("Cast", ["positions"], ["pos_f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["pos_f", "inv_freq"], ["angles"]),
        helper.make_node("Cos", ["angles"], ["cos"]),
        helper.make_node("Mul", ["x", "weight"], ["xw"]),
        helper.make_node("Mul", ["xw", "cos"], ["rotated"]),
        helper.make_node("Where", ["mask", "rotated", "neg_inf"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("positions", TensorProto.INT64, [n]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, n]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, n]),
        ],
        [
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, n]),
            helper.make_tensor_value_info("angles", TensorProto.FLOAT, [n]),
        ],
        [
            numpy_helper.from_array(inv_freq, "inv_freq"),
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(neg_inf, "neg_inf"),
        ],
    )
    # Positions 0 make cos exactly 1, so the logits are x itself: integers up to 2000, exact in float16,
    # far past where a float16 exp overflows (e^11.1 = 65504); 4096 terms in the softmax sum.
    positions = np.zeros(n, dtype=np.int64)
    x = (1000 + (np.arange(n) * 37) % 1000).astype(np.float32)[None]
    mask = np.ones((1, n), bool)
    mask[0, :7] = False
    return model, {"positions": positions, "x": x, "mask": mask}


def test_rewrite_keeps_position_math_and_softmax_in_float32_and_converts_the_rest():
    model, feed = rope_softmax_graph()
    to_dtype(model, "float16", parameters={"weight"})
    onnx.checker.check_model(model, full_check=True)
    typed = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True)
    elem = {
        v.name: v.type.tensor_type.elem_type for v in [*typed.graph.value_info, *typed.graph.output, *typed.graph.input]
    }
    inits = {i.name: i.data_type for i in model.graph.initializer}
    assert inits["weight"] == TensorProto.FLOAT16  # a parameter
    assert inits["inv_freq"] == TensorProto.FLOAT  # only position math uses it
    assert inits["neg_inf"] == TensorProto.FLOAT16  # used by a float16 Where: converted in place
    cos = next(n for n in model.graph.node if n.op_type == "Cos")
    assert elem[cos.input[0]] == TensorProto.FLOAT  # RoPE angles never rounded to float16
    softmax = next(n for n in model.graph.node if n.op_type == "Softmax")
    assert elem[softmax.input[0]] == TensorProto.FLOAT and elem[softmax.output[0]] == TensorProto.FLOAT
    assert elem["probs"] == TensorProto.FLOAT16 and elem["angles"] == TensorProto.FLOAT16  # outputs declared
    assert elem["x"] == TensorProto.FLOAT16


@pytest.mark.parametrize("backend", ["onnxruntime", "onnx-reference"])
def test_float16_softmax_with_large_logits_matches_float64(backend):
    model, feed = rope_softmax_graph()
    to_dtype(model, "float16", parameters={"weight"})
    feed = dict(feed, x=feed["x"].astype(np.float16))
    if backend == "onnxruntime":
        probs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            ["probs"], feed
        )[0]
    else:
        probs = ReferenceEvaluator(model).run(["probs"], feed)[0]
    scores = feed["x"].astype(np.float64)
    scores[~feed["mask"]] = -np.inf
    want = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
    assert np.isfinite(probs).all() and probs.dtype == np.float16
    np.testing.assert_allclose(probs.astype(np.float64), want, rtol=4 * ROUNDOFF["float16"], atol=1e-7)


def test_constant_used_by_float32_and_float16_nodes_is_copied_not_converted():
    shared = numpy_helper.from_array(np.array([2.5], np.float32), "two_and_a_half")
    nodes = [
        helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["f", "two_and_a_half"], ["f2"]),  # float32 (positions)
        helper.make_node("Mul", ["x", "two_and_a_half"], ["x2"]),  # float16 (activation)
        helper.make_node("Add", ["x2", "f2"], ["y"]),
    ]
    model = _model(
        nodes,
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, [3]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [shared],
    )
    to_dtype(model, "float16", parameters=set())
    onnx.checker.check_model(model, full_check=True)
    inits = {i.name: i.data_type for i in model.graph.initializer}
    assert inits["two_and_a_half"] == TensorProto.FLOAT and TensorProto.FLOAT16 in inits.values()
    y = ReferenceEvaluator(model).run(None, {"i": np.arange(3), "x": np.array([1, 2, 3], np.float16)})[0]
    np.testing.assert_array_equal(y, np.array([2.5, 7.5, 12.5], np.float16))  # 2.5*x + 2.5*i, exact in float16


def test_weight_beyond_float16_range_is_an_export_error_naming_bfloat16():
    with pytest.raises(ExportError, match=r"initializer 'w'.*1e\+05.*float16.*65504.*bfloat16"):
        convert_array(np.array([1.0, -1e5], np.float32), "float16", "weight initializer 'w'")
    assert convert_array(np.array([1e5], np.float32), "bfloat16", "w").dtype == ml_dtypes.bfloat16


def test_unsupported_dtype_and_lowering_combinations_are_refused():
    with pytest.raises(ExportError, match=r"unknown export dtype 'float8'.*float32, float16, bfloat16"):
        check_supported("float8", "functions")
    with pytest.raises(ExportError, match=r"--dtype float16 with --lowering standard.*--lowering functions"):
        check_supported("float16", "standard")
    check_supported("float32", "standard")  # float32 goes with every lowering


def test_subgraphs_are_refused():
    branch = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])],
        "b",
        [],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1])],
    )
    node = helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=branch)
    model = _model(
        [node],
        [
            helper.make_tensor_value_info("c", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    with pytest.raises(ExportError, match=r"'If'|\(If\).*subgraphs.*--dtype float32"):
        to_dtype(model, "float16", parameters=set())


# --- whole presets ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def exported_dtype(tmp_path_factory):
    cache = {}

    def get(preset: str, dtype: str, variant: str = "stages"):
        key = (preset, dtype, variant)
        if key not in cache:
            spec = get_preset(preset)
            out = tmp_path_factory.mktemp(f"{preset}-{dtype}") / "artifact"
            cache[key] = export_model(
                spec.build(),
                spec.family,
                spec.config,
                out,
                variant=variant,
                preset=spec.name,
                seed=spec.seed,
                dtype=dtype,
            )
        return cache[key]

    return get


def test_float16_export_declares_its_dtype_and_keeps_the_weight_map(exported_dtype):
    artifact = exported_dtype("decoder-small", "float16")
    assert artifact.manifest.dtype == "float16"
    graph = artifact.graph()
    assert {o.dtype for o in graph.entry.outputs} == {"float16"}
    assert [s.dtype for s in graph.input_specs] == ["int64"]
    proto = onnx.load(graph.model_path)
    params = {graph.weights[n].initializer for n, _ in get_preset("decoder-small").build().named_parameters()}
    assert {i.data_type for i in proto.graph.initializer if i.name in params} == {TensorProto.FLOAT16}
    # The rebuilt reference holds the float16-rounded weights of the original model, widened exactly.
    rebuilt = model_from_artifact(artifact).state_dict()
    for name, tensor in get_preset("decoder-small").build().state_dict().items():
        torch.testing.assert_close(rebuilt[name], tensor.half().float(), rtol=0, atol=0, msg=name)


def test_float16_preset_passes_check_with_float16_tolerances(exported_dtype):
    report = cross_check(exported_dtype("decoder-small", "float16"), ["eager", "ort-cpu", "onnx-reference"])
    assert report.dtype == "float16"
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends]
    ort_logits = report.backends[1].comparison["logits"]
    assert ort_logits.max_abs > 1e-5  # float16 rounding is visible, so this is not a float32 graph
    assert "float16" in report.backends[0].device


def test_float16_check_fails_when_a_backend_is_off_by_five_percent(exported_dtype, monkeypatch):
    import runners.ort as ort_module

    original = ort_module.OrtRunner._infer

    def off(self, feed):
        out = original(self, feed)
        return {k: (v * np.float16(1.05)).astype(v.dtype) for k, v in out.items()}  # ~100 float16 ulps

    monkeypatch.setattr(ort_module.OrtRunner, "_infer", off)
    report = cross_check(exported_dtype("decoder-small", "float16"), ["ort-cpu"])
    assert not report.passed
    # A tolerance failure on real numbers, not a crash or a missing output: the error is the injected 5%.
    failure = report.backends[0].comparison.first_failure
    assert failure.reason.startswith("max_abs"), failure.reason
    reference = report.arrays["reference"][failure.name]
    assert failure.max_abs == pytest.approx(0.05 * np.max(np.abs(reference)), rel=0.1)


def test_float16_kv_cache_decode_matches_the_oracle(exported_dtype):
    artifact = exported_dtype("decoder-small", "float16", "serving")
    assert {s.dtype for s in artifact.input_specs if s.name.startswith("past.")} == {"float16"}
    report = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=3, decode_steps=2)
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends]
    assert "decode.1.logits" in report.stages


def test_bfloat16_preset_passes_on_reference_and_eager_and_ort_cpu_is_refused(exported_dtype):
    artifact = exported_dtype("block-small", "bfloat16")
    assert artifact.manifest.dtype == "bfloat16"
    with pytest.raises(BackendUnavailableError, match=r"'ort-cpu' cannot run bfloat16.*use .*eager.*onnx-reference"):
        check_backend("ort-cpu", "bfloat16")
    with pytest.raises(BackendUnavailableError, match="ort-cpu.*bfloat16"):
        create_runner("ort-cpu", artifact)
    report = cross_check(artifact, ["eager", "onnx-reference"])
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends]
    outputs = report.arrays["outputs"]["onnx-reference"]
    assert {v.dtype for v in outputs.values()} == {np.dtype(ml_dtypes.bfloat16)}


def test_cli_export_dtype_and_check_refusing_ort_cpu_for_bfloat16(tmp_path, exported_dtype):
    runner = CliRunner()
    result = runner.invoke(
        main, ["export", "--preset", "worked-example", "--dtype", "float16", "--out", str(tmp_path / "w16")]
    )
    assert result.exit_code == 0, result.output
    assert "float16" in result.output
    result = runner.invoke(main, ["check", str(tmp_path / "w16")])
    assert result.exit_code == 0, result.output
    bf16 = exported_dtype("block-small", "bfloat16").directory
    result = runner.invoke(main, ["check", str(bf16), "--backends", "ort-cpu"])
    assert result.exit_code == 2
    assert re.search(
        r"'ort-cpu' cannot run .*not bfloat16; for bfloat16 use eager, eager-cuda, ort-cuda", result.output
    )
    result = runner.invoke(main, ["check", str(bf16)])  # the default backends leave ort-cpu out, saying so
    assert result.exit_code == 0, result.output
    assert "not checking ort-cpu" in result.output
