"""Progress lines of `toolkit export`: on stderr when asked ($TOOLKIT_PROGRESS=1, or a terminal), never with
--quiet, and never on stdout (the command's output is the same either way)."""

from __future__ import annotations

import re

from tests.toolkit.test_cli import invoke
from toolkit.progress import PROGRESS_ENV


def test_export_progress_on_stderr_only(tmp_path, monkeypatch):
    monkeypatch.setenv(PROGRESS_ENV, "1")
    shown = invoke("export", "--preset", "decoder-small", "--out", tmp_path / "a")
    assert shown.exit_code == 0, shown.output
    steps = [line for line in shown.stderr.splitlines() if line.startswith("[export")]
    assert [re.sub(r"\[export +[\d.]+ s\] ", "", s).split(" ")[0] for s in steps] == ["tracing", "checking", "writing"]
    quiet = invoke("export", "--preset", "decoder-small", "--out", tmp_path / "b", "--quiet")
    assert quiet.exit_code == 0 and "[export" not in quiet.stderr
    monkeypatch.delenv(PROGRESS_ENV)  # not a terminal: quiet by default
    plain = invoke("export", "--preset", "decoder-small", "--out", tmp_path / "c")
    assert "[export" not in plain.stderr
    assert shown.stdout.replace(str(tmp_path / "a"), "OUT") == plain.stdout.replace(str(tmp_path / "c"), "OUT")


def test_quantize_progress_names_each_step(tmp_path, monkeypatch):
    out = invoke("export", "--preset", "decoder-small", "--variant", "serving", "--out", tmp_path / "float")
    assert out.exit_code == 0, out.output
    monkeypatch.setenv(PROGRESS_ENV, "1")
    args = ("quantize", tmp_path / "float", "--bits", 8, "--greedy-tokens", 2)
    shown = invoke(*args, "--out", tmp_path / "q")
    assert shown.exit_code == 0, shown.output
    steps = [re.sub(r"\[quantize +[\d.]+ s\] ", "", s) for s in shown.stderr.splitlines() if s.startswith("[quantize")]
    assert [s.split(" ")[0] for s in steps] == ["reading", "quantizing", "writing", "measuring", "writing"], steps
    assert re.match(r"quantizing model\.onnx: \d+ MatMuls to 8-bit \(rtn\)", steps[1]), steps[1]
    quiet = invoke(*args, "--out", tmp_path / "q2", "--quiet")
    assert quiet.exit_code == 0 and "[quantize" not in quiet.stderr


def test_hashing_a_large_file_reports_its_progress(tmp_path):
    from artifact.hashing import HASH_PROGRESS, PROGRESS_EVERY, sha256_file

    big, small = tmp_path / "model.onnx.data", tmp_path / "small"
    with open(big, "wb") as handle:  # sparse: no disk, hashed as zeros
        handle.truncate(PROGRESS_EVERY * 3 // 2)
    small.write_bytes(b"x" * 1000)
    seen: list[str] = []
    token = HASH_PROGRESS.set(seen.append)
    try:
        sha256_file(big)
        sha256_file(small)  # below the size that reports
    finally:
        HASH_PROGRESS.reset(token)
    every, size = PROGRESS_EVERY / 2**30, PROGRESS_EVERY * 1.5 / 2**30
    assert seen == [
        f"verifying model.onnx.data: {every:.2f} of {size:.2f} GiB hashed",
        f"verifying model.onnx.data: {size:.2f} of {size:.2f} GiB hashed",
    ]


def test_progress_lines_go_to_the_stream_the_command_started_with(monkeypatch):
    """The export's trace redirects sys.stderr into a buffer it discards; a line the hashing thread reports
    meanwhile still reaches the command's stderr."""
    import contextlib
    import io

    from toolkit.progress import PROGRESS_ENV, Progress

    monkeypatch.setenv(PROGRESS_ENV, "1")
    shown = io.StringIO()
    monkeypatch.setattr("sys.stderr", shown)
    progress = Progress("export")
    with contextlib.redirect_stderr(io.StringIO()):
        progress("verifying model.safetensors: 0.00 of 0.00 GiB hashed")
    assert "verifying model.safetensors" in shown.getvalue()
