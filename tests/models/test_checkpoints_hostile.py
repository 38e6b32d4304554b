"""Hostile checkpoint files: headers that lie are refused with the file named, before the safetensors
or gguf library parses them, so no allocation or loop is sized by an unchecked header field.

Files are built byte by byte here (struct.pack, following the published formats), independently
of the code under test; valid ones are cross-checked against the libraries' own writers/readers.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="gguf is needed to write GGUF test files")

from artifact.errors import ModelFileError  # noqa: E402
from models.checkpoints import (  # noqa: E402
    check_gguf_header,
    check_safetensors_header,
    gguf_import,
    gguf_reader,
    import_checkpoint,
)

LLAMA = {
    "model_type": "llama",
    "vocab_size": 8,
    "hidden_size": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 8,
}


# --------------------------------------------------------------------------- safetensors


def safetensors_bytes(header, data: bytes = b"", length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


def hf_dir(tmp_path: Path, content: bytes) -> Path:
    directory = tmp_path / "hf"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(LLAMA))
    (directory / "model.safetensors").write_bytes(content)
    return directory


def test_a_library_written_file_passes_and_its_header_is_returned(tmp_path):
    from safetensors.numpy import save_file

    arrays = {"a": np.ones((2, 3), np.float32), "b": np.arange(5, dtype=np.int64)}
    save_file(arrays, str(tmp_path / "m.safetensors"), metadata={"k": "v"})
    header = check_safetensors_header(tmp_path / "m.safetensors")
    assert header["a"]["shape"] == [2, 3] and header["a"]["dtype"] == "F32"
    assert header["b"]["data_offsets"][1] - header["b"]["data_offsets"][0] == 5 * 8
    assert header["__metadata__"] == {"k": "v"}


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
SAFETENSORS = {
    "empty file": (b"", r"truncated: 0 bytes"),
    "short length": (b"\x01\x02\x03", r"truncated: 3 bytes"),
    "absurd header length": (safetensors_bytes({}, length=2**63), r"header length 9,223,372,036,854,775,808 is above"),
    "header past the end": (
        safetensors_bytes({"w": F32}, b"\0" * 8, length=10_000),
        r"header length 10,000 runs past the end",
    ),
    "header not JSON": (safetensors_bytes(b"{not json"), r"header is not JSON"),
    "header not UTF-8": (safetensors_bytes(b"\xff\xfe"), r"header is not JSON"),
    "header not an object": (safetensors_bytes([1, 2]), r"header is not a JSON object"),
    "unknown dtype": (
        safetensors_bytes({"w": dict(F32, dtype="F8_E4M3")}, b"\0" * 8),
        r"tensor 'w': dtype 'F8_E4M3' is not supported; supported: F64, F32",
    ),
    "shape vs bytes": (
        safetensors_bytes({"w": dict(F32, shape=[3])}, b"\0" * 8),
        r"tensor 'w': shape \(3,\) of F32 needs 12 bytes but data_offsets \[0, 8\) hold 8",
    ),
    "huge shape": (
        safetensors_bytes({"w": dict(F32, shape=[2**40, 2**40])}, b"\0" * 8),
        r"shape \(1099511627776, 1099511627776\) of F32 needs",
    ),
    "offsets past the end": (
        safetensors_bytes({"w": dict(F32, data_offsets=[8, 16])}, b"\0" * 8),
        r"data_offsets \[8, 16\) run past the end of the data \(8 bytes\)",
    ),
    "negative offset": (
        safetensors_bytes({"w": dict(F32, data_offsets=[-8, 0])}, b"\0" * 8),
        r"data_offsets \[-8, 0\] are not \[begin, end\]",
    ),
    "reversed offsets": (
        safetensors_bytes({"w": dict(F32, data_offsets=[8, 0])}, b"\0" * 8),
        r"data_offsets \[8, 0\] are not \[begin, end\]",
    ),
    "overlap": (
        safetensors_bytes({"a": F32, "b": dict(F32, data_offsets=[4, 12])}, b"\0" * 12),
        r"tensors 'a' and 'b' overlap \(bytes from 4 to 8\)",
    ),
    "shape not a list": (safetensors_bytes({"w": dict(F32, shape="2")}, b"\0" * 8), r"shape '2' is not a list"),
    "bool in shape": (safetensors_bytes({"w": dict(F32, shape=[True, 2])}, b"\0" * 8), r"shape \[True, 2\] is not"),
    "bad metadata": (safetensors_bytes({"__metadata__": {"k": 1}}), r"__metadata__ must map strings to strings"),
}


@pytest.mark.parametrize("case", SAFETENSORS)
def test_lying_safetensors_headers_are_refused(tmp_path, case):
    content, pattern = SAFETENSORS[case]
    directory = hf_dir(tmp_path, content)
    with pytest.raises(ModelFileError, match=r"model\.safetensors: unreadable safetensors file.*" + pattern):
        import_checkpoint(directory)


@pytest.mark.parametrize(
    "tensors,size,pattern",
    [
        ({"a": F32, "b": dict(F32, data_offsets=[12, 20])}, 20, r"4 unclaimed byte\(s\) between tensors 'a' and 'b'"),
        ({"a": F32}, 12, r"the tensors cover bytes 0 to 8 of a 12-byte data section"),
        ({"b": dict(F32, data_offsets=[4, 12])}, 12, r"the tensors cover bytes 4 to 12 of a 12-byte data section"),
    ],
)
def test_gaps_and_unclaimed_bytes_are_refused(tmp_path, tensors, size, pattern):
    # The tensors are read with plain file reads, so the check enforces the tiling the safetensors library does.
    content = safetensors_bytes(tensors, b"\0" * size)
    with pytest.raises(ModelFileError, match=r"model\.safetensors: unreadable safetensors file: " + pattern):
        import_checkpoint(hf_dir(tmp_path, content))


@pytest.mark.parametrize(
    "index,pattern",
    [
        ({"weight_map": {"a": 3}}, r"'weight_map' must map tensor names to shard file names"),
        ({"weight_map": ["x"]}, r"'weight_map' must map"),
        ({"no": 1}, r"'weight_map' must map"),
        ("[" * 100 + "]" * 100, r"invalid JSON \(nested 100 levels deep"),
        ({"weight_map": {"a": "model-2.safetensors"}}, r"shard 'model-2\.safetensors' is listed but not in"),
    ],
)
def test_malformed_shard_index(tmp_path, index, pattern):
    directory = hf_dir(tmp_path, safetensors_bytes({}))
    (directory / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(ModelFileError, match=r"model\.safetensors\.index\.json: " + pattern):
        import_checkpoint(directory)


# --------------------------------------------------------------------------- GGUF

U32, F32_T, STRING, ARRAY = 4, 6, 8, 9


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", kind) + payload


def tensor_info(name: str, dims, kind: int = 0, offset: int = 0) -> bytes:
    return (
        gstr(name)
        + struct.pack("<I", len(dims))
        + struct.pack(f"<{len(dims)}Q", *dims)
        + struct.pack("<IQ", kind, offset)
    )


def gguf_bytes(kvs=(), tensors=(), data=b"", *, version=3, n_tensors=None, n_kv=None, alignment=32) -> bytes:
    """GGUF per the spec: magic, version, counts, metadata, tensor infos, padding to `alignment`, data."""
    head = b"GGUF" + struct.pack(
        "<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    body = head + b"".join(kvs) + b"".join(tensors)
    return body + b"\0" * (-len(body) % alignment) + data


ARCH = kv("general.architecture", STRING, gstr("llama"))
ONE_F32 = tensor_info("w", [8], 0, 0)  # 8 float32 values at data offset 0


def test_hand_built_gguf_matches_the_library_reader(tmp_path):
    path = tmp_path / "m.gguf"
    values = np.arange(8, dtype=np.float32)
    path.write_bytes(gguf_bytes([ARCH], [ONE_F32], values.tobytes()))
    check_gguf_header(path)
    reader = gguf.GGUFReader(str(path))  # the oracle for our byte layout
    assert reader.fields["general.architecture"].contents() == "llama"
    np.testing.assert_array_equal(reader.tensors[0].data, values)


def test_a_library_written_gguf_passes(tmp_path):
    writer = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_tensor("w", np.ones((4, 32), np.float32))
    writer.add_tensor(
        "q",
        gguf.quants.quantize(np.ones((2, 64), np.float32), gguf.GGMLQuantizationType.Q8_0),
        raw_dtype=gguf.GGMLQuantizationType.Q8_0,
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    check_gguf_header(tmp_path / "w.gguf")


GGUF = {
    "tiny file": (b"GGUF\x03", r"truncated: 5 bytes"),
    "bad magic": (b"GGML" + gguf_bytes()[4:], r"magic is b'GGML', expected b'GGUF'"),
    "version 1": (gguf_bytes(version=1), r"version 1 .*supported: little-endian versions 2, 3"),
    "big-endian": (gguf_bytes(version=3 << 24), r"version 50331648 \(or a big-endian file\)"),
    "absurd tensor count": (gguf_bytes([ARCH], n_tensors=2**60), r"header counts \(1,152,921,504,606,846,976 tensors"),
    "absurd metadata count": (gguf_bytes([ARCH], n_kv=2**40), r"metadata entries\) cannot fit"),
    "metadata count past the entries": (gguf_bytes([ARCH], n_kv=2, alignment=1), r"truncated: metadata key #1 length"),
    "huge string": (
        gguf_bytes([kv("general.architecture", STRING, struct.pack("<Q", 2**62) + b"llama")]),
        r"metadata 'general\.architecture' of 4,611,686,018,427,387,904 bytes .* runs past the end",
    ),
    "huge scalar array": (
        gguf_bytes([ARCH, kv("x", ARRAY, struct.pack("<IQ", 0, 2**62))]),
        r"metadata 'x': 4,611,686,018,427,387,904 items of 1 bytes run past the end",
    ),
    "huge string array": (
        gguf_bytes([ARCH, kv("x", ARRAY, struct.pack("<IQ", STRING, 2**40))]),
        r"metadata 'x': 1,099,511,627,776 strings cannot fit",
    ),
    "nested array": (
        gguf_bytes([ARCH, kv("x", ARRAY, struct.pack("<IQ", ARRAY, 1))]),
        r"array item type 9 is not supported",
    ),
    "unknown value type": (gguf_bytes([kv("x", 13, b"\0" * 8)]), r"metadata 'x': value type 13 is not supported"),
    "bad alignment": (gguf_bytes([kv("general.alignment", U32, struct.pack("<I", 3))]), r"general\.alignment 3 is not"),
    "rank 0": (gguf_bytes([ARCH], [tensor_info("w", [])]), r"tensor 'w' has rank 0; GGUF allows 1\.\.4"),
    "rank 5": (gguf_bytes([ARCH], [tensor_info("w", [1] * 5)]), r"tensor 'w' has rank 5"),
    "unknown tensor type": (
        gguf_bytes([ARCH], [tensor_info("w", [8], 99)], b"\0" * 32),
        r"tensor 'w' has unknown tensor type 99",
    ),
    "huge dims": (
        gguf_bytes([ARCH], [tensor_info("w", [2**32, 2**32])], b"\0" * 32),
        r"tensor 'w' \(4294967296, 4294967296\) needs bytes \[0, 73,786,976,294,838,206,464\) of a 32-byte",
    ),
    "data past the end": (
        gguf_bytes([ARCH], [ONE_F32], b"\0" * 16),
        r"tensor 'w' \(8,\) needs bytes \[0, 32\) of a 16",
    ),
    "offset past the end": (
        gguf_bytes([ARCH], [tensor_info("w", [8], 0, 64)], b"\0" * 32),
        r"needs bytes \[64, 96\) of a 32-byte data section",
    ),
    "misaligned offset": (
        gguf_bytes([ARCH], [tensor_info("w", [2], 0, 4)], b"\0" * 32),
        r"tensor 'w' data offset 4 is not a multiple of the alignment 32",
    ),
    "overlap": (
        gguf_bytes([ARCH], [ONE_F32, tensor_info("v", [16], 0, 0)], b"\0" * 64),
        r"tensor 'w' and tensor 'v' overlap|tensor 'v' and tensor 'w' overlap",
    ),
    "partial Q8_0 block": (
        gguf_bytes([ARCH], [tensor_info("w", [31], 8)], b"\0" * 64),
        r"tensor 'w' shape \(31,\) is not a whole number of 32-value blocks",
    ),
    "truncated tensor info": (gguf_bytes([ARCH], [ONE_F32[:-6]]), r"truncated: tensor 'w' offset"),
}


@pytest.mark.parametrize("case", GGUF)
def test_lying_gguf_headers_are_refused_before_the_library(tmp_path, monkeypatch, case):
    def refuse(*args, **kwargs):
        raise AssertionError("a file the header walk should have refused was parsed or mapped")

    monkeypatch.setattr(gguf, "GGUFReader", refuse)
    monkeypatch.setattr(gguf_reader.np, "memmap", refuse)  # nor is any tensor mapped
    content, pattern = GGUF[case]
    path = tmp_path / "m.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=r"m\.gguf: not a readable GGUF file \(.*" + pattern):
        import_checkpoint(path)


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9, 0.999])
def test_truncated_library_written_gguf(tmp_path, fraction):
    writer = gguf.GGUFWriter(str(tmp_path / "w.gguf"), "llama")
    writer.add_token_list([f"t{i}" for i in range(50)])
    writer.add_tensor("w", np.ones((4, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = (tmp_path / "w.gguf").read_bytes()
    (tmp_path / "w.gguf").write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(
        ModelFileError, match=r"w\.gguf: not a readable GGUF file \((truncated|.*(run past the end|cannot fit))"
    ):
        import_checkpoint(tmp_path / "w.gguf")


def llama_gguf(tmp_path: Path, **overrides) -> Path:
    """Llama metadata only (the metadata is checked before any tensor is looked for)."""
    writer = gguf.GGUFWriter(str(tmp_path / "meta.gguf"), "llama")
    values = {
        "block_count": 1,
        "embedding_length": 4,
        "feed_forward_length": 8,
        "attention.head_count": 2,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "vocab_size": 8,
        **overrides,
    }
    for key, value in values.items():
        add = {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)]
        add(f"llama.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "meta.gguf"


@pytest.mark.parametrize(
    "key,value,pattern",
    [
        ("block_count", "two", r"llama\.block_count is 'two'; expected an integer"),
        ("attention.head_count", 2.5, r"llama\.attention\.head_count is 2\.5; expected an integer"),
        ("attention.layer_norm_rms_epsilon", "tiny", r"layer_norm_rms_epsilon is 'tiny'; expected a finite number"),
        ("attention.layer_norm_rms_epsilon", float("nan"), r"layer_norm_rms_epsilon is nan; expected a finite number"),
        ("embedding_length", 5, r"LlamaConfig"),  # the config's own check: width not divisible by heads
    ],
)
def test_gguf_metadata_of_the_wrong_type(tmp_path, key, value, pattern):
    with pytest.raises(ModelFileError, match=r"meta\.gguf: .*" + pattern):
        import_checkpoint(llama_gguf(tmp_path, **{key: value}))


def test_gguf_metadata_passes_to_the_tensor_stage(tmp_path):
    with pytest.raises(
        ModelFileError, match=r"meta\.gguf: missing tensor 'token_embd\.weight' \(expected shape \(8, 4\)\)"
    ):
        import_checkpoint(llama_gguf(tmp_path))


TOKENIZER = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.tokens": ["a", "b", "ab"],
    "tokenizer.ggml.merges": ["a b"],
    "tokenizer.ggml.token_type": [1, 1, 1],
    "tokenizer.ggml.bos_token_id": 0,
    "tokenizer.ggml.eos_token_id": 1,
}


def test_well_formed_gguf_tokenizer_metadata_builds(tmp_path):
    tokenizer = gguf_import._gguf_tokenizer(dict(TOKENIZER), 3, tmp_path / "t.gguf")
    assert tokenizer.encode("ab") == [2]  # hand-computed: the one merge joins a+b


@pytest.mark.parametrize(
    "edit,pattern",
    [
        ({"tokenizer.ggml.tokens": ["a", 2, "ab"]}, r"tokens is not a list of strings"),
        ({"tokenizer.ggml.tokens": ["a", "b"]}, r"tokens has 2 entries but the vocabulary has 3"),
        ({"tokenizer.ggml.merges": ["ab"]}, r"merges is not a list of 'a b' strings"),
        ({"tokenizer.ggml.token_type": [1, 1, 1, 3]}, r"token_type is not a list of integers, one per token"),
        ({"tokenizer.ggml.bos_token_id": 7}, r"bos_token_id 7 is not a token id in \[0, 3\)"),
        ({"tokenizer.ggml.eos_token_id": "x"}, r"eos_token_id 'x' is not a token id"),
        ({"tokenizer.chat_template": ["x"]}, r"chat_template is not a string"),
        ({"tokenizer.ggml.model": "t5"}, r"GGUF tokenizer model 't5' is not supported"),
        ({"tokenizer.ggml.model": "llama"}, r"tokenizer model 'llama' \(SentencePiece\) needs tokenizer\.ggml\.scores"),
        ({"tokenizer.ggml.scores": [0.0, 1.0]}, r"scores is not a list of finite numbers, one per token"),
        ({"tokenizer.ggml.scores": [0.0, float("nan"), 1.0]}, r"scores is not a list of finite numbers, one per token"),
        ({"tokenizer.ggml.add_space_prefix": "yes"}, r"add_space_prefix 'yes' is not true or false"),
    ],
)
def test_malformed_gguf_tokenizer_metadata(tmp_path, edit, pattern):
    with pytest.raises(ModelFileError, match=r"t\.gguf: .*" + pattern):
        gguf_import._gguf_tokenizer({**TOKENIZER, **edit}, 3, tmp_path / "t.gguf")
