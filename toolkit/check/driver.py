"""`toolkit check` as one library call: open (or export) the artifact, choose the backends, cross-check them,
compare with golden outputs, localise divergences, save golden outputs; then write the report files."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from artifact import Artifact
from artifact.errors import BackendUnavailableError, ConfigError
from artifact.jsonfile import read_toml_or_json
from artifact.write import write_text_atomically
from exporters.lowerings import unsupported_backends
from exporters.onnx_export import export_model
from models.artifacts import artifact_config, open_artifact
from models.presets import get_preset
from runners.compare import ToleranceConfig, load_tolerances
from runners.registry import DEFAULT_BACKENDS, artifact_dtype, dtype_unsupported
from toolkit.check.crosscheck import CheckReport, EagerModels, cross_check
from toolkit.check.golden import Golden, check_inputs_fit, compare_with_golden, load_golden, save_golden
from toolkit.check.html_report import render_html
from toolkit.check.llamacpp import DEFAULT_DECODE_STEPS, import_llama_cpp, llama_cpp_check, refuse_llama_cpp
from toolkit.check.llamacpp import NAME as LLAMA_CPP
from toolkit.check.localize import localize_report
from toolkit.check.oracle import FAMILIES, ORACLES, import_transformers, mapped_stages, oracle_check, refuse_oracle
from toolkit.check.reports import to_json, to_junit
from toolkit.plotting import pyplot

DEFAULT_PRESET = "worked-example"


@dataclass(frozen=True)
class CheckRequest:
    """What to check and how: `toolkit check`'s options, parsed (the --inputs file already read)."""

    artifact_dir: str | None = None  # None: export `preset` to a temporary directory and check that
    preset: str | None = None  # None: DEFAULT_PRESET
    backends: list[str] | None = None  # None: the default backends, less those the artifact cannot run
    inputs: dict[str, np.ndarray] | None = None  # None: the preset's fixed inputs or a seeded random feed
    batch: int | None = None
    seq_len: int | None = None
    seed: int = 0
    decode_steps: int = 0
    tolerances_file: str | None = None
    golden_dir: str | None = None
    save_golden_dir: str | None = None
    localize: bool = False
    allow_cpu_fallback: bool = False
    html: bool = False  # an HTML report follows, so matplotlib must be importable before the check starts
    # "transformers" or "llama.cpp": also compare with the original checkpoint (toolkit.check.oracle, .llamacpp)
    oracle: str | None = None


def run_check(request: CheckRequest, notify: Callable[[str], None] = print) -> CheckReport:
    """Run the check `request` describes and return its report; `notify` receives the progress lines
    (an export, a default backend skipped) as they happen. Every usage error is raised before the check runs."""
    if request.artifact_dir and request.preset:
        raise ConfigError("give either ARTIFACT_DIR or --preset, not both")
    tolerances = read_tolerances(request.tolerances_file) if request.tolerances_file else None
    golden = requested_golden(request)
    if request.html:
        pyplot("--html")  # a missing matplotlib fails now, not after the check
    if request.oracle is not None:
        if request.oracle not in ORACLES:
            raise ConfigError(f"--oracle {request.oracle!r}: unknown oracle; known: {', '.join(ORACLES)}")
        # A missing transformers or llama-cpp-python fails now, not after an export.
        if request.oracle == LLAMA_CPP:
            import_llama_cpp()
        else:
            import_transformers()
    with tempfile.TemporaryDirectory(prefix="toolkit-check-") as tmp:
        artifact = open_or_export(request, Path(tmp), notify)
        names = choose_backends(artifact, request.backends, notify)
        if golden is not None:
            check_inputs_fit(golden, artifact)
        if tolerances is not None:
            stages = list(artifact.output_names)
            if request.oracle == "transformers" and artifact.family in FAMILIES:  # it compares hidden states too
                stages += mapped_stages(artifact_config(artifact).layers)
            tolerances.check_patterns(stages)
        checkpoint = None
        feed = golden.inputs if golden is not None else request.inputs
        oracle_steps = request.decode_steps or DEFAULT_DECODE_STEPS  # llama.cpp's greedy steps
        # A moved or changed checkpoint fails before the check runs.
        if request.oracle == "transformers":
            checkpoint = refuse_oracle(artifact, feed, tolerances)
        elif request.oracle == LLAMA_CPP:
            checkpoint = refuse_llama_cpp(artifact, feed, oracle_steps)
        stored_original = golden is not None and golden.oracle is not None
        models = EagerModels.load(artifact) if checkpoint is not None or stored_original else None
        report = cross_check(
            artifact,
            names,
            inputs=golden.inputs if golden is not None else request.inputs,
            batch=request.batch,
            sequence=request.seq_len,
            seed=request.seed,
            decode_steps=request.decode_steps,
            tolerances=tolerances,
            allow_cpu_fallback=request.allow_cpu_fallback,
            models=models,
        )
        if request.oracle == "transformers":
            oracle_check(report, artifact, models.float64, checkpoint, tolerances)
        elif request.oracle == LLAMA_CPP:
            llama_cpp_check(report, artifact, models.float64, checkpoint, oracle_steps)
        if golden is not None:
            report.input_source = f"golden inputs from {request.golden_dir}"
            compare_with_golden(report, golden, artifact, tolerances, models.float64 if models else None)
        if request.localize:
            report.localizations = localize_report(report, artifact)
        if request.save_golden_dir:
            save_golden(report, artifact, request.save_golden_dir)
    return report


MAX_TOLERANCE_BYTES = 1 << 20  # a tolerance file is a few tables


def read_tolerances(path: str) -> ToleranceConfig:
    """The tolerance file, through the bounded reader (a regular file of at most MAX_TOLERANCE_BYTES, UTF-8,
    nesting and numbers bounded) and then the typed parse of runners.compare (every key and value checked)."""
    read_toml_or_json(path, error=ConfigError, what="tolerance file", max_bytes=MAX_TOLERANCE_BYTES)
    return load_tolerances(path)


def requested_golden(request: CheckRequest) -> Golden | None:
    """The golden outputs --golden names, verified; their stored inputs replace any other feed."""
    if not request.golden_dir:
        return None
    if request.inputs is not None or request.batch is not None or request.seq_len is not None:
        raise ConfigError("--golden uses the golden directory's stored inputs; drop --inputs/--batch/--seq-len")
    return load_golden(request.golden_dir)


def open_or_export(request: CheckRequest, tmp: Path, notify: Callable[[str], None]) -> Artifact:
    """The artifact at request.artifact_dir, or the requested preset exported into `tmp`."""
    artifact_dir = request.artifact_dir
    if artifact_dir is None:
        spec = get_preset(request.preset or DEFAULT_PRESET)
        artifact_dir = tmp / spec.name
        export_model(spec.build(), spec.family, spec.config, artifact_dir, preset=spec.name, seed=spec.seed)
        notify(f"exported preset {spec.name!r} to a temporary directory")
    return open_artifact(artifact_dir)


def choose_backends(artifact: Artifact, requested: list[str] | None, notify: Callable[[str], None]) -> list[str]:
    """The backends to check: `requested`, each of which must be able to run the artifact, or else the
    defaults less those it cannot run (each one skipped is named through `notify`)."""
    unsupported = unsupported_backends(artifact.manifest)
    unsupported.update(dtype_unsupported(artifact_dtype(artifact)))
    if requested is None:
        for name, why in unsupported.items():
            if name in DEFAULT_BACKENDS:
                notify(f"not checking {name}: {why}")
        return [name for name in DEFAULT_BACKENDS if name not in unsupported]
    for name in requested:
        if name in unsupported:
            raise BackendUnavailableError(f"backend {name!r} cannot run {artifact.location}: {unsupported[name]}")
    return list(requested)


def write_reports(
    report: CheckReport, *, json_file: str | None = None, junit_file: str | None = None, html_file: str | None = None
) -> None:
    """Write each report file asked for, atomically, in this order: JSON, JUnit XML, HTML."""
    if json_file:
        write_text_atomically(json_file, to_json(report))
    if junit_file:
        write_text_atomically(junit_file, to_junit(report))
    if html_file:
        write_text_atomically(html_file, render_html(report))
