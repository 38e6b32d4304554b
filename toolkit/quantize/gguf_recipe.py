"""`toolkit quantize --recipe gguf`: each MatMul weight's blocks taken from the artifact's source GGUF as they are.

An artifact exported from a GGUF holds the file's dequantized values as its float weights; rounding those
again onto MatMulNBits' grid (rtn) loses what the file's own blocks keep. This recipe finds, for every
MatMul weight of the prepared graph, the GGUF tensors (and rows, for fused initializers) it was read from
(the import's own name table, gguf_import.gguf_sources), and repacks their blocks
(exporters/gguf_blocks.py). The GGUF must be where the manifest says, with the sha256 recorded at export.

--bits with this recipe: the GGUF decides each tensor's layout; `bits`, if given, must be the file's width,
the narrowest MatMulNBits width of its quantized MatMul tensors (Q4_0, Q4_1, Q4_K: 4; Q5_0, Q5_1, Q5_K, Q6_K,
Q8_0: 8; a Q4_K_M file keeps some tensors in Q6_K and is 4), so `--bits 8` on a Q4_0 file is refused rather than
silently meaning 4.
"""

from __future__ import annotations

from pathlib import Path

from exporters.gguf_blocks import (
    GGUF_FLOAT_TYPES,
    GGUF_LAYOUTS,
    GGUF_NBITS_TYPES,
    Q4_1_LAYOUTS,
    GGUFRecipeError,
    concat_columns,
    deviation,
    piece_bytes,
    piece_kind,
    plan_matmuls,
    target_layout,
    to_nbits,
)
from exporters.quantize import HEAD, constant_matmul_weights, head_copy, torch_weight

FLOAT32 = 1  # TensorProto.FLOAT
# Steps of the MatMulNBits grid an inexact layout may be off by (rounding to its nearest point, plus float32).
INEXACT_BOUND = 0.51


class GGUFRecipe:
    """The source GGUF of one artifact, its tensors and the import's name table; blocks() plans one graph."""

    def __init__(self, path: Path, sha256: str, tensors: dict, sources: dict, bits: int | None, q4_1: str):
        self.path, self.sha256, self.tensors, self.sources = path, sha256, tensors, sources
        self.wanted_bits, self.q4_1 = bits, q4_1
        self.bits: int | None = None  # the file's width, once a graph is planned
        self.bounds: dict[str, float] = {}  # {MatMulNBits weight: steps} for quantized_weight_map
        self.tensor_report: dict[str, dict] = {}

    def blocks(self, prepared, weights, weight_map: dict, folded: dict, copies: dict, originals):
        """The blocks(b) function quantize_proto_blocks calls, once every MatMul weight of `prepared` is planned
        (GGUFRecipeError otherwise, before any weight is converted)."""
        matmuls = constant_matmul_weights(prepared, weights)
        float32 = {b for b in matmuls if weights.tensors[b].data_type == FLOAT32}
        head = weight_map.get(HEAD)
        head_b = None if head is None else head_copy(copies, torch_weight(originals, head))
        plan = plan_matmuls(matmuls, float32, weight_map, folded, head_b, self.sources, self.tensors)
        self.bits = self._width(plan)

        def blocks(b):
            return self._convert(b, plan[b])

        return blocks

    def check_types(self) -> None:
        """GGUFRecipeError, before any graph is read, when a matrix the import reads is of a type whose blocks
        MatMulNBits cannot take as they are, or when --bits is not the file's width."""
        kinds = {}
        for source in self.sources.values():
            tensor = self.tensors[source.tensor]
            if len(tensor.shape) == 2:
                kinds.setdefault(tensor.tensor_type.name, source.tensor)
        for kind, name in sorted(kinds.items()):
            if kind not in GGUF_NBITS_TYPES + GGUF_FLOAT_TYPES:
                raise GGUFRecipeError(
                    f"tensor {name!r} is {kind}, which MatMulNBits cannot hold as it is "
                    f"(taken as they are: {', '.join(GGUF_NBITS_TYPES)}; kept float: {', '.join(GGUF_FLOAT_TYPES)})"
                )
        quantized = sorted(set(kinds) - set(GGUF_FLOAT_TYPES))
        if quantized:
            self._held_to_bits(quantized)

    def _held_to_bits(self, quantized: list[str]) -> int:
        width = min(GGUF_LAYOUTS[kind][2] for kind in quantized)  # MatMulNBits bits: Q4 types 4, the rest 8
        if self.wanted_bits is not None and self.wanted_bits != width:
            raise GGUFRecipeError(
                f"--bits {self.wanted_bits}: {self.path.name}'s MatMul tensors are {'/'.join(quantized)}, "
                f"{width}-bit; the gguf recipe keeps them as they are (--bits {width}, or --recipe rtn to re-round)"
            )
        return width

    def _width(self, plan: dict) -> int:
        """The file's width (its narrowest quantized MatMul tensor's), held to the --bits asked for."""
        kinds = {piece_kind(p, self.tensors) for pieces in plan.values() for p in pieces}
        quantized = sorted(kinds - set(GGUF_FLOAT_TYPES))
        if not quantized:
            raise GGUFRecipeError(f"{self.path.name} holds no quantized MatMul tensor ({', '.join(sorted(kinds))})")
        return self._held_to_bits(quantized)

    def _convert(self, b: str, pieces: list):
        """The NBitsWeight of MatMul weight `b` (None: its tensors are float and it stays a float MatMul), with a
        report line per GGUF tensor."""
        kinds = {piece_kind(p, self.tensors) for p in pieces}
        if kinds <= set(GGUF_FLOAT_TYPES):
            for piece in pieces:
                self.tensor_report[piece.tensor] = {"type": piece_kind(piece, self.tensors), "kept": "float MatMul"}
            return None
        parts = []
        layout = target_layout(kinds) if len(kinds) > 1 else None  # fused pieces of different types
        for piece in pieces:
            kind, raw = piece_kind(piece, self.tensors), piece_bytes(piece, self.tensors)
            part = to_nbits(kind, raw, self.q4_1, layout)
            measured = deviation(part, kind, raw)
            self.tensor_report[piece.tensor] = {
                "type": kind,
                "matmul": b,
                "bits": part.bits,
                "block_size": part.block_size,
                "zero_points": "default" if part.zero_points is None else str(part.zero_points.dtype),
                "offsets": part.offsets is not None,
                "exact": part.exact,
                **measured,
            }
            if part.exact and not measured["identical"]:
                raise GGUFRecipeError(f"tensor {piece.tensor!r}: its {kind} blocks did not repack bit for bit")
            parts.append(part)
        try:
            weight = concat_columns(parts)
        except ValueError as exc:
            raise GGUFRecipeError(f"MatMul weight {b!r}: {exc}") from None
        self.bounds[f"{b}_Q{weight.bits}"] = 0.0 if weight.exact else INEXACT_BOUND
        return weight

    def report(self) -> dict:
        return {"path": str(self.path), "sha256": self.sha256, "q4_1": self.q4_1, "tensors": self.tensor_report}

    def version(self) -> dict:
        from importlib.metadata import version

        return {
            "tool": "exporters.gguf_blocks",
            "algorithm": "the GGUF's blocks as they are (Q4_0, Q8_0 bit for bit; Q4_1 as " + self.q4_1 + ")",
            "gguf": version("gguf"),
        }


def gguf_recipe(source, bits: int | None, q4_1: str) -> GGUFRecipe:
    """The GGUF recipe of artifact `source`: its GGUF verified (toolkit check --oracle llama.cpp's check: the file
    at the recorded path, with the recorded sha256) and its header read. One-line errors otherwise."""
    from models.artifacts import artifact_config
    from models.checkpoints.gguf_import import gguf_sources
    from models.checkpoints.gguf_reader import check_gguf_header
    from toolkit.check.oracle import verify_checkpoint

    if q4_1 not in Q4_1_LAYOUTS:
        raise GGUFRecipeError(f"Q4_1 layout {q4_1!r}: expected one of {', '.join(Q4_1_LAYOUTS)}")
    recorded = source.manifest.source or {}
    if recorded.get("format") != "gguf":
        raise GGUFRecipeError(f"{source.location} was not exported from a GGUF file (toolkit export --from FILE.gguf)")
    path = verify_checkpoint(source, "llama.cpp")
    header = check_gguf_header(path)
    sources = gguf_sources(artifact_config(source), header.tensors.keys(), recorded.get("architecture", "llama"))
    missing = sorted({s.tensor for s in sources.values()} - set(header.tensors))
    if missing:
        raise GGUFRecipeError(f"{path}: tensor {missing[0]!r} is missing")
    recipe = GGUFRecipe(path, recorded["sha256"][path.name], header.tensors, sources, bits, q4_1)
    recipe.check_types()
    return recipe
