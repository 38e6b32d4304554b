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
