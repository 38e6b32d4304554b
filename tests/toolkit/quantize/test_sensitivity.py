"""`--recipe measured`: the weights that move the model most at 4 bits are found by measurement and kept at 8.

The fixture plants the answer: one weight of a two-layer decoder gets an outlier in every block of 32 (the
up projection feeding it scaled down to match, so the model computes the same function), so its 4-bit grid is
coarse and nearly every value rounds far off, while every other weight is an ordinary random one. The
measurement must name that weight first and promote it; the graph must then hold it at 8 bits, and
the artifact must answer closer to the float model than `mixed` (the same k-quant weights without it).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from exporters.quantize import dequantize_weight, quantized_spec
from tests.toolkit.quantize.planted import export_planted
from tests.toolkit.test_cli import assert_user_error, invoke

pytestmark = pytest.mark.slow

PLANTED = "block.0.feed_forward.down_proj"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    # down_proj's inputs 0, 32, 64, 96 weigh 40x more and up_proj makes them 40x smaller: the same function,
    # but each of down_proj's blocks (along K) now spans an outlier, so its 4-bit step is coarse. The gate
    # and up projections' errors reach the output as before.
    return export_planted(tmp_path_factory.mktemp("sensitivity") / "float", 0, slice(None, None, 32), 40.0)


def quantize(source, target, recipe):
    report = target.parent / f"{target.name}.json"
    result = invoke(
        "quantize",
        source,
        "--bits",
        4,
        "--recipe",
        recipe,
        "--no-imatrix",  # the planted weight is found by the measurement alone (the importance would see it too)
        "--accuracy-level",
        0,
        "--out",
        target,
        "--json",
        report,
    )
    assert result.exit_code == 0, result.output
    return result, json.loads(report.read_text())


def nbits_of(artifact_dir) -> dict[str, int]:
    """{MatMulNBits B initializer: bits} of the quantized graph."""
    proto = onnx.load(artifact_dir / "model.onnx", load_external_data=False)
    return {
        n.input[1]: next(a.i for a in n.attribute if a.name == "bits")
        for n in proto.graph.node
        if n.op_type == "MatMulNBits"
    }


def test_the_planted_weight_is_measured_most_sensitive_and_kept_at_8_bits(source, tmp_path):
    result, report = quantize(source, tmp_path / "measured", "measured")
    promotion = json.loads((tmp_path / "measured" / "manifest.json").read_text())["quantization"]["promotion"]
    sensitivity = promotion["sensitivity"]
    ranked = sorted(sensitivity, key=sensitivity.get, reverse=True)
    assert ranked[0] == PLANTED == promotion["promoted"][0]
    assert sensitivity[PLANTED] > 2 * sensitivity[ranked[1]]
    assert 0 < promotion["share_promoted"] <= promotion["share_limit"] == 0.15
    assert f"measured: {len(promotion['promoted'])} of 14 MatMul weights at 8 bits" in result.output
    # In the graph: the head and the promoted weights at 8 bits, the rest at 4; 1 + 14 MatMuls in all.
    widths = nbits_of(tmp_path / "measured")
    assert sorted(widths.values()).count(8) == 1 + len(promotion["promoted"]) and len(widths) == 15
    # The planted weight's own MatMulNBits is an 8-bit one: the only node whose rows 0, 32, 64, ... hold outliers.
    proto = onnx.load(tmp_path / "measured" / "model.onnx")
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    holding = []
    for node in (n for n in proto.graph.node if n.op_type == "MatMulNBits"):
        w = dequantize_weight(inits, quantized_spec(node, inits))  # offsets included
        if np.sqrt(np.mean(w[::32] ** 2)) > 10 * np.sqrt(np.mean(w[1::32] ** 2)):
            holding.append(next(a.i for a in node.attribute if a.name == "bits"))
    assert holding == [8]


def test_measured_answers_closer_to_float_than_mixed_and_checks(source, tmp_path):
    _, measured = quantize(source, tmp_path / "measured", "measured")
    _, mixed = quantize(source, tmp_path / "mixed", "mixed")
    m, x = measured["quality"], mixed["quality"]
    assert m["logits_max_abs"] < 0.5 * x["logits_max_abs"]
    assert abs(m["perplexity_quantized"] / m["perplexity_float"] - 1) < abs(
        x["perplexity_quantized"] / x["perplexity_float"] - 1
    )
    result = invoke("check", tmp_path / "measured", "--backends", "eager,ort-cpu,onnx-reference", "--decode-steps", 2)
    assert result.exit_code == 0, result.output


def test_a_larger_share_promotes_more_and_the_share_is_only_for_measured(source, tmp_path):
    _, _ = quantize(source, tmp_path / "default", "measured")
    result = invoke(
        "quantize",
        source,
        "--bits",
        4,
        "--recipe",
        "measured",
        "--no-imatrix",
        "--promote-share",
        0.4,
        "--out",
        tmp_path / "wide",
    )
    assert result.exit_code == 0, result.output
    default, wide = (
        json.loads((tmp_path / name / "manifest.json").read_text())["quantization"]["promotion"]
        for name in ("default", "wide")
    )
    assert wide["share_limit"] == 0.4 and 0.15 < wide["share_promoted"] <= 0.4
    assert set(default["promoted"]) < set(wide["promoted"])
    assert_user_error(
        invoke("quantize", source, "--bits", 4, "--recipe", "mixed", "--promote-share", 0.4, "--out", tmp_path / "q"),
        "--promote-share applies to --recipe measured, not mixed",
    )


def test_measured_needs_bits_and_is_for_4_bits(source, tmp_path):
    result = invoke("quantize", source, "--bits", 8, "--recipe", "measured", "--out", tmp_path / "q")
    assert_user_error(result, "--recipe measured keeps chosen 4-bit weights at 8 bits; with --bits 8 use mixed or rtn")
    assert not (tmp_path / "q").exists()
    assert_user_error(
        invoke("quantize", source, "--recipe", "measured", "--out", tmp_path / "q"),
        "--bits is required with --recipe measured",
    )
