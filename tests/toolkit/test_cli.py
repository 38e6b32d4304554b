"""The `toolkit` CLI through click's CliRunner: verdicts, reports, round trips and one-line errors."""

from __future__ import annotations

import hashlib
import json
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from click.testing import CliRunner
from onnx import numpy_helper

from artifact import MANIFEST_FILE, MODEL_FILE
from models.worked_example import build_worked_example, worked_example_inputs
from toolkit.cli import main

CUDA_AVAILABLE = "CUDAExecutionProvider" in onnxruntime.get_available_providers()
PRE_NORM = [
    "attention_norm",
    "attention_weights",
    "attention_branch",
    "after_attention",
    "feed_forward_norm",
    "feed_forward_branch",
    "output",
]
BLOCK_STAGES = [f"block.0.{s}" for s in PRE_NORM] + ["logits"]
DEFAULT_BACKENDS = ["eager", "ort-cpu", "onnx-reference"]


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, *fragments):
    """Exit 2, exactly one 'Error: ...' line on stderr naming `fragments`, and no traceback."""
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def worked_dir(tmp_path_factory):
    """`toolkit export --preset worked-example --out D`, once for this module."""
    out = tmp_path_factory.mktemp("cli") / "worked"
    result = invoke("export", "--preset", "worked-example", "--out", out)
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def block_dir(exported) -> Path:
    return exported("block-small").directory


# --------------------------------------------------------------------------- check


def test_check_without_arguments_checks_the_worked_example():
    result = invoke("check")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for stage in BLOCK_STAGES:
        (row,) = [line for line in lines if line.startswith(stage + " ")]  # one table row per stage
        assert row.count(" ok") == len(DEFAULT_BACKENDS) and "FAIL" not in row, row
    for backend in DEFAULT_BACKENDS:
        assert any(line.startswith(backend) and "PASS" in line for line in lines), backend
    assert "RESULT: PASS" in result.stdout


def test_check_writes_json_and_junit_reports(block_dir, tmp_path):
    json_file, junit_file = tmp_path / "reports" / "check.json", tmp_path / "check.xml"
    result = invoke("check", block_dir, "--json", json_file, "--junit", junit_file, "--batch", 2, "--seq-len", 6)
    assert result.exit_code == 0, result.output
    assert "RESULT: PASS" in result.stdout
    report = json.loads(json_file.read_text())
    assert {"passed", "backends", "results", "first_divergence"} <= set(report)
    assert report["passed"] is True and report["first_divergence"] is None
    assert [b["name"] for b in report["backends"]] == DEFAULT_BACKENDS
    assert len(report["results"]) == len(DEFAULT_BACKENDS) * len(BLOCK_STAGES)
    first = report["results"][0]
    assert {"backend", "stage", "shape", "max_abs", "max_rel", "passed"} <= set(first)
    assert first["backend"] == "eager" and first["stage"] == BLOCK_STAGES[0] and first["shape"] == [2, 6, 12]
    assert all(r["passed"] is True and isinstance(r["max_abs"], float) for r in report["results"])
    assert [r["stage"] for r in report["results"] if r["backend"] == "ort-cpu"] == BLOCK_STAGES

    root = ET.parse(junit_file).getroot()
    cases = root.findall(".//testcase")
    assert len(cases) == len(DEFAULT_BACKENDS) * len(BLOCK_STAGES)
    pairs = {(c.get("classname"), c.get("name")) for c in cases}
    assert pairs == {(f"check.{b}", s) for b in DEFAULT_BACKENDS for s in BLOCK_STAGES}
    assert root.findall(".//failure") == []
    suite = root.find("testsuite")
    assert suite.get("tests") == str(len(cases)) and suite.get("failures") == "0"


def corrupt_weight(source: Path, target: Path, weight: str) -> None:
    """Copy an artifact; make the graph (not the manifest mapping) use a perturbed copy of `weight`."""
    shutil.copytree(source, target)
    manifest = json.loads((target / MANIFEST_FILE).read_text())
    entry = manifest["graphs"][0] if "graphs" in manifest else manifest
    model_path = target / entry.get("file", MODEL_FILE)
    original = entry["weights"][weight]["initializer"]
    proto = onnx.load(str(model_path))
    array = numpy_helper.to_array(next(i for i in proto.graph.initializer if i.name == original))
    proto.graph.initializer.append(numpy_helper.from_array((2 * array + 0.5).astype(array.dtype), name="corrupted"))
    for node in proto.graph.node:
        for k, name in enumerate(node.input):
            if name == original:
                node.input[k] = "corrupted"
    data = proto.SerializeToString()
    model_path.write_bytes(data)
    entry["sha256" if "graphs" in manifest else "model_sha256"] = hashlib.sha256(data).hexdigest()
    (target / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_diverging_artifact_fails_the_check_with_exit_1(block_dir, tmp_path):
    bad = tmp_path / "bad"
    corrupt_weight(block_dir, bad, "block.0.attention.k_proj.weight")
    json_file, junit_file = tmp_path / "r.json", tmp_path / "r.xml"
    result = invoke("check", bad, "--json", json_file, "--junit", junit_file)
    assert result.exit_code == 1, result.output
    assert "RESULT: FAIL" in result.stdout and "block.0.attention_weights" in result.stdout
    report = json.loads(json_file.read_text())
    assert report["passed"] is False
    assert report["first_divergence"]["stage"] == "block.0.attention_weights"
    json.dumps(report, allow_nan=False)  # strict JSON even with failures
    root = ET.parse(junit_file).getroot()
    failed = [c for c in root.findall(".//testcase") if c.find("failure") is not None]
    assert failed and root.find("testsuite").get("failures") == str(len(failed))
    assert {c.get("classname") for c in failed} == {"check.ort-cpu", "check.onnx-reference"}
    assert "block.0.attention_weights" in {c.get("name") for c in failed}
    assert "block.0.attention_norm" not in {c.get("name") for c in failed}  # upstream of the corrupted weight


def test_check_subset_of_backends(block_dir):
    result = invoke("check", block_dir, "--backends", "ort-cpu")
    assert result.exit_code == 0, result.output
    assert "onnx-reference" not in result.stdout and "ort-cpu" in result.stdout


# --------------------------------------------------------------------------- export / inspect / run


def test_export_then_inspect_shows_functions_and_parameters(worked_dir):
    assert sorted(p.name for p in worked_dir.iterdir()) == [MANIFEST_FILE, MODEL_FILE]
    result = invoke("inspect", worked_dir)
    assert result.exit_code == 0, result.output
    assert "custom functions" in result.stdout
    assert "onnx_toolkit::RMSNorm" in result.stdout and "onnx_toolkit::SwiGLU" in result.stdout
    # d = 4, d_ff = 4: two gains 2*4 + Q, K, V, O 4*16 + gate, up, down 3*16 = 120 (the probe is a fixed buffer)
    assert "parameters: 120" in result.stdout
    as_json = json.loads(invoke("inspect", worked_dir, "--format", "json").stdout)
    functions = (
        as_json["functions"] if "functions" in as_json else [f for g in as_json["graphs"] for f in g["functions"]]
    )
    assert sorted(f["name"] for f in functions) == ["onnx_toolkit::RMSNorm", "onnx_toolkit::SwiGLU"]
    assert as_json["parameters"]["total"] == 120


def test_run_saves_every_output(worked_dir, tmp_path):
    out = tmp_path / "out.npz"
    result = invoke("run", worked_dir, "--backend", "ort-cpu", "--save", out)
    assert result.exit_code == 0, result.output
    assert "CPUExecutionProvider" in result.stdout
    with np.load(out) as data:
        saved = {k: data[k] for k in data.files}
    assert sorted(saved) == sorted(BLOCK_STAGES)
    # The worked example by hand (identity weights, unit gains, eps = 0, rows 2*e_i):
    # token 0 sees only itself: attention_norm = (2,0,0,0), branch = v0 = (2,0,0,0), h = (4,0,0,0),
    # feed_forward_norm = (2,0,0,0), branch = silu(2) * 2 = 4*sigmoid(2) on axis 0,
    # output = 4 + 4*sigmoid(2) on axis 0, logits = output @ P = c * (1, 0, -1).
    c = 4.0 + 4.0 / (1.0 + np.exp(-2.0))
    np.testing.assert_allclose(saved["block.0.attention_norm"][0], 2.0 * np.eye(4)[:3], atol=1e-6)
    np.testing.assert_allclose(saved["block.0.attention_weights"][0, :, 0], [[1, 0, 0], [1, 0, 0]], atol=1e-6)
    np.testing.assert_allclose(saved["block.0.output"][0, 0], [c, 0, 0, 0], atol=1e-5)
    np.testing.assert_allclose(saved["logits"][0, 0], [c, 0, -c], atol=1e-5)


def test_run_with_inputs_round_trips(worked_dir, tmp_path):
    x = np.random.default_rng(5).standard_normal((2, 5, 4)).astype(np.float32)
    inputs, out = tmp_path / "in.npz", tmp_path / "out.npz"
    np.savez(inputs, hidden_states=x)
    result = invoke("run", worked_dir, "--backend", "onnx-reference", "--inputs", inputs, "--save", out)
    assert result.exit_code == 0, result.output
    with torch.no_grad():
        want = build_worked_example().double()(torch.from_numpy(x).double())
    with np.load(out) as data:
        assert sorted(data.files) == sorted(BLOCK_STAGES)
        for name in BLOCK_STAGES:
            assert data[name].shape == tuple(want[name].shape), name
            np.testing.assert_allclose(data[name], want[name].numpy(), atol=1e-5, err_msg=name)


def test_run_eager_default_inputs_are_the_preset_inputs(worked_dir, tmp_path):
    out = tmp_path / "e.npz"
    assert invoke("run", worked_dir, "--backend", "eager", "--save", out).exit_code == 0
    with np.load(out) as data:
        assert data["logits"].shape == worked_example_inputs()["hidden_states"].shape[:2] + (3,)


def test_trace_exits_zero():
    result = invoke("trace")
    assert result.exit_code == 0, result.output
    assert "causality" in result.stdout


def test_presets_json_parses():
    result = invoke("presets", "--format", "json")
    assert result.exit_code == 0, result.output
    rows = {row["name"]: row for row in json.loads(result.stdout)}
    assert {"worked-example", "block-small", "decoder-small"} <= set(rows)
    assert rows["worked-example"]["family"] == "block" and rows["worked-example"]["parameters"] == 120
    # block-small: d=12, d_ff=32 -> 2*12 + 4*144 + 3*12*32 = 1,752
    assert rows["block-small"]["parameters"] == 1752


def test_version_option():
    result = invoke("--version")
    assert result.exit_code == 0 and "toolkit" in result.stdout


# --------------------------------------------------------------------------- user errors: exit 2, one line


def test_unknown_preset(tmp_path):
    result = invoke("export", "--preset", "gpt-17", "--out", tmp_path / "o")
    assert_user_error(result, "gpt-17", "worked-example")
    assert not (tmp_path / "o").exists()


def test_unknown_backend_in_check():
    assert_user_error(invoke("check", "--backends", "eager,tensorrt"), "tensorrt", "ort-cpu")


def test_unknown_backend_in_run(block_dir):
    assert_user_error(invoke("run", block_dir, "--backend", "tvm"), "tvm")


@pytest.mark.skipif(CUDA_AVAILABLE, reason="CUDAExecutionProvider is available here, so ort-cuda is not unavailable")
@pytest.mark.parametrize("command", ["check", "run"])
def test_unavailable_backend(command, block_dir):
    args = (
        ["check", block_dir, "--backends", "ort-cuda"]
        if command == "check"
        else ["run", block_dir, "--backend", "ort-cuda"]
    )
    assert_user_error(invoke(*args), "ort-cuda", "not available", "ort-cpu")


@pytest.mark.parametrize("command", ["check", "run", "inspect"])
def test_missing_artifact_directory(command, tmp_path):
    missing = tmp_path / "nowhere"
    args = [command, missing] + (["--backend", "ort-cpu"] if command == "run" else [])
    assert_user_error(invoke(*args), str(missing))


def test_corrupt_artifact_is_a_user_error(block_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(block_dir, bad)
    (bad / MODEL_FILE).write_bytes(b"garbage")
    assert_user_error(invoke("inspect", bad), "sha256")


@pytest.mark.parametrize(
    "text,fragments",
    [
        ('{"family": "llama", "config": {', ["invalid JSON", "line"]),
        ('{"family": "llama", "config": {"widht": 16}}', ["widht"]),
        ('{"family": "llama", "config": {"width": 16, "heads": 3}}', ["heads"]),
        ('{"family": "llama", "config": {"vocab_size": -4}}', ["vocab_size", "-4"]),
        ('{"family": "llama", "config": {"tie_embeddings": "yes"}}', ["tie_embeddings"]),
        ('{"family": "transformer-xl", "config": {}}', ["transformer-xl"]),
        ('{"family": "llama", "config": {}, "sede": 3}', ["sede"]),
    ],
)
def test_invalid_config_file(tmp_path, text, fragments):
    config = tmp_path / "model.json"
    config.write_text(text)
    result = invoke("export", "--config", config, "--out", tmp_path / "out")
    assert_user_error(result, *fragments)
    assert not (tmp_path / "out").exists()


def test_config_file_with_non_string_family(tmp_path):
    config = tmp_path / "model.json"
    config.write_text('{"family": ["llama"], "config": {}}')
    assert_user_error(invoke("export", "--config", config, "--out", tmp_path / "out"), "family")


def test_inputs_with_wrong_dtype(block_dir, tmp_path):
    inputs = tmp_path / "in.npz"
    np.savez(inputs, hidden_states=np.zeros((1, 3, 12), np.float64))
    assert_user_error(
        invoke("run", block_dir, "--backend", "ort-cpu", "--inputs", inputs), "hidden_states", "float32", "float64"
    )


def test_inputs_file_that_is_not_npz(block_dir, tmp_path):
    inputs = tmp_path / "in.npz"
    inputs.write_text("hidden_states = [1, 2, 3]")
    assert_user_error(invoke("run", block_dir, "--backend", "ort-cpu", "--inputs", inputs), "in.npz")


def test_check_with_both_artifact_and_preset(block_dir):
    assert_user_error(invoke("check", block_dir, "--preset", "block-small"), "either")


def test_check_with_non_positive_batch(block_dir):
    assert_user_error(invoke("check", block_dir, "--batch", 0), "batch")


def test_a_reader_that_goes_away_ends_the_command_quietly_with_the_sigpipe_status():
    """`toolkit ... | head`: once the pipe's reader has gone, a write raises BrokenPipeError. That is neither a
    verdict nor a toolkit bug: no "internal error" line, status 141 (128 + SIGPIPE), as a shell reports it."""
    import subprocess
    import sys

    code = (
        "import click, sys\n"
        "from toolkit.cli import main\n"
        "@main.command('flood')\n"
        "def flood():\n"
        "    for _ in range(100_000):\n"
        "        click.echo('x' * 100)\n"
        "sys.argv = ['toolkit', 'flood']\n"
        "main()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=Path(__file__).parents[2]
    )
    child.stdout.read(1000)  # the reader takes a little, then leaves
    child.stdout.close()
    stderr = child.stderr.read().decode()
    assert child.wait(timeout=60) == 141, stderr
    assert "internal error" not in stderr and "Traceback" not in stderr, stderr
