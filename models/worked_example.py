"""The worked example: a hand-checkable block every backend must reproduce.

B=1, T=3, d=4, heads=2 (head width 2), d_ff=4, eps=0, both gains all ones,
Q=K=V=O=gate=up=down=identity, input rows 2*e0, 2*e1, 2*e2, and a fixed
probe read-out P (4x3), so probe logits = y @ P with shape [1, 3, 3].
"""

import numpy as np
import torch

from models.llama import ProbedBlock, ProbedBlockConfig

PROBE = ((1.0, 0.0, -1.0), (0.0, 1.0, -1.0), (1.0, 1.0, 0.0), (0.0, 0.0, 0.0))


def worked_example_config(norm_placement: str = "pre") -> ProbedBlockConfig:
    width = len(PROBE)
    return ProbedBlockConfig(
        width=width,
        heads=2,
        ff_width=width,
        max_positions=16,
        eps=0.0,
        norm_placement=norm_placement,
        probe_width=len(PROBE[0]),
    )


@torch.no_grad()
def build_worked_example(norm_placement: str = "pre") -> ProbedBlock:
    config = worked_example_config(norm_placement)
    with torch.random.fork_rng(devices=[]):
        model = ProbedBlock(config)
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name == "probe":
            tensor.copy_(torch.tensor(PROBE))
        elif tensor.ndim == 2:
            tensor.copy_(torch.eye(*tensor.shape))
        else:
            tensor.fill_(1.0)
    return model.eval()


def worked_example_inputs() -> dict[str, np.ndarray]:
    width, tokens = len(PROBE), 3
    rows = 2.0 * np.eye(width)[:tokens]  # rows 2*e0, 2*e1, 2*e2
    return {"hidden_states": rows[None, :, :]}  # (B=1, T=3, d)
