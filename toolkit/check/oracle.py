"""The original model as an oracle: transformers, loaded from the checkpoint an artifact was imported from.

`toolkit check` holds every backend to the float64 eager model rebuilt from the artifact. When the import
misreads a checkpoint (a config key it does not know, a weight it maps wrongly), that rebuild shares the
mistake and the check passes. This module loads the *original* with transformers, from the checkpoint the
manifest records (its files' sha256 checked first), and compares the rebuild with it stage by stage:

    ours (float64, rebuilt from the artifact)    transformers (float32, from the checkpoint)
    embed_tokens                                 hidden_states[0]
    block.{i}.output, i < L-1                    hidden_states[i + 1] (the residual stream after block i)
    block.{L-1}.output                           the last decoder layer's output (a forward hook: transformers'
                                                 hidden_states[L] is the final norm's output, not block L-1's)
    final_norm                                   hidden_states[L]
    logits                                       logits
    decode.{k}.logits                            logits of step k through transformers' own KV cache, fed the
                                                 oracle's greedy tokens

Tolerance: transformers runs in float32, so it is one more float32 implementation of the same function and is
held to the same bar as a backend: `allowed = multiple * calibration + atol + rtol * max|original|` with the
artifact dtype's defaults (float32: 8, 1e-6, 1e-5), where calibration is our own float32 model's max abs error
against our float64 model on the same stage. A reduced-precision export's weights were rounded, so it is held
to its dtype's tolerance (float16: rtol 1e-2).
"""

from __future__ import annotations

import inspect
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from artifact import Artifact, sha256_file
from artifact.errors import (
    BackendUnavailableError,
    ConfigError,
    ExportError,
    HashMismatchError,
    InputError,
    ModelFileError,
)
from artifact.write import check_output_dir, write_staged
from models.artifacts import artifact_config, open_artifact
from runners.compare import Comparison, ToleranceConfig, compare
from runners.eager import computing_in, model_from_artifact

ORACLES = ("transformers", "llama.cpp")
INSTALL_HINT = "pip install '.[oracle]' (or pip install 'transformers>=4.45')"
FAMILIES = ("llama", "gpt")  # the families a Hugging Face import produces (models/checkpoints/huggingface.py)
_SHA256 = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------- the checkpoint


def import_transformers():
    """The transformers module, or a one-line error saying how to install it."""
    try:
        import transformers
    except ImportError:
        raise BackendUnavailableError(
            f"--oracle transformers needs the transformers package, which is not installed here; {INSTALL_HINT}"
        ) from None
    return transformers


def transformers_available() -> bool:
    try:
        import_transformers()
    except BackendUnavailableError:
        return False
    return True


def checkpoint_files(directory: Path) -> list[Path]:
    """The files that define a Hugging Face checkpoint's function: config.json and every *.safetensors file."""
    directory = Path(directory)
    return [directory / "config.json", *sorted(directory.glob("*.safetensors"))]


def checkpoint_hashes(directory: str | os.PathLike) -> dict[str, str]:
    """{file name: sha256} of the checkpoint's files (streamed), for the manifest's `source.sha256`."""
    return {path.name: sha256_file(path) for path in checkpoint_files(Path(directory)) if path.is_file()}


# The checkpoint format each oracle loads, and how a user makes an artifact from one.
SOURCE_FORMATS = {"transformers": "huggingface", "llama.cpp": "gguf"}
_EXPORT_HINT = {"huggingface": "toolkit export --from DIR", "gguf": "toolkit export --from FILE.gguf"}
_SOURCE_NAMES = {"huggingface": "a Hugging Face directory", "gguf": "a GGUF file"}


def verify_checkpoint(artifact: Artifact, oracle: str = "transformers") -> Path:
    """The checkpoint `artifact` was imported from (a Hugging Face directory for transformers, a GGUF file for
    llama.cpp), after checking that its files are the ones hashed at export. A preset artifact, another format, an
    unrecorded hash, a moved or changed checkpoint: one-line errors."""
    wanted = SOURCE_FORMATS[oracle]
    source = artifact.manifest.source
    where = f"{artifact.location}/manifest.json"
    if not isinstance(source, dict) and source is not None:
        source = dict(source) if hasattr(source, "items") else None
    if not source or source.get("format") != wanted:
        made = (
            f"imported from a {source.get('format')} checkpoint"
            if source and isinstance(source.get("format"), str)
            else f"exported from preset {artifact.manifest.preset!r}"
            if artifact.manifest.preset
            else "not imported from a checkpoint"
        )
        raise ConfigError(
            f"--oracle {oracle} needs an artifact imported from {_SOURCE_NAMES[wanted]} ({_EXPORT_HINT[wanted]}); "
            f"{artifact.location} was {made}"
        )
    path, hashes = source.get("path"), source.get("sha256")
    what = "checkpoint directory" if wanted == "huggingface" else "GGUF file"
    if not isinstance(path, str) or not path:
        raise ModelFileError(f"{where}: source.path must be the {what}, got {path!r}")
    if not hashes:
        raise ModelFileError(
            f"{where}: records no sha256 of the source checkpoint's files (exported by an older toolkit), so the "
            f"original cannot be verified; re-export it with `toolkit export --from {path}`"
        )
    if not isinstance(hashes, dict) or not all(
        isinstance(k, str)
        and k
        and Path(k).name == k
        and k not in (".", "..")
        and isinstance(v, str)
        and _SHA256.fullmatch(v)
        for k, v in hashes.items()
    ):
        raise ModelFileError(f"{where}: source.sha256 must map plain file names to sha256 hex digests")
    recorded = Path(path)
    if wanted == "gguf":
        if list(hashes) != [recorded.name]:
            raise ModelFileError(f"{where}: source.sha256 must hold exactly the GGUF file {recorded.name!r}")
        directory = recorded.parent
        present = recorded.is_file()
    else:
        directory = recorded
        present = directory.is_dir()
    if not present:
        raise ModelFileError(
            f"source {what} {recorded} (recorded in {where}) is not there: it was moved or deleted since the "
            "export; put it back, or re-export from where it is now"
        )
    for name, expected in sorted(hashes.items()):
        file = directory / name
        if not file.is_file():
            raise ModelFileError(
                f"{file}: missing; the source checkpoint changed since {artifact.location} was exported; "
                "re-export it or restore the file"
            )
        actual = sha256_file(file)
        if actual != expected:
            raise HashMismatchError(
                f"{file}: sha256 {actual[:12]}… differs from {expected[:12]}… recorded at export; the source "
                f"checkpoint changed since {artifact.location} was exported; re-export it or restore the file"
            )
    if wanted == "gguf":
        return recorded
    added = sorted(p.name for p in checkpoint_files(directory) if p.is_file() and p.name not in hashes)
    if added:
        raise HashMismatchError(
            f"{directory}: {', '.join(added)} appeared since {artifact.location} was exported; the source "
            "checkpoint changed, re-export it"
        )
    return directory


def load_original(directory: Path):
    """The checkpoint as transformers loads it: AutoModelForCausalLM in float32, evaluation mode. Local files only,
    safetensors only (never a pickle), no remote code."""
    transformers = import_transformers()
    progress = transformers.utils.logging.is_progress_bar_enabled()
    transformers.utils.logging.disable_progress_bar()  # errors are one line; a loading bar on stderr is noise
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(directory), local_files_only=True, use_safetensors=True, trust_remote_code=False
        )
    except Exception as exc:  # transformers raises many types (OSError, ValueError, KeyError...) for a bad checkpoint
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        raise ModelFileError(
            f"{directory}: transformers cannot load this checkpoint ({type(exc).__name__}: {first})"
        ) from None
    finally:
        if progress:
            transformers.utils.logging.enable_progress_bar()
    return model.to(torch.float32).eval()


# --------------------------------------------------------------------------- running both sides


def _layers(model) -> torch.nn.ModuleList:
    base = model.base_model
    for name in ("layers", "h"):  # LlamaModel/MistralModel, GPT2Model
        layers = getattr(base, name, None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise ConfigError(f"--oracle transformers: cannot find the decoder layers of {type(model).__name__}")


@torch.no_grad()
def original_stages(model, input_ids: np.ndarray, layers: int) -> dict[str, np.ndarray]:
    """transformers' outputs under our stage names (see the module docstring for the mapping)."""
    modules = _layers(model)
    if len(modules) != layers:
        raise ModelFileError(
            f"the original has {len(modules)} decoder layers but the artifact has {layers}; the import misread "
            "the checkpoint's depth"
        )
    captured = {}

    def hook(_module, _args, output):
        captured["last"] = output[0] if isinstance(output, (tuple, list)) else output

    handle = modules[-1].register_forward_hook(hook)
    try:
        out = model(input_ids=torch.from_numpy(input_ids), output_hidden_states=True, use_cache=False)
    finally:
        handle.remove()
    hidden = out.hidden_states
    if hidden is None or len(hidden) != layers + 1 or "last" not in captured:
        raise ConfigError(
            f"--oracle transformers: expected {layers + 1} hidden states from {type(model).__name__}, got "
            f"{None if hidden is None else len(hidden)}; this transformers version reports them differently"
        )
    stages = {"embed_tokens": hidden[0]}
    for i in range(layers - 1):
        stages[f"block.{i}.output"] = hidden[i + 1]
    stages[f"block.{layers - 1}.output"] = captured["last"]
    stages["final_norm"] = hidden[layers]
    stages["logits"] = out.logits
    return {name: tensor.detach().to(torch.float32).numpy() for name, tensor in stages.items()}


@torch.no_grad()
def original_decode(model, input_ids: np.ndarray, tokens: list) -> dict[str, np.ndarray]:
    """Prefill `input_ids` through transformers' own KV cache, then feed `tokens` (B, 1) one by one; logits per step."""
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    out = model(input_ids=torch.from_numpy(input_ids), use_cache=True)
    outputs = {}
    for k, token in enumerate(tokens):
        cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        out = model(input_ids=torch.from_numpy(np.asarray(token, dtype=np.int64)), use_cache=True, **{cache_kw: cache})
        outputs[f"decode.{k}.logits"] = out.logits.detach().to(torch.float32).numpy()
    return outputs


def mapped_stages(layers: int) -> list[str]:
    return ["embed_tokens", *(f"block.{i}.output" for i in range(layers)), "final_norm", "logits"]


@torch.no_grad()
def our_stages(model64: torch.nn.Module, input_ids: np.ndarray, names: list[str]) -> tuple[dict, dict]:
    """The float64 rebuild's stages `names` on `input_ids`, and per stage float32's max abs error against it."""
    ids = torch.from_numpy(np.asarray(input_ids, dtype=np.int64))
    # model64 is a float64 copy or a model cast a block at a time (computing_in): no second copy either way
    with computing_in(model64, torch.float64):
        ours = {k: v.numpy() for k, v in model64(ids).items() if k in names}
    with computing_in(model64, torch.float32):
        ours32 = model64(ids)
    calibration = {k: float(np.max(np.abs(ours32[k].double().numpy() - ours[k]), initial=0.0)) for k in ours}
    return ours, {k: v if np.isfinite(v) else 0.0 for k, v in calibration.items()}


# --------------------------------------------------------------------------- the comparison


@dataclass
class OracleRun:
    """transformers' outputs on one check's inputs and what they are compared with."""

    original: dict[str, np.ndarray]  # transformers, float32, under our stage names
    ours: dict[str, np.ndarray]  # the float64 rebuild from the artifact
    calibration: dict[str, float]
    stages: list[str]
    info: dict
    seconds: float


def check_prompt_feed(inputs: dict | None, oracle: str) -> None:
    """An oracle runs the original on a fresh prompt: input_ids at positions 0..T-1, nothing else."""
    if inputs is None:
        return
    extra = sorted(set(inputs) - {"input_ids", "position_ids"})
    if extra:
        raise ConfigError(
            f"--oracle {oracle} feeds the original a fresh prompt (input_ids only); the inputs also give {extra}"
        )
    ids, positions = inputs.get("input_ids"), inputs.get("position_ids")
    if positions is not None and ids is not None:
        expected = np.broadcast_to(np.arange(np.shape(ids)[-1]), np.shape(ids))
        if np.shape(positions) != np.shape(ids) or not np.array_equal(positions, expected):
            raise ConfigError(
                f"--oracle {oracle} feeds the original positions 0..T-1; the inputs give other position_ids"
            )


def refuse_oracle(artifact: Artifact, inputs: dict | None, tolerances: ToleranceConfig | None) -> Path:
    """Every reason the oracle cannot run, before any model is built; returns the verified checkpoint directory."""
    import_transformers()
    if artifact.manifest.quantization and tolerances is None:
        raise ConfigError(
            f"{artifact.location} is quantized, so it differs from the original by the quantization error, which "
            "the float tolerances do not allow; give --tolerances with the error you accept"
        )
    check_prompt_feed(inputs, "transformers")
    directory = verify_checkpoint(artifact)
    if artifact.family not in FAMILIES:
        raise ConfigError(
            f"--oracle transformers compares language models ({', '.join(FAMILIES)}), not {artifact.family!r}"
        )
    return directory


def run_oracle(
    artifact: Artifact,
    directory: Path,
    model64: torch.nn.Module,
    input_ids: np.ndarray,
    *,
    decode: tuple[dict, dict, list] | None = None,
    stages: list[str] | None = None,
) -> OracleRun:
    """Run the original (from the verified `directory`) and our float64 rebuild on `input_ids`.

    decode: (our float64 decode logits, their calibration, the greedy tokens) from the cross-check, replayed
    through transformers' cache. stages: a subset of the mapped stages (export verification uses logits only).
    """
    transformers = import_transformers()
    layers = artifact_config(artifact).layers
    names = stages or mapped_stages(layers)
    ours, calibration = our_stages(model64, input_ids, names)  # first: it refuses out-of-range token ids
    start = time.perf_counter()
    model = load_original(directory)
    original = {k: v for k, v in original_stages(model, input_ids, layers).items() if k in names}
    if decode is not None:
        decoded, decode_calibration, tokens = decode
        original.update(original_decode(model, input_ids, tokens))
        ours.update(decoded)
        calibration.update(decode_calibration)
        names = names + list(decoded)
    seconds = time.perf_counter() - start
    info = {
        "name": "transformers",
        "checkpoint": str(directory),
        "architecture": type(model).__name__,
        "transformers": transformers.__version__,
        "compared": "eager-f64 (rebuilt from the artifact) against the original in float32",
        "stages": names,
    }
    return OracleRun(original, ours, calibration, names, info, seconds)


def judge_oracle(run: OracleRun, dtype: str, tolerances: ToleranceConfig | None = None) -> Comparison:
    """Our rebuild against the original, stage by stage (the original is the reference)."""
    return compare(
        run.original, run.ours, dtype=dtype, tolerances=tolerances, calibration=run.calibration, order=run.stages
    )


def layer_of(stage: str) -> str:
    """'block.3.output' -> 'layer 3'; other stages are named as they are."""
    match = re.fullmatch(r"block\.(\d+)\.output", stage)
    return f"layer {match.group(1)}" if match else stage


def check_input_ids(input_ids) -> np.ndarray:
    ids = np.asarray(input_ids)
    if ids.ndim != 2 or ids.dtype.kind not in "iu":
        raise InputError(f"input 'input_ids': expected a 2-D integer array, got {ids.dtype} {list(ids.shape)}")
    return ids.astype(np.int64)


def oracle_check(report, artifact: Artifact, model64: torch.nn.Module, directory: Path, tolerances=None) -> None:
    """Add to a cross-check `report` the comparison of our float64 rebuild with the original on the check's
    prompt (and its decode steps, replaying the oracle's greedy tokens through transformers' cache)."""
    from toolkit.check.crosscheck import BackendResult

    ids = check_input_ids(report.arrays["inputs"]["input_ids"])
    decode = None
    tokens = report.arrays.get("decode_tokens")
    if tokens:
        decoded = {k: v for k, v in report.arrays["reference"].items() if k.startswith("decode.")}
        decode = (decoded, {k: report.calibration.get(k, 0.0) for k in decoded}, tokens)
    run = run_oracle(artifact, directory, model64, ids, decode=decode)
    comparison = judge_oracle(run, report.dtype, tolerances)
    device = f"transformers {run.info['transformers']} {run.info['architecture']}, float32 cpu"
    report.oracle = BackendResult("transformers", device, comparison, run.seconds)
    report.oracle_info = {**run.info, "first_position": first_positions(run, comparison)}
    report.arrays["oracle"] = {"original": run.original, "ours": run.ours, "calibration": run.calibration}


def first_positions(run: OracleRun, comparison: Comparison) -> dict[str, int]:
    """Per failing prompt stage (B, T, ...), the first sequence position whose error leaves tolerance: a dropped
    sliding window, for one, shows up exactly from the window's length on."""
    positions = {}
    for output in comparison.outputs:
        ours, original = run.ours.get(output.name), run.original.get(output.name)
        if output.passed or output.name.startswith("decode.") or ours is None or original is None:
            continue
        if ours.shape != original.shape or ours.ndim < 2:
            continue
        diff = np.abs(ours.astype(np.float64) - original.astype(np.float64))
        per_position = np.max(
            np.where(np.isfinite(diff), diff, np.inf), axis=tuple(a for a in range(diff.ndim) if a != 1)
        )
        bad = np.nonzero(per_position > output.allowed)[0]
        if bad.size:
            positions[output.name] = int(bad[0])
    return positions


# --------------------------------------------------------------------------- `toolkit export --from` verification

VERIFY_TOKENS = 8
# Bytes per parameter the verification holds beside the imported model: transformers' float32 copy (4), our
# float64 rebuild (8) and its float32 copy (4), plus the imported float32 model still alive in the export (4).
VERIFY_BYTES_PER_PARAMETER = 20
# Beside those: transformers' import and its model classes (about 0.11 GiB resident beside torch, measured),
# with room for the activations of the few verification tokens.
VERIFY_OVERHEAD_BYTES = 1 << 28


def why_not_verify(source: dict, parameters: int) -> str | None:
    """Why `toolkit export --from` skips its default verification (None: verify): not a Hugging Face directory,
    no transformers, or the original would not fit in memory beside the export."""
    if source.get("format") != "huggingface":
        return f"transformers loads Hugging Face directories, not {source.get('format')} checkpoints"
    if not transformers_available():
        return f"transformers is not installed ({INSTALL_HINT})"
    from toolkit.memory import available_memory  # looked up per call, so that tests can set the machine

    needed = parameters * VERIFY_BYTES_PER_PARAMETER + VERIFY_OVERHEAD_BYTES
    available = available_memory()
    if available is None:
        return "this machine does not say how much memory is free (--verify forces it)"
    if needed > available:
        return f"the original needs about {needed / 2**30:.1f} GiB beside the export, {available / 2**30:.1f} GiB is free (--verify forces it)"
    return None


def verify_export(artifact: Artifact, directory: Path, *, seed: int = 0):
    """Hold a fresh import's logits on a few tokens to the original loaded with transformers; ExportError when they
    disagree. Returns the logits' OutputComparison and the oracle's info."""
    config = artifact_config(artifact)
    ids = np.random.default_rng(seed).integers(0, config.vocab_size, (1, min(VERIFY_TOKENS, config.max_positions)))
    model64 = model_from_artifact(artifact)  # float32, run in float64 a block at a time
    run = run_oracle(artifact, directory, model64, ids.astype(np.int64), stages=["logits"])
    result = judge_oracle(run, artifact.manifest.dtype)["logits"]
    if not result.passed:
        raise ExportError(
            f"the export disagrees with the original {run.info['architecture']} that transformers "
            f"{run.info['transformers']} loads from {directory}: logits {result.reason} on {ids.shape[1]} tokens "
            f"(arg-max agreement {result.argmax_agreement:.0%}); the import misreads this checkpoint, nothing was "
            "written (--no-verify writes it anyway)"
        )
    return result, run.info


def recorded_source(source: dict, checkpoint: str) -> dict:
    """The manifest's `source`: a Hugging Face directory or a GGUF file is recorded by absolute path with its
    files' sha256 (config.json and *.safetensors, or the .gguf), so `toolkit check --oracle transformers|llama.cpp`
    can verify and load the original."""
    if source.get("format") == "gguf":
        path = Path(checkpoint).resolve()
        return {**source, "path": str(path), "sha256": {path.name: sha256_file(path)}}
    if source.get("format") != "huggingface":
        return dict(source)
    directory = Path(checkpoint).resolve()
    return {**source, "path": str(directory), "sha256": checkpoint_hashes(directory)}


def verified_export(write, out_dir: str, checkpoint: Path):
    """Export with `write` into a sibling staging directory, verify it against the original, and only then swap it
    in for `out_dir`: a disagreement leaves the previous artifact at `out_dir` as it was."""
    out = Path(out_dir)
    check_output_dir(out)

    def fill(staging: Path):
        return verify_export(write(staging), checkpoint)

    result, info = write_staged(out, fill)
    summary = (
        f"{info['architecture']} with transformers {info['transformers']}, logits max abs {result.max_abs:.2e} <= "
        f"allowed {result.allowed:.2e} on {result.reference_shape[1]} tokens"
    )
    return open_artifact(out), summary
