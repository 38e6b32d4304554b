"""Fuzzing the files `toolkit check` reads besides the artifact: tolerance files (TOML and JSON, through the
bounded reader and the typed parse) and golden directories' golden.json (mutations of a real index). Only
the toolkit's own errors escape, in one line. 2,000 cases per file, counts printed."""

from __future__ import annotations

import json
import math
import shutil

import pytest
from hypothesis import strategies as st

from artifact.errors import ConfigError
from tests.models.test_checkpoint_configs_fuzz import JSON_VALUES, json_texts, run_fuzz
from tests.toolkit.test_cli import invoke
from toolkit.check.driver import read_tolerances
from toolkit.check.golden import GoldenError, load_golden

pytestmark = pytest.mark.slow

CASES = 2000
TOLERANCES = {"float32": {"atol": 1e-6, "rtol": 1e-5, "stages": {"block.*": {"multiple": 4}}}, "float64": {"atol": 0}}
TOML_PIECES = st.sampled_from(
    [
        "[float32]\n",
        "[float64]\n",
        '[float32.stages."block.*"]\n',
        "[float16.stages.'logits']\n",
        "atol = 1e-6\n",
        "rtol = -1\n",
        "multiple = inf\n",
        "atol = 99999999999999999999999\n",
        'atol = "small"\n',
        "epsilon = 1\n",
        "a = [[[[[[[[]]]]]]]]\n",
        "a = " + "[" * 2000 + "]" * 2000 + "\n",
        "x = {a = {b = 1}}\n",
        "[float32\n",
        "# comment [[[[\n",
        's = """[[[[\n"""\n',
        "\udcff\n",  # a byte that is not UTF-8
    ]
)


@st.composite
def tolerance_files(draw) -> tuple[str, str]:
    """(suffix, text): JSON drawn like the other JSON files, or TOML assembled from lines."""
    if draw(st.booleans()):
        return ".json", draw(json_texts([TOLERANCES]))
    return ".toml", "".join(draw(st.lists(TOML_PIECES, max_size=8)))


def test_fuzz_tolerance_files(tmp_path, fuzz_summary):
    def check(drawn):
        suffix, text = drawn
        path = tmp_path / f"tolerances{suffix}"
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        config = read_tolerances(str(path))
        for table in [config.per_dtype, *config.per_dtype_output.values()]:
            for tolerance in table.values():  # independent invariant: finite, non-negative numbers
                assert all(math.isfinite(v) and v >= 0 for v in (tolerance.atol, tolerance.rtol, tolerance.multiple))

    run_fuzz("toolkit.check.driver.read_tolerances", tolerance_files(), check, fuzz_summary, errors=(ConfigError,))


@pytest.fixture(scope="module")
def golden(exported, tmp_path_factory):
    directory = tmp_path_factory.mktemp("golden-fuzz") / "g"
    result = invoke("check", exported("block-small").directory, "--backends", "ort-cpu", "--save-golden", directory)
    assert result.exit_code == 0, result.output
    return directory


@st.composite
def golden_indexes(draw, index: dict) -> str:
    """The real index with up to four values replaced (top level, a group, an array entry) or dropped."""
    data = json.loads(json.dumps(index))
    for _ in range(draw(st.integers(0, 4))):
        places = [data, *(v for v in data.values() if isinstance(v, dict))]
        groups = data.get("groups") if isinstance(data.get("groups"), dict) else {}
        places += [g for g in groups.values() if isinstance(g, dict)]
        places += [a for g in places[:] if isinstance(g.get("arrays"), dict) for a in g["arrays"].values()]
        where = draw(st.sampled_from([p for p in places if isinstance(p, dict)]))
        key = draw(st.sampled_from(sorted(where) + ["unknown"]))
        if draw(st.integers(0, 4)) == 0:
            where.pop(key, None)
        else:
            where[key] = draw(JSON_VALUES)
    text = json.dumps(data, allow_nan=True)
    if draw(st.integers(0, 14)) == 0:
        text = draw(st.sampled_from([text[: len(text) // 2], "[" * 3000 + "]" * 3000, text.replace("1", "1" * 30)]))
    return text


def test_fuzz_golden_index(golden, tmp_path, fuzz_summary):
    directory = tmp_path / "g"
    shutil.copytree(golden, directory)
    index = json.loads((golden / "golden.json").read_text())

    def check(text):
        (directory / "golden.json").write_text(text)
        loaded = load_golden(directory)
        assert set(loaded.stages) <= set(loaded.reference)  # independent: every stage has a stored output

    run_fuzz(
        "toolkit.check.golden.load_golden (golden.json)", golden_indexes(index), check, fuzz_summary, (GoldenError,)
    )
