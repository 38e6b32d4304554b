"""`toolkit bench`: JSON shape, sanity and the bandwidth-bound arithmetic, re-derived here from the config.

A one-layer llama decoder (serving export) and its int8 quantization are benchmarked with 2-token
prompts, 2 new tokens and 1 repeat. Timings are never asserted, only that they exist and are positive
and that each bandwidth fraction is (measured tokens/s) x (bytes per token) / (measured bandwidth),
with the bytes counted from the config independently of toolkit/bench/bench.py.
"""

from __future__ import annotations

import json
import sys

import pytest

from exporters.onnx_export import export_model
from models.artifacts import open_artifact
from models.registry import build_model, get_family
from tests.optional import import_or_skip
from tests.toolkit.test_cli import assert_user_error, invoke
from toolkit.bench.bench import BenchSettings, bench
from toolkit.quantize.pipeline import quantize_artifact

pytestmark = pytest.mark.slow

CONFIG = {"vocab_size": 96, "layers": 1, "width": 64, "heads": 4, "kv_heads": 2, "ff_width": 128, "max_positions": 16}
SETTINGS = BenchSettings(prompt_len=2, new_tokens=2, batches=(1, 2), repeats=1, warmup=0, threads=1)
KEYS = {
    "backend",
    "lowering",
    "dtype",
    "bits",
    "batch",
    "prefill_ms",
    "decode_tokens_per_s",
    "bandwidth_fraction",
    "peak_rss_mb",
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    config = get_family("llama").config_from_dict(CONFIG)
    base = tmp_path_factory.mktemp("bench")
    export_model(build_model("llama", config, seed=0), "llama", config, base / "float", variant="serving")
    quantize_artifact(base / "float", base / "int8", bits=8, block_size=32, greedy_tokens=1)
    return open_artifact(base / "float"), open_artifact(base / "int8")


@pytest.fixture(scope="module")
def report(artifacts):
    return bench(
        [a.directory for a in artifacts],
        backends=["eager", "ort-cpu"],
        settings=SETTINGS,
        isolate=False,
        bandwidth_bytes=64 << 20,
    )


def expected_weight_bytes(bits: int | None) -> int:
    """Bytes a decode step reads in full, from the config: every projection + the head + norm gains.

    The embedding table is read by Gather (a few rows), so it is not counted; its transposed copy that the
    head multiplies by is. Quantized: per [K, N] matrix, K*N*bits/8 bytes of values, float32 scales and
    uint8 zero points per (column, K-block) (two 4-bit zero points per byte).
    """
    c = CONFIG
    head = c["width"] // c["heads"]
    matrices = [
        (c["width"], c["heads"] * head),
        (c["width"], c["kv_heads"] * head),
        (c["width"], c["kv_heads"] * head),
        (c["heads"] * head, c["width"]),
        (c["width"], c["ff_width"]),
        (c["width"], c["ff_width"]),
        (c["ff_width"], c["width"]),
    ] * c["layers"]
    matrices.append((c["width"], c["vocab_size"]))
    gains = (2 * c["layers"] + 1) * c["width"] * 4
    if bits is None:
        return sum(k * n * 4 for k, n in matrices) + gains
    total = 0
    for k, n in matrices:
        blocks = -(-k // 32)
        total += k * n * bits // 8 + n * blocks * 4 + n * (blocks if bits == 8 else -(-blocks // 2))
    return total + gains


def kv_bytes(batch: int) -> float:
    c = CONFIG
    context = SETTINGS.prompt_len + SETTINGS.new_tokens / 2
    return batch * c["layers"] * 2 * c["kv_heads"] * (c["width"] // c["heads"]) * 4 * context


def test_json_shape_and_sanity(report):
    assert set(report) >= {"machine", "results"}
    machine = report["machine"]
    assert set(machine) >= {"cpu", "threads", "read_bandwidth_gbs", "versions"}
    assert machine["threads"] == 1 and machine["read_bandwidth_gbs"] > 0
    # The bound uses the faster of the two streaming reads, so no backend's GEMV can beat it by probe choice.
    probes = machine["read_bandwidth_probes_gbs"]
    assert set(probes) == {"torch_sum", "onnxruntime_gemv"} and min(probes.values()) > 0
    assert machine["read_bandwidth_gbs"] == max(probes.values())
    assert {"torch", "onnxruntime", "onnx"} <= set(machine["versions"])
    rows = [(r["backend"], r["lowering"], r["bits"], r["batch"]) for r in report["results"]]
    # eager once (on the float artifact), ONNX Runtime on both, every batch size
    assert rows == [
        ("eager", "torch", None, 1),
        ("eager", "torch", None, 2),
        ("ort-cpu", "functions", None, 1),
        ("ort-cpu", "functions", None, 2),
        ("ort-cpu", "functions", 8, 1),
        ("ort-cpu", "functions", 8, 2),
    ]
    for r in report["results"]:
        assert KEYS <= set(r)
        assert r["dtype"] == "float32"
        for key in ("prefill_ms", "decode_tokens_per_s", "bandwidth_fraction", "peak_rss_mb"):
            assert r[key] > 0, (key, r)
        assert r["prefill_ms_min"] <= r["prefill_ms"] <= r["prefill_ms_max"]
        assert r["decode_tokens_per_s_min"] <= r["decode_tokens_per_s"] <= r["decode_tokens_per_s_max"]
    json.dumps(report)  # serialisable as is


def test_bandwidth_fraction_rederived(report):
    bandwidth = report["machine"]["read_bandwidth_gbs"] * 1e9
    for r in report["results"]:
        weights = expected_weight_bytes(r["bits"])
        # a few bytes of shape constants and RoPE frequencies are read too
        assert weights <= r["weight_bytes"] <= weights * 1.02, (r["weight_bytes"], weights)
        per_token = (r["weight_bytes"] + kv_bytes(r["batch"])) / r["batch"]
        assert r["bytes_per_token"] == pytest.approx(per_token, rel=1e-9)
        assert r["bandwidth_fraction"] == pytest.approx(r["decode_tokens_per_s"] * per_token / bandwidth, rel=1e-9)


def test_cli_isolated_json_png(artifacts, tmp_path, monkeypatch):
    import_or_skip("matplotlib", reason="the --png chart needs matplotlib (the plot extra)")
    # The bandwidth probe's own buffer is sized to the machine (several GiB where a VM reports its socket's cache,
    # tests/toolkit/bench/test_machine.py); this test is about the command's files, so it probes 64 MiB.
    monkeypatch.setattr("toolkit.bench.machine.probe_buffer_bytes", lambda: 64 << 20)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = invoke(
        "bench",
        artifacts[0].directory,
        "--backends",
        "ort-cpu",
        "--prompt-len",
        2,
        "--new-tokens",
        2,
        "--batch",
        1,
        "--repeats",
        1,
        "--warmup",
        0,
        "--threads",
        1,
        "--json",
        out,
        "--png",
        png,
    )
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(out.read_text())
    [row] = report["results"]
    assert KEYS <= set(row) and row["peak_rss_scope"] == "subprocess" and row["peak_rss_mb"] > 0
    assert "ort-cpu functions float32" in result.stdout and "GB/s" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_errors(artifacts, tmp_path, monkeypatch):
    directory = artifacts[0].directory
    assert_user_error(invoke("bench"), "at least one ARTIFACT_DIR")
    assert_user_error(invoke("bench", directory, "--backends", "llama.cpp"), "unknown backend 'llama.cpp'")
    assert_user_error(invoke("bench", directory, "--batch", "1,x"), "--batch", "'1,x'")
    assert_user_error(invoke("bench", directory, "--prompt-len", 12, "--new-tokens", 8), "exceed", "max_positions 16")
    assert_user_error(invoke("bench", tmp_path), "missing manifest.json")
    result = invoke("bench", directory, "--from", "x.gguf")
    assert result.exit_code == 2 and "--from only names the checkpoint for --export" in result.output
    assert_user_error(
        invoke("bench", directory, "--export", "--from", tmp_path / "missing.gguf"),
        "missing.gguf: no such file or directory",
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    assert_user_error(
        invoke(
            "bench",
            directory,
            "--backends",
            "ort-cpu",
            "--prompt-len",
            1,
            "--new-tokens",
            1,
            "--batch",
            1,
            "--repeats",
            1,
            "--warmup",
            0,
            "--in-process",
            "--png",
            tmp_path / "c.png",
        ),
        "--png needs matplotlib",
    )
