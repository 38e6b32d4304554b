"""Fuzzing checkpoint import: safetensors directories and GGUF files, built from drawn header fields
or from byte mutations of valid files. Whatever the bytes, import_checkpoint either imports or
raises ModelFileError naming the file; no other exception, no hang. 2,000 cases per format, counts printed."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf", reason="gguf is needed to write GGUF test files")

from artifact.errors import ModelFileError  # noqa: E402
from models.checkpoints import import_checkpoint  # noqa: E402

CASES = 2000
SETTINGS = settings(
    max_examples=CASES, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
LLAMA = {
    "model_type": "llama",
    "vocab_size": 8,
    "hidden_size": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 8,
}
INTERESTING = [0, 1, 2, 7, 8, 31, 32, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def mutated(draw, valid: bytes) -> bytes:
    """Byte-level mutations of a valid file: flips, u32/u64 overwrites with edge values, cuts, splices."""
    data = bytearray(valid)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "u64", "u32", "truncate", "insert", "delete"]))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind in ("u64", "u32"):
            width = 8 if kind == "u64" else 4
            value = draw(st.sampled_from(INTERESTING)) % (1 << (8 * width))
            data[at : at + width] = value.to_bytes(width, "little")
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 16))]
    return bytes(data)


def expect_only_toolkit_errors(call, path) -> str:
    try:
        call()
    except ModelFileError as exc:
        assert str(path.parent) in str(exc) and "\n" not in str(exc), str(exc)  # names the file or its directory
        return "refused"
    return "imported"


# --------------------------------------------------------------------------- safetensors


def valid_safetensors() -> bytes:
    header = {
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "F16", "shape": [3], "data_offsets": [16, 22]},
        "__metadata__": {"format": "pt"},
    }
    raw = json.dumps(header).encode()
    return (
        struct.pack("<Q", len(raw)) + raw + np.arange(4, dtype=np.float32).tobytes() + np.ones(3, np.float16).tobytes()
    )


@st.composite
def drawn_safetensors(draw) -> bytes:
    """A header drawn field by field: dtypes, shapes and offsets that may or may not agree."""
    header, cursor = {}, 0
    for i in range(draw(st.integers(0, 3))):
        dtype = draw(st.sampled_from(["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "Q4", "", 7]))
        shape = draw(st.lists(st.integers(-1, 5) | st.sampled_from(INTERESTING), max_size=3))
        begin = draw(st.sampled_from([cursor, cursor + 1, 0, -4]) | st.integers(0, 64))
        end = draw(
            st.sampled_from(
                [
                    begin + 4 * int(np.prod(shape or [1]))
                    if all(isinstance(d, int) and 0 <= d < 100 for d in shape)
                    else begin,
                    begin - 1,
                ]
            )
            | st.integers(0, 128)
        )
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}
        cursor = max(cursor, end if isinstance(end, int) else 0)
    raw = json.dumps(header).encode()
    length = draw(st.sampled_from([len(raw)] * 4 + INTERESTING))
    return struct.pack("<Q", length % 2**64) + raw + b"\0" * draw(st.integers(0, 80))


def test_fuzz_safetensors_import(tmp_path, fuzz_summary):
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    path = directory / "model.safetensors"
    counts = {"cases": 0, "imported": 0, "refused": 0}

    @SETTINGS
    @given(st.one_of(mutated(valid_safetensors()), drawn_safetensors()))
    def run(content):
        counts["cases"] += 1
        path.write_bytes(content)
        counts[expect_only_toolkit_errors(lambda: import_checkpoint(directory), path)] += 1

    run()
    fuzz_summary(
        f"fuzzed {counts['cases']} cases of models.checkpoints safetensors import ({counts['refused']} refused)"
    )
    assert counts["cases"] >= CASES


# --------------------------------------------------------------------------- GGUF


def gstr(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def valid_gguf(tmp_path) -> bytes:
    """A complete one-block llama GGUF that imports: every hyperparameter and tensor the importer needs,
    2-D weights in Q8_0 (so mutations reach dequantization and weight loading, not only the header)."""
    width, heads, ff, vocab = 32, 2, 32, 3
    writer = gguf.GGUFWriter(str(tmp_path / "seed.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_context_length(16)
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_freq_base(100.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (vocab, width),
        "blk.0.attn_norm.weight": (width,),
        "blk.0.attn_q.weight": (width, width),
        "blk.0.attn_k.weight": (width, width),
        "blk.0.attn_v.weight": (width, width),
        "blk.0.attn_output.weight": (width, width),
        "blk.0.ffn_norm.weight": (width,),
        "blk.0.ffn_gate.weight": (ff, width),
        "blk.0.ffn_up.weight": (ff, width),
        "blk.0.ffn_down.weight": (width, ff),
        "output_norm.weight": (width,),
        "output.weight": (vocab, width),
    }
    for name, shape in shapes.items():
        array = rng.standard_normal(shape).astype(np.float32)
        if array.ndim == 2:
            writer.add_tensor(
                name,
                gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                raw_dtype=gguf.GGMLQuantizationType.Q8_0,
            )
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return (tmp_path / "seed.gguf").read_bytes()


@st.composite
def drawn_gguf(draw) -> bytes:
    """A GGUF assembled from drawn counts, value types, array lengths, tensor ranks, dims, types, offsets."""
    kvs = [gstr(b"general.architecture") + struct.pack("<I", 8) + gstr(b"llama")]
    for i in range(draw(st.integers(0, 3))):
        kind = draw(st.integers(0, 13))
        if kind == 9:
            item = draw(st.integers(0, 12))
            count = draw(st.sampled_from(INTERESTING))
            payload = struct.pack("<IQ", item, count % 2**64) + draw(st.binary(max_size=24))
        elif kind == 8:
            payload = struct.pack("<Q", draw(st.sampled_from(INTERESTING)) % 2**64) + draw(st.binary(max_size=8))
        else:
            payload = draw(st.binary(min_size=0, max_size=8))
        kvs.append(gstr(f"k{i}".encode()) + struct.pack("<I", kind) + payload)
    tensors = []
    for i in range(draw(st.integers(0, 3))):
        dims = draw(st.lists(st.sampled_from([1, 2, 8, 32, 2**32, 2**63]), max_size=5))
        kind = draw(st.sampled_from([0, 1, 8, 2, 6, 99]))
        offset = draw(st.sampled_from([0, 32, 64, 4, 2**63]))
        tensors.append(
            gstr(f"t{i}".encode())
            + struct.pack("<I", len(dims))
            + b"".join(struct.pack("<Q", d % 2**64) for d in dims)
            + struct.pack("<IQ", kind, offset)
        )
    n_tensors = draw(st.sampled_from([len(tensors)] * 4 + INTERESTING))
    n_kv = draw(st.sampled_from([len(kvs)] * 4 + INTERESTING))
    version = draw(st.sampled_from([3, 3, 3, 2, 1, 4, 3 << 24]))
    body = b"GGUF" + struct.pack("<IQQ", version, n_tensors % 2**64, n_kv % 2**64) + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + b"\0" * draw(st.integers(0, 200))


def test_fuzz_gguf_import(tmp_path, fuzz_summary):
    path = tmp_path / "model.gguf"
    seed = valid_gguf(tmp_path)
    path.write_bytes(seed)
    import_checkpoint(path)  # the seed itself imports, so its mutations get past the header
    counts = {"cases": 0, "imported": 0, "refused": 0}

    @SETTINGS
    @given(st.one_of(mutated(seed), drawn_gguf()))
    def run(content):
        counts["cases"] += 1
        path.write_bytes(content)
        counts[expect_only_toolkit_errors(lambda: import_checkpoint(path), path)] += 1

    run()
    fuzz_summary(
        f"fuzzed {counts['cases']} cases of models.checkpoints GGUF import ({counts['imported']} imported, "
        f"{counts['refused']} refused)"
    )
    assert counts["imported"] > 0, "no mutation reached the tensors"
    assert counts["cases"] >= CASES
