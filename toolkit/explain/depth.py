"""The chart of `toolkit depth`: activation RMS through stacked pre-norm and post-norm blocks."""

from __future__ import annotations

from toolkit.plotting import pyplot


def plot(result: dict, path) -> None:
    """Write a PNG of both curves; needs matplotlib (the `plot` extra)."""
    plt = pyplot("--plot")
    figure, axis = plt.subplots(figsize=(6, 4))
    blocks = range(1, result["layers"] + 1)
    axis.plot(blocks, result["pre"], marker="o", label="pre-norm")
    axis.plot(blocks, result["post"], marker="s", label="post-norm")
    axis.set_xlabel("block")
    axis.set_ylabel("activation RMS")
    axis.set_title("Residual stream through stacked blocks")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
