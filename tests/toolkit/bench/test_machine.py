"""The machine probes behind the bench's bandwidth bound."""

from __future__ import annotations

import numpy as np

import toolkit.memory
from toolkit.bench import machine

MiB, GiB = 1 << 20, 1 << 30


def test_the_probe_buffer_is_eight_llcs_capped_at_a_quarter_of_available_memory(monkeypatch):
    # A 2-core VM guest that reports its socket's 480 MiB L3.
    monkeypatch.setattr(machine, "llc_bytes", lambda: 480 * MiB)
    monkeypatch.setattr(toolkit.memory, "available_memory", lambda: 8 * GiB)
    assert machine.probe_buffer_bytes() == 2 * GiB
    monkeypatch.setattr(toolkit.memory, "available_memory", lambda: None)
    assert machine.probe_buffer_bytes() == 3840 * MiB
    monkeypatch.setattr(toolkit.memory, "available_memory", lambda: 100 * MiB)
    assert machine.probe_buffer_bytes() == 64 * MiB
    monkeypatch.setattr(machine, "llc_bytes", lambda: 8 * MiB)
    monkeypatch.setattr(toolkit.memory, "available_memory", lambda: 8 * GiB)
    assert machine.probe_buffer_bytes() == 256 * MiB


def test_the_onnxruntime_gemv_probe_reads_a_weight_above_protobufs_2_gib_limit():
    # An initializer this size cannot be serialised into one ModelProto; the probe binds it instead.
    probe = machine._ort_gemv(1, 2 * GiB + 4 * MiB)
    assert probe is not None
    run, nbytes = probe
    assert nbytes == 1024 * ((2 * GiB + 4 * MiB) // 4 // 1024) * 4
    y = run().numpy()  # ones times ones: every column sums K = 1024 ones
    assert y.shape == (1, nbytes // 4 // 1024)
    np.testing.assert_array_equal(y, np.full_like(y, 1024.0))
