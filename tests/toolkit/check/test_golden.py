"""Golden outputs: saved atomically, verified on load, and catching a change every backend agrees with."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper

import artifact.write as artifact_write
from artifact import MANIFEST_FILE, MODEL_FILE, sha256_file
from models.artifacts import open_artifact
from toolkit.check.crosscheck import cross_check
from toolkit.check.golden import GoldenError, check_inputs_fit, load_golden, save_golden
from toolkit.cli import main


@pytest.fixture(scope="module")
def saved(exported, tmp_path_factory):
    artifact = exported("block-small")
    directory = tmp_path_factory.mktemp("golden") / "g"
    result = CliRunner().invoke(main, ["check", str(artifact.directory), "--save-golden", str(directory)])
    assert result.exit_code == 0, result.output
    return artifact, directory


def test_index_records_hashes_shapes_and_versions(saved):
    artifact, directory = saved
    index = json.loads((directory / "golden.json").read_text())
    assert set(index["versions"]) >= {"torch", "onnx", "onnxruntime", "onnxscript", "toolkit"}
    assert index["artifact"]["preset"] == "block-small"
    assert index["artifact"]["graph_sha256"] == {"model": sha256_file(artifact.model_path)}
    with np.load(directory / "reference.npz") as data:
        logits = data["logits"]
    entry = index["groups"]["reference"]["arrays"]["logits"]
    assert entry["dtype"] == "float64" and entry["shape"] == list(logits.shape)
    # An independent hash of the stored bytes.
    import hashlib

    assert entry["sha256"] == hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest()
    assert index["stages"] == list(artifact.output_names)


def test_same_artifact_matches_its_golden(saved):
    artifact, directory = saved
    result = CliRunner().invoke(main, ["check", str(artifact.directory), "--golden", str(directory)])
    assert result.exit_code == 0, result.output
    assert "golden eager-f64        matches golden" in result.output
    assert "graphs unchanged" in result.output


def test_a_change_every_backend_agrees_with_is_caught(saved, tmp_path):
    # Scale the probe (the read-out weights) by 1.01 in the ONNX file: the oracle is rebuilt from the file,
    # so today's oracle and every backend agree with each other; only the golden outputs can see it.
    artifact, directory = saved
    out = tmp_path / "changed"
    shutil.copytree(artifact.directory, out)
    model = onnx.load(out / MODEL_FILE)
    probe = next(i for i in model.graph.initializer if i.name == artifact.graph().weights["probe"].initializer)
    probe.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(probe) * np.float32(1.01), probe.name))
    onnx.save(model, out / MODEL_FILE)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    manifest["graphs"][0]["sha256"] = sha256_file(out / MODEL_FILE)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest))

    result = CliRunner().invoke(
        main, ["check", str(out), "--golden", str(directory), "--junit", str(tmp_path / "j.xml")]
    )
    assert result.exit_code == 1, result.output
    assert "ort-cpu          PASS" in result.output  # today's backends agree with today's oracle
    assert "golden eager-f64        DRIFTED from golden at stage logits" in result.output
    assert "golden ort-cpu          DRIFTED from golden at stage logits" in result.output
    assert "graphs CHANGED: model" in result.output
    assert 'classname="golden.ort-cpu" name="logits"' in (tmp_path / "j.xml").read_text()


def _copy(directory, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    return copy


def test_missing_directory_is_one_clear_line(tmp_path):
    with pytest.raises(GoldenError, match=r"no such directory; create it with `toolkit check --save-golden"):
        load_golden(tmp_path / "nowhere")


def test_corrupt_index(saved, tmp_path):
    copy = _copy(saved[1], tmp_path)
    (copy / "golden.json").write_text("{not json")
    with pytest.raises(GoldenError, match=r"golden.json: invalid JSON"):
        load_golden(copy)


def test_modified_array_file_fails_its_hash(saved, tmp_path):
    copy = _copy(saved[1], tmp_path)
    with np.load(copy / "reference.npz") as data:
        arrays = {k: data[k] for k in data.files}
    arrays["logits"] = arrays["logits"] + 1.0
    np.savez(copy / "reference.npz", **arrays)
    with pytest.raises(GoldenError, match=r"reference.npz: sha256 .* does not match the index"):
        load_golden(copy)


def test_missing_array_file(saved, tmp_path):
    copy = _copy(saved[1], tmp_path)
    (copy / "inputs.npz").unlink()
    with pytest.raises(GoldenError, match=r"inputs.npz: missing"):
        load_golden(copy)


def test_golden_of_another_model_is_refused(saved, exported):
    other = exported("worked-example")  # hidden_states width 4, the golden's is 12
    with pytest.raises(GoldenError, match=r"its inputs do not fit .*hidden_states"):
        check_inputs_fit(load_golden(saved[1]), other)
    result = CliRunner().invoke(main, ["check", str(other.directory), "--golden", str(saved[1])])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "Error:" in result.output


def test_golden_with_inputs_options_is_a_usage_error(saved):
    artifact, directory = saved
    result = CliRunner().invoke(main, ["check", str(artifact.directory), "--golden", str(directory), "--batch", "3"])
    assert result.exit_code == 2 and "stored inputs" in result.output


def test_interrupted_save_leaves_the_previous_golden_intact(saved, tmp_path, monkeypatch):
    artifact, directory = saved
    copy = _copy(directory, tmp_path)
    before = {p.name: p.read_bytes() for p in copy.iterdir()}
    report = cross_check(artifact, ["eager"], batch=1, sequence=2)

    def killed(tmp, target):
        raise KeyboardInterrupt("killed mid-swap")

    monkeypatch.setattr(artifact_write, "swap_in", killed)
    with pytest.raises(KeyboardInterrupt):
        save_golden(report, artifact, copy)
    assert {p.name: p.read_bytes() for p in copy.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["copy"]  # no temporary directory left behind
    load_golden(copy)


def test_failing_check_is_not_saved_as_golden(exported, tmp_path):
    artifact = exported("block-small")
    report = cross_check(artifact, ["eager"], batch=1, sequence=2)
    report.backends[0].comparison.outputs[0].passed = False
    with pytest.raises(GoldenError, match="the check failed"):
        save_golden(report, artifact, tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_non_golden_directory_is_not_replaced(exported, tmp_path):
    artifact = exported("block-small")
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "notes.txt").write_text("mine")
    report = cross_check(artifact, ["eager"], batch=1, sequence=2)
    with pytest.raises(GoldenError, match="holds no golden.json; refusing"):
        save_golden(report, artifact, tmp_path / "g")
    assert (tmp_path / "g" / "notes.txt").read_text() == "mine"


def test_saved_golden_reloads_with_the_same_arrays(exported, tmp_path):
    artifact = exported("block-small")
    report = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=2)
    save_golden(report, artifact, tmp_path / "g")
    loaded = load_golden(tmp_path / "g")
    assert set(loaded.backends) == {"eager", "ort-cpu"}
    np.testing.assert_array_equal(loaded.inputs["hidden_states"], report.arrays["inputs"]["hidden_states"])
    assert loaded.reference["logits"].dtype == np.float64
    assert open_artifact(artifact.directory)  # untouched
