"""Progress lines on stderr for long commands: each step with the seconds since the command started.

Shown when stderr is a terminal, or with $TOOLKIT_PROGRESS=1; never with --quiet. They go to stderr so the
command's own output (stdout) stays the same with or without them.
"""

from __future__ import annotations

import os
import sys
import threading
import time

PROGRESS_ENV = "TOOLKIT_PROGRESS"
# One line at a time: the checkpoint's hashing thread reports beside the main thread, and a text stream is not
# safe to write from two threads at once.
_WRITE = threading.Lock()


class Progress:
    def __init__(self, label: str, quiet: bool = False):
        forced = os.environ.get(PROGRESS_ENV)
        self.enabled = not quiet and (forced == "1" or (forced is None and sys.stderr.isatty()))
        self.label, self.start = label, time.perf_counter()
        # The stream when the command started: the export's trace swaps sys.stderr for a buffer it discards, and
        # the hashing thread's lines written meanwhile would go there.
        self.stream = sys.stderr

    def __call__(self, message: str) -> None:
        if self.enabled:
            line = f"[{self.label} {time.perf_counter() - self.start:6.1f} s] {message}\n"
            with _WRITE:
                self.stream.write(line)
                self.stream.flush()


def command_progress(label: str, quiet: bool) -> Progress:
    """The progress of a command with --quiet: its own lines, and the hashing of large files it reads or writes
    (artifact.hashing.HASH_PROGRESS) under its label, or none of either with --quiet."""
    from artifact.hashing import HASH_PROGRESS

    progress = Progress(label, quiet)
    HASH_PROGRESS.set(progress if progress.enabled else None)
    return progress
