"""The comparator: verdicts, tolerances and error statistics against hand-computed numbers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from artifact.errors import ComparisonError, ConfigError
from runners.compare import Comparison, Tolerance, ToleranceConfig, compare

LOOSE = Tolerance(atol=0.1, rtol=0.01, multiple=2.0)


def only(tolerance: Tolerance, dtype: str = "float32") -> ToleranceConfig:
    return ToleranceConfig(per_dtype={dtype: tolerance})


def test_identical_outputs_pass_and_comparison_is_truthy():
    ref = {"a": np.array([1.0, -2.0]), "b": np.zeros((2, 3))}
    result = compare(ref, {k: v.astype(np.float32) for k, v in ref.items()})
    assert result
    assert all(o.passed and o.max_abs == 0.0 and o.reason == "" for o in result.outputs)
    assert result.first_failure is None


def test_error_statistics_match_hand_computed_values():
    ref = {"a": np.array([1.0, -2.0, 4.0])}
    got = {"a": np.array([1.5, -2.0, 3.0])}
    # diff = (0.5, 0, 1.0): max 1.0, mean 0.5; relative (0.5/1, 0/2, 1/4) -> max 0.5
    # allowed = multiple * calibration + atol + rtol * max|ref| = 2 * 0.2 + 0.1 + 0.01 * 4 = 0.54
    result = compare(ref, got, tolerances=only(LOOSE), calibration={"a": 0.2})
    out = result["a"]
    assert out.max_abs == pytest.approx(1.0)
    assert out.mean_abs == pytest.approx(0.5)
    assert out.max_rel == pytest.approx(0.5)
    assert out.allowed == pytest.approx(0.54)
    assert not out.passed and not result
    assert "1" in out.reason and "0.54" in out.reason


def test_calibration_multiple_widens_the_allowance():
    ref, got = {"a": np.array([1.0, -2.0, 4.0])}, {"a": np.array([1.5, -2.0, 3.0])}
    # calibration 0.5 -> allowed = 2 * 0.5 + 0.1 + 0.04 = 1.14 >= max_abs 1.0
    result = compare(ref, got, tolerances=only(LOOSE), calibration={"a": 0.5})
    assert result["a"].allowed == pytest.approx(1.14)
    assert result
    # The multiple is what scales the calibration: with multiple 1 the same calibration is not enough.
    single = Tolerance(atol=0.1, rtol=0.01, multiple=1.0)
    assert not compare(ref, got, tolerances=only(single), calibration={"a": 0.5})


def test_the_rounding_spread_adds_twice_itself_to_the_allowance():
    ref, got = {"a": np.array([1.0, -2.0, 4.0])}, {"a": np.array([1.5, -2.0, 3.0])}
    # allowed = 2 * 0.2 (calibration) + 2 * 0.25 (rounding) + 0.1 + 0.04 = 1.04 >= max_abs 1.0
    result = compare(ref, got, tolerances=only(LOOSE), calibration={"a": 0.2}, rounding={"a": 0.25})
    assert result["a"].allowed == pytest.approx(1.04) and result
    assert not compare(ref, got, tolerances=only(LOOSE), calibration={"a": 0.2}, rounding={"b": 0.25})


def test_boundary_is_inclusive():
    # allowed = 0 * cal + 0.25 + 0 = 0.25 exactly; an error of exactly 0.25 passes, slightly more fails.
    tol = only(Tolerance(atol=0.25, rtol=0.0, multiple=0.0))
    assert compare({"a": np.array([0.0])}, {"a": np.array([0.25])}, tolerances=tol)
    assert not compare({"a": np.array([0.0])}, {"a": np.array([0.2501])}, tolerances=tol)


def test_relative_error_is_guarded_at_exact_zeros():
    # ref 0 -> denominator is atol (0.01): 0.001 / 0.01 = 0.1; ref 2 -> 0.5 / 2 = 0.25
    tol = only(Tolerance(atol=0.01, rtol=0.0, multiple=0.0))
    out = compare({"a": np.array([0.0, 2.0])}, {"a": np.array([0.001, 2.5])}, tolerances=tol)["a"]
    assert np.isfinite(out.max_rel)
    assert out.max_rel == pytest.approx(0.25)
    out = compare({"a": np.array([0.0, 2.0])}, {"a": np.array([0.003, 2.0])}, tolerances=tol)["a"]
    assert out.max_rel == pytest.approx(0.3)


def test_default_tolerances_depend_on_dtype():
    ref = {"a": np.array([1.0, -3.0, 4.0])}
    few_ulps = {"a": ref["a"] * (1 + 2.0**-22)}  # ~4 float32 ulps: rounding noise in float32, a bug in float64
    assert compare(ref, few_ulps, dtype="float32")
    assert not compare(ref, few_ulps, dtype="float64")
    real_bug = {"a": ref["a"] + 1e-3}
    assert not compare(ref, real_bug, dtype="float32")


def test_unknown_dtype_is_a_config_error():
    # int8 has no default tolerance (float16/bfloat16 gained theirs with reduced-precision exports).
    with pytest.raises(ConfigError, match=r"no tolerance for dtype 'int8'; known dtypes: float32, float64"):
        compare({"a": np.zeros(2)}, {"a": np.zeros(2)}, dtype="int8")


def test_per_output_override_by_glob_first_match_wins():
    ref = {"block.0.attention_weights": np.zeros(3), "block.0.output": np.zeros(3), "block.1.output": np.zeros(3)}
    got = {name: np.full(3, 0.5) for name in ref}
    tolerances = ToleranceConfig(
        per_dtype={"float32": Tolerance(atol=1e-6, rtol=0.0, multiple=0.0)},
        per_output={
            "block.*.attention_weights": Tolerance(atol=1.0, rtol=0.0, multiple=0.0),
            "block.1.*": Tolerance(atol=0.6, rtol=0.0, multiple=0.0),
            "block.*": Tolerance(atol=0.1, rtol=0.0, multiple=0.0),  # shadowed for block.1.* by the rule above
        },
    )
    result = compare(ref, got, tolerances=tolerances)
    assert result["block.0.attention_weights"].passed and result["block.0.attention_weights"].allowed == 1.0
    assert result["block.1.output"].passed and result["block.1.output"].allowed == 0.6
    assert not result["block.0.output"].passed and result["block.0.output"].allowed == pytest.approx(0.1)
    assert result.first_failure.name == "block.0.output"


def test_missing_output_is_a_failure():
    ref = {"a": np.zeros(2), "b": np.ones(2)}
    result = compare(ref, {"a": np.zeros(2)})
    assert not result
    assert result["a"].passed
    assert not result["b"].passed and result["b"].actual_shape is None
    assert "missing" in result["b"].reason
    assert result.first_failure.name == "b"


def test_shape_mismatch_is_a_failure_even_when_broadcastable():
    result = compare({"a": np.zeros((2, 3))}, {"a": np.zeros((1, 3))})
    assert not result
    assert result["a"].actual_shape == (1, 3) and result["a"].reference_shape == (2, 3)
    assert "shape" in result["a"].reason


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_backend_output_is_a_failure(bad):
    got = np.zeros(4)
    got[2] = bad
    # An enormous tolerance must not make NaN/Inf pass.
    huge = only(Tolerance(atol=1e30, rtol=0.0, multiple=0.0))
    result = compare({"a": np.zeros(4)}, {"a": got}, tolerances=huge)
    assert not result
    assert "non-finite" in result["a"].reason and "backend" in result["a"].reason


def test_non_finite_reference_is_a_failure():
    ref = np.array([0.0, np.nan])
    result = compare({"a": ref}, {"a": np.zeros(2)})
    assert not result
    assert "reference" in result["a"].reason


def test_failed_comparison_serialises_to_strict_json():
    result = compare({"a": np.zeros(2), "b": np.zeros(2)}, {"a": np.array([np.nan, 0.0])})
    for output in result.outputs:
        data = output.to_dict()
        json.dumps(data, allow_nan=False)  # NaN statistics are reported as null
        assert data["max_abs"] is None and data["passed"] is False


def test_empty_reference_raises():
    with pytest.raises(ComparisonError, match="nothing to compare"):
        compare({}, {"a": np.zeros(1)})


def test_order_naming_an_output_not_in_the_reference_raises():
    with pytest.raises(ComparisonError, match="'c'"):
        compare({"a": np.zeros(1)}, {"a": np.zeros(1)}, order=["a", "c"])


def test_order_sets_which_failure_is_first():
    ref = {"late": np.zeros(1), "early": np.zeros(1)}
    got = {"late": np.ones(1), "early": np.ones(1)}
    result = compare(ref, got, order=["early", "late"])
    assert [o.name for o in result.outputs] == ["early", "late"]
    assert result.first_failure.name == "early"


def test_empty_comparison_is_falsy():
    assert not Comparison([])


def test_logits_argmax_agreement():
    ref = {"logits": np.array([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]]), "other": np.array([[0.0, 1.0]])}
    got = {"logits": np.array([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]), "other": np.array([[1.0, 0.0]])}
    # argmax per position: (1, 0) vs (1, 2) -> half of the positions agree
    result = compare(ref, got, tolerances=only(Tolerance(atol=10.0, rtol=0.0, multiple=0.0)))
    assert result["logits"].argmax_agreement == pytest.approx(0.5)
    assert result["other"].argmax_agreement is None
    exact = compare(ref, ref)
    assert exact["logits"].argmax_agreement == 1.0


def test_comparison_lookup_by_unknown_name_raises_key_error():
    result = compare({"a": np.zeros(1)}, {"a": np.zeros(1)})
    with pytest.raises(KeyError):
        result["b"]


@pytest.mark.parametrize("field", ["atol", "rtol", "multiple"])
@pytest.mark.parametrize("value", [-1e-9, float("nan"), float("inf"), True, "0.1", None])
def test_tolerance_rejects_invalid_values(field, value):
    kwargs = {"atol": 0.0, "rtol": 0.0, "multiple": 0.0, field: value}
    with pytest.raises(ConfigError, match=field):
        Tolerance(**kwargs)


# --- tolerance files -------------------------------------------------------------------------------

from runners.compare import DEFAULT_TOLERANCES, load_tolerances  # noqa: E402


def write(tmp_path, text, name="tol.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_tolerance_file_per_dtype_and_stage_glob(tmp_path):
    path = write(
        tmp_path,
        """
[float32]
atol = 0.5
[float32.stages."block.*.attention_weights"]
rtol = 0.25
[float16]
atol = 1e-3
rtol = 1e-2
""",
    )
    config = load_tolerances(path)
    # The stage entry inherits atol and multiple from [float32], overrides rtol.
    assert config.for_output("block.0.attention_weights", "float32") == Tolerance(0.5, 0.25, 8.0)
    assert config.for_output("logits", "float32") == Tolerance(0.5, DEFAULT_TOLERANCES["float32"].rtol, 8.0)
    assert config.for_output("logits", "float16") == Tolerance(1e-3, 1e-2, 8.0)
    # Used by compare: allowed = 8 * 0 + 0.5 + 0.25 * 2 = 1.0 for the attention weights.
    result = compare(
        {"block.0.attention_weights": np.array([2.0])},
        {"block.0.attention_weights": np.array([3.0])},
        tolerances=config,
    )
    assert result["block.0.attention_weights"].allowed == pytest.approx(1.0) and result


def test_tolerance_file_in_json(tmp_path):
    path = write(tmp_path, json.dumps({"float32": {"atol": 0.1, "stages": {"logits": {"atol": 0.2}}}}), "tol.json")
    assert load_tolerances(path).for_output("logits", "float32").atol == 0.2


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[float33]\natol = 1", r"unknown key 'float33' at the top level; expected a dtype table"),
        ("[float32]\natool = 1", r"float32.atool: unknown key; expected atol, rtol, multiple"),
        ("[float32]\natol = -1", r"float32.atol: expected a finite number >= 0, got -1"),
        ('[float32]\nrtol = "small"', r"float32.rtol: expected a number, got str 'small'"),
        ('[float32.stages."block.[0"]\natol = 1', r"float32.stages.'block.\[0': bad glob, unclosed '\['"),
        ('[float32.stages."logits"]\nepsilon = 1', r"float32.stages.'logits'.epsilon: unknown key"),
        ("[float32]\natol = 1\n[float32", r"invalid TOML"),
        ("float32 = 3", r"float32: expected a table"),
    ],
)
def test_tolerance_file_errors_name_file_and_key(tmp_path, text, fragment):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=r"tol.toml: .*" + fragment):
        load_tolerances(path)


def test_tolerance_glob_matching_no_stage_is_refused(tmp_path):
    config = load_tolerances(write(tmp_path, '[float32.stages."block.*.atention_weights"]\natol = 1'))
    with pytest.raises(ConfigError, match=r"matches no stage of this artifact; stages are block.0.attention_weights"):
        config.check_patterns(["block.0.attention_weights", "logits"])


def test_missing_tolerance_file(tmp_path):
    with pytest.raises(ConfigError, match=r"cannot read tolerance file"):
        load_tolerances(tmp_path / "none.toml")
