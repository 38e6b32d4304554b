"""How closely each imported decoder family matches transformers: the README's architecture table.

For every case of tests/models/test_hf_decoders.py (a random tiny checkpoint per architecture and switch),
import it and measure, in float32 against transformers in float32:
  - the max abs logits error over a 2 x 24 prefill and over 20 cached decode steps (relative to the logits'
    max magnitude as well);
  - greedy agreement: the share of 20 greedy tokens (our eager model, no cache) equal to
    transformers' generate(do_sample=False) on the same prompt;
  - the lowerings that accept the config (exporters.lowerings.check_supported, for the family it imports as).

A gpt2 case (GPT2LMHeadModel, imported as the gpt family: learned positions, LayerNorm, gelu_new, Conv1D
weights, a tied head) is added here, built like test_hf_decoders' cases: the same widths, layers, context and
`randomize` (which scales a 2-D weight by 1/sqrt of its second axis: fan-out for GPT-2's [in, out] Conv1D).
--only NAME (repeatable) measures only those cases.

    .venv/bin/python benchmarks/family_fidelity.py --json benchmarks/results/2026-12-02-family-fidelity.json

(2026-12-01-family-fidelity.json is the same measurement without the gpt2 row; the errors of a row differ from
run to run at float32 rounding level, a few 1e-6 absolute; greedy agreement and lowerings do not.)
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from artifact.errors import ExportError  # noqa: E402
from exporters.lowerings import LOWERINGS, check_supported  # noqa: E402
from models.checkpoints import import_checkpoint  # noqa: E402
from tests.models.test_hf_decoders import (  # noqa: E402
    CASES,
    COMMON,
    MAX_POS,
    SEQ,
    build,
    ids_for,
    randomize,
    save_with_tokenizer,
)
from tests.models.test_hf_decoders import tokenizer as tokenizer_fixture  # noqa: E402

STEPS = 20


def build_gpt2(name, tok, directory):
    """A random GPT2LMHeadModel with test_hf_decoders' widths, layers and context (its learned positions cover
    the prefill and the prompt plus STEPS greedy tokens), saved with the tokenizer."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=tok.get_vocab_size(),
        n_embd=COMMON["hidden_size"],
        n_inner=COMMON["intermediate_size"],
        n_head=COMMON["num_attention_heads"],
        n_layer=COMMON["num_hidden_layers"],
        n_positions=MAX_POS,
        activation_function="gelu_new",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = randomize(transformers.GPT2LMHeadModel(config), sum(map(ord, name)))
    return save_with_tokenizer(model, tok, directory)


BUILDERS = {**{name: build for name in CASES}, "gpt2": build_gpt2}


@torch.no_grad()
def measure(name: str, tok, root: Path) -> dict:
    directory = root / name
    hf = BUILDERS[name](name, tok, directory)
    imported = import_checkpoint(directory)
    ours, config = imported.model.eval(), imported.config
    ids = ids_for(config.vocab_size, seed=len(name))
    want = hf(torch.from_numpy(ids)).logits.numpy()
    prefill = float(np.abs(ours(torch.from_numpy(ids))["logits"].numpy() - want).max())
    kv_heads = getattr(config, "kv_heads", None) or config.heads  # the gpt family has no grouped KV heads
    empty = torch.zeros(2, kv_heads, 0, config.head_width)
    out = ours(torch.from_numpy(ids[:, :4]), past=[(empty, empty)] * config.layers)
    decode = 0.0
    for t in range(4, SEQ):
        past = [(out[f"present.{i}.key"], out[f"present.{i}.value"]) for i in range(config.layers)]
        out = ours(torch.from_numpy(ids[:, t : t + 1]), past=past)
        decode = max(decode, float(np.abs(out["logits"].numpy()[:, 0] - want[:, t]).max()))
    prompt = [tok.token_to_id("<s>"), *tok.encode("the quick brown fox").ids]
    theirs = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=STEPS, eos_token_id=None)
    theirs = theirs[0, len(prompt) :].tolist()
    mine = list(prompt)
    for _ in range(STEPS):
        mine.append(int(ours(torch.tensor([mine]))["logits"][0, -1].argmax()))
    lowerings = []
    for lowering in LOWERINGS:
        try:
            check_supported(imported.family, config, lowering)
            lowerings.append(lowering)
        except ExportError:
            pass
    return {
        "case": name,
        "transformers_class": type(hf).__name__,
        "prefill_max_abs": prefill,
        "decode_max_abs": decode,
        "logits_scale": float(np.abs(want).max()),
        "greedy_agreement": float(np.mean(np.array(mine[len(prompt) :]) == np.array(theirs))),
        "lowerings": lowerings,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--only", action="append", choices=list(BUILDERS), metavar="NAME", help="measure only this case"
    )
    args = parser.parse_args()
    import transformers

    tok = tokenizer_fixture.__wrapped__() if hasattr(tokenizer_fixture, "__wrapped__") else None
    if tok is None:
        tok = tokenizer_fixture.__pytest_wrapped__.obj()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(name, tok, Path(tmp)) for name in (args.only or BUILDERS)]
    print("| case | class | prefill max abs | decode max abs | logits scale | greedy agreement | lowerings |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['case']} | {r['transformers_class']} | {r['prefill_max_abs']:.1e} | {r['decode_max_abs']:.1e} | "
            f"{r['logits_scale']:.1f} | {r['greedy_agreement']:.0%} | {', '.join(r['lowerings'])} |"
        )
    if args.json:
        meta = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "machine": platform.machine(),
            "command": " ".join([".venv/bin/python", "benchmarks/family_fidelity.py", *sys.argv[1:]]),
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
