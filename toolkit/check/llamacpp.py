"""The original GGUF as an oracle: llama.cpp (llama-cpp-python) run on the file an artifact was imported from.

`toolkit check --oracle llama.cpp` verifies the GGUF the manifest records (path and sha256), lets llama.cpp
prefill the check's prompt and decode greedily through its own KV cache, then runs our float64 rebuild of the
artifact on the same tokens (prompt + llama.cpp's greedy tokens) and compares logits position by position:

    logits          the prompt's positions (llama.cpp's batched prefill)
    decode.logits   the positions llama.cpp computed one token at a time through its cache

llama.cpp reports logits only, so this oracle localises to prefill vs decode, not to a layer.

Tolerance: llama.cpp's CPU kernels round the activations to the weights' vector type before each matrix
product (F16 for F16 weights, 8-bit blocks for quantized ones), so it is not one more float32 implementation
of the function, and a max-abs bar would be meaningless. The measure is the logits' relative RMS error,
||ours - llama.cpp|| / ||llama.cpp|| over every position, held to a bound set by the least precise matrix type of
the GGUF (or of the artifact, when it is stored in a lower precision):

    float32 weights    1e-5    (measured about 3e-7 on a 4-layer model)
    float32, GELU      1e-3    (llama.cpp's CPU GELU reads a float16 table: 1.1e-4 to 2.2e-4 on Gemma 2/3)
    float16 weights    5e-3    (about 6e-4)
    bfloat16 weights   3e-2
    quantized weights  5e-2    (about 2e-2: SmolLM2-135M Q4_1, 30 layers; Q8_0/Q4_0 on a 4-layer model)

Greedy agreement (our arg-max against llama.cpp's greedy token at each decode step) is reported beside it.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from artifact import Artifact
from artifact.errors import BackendUnavailableError, ConfigError, InputError, ModelFileError
from models.artifacts import artifact_config
from runners.compare import Comparison, OutputComparison
from runners.eager import computing_in

NAME = "llama.cpp"
INSTALL_HINT = (
    "pip install '.[llamacpp]' (it builds llama.cpp for this CPU: "
    'CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python)'
)
DEFAULT_DECODE_STEPS = 8
TOLERANCES = {"float32": 1e-5, "float32-gelu": 1e-3, "float16": 5e-3, "bfloat16": 3e-2, "quantized": 5e-2}
_PRECISION_ORDER = ("float32", "float32-gelu", "float16", "bfloat16", "quantized")
GELU_ACTIVATIONS = ("gelu", "gelu_tanh")  # llama.cpp computes both from a float16 lookup table on the CPU
_FLOAT_TYPES = {"F32": "float32", "F64": "float32", "F16": "float16", "BF16": "bfloat16"}
_GGML_TYPE_F32 = 0  # ggml_type of the KV cache llama.cpp is asked for: no F16 rounding of keys and values


def import_llama_cpp():
    """The llama_cpp module, or a one-line error saying how to install it."""
    try:
        import llama_cpp
    except ImportError:
        raise BackendUnavailableError(
            f"--oracle llama.cpp needs the llama-cpp-python package, which is not installed here; {INSTALL_HINT}"
        ) from None
    return llama_cpp


def gguf_precision(path: Path) -> str:
    """The least precise type among the GGUF's matrices: float32, float16, bfloat16 or quantized."""
    from models.checkpoints.gguf_reader import check_gguf_header

    kinds = {
        _FLOAT_TYPES.get(t.tensor_type.name, "quantized")
        for t in check_gguf_header(path).tensors.values()
        if len(t.shape) >= 2
    }
    return max(kinds or {"float32"}, key=_PRECISION_ORDER.index)


def precision_class(path: Path, artifact: Artifact) -> str:
    """The tolerance class: the GGUF's own precision, or the artifact's when it stores the weights less precisely."""
    kinds = [gguf_precision(path), artifact.manifest.dtype if artifact.manifest.dtype in TOLERANCES else "float32"]
    if artifact.manifest.quantization:
        kinds.append("quantized")
    if artifact.manifest.config.get("ffn_activation") in GELU_ACTIVATIONS:
        kinds.append("float32-gelu")
    return max(kinds, key=_PRECISION_ORDER.index)


def refuse_llama_cpp(artifact: Artifact, inputs: dict | None, steps: int) -> Path:
    """Every reason this oracle cannot run, before any model is built; returns the verified GGUF file."""
    from toolkit.check.oracle import check_prompt_feed, verify_checkpoint

    import_llama_cpp()
    check_prompt_feed(inputs, NAME)
    path = verify_checkpoint(artifact, NAME)
    if artifact.family != "llama":
        raise ConfigError(f"--oracle llama.cpp compares GGUF imports of the llama family, not {artifact.family!r}")
    if inputs is not None and inputs.get("input_ids") is not None:
        length = np.shape(inputs["input_ids"])[-1] + steps
        limit = artifact_config(artifact).max_positions
        if length > limit:
            raise ConfigError(
                f"--oracle llama.cpp: the prompt plus {steps} decode steps is {length} tokens, beyond the model's "
                f"context of {limit}; use a shorter prompt or fewer --decode-steps"
            )
    return path


# --------------------------------------------------------------------------- running llama.cpp


class _Log:
    """llama.cpp's log lines while the oracle runs: kept (not printed), so a failed load can say why."""

    def __init__(self, llama_cpp):
        self.llama_cpp, self.lines = llama_cpp, []
        self.callback = llama_cpp.llama_log_callback(self._record)  # referenced here so ctypes keeps it alive

    def _record(self, level, text, _user):
        if level == 3 and text:  # GGML_LOG_LEVEL_ERROR
            self.lines.append(text.decode("utf-8", "replace").strip())

    def __enter__(self):
        self.llama_cpp.llama_log_set(self.callback, ctypes.c_void_p(0))
        return self

    def __exit__(self, *exc):
        from llama_cpp import _logger

        self.llama_cpp.llama_log_set(_logger.llama_log_callback, ctypes.c_void_p(0))


@dataclass
class LlamaCppRun:
    """llama.cpp's logits for prompt + its own greedy tokens, row by row of the check's batch."""

    prompt: np.ndarray  # (B, T) int64
    tokens: np.ndarray  # (B, N) int64: llama.cpp's greedy tokens
    logits: np.ndarray  # (B, T + N, V) float32: position i predicts token i + 1
    info: dict = field(default_factory=dict)
    seconds: float = 0.0


def run_llama_cpp(path: Path, prompt: np.ndarray, steps: int, *, threads: int | None = None) -> LlamaCppRun:
    """Prefill each row of `prompt` with llama.cpp, then decode `steps` greedy tokens through its cache."""
    llama_cpp = import_llama_cpp()
    batch, length = prompt.shape
    threads = threads or len(os.sched_getaffinity(0))
    start = time.perf_counter()
    with _Log(llama_cpp) as log:
        try:
            llm = llama_cpp.Llama(
                model_path=str(path),
                n_ctx=length + steps,
                n_batch=max(length, 1),
                logits_all=True,
                n_threads=threads,
                type_k=_GGML_TYPE_F32,
                type_v=_GGML_TYPE_F32,
                verbose=False,
            )
        except (ValueError, RuntimeError) as exc:
            why = "; ".join(log.lines[-2:]) or str(exc)
            raise ModelFileError(f"{path}: llama.cpp cannot load this GGUF ({why[:300]})") from None
        try:
            vocab = llm.n_vocab()
            rows, tokens = [], []
            for row in prompt:
                llm.reset()
                llm.eval(row.tolist())
                generated = []
                for _ in range(steps):
                    token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
                    generated.append(token)
                    llm.eval([token])
                rows.append(np.array(llm.scores[: llm.n_tokens], dtype=np.float32))
                tokens.append(generated)
        finally:
            llm.close()
    info = {
        "name": NAME,
        "checkpoint": str(path),
        "llama_cpp": llama_cpp.__version__,
        "system": llama_cpp.llama_print_system_info().decode("utf-8", "replace").strip(),
        "threads": threads,
        "vocab": vocab,
    }
    return LlamaCppRun(
        prompt.astype(np.int64),
        np.array(tokens, dtype=np.int64).reshape(batch, steps),
        np.stack(rows),
        info,
        time.perf_counter() - start,
    )


@torch.no_grad()
def rebuild_logits(model64: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    """Our float64 rebuild's logits on `ids` (B, S), all positions at once."""
    with computing_in(model64, torch.float64):
        return model64(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)))["logits"].numpy()


# --------------------------------------------------------------------------- the verdict


def _agreement(original: np.ndarray, ours: np.ndarray, precision: str, name: str) -> OutputComparison:
    diff = ours - original
    scale = float(np.sqrt(np.mean(np.square(original)))) if original.size else 0.0
    rel = float(np.sqrt(np.mean(np.square(diff))) / scale) if scale > 0 else float("inf")
    allowed = TOLERANCES[precision]
    finite = np.isfinite(ours).all() and np.isfinite(original).all()
    passed = finite and rel <= allowed
    reason = (
        ""
        if passed
        else "non-finite logits"
        if not finite
        else f"relative RMS error {rel:.3g} > allowed {allowed:.3g} ({precision} weights)"
    )
    agreement = float(np.mean(original.argmax(-1) == ours.argmax(-1))) if original.size else None
    return OutputComparison(
        name,
        original.shape,
        ours.shape,
        float(np.abs(diff).max(initial=0.0)),
        float(np.abs(diff).mean()) if diff.size else 0.0,
        float("nan"),
        allowed,
        passed,
        reason,
        agreement,
        metric="rel_rms",
        value=rel,
    )


def judge_llama_cpp(run: LlamaCppRun, ours: np.ndarray, precision: str) -> tuple[Comparison, dict]:
    """Our logits `ours` (B, T + N, V) against llama.cpp's: prefill positions and decode positions separately, plus
    greedy agreement (did our arg-max pick llama.cpp's greedy token at each decode step)."""
    if ours.shape != run.logits.shape:
        raise ModelFileError(
            f"llama.cpp's logits are {list(run.logits.shape)} but the artifact's are {list(ours.shape)}; the GGUF's "
            "vocabulary differs from the artifact's"
        )
    length, steps = run.prompt.shape[1], run.tokens.shape[1]
    outputs = [_agreement(run.logits[:, :length].astype(np.float64), ours[:, :length], precision, "logits")]
    greedy = None
    if steps:
        outputs.append(
            _agreement(run.logits[:, length:].astype(np.float64), ours[:, length:], precision, "decode.logits")
        )
        chosen = ours[:, length - 1 : length - 1 + steps].argmax(-1)
        greedy = float(np.mean(chosen == run.tokens))
    return Comparison(outputs), {"greedy_agreement": greedy, "precision": precision, "decode_steps": steps}


def llama_cpp_check(report, artifact: Artifact, model64: torch.nn.Module, path: Path, steps: int) -> None:
    """Add to a cross-check `report` our float64 rebuild against llama.cpp on the check's prompt and `steps` greedy
    decode steps of llama.cpp's own."""
    from toolkit.check.crosscheck import BackendResult
    from toolkit.check.oracle import check_input_ids

    prompt = check_input_ids(report.arrays["inputs"]["input_ids"])
    config = artifact_config(artifact)
    if prompt.size and (prompt.min() < 0 or prompt.max() >= config.vocab_size):
        raise InputError(f"input 'input_ids': token ids must lie in [0, {config.vocab_size}) for llama.cpp")
    if prompt.shape[1] + steps > config.max_positions:
        raise ConfigError(
            f"--oracle llama.cpp: the prompt of {prompt.shape[1]} tokens plus {steps} decode steps is beyond the "
            f"model's context of {config.max_positions}; use a shorter --seq-len or fewer --decode-steps"
        )
    run = run_llama_cpp(path, prompt, steps)
    ours = rebuild_logits(model64, np.concatenate([run.prompt, run.tokens], axis=1))
    comparison, extra = judge_llama_cpp(run, ours, precision_class(path, artifact))
    report.oracle = BackendResult(NAME, f"llama.cpp {run.info['llama_cpp']}, cpu", comparison, run.seconds)
    report.oracle_info = {
        **run.info,
        **extra,
        "compared": "eager-f64 (rebuilt from the artifact) against llama.cpp on the recorded GGUF",
        "stages": [o.name for o in comparison.outputs],
    }
    report.arrays["oracle"] = {"original": {"logits": run.logits, "tokens": run.tokens}, "ours": {"logits": ours}}


def stored_llama_cpp(golden_oracle: dict, prompt: np.ndarray, model64: torch.nn.Module, precision: str) -> tuple:
    """llama.cpp's stored logits and tokens (a golden directory's) against today's float64 rebuild."""
    logits, tokens = golden_oracle.get("logits"), golden_oracle.get("tokens")
    if logits is None or tokens is None or tokens.ndim != 2 or tokens.shape[0] != prompt.shape[0]:
        raise ModelFileError("the golden llama.cpp outputs need 'logits' (B, T+N, V) and 'tokens' (B, N)")
    run = LlamaCppRun(prompt, tokens.astype(np.int64), logits)
    ours = rebuild_logits(model64, np.concatenate([prompt, run.tokens], axis=1))
    return judge_llama_cpp(run, ours, precision)
