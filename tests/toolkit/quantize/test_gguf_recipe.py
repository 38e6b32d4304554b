"""`toolkit quantize --recipe gguf`: a GGUF import's MatMul weights taken from the file's blocks as they are.

Tiny GGUF files (Q4_0, Q8_0, Q4_1; widths multiples of 32) are written with gguf.GGUFWriter by the
checkpoint tests' helpers, exported with `toolkit export --from` and quantized through the CLI. The oracles
are independent of exporters/gguf_blocks.py: gguf.GGUFReader and gguf.quants.dequantize read the file, and
test_quantize.mnb_dequantize (written from the com.microsoft MatMulNBits spec) reads the graph.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from models.artifacts import open_artifact
from runners.eager import model_from_artifact
from tests.optional import import_or_skip
from tests.toolkit.quantize.test_quantize import mnb_dequantize, ort_logits, tamper_first_matmulnbits
from tests.toolkit.test_cli import assert_user_error, invoke

gguf = import_or_skip("gguf", "GGUF test files are written with the gguf library")
import_or_skip("transformers", "the tiny GGUF files are written from a random transformers Llama")
from tests.models import test_checkpoints as checkpoints  # noqa: E402
from tests.models.test_checkpoints import gguf_llama, write_gguf  # noqa: E402

pytestmark = pytest.mark.slow
bpe = checkpoints.bpe  # the fixture: a small byte-level BPE vocabulary
Q = gguf.GGMLQuantizationType
# name: (matrix type, tied head, lowering, per-tensor types, quantize arguments)
# Float32 activations (--accuracy-level 0), so that an exact mapping is held to float32 kernel rounding.
CASES = {
    "q4_0": (Q.Q4_0, True, "functions", None, ("--recipe", "gguf", "--bits", 4, "--accuracy-level", 0)),
    # SmolLM2's mix: 4-bit projections, a Q8_0 embedding that is also the head; fused QKV and gate/up columns
    "q4_0-ort": (Q.Q4_0, True, "ort", {"token_embd.weight": Q.Q8_0}, ("--accuracy-level", 0)),
    "q8_0": (Q.Q8_0, False, "functions", None, ("--recipe", "gguf", "--accuracy-level", 0)),
    "q4_1": (Q.Q4_1, True, "functions", None, ("--bits", 4, "--accuracy-level", 0)),
}


def export(gguf_file, out, lowering="functions"):
    result = invoke("export", "--from", gguf_file, "--lowering", lowering, "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def cases(tmp_path_factory, bpe):
    """{name: (gguf file, float artifact, quantized artifact, quantize's stdout)}."""
    root = tmp_path_factory.mktemp("gguf_recipe")
    out = {}
    for seed, (name, (qtype, tie, lowering, types, arguments)) in enumerate(CASES.items()):
        path = root / f"{name}.gguf"
        write_gguf(path, gguf_llama(bpe, tie=tie, seed=seed), bpe, qtype=qtype, types=types)
        source = export(path, root / f"float-{name}", lowering)
        result = invoke("quantize", source, *arguments, "--out", root / f"q-{name}", "--greedy-tokens", 4)
        assert result.exit_code == 0, (result.output, result.exception)
        out[name] = (path, open_artifact(source), open_artifact(root / f"q-{name}"), result.stdout)
    return out


def gguf_matrices(path) -> dict[str, np.ndarray]:
    """{tensor name: values [N, K] float32} of every quantized matrix, read by gguf.GGUFReader and dequantized by
    gguf.quants."""
    out = {}
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.tensor_type in (Q.F32, Q.F16, Q.BF16) or len(tensor.shape) != 2:
            continue
        shape = tuple(int(n) for n in reversed(tensor.shape))
        raw = np.asarray(tensor.data).reshape(-1, gguf.GGML_QUANT_SIZES[tensor.tensor_type][1])
        out[tensor.name] = gguf.quants.dequantize(raw, tensor.tensor_type).reshape(shape)
    return out


def candidates(path) -> dict[str, np.ndarray]:
    """What a MatMul's B [K, N] may hold: each matrix transposed, and each layer's q|k|v and gate|up side by side
    (the `ort` lowering's fused initializers)."""
    matrices = gguf_matrices(path)
    out = {name: values.T for name, values in matrices.items()}
    layers = {name.split(".")[1] for name in matrices if name.startswith("blk.")}
    for layer in layers:
        for fused, parts in (("qkv", ("attn_q", "attn_k", "attn_v")), ("gate_up", ("ffn_gate", "ffn_up"))):
            out[f"blk.{layer}.{fused}"] = np.concatenate([matrices[f"blk.{layer}.{p}.weight"].T for p in parts], axis=1)
    return out


def matrix_role(key: str) -> str:
    """'fused' (a candidate built from a layer's q|k|v or gate|up), 'part' (one of those), 'whole' (any other)."""
    kind = key.split(".")[2] if key.startswith("blk.") else key
    if kind in ("qkv", "gate_up"):
        return "fused"
    return "part" if kind in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up") else "whole"


def nbits_nodes(artifact):
    proto = onnx.load(str(artifact.model_path))
    return proto, [n for n in proto.graph.node if n.op_type == "MatMulNBits"]


def graph_weight(proto, node) -> np.ndarray:
    """[K, N] float64: the MatMulNBits spec oracle's matrix, plus the per-block offsets the graph adds to its
    output where it does (Q4_1's minimum): found by following the wiring (an Add of the node's output and a
    MatMul by a [blocks, N] initializer), not by name."""
    w = mnb_dequantize(proto, node)
    k, n = w.shape
    block = next(a.i for a in node.attribute if a.name == "block_size")
    inits = {i.name: numpy_helper.to_array(i) for i in proto.graph.initializer}
    made = {output: n for n in proto.graph.node for output in n.output}
    offsets = []
    for add in (n for n in proto.graph.node if n.op_type == "Add" and node.output[0] in n.input):
        other = made.get(next(name for name in add.input if name != node.output[0]))
        matrix = None if other is None or other.op_type != "MatMul" else inits.get(other.input[1])
        if matrix is not None and matrix.shape == (k // block, n):
            offsets.append(matrix.astype(np.float64))  # [blocks, N]
    if not offsets:
        return w
    (offsets,) = offsets
    return w + np.repeat(offsets, block, axis=0)


# --------------------------------------------------------------------------- the blocks


@pytest.mark.parametrize("name", list(CASES))
def test_matmulnbits_weights_are_the_gguf_values(cases, name):
    """Every MatMulNBits weight dequantizes (spec oracle) to one GGUF matrix (or fused set) as gguf.quants gives it:
    bit for bit (Q4_1 through the offsets the graph adds); every GGUF matrix is used once."""
    path, _, quantized, _ = cases[name]
    proto, nodes = nbits_nodes(quantized)
    wanted = candidates(path)
    used = []
    for node in nodes:
        w_hat = graph_weight(proto, node).astype(np.float32)
        same = {key: value for key, value in wanted.items() if value.shape == w_hat.shape}
        key = min(same, key=lambda k: np.abs(same[k] - w_hat).max())
        assert np.array_equal(w_hat, same[key]), (node.name, key)
        used.append(key)
    expected = {key for key in wanted if matrix_role(key) in ("whole", "fused" if CASES[name][2] == "ort" else "part")}
    expected -= {"token_embd.weight"} if not CASES[name][1] else set()  # untied: the embedding is only gathered
    assert sorted(used) == sorted(expected)
    bits = {a.i for n in nodes for a in n.attribute if a.name == "bits"}
    assert bits == {"q4_0": {4}, "q4_0-ort": {4, 8}, "q8_0": {8}, "q4_1": {4}}[name]


@pytest.mark.parametrize("name", list(CASES))
def test_the_eager_reference_is_the_float_artifact(cases, name):
    """The quantized artifact's eager reference (its dequantized weights) is the float artifact's model, parameter
    for parameter, and the manifest reports every GGUF tensor as taken bit for bit."""
    _, source, quantized, _ = cases[name]
    floats = model_from_artifact(source).state_dict()
    rebuilt = model_from_artifact(quantized).state_dict()
    assert floats.keys() == rebuilt.keys()
    assert [key for key in floats if not torch.equal(floats[key], rebuilt[key])] == []
    report = quantized.manifest.quantization
    assert (report["recipe"], report["algorithm"]) == ("gguf", "gguf")
    assert report["gguf"]["path"] == str(cases[name][0].resolve())
    tensors = report["gguf"]["tensors"]
    for tensor in tensors.values():
        assert tensor["exact"] and tensor["identical"] and tensor["max_steps"] == 0, tensor
        assert tensor["offsets"] == (tensor["type"] == "Q4_1")


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_quality_against_the_float_artifact(cases, name):
    """ONNX Runtime logits of the quantized artifact against the float one: float32 kernel rounding apart (greedy
    agreement 100 %, the same perplexity), Q4_1's offsets included."""
    _, source, quantized, stdout = cases[name]
    want, got = ort_logits(source), ort_logits(quantized)
    error = np.abs(got - want).max() / np.abs(want).max()
    quality = quantized.manifest.quantization["quality"]
    assert error <= 1e-4, error
    assert quality["greedy_agreement"] == 1.0
    assert quality["perplexity_quantized"] == pytest.approx(quality["perplexity_float"], rel=1e-4)
    assert "from the GGUF's blocks as they are" in stdout and "re-rounded" not in stdout
    eight_bit = name in ("q4_0-ort", "q8_0")  # a Q8_0 tensor: no fast float32-activation kernel at level 0
    assert ("no fast float32-activation kernel" in stdout) == eight_bit


@pytest.mark.parametrize("name", ["q4_0-ort", "q4_1"])
def test_check_passes_on_the_quantized_artifact(cases, name):
    result = invoke("check", cases[name][2].directory, "--backends", "eager,ort-cpu", "--decode-steps", 2)
    assert result.exit_code == 0 and "RESULT: PASS" in result.output, result.output


# --------------------------------------------------------------------------- choices and refusals


def test_the_default_takes_the_blocks_where_it_can(cases, tmp_path):
    """Without --recipe a GGUF export takes the gguf recipe (at accuracy level 4 unless asked otherwise) where the
    file's blocks fit --bits, and is re-rounded (rtn, level 0) with a note saying why where they do not; --recipe
    gguf refuses a width the file does not have, and a block size of its own."""
    for name in ("q4_0-ort", "q4_1"):  # quantized without --recipe
        assert cases[name][2].manifest.quantization["recipe"] == "gguf"
    _, source, _, _ = cases["q4_0"]
    result = invoke("quantize", source.directory, "--out", tmp_path / "default", "--greedy-tokens", 2)
    assert result.exit_code == 0, result.output
    made = open_artifact(tmp_path / "default").manifest.quantization
    assert (made["recipe"], made["bits"], made["accuracy_level"]) == ("gguf", 4, 4)
    result = invoke("quantize", source.directory, "--bits", 8, "--out", tmp_path / "q8", "--greedy-tokens", 2)
    assert result.exit_code == 0, result.output
    assert "quantizing the float weights with rtn, since the gguf recipe cannot take this GGUF as it is: --bits 8:" in (
        result.stdout
    )
    made = open_artifact(tmp_path / "q8").manifest.quantization
    assert (made["recipe"], made["bits"], made["accuracy_level"]) == ("rtn", 8, 4) and "gguf" not in made
    assert_user_error(
        invoke("quantize", source.directory, "--recipe", "gguf", "--bits", 8, "--out", tmp_path / "q"),
        "--bits 8:",
        "Q4_0, 4-bit",
    )
    assert_user_error(
        invoke("quantize", source.directory, "--recipe", "gguf", "--block-size", 64, "--out", tmp_path / "q"),
        "--block-size 64 with --recipe gguf",
    )
    assert not (tmp_path / "q").exists()


def test_q4_1_on_the_8_bit_grid_is_within_a_32nd_of_a_step(cases, tmp_path):
    """--q4-1 int8-grid: every Q4_1 matrix becomes an 8-bit MatMulNBits without offsets whose values (spec oracle)
    are within d/32 of gguf.quants' (d each block's own scale, read from the file's bytes) and not all exact; the
    manifest and the command say so; the flag is refused where the gguf recipe does not apply."""
    path, source, _, _ = cases["q4_1"]
    out = tmp_path / "grid"
    result = invoke("quantize", source.directory, "--q4-1", "int8-grid", "--accuracy-level", 0, "--out", out)
    assert result.exit_code == 0, result.output
    assert "not all bit for bit: see each tensor's deviation" in result.stdout and "Q4_1 as int8-grid" in result.stdout
    made = open_artifact(out).manifest.quantization["gguf"]
    assert made["q4_1"] == "int8-grid"
    q4_1 = {name: t for name, t in made["tensors"].items() if t["type"] == "Q4_1"}
    assert q4_1 and all(t["bits"] == 8 and not t["offsets"] and t["max_steps"] <= 1 / 32 for t in q4_1.values())
    proto, nodes = nbits_nodes(open_artifact(out))
    assert not [n for n in proto.graph.node if n.op_type == "Add" and any("_nbits" in i for i in n.input)]
    scales = {}  # tensor name: d [N, blocks], the fp16 at the start of every 20-byte Q4_1 block
    for tensor in gguf.GGUFReader(str(path)).tensors:
        if tensor.tensor_type == Q.Q4_1:
            blocks = np.asarray(tensor.data).reshape(int(tensor.shape[1]), -1, 20)
            scales[tensor.name] = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)
    wanted = {name: values.T for name, values in gguf_matrices(path).items() if name in scales}
    inexact = 0
    for node in nodes:
        w_hat = mnb_dequantize(proto, node)
        same = [key for key, value in wanted.items() if value.shape == w_hat.shape]
        if not same:
            continue
        key = min(same, key=lambda k: np.abs(wanted[k] - w_hat).max())
        step = np.repeat(scales[key].T, 32, axis=0)  # [K, N]: each value's own d
        error = np.abs(w_hat - wanted[key])
        assert (error <= step / 32 * (1 + 1e-6) + 1e-12).all(), (node.name, key, float((error / step).max()))
        inexact += int((error > 0).any())
        del wanted[key]
    assert not wanted and inexact  # every Q4_1 matrix found; the grid is not the file's values bit for bit
    assert_user_error(
        invoke(
            "quantize", source.directory, "--bits", 4, "--recipe", "rtn", "--q4-1", "int8-grid", "--out", tmp_path / "q"
        ),
        "--q4-1 int8-grid applies to --recipe gguf (the default for a GGUF export), not with --recipe rtn",
    )
    config = tmp_path / "config.json"
    small = {"vocab_size": 64, "layers": 1, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 64}
    config.write_text(json.dumps({"family": "llama", "seed": 0, "config": small}))
    assert invoke("export", "--config", config, "--variant", "serving", "--out", tmp_path / "plain").exit_code == 0
    assert_user_error(
        invoke("quantize", tmp_path / "plain", "--bits", 4, "--q4-1", "int8-grid", "--out", tmp_path / "q"),
        "--q4-1 int8-grid applies to the gguf recipe, which cannot take this artifact: it was not exported from a GGUF",
    )
    assert not (tmp_path / "q").exists()


def test_an_explicit_algorithm_re_rounds_a_gguf_artifact(cases, tmp_path):
    _, source, _, _ = cases["q4_0"]
    result = invoke("quantize", source.directory, "--bits", 4, "--algorithm", "rtn", "--out", tmp_path / "q")
    assert result.exit_code == 0 and "(block 32, rtn," in result.stdout and "--recipe gguf" not in result.stdout


def test_rotate_refuses_the_gguf_recipe_whose_blocks_are_the_weights(cases, tmp_path):
    """--rotate turns the float weights: by default (the file's blocks) and named, the gguf recipe is refused with
    one line; a recipe that rounds float weights takes the same export."""
    _, source, _, _ = cases["q4_0"]
    for named in ((), ("--recipe", "gguf")):
        result = invoke("quantize", source.directory, "--bits", 4, *named, "--rotate", 0, "--out", tmp_path / "q")
        assert_user_error(result, "--rotate", "GGUF's blocks", "--recipe gptq")
    assert not (tmp_path / "q").exists() and not list(tmp_path.iterdir())
    result = invoke(
        "quantize", source.directory, "--bits", 4, "--recipe", "rtn", "--rotate", 0, "--out", tmp_path / "q"
    )
    assert result.exit_code == 0, result.output


def test_tune_scales_refuses_the_gguf_recipe_whose_scales_are_the_files(cases, tmp_path):
    """--tune-scales moves each block's scale: the gguf recipe, by default and named, is refused with one line and
    nothing written."""
    _, source, _, _ = cases["q4_0"]
    for named in ((), ("--recipe", "gguf")):
        result = invoke("quantize", source.directory, "--bits", 4, *named, "--tune-scales", 5, "--out", tmp_path / "q")
        assert_user_error(result, "--tune-scales", "no longer be the GGUF's", "--recipe gptq")
    assert not list(tmp_path.iterdir())


def test_a_missing_or_changed_gguf_is_refused(cases, tmp_path):
    path, _, _, _ = cases["q4_0"]
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(path, copy)
    source = export(copy, tmp_path / "float")
    with open(copy, "r+b") as handle:  # one byte of the last tensor changed
        handle.seek(-1, 2)
        last = handle.read(1)
        handle.seek(-1, 2)
        handle.write(bytes([last[0] ^ 1]))
    assert_user_error(invoke("quantize", source, "--recipe", "gguf", "--out", tmp_path / "q"), "differs from")
    copy.unlink()
    assert_user_error(invoke("quantize", source, "--recipe", "gguf", "--out", tmp_path / "q"), "is not there")
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0], ids=["q4_0", "q8_0"])
def test_blocks_that_are_not_the_files_values_bit_for_bit_are_refused(tmp_path, bpe, monkeypatch, qtype):
    """The gguf recipe's blocks are held to the float artifact's weights bit for bit: one stored value moved by a
    single step (bit 0 of its nibble or byte flipped) is refused by name, with exit 2 and one line."""
    path = tmp_path / "model.gguf"
    write_gguf(path, gguf_llama(bpe, seed=5), bpe, qtype=qtype)
    source = export(path, tmp_path / "float")
    tampered = tamper_first_matmulnbits(monkeypatch, "quantize_proto_blocks", 0x01)
    result = invoke("quantize", source, "--recipe", "gguf", "--out", tmp_path / "q")
    bits = 4 if qtype == Q.Q4_0 else 8
    assert len(tampered) == 1 and tampered[0].endswith(f"_Q{bits}")
    assert_user_error(
        result, f"its {bits}-bit MatMulNBits weight {tampered[0]!r} does not dequantize bit for bit to the float weight"
    )
    assert not (tmp_path / "q").exists()


def test_an_unmappable_type_is_refused(tmp_path, bpe):
    path = tmp_path / "q3_k.gguf"
    from tests.models.test_checkpoints import hf_llama
    from tests.models.test_checkpoints_gguf import quantized

    rng = np.random.default_rng(9)
    hf = hf_llama(vocab=len(bpe[1]), width=256, heads=4, kv_heads=2, ff=256, seed=9)
    types = {"blk.0.ffn_down.weight": Q.Q3_K}
    write_gguf(path, hf, bpe, qtype=Q.Q4_K, types=types, quantize=lambda a, k: quantized(a, k, rng))
    source = export(path, tmp_path / "float")
    assert_user_error(
        invoke("quantize", source, "--recipe", "gguf", "--out", tmp_path / "q"),
        "'blk.0.ffn_down.weight' is Q3_K, which MatMulNBits cannot hold as it is",
    )
    assert_user_error(
        invoke("quantize", source, "--out", tmp_path / "q"), "--bits is required (quantizing the float weights"
    )
    result = invoke("quantize", source, "--bits", 4, "--out", tmp_path / "q", "--greedy-tokens", 2)
    assert result.exit_code == 0 and "'blk.0.ffn_down.weight' is Q3_K" in result.stdout, result.output
    made = open_artifact(tmp_path / "q").manifest.quantization
    # Q4_K weights lie on their blocks' grid of float minimums, which only offsets recover: "auto" keeps them.
    assert made["recipe"] == "mixed" and made["zero_points"] == "auto" and made["zero_points_chosen"]["offsets"] > 0


def test_a_non_gguf_artifact_is_refused_by_the_gguf_recipe(tmp_path):
    config = tmp_path / "config.json"
    small = {"vocab_size": 64, "layers": 1, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 64}
    config.write_text(json.dumps({"family": "llama", "seed": 0, "config": small}))
    assert invoke("export", "--config", config, "--variant", "serving", "--out", tmp_path / "float").exit_code == 0
    assert_user_error(
        invoke("quantize", tmp_path / "float", "--recipe", "gguf", "--out", tmp_path / "q"),
        "was not exported from a GGUF file",
    )
    assert_user_error(invoke("quantize", tmp_path / "float", "--out", tmp_path / "q"), "--bits is required")


def test_float_gguf_tensors_stay_float_matmuls(tmp_path, bpe):
    """An F16 head beside Q8_0 projections: the head stays a float MatMul (what llama.cpp computes with it)."""
    path = tmp_path / "mixed.gguf"
    write_gguf(path, gguf_llama(bpe, seed=3), bpe, qtype=Q.Q8_0, types={"output.weight": Q.F16})
    source = export(path, tmp_path / "float")
    result = invoke("quantize", source, "--recipe", "gguf", "--out", tmp_path / "q", "--greedy-tokens", 2)
    assert result.exit_code == 0, result.output
    quantized = open_artifact(tmp_path / "q")
    assert quantized.manifest.quantization["gguf"]["tensors"]["output.weight"] == {
        "type": "F16",
        "kept": "float MatMul",
    }
    proto, nodes = nbits_nodes(quantized)
    assert len(nodes) == 7 * 2 and sum(n.op_type == "MatMul" for n in proto.graph.node) > 0
    assert quantized.manifest.quantization["quality"]["greedy_agreement"] == 1.0


def test_a_k_quant_mix_is_taken_bit_for_bit(tmp_path, bpe):
    """Q4_K_M's mix (Q4_K projections, Q6_K attn_v, ffn_down and head) through the `ort` lowering, whose fused QKV
    puts Q4_K and Q6_K columns in one MatMulNBits weight: every weight is the file's values bit for bit, ONNX
    Runtime's logits are the float artifact's, and `toolkit check` passes with cached decode steps."""
    from tests.models.test_checkpoints import hf_llama
    from tests.models.test_checkpoints_gguf import quantized

    rng = np.random.default_rng(7)
    hf = hf_llama(vocab=len(bpe[1]), width=256, heads=4, kv_heads=2, ff=256, seed=7)
    six = {"output.weight": Q.Q6_K, **{f"blk.{i}.{t}.weight": Q.Q6_K for i in range(2) for t in ("attn_v", "ffn_down")}}
    path = tmp_path / "q4_k_m.gguf"
    write_gguf(path, hf, bpe, qtype=Q.Q4_K, types=six, quantize=lambda a, k: quantized(a, k, rng))
    source = open_artifact(export(path, tmp_path / "float", "ort"))
    result = invoke("quantize", source.directory, "--accuracy-level", 0, "--out", tmp_path / "q", "--greedy-tokens", 4)
    assert result.exit_code == 0, result.output
    quantized_artifact = open_artifact(tmp_path / "q")
    made = quantized_artifact.manifest.quantization
    assert (made["recipe"], made["bits"]) == ("gguf", 4)
    tensors = made["gguf"]["tensors"]
    assert {t["type"] for t in tensors.values()} == {"Q4_K", "Q6_K"}
    assert all(t["exact"] and t["identical"] for t in tensors.values())
    proto, nodes = nbits_nodes(quantized_artifact)
    wanted = candidates(path)
    for node in nodes:
        w_hat = graph_weight(proto, node).astype(np.float32)
        assert any(np.array_equal(w_hat, values) for values in wanted.values() if values.shape == w_hat.shape)
    layouts = {(a.name, a.i) for n in nodes for a in n.attribute if a.name in ("bits", "block_size")}
    assert layouts == {("bits", 4), ("bits", 8), ("block_size", 16), ("block_size", 32)}  # fused QKV: 8-bit, 16
    want, got = ort_logits(source), ort_logits(quantized_artifact)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4
    result = invoke("check", tmp_path / "q", "--backends", "eager,ort-cpu", "--decode-steps", 2)
    assert result.exit_code == 0 and "RESULT: PASS" in result.output, result.output


def test_block_sums_without_known_ranks_take_a_matmul(cases, tmp_path, monkeypatch):
    """Where shape inference does not know an activation's rank, its block sums are a MatMul by a 0/1 matrix
    instead of Reshape + ReduceSum: the same logits."""
    from exporters import quantize

    monkeypatch.setattr(quantize, "_input_ranks", lambda proto: {})
    _, source, _, _ = cases["q4_1"]
    result = invoke("quantize", source.directory, "--accuracy-level", 0, "--out", tmp_path / "q", "--greedy-tokens", 2)
    assert result.exit_code == 0, result.output
    quantized = open_artifact(tmp_path / "q")
    ops = [n.op_type for n in onnx.load(str(quantized.model_path)).graph.node]
    assert "ReduceSum" not in ops and any(name.endswith("_block_ones") for name in _initializer_names(quantized))
    want, got = ort_logits(source), ort_logits(quantized)
    assert np.abs(got - want).max() / np.abs(want).max() <= 1e-4


def _initializer_names(artifact) -> list[str]:
    return [i.name for i in onnx.load(str(artifact.model_path), load_external_data=False).graph.initializer]
