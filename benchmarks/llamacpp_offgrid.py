"""llama.cpp's own 4-bit files of an off-grid SmolLM2 proxy, measured as the toolkit's recipes are.

Issue 18's target for float weights is perplexity within 5 % of float. `recipes_offgrid.py --proxy` measures the
toolkit's recipes on checkpoints that compute SmolLM2's function in weights on no 4-bit grid; this script puts
llama.cpp's quantizer beside them on the same checkpoint, as an anchor from outside the toolkit: how close does
llama.cpp's own quantization (the one users ship) come to float on the same weights and the same text?

The proxy's Hugging Face directory (`recipes_offgrid.py --proxy ...` writes it as WORK/<proxy>/hf) is written as a
float32 GGUF with the gguf library's writer: llama.cpp's tensor names, q and k rows permuted from Hugging Face's
rotate-half order to the GGUF's interleaved one (convert_hf_to_gguf.py's LlamaModel.permute), the tokenizer's
fields copied from SmolLM2's GGUF. llama.cpp's perplexity of that file on the text must match the toolkit's
float artifact's (the script refuses to go on beyond 0.5 %), which checks the conversion. Each type is then made
by `llama_model_quantize` (llama-cpp-python's binding; no importance matrix, which its API takes only as data
from llama.cpp's imatrix tool) and measured: perplexity on the text's windows (the quality report's windows,
each fed alone), greedy agreement with the float artifact on the quality report's fixed prompts, and each file's
tensor types. `pure` types quantize every matrix, the head and the embedding too, to the one type.

    .venv/bin/python benchmarks/llamacpp_offgrid.py --hf /tmp/rot/permutation/hf --float /tmp/rot/permutation/ort \
        --text /usr/share/common-licenses/GPL-3 --work /tmp/llamacpp-offgrid --json ...
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# name: (llama.cpp file type, pure)
TYPES = {
    "Q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", False),
    "Q4_0 pure": ("LLAMA_FTYPE_MOSTLY_Q4_0", True),
    "Q4_1": ("LLAMA_FTYPE_MOSTLY_Q4_1", False),
    "Q4_K_S": ("LLAMA_FTYPE_MOSTLY_Q4_K_S", False),
    "Q4_K_M": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", False),
    "Q5_K_M": ("LLAMA_FTYPE_MOSTLY_Q5_K_M", False),
    "Q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", False),
}
FLOAT_MATCH = 0.005  # llama.cpp's float32 file against the float artifact, relative perplexity


def permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rows of a q or k projection [heads * head_dim, in] from rotate-half order to the GGUF's interleaved pairs."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def write_float_gguf(hf: Path, out: Path, template: Path) -> None:
    """The Hugging Face Llama directory `hf` (safetensors, untied head) as a float32 GGUF."""
    import gguf
    from gguf_shape import tokenizer_fields
    from safetensors.numpy import load_file

    config = json.loads((hf / "config.json").read_text())
    refused = {k: config.get(k) for k in ("rope_scaling", "attention_bias", "mlp_bias") if config.get(k)}
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        refused["rope_parameters"] = rope
    if refused or config.get("model_type") != "llama":
        raise SystemExit(f"{hf}: this writer takes a plain Llama; it does not write {refused or config['model_type']}")
    tensors = load_file(hf / "model.safetensors")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"{hf.parent.name} proxy")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for key, (value, value_type, item_type) in tokenizer_fields(template).items():
        writer.add_key_value(key, value, value_type, item_type)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(config["num_hidden_layers"]):
        for theirs, ours in per_layer.items():
            names[f"model.layers.{i}.{theirs}.weight"] = f"blk.{i}.{ours}.weight"
    if set(tensors) != set(names):
        raise SystemExit(f"{hf}: tensors {sorted(set(tensors) ^ set(names))[:6]} are not a plain untied Llama's")
    for name, target in names.items():
        value = tensors[name].astype(np.float32)
        if name.endswith("q_proj.weight"):
            value = permute(value, heads)
        elif name.endswith("k_proj.weight"):
            value = permute(value, kv_heads)
        writer.add_tensor(target, np.ascontiguousarray(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize(source: Path, out: Path, ftype: str, pure: bool) -> float:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = getattr(llama_cpp, ftype)
    params.pure = pure
    start = time.perf_counter()
    failed = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if failed:
        raise SystemExit(f"llama_model_quantize {ftype} failed ({failed})")
    return time.perf_counter() - start


def tensor_types(path: Path) -> tuple[dict, float]:
    """({type: tensors of it}, bits per weight of the file's MatMul weights, the head's too, not the embedding's
    (a lookup, float in the toolkit's artifacts): their bytes over their elements)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    matrices = [t for t in tensors if len(t.shape) == 2 and t.name != "token_embd.weight"]
    bits = 8 * sum(int(t.n_bytes) for t in matrices) / sum(int(t.n_elements) for t in matrices)
    return dict(Counter(t.tensor_type.name for t in tensors)), bits


def perplexity_of(path: Path, windows: list[list[int]], threads: int) -> float:
    """llama.cpp's perplexity over every predicted token of every window (each fed alone, as the report does)."""
    from llama_cpp import Llama

    from toolkit.quantize.pipeline import negative_log_likelihoods

    width = max(len(w) for w in windows)
    llm = Llama(
        model_path=str(path), n_ctx=width, n_batch=width, logits_all=True, n_threads=threads, n_threads_batch=threads,
        verbose=False,
    )  # fmt: skip
    losses = []
    for window in windows:
        llm.reset()
        llm.eval(window)
        losses.append(negative_log_likelihoods(np.array(llm.scores[: len(window)], dtype=np.float64), window))
    return float(math.exp(np.concatenate(losses).mean()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", type=Path, required=True, help="the proxy's Hugging Face directory")
    parser.add_argument("--float", type=Path, required=True, help="its float `toolkit export --lowering ort`")
    parser.add_argument("--text", type=Path, required=True, help="the perplexity text (--perplexity-text)")
    parser.add_argument("--types", default=";".join(TYPES), help=f"';'-separated, of {', '.join(TYPES)}")
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    chosen = [t.strip() for t in args.types.split(";") if t.strip()]
    unknown = [t for t in chosen if t not in TYPES]
    if unknown:
        parser.error(f"--types: unknown {unknown}; choose from {', '.join(TYPES)}")

    import llama_cpp
    from int4_vs_llamacpp import llamacpp_quality

    from models.artifacts import open_artifact
    from runners.registry import create_runner
    from toolkit.bench.bench import smollm2_gguf
    from toolkit.quantize.pipeline import _text_terms, read_perplexity_text

    args.work.mkdir(parents=True, exist_ok=True)
    artifact = open_artifact(args.float)
    text = read_perplexity_text(artifact, args.text)
    float_perplexity = math.exp(_text_terms(create_runner("ort-cpu", artifact), text.windows)[0].mean())
    source = args.work / "proxy.F32.gguf"
    write_float_gguf(args.hf, source, smollm2_gguf())
    theirs = perplexity_of(source, text.windows, args.threads)
    print(f"float: toolkit {float_perplexity:.3f}, llama.cpp float32 GGUF {theirs:.3f}", flush=True)
    if abs(theirs / float_perplexity - 1) > FLOAT_MATCH:
        raise SystemExit("the float32 GGUF does not compute the float artifact's function; the conversion is wrong")
    results = {}
    for name in chosen:
        ftype, pure = TYPES[name]
        out = args.work / f"proxy.{name.replace(' ', '-')}.gguf"
        seconds = quantize(source, out, ftype, pure)
        quality = llamacpp_quality(args.float, out, args.threads)
        ppl = perplexity_of(out, text.windows, args.threads)
        kinds, bits = tensor_types(out)
        results[name] = {
            "perplexity": ppl,
            "perplexity_vs_float": ppl / float_perplexity - 1,
            "greedy_agreement": quality["greedy_agreement"],
            "greedy_positions": quality["greedy_positions"],
            "tensor_types": kinds,
            "matrix_bits_per_weight": round(bits, 3),
            "file_bytes": out.stat().st_size,
            "quantize_seconds": round(seconds, 1),
        }
        print(
            f"{name}: perplexity {ppl:.3f} ({100 * (ppl / float_perplexity - 1):+.1f} %), greedy agreement "
            f"{100 * quality['greedy_agreement']:.1f} %, {bits:.2f} bits per weight, {kinds}",
            flush=True,
        )
        out.unlink()
    record = {
        "command": "python " + " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "versions": {"llama_cpp_python": llama_cpp.__version__},
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode(),
        "perplexity_text": text.report(),
        "float_perplexity": {"toolkit_ort_cpu": float_perplexity, "llama_cpp_float32_gguf": theirs},
        "types": results,
    }
    args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
