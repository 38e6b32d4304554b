"""benchmarks/recipes_offgrid.py: a recipe run over several calibration seeds is summarised by hand-checked values."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "recipes_offgrid.py"
_spec = importlib.util.spec_from_file_location("recipes_offgrid", SCRIPT)
recipes_offgrid = sys.modules["recipes_offgrid"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipes_offgrid)


def test_over_seeds_keeps_each_run_and_the_median_and_range_of_each_measure():
    runs = {
        0: {"greedy_agreement": 0.8, "perplexity_vs_float": 0.147, "kl_from_float": 0.154, "logits_mean_abs": 1.0},
        1: {"greedy_agreement": 0.9, "perplexity_vs_float": 0.132, "kl_from_float": 0.144, "logits_mean_abs": 3.0},
        3: {"greedy_agreement": 0.7, "perplexity_vs_float": 0.129, "kl_from_float": 0.158, "logits_mean_abs": 2.0},
    }
    summary = recipes_offgrid.over_seeds(runs)
    assert summary["calibration_seeds"] == {"0": runs[0], "1": runs[1], "3": runs[3]}
    assert summary["perplexity_vs_float"] == {"median": 0.132, "min": 0.129, "max": 0.147}
    assert summary["kl_from_float"] == {"median": 0.154, "min": 0.144, "max": 0.158}
    assert summary["greedy_agreement"] == {"median": 0.8, "min": 0.7, "max": 0.9}
    assert summary["logits_mean_abs"] == {"median": 2.0, "min": 1.0, "max": 3.0}
    even = recipes_offgrid.over_seeds({0: runs[0], 1: runs[1]})
    assert even["logits_mean_abs"]["median"] == pytest.approx(2.0)
