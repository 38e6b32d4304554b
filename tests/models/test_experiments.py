"""models/experiments.py and `toolkit depth`: the pre-norm vs post-norm depth experiment.

Known behaviour being checked: with the same weights and input, pre-norm's residual stream grows with
depth (every branch adds to an unnormalised sum) while post-norm renormalises after every sub-layer and
stays near the norm gain (about 1).
"""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from artifact.errors import ToolkitError
from models.experiments import depth_experiment, render_table
from models.llama import LlamaBlock, LlamaConfig
from models.registry import initialize
from toolkit.cli import main
from toolkit.explain.depth import plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def result():
    return depth_experiment()


def test_twelve_values_for_each_placement(result):
    assert result["layers"] == 12
    assert len(result["pre"]) == 12 and len(result["post"]) == 12
    assert all(math.isfinite(v) and v > 0 for v in result["pre"] + result["post"])


def test_pre_norm_rms_grows_with_depth(result):
    pre = result["pre"]
    assert pre[-1] / pre[0] > 1.5
    assert pre[-1] > pre[len(pre) // 2] > pre[0]


def test_post_norm_rms_stays_near_one(result):
    assert all(0.8 <= v <= 1.25 for v in result["post"]), result["post"]
    assert 0.8 <= result["post"][-1] / result["post"][0] <= 1.25


def test_experiment_is_deterministic_and_seeded():
    small = dict(layers=2, width=16, heads=2, ff_width=16, batch=2, sequence=4)
    first, again, other = depth_experiment(**small), depth_experiment(**small), depth_experiment(seed=1, **small)
    assert again["pre"] == first["pre"] and again["post"] == first["post"]
    assert other["pre"] != first["pre"] and other["post"] != first["post"]


def test_experiment_leaves_the_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    depth_experiment(layers=2, width=8, heads=2, ff_width=8, batch=1, sequence=4)
    assert torch.equal(torch.rand(3), expected)


def test_small_experiment_matches_an_independent_rerun_of_the_blocks():
    # rebuild the documented setup by hand: one generator seeds the stack's weights, then the input
    layers, width, heads, ff, batch, seq = 3, 8, 2, 12, 2, 5
    result = depth_experiment(layers=layers, width=width, heads=heads, ff_width=ff, batch=batch, sequence=seq, seed=4)
    for placement in ("pre", "post"):
        config = LlamaConfig(
            width=width, heads=heads, ff_width=ff, max_positions=seq, norm_placement=placement, layers=layers
        )
        generator = torch.Generator().manual_seed(4)
        blocks = torch.nn.ModuleList([LlamaBlock(config) for _ in range(layers)]).double()
        initialize(blocks, generator)
        x = torch.randn(batch, seq, width, generator=generator, dtype=torch.float64)
        expected = []
        with torch.no_grad():
            for block in blocks:
                x = block(x)["output"]
                expected.append(float(np.sqrt((x.numpy() ** 2).mean())))
        np.testing.assert_allclose(result[placement], expected, rtol=1e-12)


def test_layers_argument_sets_the_number_of_values():
    short = depth_experiment(layers=3)
    assert len(short["pre"]) == len(short["post"]) == 3 and short["layers"] == 3


def test_render_table_has_a_row_per_block_and_the_growth_line(result):
    text = render_table(result)
    lines = text.splitlines()
    rows = [line for line in lines if line.split() and line.split()[0].isdigit()]
    assert [int(r.split()[0]) for r in rows] == list(range(12))
    assert float(rows[0].split()[1]) == pytest.approx(result["pre"][0], abs=5e-5)
    assert float(rows[11].split()[2]) == pytest.approx(result["post"][11], abs=5e-5)
    growth = result["pre"][-1] / result["pre"][0]
    assert f"pre-norm {growth:.2f}x" in lines[-1]


# ---------------------------------------------------------------------------------------------
# `toolkit depth`


def test_depth_cli_json_parses_and_equals_the_library(result):
    out = CliRunner().invoke(main, ["depth", "--format", "json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    assert data["pre"] == result["pre"] and data["post"] == result["post"]
    assert len(data["pre"]) == 12


def test_depth_cli_text_and_layers_option():
    out = CliRunner().invoke(main, ["depth", "--layers", "4", "--seed", "2"])
    assert out.exit_code == 0, out.output
    assert "4 blocks" in out.output and "growth last/first" in out.output


def test_depth_cli_rejects_zero_layers():
    out = CliRunner().invoke(main, ["depth", "--layers", "0"])
    assert out.exit_code == 2
    assert "--layers" in out.output


def test_depth_cli_plot_writes_a_valid_png(tmp_path):
    target = tmp_path / "depth.png"
    out = CliRunner().invoke(main, ["depth", "--layers", "3", "--plot", str(target)])
    assert out.exit_code == 0, out.output
    data = target.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (600, 400)  # figsize 6x4 inches at 100 dpi
    assert f"wrote {target}" in out.output


def test_plot_without_matplotlib_is_a_toolkit_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    with pytest.raises(ToolkitError, match=r"--plot needs matplotlib"):
        plot(depth_experiment(layers=2), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
