"""`toolkit quantize --tune-scales STEPS`: each block's scale fitted to the float model's next-token distributions.

Rounding fixes each weight's code and zero point; what it leaves free is the float scale of each block
(MatMulNBits' `scales` input, one per block of each output column). Tuned end to end against the float model, the
scales take back part of what the rounding lost (the quantization-parameter training of EfficientQAT and PEQA)
while the codes, zero points and graph stay as the recipe made them: the artifact keeps its recipe's layout and
decode speed, and its eager reference is still its dequantized weights.

The text is the float model's own (sampled_calibration, as GPTQ's), TUNE_ROWS rows of TUNE_TOKENS tokens. The last
HELD_OUT_ROWS rows are not trained on: the mean KL divergence of the quantized model's next-token distributions from
the float model's on them, before and after, is reported, and the tuned scales are kept only where it fell.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from onnx import numpy_helper

from artifact.errors import ConfigError
from artifact.read import validate_onnx
from toolkit.quantize.sensitivity import DEFAULT_CALIBRATION_SEED

# On SmolLM2's permuted draws (4-bit head, 120 steps) 64 rows end nearer float than 32 on all three draws, and 128
# no nearer than 64 on the one draw measured: 120 steps of 2 rows see each of the 60 trained rows about four times.
TUNE_ROWS, TUNE_TOKENS = 64, 256
HELD_OUT_ROWS = 4
TUNE_BATCH = 2  # rows per step
# Adam on each scale's logarithm. On SmolLM2's permuted draws 3e-4 over 120 steps lowers the held-out KL; 3e-3
# overshoots (the training loss rises fivefold before it settles back to where it began).
LEARNING_RATE = 3e-4
TUNE_SEED = 0  # which rows each step trains on


@dataclass
class _Scaled:
    """One MatMulNBits weight: w[N, K] = levels * scale of the element's block (+ offsets), as torch weights."""

    scales: str  # the scales initializer
    stored: np.ndarray  # its values as stored
    block_size: int
    levels: torch.Tensor  # [N, K]: code - zero point, int16 where the zero points are integers (a quarter of float32's)
    offsets: torch.Tensor | None  # [N, K] float32: the float minimums added beside MatMulNBits, where held
    entries: list = field(default_factory=list)  # (torch name, slice or None)
    log_scale: torch.Tensor | None = None  # [N, blocks], trained

    def weight(self) -> torch.Tensor:
        scale = torch.from_numpy(self.stored.reshape(self.levels.shape[0], -1).astype(np.float32))
        step = (scale * torch.exp(self.log_scale)).repeat_interleave(self.block_size, dim=1)
        w = self.levels.to(torch.float32) * step[:, : self.levels.shape[1]]  # [N, K]
        return w if self.offsets is None else w + self.offsets

    def tuned(self) -> np.ndarray:
        scale = self.stored.reshape(self.levels.shape[0], -1).astype(np.float64)
        return (scale * np.exp(self.log_scale.detach().numpy().astype(np.float64))).astype(self.stored.dtype)


def scaled_weights(artifact) -> list[_Scaled]:
    """Every MatMulNBits weight of `artifact`'s graph, with the torch weights (by name, a row slice where fused)
    that its manifest maps onto it."""
    from exporters.quantize import dequantize_nbits

    graph = artifact.graphs[0]
    proto = validate_onnx(graph.model_path)
    initializers = {tensor.name: tensor for tensor in proto.graph.initializer}
    base_dir = str(graph.model_path.parent)

    def read(name):
        return numpy_helper.to_array(initializers[name], base_dir=base_dir)

    found: dict[str, _Scaled] = {}
    for name, place in graph.weights.items():
        spec = place.quantized
        if not spec:
            continue
        if not place.transpose or (place.slice and place.slice[0] != 1):
            raise ConfigError(f"--tune-scales: weight {name!r} is not held as a MatMul's [K, N] split along N")
        scaled = found.get(spec["weight"])
        if scaled is None:
            stored = read(spec["scales"])
            zero_points = read(spec["zero_points"]) if "zero_points" in spec else None
            k, n, block = spec["K"], spec["N"], spec["block_size"]
            ones = np.ones((n, -(-k // block)), dtype=np.float32)
            levels = dequantize_nbits(
                read(spec["weight"]), ones, zero_points, bits=spec["bits"], block_size=block, k=k, n=n
            )
            offsets = None
            if "offsets" in spec:  # [blocks, N]: each block's offset added to its K rows
                repeated = np.repeat(read(spec["offsets"]).astype(np.float32), block, axis=0)[:k]
                offsets = torch.from_numpy(np.ascontiguousarray(repeated.T))
            integral = zero_points is None or zero_points.dtype == np.uint8
            levels = np.ascontiguousarray(levels.T, np.int16 if integral else np.float32)
            scaled = found[spec["weight"]] = _Scaled(spec["scales"], stored, block, torch.from_numpy(levels), offsets)
        scaled.entries.append((name, place.slice))
    return list(found.values())


def tune_scales(
    source, quantized, steps: int, progress=None, seed: int = DEFAULT_CALIBRATION_SEED, text: np.ndarray | None = None
) -> tuple[dict[str, np.ndarray], dict]:
    """({scales initializer: tuned values} (empty where tuning did not lower the held-out KL), the report) for the
    quantized artifact `quantized` of the float artifact `source`, fitted on the text the sampler seeded with `seed`
    writes: `text`, its token ids [TUNE_ROWS, TUNE_TOKENS], where the caller has sampled it already (GPTQ's), else
    sampled here."""
    from torch.nn.utils.stateless import _reparametrize_module

    from runners.eager import eager_runner, model_from_artifact
    from toolkit.quantize.sensitivity import calibration, fed, sampled_calibration

    progress = progress or (lambda message: None)
    if text is None:
        progress(f"writing a text of {TUNE_ROWS} x {TUNE_TOKENS} tokens with the float model to fit the scales on")
        calibrated = sampled_calibration(source, calibration(source), TUNE_ROWS, TUNE_TOKENS, seed)
    else:
        progress(f"fitting the scales on the {len(text)} x {text.shape[1]} tokens GPTQ calibrated on")
        calibrated = fed(calibration(source), text)
    float_model, float_runner, feed = calibrated.model, calibrated.runner, calibrated.feed
    model = model_from_artifact(quantized).eval()
    runner = eager_runner(quantized, torch.float32, "eager", model=model)
    for parameter in [*model.parameters(), *float_model.parameters()]:
        parameter.requires_grad_(False)
    scaled = scaled_weights(quantized)
    for weight in scaled:  # the fit computes these from the levels: the model's own copies go
        for name, _ in weight.entries:
            model.get_parameter(name).data = torch.empty(0)
        weight.log_scale = torch.zeros(weight.levels.shape[0], weight.stored.size // weight.levels.shape[0])
        weight.log_scale.requires_grad_(True)
    rows = len(feed["input_ids"])
    args = [torch.from_numpy(np.asarray(feed[spec.name])) for spec in runner.input_specs]

    def batch(which):
        return [a[which] if a.dim() and a.shape[0] == rows else a for a in args]

    def kl(which) -> torch.Tensor:
        """Mean KL(float || quantized) of the next-token distributions of rows `which`, nats per token."""
        with torch.no_grad():
            target = float_runner.forward(float_model, *batch(which))["logits"].log_softmax(-1)
        values = {}
        for weight in scaled:
            w = weight.weight()
            for name, cut in weight.entries:
                values[name] = w if cut is None else w[cut[1] : cut[2]]
        with _reparametrize_module(model, values):
            logits = runner.forward(model, *batch(which))["logits"]
        return (target.exp() * (target - logits.log_softmax(-1))).sum(-1).mean()

    trained, held_out = rows - HELD_OUT_ROWS, torch.arange(rows - HELD_OUT_ROWS, rows)
    if trained < TUNE_BATCH:
        raise ConfigError(f"--tune-scales: the text has {rows} rows; it needs {TUNE_BATCH + HELD_OUT_ROWS}")
    with torch.no_grad():
        before = float(kl(held_out))  # log_scale 0: the rounded weights, as dequantize_nbits computes them
    optimizer = torch.optim.Adam([w.log_scale for w in scaled], lr=LEARNING_RATE)
    choose = np.random.default_rng(TUNE_SEED)
    for step in range(steps):
        if step % 20 == 0:
            progress(f"fitting the scales of {len(scaled)} MatMulNBits weights: step {step + 1} of {steps}")
        loss = kl(torch.from_numpy(np.sort(choose.choice(trained, TUNE_BATCH, replace=False))))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        after = float(kl(held_out))
    kept = after < before
    report = {
        "method": "each MatMulNBits block's scale fitted by Adam on its logarithm to the float model's next-token "
        "distributions (mean KL) on text the float model wrote; codes and zero points unchanged",
        "steps": steps,
        "rows": trained,
        "tokens_per_row": int(args[0].shape[1]),
        "learning_rate": LEARNING_RATE,
        "held_out_rows": HELD_OUT_ROWS,
        "held_out_kl_before": before,
        "held_out_kl_after": after,
        "kept": kept,
    }
    return ({w.scales: w.tuned() for w in scaled} if kept else {}), report
