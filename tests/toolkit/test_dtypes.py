"""Every artifact command on every export dtype (float32, float16, bfloat16), through the CLI.

One tiny preset (decoder-small: a language model, so quantize applies) is exported once per dtype;
each command must end with its documented exit status and never with a traceback. Regression: `toolkit
run` on a bfloat16 artifact used to die formatting ml_dtypes' bfloat16 scalars
(`ValueError: Unknown format code 'g' for object of type 'str'`).
"""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from runners.registry import DTYPES
from tests.toolkit.test_cli import assert_user_error, invoke

EXPORT_DTYPES = ("float32", "float16", "bfloat16")
PRESET = "decoder-small"
NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
CPU_BACKENDS = ("eager", "ort-cpu", "onnx-reference")


def backends_for(dtype: str) -> list[str]:
    return [b for b in CPU_BACKENDS if dtype in DTYPES.get(b, EXPORT_DTYPES)]


def assert_clean(result, status: int = 0) -> None:
    assert result.exit_code == status, (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    if status == 0:
        assert result.exception is None, repr(result.exception)


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    """{dtype: artifact directory}, each made by `toolkit export --dtype` (the export command under test)."""
    base = tmp_path_factory.mktemp("dtypes")
    out = {}
    for dtype in EXPORT_DTYPES:
        target = base / dtype
        result = invoke("export", "--preset", PRESET, "--dtype", dtype, "--out", target)
        assert_clean(result)
        shown = "(llama, stages)" if dtype == "float32" else f"(llama, stages, {dtype})"
        assert f"exported {PRESET} {shown}" in result.stdout
        out[dtype] = target
    return out


@pytest.mark.parametrize("dtype", EXPORT_DTYPES)
def test_check_passes_on_every_backend_of_the_dtype(artifacts, dtype, tmp_path):
    backends = backends_for(dtype)
    report_file = tmp_path / "report.json"
    result = invoke("check", artifacts[dtype], "--backends", ",".join(backends), "--json", report_file)
    assert_clean(result)
    assert "RESULT: PASS" in result.stdout
    report = json.loads(report_file.read_text())
    assert report["dtype"] == dtype and [b["name"] for b in report["backends"]] == backends


@pytest.mark.parametrize("dtype", EXPORT_DTYPES)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_run_prints_and_saves(artifacts, dtype, backend, tmp_path):
    if backend not in backends_for(dtype):
        result = invoke("run", artifacts[dtype], "--backend", backend)
        assert_user_error(result, backend, dtype)  # refused in one line, not a crash
        return
    saved = tmp_path / "out.npz"
    result = invoke("run", artifacts[dtype], "--backend", backend, "--save", saved)
    assert_clean(result)
    rows = [line.split() for line in result.stdout.splitlines() if line.startswith("  ")]
    logits = next(row for row in rows if row[0] == "logits")
    assert logits[1] == dtype and logits[2] == "2x5x96"
    preview = " ".join(logits[3:]).strip("[]").replace(", ...", "").split(", ")
    assert len(preview) == 4 and all(np.isfinite(float(v)) for v in preview)
    with np.load(saved) as data:
        # .npz has no bfloat16: run stores it widened to float32 (exact) and says so
        assert data["logits"].dtype == (np.float32 if dtype == "bfloat16" else NUMPY_DTYPES[dtype])
        assert data["logits"].shape == (2, 5, 96) and np.isfinite(data["logits"]).all()
    assert ("bfloat16 stored as float32" in result.stdout) == (dtype == "bfloat16")


@pytest.mark.parametrize("dtype", EXPORT_DTYPES)
def test_run_with_an_inputs_file(artifacts, dtype, tmp_path):
    feed = tmp_path / "feed.npz"
    np.savez(feed, input_ids=np.array([[1, 2, 3]], dtype=np.int64))
    result = invoke("run", artifacts[dtype], "--backend", "eager", "--inputs", feed)
    assert_clean(result)
    assert any(line.split()[:3] == ["logits", dtype, "1x3x96"] for line in result.stdout.splitlines())


@pytest.mark.parametrize("dtype", EXPORT_DTYPES)
@pytest.mark.parametrize("fmt", ["text", "json"])
def test_inspect(artifacts, dtype, fmt):
    result = invoke("inspect", artifacts[dtype], "--format", fmt)
    assert_clean(result)
    if fmt == "json":
        json.loads(result.stdout)
    assert dtype in result.stdout


@pytest.mark.parametrize("dtype", EXPORT_DTYPES)
def test_generate_without_a_tokenizer_is_a_one_line_error(artifacts, dtype):
    # Presets carry no tokenizer; generate on a tokenized import is tests/toolkit/test_smollm2.py's.
    result = invoke("generate", artifacts[dtype], "--prompt", "hi", "--backend", "eager")
    assert_user_error(result, "no tokenizer")


@pytest.mark.parametrize("dtype", EXPORT_DTYPES)
def test_quantize_ends_cleanly(artifacts, dtype, tmp_path):
    result = invoke("quantize", artifacts[dtype], "--bits", "8", "--out", tmp_path / "q")
    assert result.exit_code in (0, 2), (result.exit_code, result.output, result.exception)
    assert "Traceback" not in result.output
    if result.exit_code == 2:
        assert_user_error(result)


def test_preview_of_every_float_dtype_formats_numbers():
    from toolkit.commands.run import _number

    for dtype in NUMPY_DTYPES.values():
        assert _number(np.asarray([1.5], dtype=dtype)[0]) == "1.5"
    assert _number(np.int64(7)) == "7" and _number(np.bool_(True)) == "True"
