"""The bench report as a text table and as a chart."""

from __future__ import annotations

from pathlib import Path

from toolkit.plotting import pyplot


def label(result: dict) -> str:
    bits = "" if result.get("bits") is None else f" int{result['bits']} {result.get('algorithm') or 'rtn'}"
    if result.get("accuracy_level"):
        bits += f" acc{result['accuracy_level']}"
    return f"{result['backend']} {result['lowering']} {result['dtype']}{bits}"


def write_png(report: dict, path: str | Path) -> None:
    """Decode tokens/s (with the bandwidth bound) and prefill ms per backend, one group per batch size."""
    plt = pyplot("--png")
    results = report["results"]
    labels = list(dict.fromkeys(label(r) for r in results))
    batches = sorted({r["batch"] for r in results})
    figure, (decode_axis, prefill_axis) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(labels), 1)
    for index, name in enumerate(labels):
        rows = {r["batch"]: r for r in results if label(r) == name}
        xs = [b + index * width for b in range(len(batches))]
        decode_axis.bar(xs, [rows[b]["decode_tokens_per_s"] if b in rows else 0 for b in batches], width, label=name)
        prefill_axis.bar(xs, [rows[b]["prefill_ms"] if b in rows else 0 for b in batches], width, label=name)
    for position, batch in enumerate(batches):
        bounds = [r["decode_bound_tokens_per_s"] for r in results if r["batch"] == batch and r["bits"] is None]
        if bounds:
            decode_axis.hlines(
                max(bounds),
                position - width / 2,
                position + 0.8 - width / 2,
                colors="k",
                linestyles="dashed",
                label="float32 bandwidth bound" if position == 0 else None,
            )
    for axis, title in (
        (decode_axis, "decode tokens/s (higher is better)"),
        (prefill_axis, "prefill ms (lower is better)"),
    ):
        axis.set_xticks([b + 0.4 - width / 2 for b in range(len(batches))], [f"batch {b}" for b in batches])
        axis.set_title(title)
    decode_axis.legend(fontsize=7)
    machine = report["machine"]
    figure.suptitle(f"{machine['cpu']}, {machine['threads']} threads, read {machine['read_bandwidth_gbs']:.1f} GB/s")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def bench_table(report: dict) -> str:
    machine = report["machine"]
    load = machine.get("load_average") or [float("nan")]
    lines = [
        f"machine: {machine['cpu']}, {machine['threads']} threads, measured read bandwidth "
        f"{machine['read_bandwidth_gbs']:.1f} GB/s, load average {load[0]:.1f} at the end; onnxruntime "
        f"{machine['versions']['onnxruntime']}, torch {machine['versions']['torch']}",
        f"{'backend':<44} {'batch':>5} {'prefill ms (min-max)':>24} {'decode tok/s (min-max)':>26} "
        f"{'bound':>8} {'of bound':>8} {'peak RSS MB':>11}",
    ]
    for r in report["results"]:
        prefill = f"{r['prefill_ms']:.1f} ({r['prefill_ms_min']:.1f}-{r['prefill_ms_max']:.1f})"
        decode = (
            f"{r['decode_tokens_per_s']:.1f} ({r['decode_tokens_per_s_min']:.1f}-{r['decode_tokens_per_s_max']:.1f})"
        )
        lines.append(
            f"{label(r):<44} {r['batch']:>5} {prefill:>24} {decode:>26} "
            f"{r['decode_bound_tokens_per_s']:>8.1f} {r['bandwidth_fraction']:>8.0%} {r['peak_rss_mb']:>11.0f}"
        )
    return "\n".join(lines)
