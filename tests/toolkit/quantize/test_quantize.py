"""`toolkit quantize`: MatMulNBits int4/int8 artifacts checked against an independent numpy dequantizer.

A one-layer llama decoder whose widths are multiples of every block size (64, 128: MatMulNBits
blocks run along K = the input width) is exported once; int4 and int8 quantizations of it are made
once. The oracle is written here from the com.microsoft MatMulNBits spec, not imported from
exporters/quantize.py: unpack the uint8 blobs, w = (q - zero_point) * scale per K-block.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from artifact.errors import ConfigError, ModelFileError
from exporters.onnx_export import export_model
from models.artifacts import artifact_config, open_artifact
from models.registry import build_model, get_family
from runners.compare import load_tolerances
from runners.decoding.generate import CachedLM, generate
from runners.eager import model_from_artifact
from runners.registry import create_runner
from tests.toolkit.test_cli import assert_user_error, invoke
from toolkit.check.crosscheck import cross_check
from toolkit.quantize.pipeline import GREEDY_TOKENS, PROMPTS, evaluate_quality, quantize_artifact

pytestmark = pytest.mark.slow

CONFIG = {"vocab_size": 96, "layers": 1, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 128, "max_positions": 48}
IDS = np.array([[3, 17, 42, 5, 88, 61, 0, 95, 23, 7]], dtype=np.int64)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    config = get_family("llama").config_from_dict(CONFIG)
    out = tmp_path_factory.mktemp("quantize") / "float"
    export_model(build_model("llama", config, seed=0), "llama", config, out, variant="serving")
    return open_artifact(out)


@pytest.fixture(scope="module")
def quantized(source, tmp_path_factory):
    """{4 | 8 | "hqq": (artifact, report from --json)} made through the CLI (rtn for 4 and 8 bits, hqq at 4), at
    accuracy level 0 (float32 activations), so that the graphs compute the dequantized weights' function."""
    base = tmp_path_factory.mktemp("quantized")
    out = {}
    for key, bits, algorithm in ((4, 4, "rtn"), (8, 8, "rtn"), ("hqq", 4, "hqq")):
        target, report = base / f"int{key}", base / f"int{key}.json"
        result = invoke(
            "quantize",
            source.directory,
            "--bits",
            bits,
            "--block-size",
            32,
            "--algorithm",
            algorithm,
            "--accuracy-level",
            0,
            "--out",
            target,
            "--json",
            report,
        )
        assert result.exit_code == 0, (result.output, result.exception)
        assert f"to {bits}-bit (block 32, {algorithm}" in result.stdout and "greedy agreement" in result.stdout
        out[key] = (open_artifact(target), json.loads(report.read_text()))
    return out


def mnb_dequantize(proto: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """Oracle from the MatMulNBits spec: the [K, N] float matrix node's B stands for."""
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    attrs = {a.name: a.i for a in node.attribute}
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    blocks = (k + block - 1) // block
    blob = inits[node.input[1]].reshape(n, blocks, block * bits // 8)
    scales = inits[node.input[2]].reshape(n, blocks)
    # Without a zero-point input every block's zero point is 2^(bits-1) (the GGUF recipe's Q4_0 and Q8_0).
    has_zero = len(node.input) > 3 and node.input[3]
    zero_blob = inits[node.input[3]].reshape(n, -1) if has_zero else np.full((n, blocks), 2 ** (bits - 1), np.int64)
    w = np.zeros((k, n), dtype=np.float64)
    for col in range(n):
        for b in range(blocks):
            if bits == 8:
                q = blob[col, b].astype(np.int64)
            else:  # two values per byte, the lower nibble first
                q = np.array([(byte >> shift) & 0xF for byte in blob[col, b] for shift in (0, 4)], dtype=np.int64)
            if zero_blob.dtype != np.uint8:  # float zero points (HQQ), or the default: one per block, unpacked
                zp = float(zero_blob[col, b])
            elif bits == 8:
                zp = int(zero_blob[col, b])
            else:  # packed like the values
                zp = int((zero_blob[col, b // 2] >> (4 * (b % 2))) & 0xF)
            rows = slice(b * block, min((b + 1) * block, k))
            w[rows, col] = ((q - zp) * float(scales[col, b]))[: rows.stop - rows.start]
    return w


def float_matrices(source) -> dict[str, np.ndarray]:
    """{torch name: W^T [in, out]} of every Linear weight (what a MatMul B is), from the float artifact."""
    model = model_from_artifact(source)
    return {
        name: p.detach().numpy().T.astype(np.float64)
        for name, p in model.state_dict().items()
        if name.endswith("proj.weight") or name == "lm_head.weight"
    }


def matched(source, proto):
    """[(torch name, float W^T, dequantized, scales [K-blocks x N] expanded to [K, N])] for each MatMulNBits node,
    each matched to the float matrix it is closest to (independent of the manifest's weight map)."""
    floats = float_matrices(source)
    out = []
    for node in (n for n in proto.graph.node if n.op_type == "MatMulNBits"):
        w_hat = mnb_dequantize(proto, node)
        same = {name: w for name, w in floats.items() if w.shape == w_hat.shape}
        name = min(same, key=lambda nm: np.abs(same[nm] - w_hat).max())
        attrs = {a.name: a.i for a in node.attribute}
        scales = numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == node.input[2]))
        step = np.repeat(scales.reshape(attrs["N"], -1).T, attrs["block_size"], axis=0)[: attrs["K"]]
        out.append((name, same[name], w_hat, step.astype(np.float64)))
    return out


def ort_logits(artifact, ids=IDS) -> np.ndarray:
    runner = create_runner("ort-cpu", artifact)
    lm = CachedLM(runner, artifact_config(artifact).max_positions)
    return lm.step(ids).astype(np.float64)


# --------------------------------------------------------------------------- the graph


@pytest.mark.parametrize("key", [4, 8, "hqq"])
def test_graph_has_matmulnbits_and_no_float_weight_for_quantized_matmuls(source, quantized, key):
    artifact, _ = quantized[key]
    bits = 8 if key == 8 else 4
    proto = onnx.load(str(artifact.model_path))
    c = artifact_config(artifact)
    head_width = c.width // c.heads
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    # per layer q, k, v, o, gate, up, down; plus the vocabulary head
    assert len(nodes) == 7 * c.layers + 1
    shapes = sorted((a["K"], a["N"]) for a in ({x.name: x.i for x in n.attribute} for n in nodes))
    expected = sorted(
        [
            (c.width, c.heads * head_width),
            (c.width, c.kv_heads * head_width),
            (c.width, c.kv_heads * head_width),
            (c.heads * head_width, c.width),
            (c.width, c.ff_width),
            (c.width, c.ff_width),
            (c.ff_width, c.width),
        ]
        * c.layers
        + [(c.width, c.vocab_size)]
    )
    assert shapes == expected
    for node in nodes:
        attrs = {a.name: a.i for a in node.attribute}
        assert (attrs["bits"], attrs["block_size"]) == (bits, 32) and node.domain == "com.microsoft"
    initializer_names = {i.name for i in proto.graph.initializer}
    assert not [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in initializer_names]
    assert not proto.functions and not [n for n in proto.graph.node if n.domain == "onnx_toolkit"]
    # No float copy of a projection weight survives (as stored or transposed); the embedding table does.
    digests = {
        hashlib.sha256(np.ascontiguousarray(a).tobytes()).digest()
        for i in proto.graph.initializer
        if i.data_type == onnx.TensorProto.FLOAT
        for a in (numpy_helper.to_array(i), numpy_helper.to_array(i).T)
    }
    for name, w in float_matrices(source).items():
        f32 = w.astype(np.float32)
        found = {
            hashlib.sha256(np.ascontiguousarray(f32).tobytes()).digest(),
            hashlib.sha256(np.ascontiguousarray(f32.T).tobytes()).digest(),
        } & digests
        assert bool(found) == (name == "lm_head.weight"), name  # tied: the Gather's float table stays
    # Interface unchanged: the same inputs and outputs as the float export.
    assert artifact.input_specs == source.input_specs
    assert artifact.output_names == source.output_names


def test_dequantized_weights_within_half_a_step_and_int8_finer(source, quantized):
    errors = {}
    for bits in (4, 8):
        proto = onnx.load(str(quantized[bits][0].model_path))
        pairs = matched(source, proto)
        assert len({name for name, *_ in pairs}) == len(pairs)  # one node per float matrix
        worst = 0.0
        for name, w, w_hat, step in pairs:
            # round-to-nearest: off by at most half a step of the element's block (plus float32 rounding)
            assert np.all(np.abs(w - w_hat) <= 0.5 * step * (1 + 1e-5) + 1e-7), name
            worst = max(worst, np.abs(w - w_hat).max() / np.abs(w).max())
        errors[bits] = worst
    assert errors[8] < errors[4] / 8  # 16x finer steps


def test_logits_match_the_dequantized_oracle_and_int8_is_closer_to_float(source, quantized):
    float_logits = ort_logits(source)
    errors = {}
    for bits in (4, 8, "hqq"):
        artifact, _ = quantized[bits]
        proto = onnx.load(str(artifact.model_path))
        # Oracle: the float model in float64 with every quantized matrix replaced by the numpy dequantization;
        # the head gets its own (quantized) matrix while the embedding keeps the float table.
        config = dataclasses.replace(artifact_config(source), tie_embeddings=False)
        state = {k: v.clone() for k, v in model_from_artifact(source).state_dict().items()}
        for name, _, w_hat, _ in matched(source, proto):
            state[name] = torch.from_numpy(w_hat.T.astype(np.float32))
        oracle = build_model("llama", config, init=False)
        oracle.load_state_dict(state)
        with torch.no_grad():
            expected = oracle.to(torch.float64)(torch.from_numpy(IDS))["logits"].numpy()
        got = ort_logits(artifact)
        assert np.abs(got - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
        errors[bits] = np.abs(got - float_logits).max()
        assert 0 < errors[bits] < 0.5 * np.abs(float_logits).max()  # sane: a perturbation, not a new model
    assert errors[8] < errors[4]
    assert errors[8] < errors["hqq"]


def test_hqq_has_float_zero_points_and_stays_within_the_block_range(source, quantized):
    proto = onnx.load(str(quantized["hqq"][0].model_path))
    inits = {i.name: i for i in proto.graph.initializer}
    for node in (n for n in proto.graph.node if n.op_type == "MatMulNBits"):
        assert inits[node.input[3]].data_type == onnx.TensorProto.FLOAT
    for name, w, w_hat, step in matched(source, proto):
        assert np.all(np.abs(w - w_hat) <= 16 * step), name  # 16 levels: never outside the block's range
    assert quantized["hqq"][0].manifest.quantization["algorithm"] == "hqq"


def test_manifest_records_the_quantization_and_quality(source, quantized):
    source_hash = hashlib.sha256((source.directory / "manifest.json").read_bytes()).hexdigest()
    for bits in (4, 8):
        artifact, report = quantized[bits]
        q = artifact.manifest.quantization
        assert (q["bits"], q["block_size"], q["quantized_matmuls"]) == (bits, 32, 8)
        assert q["source"]["manifest_sha256"] == source_hash
        assert q["quantizer"]["onnxruntime"] == __import__("onnxruntime").__version__
        assert "MatMulNBitsQuantizer" in q["quantizer"]["tool"]
        assert report["quality"] == q["quality"] and report["bits"] == bits
        quality = q["quality"]
        assert 0 <= quality["greedy_agreement"] <= 1 and quality["greedy_positions"] > 0
        assert quality["logits_max_abs"] >= quality["logits_mean_abs"] > 0
        assert np.isfinite(quality["perplexity_float"]) and quality["perplexity_quantized"] > 1
    int8, int4 = (quantized[bits][0].manifest.quantization["quality"] for bits in (8, 4))
    assert int8["logits_max_abs"] < int4["logits_max_abs"]
    assert int8["greedy_agreement"] >= int4["greedy_agreement"]
    assert abs(int8["perplexity_quantized"] - int8["perplexity_float"]) <= abs(
        int4["perplexity_quantized"] - int4["perplexity_float"]
    )


def test_float_perplexity_matches_the_float64_eager_model(source, quantized):
    from toolkit.quantize.pipeline import _fixed_inputs

    _, text_ids, _ = _fixed_inputs(source, artifact_config(source))
    ids = torch.tensor([text_ids])
    with torch.no_grad():
        logits = model_from_artifact(source).to(torch.float64)(ids)["logits"][0]  # (T, V)
    # Each position predicts the next token: ppl = exp(mean -log p(ids[t+1] | ids[..t])).
    nll = -torch.log_softmax(logits[:-1], dim=-1).gather(1, ids[0, 1:, None]).mean()
    reported = quantized[8][0].manifest.quantization["quality"]["perplexity_float"]
    assert reported == pytest.approx(float(torch.exp(nll)), rel=1e-4)


def test_quantized_artifact_generates_and_checks_against_its_dequantized_reference(quantized):
    artifact, _ = quantized[4]
    lm = CachedLM(create_runner("ort-cpu", artifact), artifact_config(artifact).max_positions)
    result = generate(lm, [1, 2, 3], max_new_tokens=4)
    assert len(result.tokens) == 4
    report = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends]


def test_the_kquant_recipe_is_closer_to_float_than_round_to_nearest(source, quantized, tmp_path):
    """--recipe kquant --zero-points offsets: 4-bit MatMulNBits plus per-block offsets (the searched float minimums) whose values are the
    spec oracle's plus the graph's offsets; its logits are nearer the float model's than rtn's, and the artifact
    checks against its dequantized reference with cached decode steps."""
    from tests.toolkit.quantize.test_gguf_recipe import graph_weight

    target = tmp_path / "kquant"
    options = ("--recipe", "kquant", "--zero-points", "offsets", "--bits", 4, "--accuracy-level", 0)
    result = invoke("quantize", source.directory, *options, "--out", target)
    assert result.exit_code == 0 and "(block 32, kquant," in result.stdout, result.output
    artifact = open_artifact(target)
    assert artifact.manifest.quantization["quantizer"]["tool"] == "exporters.kquant"
    proto = onnx.load(str(artifact.model_path))
    floats = float_matrices(source)
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    offsets = [i for i in proto.graph.initializer if i.name.endswith("_offsets")]
    assert nodes and len(offsets) == len(nodes)
    for node in nodes:
        w_hat = graph_weight(proto, node)
        near = min(floats.values(), key=lambda f: np.inf if f.shape != w_hat.shape else np.abs(f - w_hat).max())
        assert np.abs(near - w_hat).max() < 0.1 * np.abs(near).max()
    float_logits = ort_logits(source)
    error = {
        "kquant": np.abs(ort_logits(artifact) - float_logits).mean(),
        "rtn": np.abs(ort_logits(quantized[4][0]) - float_logits).mean(),
    }
    assert error["kquant"] < error["rtn"], error
    report = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends]


def test_the_mixed_recipe_keeps_the_head_at_8_bits(source, tmp_path):
    """--recipe mixed: the vocabulary projection's MatMulNBits is 8-bit (its values within a 255th of its blocks'
    range of the float head), every other one 4-bit; the manifest maps the head to the 8-bit weight."""
    from tests.toolkit.quantize.test_gguf_recipe import graph_weight

    target = tmp_path / "mixed"
    result = invoke("quantize", source.directory, "--recipe", "mixed", "--bits", 4, "--out", target)
    assert result.exit_code == 0, result.output
    artifact = open_artifact(target)
    head = artifact.graphs[0].entry.data["weights"]["lm_head.weight"]["quantized"]
    proto = onnx.load(str(artifact.model_path))
    bits = {
        n.input[1]: next(a.i for a in n.attribute if a.name == "bits")
        for n in proto.graph.node
        if n.op_type == "MatMulNBits"
    }
    assert bits.pop(head["weight"]) == 8 and set(bits.values()) == {4}
    node = next(n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.input[1] == head["weight"])
    want = float_matrices(source)["lm_head.weight"]
    assert np.abs(graph_weight(proto, node) - want).max() <= (want.max() - want.min()) / 255
    assert artifact.manifest.quantization["recipe"] == "mixed"


def test_integer_zero_points_leave_no_offsets_and_beat_round_to_nearest(source, quantized, tmp_path):
    """--recipe mixed --zero-points integer: every MatMulNBits has uint8 zero points and no offsets beside it (the
    graph has no MatMul by a constant, which offsets would be), the head is 8-bit, the values are the spec oracle's; the logits are
    nearer the float model's than rtn's, and the artifact checks against its dequantized reference."""
    from tests.toolkit.quantize.test_gguf_recipe import graph_weight

    target = tmp_path / "integer"
    options = ("--recipe", "mixed", "--zero-points", "integer", "--accuracy-level", 0, "--greedy-tokens", 2)
    result = invoke("quantize", source.directory, "--bits", 4, *options, "--out", target)
    assert result.exit_code == 0, result.output
    artifact = open_artifact(target)
    quantization = artifact.manifest.quantization
    assert quantization["zero_points"] == "integer" and "integer zero points" in quantization["quantizer"]["algorithm"]
    proto = onnx.load(str(artifact.model_path))
    nodes = [n for n in proto.graph.node if n.op_type == "MatMulNBits"]
    assert nodes and all(len(n.input) == 4 and n.input[3] for n in nodes)
    assert not [i.name for i in proto.graph.initializer if i.name.endswith("_offsets")]
    constants = {i.name for i in proto.graph.initializer}
    assert not [n.name for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in constants]
    floats = float_matrices(source)
    for node in nodes:
        w_hat = graph_weight(proto, node)
        near = min(floats.values(), key=lambda f: np.inf if f.shape != w_hat.shape else np.abs(f - w_hat).max())
        # The search may clip a block's extreme value to fit the rest better: within 15 % of the largest weight.
        assert np.abs(near - w_hat).max() < 0.15 * np.abs(near).max()
    float_logits = ort_logits(source)
    error = {
        "integer": np.abs(ort_logits(artifact) - float_logits).mean(),
        "rtn": np.abs(ort_logits(quantized[4][0]) - float_logits).mean(),
    }
    assert error["integer"] < error["rtn"], error
    report = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=5, decode_steps=2)
    assert report.passed, [(b.name, b.first_divergence) for b in report.backends]
    refused = invoke(
        "quantize",
        source.directory,
        "--bits",
        4,
        "--recipe",
        "rtn",
        "--zero-points",
        "integer",
        "--out",
        tmp_path / "refused",
    )
    assert refused.exit_code == 2 and "--zero-points applies to --recipe kquant, mixed, measured" in refused.output
    assert not (tmp_path / "refused").exists()


def test_float_weights_default_to_mixed_at_4_bits_and_rtn_at_8_with_int8_activations(source, tmp_path):
    """Without --recipe and --accuracy-level: 4 bits is mixed (the 8-bit head beside 4-bit blocks), 8 bits is rtn,
    both at accuracy level 4; the 4-bit default's logits are nearer the float model's than rtn's at that level."""
    made, logits = {}, {}
    for name, options in {
        "default-4": (4,),
        "default-8": (8,),
        "rtn-4": (4, "--recipe", "rtn", "--accuracy-level", 4),
    }.items():
        result = invoke(
            "quantize", source.directory, "--bits", *options, "--out", tmp_path / name, "--greedy-tokens", 2
        )
        assert result.exit_code == 0, result.output
        artifact = open_artifact(tmp_path / name)
        quantization = artifact.manifest.quantization
        made[name] = (quantization["recipe"], quantization["bits"], quantization["accuracy_level"])
        logits[name] = ort_logits(artifact)
    assert made == {"default-4": ("mixed", 4, 4), "default-8": ("rtn", 8, 4), "rtn-4": ("rtn", 4, 4)}
    float_logits = ort_logits(source)
    error = {name: np.abs(value - float_logits).mean() for name, value in logits.items()}
    assert error["default-4"] < error["rtn-4"], error


@pytest.mark.parametrize("zero_points", ["auto", "integer", "offsets"])
def test_widths_that_do_not_fill_a_block_quantize_and_check_with_the_default_recipe(tmp_path, zero_points):
    """Width 48 and FFN 80: every K leaves its last block of 32 partial. The default recipe (mixed) with its
    default zero points (auto), integer ones and offsets (whose block sums then come from a 0/1 matrix) writes a
    graph that computes its dequantized weights: check passes at level 0 with cached decode steps."""
    config = {"vocab_size": 96, "layers": 1, "width": 48, "heads": 4, "kv_heads": 2, "ff_width": 80}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"family": "llama", "seed": 0, "config": config}))
    assert invoke("export", "--config", path, "--variant", "serving", "--out", tmp_path / "float").exit_code == 0
    options = ("--bits", 4, "--accuracy-level", 0, "--out", tmp_path / "q", "--greedy-tokens", 2)
    chosen = () if zero_points == "auto" else ("--recipe", "mixed", "--zero-points", zero_points)
    result = invoke("quantize", tmp_path / "float", *options, *chosen)
    assert result.exit_code == 0 and "(block 32, mixed," in result.stdout, result.output
    quantization = open_artifact(tmp_path / "q").manifest.quantization
    assert quantization["zero_points"] == zero_points
    made = quantization["zero_points_chosen"]
    assert sum(made.values()) == quantization["quantized_matmuls"]
    if zero_points != "auto":
        assert made[zero_points] == quantization["quantized_matmuls"]
    assert f"zero points ({zero_points}): {made['integer']} weights with integer zero points" in result.stdout
    check = invoke("check", tmp_path / "q", "--backends", "eager,ort-cpu,onnx-reference", "--decode-steps", 2)
    assert check.exit_code == 0 and "RESULT: PASS" in check.output, check.output


# --------------------------------------------------------------------------- errors and atomicity


def test_bad_bits_and_block_size(source, tmp_path):
    result = invoke("quantize", source.directory, "--bits", 3, "--out", tmp_path / "q")
    assert result.exit_code == 2 and "Invalid value for '--bits'" in result.output
    result = invoke("quantize", source.directory, "--bits", 4, "--block-size", 48, "--out", tmp_path / "q")
    assert result.exit_code == 2 and "Invalid value for '--block-size'" in result.output
    with pytest.raises(ConfigError, match="--bits: expected one of 4, 8, got 2"):
        quantize_artifact(source.directory, tmp_path / "q", bits=2)
    with pytest.raises(ConfigError, match="--block-size: expected one of 32, 64, 128, got 16"):
        quantize_artifact(source.directory, tmp_path / "q", bits=4, block_size=16)
    with pytest.raises(ConfigError, match="--algorithm hqq with --bits 8: .* use --algorithm rtn"):
        quantize_artifact(source.directory, tmp_path / "q", bits=8, algorithm="hqq")
    assert not (tmp_path / "q").exists()


def test_not_an_artifact_and_output_problems(source, quantized, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(invoke("quantize", empty, "--bits", 4, "--out", tmp_path / "q"), "missing manifest.json")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("keep me")
    assert_user_error(invoke("quantize", source.directory, "--bits", 4, "--out", busy), "not empty")
    assert (busy / "notes.txt").read_text() == "keep me"
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ModelFileError, match="exists and is not a directory"):
        quantize_artifact(source.directory, a_file, bits=4)
    assert_user_error(
        invoke("quantize", source.directory, "--bits", 4, "--out", source.directory), "is the source artifact"
    )
    assert_user_error(
        invoke("quantize", quantized[4][0].directory, "--bits", 8, "--out", tmp_path / "q"), "already quantized"
    )


def test_non_language_model_refused(tmp_path):
    # A decoder-block artifact: one graph, but hidden states in, not token ids.
    config = get_family("block").config_cls()
    export_model(build_model("block", config, seed=0), "block", config, tmp_path / "block")
    with pytest.raises(ModelFileError, match="decoder-only language models"):
        quantize_artifact(tmp_path / "block", tmp_path / "q", bits=4)


def test_interrupted_quantization_leaves_previous_artifact_intact(source, quantized, tmp_path, monkeypatch):
    import shutil

    import toolkit.quantize.pipeline as module

    target = tmp_path / "int8"
    shutil.copytree(quantized[8][0].directory, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "evaluate_quality", interrupted)
    with pytest.raises(KeyboardInterrupt):
        quantize_artifact(source.directory, target, bits=4)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["int8"]  # no scratch or temporary directories left
    assert open_artifact(target).manifest.quantization["bits"] == 8


def tamper_first_matmulnbits(monkeypatch, quantizer: str, flip: int) -> list[str]:
    """Wrap toolkit.quantize.pipeline's `quantizer` ("quantize_proto" or "quantize_proto_blocks") so that the first
    MatMulNBits weight it makes has its first stored byte XORed with `flip` (4-bit: the low nibble, the first K row
    of the first output column; 8-bit: that value), held back where the quantizer held it. Returns the list the
    tampered weight's name is appended to."""
    import toolkit.quantize.pipeline as module

    original, tampered = getattr(module, quantizer), []

    def wrapped(proto, weights, *args, **kwargs):
        quantized, count = original(proto, weights, *args, **kwargs)
        name = next(n for n in quantized.graph.node if n.op_type == "MatMulNBits").input[1]
        values = weights.array(name).copy()
        values.reshape(-1)[0] ^= flip
        weights.hold(next(t for t in quantized.graph.initializer if t.name == name), values)
        tampered.append(name)
        return quantized, count

    monkeypatch.setattr(module, quantizer, wrapped)
    return tampered


@pytest.mark.parametrize("bits", [4, 8])
def test_a_quantized_weight_that_does_not_dequantize_to_its_float_weight_is_refused(
    source, tmp_path, monkeypatch, bits
):
    """Round-to-nearest is held to 0.51 steps of the float weight: one stored value moved by 8 steps (its 4-bit
    nibble's or its byte's bit 3 flipped) is refused by name, with exit 2 and one line, and nothing is written."""
    tampered = tamper_first_matmulnbits(monkeypatch, "quantize_proto", 0x08)
    result = invoke("quantize", source.directory, "--bits", bits, "--algorithm", "rtn", "--out", tmp_path / "q")
    assert len(tampered) == 1
    assert_user_error(
        result,
        f"its {bits}-bit MatMulNBits weight {tampered[0]!r} does not dequantize to within 0.51 steps of the float weight",
    )
    assert not (tmp_path / "q").exists()


def test_check_holds_int8_activation_artifacts_to_what_onnxruntime_computes(source, tmp_path, monkeypatch):
    """At accuracy level 4 (the default) the oracle rounds activations to int8 as ONNX Runtime's CPU MatMulNBits
    does, so the default tolerances judge eager, ort-cpu and onnx-reference, cached decode included; without
    that rounding ort-cpu diverges."""
    for name, options in (("mixed", ()), ("rtn", ("--recipe", "rtn")), ("int8", ())):
        target, report = tmp_path / name, tmp_path / f"{name}.json"
        bits = 8 if name == "int8" else 4
        result = invoke("quantize", source.directory, "--bits", bits, *options, "--out", target, "--greedy-tokens", 2)
        assert result.exit_code == 0, result.output
        assert json.loads((target / "manifest.json").read_text())["quantization"]["accuracy_level"] == 4
        result = invoke(
            "check", target, "--backends", "eager,ort-cpu,onnx-reference", "--decode-steps", 3, "--json", report
        )
        assert result.exit_code == 0, result.output
        assert "RESULT: PASS" in result.output
        rounding = json.loads(report.read_text())["rounding"]
        assert set(rounding) >= {"logits", "decode.2.logits"}
        audit = next(b for b in json.loads(report.read_text())["backends"] if b["name"] == "ort-cpu")["audit"]
        assert audit["finding"] is None and audit["nodes_checked"] > 20
        assert f"node audit ort-cpu ({audit['nodes_checked']} nodes): every node within" in result.output
    # The node audit re-evaluates each node on onnx.reference: with a MatMulNBits there that does not round,
    # the stages still pass (the eager oracle rounds) and the audit names the node.
    with monkeypatch.context() as patch:
        patch.setattr("runners.contrib_ops.rounds_activations", lambda *args: False)
        result = invoke("check", tmp_path / "mixed", "--backends", "ort-cpu")
    assert result.exit_code == 1, result.output
    assert "ort-cpu          FAIL (first divergence: node audit)" in result.output
    assert "MatMulNBits" in result.output and "the backend computes it wrongly on its own inputs" in result.output
    # Without the rounding in the oracle either, the stages diverge.
    monkeypatch.setattr("runners.eager.rounds_activations", lambda *args: False)
    monkeypatch.setattr("runners.contrib_ops.rounds_activations", lambda *args: False)
    result = invoke("check", tmp_path / "mixed", "--backends", "ort-cpu", "--decode-steps", 3)
    assert result.exit_code == 1, result.output
    assert "ort-cpu          FAIL (first divergence: logits)" in result.output


def test_check_refuses_a_gpu_backend_on_int8_activations_without_explicit_tolerances(source, tmp_path, monkeypatch):
    from toolkit.check import crosscheck

    target = tmp_path / "acc4"
    result = invoke("quantize", source.directory, "--bits", 4, "--out", target, "--greedy-tokens", 2)
    assert result.exit_code == 0, result.output
    artifact = open_artifact(target)
    monkeypatch.setattr(crosscheck, "check_backend", lambda *args: None)  # no GPU here; the refusal comes first
    with pytest.raises(ConfigError, match=r"quantized at --accuracy-level 4; .* which ort-cuda is not held to"):
        crosscheck.refuse_uncheckable(artifact, ("ort-cpu", "ort-cuda"), None, 0)
    crosscheck.refuse_uncheckable(artifact, ("ort-cpu", "eager", "onnx-reference"), None, 0)
    loose = tmp_path / "loose.toml"
    loose.write_text("[float32]\natol = 1.0\nrtol = 1.0\n")
    crosscheck.refuse_uncheckable(artifact, ("ort-cuda",), load_tolerances(loose), 0)


# --------------------------------------------------------------------------- quality math, held to numpy


def numpy_agreement(float_logits: np.ndarray, quant_logits: np.ndarray) -> float:
    """Independent: the fraction of rows whose arg-max (first maximum) is the same."""
    same = [
        max(range(len(f)), key=lambda j: (f[j], -j)) == max(range(len(q)), key=lambda j: (q[j], -j))
        for f, q in zip(float_logits.tolist(), quant_logits.tolist(), strict=True)
    ]
    return sum(same) / len(same)


def numpy_log_z(row: list[float]) -> float:
    """Independent: log sum exp of one row of logits, via math.fsum."""
    import math

    top = max(row)
    return top + math.log(math.fsum(math.exp(v - top) for v in row))


def numpy_perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """Independent: exp of the mean next-token negative log-likelihood, via math.fsum and log-sum-exp."""
    import math

    nll = []
    for t in range(len(ids) - 1):
        row = [float(v) for v in logits[t]]
        nll.append(numpy_log_z(row) - row[ids[t + 1]])
    return math.exp(math.fsum(nll) / len(nll))


def numpy_kl(float_logits: np.ndarray, other_logits: np.ndarray) -> float:
    """Independent: the mean over rows but the last (those that predict a token) of KL(p || q), written from the
    logits f, o and their log-normalisers as E_p[f - o] - log Z_f + log Z_o, via math.fsum."""
    import math

    kls = []
    for f, o in zip(float_logits[:-1].tolist(), other_logits[:-1].tolist(), strict=True):
        log_z_f, log_z_o = numpy_log_z(f), numpy_log_z(o)
        expected = math.fsum(math.exp(a - log_z_f) * (a - b) for a, b in zip(f, o, strict=True))
        kls.append(expected - log_z_f + log_z_o)
    return math.fsum(kls) / len(kls)


def flipped_fixture():
    """Float logits [6, 5] with arg-maxes 0..4,0; the quantized copy has arg-max flips hand-placed at rows 1 and 4
    (a near-tie pushed over, and a clear swap), so 4 of 6 agree."""
    float_logits = np.full((6, 5), -1.0)
    for row, top in enumerate([0, 1, 2, 3, 4, 0]):
        float_logits[row, top] = 2.0
    quant = float_logits + 0.01  # a shift of every logit changes no arg-max
    quant[1, 3] = 2.02  # row 1: 1 -> 3 by 0.01 (quant[1, 1] is 2.01)
    quant[4, [4, 2]] = [0.0, 3.0]  # row 4: 4 -> 2
    quant[2, 0] = 2.0  # row 2: a rise that stays below the top (2.01): no flip
    return float_logits, quant


def test_greedy_agreement_on_hand_placed_flips():
    from toolkit.quantize.pipeline import greedy_agreement_counts

    float_logits, quant = flipped_fixture()
    assert greedy_agreement_counts(float_logits, quant) == (4, 6)
    assert numpy_agreement(float_logits, quant) == 4 / 6
    assert greedy_agreement_counts(float_logits, float_logits) == (6, 6)
    with pytest.raises(ValueError, match="one shape"):
        greedy_agreement_counts(float_logits, quant[:5])


def test_perplexity_of_hand_computable_logits():
    """V=4, ids 0,1,2,3,0. Row 0: all equal -> p = 1/4. Row 1: target ln 3 above 3 others -> 3/6 = 1/2.
    Row 2: target at ln 6 -> 6/9 = 2/3. Row 3: target 0, another at ln 5 -> 1/8. The last row is unused.
    ppl = (4 * 2 * 3/2 * 8) ** (1/4) = 96 ** 0.25; a 1000 offset on every logit changes nothing."""
    import math

    from toolkit.quantize.pipeline import perplexity

    ids = [0, 1, 2, 3, 0]
    logits = np.zeros((5, 4))
    logits[1, 2] = math.log(3)
    logits[2, 3] = math.log(6)
    logits[3, 1] = math.log(5)
    logits[4] = [50.0, -50.0, 0.0, 7.0]  # never read
    want = 96**0.25
    assert numpy_perplexity(logits, ids) == pytest.approx(want, rel=1e-14)
    assert perplexity(logits, ids) == pytest.approx(want, rel=1e-12)
    assert perplexity((logits + 1000).astype(np.float32), ids) == pytest.approx(want, rel=1e-5)
    assert perplexity(np.zeros((3, 7)), [1, 2, 3]) == pytest.approx(7.0, rel=1e-14)  # uniform -> V
    with pytest.raises(ValueError, match="T >= 2"):
        perplexity(logits[:3], ids)


def test_kl_divergences_by_hand():
    """p = (1/2, 1/2, 0) against q = (1/4, 1/4, 1/2): 2 * 1/2 * ln 2 = ln 2, the token p never gives (log p =
    -inf) adding 0; p against itself is 0; a certain p against a uniform q over 4 is ln 4; q giving no probability
    where p gives some is infinitely far."""
    import math

    from toolkit.quantize.pipeline import kl_divergences, log_softmax

    with np.errstate(divide="ignore"):
        p = np.log([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
        q = np.log([[0.25, 0.25, 0.5], [0.2, 0.3, 0.5], [0.0, 0.5, 0.5]])
        got = kl_divergences(p, q)
    assert got[:2] == pytest.approx([math.log(2), 0.0], abs=1e-15)
    assert got[2] == math.inf
    uniform = log_softmax(np.zeros((1, 4)))
    certain = log_softmax(np.array([[0.0, -np.inf, -np.inf, -np.inf]]))
    assert kl_divergences(certain, uniform) == pytest.approx([math.log(4)], abs=1e-15)


def independent_quality(float_artifact, other_artifact) -> dict:
    """Greedy agreement and both perplexities recomputed from the two models' logits on ONNX Runtime CPU (the
    runners and inputs of the report): the float model's greedy continuation of each prompt, teacher-forced
    into both, compared at the rows that predicted the continuation; perplexity on the fixed text."""
    from toolkit.quantize.pipeline import GREEDY_TOKENS, _fixed_inputs

    config = artifact_config(float_artifact)
    prompts, text_ids, _ = _fixed_inputs(float_artifact, config)
    runners = {"float": create_runner("ort-cpu", float_artifact), "other": create_runner("ort-cpu", other_artifact)}

    def logits(name, ids):  # [T, V], one call on an empty cache
        return CachedLM(runners[name], config.max_positions).step(np.asarray([ids], dtype=np.int64))[0]

    agreed, positions = 0.0, 0
    for prompt in prompts:
        sequence = list(prompt)
        for _ in range(GREEDY_TOKENS):
            sequence.append(int(np.argmax(logits("float", sequence)[-1])))
        fed = sequence[:-1]
        rows = slice(len(prompt) - 1, len(fed))
        f, q = logits("float", fed)[rows], logits("other", fed)[rows]
        agreed += numpy_agreement(f, q) * len(f)
        positions += len(f)
    text = text_ids[: config.max_positions]
    float_text, other_text = logits("float", text), logits("other", text)
    return {
        "greedy_agreement": agreed / positions,
        "greedy_positions": positions,
        "perplexity_float": numpy_perplexity(float_text, text),
        "perplexity_quantized": numpy_perplexity(other_text, text),
        "kl_from_float": numpy_kl(float_text, other_text),
    }


def assert_quality_matches(reported: dict, independent: dict) -> None:
    assert reported["greedy_positions"] == independent["greedy_positions"] == len(PROMPTS) * GREEDY_TOKENS
    assert reported["greedy_agreement"] == pytest.approx(independent["greedy_agreement"], abs=1e-12)
    for key in ("perplexity_float", "perplexity_quantized"):
        assert reported[key] == pytest.approx(independent[key], rel=1e-9), key
    # The float model's log-probabilities wait for the quantized model's as float16, which moves each by up to
    # 2**-11 of itself: the KL is held to a percent (int4 of the test model: 1.2e-8 nats, 0.5 % apart), not to
    # float64's last bits.
    assert independent["kl_from_float"] > 0
    assert reported["kl_from_float"] == pytest.approx(independent["kl_from_float"], rel=1e-2)


def test_reported_quality_of_a_quantized_artifact_equals_an_independent_computation(source, quantized):
    """int4 of the test model: the manifest's numbers equal the independent ones over the same logits."""
    for key in (4, "hqq"):
        artifact, _ = quantized[key]
        assert_quality_matches(artifact.manifest.quantization["quality"], independent_quality(source, artifact))


def test_quality_of_a_different_model_flips_arg_maxes_and_perplexity(source, tmp_path):
    """int4 here keeps every greedy arg-max (agreement 1.0), so a report stuck at 100% and at the float
    perplexity would pass the test above: evaluate_quality against another model (same shapes, other seed,
    untied head) must measure flips and a different perplexity, equal to the independent computation."""
    # untied: with a tied head a random model's arg-max is mostly the current token, for any seed
    config = get_family("llama").config_from_dict({**CONFIG, "tie_embeddings": False})
    export_model(build_model("llama", config, seed=1), "llama", config, tmp_path / "other", variant="serving")
    other = open_artifact(tmp_path / "other")
    reported = evaluate_quality(source, other)
    independent = independent_quality(source, other)
    assert_quality_matches(reported, independent)
    assert independent["greedy_agreement"] < 0.9  # measured: 0.0
    assert independent["kl_from_float"] > 0.1  # measured: 5.2
    # far from float, float16's rounding of the stored side is lost in the distance: 1e-10 apart
    assert reported["kl_from_float"] == pytest.approx(independent["kl_from_float"], rel=1e-6)
    assert abs(independent["perplexity_quantized"] / independent["perplexity_float"] - 1) > 0.01


@pytest.mark.parametrize("bits", [4, 8])
def test_a_tied_head_large_enough_not_to_be_folded_at_export_checks_against_its_reference(tmp_path, bits):
    """A tied head above torch.onnx's constant-folding size (64 x 4096) reaches quantize as Transpose(embedding):
    the quantizer folds it into its own initializer and quantizes that, while the Gather keeps the float table.
    The eager reference must embed with the float table and multiply by the quantized head, as the graph does."""
    config = {"vocab_size": 4096, "layers": 1, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 128}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"family": "llama", "seed": 0, "config": {**config, "tie_embeddings": True}}))
    result = invoke("export", "--config", path, "--variant", "serving", "--out", tmp_path / "float")
    assert result.exit_code == 0, result.output
    # Level 0 (float32 activations): check holds the graph to the dequantized weights without tolerances.
    q = ("--bits", bits, "--accuracy-level", 0, "--out", tmp_path / "q", "--greedy-tokens", 2)
    result = invoke("quantize", tmp_path / "float", *q)
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "q" / "manifest.json").read_text())
    weights = manifest["graphs"][0]["weights"]
    assert "quantized" not in weights["embed_tokens.weight"] and "quantized" in weights["lm_head.weight"]
    check = invoke("check", tmp_path / "q", "--backends", "eager,ort-cpu")
    assert check.exit_code == 0 and "RESULT: PASS" in check.output, check.output
