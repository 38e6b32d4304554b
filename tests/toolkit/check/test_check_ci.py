"""The example CI workflow runs real toolkit commands: each `toolkit ...` line is executed on a temp dir."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from toolkit.cli import main

WORKFLOW = Path(__file__).resolve().parents[3] / "examples" / "ci" / "toolkit-check.yml"


def _steps():
    text = WORKFLOW.read_text()
    import yaml  # in the [test] extra

    data = yaml.safe_load(text)
    job = data["jobs"]["check"]
    lines = [line.strip() for step in job["steps"] for line in str(step.get("run", "")).splitlines()]
    return job, [line for line in lines if line.startswith("toolkit ")]


def test_workflow_runs_real_toolkit_commands(tmp_path, monkeypatch):
    job, lines = _steps()
    env = job["env"]
    uses = [step.get("uses", "") for step in job["steps"]]
    assert any(u.startswith("actions/upload-artifact") for u in uses)
    assert any("torch==2.13.0" in str(step.get("run", "")) for step in job["steps"])
    assert [shlex.split(line)[1] for line in lines] == ["export", "check"]
    # The documented way to create the golden directory (comment in the workflow) comes first.
    setup = [
        line.lstrip("# ").strip()
        for line in WORKFLOW.read_text().splitlines()
        if line.lstrip("# ").startswith("toolkit check") and "--save-golden" in line
    ]
    assert setup, "the workflow must document how to (re)create its golden directory"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "reports").mkdir()
    runner = CliRunner()
    export_line, check_line = lines
    for line in (export_line, setup[0].replace("ci/golden/decoder-small", "$GOLDEN"), check_line):
        args = [
            env.get(a.strip('"$'), a) if a.startswith('"$') or a.startswith("$") else a for a in shlex.split(line)[1:]
        ]
        result = runner.invoke(main, args)
        assert result.exit_code == 0, (line, result.output)
    for report in ("check.json", "check.xml", "check.html"):
        assert (tmp_path / "reports" / report).stat().st_size > 0
    assert "matches golden" in result.output


@pytest.mark.parametrize(
    "option", ["--golden", "--save-golden", "--localize", "--html", "--junit", "--json", "--tolerances"]
)
def test_check_help_lists_the_ci_options(option):
    result = CliRunner().invoke(main, ["check", "--help"])
    assert result.exit_code == 0 and option in result.output
