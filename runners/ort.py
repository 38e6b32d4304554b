"""ONNX Runtime backends. onnxruntime is imported lazily so the rest of the toolkit works without it."""

from __future__ import annotations

from pathlib import Path

from runners.base import Runner
from toolkit.errors import BackendUnavailableError, ModelFileError

PROVIDERS = {"ort-cpu": "CPUExecutionProvider", "ort-cuda": "CUDAExecutionProvider"}


def _onnxruntime():
    try:
        import onnxruntime
    except ImportError as exc:
        raise BackendUnavailableError(f"onnxruntime is not importable ({exc}); install the `onnxruntime` package") from None
    return onnxruntime


def available_providers() -> list[str]:
    try:
        return list(_onnxruntime().get_available_providers())
    except BackendUnavailableError:
        return []


class SessionLoader:
    """Builds an InferenceSession for exactly one provider: no silent fall-back to another."""

    def __init__(self, model_path: Path, provider: str, intra_op_threads: int = 0):
        self.model_path = Path(model_path)
        self.provider = provider
        self.intra_op_threads = intra_op_threads

    def __call__(self):
        ort = _onnxruntime()
        available = ort.get_available_providers()
        if self.provider not in available:
            raise BackendUnavailableError(
                f"execution provider {self.provider} is not available in this onnxruntime "
                f"({ort.__version__}); available providers: {', '.join(available)}"
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = self.intra_op_threads
        options.log_severity_level = 3  # warnings about unused initializers are noise for users
        try:
            return ort.InferenceSession(str(self.model_path), sess_options=options, providers=[self.provider])
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise ModelFileError(f"{self.model_path}: onnxruntime could not load the model: {exc}") from None


class OrtRunner(Runner):
    def __init__(self, loader: SessionLoader, input_specs, output_names, config=None, name="ort-cpu"):
        super().__init__(input_specs, output_names, config)
        self.name = name
        self.session = loader()
        self.device = self.session.get_providers()[0]
        if self.device != loader.provider:
            raise BackendUnavailableError(f"{name}: session runs on {self.device}, not the requested {loader.provider}")

    def _infer(self, feed):
        values = self.session.run(self.output_names, feed)
        return dict(zip(self.output_names, values))
