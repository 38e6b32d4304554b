"""Peak memory and time of `toolkit export --from` on a random-weight Llama checkpoint of a real width.

Builds a LlamaForCausalLM with transformers (hidden 1024, 16 heads, 4 KV heads, intermediate 2816, vocab 32000,
untied; LAYERS layers), saves it as safetensors, then exports it in a child process and reads the child's
peak resident set size (getrusage RUSAGE_CHILDREN) and wall time. The ratio to the weight bytes is the figure
issue 16 targets (at most 1.3x).

    .venv/bin/python benchmarks/export_memory.py --layers 20 --json benchmarks/results/2026-12-01-export-memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build(directory: Path, layers: int) -> int:
    code = (
        "import sys, torch, transformers\n"
        "c = transformers.LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, "
        f"num_hidden_layers={layers}, num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512, "
        "tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)\n"
        "torch.manual_seed(0)\n"
        "m = transformers.LlamaForCausalLM(c)\n"
        "m.save_pretrained(sys.argv[1])\n"
        "print(sum(p.numel() for p in m.parameters()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(directory)], check=True, capture_output=True, text=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    toolkit = [str(Path(sys.executable).parent / "toolkit")]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        parameters = build(Path(tmp) / "hf", args.layers)
        load_before = os.getloadavg()
        start = time.perf_counter()
        subprocess.run(
            [*toolkit, "export", "--from", str(Path(tmp) / "hf"), "--out", str(Path(tmp) / "art"), "--no-verify"],
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
        seconds = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # the export is the largest child
        files = {p.name: p.stat().st_size for p in (Path(tmp) / "art").iterdir()}
    weights = parameters * 4
    result = {
        "layers": args.layers,
        "parameters": parameters,
        "weight_bytes_float32": weights,
        "peak_rss_bytes": peak,
        "peak_rss_over_weights": peak / weights,
        "export_seconds": seconds,
        "files": files,
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
