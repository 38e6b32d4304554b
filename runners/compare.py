"""Per-output comparison against a reference, with calibrated, per-stage tolerances.

The allowed max abs error of an output is

    allowed = multiple * calibration + atol + rtol * max|reference|

where `calibration` is the float32 eager model's own max abs error against the
float64 oracle for that output: a backend may be a small multiple worse than
PyTorch's own float32 rounding, plus a floor that scales with the output's
magnitude (the floor matters where float32 eager happens to be exact).

Where the graph rounds activations to int8 (MatMulNBits at accuracy level 4), a float32 backend may round a
value that lies within its last bits of a half step the other way than the oracle does; `rounding` is, per
output, how far the oracle moves when it rounds all such values the other way (runners.activations), and
ROUNDING_MULTIPLE times it is added to the allowance, so that a backend rounding some of them otherwise,
with partial cancellations, still passes.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from artifact.errors import ComparisonError, ConfigError


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    multiple: float

    def __post_init__(self):
        for name in ("atol", "rtol", "multiple"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (value >= 0)
                or value == float("inf")
            ):
                raise ConfigError(f"tolerance {name}: expected a finite number >= 0, got {value!r}")


# float32 rounding is 2^-24 ~ 6e-8 relative; rtol 1e-5 leaves room for ~100 ulps of
# reassociation (different matmul blocking, fused kernels) without hiding real bugs,
# which show up as errors of order 1e-3 and above.
DEFAULT_TOLERANCES = {
    "float32": Tolerance(atol=1e-6, rtol=1e-5, multiple=8.0),
    "float64": Tolerance(atol=1e-12, rtol=1e-10, multiple=8.0),
    # Reduced-precision exports (exporters/precision.py), judged against the same float64 oracle: the floor
    # is ~20 units of roundoff of the output's scale (float16 u = 2^-11, bfloat16 u = 2^-8). Measured on
    # the presets: backends within 2x the eager model's own error at that dtype, at most 2.3e-3 (float16)
    # and 1.8e-2 (bfloat16) of the output's scale; a wrong weight or op is off by O(1) of it.
    "float16": Tolerance(atol=1e-3, rtol=1e-2, multiple=8.0),
    "bfloat16": Tolerance(atol=1e-2, rtol=8e-2, multiple=8.0),
}


@dataclass
class ToleranceConfig:
    """Defaults per dtype, overridden per output by glob patterns (first match wins).

    per_dtype_output ({dtype: {glob: Tolerance}}) is searched first, then the dtype-independent
    per_output, then the dtype's default.
    """

    per_dtype: dict[str, Tolerance] = field(default_factory=lambda: dict(DEFAULT_TOLERANCES))
    per_output: dict[str, Tolerance] = field(default_factory=dict)
    per_dtype_output: dict[str, dict[str, Tolerance]] = field(default_factory=dict)
    source: str | None = None  # the file it was loaded from, for messages

    def for_output(self, name: str, dtype: str) -> Tolerance:
        for pattern, tolerance in self.per_dtype_output.get(dtype, {}).items():
            if fnmatch.fnmatchcase(name, pattern):
                return tolerance
        for pattern, tolerance in self.per_output.items():
            if fnmatch.fnmatchcase(name, pattern):
                return tolerance
        if dtype not in self.per_dtype:
            raise ConfigError(f"no tolerance for dtype {dtype!r}; known dtypes: {', '.join(self.per_dtype)}")
        return self.per_dtype[dtype]

    def check_patterns(self, stages: list[str]) -> None:
        """Refuse a stage glob that matches none of `stages` (a typo would otherwise silently do nothing)."""
        where = f"{self.source}: " if self.source else ""
        patterns = [(f"{d}.stages.{p!r}", p) for d, table in self.per_dtype_output.items() for p in table]
        patterns += [(f"stages.{p!r}", p) for p in self.per_output]
        for key, pattern in patterns:
            if not any(fnmatch.fnmatchcase(stage, pattern) for stage in stages):
                shown = ", ".join(stages[:8]) + (", ..." if len(stages) > 8 else "")
                raise ConfigError(f"{where}{key} matches no stage of this artifact; stages are {shown}")


# dtypes a tolerance file may configure: the export dtypes the toolkit compares (float16/bfloat16 for
# reduced-precision exports) and the float64 oracle's own.
TOLERANCE_DTYPES = ("float32", "float64", "float16", "bfloat16")
TOLERANCE_KEYS = ("atol", "rtol", "multiple")


def load_tolerances(path: str | Path) -> ToleranceConfig:
    """Read a TOML (or .json) tolerance file into a ToleranceConfig, validating every key.

    Format (TOML; JSON has the same nesting):

        [float32]                    # defaults for float32 outputs; missing keys keep the built-in default
        atol = 1e-6
        rtol = 1e-5
        multiple = 8.0
        [float32.stages."block.*.attention_weights"]   # glob over stage names, first match wins
        rtol = 2e-5                  # missing keys inherit from [float32]
        [float16]
        atol = 1e-3
        rtol = 1e-2
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read tolerance file ({exc.strerror})") from None
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(raw.decode("utf-8"))
        else:
            tomllib = _tomllib(path)
            data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text; a tolerance file is TOML or JSON") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of dtypes, got {type(data).__name__}")
    config = ToleranceConfig(source=str(path))
    for dtype, table in data.items():
        if dtype not in TOLERANCE_DTYPES:
            raise ConfigError(
                f"{path}: unknown key {dtype!r} at the top level; expected a dtype table, one of "
                f"{', '.join(TOLERANCE_DTYPES)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {dtype}: expected a table, got {type(table).__name__} {table!r}")
        base = DEFAULT_TOLERANCES.get(dtype, DEFAULT_TOLERANCES["float32"])
        default = _tolerance(path, dtype, {k: v for k, v in table.items() if k != "stages"}, base)
        config.per_dtype[dtype] = default
        stages = table.get("stages", {})
        if not isinstance(stages, dict):
            raise ConfigError(f"{path}: {dtype}.stages: expected a table of stage globs, got {type(stages).__name__}")
        for pattern, entry in stages.items():
            key = f"{dtype}.stages.{pattern!r}"
            _check_glob(path, key, pattern)
            if not isinstance(entry, dict):
                raise ConfigError(f"{path}: {key}: expected a table with atol/rtol/multiple, got {entry!r}")
            config.per_dtype_output.setdefault(dtype, {})[pattern] = _tolerance(path, key, entry, default)
    return config


def _tomllib(path: Path):
    try:
        import tomllib
    except ImportError:  # Python 3.10 has no TOML reader in the standard library
        raise ConfigError(
            f"{path}: reading TOML needs Python >= 3.11 (tomllib); write the same tables as a .json file"
        ) from None
    return tomllib


def _tolerance(path: Path, key: str, table: dict, base: Tolerance) -> Tolerance:
    values = {}
    for name, value in table.items():
        if name not in TOLERANCE_KEYS:
            raise ConfigError(
                f"{path}: {key}.{name}: unknown key; expected {', '.join(TOLERANCE_KEYS)}"
                + (" or a 'stages' table" if "." not in key else "")
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path}: {key}.{name}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{path}: {key}.{name}: expected a finite number >= 0, got {value!r}")
        values[name] = float(value)
    return Tolerance(**{name: values.get(name, getattr(base, name)) for name in TOLERANCE_KEYS})


def _check_glob(path: Path, key: str, pattern) -> None:
    if not isinstance(pattern, str) or not pattern.strip():
        raise ConfigError(f"{path}: {key}: a stage glob must be a non-empty string")
    # fnmatch reads an unclosed '[' as a literal, which is never what a stage glob means.
    depth = 0
    for char in pattern:
        if char == "[":
            if depth:
                raise ConfigError(f"{path}: {key}: bad glob, nested '[' in {pattern!r}")
            depth = 1
        elif char == "]" and depth:
            depth = 0
    if depth:
        raise ConfigError(f"{path}: {key}: bad glob, unclosed '[' in {pattern!r}")
    re.compile(fnmatch.translate(pattern))


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
    # What `allowed` bounds: the max abs error (every backend), or another measure an oracle uses instead (the
    # llama.cpp oracle bounds the relative RMS error, "rel_rms", whose value is `value`).
    metric: str = "max_abs"
    value: float | None = None

    def to_dict(self) -> dict:
        measure = {} if self.metric == "max_abs" else {"metric": self.metric, "value": _finite_or_none(self.value)}
        return {
            **measure,
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


ROUNDING_MULTIPLE = 2.0


def compare(
    reference: dict[str, np.ndarray],
    actual: dict[str, np.ndarray],
    *,
    dtype: str = "float32",
    tolerances: ToleranceConfig | None = None,
    calibration: dict[str, float] | None = None,
    order: list[str] | None = None,
    rounding: dict[str, float] | None = None,
) -> Comparison:
    """Compare `actual` against `reference` output by output, in `order` (default: reference order)."""
    names = list(order) if order is not None else list(reference)
    if not names:
        raise ComparisonError("nothing to compare: the reference has no outputs")
    tolerances = tolerances or ToleranceConfig()
    calibration, rounding = calibration or {}, rounding or {}
    results = []
    for name in names:
        if name not in reference:
            raise ComparisonError(f"output {name!r} is not in the reference; reference has {sorted(reference)}")
        ref = np.asarray(reference[name], dtype=np.float64)
        tolerance = tolerances.for_output(name, dtype)
        ref_scale = float(np.max(np.abs(ref))) if ref.size and np.isfinite(ref).all() else 0.0
        allowed = (
            tolerance.multiple * calibration.get(name, 0.0)
            + ROUNDING_MULTIPLE * rounding.get(name, 0.0)
            + tolerance.atol
            + tolerance.rtol * ref_scale
        )
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
        max_rel = (
            float((diff / np.maximum(np.abs(ref), tolerance.atol or np.finfo(np.float64).tiny)).max())
            if diff.size
            else 0.0
        )
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
