"""matplotlib, loaded on demand for the charts of `check --html`, `bench --png` and `depth --plot`."""

from __future__ import annotations

from artifact.errors import ToolkitError


def pyplot(option: str):
    """matplotlib.pyplot on the Agg backend (no display: render to memory or a file), or one line saying that
    `option` needs matplotlib and how to get it. Commands call it before their slow part, to fail fast."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ToolkitError(
            f"{option} needs matplotlib; install it with `pip install -e '.[plot]'` "
            f"(or pip install matplotlib), or drop {option}"
        ) from None
    return plt
