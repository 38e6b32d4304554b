"""`toolkit export --from` refuses, before reading a weight, a checkpoint whose export cannot fit in memory."""

from __future__ import annotations

import json
import struct
import time

import pytest

from tests.toolkit.test_cli import assert_user_error, invoke

GIB = 2**30


def sparse_checkpoint(directory, rows: int, width: int, dtype: str = "F32") -> None:
    """A config.json and a safetensors file whose header declares one rows x width tensor; the data is a hole in
    a sparse file, so the 8B-parameter checkpoint takes no disk and no time to write."""
    directory.mkdir()
    config = {"model_type": "llama", "hidden_size": width, "num_hidden_layers": 32, "vocab_size": 128256}
    (directory / "config.json").write_text(json.dumps(config))
    size = rows * width * {"F32": 4, "BF16": 2}[dtype]
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": dtype, "shape": [rows, width], "data_offsets": [0, size]}}
    )
    with open(directory / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header.encode())
        handle.truncate(8 + len(header) + size)


@pytest.fixture
def machine_with_24_gib(monkeypatch):
    import toolkit.memory

    monkeypatch.setattr(toolkit.memory, "available_memory", lambda: 24 * GIB)


def test_an_8b_float32_export_is_refused_up_front_with_the_numbers(tmp_path, machine_with_24_gib):
    sparse_checkpoint(tmp_path / "hf", 2_000_000, 4096)  # 8.19B float32 parameters
    start = time.perf_counter()
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "artifact")
    # 8.19e9 x 4 bytes + 1 GiB = 31.5 GiB (as bfloat16 too: the import reads a float32 checkpoint as float32).
    assert_user_error(
        result,
        "exporting 8.19B parameters as float32 needs about 31.5 GiB of memory and 24.0 GiB is available",
        "free memory or export on a larger machine",
    )
    assert time.perf_counter() - start < 10  # not one of the 32 GB was read
    assert not (tmp_path / "artifact").exists()


def test_a_bfloat16_checkpoint_says_what_its_own_dtype_needs(tmp_path, machine_with_24_gib):
    sparse_checkpoint(tmp_path / "hf", 4_000_000, 4096, "BF16")  # 16.4B bfloat16 parameters
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "artifact")
    # float32 by default (ONNX Runtime's CPU provider runs no bfloat16): 16.4e9 x 4 + 1 GiB = 62.0 GiB; kept as
    # bfloat16, 16.4e9 x 2 + 1 GiB = 31.5 GiB, still too much.
    assert_user_error(result, "16.38B parameters as float32 needs about 62.0 GiB", "as bfloat16", "31.5 GiB")
    result = invoke("export", "--from", tmp_path / "hf", "--out", tmp_path / "artifact", "--dtype", "bfloat16")
    assert_user_error(result, "16.38B parameters as bfloat16 needs about 31.5 GiB of memory and 24.0 GiB")
