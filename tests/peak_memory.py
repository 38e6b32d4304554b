"""Peak memory of one `toolkit` command in a child process, and the cost per extra weight byte between two
checkpoints that differ only in depth (the fixed costs, interpreter, trace and embedding, cancel)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models.test_checkpoints import hf_llama

ROOT = Path(__file__).resolve().parents[1]
# VmHWM, not ru_maxrss: Linux keeps ru_maxrss across execve, so a child forked from the test process would
# report at least the test process's own resident set at the fork (toolkit.bench.machine.peak_rss_kb).
CHILD = """
import json, sys
from click.testing import CliRunner
from toolkit.bench.machine import peak_rss_kb
from toolkit.cli import main
result = CliRunner().invoke(main, sys.argv[1:])
assert result.exit_code == 0, result.output
print(json.dumps({"peak": peak_rss_kb() * 1024}))
"""


def checkpoint(directory: Path, layers: int) -> int:
    """Save a `layers`-layer Llama checkpoint (width 512, GQA, vocabulary 32000) to `directory`; its float32
    weight bytes."""
    model = hf_llama(width=512, heads=8, kv_heads=2, ff=1408, layers=layers, vocab=32000, seed=1)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters()) * 4


def command_peak(*args) -> int:
    """Peak resident bytes of `toolkit ARGS` run in a fresh child process."""
    code = [sys.executable, "-c", CHILD, *map(str, args)]
    out = subprocess.run(code, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])["peak"]


def assert_cost_per_extra_byte(shallow: tuple[int, int], deep: tuple[int, int], bound: float) -> None:
    """(peak, weight bytes) of a shallow and a deep checkpoint: the extra peak per extra weight byte is under
    `bound`, over a difference large enough to measure."""
    (shallow_peak, shallow_weights), (deep_peak, deep_weights) = shallow, deep
    ratio = (deep_peak - shallow_peak) / (deep_weights - shallow_weights)
    print(
        f"peaks {shallow_peak / 2**20:.0f} and {deep_peak / 2**20:.0f} MiB for {shallow_weights / 2**20:.0f} and "
        f"{deep_weights / 2**20:.0f} MiB of weights: {ratio:.2f} bytes per extra weight byte"
    )
    assert deep_weights - shallow_weights > 250e6
    if ratio >= bound:
        pytest.fail(f"each extra weight byte cost {ratio:.2f} bytes of peak memory (bound {bound})")
