"""scripts/gpu-check on a machine without a GPU: its syntax, its usage errors and the commands --dry-run prints."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")


def run(*args, **env):
    environment = dict(os.environ, PYTHON=sys.executable, **env)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=environment
    )


def test_script_is_executable_and_parses():
    assert os.access(SCRIPT, os.X_OK)
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_dry_run_prints_every_step_with_a_timeout_and_writes_nothing(tmp_path):
    out = tmp_path / "results"
    result = run("--dry-run", str(out), PRESETS="worked-example decoder-small", SMOLLM2_GGUF="none")
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("+ timeout ")]
    text = "\n".join(lines)
    for preset in ("worked-example", "decoder-small"):
        for dtype in ("float32", "float16"):
            assert f"export --preset {preset} --dtype {dtype} --out {out}/artifacts/{preset}-{dtype}" in text
            assert (
                f"check {out}/artifacts/{preset}-{dtype} --backends eager\\,eager-cuda\\,ort-cpu\\,ort-cuda "
                f"--json {out}/check-{preset}-{dtype}.json"
            ) in text
    assert "nvidia-smi" in text and "SmolLM2" in result.stdout and "not installed" in result.stdout
    # `toolkit bench` exists, so the GPU bench step must be planned, not skipped.
    assert "bench" in text and "--backends ort-cuda\\,eager-cuda --batch 1\\,8" in text
    assert "no `toolkit bench` command" not in result.stdout
    assert not out.exists()


def test_dry_run_uses_the_smollm2_gguf_when_given(tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"")
    result = run("--dry-run", str(tmp_path / "o"), PRESETS="worked-example", SMOLLM2_GGUF=str(gguf))
    assert result.returncode == 0, result.stderr
    assert f"export --from {gguf} --dtype float16" in result.stdout
    assert "--decode-steps 4" in result.stdout


def test_default_output_directory_is_dated_under_benchmarks_results():
    result = run("--dry-run", PRESETS="worked-example", SMOLLM2_GGUF="none")
    assert result.returncode == 0, result.stderr
    assert "benchmarks/results/gpu-20" in result.stdout


@pytest.mark.parametrize(
    "args,message", [(["--frobnicate"], "unknown option --frobnicate"), (["a", "b"], "one OUT_DIR only")]
)
def test_usage_errors_exit_2(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr
