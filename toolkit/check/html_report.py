"""`toolkit check --html FILE`: one self-contained page a person reads.

No external resources: CSS is inline, plots are PNG data: URIs. The page has the
backend x stage table (verdict and max abs error per cell), the golden and
localisation results when present, per-stage error plots (max and mean abs error
per stage and backend, log scale, with the allowed error), and heat maps of the
attention probabilities. The probabilities are not hooked out of the model:
every family already returns them as the `*.attention_weights` stages, so the
heat maps draw the float64 oracle's values of those stages on the check inputs.
"""

from __future__ import annotations

import base64
import html
import io

import numpy as np

from toolkit.check.crosscheck import CheckReport
from toolkit.plotting import pyplot

# Log-scale plots cannot show an exact 0; errors below this are drawn on the floor line (labelled).
# The smallest float64 difference that matters here is far above it (float64 eps ~ 2.2e-16).
ERROR_FLOOR = 1e-18
MAX_HEATMAP_STAGES = 4
MAX_HEADS = 8


def _png(fig) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _fmt(value) -> str:
    return "n/a" if value is None or value != value else f"{value:.2e}"


def error_plot(report: CheckReport, plt) -> str:
    stages = report.stages
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 0.9 * len(stages) + 4), 4.2), sharey=True)
    x = np.arange(len(stages))
    for ax, field, title in ((axes[0], "max_abs", "max abs error"), (axes[1], "mean_abs", "mean abs error")):
        for backend in report.backends:
            values = [getattr(backend.comparison[s], field) for s in stages]
            values = [ERROR_FLOOR if (v != v or v <= ERROR_FLOOR) else v for v in values]
            ax.plot(x, values, marker="o", label=backend.name)
        allowed = [backend.comparison[s].allowed for s in stages] if report.backends else []
        if allowed:
            ax.plot(x, allowed, linestyle="--", color="black", label="allowed")
        ax.set_yscale("log")
        ax.set_title(f"{title} vs float64 oracle (0 drawn at {ERROR_FLOOR:g})")
        ax.set_xticks(x, stages, rotation=60, ha="right", fontsize=8)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()  # long rotated stage names were clipped at the figure's left edge
    data = _png(fig)
    plt.close(fig)
    return data


def attention_heatmaps(report: CheckReport, plt) -> list[tuple[str, str]]:
    reference = report.arrays.get("reference", {})
    names = [s for s in report.stages if s.endswith("attention_weights") and s in reference][:MAX_HEATMAP_STAGES]
    images = []
    for name in names:
        probs = np.asarray(reference[name], dtype=np.float64)
        if probs.ndim != 4:
            continue
        heads = probs[0][:MAX_HEADS]  # (heads, T_q, T_k) of the first batch row
        fig, axes = plt.subplots(1, len(heads), figsize=(2.6 * len(heads) + 0.8, 2.8), squeeze=False)
        for h, ax in enumerate(axes[0]):
            image = ax.imshow(heads[h], vmin=0.0, vmax=1.0, cmap="viridis")
            ax.set_title(f"head {h}", fontsize=9)
            # Positions are integers; matplotlib's default ticks would put half positions on the axes.
            t_q, t_k = heads[h].shape
            ax.set_xticks(range(t_k))
            ax.set_yticks(range(t_q))
            ax.tick_params(labelsize=7)
            ax.set_xlabel("key position", fontsize=8)
            if h == 0:  # one label for the row of heads; more would overlap the neighbouring map
                ax.set_ylabel("query position", fontsize=8)
            if heads[h].size <= 64:  # small maps are readable with their numbers
                for (i, j), p in np.ndenumerate(heads[h]):
                    ax.text(
                        j, i, f"{p:.2f}", ha="center", va="center", fontsize=7, color="white" if p < 0.5 else "black"
                    )
        fig.colorbar(image, ax=axes[0].tolist(), shrink=0.8)
        fig.suptitle(f"{name} (float64 oracle, batch row 0)", fontsize=10)
        images.append((name, _png(fig)))
        plt.close(fig)
    return images


CSS = """
body { font-family: sans-serif; margin: 24px; color: #111; background: #fff; }
table { border-collapse: collapse; margin: 12px 0; }
th, td { border: 1px solid #888; padding: 4px 10px; font-size: 14px; }
th { background: #dde3ea; }
td.pass { background: #bfe8c4; }
td.fail { background: #f5b3b0; font-weight: bold; }
.verdict-pass { color: #186a24; } .verdict-fail { color: #a4161a; }
code { background: #f2f2f2; padding: 1px 4px; }
"""


def render_html(report: CheckReport) -> str:
    """The whole page as one string."""
    plt = pyplot("--html")
    e = html.escape
    names = [b.name for b in report.backends]
    rows = []
    for stage in report.stages:
        first = report.backends[0].comparison[stage] if report.backends else None
        cells = []
        for backend in report.backends:
            result = backend.comparison[stage]
            verdict = "ok" if result.passed else "FAIL"
            title = e(result.reason or f"allowed {_fmt(result.allowed)}")
            cells.append(
                f'<td class="{"pass" if result.passed else "fail"}" data-backend="{e(backend.name)}" '
                f'data-stage="{e(stage)}" title="{title}">{_fmt(result.max_abs)} {verdict}</td>'
            )
        shape = "x".join(str(d) for d in first.reference_shape) if first else "?"
        rows.append(
            f'<tr><th scope="row">{e(stage)}</th><td>{shape}</td><td>{_fmt(first.allowed if first else None)}'
            f"</td>{''.join(cells)}</tr>"
        )
    summary = "".join(
        f'<li><b>{e(b.name)}</b> <span class="verdict-{"pass" if b.passed else "fail"}">'
        f"{'PASS' if b.passed else 'FAIL at ' + e(str(b.first_divergence))}</span> on {e(b.device)}, "
        f"{b.seconds * 1e3:.1f} ms</li>"
        for b in report.backends
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>toolkit check: {'PASS' if report.passed else 'FAIL'}</title><style>{CSS}</style></head><body>",
        f'<h1 id="verdict" class="verdict-{"pass" if report.passed else "fail"}">toolkit check: '
        f"{'PASS' if report.passed else 'FAIL'}</h1>",
        f"<p>artifact <code>{e(report.artifact)}</code>; inputs "
        f"{e(', '.join(k + ' ' + 'x'.join(map(str, v)) for k, v in report.inputs.items()))} "
        f"({e(report.input_source)}); reference eager-f64 (PyTorch float64). Cells: max abs error vs the reference.</p>",
        '<table id="results"><thead><tr><th>stage</th><th>shape</th><th>allowed</th>'
        + "".join(f'<th data-backend="{e(n)}">{e(n)}</th>' for n in names)
        + "</tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>",
        f"<ul>{summary}</ul>",
    ]
    if report.golden:
        info = report.golden_info
        items = []
        for result in report.golden:
            failure = result.comparison.first_failure
            items.append(
                f"<li><b>{e(result.name)}</b>: "
                + (
                    "matches golden"
                    if failure is None
                    else f'<span class="verdict-fail">drifted at {e(failure.name)}: {e(failure.reason)}</span>'
                )
                + "</li>"
            )
        parts.append(
            f"<h2>Golden outputs</h2><p><code>{e(str(info.get('directory')))}</code>, saved "
            f"{e(str(info.get('created')))}; graphs changed: {e(', '.join(info.get('graphs_changed') or []) or 'none')}"
            f'</p><ul id="golden">{"".join(items)}</ul>'
        )
    if report.localizations:
        parts.append(
            '<h2>Localisation</h2><ul id="localization">'
            + "".join(f"<li>{e(loc.describe())}</li>" for loc in report.localizations)
            + "</ul>"
        )
    if report.backends:
        parts.append(
            f'<h2>Error per stage</h2><img id="error-plot" alt="max and mean abs error per stage" '
            f'src="{error_plot(report, plt)}">'
        )
    heatmaps = attention_heatmaps(report, plt)
    if heatmaps:
        parts.append("<h2>Attention probabilities</h2>")
        parts.extend(
            f'<figure><img class="attention" alt="{e(name)}" src="{src}"><figcaption>{e(name)}</figcaption></figure>'
            for name, src in heatmaps
        )
    parts.append("</body></html>")
    return "\n".join(parts)
