"""The exit statuses of every command: 0 pass, 1 diverged (a verdict), 2 a user error, 3 an internal error. An
unexpected exception is one line and exit 3, never a traceback and never a status that reads as a verdict."""

from __future__ import annotations

import errno

import pytest

import toolkit.commands.presets
from tests.toolkit.test_cli import assert_user_error, invoke
from toolkit.cli import DEBUG_ENV, EXIT_INTERNAL_ERROR


@pytest.fixture
def broken_presets(monkeypatch):
    def boom():
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(toolkit.commands.presets, "preset_rows", boom)


def test_an_unexpected_exception_exits_3_in_one_line(broken_presets, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    result = invoke("presets")
    assert result.exit_code == EXIT_INTERNAL_ERROR == 3, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [
        "Error: internal error (RuntimeError: boom); this is a toolkit bug, please report it with the command line "
        "(--debug prints the traceback)"
    ]
    assert "Traceback" not in result.output


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_prints_the_traceback(broken_presets, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv(DEBUG_ENV, "1")
    result = invoke("--debug", "presets") if how == "flag" else invoke("presets")
    assert result.exit_code == 3
    assert "Traceback (most recent call last)" in result.stderr and "RuntimeError: boom" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("Error: internal error (RuntimeError: boom)")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EFBIG, errno.EROFS])
def test_an_unwritable_or_full_location_is_a_user_error(monkeypatch, tmp_path, code):
    import artifact.write

    def full(*args, **kwargs):
        raise OSError(code, "No space left on device" if code == errno.ENOSPC else "refused", str(tmp_path / "out"))

    monkeypatch.setattr(artifact.write.tempfile, "mkdtemp", full)
    result = invoke("export", "--preset", "decoder-small", "--out", tmp_path / "out")
    assert_user_error(result, str(tmp_path / "out"), "free space or choose a writable location")


def test_other_os_errors_are_internal(broken_presets, monkeypatch):
    def lost(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(toolkit.commands.presets, "preset_rows", lost)
    result = invoke("presets")
    assert result.exit_code == 3 and "internal error (OSError: [Errno 5] Input/output error)" in result.stderr
