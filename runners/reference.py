"""The ONNX reference evaluator: pure Python, independent of ONNX Runtime."""

from __future__ import annotations

from artifact.errors import ModelFileError
from runners.base import Runner
from runners.contrib_ops import Evaluator


class ReferenceRunner(Runner):
    name = "onnx-reference"
    device = "onnx.reference (python)"

    def __init__(self, model_proto, input_specs, output_names, config=None):
        super().__init__(input_specs, output_names, config)
        # The model's local functions (the custom ops' bodies) are evaluated from the proto itself; the
        # com.microsoft operators a quantized artifact holds, and Gelu inside a function, from CONTRIB_OPS.
        try:
            self.evaluator = Evaluator(model_proto)
        except Exception as exc:  # the evaluator raises NotImplementedError, ValueError, ... on bad graphs
            raise ModelFileError(f"onnx.reference could not load the model: {type(exc).__name__}: {exc}") from None

    def _infer(self, feed):
        values = self.evaluator.run(self.output_names, feed)
        return dict(zip(self.output_names, values, strict=False))
