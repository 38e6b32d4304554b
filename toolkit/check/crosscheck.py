"""Cross-check: every backend's outputs against the float64 eager oracle, stage by stage."""

from __future__ import annotations

import copy
import platform
from dataclasses import dataclass, field

import numpy as np
import torch

from artifact import Artifact
from artifact.errors import ConfigError, InputError
from exporters.quantize import INT8_ACTIVATIONS_LEVEL
from models.artifacts import artifact_config
from models.presets import PRESETS
from models.registry import get_family, has_cache, lm_defaults
from runners.activations import rounding_ambiguous_away
from runners.base import check_kind
from runners.compare import Comparison, ToleranceConfig, compare
from runners.decoding.generate import CachedLM
from runners.eager import model_from_artifact
from runners.registry import DEFAULT_BACKENDS, artifact_dtype, check_backend, create_runner
from toolkit.check.localize import NodeAudit, audit_nodes

DEFAULT_BATCH, DEFAULT_SEQUENCE = 2, 5


@dataclass
class BackendResult:
    name: str
    device: str
    comparison: Comparison
    seconds: float
    placement: dict | None = None  # GPU ONNX Runtime backends: runners.ort.PlacementAudit.to_dict()
    audit: NodeAudit | None = None  # int8-activation artifacts: every node on the backend's own inputs

    @property
    def passed(self) -> bool:
        placed = self.placement is None or self.placement["ok"] or self.placement.get("fallback_allowed", False)
        return bool(self.comparison) and placed and (self.audit is None or self.audit.passed)

    @property
    def first_divergence(self) -> str | None:
        failure = self.comparison.first_failure
        if failure is None:
            return "node audit" if self.audit is not None and not self.audit.passed else None
        return failure.name


@dataclass
class CheckReport:
    artifact: str
    stages: list[str]
    inputs: dict[str, list[int]]
    input_source: str
    calibration: dict[str, float]
    backends: list[BackendResult] = field(default_factory=list)
    # Level-4 quantized artifacts: per stage, how far the oracle moves when it rounds the activations that lie
    # within float32 noise of a half step the other way (runners.compare, runners.activations).
    rounding: dict[str, float] = field(default_factory=dict)
    # Comparisons against stored golden outputs (toolkit.check.golden), one per backend plus the oracle.
    golden: list[BackendResult] = field(default_factory=list)
    golden_info: dict = field(default_factory=dict)
    # Node-level divergence findings (toolkit.check.localize), filled by --localize.
    localizations: list = field(default_factory=list)
    # The arrays behind the numbers (feeds per graph, oracle outputs, each backend's outputs), kept for
    # golden files, localisation and plots; not serialised.
    arrays: dict = field(default_factory=dict, repr=False)
    dtype: str = "float32"  # the artifact's export dtype, which picks the tolerances
    # --oracle transformers (toolkit.check.oracle): our float64 rebuild against the original checkpoint.
    oracle: BackendResult | None = None
    oracle_info: dict = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (
            bool(self.backends)
            and all(b.passed for b in self.backends)
            and all(g.passed for g in self.golden)
            and (self.oracle is None or self.oracle.passed)
        )

    @property
    def first_divergence(self) -> dict | None:
        """The earliest failing stage in computation order, over all backends."""
        best = None
        for backend in self.backends:
            failure = backend.comparison.first_failure
            if failure is None:
                continue
            index = self.stages.index(failure.name)
            if best is None or index < best[0]:
                best = (index, backend.name, failure)
        if best is None:
            return None
        index, backend, failure = best
        return {
            "backend": backend,
            "stage": failure.name,
            "index": index,
            "reason": failure.reason,
            "max_abs": failure.to_dict()["max_abs"],
            "allowed": failure.allowed,
        }

    def to_dict(self) -> dict:
        results = []
        for backend in self.backends:
            for output in backend.comparison.outputs:
                results.append({"backend": backend.name, **output.to_dict()})
        return {
            "passed": self.passed,
            "artifact": self.artifact,
            "reference": "eager-f64",
            "dtype": self.dtype,
            "inputs": self.inputs,
            "input_source": self.input_source,
            "backends": [
                {
                    "name": b.name,
                    "device": b.device,
                    "passed": b.passed,
                    "first_divergence": b.first_divergence,
                    "seconds": b.seconds,
                    "placement": b.placement,
                    "audit": None if b.audit is None else b.audit.to_dict(),
                }
                for b in self.backends
            ],
            "results": results,
            "first_divergence": self.first_divergence,
            "calibration": self.calibration,
            "rounding": self.rounding,
            "golden": None
            if not self.golden
            else {
                **self.golden_info,
                "passed": all(g.passed for g in self.golden),
                "results": [{"backend": g.name, **o.to_dict()} for g in self.golden for o in g.comparison.outputs],
            },
            "localizations": [loc.to_dict() for loc in self.localizations],
            "oracle": None
            if self.oracle is None
            else {
                **self.oracle_info,
                "device": self.oracle.device,
                "passed": self.oracle.passed,
                "first_divergence": self.oracle.first_divergence,
                "results": [o.to_dict() for o in self.oracle.comparison.outputs],
            },
            "platform": platform.platform(),
        }


def default_inputs(artifact: Artifact, batch: int | None, sequence: int | None, seed: int) -> tuple[dict, str]:
    """The preset's fixed inputs when it has them and no size was asked for, else seeded random ones.

    Only external inputs are made: a graph input produced by an earlier graph
    (the decoder's `encoder_output`) is not.
    """
    preset = PRESETS.get(artifact.manifest.preset or "")
    if preset is not None and preset.inputs is not None and batch is None and sequence is None:
        return _cast_to_specs(preset.inputs(), artifact), f"fixed inputs of preset {preset.name!r}"
    config = artifact_config(artifact)
    batch = DEFAULT_BATCH if batch is None else batch
    sequence = min(DEFAULT_SEQUENCE, config.max_positions) if sequence is None else sequence
    for name, value in (("batch", batch), ("sequence length", sequence)):
        if value < 1:
            raise InputError(f"{name}: expected a positive integer, got {value}")
    if sequence > config.max_positions:
        raise InputError(f"sequence length {sequence} exceeds the model's max_positions={config.max_positions}")
    rng = np.random.default_rng(seed)
    inputs = get_family(artifact.family).random_inputs(config, batch, sequence, rng)
    return _cast_to_specs(inputs, artifact), f"random (seed {seed}, batch {batch}, sequence {sequence})"


def _cast_to_specs(inputs: dict, artifact: Artifact) -> dict:
    specs = {s.name: s for g in artifact.graphs for s in g.input_specs}
    return {name: np.asarray(value).astype(specs[name].dtype) for name, value in inputs.items() if name in specs}


def graph_feed(graph, inputs: dict, produced: dict) -> dict:
    """A graph's feed: the user's inputs, earlier graphs' outputs cast to the declared dtype, and an
    empty KV cache (T_past = 0) for cache inputs the user left out."""
    feed = {}
    for spec in graph.input_specs:
        if spec.name in inputs:
            feed[spec.name] = inputs[spec.name]
        elif spec.name in produced:
            feed[spec.name] = np.asarray(produced[spec.name]).astype(spec.dtype)
    if "input_ids" in feed and not any(name.startswith("past.") for name in inputs):
        check_kind(next(s for s in graph.input_specs if s.name == "input_ids"), feed["input_ids"])
        implied = lm_defaults(graph.input_specs, feed["input_ids"])
        feed.update({name: value for name, value in implied.items() if name not in inputs})
    return feed


def cross_check(
    artifact: Artifact,
    backends: tuple[str, ...] | list[str] = DEFAULT_BACKENDS,
    *,
    inputs: dict[str, np.ndarray] | None = None,
    batch: int | None = None,
    sequence: int | None = None,
    seed: int = 0,
    tolerances: ToleranceConfig | None = None,
    decode_steps: int = 0,
    allow_cpu_fallback: bool = False,
    models: EagerModels | None = None,
) -> CheckReport:
    """Run every backend on every graph and compare each stage with the float64 eager oracle.

    Graphs run in order; a later graph's inputs that an earlier graph produces
    (the decoder's `encoder_output`) come from the oracle, cast to float32, so
    each graph is judged on identical inputs.

    decode_steps > 0 (KV-cache artifacts): after the prefill every backend
    decodes that many steps through its own cache, fed the oracle's greedy
    tokens, and each step's logits are compared as `decode.{k}.logits`.

    GPU ONNX Runtime backends also get a placement audit (one profiled run): a compute node on the
    CPU fails the backend unless allow_cpu_fallback.

    models: the artifact's eager models when the caller already built them (the oracle check reuses them).
    """
    refuse_uncheckable(artifact, backends, tolerances, decode_steps)
    inputs, source = prepare_inputs(artifact, inputs, batch, sequence, seed)
    models = models if models is not None else EagerModels.load(artifact)
    reference, eager32_outputs, feeds = oracle_outputs(artifact, models, inputs)
    stages = list(artifact.output_names)
    tokens = None
    if decode_steps:
        decoded, eager32_decoded, tokens = oracle_decode(artifact, models, inputs["input_ids"], decode_steps)
        reference.update(decoded)
        eager32_outputs.update(eager32_decoded)
        stages += list(decoded)
    calibration = calibrate(reference, eager32_outputs, stages)
    rounding = rounding_spread(artifact, models, feeds, reference, inputs["input_ids"] if tokens else None, tokens)
    report = CheckReport(
        artifact=artifact.location,
        stages=stages,
        inputs={k: list(v.shape) for k, v in inputs.items()},
        input_source=source,
        calibration=calibration,
        rounding=rounding,
        arrays={"inputs": inputs, "feeds": feeds, "reference": reference, "outputs": {}, "decode_tokens": tokens},
        dtype=artifact_dtype(artifact),
    )
    for name in backends:
        run = run_backend(name, artifact, models, feeds, allow_cpu_fallback)
        if decode_steps:
            run.outputs.update(_decode(run.runner, artifact, inputs["input_ids"], decode_steps, tokens)[0])
        result = judge_backend(run, report, tolerances)
        if report.rounding and name in AUDITED_BACKENDS:
            result.audit = audit_nodes(artifact, name, audit_feeds(artifact, inputs, feeds))
        report.backends.append(result)
        report.arrays["outputs"][name] = run.outputs
    return report


# --------------------------------------------------------------------------- input preparation


def refuse_uncheckable(artifact: Artifact, backends, tolerances: ToleranceConfig | None, decode_steps: int) -> None:
    """Refuse a check that cannot give a verdict, before any model is built."""
    if not backends:
        raise ConfigError("no backends to check; name at least one, e.g. --backends eager,ort-cpu")
    if decode_steps and not has_cache(artifact.graphs[0].input_specs):
        raise ConfigError("--decode-steps needs a KV-cache artifact; export a language model with --variant serving")
    for name in backends:
        check_backend(name, artifact_dtype(artifact))  # fail on a typo before any model is built
    level = (artifact.manifest.quantization or {}).get("accuracy_level")
    gpu = [name for name in backends if name in ("ort-cuda", "ort-trt")]
    if isinstance(level, int) and level >= INT8_ACTIVATIONS_LEVEL and gpu and tolerances is None:
        # The oracle rounds activations to int8 where ONNX Runtime's CPU MatMulNBits does
        # (runners.activations); the GPU kernels are not held to that rounding.
        raise ConfigError(
            f"{artifact.location}: quantized at --accuracy-level {level}; the oracle rounds activations to "
            f"int8 as ONNX Runtime's CPU MatMulNBits does, which {gpu[0]} is not held to; check it on "
            "eager, ort-cpu and onnx-reference, check the same quantization made with --accuracy-level 0, "
            "or give --tolerances with the error you accept"
        )


def prepare_inputs(
    artifact: Artifact, inputs: dict[str, np.ndarray] | None, batch: int | None, sequence: int | None, seed: int
) -> tuple[dict, str]:
    """The check's inputs and where they came from: the caller's as given, else `default_inputs`."""
    if inputs is None:
        return default_inputs(artifact, batch, sequence, seed)
    return inputs, "user-supplied"


# --------------------------------------------------------------------------- the oracle


# Above this size of a float64 copy of the weights the check keeps one model: the oracle and the eager
# backend cast it a block at a time while they run (runners.eager.computing_in). Below it a float64 copy and
# a converted model run faster in decode loops.
BY_BLOCK_BYTES = 2 << 30


@dataclass
class EagerModels:
    """The eager model rebuilt from the artifact's weights: the float64 oracle and the eager backend's model.

    Every runner of one check shares them, so the model is rebuilt once. For a large model (`by_block`) both
    are the one float32 model, cast by block while each runs; otherwise `float64` is a float64 copy.
    """

    float64: torch.nn.Module
    float32: torch.nn.Module
    by_block: bool = False

    @classmethod
    def load(cls, artifact: Artifact) -> EagerModels:
        model = model_from_artifact(artifact)
        if 2 * sum(p.numel() * p.element_size() for p in model.parameters()) > BY_BLOCK_BYTES:
            return cls(model, model, by_block=True)
        return cls(copy.deepcopy(model).to(torch.float64), model)

    def runner(self, name: str, artifact: Artifact, graph: str | None = None):
        """The runner `name` for `graph` (the whole artifact by default); the eager backends reuse these models."""
        model = self.float32 if name == "eager" else self.float64 if name == "eager-f64" else None
        return create_runner(name, artifact, graph, eager_model=model, by_block=self.by_block)


def oracle_outputs(artifact: Artifact, models: EagerModels, inputs: dict) -> tuple[dict, dict, dict]:
    """Graph by graph: each graph's feed, the float64 oracle's outputs, and float32 eager's on the same feed.

    Returns (reference, eager32 outputs, feeds by graph name).
    """
    reference, eager32_outputs, feeds = {}, {}, {}
    for graph in artifact.graphs:
        feeds[graph.name] = graph_feed(graph, inputs, reference)
        reference.update(models.runner("eager-f64", artifact, graph.name).run(feeds[graph.name]))
        eager32_outputs.update(models.runner("eager", artifact, graph.name).run(feeds[graph.name]))
    return reference, eager32_outputs, feeds


def calibrate(reference: dict, eager32_outputs: dict, stages: list[str]) -> dict[str, float]:
    """Per stage, float32 eager's max abs error against the oracle.

    The eager model's own error at the export dtype is the yardstick for every backend's tolerance;
    a non-finite one (float16 overflow in eager) must not make every tolerance infinite.
    """
    calibration = {
        name: float(np.max(np.abs(eager32_outputs[name].astype(np.float64) - reference[name]), initial=0.0))
        for name in stages
    }
    return {name: value if np.isfinite(value) else 0.0 for name, value in calibration.items()}


# The ONNX backends whose every node an int8-activation artifact's check audits: ort-cpu's kernels round as
# runners.activations does; onnx-reference computes MatMulNBits with runners.contrib_ops itself.
AUDITED_BACKENDS = ("ort-cpu",)


def audit_feeds(artifact: Artifact, inputs: dict, feeds: dict) -> dict[str, list[dict]]:
    """The feeds a node audit runs each graph on: the check's own and, for a one-graph language model, one token
    of one sequence, which takes the kernels' one-row path (the decode path)."""
    audited = {name: [feed] for name, feed in feeds.items()}
    if len(artifact.graphs) == 1 and "input_ids" in inputs:
        graph = artifact.graphs[0]
        audited[graph.name].append(graph_feed(graph, {"input_ids": inputs["input_ids"][:1, :1]}, {}))
    return audited


def rounding_spread(artifact: Artifact, models: EagerModels, feeds: dict, reference: dict, prompt, tokens) -> dict:
    """Where the artifact rounds activations to int8 (runners.activations): per stage, the oracle's max move
    when every value within AMBIGUITY of a half step rounds the other way, on the same feeds and, after
    `prompt`, the same decode `tokens`. Empty for any other artifact."""
    if not getattr(models.float64, "rounded_weights", None):
        return {}
    moved = {}
    with rounding_ambiguous_away():
        for graph in artifact.graphs:
            moved.update(models.runner("eager-f64", artifact, graph.name).run(feeds[graph.name]))
        if tokens:
            moved.update(_decode(models.runner("eager-f64", artifact), artifact, prompt, len(tokens), tokens)[0])
    return {name: float(np.max(np.abs(moved[name] - reference[name]), initial=0.0)) for name in reference}


# --------------------------------------------------------------------------- decode steps


def oracle_decode(artifact: Artifact, models: EagerModels, prompt: np.ndarray, steps: int) -> tuple[dict, dict, list]:
    """The oracle's greedy decode of `steps` tokens after `prompt`, and float32 eager replaying its tokens.

    Returns (oracle logits per step, eager32 logits per step, the oracle's tokens).
    """
    max_positions = artifact_config(artifact).max_positions
    lengths = [len(prompt[0]), steps]
    if sum(lengths) > max_positions:
        raise InputError(f"prompt {lengths[0]} + {steps} decode steps exceed max_positions={max_positions}")
    decoded, tokens = _decode(models.runner("eager-f64", artifact), artifact, prompt, steps)
    eager32_decoded = _decode(models.runner("eager", artifact), artifact, prompt, steps, tokens)[0]
    return decoded, eager32_decoded, tokens


def _decode(runner, artifact: Artifact, prompt: np.ndarray, steps: int, tokens: list | None = None):
    """Prefill `prompt` then decode `steps` tokens, greedily or replaying `tokens`; logits per step."""
    lm = CachedLM(runner, artifact_config(artifact).max_positions)
    logits = lm.step(prompt)[:, -1:]
    chosen, outputs = [], {}
    for k in range(steps):
        token = logits.argmax(-1) if tokens is None else tokens[k]  # (B, 1)
        chosen.append(token)
        logits = lm.step(np.asarray(token, dtype=np.int64))
        outputs[f"decode.{k}.logits"] = np.asarray(logits)
    return outputs, chosen


# --------------------------------------------------------------------------- one backend


@dataclass
class BackendRun:
    """One backend's pass over every graph: its outputs, time, device and worst placement audit."""

    name: str
    outputs: dict[str, np.ndarray]
    seconds: float
    device: str
    placement: dict | None
    runner: object  # the last graph's runner; decode steps continue on it


def run_backend(
    name: str, artifact: Artifact, models: EagerModels, feeds: dict, allow_cpu_fallback: bool
) -> BackendRun:
    """Run backend `name` on every graph, each on the oracle's feed for it.

    A GPU ONNX Runtime runner is also audited for placement; the first failing audit is kept.
    """
    outputs, seconds, device, placement, runner = {}, 0.0, "", None, None
    for graph in artifact.graphs:
        runner = models.runner(name, artifact, graph.name)
        outputs.update(runner.run(feeds[graph.name]))
        seconds += runner.last_inference_time or 0.0
        device = runner.device
        audit = runner.placement_audit(feeds[graph.name])
        if audit is not None:
            audit = audit.to_dict()
            if placement is None or (placement["ok"] and not audit["ok"]):
                placement = dict(audit, graph=graph.name, fallback_allowed=allow_cpu_fallback)
    return BackendRun(name, outputs, seconds, device, placement, runner)


def judge_backend(run: BackendRun, report: CheckReport, tolerances: ToleranceConfig | None) -> BackendResult:
    """Compare one backend's outputs with the report's oracle, stage by stage, at the artifact's dtype."""
    comparison = compare(
        report.arrays["reference"],
        run.outputs,
        dtype=report.dtype,
        tolerances=tolerances,
        calibration=report.calibration,
        order=report.stages,
        rounding=report.rounding,
    )
    return BackendResult(run.name, run.device, comparison, run.seconds, run.placement)
