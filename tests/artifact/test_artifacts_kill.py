"""A writer SIGKILLed mid-write leaves the previous artifact intact and loadable, and the next write
clears what it left behind.

The child process writes one real exported artifact over another through write_artifact; a hook
at the chosen point prints "ready" and blocks, so the parent kills it exactly there (no timing).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from artifact import MANIFEST_FILE, MODEL_FILE, sha256_file, write_artifact
from artifact.errors import ModelFileError
from models.artifacts import open_artifact

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import os, shutil, sys, time
from pathlib import Path
import artifact.write as artifacts

target, source, point = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]

def stop_here():
    print("ready", flush=True)
    time.sleep(600)

files = {p.name: p.read_bytes() for p in source.iterdir()}

class HaltAfterFirstFile(dict):
    def items(self):
        for i, item in enumerate(super().items()):
            if i == 1:
                stop_here()  # one file is on disk in the temporary directory, the rest are not
            yield item

verify = None
if point == "writing":
    files = HaltAfterFirstFile(files)
elif point == "verifying":
    verify = lambda tmp: stop_here()
elif point == "swapped":
    real_rmtree = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        stop_here()  # the exchange is done; the old artifact has not been removed yet
    artifacts.shutil.rmtree = rmtree
elif point == "between-renames":
    artifacts._exchange = lambda a, b: False  # the fallback for filesystems without an atomic exchange
    real_rename = os.rename
    def rename(a, b):
        real_rename(a, b)
        stop_here()  # the old artifact is moved aside, the new one not yet in place
    artifacts.os.rename = rename
artifacts.write_artifact(target, files, verify=verify)
print("finished", flush=True)
"""


def snapshot(directory: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir())}


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def kill_writer_at(point: str, target: Path, source: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(target), str(source), point],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline()
        assert line == "ready\n", f"child never reached {point!r}: {line!r} {child.stderr.read()}"
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()
        child.stderr.close()


@pytest.fixture
def old_and_new(exported, tmp_path):
    """The artifact on disk and a different, equally valid one the writer puts over it (same graph,
    another manifest: the manifest is not hashed, so both load)."""
    target, source = tmp_path / "artifact", tmp_path / "source"
    shutil.copytree(exported("block-small").directory, target)
    shutil.copytree(target, source)
    manifest = json.loads((source / MANIFEST_FILE).read_text())
    manifest["preset"] = "written-by-the-new-export"
    (source / MANIFEST_FILE).write_text(json.dumps(manifest))
    return target, source


def preset(directory: Path) -> str:
    return open_artifact(directory).manifest.preset


@pytest.mark.parametrize("point", ["writing", "verifying", "swapped", "between-renames"])
def test_kill_mid_write_leaves_a_complete_loadable_artifact(old_and_new, point):
    target, source = old_and_new
    before, new = snapshot(target), snapshot(source)
    assert before != new
    kill_writer_at(point, target, source)

    if point == "between-renames":
        # The fallback swap's one window: only the moved-aside copy exists until the next write restores it.
        assert not target.exists() and len(leftovers(target.parent, "artifact")) >= 1
        with pytest.raises(ModelFileError, match=r"interrupted write left the previous artifact at .*\.artifact\.old-"):
            open_artifact(target)

        def reject(tmp):  # a next write that fails its own verification: the old artifact must be back
            raise ModelFileError("rejected")

        with pytest.raises(ModelFileError, match="rejected"):
            write_artifact(target, {MODEL_FILE: b"x"}, verify=reject)
        assert snapshot(target) == before and preset(target) == "block-small"
        assert leftovers(target.parent, "artifact") == []
    else:
        assert leftovers(target.parent, "artifact"), "the kill should have left the writer's temporary directory"
        # Before the swap the old artifact is untouched; after it, the new one is complete.
        assert snapshot(target) == (new if point == "swapped" else before)
        assert preset(target) == ("written-by-the-new-export" if point == "swapped" else "block-small")

    # The next write is not confused by what the dead writer left.
    write_artifact(target, {p.name: p.read_bytes() for p in source.iterdir()}, verify=open_artifact)
    assert snapshot(target) == new and preset(target) == "written-by-the-new-export"
    assert leftovers(target.parent, "artifact") == []
