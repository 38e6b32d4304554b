"""`toolkit quantize --rotate SEED`: the residual stream turned by a random rotation before the weights are rounded.

QuaRot's transform, applied to an export's float weights. With R an orthogonal [width, width] matrix (QuaRot's
randomized Hadamard matrix where one of the width is built: rotation_matrix), every tensor of the residual stream
becomes h R: the embedding table E R, each projection that writes into the stream
(o_proj, down_proj) W R, and each one that reads a normalized copy of it R^T diag(g) W, where g is the RMSNorm gain
in front of it, which becomes 1. RMSNorm commutes with R (it divides by the root mean square, which R keeps), so the
rotated model computes the same function with the same graph: the same nodes, shapes and decode speed. What changes
is where the weights' outliers are: a trained model's loud residual channels become directions that every input
channel shares, which GPTQ, reading how the input channels move together, rounds with less loss on SmolLM2's
permuted draws, and round-to-nearest with far more (benchmarks/recipes_offgrid.py; the README's table).

The rotation is written as a float artifact of its own (rotate_artifact), from which the recipe quantizes as from
any export, so the quantized artifact's eager reference is the rotated model: `toolkit check` holds the graph to
it as to any other. The residual stream is followed through the graph node by node (residual_stream); a node the
transform does not know on it is refused by name rather than guessed at.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from artifact.errors import ConfigError
from artifact.format import CUSTOM_DOMAIN
from artifact.read import validate_onnx
from artifact.write import PendingWeights, pack_artifact, write_artifact
from exporters.quantize import HEAD, MS_DOMAIN, GraphWeights
from models.artifacts import artifact_config

# Nodes that normalize the residual stream: (domain, op) -> (the inputs that carry the stream, the gain's input).
# SkipSimplifiedLayerNormalization also adds its two stream inputs and returns the sum as output SKIP_SUM.
NORMS = {
    ("", "RMSNormalization"): ((0,), 1),
    (MS_DOMAIN, "SimplifiedLayerNormalization"): ((0,), 1),
    (MS_DOMAIN, "SkipSimplifiedLayerNormalization"): ((0, 1), 2),
    (CUSTOM_DOMAIN, "RMSNorm"): ((0,), 1),
}
SKIP_SUM = 3
# The custom gated feed-forward nodes: (x, gate_proj, up_proj, down_proj), weights in torch's [out, in] layout.
GATED_FFN = {(CUSTOM_DOMAIN, "SwiGLU"), (CUSTOM_DOMAIN, "GeGLU")}
SHAPE_ONLY = {("", "Shape")}  # consumers that read only a tensor's shape
FLOAT_DTYPES = (np.float32, np.float16)
# The rotated float model's logits against the source's, relative to the largest |logit| (checked by the quantize
# pipeline): the rotation is applied in float64 and stored at the weights' precision, which moves a float32 model by
# about 1e-6 of it.
FUNCTION_BOUND = 1e-3
HADAMARD = "randomized Hadamard: diag(random signs) H / sqrt(width), H from Sylvester's and Paley's constructions"
HAAR = "random orthogonal: Q of the QR factorization of a standard normal matrix, column signs fixed (Haar)"


@dataclass
class Stream:
    """Where the residual stream meets constant weights in one graph. Layouts: "kn" a MatMul's B [in, out]; "nk" a
    custom feed-forward node's torch weight [out, in], or the initializer a MatMul reads through a Transpose. The
    table is also a reader where the head multiplies by its transpose (a tied head held once)."""

    gather: object  # the embedding's Gather node
    table: str  # the initializer it reads
    readers: dict[str, tuple[str, str]] = field(default_factory=dict)  # initializer -> (layout, the gain before it)
    writers: dict[str, str] = field(default_factory=dict)  # initializer -> layout
    gains: set[str] = field(default_factory=set)


def hadamard(n: int) -> np.ndarray | None:
    """A Hadamard matrix of order n (entries +-1, H H^T = n I): Sylvester's doubling of up to two Paley (I) matrices
    (order q + 1 for a prime q = 3 mod 4), or None where no such product has order n."""
    paley = [m for m in range(4, n + 1, 4) if n % m == 0 and _prime(m - 1) and (m - 1) % 4 == 3]
    for parts in [(), *((m,) for m in paley), *((a, b) for a in paley for b in paley if a <= b)]:
        rest, remainder = divmod(n, int(np.prod(parts, dtype=np.int64)))
        if remainder or rest & (rest - 1):
            continue
        h = np.ones((1, 1), dtype=np.int64)
        while h.shape[0] < rest:
            h = np.block([[h, h], [h, -h]])
        for m in parts:
            h = np.kron(h, _paley(m - 1))
        return h
    return None


def _prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q**0.5) + 1))


def _paley(q: int) -> np.ndarray:
    """Paley's construction I: I + [[0, 1^T], [-1, Q]], Q[i, j] the quadratic character of j - i mod q."""
    character = -np.ones(q, dtype=np.int64)
    character[(np.arange(1, q, dtype=np.int64) ** 2) % q] = 1
    character[0] = 0
    skew = np.zeros((q + 1, q + 1), dtype=np.int64)
    skew[0, 1:], skew[1:, 0] = 1, -1
    skew[1:, 1:] = character[(np.arange(q)[None, :] - np.arange(q)[:, None]) % q]
    return np.eye(q + 1, dtype=np.int64) + skew


def rotation_matrix(width: int, seed: int) -> tuple[np.ndarray, str]:
    """(R, what it is), R a [width, width] float64 orthogonal matrix: QuaRot's randomized Hadamard matrix
    diag(s) H / sqrt(width), the signs s drawn from `seed`, where hadamard(width) finds H; else a Haar random
    orthogonal matrix drawn from `seed`. On SmolLM2's permuted draws the Hadamard matrix kept more than a Haar one
    with GPTQ on every draw (README): it spreads each channel evenly over all of them."""
    rng = np.random.default_rng(seed)
    h = hadamard(width)
    if h is not None:
        return rng.choice([-1.0, 1.0], width)[:, None] * h / np.sqrt(width), HADAMARD
    q, r = np.linalg.qr(rng.standard_normal((width, width)))
    return q * np.sign(np.diag(r)), HAAR


def _refuse(node, why: str):
    raise ConfigError(
        f"--rotate: node {node.name or node.op_type!r} ({node.op_type}) {why}; --rotate follows the residual stream "
        "of a pre-norm RMSNorm decoder without biases on it and refuses what it does not know; quantize without "
        "--rotate"
    )


def _output(name: str, what: str):
    raise ConfigError(
        f"--rotate: graph output {name!r} is {what}, which the rotation would turn; export with --variant serving"
    )


def residual_stream(proto, weights: GraphWeights) -> Stream:
    """Follow the residual stream of `proto` from the embedding Gather, through the RMSNorm nodes that read it and
    the residual adds, to the constant weights that read its normalized copies and those that write into it."""
    nodes = list(proto.graph.node)
    consumers: dict[str, list] = {}
    producer = {}
    for node in nodes:
        for i, name in enumerate(node.input):
            consumers.setdefault(name, []).append((node, i))
        for name in node.output:
            producer[name] = node
    outputs = {o.name for o in proto.graph.output}
    inputs = {i.name for i in proto.graph.input}
    gathers = [n for n in nodes if n.op_type == "Gather" and n.input[0] in weights and n.input[1] in inputs]
    if len(gathers) != 1:
        raise ConfigError(
            f"--rotate: expected one embedding Gather of a constant table by a graph input, found {len(gathers)}"
            f"{' (' + ', '.join(n.input[0] for n in gathers) + ')' if gathers else ''}; quantize without --rotate"
        )
    gather = gathers[0]
    table = gather.input[0]

    def constant(node, index):
        name = node.input[index] if index < len(node.input) else ""
        if name not in weights or len(consumers.get(name, [])) != 1:
            _refuse(node, f"reads {name!r}, which is not a constant weight read by this node alone")
        return name

    def matmul_b(node):
        """(initializer, layout) of a MatMul's B: an initializer ("kn"), or the transpose of one ("nk"), which may
        be the embedding table (a tied head)."""
        name = node.input[1]
        transpose = producer.get(name)
        if (
            name in weights
            or transpose is None
            or transpose.op_type != "Transpose"
            or transpose.domain not in ("", "ai.onnx")
        ):
            return constant(node, 1), "kn"
        perm = [list(a.ints) for a in transpose.attribute if a.name == "perm"]
        source = transpose.input[0]
        users = [n for n, _ in consumers.get(source, [])]
        alone = len(users) == 1 or (source == table and len(users) == 2 and gather in users)
        if perm not in ([], [[1, 0]]) or source not in weights or len(consumers[name]) != 1 or not alone:
            _refuse(node, f"reads {name!r}, which is not a constant weight, or the transpose of one, read by it alone")
        return source, "nk"

    stream = Stream(gather, table)

    def written(name, into):
        """`name`, added to the stream at node `into`: a projection's output, rotated on its output side."""
        node = producer.get(name)
        key = None if node is None else (node.domain, node.op_type)
        if key not in (("", "MatMul"), *GATED_FFN) or len(consumers[name]) != 1 or name in outputs:
            _refuse(into, f"adds {name!r} to the residual stream, which is not a projection's output alone")
        if key == ("", "MatMul"):
            b, layout = matmul_b(node)
            stream.writers[b] = layout
        else:
            stream.writers[constant(node, 3)] = "nk"

    def normalized(name, gain):
        if name in outputs:
            _output(name, "a normalized residual stream")
        for node, index in consumers.get(name, []):
            key = (node.domain, node.op_type)
            if key in SHAPE_ONLY:
                continue
            if key == ("", "MatMul") and index == 0:
                b, layout = matmul_b(node)
                stream.readers[b] = (layout, gain)
            elif key in GATED_FFN and index == 0:
                stream.readers[constant(node, 1)] = ("nk", gain)
                stream.readers[constant(node, 2)] = ("nk", gain)
            else:
                _refuse(node, f"reads the normalized residual stream {name!r} and is not a projection")

    carried = {gather.output[0]}
    queue = [gather.output[0]]
    done = set()
    while queue:
        name = queue.pop()
        if name in outputs:
            _output(name, "the residual stream")
        for node, index in consumers.get(name, []):
            key = (node.domain, node.op_type)
            if key in SHAPE_ONLY or id(node) in done:
                continue
            done.add(id(node))
            if key in NORMS:
                stream_inputs, gain_index = NORMS[key]
                if index not in stream_inputs:
                    _refuse(node, f"reads the residual stream {name!r} as other than its input")
                if key == (MS_DOMAIN, "SkipSimplifiedLayerNormalization") and len(node.input) > 3 and node.input[3]:
                    _refuse(node, "adds a bias, which the rotation does not turn")
                gain = node.input[gain_index] if gain_index < len(node.input) else ""
                if gain not in weights:
                    _refuse(node, "has no constant gain")
                stream.gains.add(gain)
                for other in stream_inputs:
                    if other != index and node.input[other] not in carried:
                        written(node.input[other], node)
                normalized(node.output[0], gain)
                statistics = [o for i, o in enumerate(node.output) if o and i not in (0, SKIP_SUM)]
                if any(consumers.get(o) or o in outputs for o in statistics):
                    _refuse(node, "has its statistics read")
                if len(node.output) > SKIP_SUM and node.output[SKIP_SUM]:
                    carried.add(node.output[SKIP_SUM])
                    queue.append(node.output[SKIP_SUM])
            elif key == ("", "Add") and len(node.input) == 2:
                if node.input[1 - index] not in carried:
                    written(node.input[1 - index], node)
                carried.add(node.output[0])
                queue.append(node.output[0])
            else:
                _refuse(node, f"reads the residual stream {name!r} and is neither an RMSNorm nor a residual add")
    for gain in stream.gains:
        if not {(n.domain, n.op_type) for n, _ in consumers[gain]} <= set(NORMS):
            raise ConfigError(f"--rotate: the RMSNorm gain {gain!r} is also read by another node; quantize without it")
    if len(consumers[table]) > 1 and table not in stream.readers:  # matmul_b took the one other reader it allows
        _refuse(gather, f"reads {table!r}, which another node reads too, not as the transposed head of a norm")
    if table in stream.writers or not stream.readers or not stream.writers or set(stream.readers) & set(stream.writers):
        raise ConfigError(
            f"--rotate: found {len(stream.readers)} projections reading the residual stream and {len(stream.writers)} "
            "writing into it, expected some of each and none both; quantize without --rotate"
        )
    return stream


def rotate_artifact(source, out_dir: Path, seed: int) -> dict:
    """Write `source`'s model with its residual stream turned by rotation_matrix(width, seed) to `out_dir` (a float
    artifact of its own: same graph, rotated weights, unit RMSNorm gains). A tied head is untied: the embedding
    becomes E R and the head R^T diag(g) E^T, in the head's own copy or, where the head reads the table through a
    Transpose, in the table, the Gather then reading a new initializer. Returns what was turned, for the quantized
    manifest."""
    if len(source.graphs) != 1:
        raise ConfigError(f"--rotate: {source.location} has {len(source.graphs)} graphs; it rotates an export of one")
    config = artifact_config(source)
    width = config.width
    graph = source.graphs[0]
    proto = validate_onnx(graph.model_path)
    weights = GraphWeights(proto, str(graph.model_path.parent), graph.model_path, PendingWeights())
    stream = residual_stream(proto, weights)
    rotation, kind = rotation_matrix(width, seed)
    manifest = copy.deepcopy(source.manifest.to_dict())
    weight_map = manifest["graphs"][0]["weights"]
    head = weight_map.get(HEAD)
    untied = head is not None and head["initializer"] == stream.table
    shared = stream.table in stream.readers  # the head multiplies by the table's transpose

    def turn(name, expected_axis, function, into=None):
        tensor = weights.tensors[name] if into is None else into
        array = weights.array(name)
        if array.dtype not in FLOAT_DTYPES or array.ndim not in (1, 2) or array.shape[expected_axis] != width:
            raise ConfigError(
                f"--rotate: weight {name!r} is {array.dtype} {list(array.shape)}; expected float32 or float16 with "
                f"{width} (the width) along axis {expected_axis}"
            )
        weights.hold(tensor, function(array.astype(np.float64)).astype(array.dtype))

    if shared:  # the Gather gets a table of its own, E R; the table turns as the head it also is
        held = weights.tensors[stream.table]
        embedding = f"{stream.table}.rotated_embedding"
        if embedding in weights:
            raise ConfigError(f"--rotate: the graph already holds an initializer {embedding!r}")
        tensor = proto.graph.initializer.add(name=embedding, data_type=held.data_type, dims=held.dims)
        turn(stream.table, 1, lambda e: e @ rotation, into=tensor)
        stream.gather.input[0] = embedding
        for name, entry in weight_map.items():
            if entry["initializer"] == stream.table and name != HEAD:
                entry["initializer"] = embedding
        manifest["config"]["tie_embeddings"] = False
    elif untied:  # the graph's head reads its own transposed copy of the table: the reader equal to it
        table = weights.array(stream.table)
        copies = [
            b
            for b, (layout, _) in stream.readers.items()
            if layout == "kn" and tuple(weights.tensors[b].dims) == table.shape[::-1]
            and np.array_equal(weights.array(b), table.T)
        ]  # fmt: skip
        if len(copies) != 1 or head.get("transpose") or set(head) - {"initializer", "transpose"}:
            raise ConfigError(
                f"--rotate: the tied head {HEAD!r} is read from the embedding table, and the graph's head MatMul "
                "holds no plain copy of it; quantize without --rotate"
            )
        weight_map[HEAD] = {"initializer": copies[0], "transpose": True}
        manifest["config"]["tie_embeddings"] = False
        del table

    for name, (layout, gain) in stream.readers.items():
        g = weights.array(gain).astype(np.float64)
        if layout == "kn":
            turn(name, 0, lambda b, g=g: rotation.T @ (g[:, None] * b))
        else:
            turn(name, 1, lambda w, g=g: (w * g[None, :]) @ rotation)
    for name, layout in stream.writers.items():
        turn(
            name, 1 if layout == "kn" else 0, (lambda b: b @ rotation) if layout == "kn" else (lambda w: rotation.T @ w)
        )
    if not shared:
        turn(stream.table, 1, lambda e: e @ rotation)
    for gain in stream.gains:
        turn(gain, 0, np.ones_like)
    weights.detach(proto)  # the weights not turned, read from the source: the new artifact stands alone
    extra = {name: (source.directory / name).read_bytes() for name in manifest.get("extra_files") or {}}
    write_artifact(
        out_dir, pack_artifact(manifest, {manifest["graphs"][0]["name"]: proto}, extra, pending=weights.pending)
    )
    return {
        "seed": seed,
        "width": width,
        "rotation": kind,
        "readers": len(stream.readers),
        "writers": len(stream.writers),
        "gains": len(stream.gains),
        "untied_head": untied or shared,
    }
