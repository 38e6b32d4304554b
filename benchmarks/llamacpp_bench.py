"""llama.cpp (llama-cpp-python) on the same GGUF, measured the way `toolkit bench` measures ONNX Runtime.

Same protocol as toolkit/bench/bench.py's `measure`: a fixed random prompt (seed 0) of --prompt-len ids,
`warmup` untimed runs, then `repeats` timed runs of one prefill (empty cache) and --new-tokens greedy
decode steps (the arg-max taken inside the timed loop), batch 1, --threads for both prompt and
generation. Prints one JSON row in the shape of `toolkit bench`'s results (and appends it to --into).

llama-cpp-python is not a dependency of this project (its build takes about ten minutes on two cores
and the default native build dies with "Illegal instruction" on some VMs); build it with
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF" \
        pip install --target /tmp/llamacpp-site llama-cpp-python diskcache
and run this with PYTHONPATH=/tmp/llamacpp-site.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np

SEED = 0  # toolkit.bench.bench.SEED: the same prompt ids


def measure(gguf: Path, threads: int, prompt_len: int, new_tokens: int, repeats: int, warmup: int) -> dict:
    from llama_cpp import Llama, __version__

    llm = Llama(
        model_path=str(gguf),
        n_ctx=prompt_len + new_tokens,
        n_batch=prompt_len,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    prompt = np.random.default_rng(SEED).integers(0, llm.n_vocab(), (1, prompt_len), dtype=np.int64)[0].tolist()
    vocab = llm.n_vocab()
    prefill, decode = [], []
    for run in range(warmup + repeats):
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        middle = time.perf_counter()
        for _ in range(new_tokens):
            # Without logits_all llama-cpp-python keeps no scores; the context holds the last token's logits.
            token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))
            llm.eval([token])
        end = time.perf_counter()
        if run >= warmup:
            prefill.append((middle - start) * 1e3)
            decode.append(new_tokens / (end - middle))
    quant = gguf.stem.rsplit(".", 1)[-1].lower()  # SmolLM2-135M-Instruct.Q4_1 -> q4_1
    bits = re.match(r"q(\d+)", quant)
    return {
        "backend": "llama.cpp",
        "lowering": None,
        "dtype": f"gguf-{quant}",
        "bits": int(bits.group(1)) if bits else None,
        "batch": 1,
        "prefill_ms": statistics.median(prefill),
        "prefill_ms_min": min(prefill),
        "prefill_ms_max": max(prefill),
        "decode_tokens_per_s": statistics.median(decode),
        "decode_tokens_per_s_min": min(decode),
        "decode_tokens_per_s_max": max(decode),
        "llama_cpp_python": __version__,
        "threads": threads,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--into", type=Path, help="a `toolkit bench` JSON report to append the row to")
    args = parser.parse_args()
    if importlib.util.find_spec("llama_cpp") is None:
        print("llama-cpp-python is not importable; see this script's docstring", file=sys.stderr)
        return 2
    row = measure(args.gguf, args.threads, args.prompt_len, args.new_tokens, args.repeats, args.warmup)
    print(json.dumps(row))
    if args.into:
        report = json.loads(args.into.read_text())
        bandwidth = report["machine"]["read_bandwidth_gbs"] * 1e9
        row["bandwidth_fraction"] = None  # llama.cpp's bytes per token are its own (Q4_1 blocks), not ours
        row["gguf_bytes"] = args.gguf.stat().st_size
        row["decode_bound_tokens_per_s_gguf"] = bandwidth / args.gguf.stat().st_size
        report["results"].append(row)
        args.into.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
