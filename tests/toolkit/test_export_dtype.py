"""`toolkit export --from` keeps a float16 checkpoint's dtype by default, and says why a bfloat16 one becomes
float32 (ONNX Runtime's CPU provider has no bfloat16 kernels); --dtype overrides both."""

from __future__ import annotations

import json

import pytest
import torch

from tests.optional import import_or_skip
from tests.toolkit.test_cli import invoke

import_or_skip("transformers", "the checkpoints are written with transformers")
from tests.models.test_checkpoints import hf_llama  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("dtypes")
    out = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        hf_llama(seed=5).to(dtype).save_pretrained(root / name)
        out[name] = root / name
    return out


@pytest.mark.parametrize(
    "stored,args,expected,note",
    [
        ("float32", (), "float32", None),
        ("float16", (), "float16", "dtype float16: the checkpoint's dtype"),
        ("bfloat16", (), "float32", "the checkpoint is bfloat16, which ONNX Runtime's CPU provider does not run"),
        ("float16", ("--dtype", "float32"), "float32", None),
        ("bfloat16", ("--dtype", "bfloat16"), "bfloat16", None),
    ],
)
def test_default_export_dtype_follows_the_checkpoint(checkpoints, tmp_path, stored, args, expected, note):
    out = tmp_path / "artifact"
    result = invoke("export", "--from", checkpoints[stored], "--out", out, "--no-verify", *args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest.get("dtype", "float32") == expected
    assert manifest["source"]["dtype"] == stored
    if note is None:
        assert "  dtype " not in result.output
    else:
        assert note in result.output
    if expected != "bfloat16":  # ONNX Runtime's CPU provider runs float32 and float16
        check = invoke("check", out, "--backends", "eager,ort-cpu")
        assert check.exit_code == 0, check.output
