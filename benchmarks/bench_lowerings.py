"""Prefill and decode speed of the three lowerings side by side (ONNX Runtime CPU, batch 1).

Exports SmolLM2-135M's shape (random weights: speed does not depend on the values) once per
lowering, then measures every lowering in turn in each round, so machine noise hits all alike:

    .venv/bin/python benchmarks/bench_lowerings.py --out /tmp/lowerings --repeats 5

Reports medians (and the best round) and each lowering's ratio to "functions".
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from artifact import is_artifact_dir
from exporters.lowerings import LOWERINGS
from exporters.onnx_export import export_model
from models.artifacts import artifact_config, open_artifact
from models.llama import LlamaConfig
from models.registry import build_model
from runners.decoding.generate import CachedLM
from runners.ort import OrtRunner, SessionLoader

SMOLLM2_SHAPE = LlamaConfig(
    vocab_size=49152,
    layers=30,
    width=576,
    heads=9,
    kv_heads=3,
    ff_width=1536,
    max_positions=2048,
    rope_base=100000.0,
    eps=1e-5,
    tie_embeddings=True,
    rope_pairing="half",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the three exports (reused if present)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    model = None
    lms = {}
    for lowering in LOWERINGS:
        path = args.out / lowering
        if not is_artifact_dir(path):
            model = model or build_model("llama", SMOLLM2_SHAPE, seed=0)
            start = time.perf_counter()
            export_model(model, "llama", SMOLLM2_SHAPE, path, variant="serving", lowering=lowering)
            print(f"exported {lowering} in {time.perf_counter() - start:.0f} s", flush=True)
        artifact = open_artifact(path)
        graph = artifact.graphs[0]
        loader = SessionLoader(graph.model_path, "CPUExecutionProvider", intra_op_threads=args.threads)
        runner = OrtRunner(loader, graph.input_specs, graph.output_names, artifact_config(artifact))
        lms[lowering] = CachedLM(runner, artifact_config(artifact).max_positions)
    prompt = np.random.default_rng(0).integers(0, SMOLLM2_SHAPE.vocab_size, (1, args.prompt_len))
    results = {name: {"prefill_ms": [], "decode_tokens_per_s": []} for name in lms}
    for round_ in range(args.repeats + 1):  # round 0 warms up every session
        for name, lm in lms.items():
            lm.reset()
            start = time.perf_counter()
            token = int(lm.step(prompt)[0, -1].argmax())
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(args.new_tokens):
                token = int(lm.step(np.array([[token]]))[0, -1].argmax())
            decode = args.new_tokens / (time.perf_counter() - start)
            if round_:
                results[name]["prefill_ms"].append(prefill * 1000)
                results[name]["decode_tokens_per_s"].append(decode)
    base = {k: statistics.median(v) for k, v in results["functions"].items()}
    print(
        f"prompt {args.prompt_len} tokens, {args.new_tokens} decode steps, {args.repeats} rounds, "
        f"{args.threads} threads; medians (best)"
    )
    for name, values in results.items():
        prefill, decode = statistics.median(values["prefill_ms"]), statistics.median(values["decode_tokens_per_s"])
        print(
            f"{name:10s} prefill {prefill:7.1f} ms ({min(values['prefill_ms']):7.1f})  "
            f"decode {decode:6.2f} tokens/s ({max(values['decode_tokens_per_s']):6.2f})  "
            f"vs functions: prefill {base['prefill_ms'] / prefill:.2f}x faster, "
            f"decode {decode / base['decode_tokens_per_s']:.2f}x"
        )


if __name__ == "__main__":
    main()
