"""What both importers share: the imported checkpoint, taking tensors by name and shape, and loading a model.

Name mapping is per format (huggingface.py, gguf_import.py); these helpers make every mapping refuse
the same way: the first missing, unexpected, mis-shaped or non-finite tensor is named.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from artifact.errors import ModelFileError
from artifact.spans import release_pages
from models.registry import build_model
from models.tokenizer import TextTokenizer

# Buffers some checkpoints carry that are not weights (recomputed from the config here).
IGNORED_TENSORS = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")


@dataclass
class ImportedCheckpoint:
    family: str
    config: object
    model: torch.nn.Module
    tokenizer: TextTokenizer | None
    source: dict  # format, path, architecture


@dataclass
class OpenedCheckpoint:
    """A checkpoint whose config, tensor names and shapes, tokenizer and provenance are read and checked, and
    whose weights are not read yet: read_model() reads them (checked again, and for finite values) into the
    model. What an export traces needs only the config, so the weights need not be held while it does."""

    family: str
    config: object
    tokenizer: TextTokenizer | None
    source: dict  # format, path, architecture[, dtype: what most weights are stored in]
    read_model: Callable[[], torch.nn.Module]

    def load(self) -> ImportedCheckpoint:
        return ImportedCheckpoint(self.family, self.config, self.read_model(), self.tokenizer, self.source)


def take_tensor(tensors: dict, name: str, shape: tuple, where) -> torch.Tensor:
    """Remove `name` from `tensors` and return it, refusing a missing tensor or one of another shape."""
    if name not in tensors:
        raise ModelFileError(f"{where}: missing tensor {name!r} (expected shape {shape})")
    tensor = tensors.pop(name)
    if tuple(tensor.shape) != tuple(shape):
        raise ModelFileError(f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)}")
    return tensor


def finish_state(state: dict, leftovers: dict, where) -> dict:
    """`state`, once every tensor the mapping did not take is one of IGNORED_TENSORS."""
    extra = [n for n in leftovers if not n.endswith(IGNORED_TENSORS)]
    if extra:
        raise ModelFileError(f"{where}: unexpected tensor {sorted(extra)[0]!r} (not in this architecture)")
    return state


def load_model(family: str, config, state: dict, where, *, assign: bool = False) -> torch.nn.Module:
    """The model with `state` loaded (every entry checked for name and shape by load_state_dict).

    assign=True makes the state's tensors the parameters instead of copying them (the caller owns
    them: fresh, writable memory, or private file mappings whose written pages become their own); tied
    parameters stay one Parameter.
    """
    model = build_model(family, config, init=False)  # every weight is loaded next
    expected = set(model.state_dict())
    missing = sorted(expected - set(state))
    if missing:
        raise ModelFileError(f"{where}: no source tensor for {missing[0]!r}")
    for name in sorted(expected):
        value = state[name]
        if torch.is_tensor(value) and value.is_floating_point() and not _all_finite(value):
            bad = int((~torch.isfinite(value)).sum())
            raise ModelFileError(
                f"{where}: weight {name!r} holds {bad} non-finite value(s) (NaN/Inf); the checkpoint "
                "is corrupt or was saved from a diverged model, re-download or re-convert it"
            )
        if torch.is_tensor(value):  # a weight mapped from its file: the check's touched pages go back
            release_pages(value)
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    model.load_state_dict({name: state[name] for name in expected}, assign=assign)
    if assign:  # load_state_dict(assign=True) wraps each name's tensor in a Parameter of its own
        for first, *others in tied.values():
            for other in others:
                owner, _, attr = other.rpartition(".")
                setattr(model.get_submodule(owner), attr, model.get_parameter(first))
    return model.eval()


FINITE_CHUNK = 1 << 22  # elements per sum (and isfinite) call: each allocates temporaries the size of its input


def _all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite, a FINITE_CHUNK of values at a time. A chunk's sum is finite only if every
    term is (a NaN makes it NaN, an infinity infinite or NaN, and a partial sum that overflows never comes back),
    and summing streams at memory speed where isfinite writes a mask the size of its input first; only a chunk whose sum is not finite, a NaN or infinity or an overflow of large finite values, is
    settled value by value. Chunks keep a 16-bit weight's float32 accumulation as small as isfinite's mask."""
    flat = tensor.reshape(-1)
    accumulate = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else None
    for start in range(0, flat.numel(), FINITE_CHUNK):
        chunk = flat[start : start + FINITE_CHUNK]
        if not math.isfinite(float(chunk.sum(dtype=accumulate))) and not bool(torch.isfinite(chunk).all()):
            return False
    return True
