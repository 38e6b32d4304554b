"""The depth experiment: how the residual stream grows through 12 stacked blocks, pre vs post norm."""

from __future__ import annotations

import torch

from models.llama import LlamaBlock, LlamaConfig
from models.registry import initialize


@torch.no_grad()
def depth_experiment(
    layers: int = 12,
    width: int = 64,
    heads: int = 4,
    ff_width: int = 128,
    batch: int = 4,
    sequence: int = 16,
    seed: int = 0,
) -> dict:
    """RMS of the activations after each block for the same random stack in both placements.

    Pre-norm adds every branch to an unnormalised residual stream, so its RMS grows
    with depth; post-norm renormalises after every sub-layer, so its RMS stays near
    the norm gain. Same weights and input for both (only the placement differs).
    """
    result = {"layers": layers, "width": width, "batch": batch, "sequence": sequence, "seed": seed}
    for placement in ("pre", "post"):
        config = LlamaConfig(
            width=width, heads=heads, ff_width=ff_width, max_positions=sequence, norm_placement=placement, layers=layers
        )
        with torch.random.fork_rng(devices=[]):
            generator = torch.Generator().manual_seed(seed)
            blocks = torch.nn.ModuleList([LlamaBlock(config) for _ in range(layers)]).double()
            initialize(blocks, generator)
            x = torch.randn(batch, sequence, width, generator=generator, dtype=torch.float64)
        norms = []
        for block in blocks:
            x = block(x)["output"]
            norms.append(float(x.pow(2).mean().sqrt()))
        result[placement] = norms
    return result


def render_table(result: dict) -> str:
    lines = [
        f"activation RMS after each block ({result['layers']} blocks, d={result['width']}, "
        f"random input {result['batch']}x{result['sequence']}, seed {result['seed']})",
        f"{'block':>5}  {'pre-norm':>10}  {'post-norm':>10}",
    ]
    for i, (pre, post) in enumerate(zip(result["pre"], result["post"], strict=False)):
        lines.append(f"{i:>5}  {pre:>10.4f}  {post:>10.4f}")
    growth_pre = result["pre"][-1] / result["pre"][0]
    growth_post = result["post"][-1] / result["post"][0]
    lines.append(f"growth last/first: pre-norm {growth_pre:.2f}x, post-norm {growth_post:.2f}x")
    return "\n".join(lines)
