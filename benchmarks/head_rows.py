"""Quality and speed of an int4 artifact whose vocabulary projection holds the likeliest tokens' rows at 8 bits.

The 4-bit head of a `--recipe gptq` artifact costs about 1.5 points of perplexity against an 8-bit head, and an
8-bit head reads about 15 % more bytes per decode step. Most rows of the head belong to tokens a text almost never
makes likely. This script writes a copy of the 4-bit-head artifact (FOUR) in which the head's rows of the `--rows`
tokens with the most softmax mass under the float model (transformers on the checkpoint `--hf`, over the first
4096 tokens of `--calibration`) are taken from an artifact of the same float model with an 8-bit head (EIGHT, the
same `--rotate` seed so both heads share a basis), and the other rows stay FOUR's: two MatMulNBits of N - rows and
rows outputs, a Concat and a Gather that puts every logit back at its token id. The bodies stay FOUR's, so the
8-bit rows meet hidden states a little unlike those they were rounded on (EIGHT's body was tuned with its own
head); a product recipe would round both parts on one body.

The copies are graph surgery for measurement only: the manifest still describes FOUR's head, so `toolkit check`
would hold them to the wrong eager reference. Measure them with `benchmarks/quality_of.py` and
`benchmarks/decode_ab.py`.

    .venv/bin/python benchmarks/head_rows.py /tmp/rot/permutation/gptq-rotated-tuned-level-4 \
        /tmp/rot/permutation/gptq-rotated-8-bit-head-tuned-level-4 --hf /tmp/rot/permutation/hf \
        --calibration /usr/share/common-licenses/Apache-2.0 --rows 4096 --out /tmp/head-rows-4096
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artifact.hashing import sha256_file  # noqa: E402

CALIBRATION_TOKENS = 4096
WINDOW = 512


def token_mass(hf: Path, text: str) -> np.ndarray:
    """[V] the float model's softmax probabilities summed over the positions of `text`'s first tokens."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    ids = Tokenizer.from_file(str(hf / "tokenizer.json")).encode(text).ids[:CALIBRATION_TOKENS]
    mass = torch.zeros(model.config.vocab_size, dtype=torch.float64)
    with torch.no_grad():
        for start in range(0, len(ids), WINDOW):
            logits = model(torch.tensor([ids[start : start + WINDOW]])).logits[0]  # [T, V]
            mass += torch.softmax(logits.double(), dim=-1).sum(dim=0)
    return mass.numpy()


def head_node(proto: onnx.ModelProto):
    """The MatMulNBits that writes the graph's `logits` output."""
    return next(n for n in proto.graph.node if n.op_type == "MatMulNBits" and n.output[0] == "logits")


def _columns(array: np.ndarray, n: int, columns: np.ndarray) -> np.ndarray:
    """The part of a MatMulNBits input (packed [N, blocks, blob], or scales or zero points flat, N-major) that
    belongs to output `columns`, in the same layout."""
    part = array.reshape(n, -1)[columns]
    return part.reshape((len(columns), *array.shape[1:])) if array.ndim > 1 else part.reshape(-1)


def split_head(four: onnx.ModelProto, eight: onnx.ModelProto, chosen: np.ndarray) -> onnx.ModelProto:
    """`four` with its head's rows `chosen` (sorted token ids) read from `eight`'s 8-bit head."""
    head, eight_head = head_node(four), head_node(eight)
    n = next(a.i for a in head.attribute if a.name == "N")
    rest = np.setdiff1d(np.arange(n), chosen)
    initializers = {i.name: i for i in four.graph.initializer}
    for name in head.input[1:]:
        part = _columns(numpy_helper.to_array(initializers[name]), n, rest)
        initializers[name].CopyFrom(numpy_helper.from_array(part, name))
    next(a for a in head.attribute if a.name == "N").i = len(rest)
    head.output[0] = "logits_rest"
    wide = {i.name: numpy_helper.to_array(i) for i in eight.graph.initializer if i.name in eight_head.input[1:]}
    names = []
    for name in eight_head.input[1:]:
        names.append(f"head_rows_{len(names)}")
        four.graph.initializer.append(numpy_helper.from_array(_columns(wide[name], n, chosen), names[-1]))
    index = np.empty(n, dtype=np.int64)  # token id -> its place in Concat(rest, chosen)
    index[rest], index[chosen] = np.arange(len(rest)), len(rest) + np.arange(len(chosen))
    four.graph.initializer.append(numpy_helper.from_array(index, "head_rows_index"))
    attributes = {a.name: a.i for a in eight_head.attribute}
    attributes["N"] = len(chosen)
    four.graph.node.extend(
        [
            helper.make_node(
                "MatMulNBits",
                [head.input[0], *names],
                ["logits_rows"],
                "head_rows",
                domain="com.microsoft",
                **attributes,
            ),
            helper.make_node("Concat", ["logits_rest", "logits_rows"], ["logits_both"], "head_concat", axis=-1),
            helper.make_node("Gather", ["logits_both", "head_rows_index"], ["logits"], "head_gather", axis=-1),
        ]
    )
    return four


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("four", type=Path, help="an int4 artifact with a 4-bit head")
    parser.add_argument("eight", type=Path, help="an int4 artifact of the same float model with an 8-bit head")
    parser.add_argument("--hf", type=Path, required=True, help="the float model's Hugging Face checkpoint")
    parser.add_argument("--calibration", type=Path, nargs="+", required=True, help="text files, concatenated")
    parser.add_argument("--rows", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    mass = token_mass(args.hf, "".join(p.read_text() for p in args.calibration))
    chosen = np.sort(np.argsort(-mass, kind="stable")[: args.rows])
    proto = split_head(onnx.load(args.four / "model.onnx"), onnx.load(args.eight / "model.onnx"), chosen)
    shutil.rmtree(args.out, ignore_errors=True)
    shutil.copytree(args.four, args.out, ignore=shutil.ignore_patterns("model.onnx"))
    onnx.save(proto, args.out / "model.onnx")
    manifest = json.loads((args.out / "manifest.json").read_text())
    manifest["graphs"][0]["sha256"] = sha256_file(args.out / "model.onnx")
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"{args.out}: {args.rows} rows at 8 bits, {mass[chosen].sum() / mass.sum():.1%} of the calibration mass")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
