"""Per-output comparison against a reference, with calibrated, per-stage tolerances.

The allowed max abs error of an output is

    allowed = multiple * calibration + atol + rtol * max|reference|

where `calibration` is the float32 eager model's own max abs error against the
float64 oracle for that output: a backend may be a small multiple worse than
PyTorch's own float32 rounding, plus a floor that scales with the output's
magnitude (the floor matters where float32 eager happens to be exact).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np

from toolkit.errors import ComparisonError, ConfigError


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    multiple: float

    def __post_init__(self):
        for name in ("atol", "rtol", "multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value >= 0) or value == float("inf"):
                raise ConfigError(f"tolerance {name}: expected a finite number >= 0, got {value!r}")


# float32 rounding is 2^-24 ~ 6e-8 relative; rtol 1e-5 leaves room for ~100 ulps of
# reassociation (different matmul blocking, fused kernels) without hiding real bugs,
# which show up as errors of order 1e-3 and above.
DEFAULT_TOLERANCES = {
    "float32": Tolerance(atol=1e-6, rtol=1e-5, multiple=8.0),
    "float64": Tolerance(atol=1e-12, rtol=1e-10, multiple=8.0),
}


@dataclass
class ToleranceConfig:
    """Defaults per dtype, overridden per output by glob patterns (first match wins)."""

    per_dtype: dict[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    per_output: dict[str, Tolerance] = field(default_factory=dict)

    def for_output(self, name: str, dtype: str) -> Tolerance:
        for pattern, tolerance in self.per_output.items():
            if fnmatch.fnmatchcase(name, pattern):
                return tolerance
        if dtype not in self.per_dtype:
            raise ConfigError(f"no tolerance for dtype {dtype!r}; known dtypes: {', '.join(self.per_dtype)}")
        return self.per_dtype[dtype]


@dataclass
class OutputComparison:
    name: str
    reference_shape: tuple
    actual_shape: tuple | None
    max_abs: float
    mean_abs: float
    max_rel: float
    allowed: float
    passed: bool
    reason: str = ""
    argmax_agreement: float | None = None

    def to_dict(self) -> dict:
        return {
            "stage": self.name,
            "shape": list(self.reference_shape),
            "actual_shape": None if self.actual_shape is None else list(self.actual_shape),
            "max_abs": _finite_or_none(self.max_abs),
            "mean_abs": _finite_or_none(self.mean_abs),
            "max_rel": _finite_or_none(self.max_rel),
            "allowed": self.allowed,
            "passed": self.passed,
            "reason": self.reason,
            "argmax_agreement": self.argmax_agreement,
        }


@dataclass
class Comparison:
    """Truthy only when at least one output was compared and every output passed."""

    outputs: list[OutputComparison]

    def __bool__(self) -> bool:
        return bool(self.outputs) and all(o.passed for o in self.outputs)

    @property
    def first_failure(self) -> OutputComparison | None:
        return next((o for o in self.outputs if not o.passed), None)

    def __getitem__(self, name: str) -> OutputComparison:
        for output in self.outputs:
            if output.name == name:
                return output
        raise KeyError(name)


def compare(
    reference: dict[str, np.ndarray],
    actual: dict[str, np.ndarray],
    *,
    dtype: str = "float32",
    tolerances: ToleranceConfig | None = None,
    calibration: dict[str, float] | None = None,
    order: list[str] | None = None,
) -> Comparison:
    """Compare `actual` against `reference` output by output, in `order` (default: reference order)."""
    names = list(order) if order is not None else list(reference)
    if not names:
        raise ComparisonError("nothing to compare: the reference has no outputs")
    tolerances = tolerances or ToleranceConfig()
    calibration = calibration or {}
    results = []
    for name in names:
        if name not in reference:
            raise ComparisonError(f"output {name!r} is not in the reference; reference has {sorted(reference)}")
        ref = np.asarray(reference[name], dtype=np.float64)
        tolerance = tolerances.for_output(name, dtype)
        ref_scale = float(np.max(np.abs(ref))) if ref.size and np.isfinite(ref).all() else 0.0
        allowed = tolerance.multiple * calibration.get(name, 0.0) + tolerance.atol + tolerance.rtol * ref_scale
        if name not in actual:
            results.append(_failed(name, ref.shape, None, allowed, "missing from the backend's outputs"))
            continue
        got = np.asarray(actual[name], dtype=np.float64)
        if got.shape != ref.shape:
            results.append(_failed(name, ref.shape, got.shape, allowed, f"shape {got.shape} != reference {ref.shape}"))
            continue
        if not np.isfinite(got).all() or not np.isfinite(ref).all():
            where = "backend" if not np.isfinite(got).all() else "reference"
            results.append(_failed(name, ref.shape, got.shape, allowed, f"non-finite values in the {where} output"))
            continue
        diff = np.abs(got - ref)
        max_abs = float(diff.max()) if diff.size else 0.0
        mean_abs = float(diff.mean()) if diff.size else 0.0
        # Relative error per element, guarded by the atol floor so exact zeros do not divide by zero.
        max_rel = float((diff / np.maximum(np.abs(ref), tolerance.atol or np.finfo(np.float64).tiny)).max()) if diff.size else 0.0
        passed = max_abs <= allowed
        reason = "" if passed else f"max_abs {max_abs:.3g} > allowed {allowed:.3g}"
        agreement = None
        if name == "logits" and ref.ndim >= 1 and ref.size:
            agreement = float(np.mean(ref.argmax(-1) == got.argmax(-1)))
        results.append(
            OutputComparison(name, ref.shape, got.shape, max_abs, mean_abs, max_rel, allowed, passed, reason, agreement)
        )
    return Comparison(results)


def _finite_or_none(value: float) -> float | None:
    # JSON has no NaN: a comparison that could not be made reports null.
    return value if np.isfinite(value) else None


def _failed(name, ref_shape, actual_shape, allowed, reason) -> OutputComparison:
    nan = float("nan")
    return OutputComparison(name, tuple(ref_shape), actual_shape, nan, nan, nan, allowed, False, reason)
