"""The `measured` recipe's choice: which MatMul weights keep 8 bits, from each one's measured effect on the model.

llama.cpp's Q4_K_M gives more bits to the tensors that matter most (the value and down projections of some
layers) by a fixed rule. Here the rule is measured on the model at hand: each MatMul weight alone is replaced by
its 4-bit k-quant (the rest float), the float model runs a calibration text, and the mean KL divergence of its
next-token distributions from the float model's is that weight's sensitivity. The most sensitive weights are
promoted to 8 bits while their elements stay within `share` of all MatMul weights' (greedily, most sensitive
first, skipping one that would overflow the share). The calibration text is not the quality report's
perplexity text, so the report measures the choice on text the choice did not see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from artifact.errors import ConfigError
from exporters.kquant import kquant_blocks
from exporters.quantize import HEAD, _reconstruct

PROMOTED_SHARE = 0.15  # about Q4_K_M's share of 6-bit weights among its 4-bit ones
CALIBRATION_TEXT = (
    "In 1905 Albert Einstein published four papers that changed physics: the photoelectric effect, Brownian "
    "motion, special relativity and the equivalence of mass and energy. "
    "import numpy as np\nfor i in range(10):\n    print(i * i)\n"
    "The recipe calls for two cups of flour, a pinch of salt and three eggs, whisked until smooth. "
    "Rivers carve valleys over millions of years, carrying sediment down to the sea."
)
CALIBRATION_SEED = 1  # token ids of the calibration text for artifacts without a tokenizer


@dataclass
class Promotion:
    """The measured choice: the MatMul weights (B initializers) promoted to 8 bits, every measured weight's
    sensitivity (mean KL, nats per token) and the share of MatMul weight elements promoted."""

    promoted: set[str]
    sensitivity: dict[str, float]
    share: float
    limit: float
    elements: dict[str, int] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)  # B -> the torch weights it holds, joined by "+"
    four_bit: dict = field(default_factory=dict, repr=False)  # B -> its 4-bit NBitsWeight, reused by the rewrite

    def report(self) -> dict:
        ranked = sorted(self.sensitivity, key=self.sensitivity.get, reverse=True)
        return {
            "method": "each MatMul weight alone at 4-bit k-quant, mean KL of next-token distributions from the "
            "float model's on a calibration text; most sensitive promoted to 8 bits within the share",
            "share_limit": self.limit,
            "share_promoted": self.share,
            "promoted": [self.labels.get(b, b) for b in ranked if b in self.promoted],
            "sensitivity": {self.labels.get(b, b): self.sensitivity[b] for b in ranked},
        }


def calibration_ids(source, config) -> list[int]:
    directory = source.directory
    if directory is not None and (directory / "tokenizer.json").is_file():
        from models.tokenizer import TextTokenizer

        ids = TextTokenizer.from_artifact(directory).encode(CALIBRATION_TEXT)
    else:
        ids = np.random.default_rng(CALIBRATION_SEED).integers(0, config.vocab_size, 96).tolist()
    return ids[: config.max_positions]


def weights_of(
    matmul_b: set[str], source_map: dict, folded: dict[str, str], head: bool = False
) -> dict[str, list[dict]]:
    """{B: the weight-map entries of the torch weights it holds, re-pointed at B}: a fused B (QKV, gate/up) holds
    several, each a slice; a B folded from a transposed initializer holds its weight transposed the other way.
    The vocabulary projection's B only with `head`."""
    held: dict[str, list[dict]] = {}
    for name, entry in source_map.items():
        location, transpose = entry["initializer"], bool(entry.get("transpose"))
        moved = dict(entry)
        if location not in matmul_b and location in folded:
            location, transpose = folded[location], not transpose
            if entry.get("slice"):  # the slice's axis is the stored initializer's, which the fold swapped
                axis, start, stop = entry["slice"]
                moved["slice"] = [1 - axis, start, stop]
        if location in matmul_b and (head or name != HEAD):
            held.setdefault(location, []).append(dict(moved, name=name, initializer=location, transpose=transpose))
    return held


@dataclass
class Calibration:
    """The float model rebuilt from an artifact (its eager reference), its runner, and the feed of the
    calibration text: what --recipe measured and --imatrix both run."""

    model: torch.nn.Module
    runner: object
    feed: dict


def calibration(source) -> Calibration:
    """The Calibration of `source`'s one graph."""
    from models.artifacts import artifact_config
    from models.registry import lm_defaults
    from runners.eager import eager_runner, model_from_artifact

    if len(source.graphs) != 1:
        raise ConfigError(f"{source.location} has {len(source.graphs)} graphs; calibration runs one")
    config = artifact_config(source)
    model = model_from_artifact(source).eval()
    runner = eager_runner(source, torch.float32, "eager", model=model)
    ids = np.asarray([calibration_ids(source, config)], dtype=np.int64)
    return Calibration(model, runner, {"input_ids": ids, **lm_defaults(runner.input_specs, ids)})


def measure(
    calibrated: Calibration,
    weights,
    matmul_b: set[str],
    source_map: dict,
    folded: dict,
    *,
    bits: int,
    block_size: int,
    share: float = PROMOTED_SHARE,
    importance: dict | None = None,
    zero_points: str = "offsets",
):
    """The Promotion for one graph's MatMul weights (`weights`: the prepared graph's GraphWeights), measured on
    the calibrated float model, promoting at most `share` of their elements. importance: {B: [K]}, the --imatrix
    weighting of each 4-bit k-quant. zero_points: the k-quants' block minimums (kquant_blocks)."""
    model = calibrated.model

    def log_probs() -> np.ndarray:
        logits = calibrated.runner.run(calibrated.feed)["logits"][0].astype(np.float64)
        shifted = logits - logits.max(-1, keepdims=True)
        return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))

    reference = log_probs()
    parameters = dict(model.named_parameters(remove_duplicate=False))
    held = weights_of(matmul_b, source_map, folded)
    sensitivity, elements, four_bit = {}, {}, {}
    with torch.no_grad():
        for b, entries in held.items():
            stored = weights.array(b)
            four_bit[b] = quantized = kquant_blocks(stored, bits, block_size, (importance or {}).get(b), zero_points)
            dequantized = quantized.dequantize().astype(np.float32, copy=False)
            kept = [(parameters[e["name"]], parameters[e["name"]].detach().clone()) for e in entries]
            for entry, (parameter, _) in zip(entries, kept, strict=True):
                parameter.copy_(torch.from_numpy(np.ascontiguousarray(_reconstruct(dequantized, entry))))
            measured = log_probs()
            for parameter, original in kept:
                parameter.copy_(original)
            sensitivity[b] = float((np.exp(reference) * (reference - measured)).sum(-1).mean())
            elements[b] = int(stored.size)
    total = sum(elements.values())
    promoted, used = set(), 0
    for b in sorted(sensitivity, key=sensitivity.get, reverse=True):
        if used + elements[b] <= share * total:
            promoted.add(b)
            used += elements[b]
    for b in promoted:  # promoted weights are made again at 8 bits
        four_bit.pop(b)
    labels = {b: "+".join(entry["name"].removesuffix(".weight") for entry in entries) for b, entries in held.items()}
    return Promotion(promoted, sensitivity, used / total if total else 0.0, share, elements, labels, four_bit)


SAMPLING_TEMPERATURE = 0.9
# The sampler's seed where none is given (toolkit quantize --calibration-seed). Each seed writes another text, and
# GPTQ's rounding and the scale fit follow the text: on SmolLM2 four seeds moved one recipe's perplexity over about
# two points (README), so one seed's result is one draw.
DEFAULT_CALIBRATION_SEED = 0


def sampled_calibration(
    source,
    calibrated: Calibration,
    rows: int,
    tokens: int,
    seed: int = DEFAULT_CALIBRATION_SEED,
    backend: str = "ort-cpu",
) -> Calibration:
    """`calibrated` with a longer feed, written by the float model itself: `rows` sequences of `tokens`, each
    starting from its own slice of the calibration text (the text cut in `rows` pieces of equal length) and
    continued by sampling the float artifact `source` on the runner `backend` (the recipes sample on ONNX Runtime),
    all rows in one batch (temperature SAMPLING_TEMPERATURE, no stop token, the sampler seeded with `seed`): text in
    the model's own distribution, where no corpus ships with the toolkit. Rows are cut to the model's context where
    it is shorter than `tokens`. A graph without a KV cache (a stages export) is fed every row whole at each token
    (`_whole_rows`)."""
    from models.artifacts import artifact_config
    from models.registry import has_cache
    from runners.decoding.generate import CachedLM, Sampler, Sampling
    from runners.registry import create_runner

    tokens = min(tokens, artifact_config(source).max_positions)
    text = calibrated.feed["input_ids"][0].tolist()
    piece = max(min(len(text) // rows, tokens - 1), 1)
    ids = np.asarray([(text[i * piece : (i + 1) * piece] + text)[:piece] for i in range(rows)], dtype=np.int64)
    runner = create_runner(backend, source)
    step = CachedLM(runner, tokens).step if has_cache(runner.input_specs) else _whole_rows(runner)
    sample = Sampler(Sampling(temperature=SAMPLING_TEMPERATURE, seed=seed))
    logits = step(ids)[:, -1]
    while ids.shape[1] < tokens:
        chosen = np.array([[sample(row)] for row in logits], dtype=np.int64)
        ids = np.concatenate([ids, chosen], axis=1)
        if ids.shape[1] < tokens:
            logits = step(chosen)[:, -1]
    del step, runner
    return fed(calibrated, ids)


def fed(calibrated: Calibration, ids: np.ndarray) -> Calibration:
    """`calibrated` with its feed the token ids `ids` [rows, tokens] (and the inputs its graph derives from them)."""
    from models.registry import lm_defaults

    return Calibration(
        calibrated.model, calibrated.runner, {"input_ids": ids, **lm_defaults(calibrated.runner.input_specs, ids)}
    )


def _whole_rows(runner):
    """CachedLM.step's contract (feed ids [B, T] after everything fed so far; logits [B, T, V]) for a graph without
    a KV cache: every row is fed whole at each call, so `tokens` positions cost about tokens^2 / 2 of the cached
    graph's, and the logits are the same function's."""
    from models.registry import lm_defaults

    whole = None  # every row fed so far

    def step(ids: np.ndarray) -> np.ndarray:
        nonlocal whole
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        whole = ids if whole is None else np.concatenate([whole, ids], axis=1)
        logits = runner.run({"input_ids": whole, **lm_defaults(runner.input_specs, whole)})["logits"]
        return logits[:, -ids.shape[1] :]

    return step
