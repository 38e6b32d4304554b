"""GPTQ's damping on a short calibration text: output error on the calibration text and on other text.

`--recipe gptq` measures H = E[x^T x] on 2048 tokens the float model writes; that is close to singular for a
K of 1536 (SmolLM2's down projections), and GPTQ can then fit those tokens rather than the model's inputs. This
script takes the off-grid SmolLM2 of benchmarks/recipes_offgrid.py (its `noise-0.08/hf` directory), samples --rows
(default 8) x 256 tokens with transformers (temperature 0.9, seeded) as the calibration text, reads H of four weights of the chosen
layers with forward pre-hooks on it and on two held-out texts (the first 2048 tokens of each --text file), and
for each damping reports GPTQ's output error tr((W - Q)^T H (W - Q)) over the k-quant search's (integer zero
points, weighted by the calibration H's diagonal): below 1 is better than the search. Deterministic; no timing.

    .venv/bin/python benchmarks/gptq_heldout.py --checkpoint /tmp/offgrid/noise-0.08/hf \
        --text /usr/share/common-licenses/GPL-3 --text /usr/lib/python3.11/pydoc_data/topics.py \
        --json benchmarks/results/2026-12-03-gptq-heldout.json
    .venv/bin/python benchmarks/gptq_heldout.py ... --rows 32 --json benchmarks/results/2026-12-03-gptq-heldout-8k.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import exporters.gptq as gptq  # noqa: E402
from exporters.kquant import kquant_blocks  # noqa: E402

SEEDS = ["The", "In the", "def ", "Once", "Water", "A study", "import", "The city"]
DAMPINGS = (0.01, 0.1, 0.3, 1.0)


def second_moments(model, modules: dict, rows: torch.Tensor) -> dict[str, np.ndarray]:
    sums, counts, hooks = {}, {}, []
    for name, module in modules.items():

        def hook(_, args, name=name):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums.get(name, 0) + x.T @ x
            counts[name] = counts.get(name, 0) + x.shape[0]

        hooks.append(module.register_forward_pre_hook(hook))
    with torch.no_grad():
        for row in rows:
            model(row[None])
    for h in hooks:
        h.remove()
    return {name: (sums[name] / counts[name]).numpy() for name in modules}


def error(w: np.ndarray, q: np.ndarray, h: np.ndarray) -> float:
    e = (w - q).astype(np.float64)
    return float(np.einsum("kn,kj,jn->", e, h, e))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--text", type=Path, action="append", required=True)
    parser.add_argument("--layers", default="5,20")
    parser.add_argument(
        "--rows", type=int, default=8, help="calibration sequences of 256 tokens, a multiple of 8 (default 8)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.float32).eval()
    torch.manual_seed(0)
    seeds = torch.tensor([[tokenizer(s).input_ids[0]] for s in SEEDS])
    if args.rows < len(SEEDS) or args.rows % len(SEEDS):
        raise SystemExit(f"--rows: a multiple of {len(SEEDS)}")
    with torch.no_grad():
        calibration = torch.cat([
            model.generate(seeds, do_sample=True, temperature=0.9, top_k=0, max_new_tokens=255, min_new_tokens=255)
            for _ in range(args.rows // len(SEEDS))
        ])  # fmt: skip
    held_out = {}
    for path in args.text:
        ids = tokenizer(path.read_text(), return_tensors="pt").input_ids[0, :2048]
        held_out[path.name] = ids.reshape(4, 512)
    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "texts": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in args.text},
        "calibration_tokens": int(calibration.numel()),
        "ratio_to_search": {},
    }
    for layer in (int(n) for n in args.layers.split(",")):
        block = model.model.layers[layer]
        modules = {
            "q_proj": block.self_attn.q_proj,
            "o_proj": block.self_attn.o_proj,
            "gate_proj": block.mlp.gate_proj,
            "down_proj": block.mlp.down_proj,
        }
        on = {"calibration": second_moments(model, modules, calibration)}
        on.update({name: second_moments(model, modules, rows) for name, rows in held_out.items()})
        for name, module in modules.items():
            w = module.weight.detach().numpy().T.astype(np.float32)  # [K, N], a MatMul's B
            h = on["calibration"][name]
            searched = kquant_blocks(w, 4, 32, np.diagonal(h).astype(np.float32), "integer").dequantize()
            row = {}
            for damping in DAMPINGS:
                gptq.DAMPING = damping
                q = gptq.gptq_blocks(w, h, 4, 32).dequantize()
                row[str(damping)] = {text: round(error(w, q, hs[name]) / error(w, searched, hs[name]), 3)
                                     for text, hs in on.items()}  # fmt: skip
            results["ratio_to_search"][f"layers.{layer}.{name}"] = row
            print(f"layer {layer} {name}: " + "  ".join(f"damping {d}: {r}" for d, r in row.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
