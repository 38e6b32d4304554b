"""Reports people read: JUnit with the numbers, and the HTML page checked in a real headless browser."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from click.testing import CliRunner

from toolkit.check.crosscheck import cross_check
from toolkit.check.reports import to_junit
from toolkit.cli import main

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Install with: apt-get install -y chromium   (CI sets TOOLKIT_REQUIRE_BROWSER=1 so a missing browser fails)
REQUIRE = os.environ.get("TOOLKIT_REQUIRE_BROWSER") == "1"
WIDTH, HEIGHT = 1200, 900


def test_junit_has_one_case_per_backend_and_stage_with_numbers(exported):
    artifact = exported("block-small")
    report = cross_check(artifact, ["eager", "ort-cpu"], batch=1, sequence=2)
    # Make one comparison fail with known numbers.
    failed = report.backends[1].comparison["logits"]
    failed.passed, failed.max_abs, failed.allowed, failed.reason = (
        False,
        0.125,
        0.0625,
        "max_abs 0.125 > allowed 0.0625",
    )
    suite = ET.fromstring(to_junit(report)).find("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == 2 * len(artifact.output_names)
    assert {(c.get("classname"), c.get("name")) for c in cases} == {
        (f"check.{b}", s) for b in ("eager", "ort-cpu") for s in artifact.output_names
    }
    assert suite.get("failures") == "1"
    (failure,) = [c.find("failure") for c in cases if c.find("failure") is not None]
    assert "max_abs=1.25e-01" in failure.get("message") and "allowed=6.25e-02" in failure.get("message")


def _browser(args, tmp_path):
    return subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_html_report_renders_in_a_real_browser(tmp_path):
    if CHROMIUM is None:
        if REQUIRE:
            pytest.fail("TOOLKIT_REQUIRE_BROWSER=1 but no chromium on PATH; apt-get install -y chromium")
        pytest.skip("no chromium on PATH (apt-get install -y chromium); set TOOLKIT_REQUIRE_BROWSER=1 to require it")
    pytest.importorskip("matplotlib", reason="--html needs matplotlib (the plot extra)")
    page = tmp_path / "report.html"
    result = CliRunner().invoke(main, ["check", "--html", str(page)])  # the worked example
    assert result.exit_code == 0, result.output
    text = page.read_text()
    # Self-contained: nothing is fetched from anywhere.
    assert not re.search(r"""(src|href)=["'](?!data:)""", text)
    assert "<script" not in text

    dom = _browser(["--dump-dom", page.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    stages = ["block.0.attention_norm", "block.0.attention_weights", "block.0.output", "logits"]
    for backend in ("eager", "ort-cpu", "onnx-reference"):
        assert f'<th data-backend="{backend}">{backend}</th>' in dom.stdout
        for stage in stages:
            cell = re.search(
                rf'<td class="(pass|fail)" data-backend="{backend}" data-stage="{re.escape(stage)}"', dom.stdout
            )
            assert cell and cell.group(1) == "pass", (backend, stage)
    assert dom.stdout.count('class="attention"') == 1  # one attention stage in the worked example
    assert 'id="error-plot"' in dom.stdout

    shot = tmp_path / "shot.png"
    run = _browser([f"--screenshot={shot}", f"--window-size={WIDTH},{HEIGHT}", page.as_uri()], tmp_path)
    assert run.returncode == 0 and shot.is_file(), run.stderr[-2000:]
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))[..., :3]  # floats in [0, 1], rows x columns x RGB
    assert pixels.shape[:2] == (HEIGHT, WIDTH)
    # The table's passing cells are drawn in the CSS green #bfe8c4 = (191, 232, 196); its header in #dde3ea.
    green = np.all(np.abs(pixels * 255 - (191, 232, 196)) < 3, axis=-1)
    header = np.all(np.abs(pixels * 255 - (221, 227, 234)) < 3, axis=-1)
    rows, cols = np.nonzero(green)
    # 3 backends x 8 stages of green cells: a large block in the upper part of the page, right of the headers.
    assert green.sum() > 3 * 8 * 500, green.sum()
    assert rows.min() < HEIGHT // 2 and cols.max() > cols.min() + 200
    assert header.sum() > 2000
    # Green cells sit in the table's columns, to the right of the stage-name header column.
    assert np.nonzero(header)[1].min() < cols.min()


def test_html_without_matplotlib_is_one_clear_error(monkeypatch, tmp_path):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    result = CliRunner().invoke(main, ["check", "--backends", "eager", "--html", str(tmp_path / "r.html")])
    assert result.exit_code == 2
    assert "--html needs matplotlib" in result.output and "[plot]" in result.output
    assert not (tmp_path / "r.html").exists()
