"""The int4 recipes from float weights that lie on no 4-bit grid: what `toolkit quantize --bits 4` defaults to.

SmolLM2-135M's only local checkpoint is its Q4_1 GGUF, whose dequantized weights lie exactly on a grid of a
float scale and a float minimum per block of 32, the grid the k-quant search looks for: on them `mixed` looks
better than it would on a trained float model. This script moves every 2-D weight off that grid: transformers
reads the GGUF (dequantized, float32), Gaussian noise of `noise` times each row's RMS is added (a Q4_1 step is
about a third of a row's RMS, so 0.03-0.08 is 10-25 % of a step), and the result is saved as a Hugging Face
directory (safetensors, the GGUF's tokenizer). The float model is then that noisy one: its own perplexity is
the baseline each recipe is measured against. Noise 0 is the GGUF's weights as they are (on the grid). For each
noise level: `toolkit export --lowering ort`, then
`toolkit quantize` with each recipe at 4 bits (the k-quant ones with and without --imatrix), and rtn and mixed
at 8, recording the quality report (greedy agreement, perplexity, KL from the float model,
logit error against the float artifact on ort-cpu) and the quantize wall time.

`--proxy rotation|permutation` takes, in place of the noise levels, the GGUF's model in weights on no grid that
compute the same function (rotated_checkpoint: the residual stream turned by a random rotation, or its channels,
each FFN's hidden channels and each KV head's value channels permuted), so the float model is SmolLM2 itself.
Rotation spreads the outlier channels into dense directions that every input channel shares; permutation keeps
them channels, as a trained checkpoint has them.
`--seed N` makes another proxy of the same kind (another rotation, other permutations): how much a recipe's
result depends on the draw. `--calibration-seeds 0,1,2` runs each recipe once per seed of the text that gptq and
--tune-scales calibrate on (`toolkit quantize --calibration-seed`) and records each run and, per recipe, the median
and range of each measure over the seeds: how much a result depends on the calibration text.

Needs transformers and accelerate (transformers' GGUF loader requires it); the saved config drops the keys that
transformers copies from the GGUF's metadata and that no Hugging Face checkpoint holds (`_model_name_or_path`,
`unk_token_id`), which the import would otherwise refuse as unknown.

    .venv/bin/python benchmarks/recipes_offgrid.py --work /tmp/offgrid --json benchmarks/results/2026-12-02-recipes-offgrid-imatrix.json
    .venv/bin/python benchmarks/recipes_offgrid.py --work /tmp/rot --proxy permutation \
        --text /usr/share/common-licenses/GPL-3 --json benchmarks/results/<date>-recipes-permutation-gpl3.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from toolkit.bench.bench import smollm2_gguf  # noqa: E402

TOOLKIT = [str(Path(sys.executable).parent / "toolkit")]
RECIPES = {
    "rtn, level 0": ["--bits", "4", "--recipe", "rtn", "--accuracy-level", "0"],
    "rtn, level 4": ["--bits", "4", "--recipe", "rtn", "--accuracy-level", "4"],
    "hqq, level 4": ["--bits", "4", "--recipe", "hqq", "--accuracy-level", "4"],
    "kquant, level 4": ["--bits", "4", "--recipe", "kquant", "--no-imatrix", "--accuracy-level", "4"],
    "mixed, level 4": ["--bits", "4", "--recipe", "mixed", "--no-imatrix", "--accuracy-level", "4"],
    "measured, level 4": ["--bits", "4", "--recipe", "measured", "--no-imatrix", "--accuracy-level", "4"],
    "kquant imatrix, level 4": ["--bits", "4", "--recipe", "kquant", "--imatrix", "--accuracy-level", "4"],
    "mixed imatrix, level 4": ["--bits", "4", "--recipe", "mixed", "--imatrix", "--accuracy-level", "4"],
    "measured imatrix, level 4": ["--bits", "4", "--recipe", "measured", "--imatrix", "--accuracy-level", "4"],
    "kquant offsets imatrix, level 4": ["--bits", "4", "--recipe", "kquant", "--zero-points", "offsets"],
    "mixed offsets imatrix, level 4": ["--bits", "4", "--recipe", "mixed", "--zero-points", "offsets"],
    "kquant integer imatrix, level 4": ["--bits", "4", "--recipe", "kquant", "--zero-points", "integer"],
    "mixed integer imatrix, level 4": ["--bits", "4", "--recipe", "mixed", "--zero-points", "integer"],
    "measured integer imatrix, level 4": ["--bits", "4", "--recipe", "measured", "--zero-points", "integer"],
    "gptq, level 4": ["--bits", "4", "--recipe", "gptq"],
    "gptq 8-bit head, level 4": ["--bits", "4", "--recipe", "gptq", "--head-bits", "8"],
    "gptq offsets 8-bit head, level 4": "--bits 4 --recipe gptq --zero-points offsets --head-bits 8".split(),
    "gptq auto 8-bit head, level 4": "--bits 4 --recipe gptq --zero-points auto --head-bits 8".split(),
    "rtn rotated, level 4": "--bits 4 --recipe rtn --accuracy-level 4 --rotate 0".split(),
    "mixed imatrix rotated, level 4": "--bits 4 --recipe mixed --imatrix --accuracy-level 4 --rotate 0".split(),
    "gptq rotated, level 4": "--bits 4 --recipe gptq --rotate 0".split(),
    "gptq rotated 8-bit head, level 4": "--bits 4 --recipe gptq --head-bits 8 --rotate 0".split(),
    "gptq auto rotated 8-bit head, level 4": "--bits 4 --recipe gptq --zero-points auto --head-bits 8 --rotate 0".split(),
    "gptq offsets rotated 8-bit head, level 4": "--bits 4 --recipe gptq --zero-points offsets --head-bits 8 --rotate 0".split(),
    "gptq rotated 8-bit head tuned, level 4": "--bits 4 --recipe gptq --head-bits 8 --rotate 0 --tune-scales 120".split(),
    "gptq rotated 8-bit head tuned 240, level 4": "--bits 4 --recipe gptq --head-bits 8 --rotate 0 --tune-scales 240".split(),
    "gptq rotated tuned, level 4": "--bits 4 --recipe gptq --rotate 0 --tune-scales 120".split(),
    "gptq 8-bit head tuned, level 4": "--bits 4 --recipe gptq --head-bits 8 --tune-scales 120".split(),
    "rtn tuned, level 4": "--bits 4 --recipe rtn --accuracy-level 4 --tune-scales 120".split(),
    "8-bit rtn, level 4": ["--bits", "8", "--recipe", "rtn", "--accuracy-level", "4"],
    "8-bit mixed, level 4": ["--bits", "8", "--recipe", "mixed", "--no-imatrix", "--accuracy-level", "4"],
}
NOT_HF_KEYS = ("_model_name_or_path", "unk_token_id")  # transformers' GGUF metadata, in no HF checkpoint


def _load(gguf: Path):
    """(tokenizer, float32 transformers model) of the GGUF, as transformers dequantizes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return tokenizer, AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)


def _save(model, tokenizer, out: Path) -> None:
    """`model` as a Hugging Face directory (safetensors; a tied head not written twice), without the GGUF-only keys."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    for key in (*NOT_HF_KEYS, "quantization_config"):
        config.pop(key, None)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(out)


def noisy_checkpoint(gguf: Path, out: Path, noise: float, seed: int = 0) -> None:
    """A Hugging Face directory of the GGUF's model with N(0, (noise * row RMS)^2) added to every 2-D weight."""
    tokenizer, model = _load(gguf)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 2:
                rms = parameter.pow(2).mean(dim=1, keepdim=True).sqrt()
                parameter.add_(torch.randn(parameter.shape, generator=generator) * rms * noise)
    _save(model, tokenizer, out)


def rotated_checkpoint(gguf: Path, out: Path, kind: str = "rotation", seed: int = 0) -> None:
    """A Hugging Face directory of the GGUF's model in weights that lie on no grid of any block, computing the same
    function (up to float32 rounding). The RMSNorm gains are folded into the projections that read the norms
    (columns of q/k/v, gate/up; the final norm's into an untied head) and set to 1, so that for an orthogonal R of
    the residual stream RMSNorm(x R) = RMSNorm(x) R; every matrix reading the residual stream becomes W R, every one
    writing it R^T W, the embedding E R.

    kind "rotation": R a random rotation (QuaRot's transform). Each channel is spread over all of them, so a
    trained model's outlier channels become dense directions shared by every input channel.
    kind "permutation": R a random permutation of the channels, and within each layer a random permutation of the
    feed-forward's hidden channels (rows of gate/up, columns of down) and of each KV head's value channels (rows of
    v, the columns of o its query heads write): outlier channels stay channels, but every block of 32 along K now
    mixes values of several Q4_1 blocks (of all a row's, or for o only of its head's two), so none lies on one
    grid."""
    tokenizer, model = _load(gguf)
    config = model.config
    width = config.hidden_size
    generator = torch.Generator().manual_seed(seed)
    if kind == "rotation":
        rotation, _ = torch.linalg.qr(torch.randn(width, width, generator=generator, dtype=torch.float64))
    else:
        rotation = torch.eye(width, dtype=torch.float64)[:, torch.randperm(width, generator=generator)]
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 253, 1134, 30, 378, 905, 284, 3096, 42, 7, 9, 13]])
    with torch.no_grad():
        before = model(ids).logits
        embed = model.model.embed_tokens.weight
        head = embed.double() * model.model.norm.weight.double()
        for layer in model.model.layers:
            attention, mlp = layer.self_attn, layer.mlp
            for norm, readers in (
                (layer.input_layernorm, (attention.q_proj, attention.k_proj, attention.v_proj)),
                (layer.post_attention_layernorm, (mlp.gate_proj, mlp.up_proj)),
            ):
                for linear in readers:  # [out, width] reading norm(x) R: W diag(g) R
                    linear.weight.copy_(linear.weight.double() * norm.weight.double() @ rotation)
                norm.weight.fill_(1)
            for linear in (attention.o_proj, mlp.down_proj):  # [width, in] writing the residual: R^T W
                linear.weight.copy_(rotation.T @ linear.weight.double())
            if kind == "permutation":
                hidden = torch.randperm(config.intermediate_size, generator=generator)
                mlp.gate_proj.weight.copy_(mlp.gate_proj.weight[hidden])
                mlp.up_proj.weight.copy_(mlp.up_proj.weight[hidden])
                mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, hidden])
                head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
                kv_heads = config.num_key_value_heads
                group = config.num_attention_heads // kv_heads  # query heads per KV head (repeat_interleave)
                v_rows = torch.arange(kv_heads * head_dim).view(kv_heads, head_dim)
                o_columns = torch.arange(config.num_attention_heads * head_dim).view(kv_heads, group, head_dim)
                for h in range(kv_heads):
                    order = torch.randperm(head_dim, generator=generator)
                    v_rows[h] = v_rows[h][order]
                    o_columns[h] = o_columns[h][:, order]
                attention.v_proj.weight.copy_(attention.v_proj.weight[v_rows.reshape(-1)])
                attention.o_proj.weight.copy_(attention.o_proj.weight[:, o_columns.reshape(-1)])
        model.model.norm.weight.fill_(1)
        config.tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(width, head.shape[0], bias=False)
        model.lm_head.weight = torch.nn.Parameter((head @ rotation).float())
        model.model.embed_tokens.weight = torch.nn.Parameter((embed.double() @ rotation).float())
        after = model(ids).logits
    moved = (after - before).abs().max().item()
    if moved > 1e-3 * before.abs().max().item():
        raise SystemExit(f"the {kind} model does not compute the original: logits moved by {moved:.3g}")
    _save(model, tokenizer, out)
    print(f"{kind} checkpoint -> {out}: logits moved by {moved:.3g} (of {before.abs().max().item():.3g})", flush=True)


def run(args: list, **kwargs) -> float:
    start = time.perf_counter()
    subprocess.run([str(a) for a in args], check=True, stdout=subprocess.DEVNULL, **kwargs)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--noise", default="0,0.03,0.08", help="comma-separated noise levels (times each row's RMS)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--recipes", help="semicolon-separated names of RECIPES to run (default: all)")
    parser.add_argument(
        "--text",
        type=Path,
        help="measure perplexity on this UTF-8 file (toolkit quantize --perplexity-text) in place of the report's "
        "fixed 52-token sentence, for example /usr/share/common-licenses/GPL-3 (Debian's copy of the GPL)",
    )
    parser.add_argument(
        "--proxy",
        choices=("rotation", "permutation"),
        help="in place of the noise levels (--noise is then refused), one proxy: the GGUF's model with its residual "
        "stream turned by a random rotation or permutation (rotated_checkpoint), the same function in weights on no grid",
    )
    parser.add_argument(
        "--seed",
        type=int,
        help="--proxy: the seed of its random rotation or permutations (default 0; each seed is another proxy of the "
        "same model)",
    )
    parser.add_argument(
        "--calibration-seeds",
        help="comma-separated seeds: each recipe runs once per `toolkit quantize --calibration-seed`, reported per run "
        "and as the median and range over them (the recipes must calibrate on a sampled text: gptq, --tune-scales)",
    )
    parser.add_argument(
        "--gptq-damping",
        help="toolkit quantize --gptq-damping FRACTION for every recipe run (the recipes must be gptq's)",
    )
    args = parser.parse_args()
    if args.proxy and "--noise" in sys.argv:
        parser.error("--proxy replaces the noise levels; give one of --proxy and --noise")
    if args.seed is not None and not args.proxy:
        parser.error("--seed chooses a --proxy's rotation or permutations; give --proxy")
    chosen = RECIPES if not args.recipes else {name: RECIPES[name] for name in args.recipes.split(";")}
    if args.gptq_damping is not None:
        chosen = {name: [*options, "--gptq-damping", args.gptq_damping] for name, options in chosen.items()}
    import onnxruntime
    import transformers

    results = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "versions": {
            "torch": torch.__version__,
            "onnxruntime": onnxruntime.__version__,
            "transformers": transformers.__version__,
        },
        "gguf": smollm2_gguf().name,
        "perplexity_text": None
        if args.text is None
        else {"path": str(args.text), "sha256": hashlib.sha256(args.text.read_bytes()).hexdigest()},
        "levels": [],
    }
    levels = [args.proxy] if args.proxy else [float(n) for n in args.noise.split(",")]
    seed = args.seed or 0
    for noise in levels:
        seeded = f"-seed-{seed}" if isinstance(noise, str) and seed else ""
        base = args.work / ((noise + seeded) if isinstance(noise, str) else f"noise-{noise}")
        checkpoint, exported = base / "hf", base / "ort"
        if not (checkpoint / "model.safetensors").exists():
            if isinstance(noise, str):
                rotated_checkpoint(smollm2_gguf(), checkpoint, noise, seed)
            else:
                noisy_checkpoint(smollm2_gguf(), checkpoint, noise)
        if not (exported / "manifest.json").exists():
            run([*TOOLKIT, "export", "--from", checkpoint, "--lowering", "ort", "--out", exported])
        proxy = isinstance(noise, str)
        level = {
            "noise_times_row_rms": None if proxy else noise,
            "proxy": noise if proxy else None,
            "seed": seed if proxy else None,
            "recipes": {},
        }
        seeds = [None] if args.calibration_seeds is None else [int(s) for s in args.calibration_seeds.split(",")]
        for name, options in chosen.items():
            runs = {}
            for calibration_seed in seeds:
                seeded = [] if calibration_seed is None else ["--calibration-seed", str(calibration_seed)]
                label = name if calibration_seed is None else f"{name} calibration seed {calibration_seed}"
                runs[calibration_seed] = measured = quantized(exported, base, label, [*options, *seeded], args.text)
                level["float_perplexity"] = measured.pop("float_perplexity")
                print(
                    f"{base.name}: {label}: agreement {measured['greedy_agreement']:.1%}, perplexity "
                    f"{measured['perplexity']:.2f} ({measured['perplexity_vs_float']:+.1%} of float "
                    f"{level['float_perplexity']:.2f}), KL from float {measured['kl_from_float']:.4f}, "
                    f"{measured['quantize_seconds']:.0f} s",
                    flush=True,
                )
            level["recipes"][name] = runs[None] if seeds == [None] else over_seeds(runs)
        results["levels"].append(level)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


SPREAD = ("greedy_agreement", "perplexity_vs_float", "kl_from_float", "logits_mean_abs")


def over_seeds(runs: dict) -> dict:
    """Each calibration seed's run, and the median, least and largest of each SPREAD measure over them."""
    import statistics

    summary = {"calibration_seeds": {str(seed): row for seed, row in runs.items()}}
    for key in SPREAD:
        values = [row[key] for row in runs.values()]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return summary


def quantized(exported: Path, base: Path, name: str, options: list, text) -> dict:
    """`toolkit quantize exported *options` into base/<name>, and the quality report's measures."""
    out, report = base / name.replace(", ", "-").replace(" ", "-"), base / f"{name.replace(', ', '-')}.json"
    if out.exists():
        subprocess.run(["rm", "-rf", str(out)], check=True)
    load = os.getloadavg()[0]
    text = ["--perplexity-text", text] if text is not None else []
    seconds = run([*TOOLKIT, "quantize", exported, *options, *text, "--out", out, "--json", report, "--quiet"])
    written = json.loads(report.read_text())
    quality = written["quality"]
    return {
        "float_perplexity": quality["perplexity_float"],
        "options": " ".join(options),
        "greedy_agreement": quality["greedy_agreement"],
        "perplexity": quality["perplexity_quantized"],
        "perplexity_vs_float": quality["perplexity_quantized"] / quality["perplexity_float"] - 1,
        "kl_from_float": quality["kl_from_float"],
        "logits_max_abs": quality["logits_max_abs"],
        "logits_mean_abs": quality["logits_mean_abs"],
        "perplexity_tokens": quality["perplexity_tokens"],
        "zero_points": written.get("zero_points"),
        "zero_points_chosen": written.get("zero_points_chosen"),
        "quantize_seconds": round(seconds, 1),
        "load_average": load,
        "calibration_seed": written.get("calibration_seed"),
    }


if __name__ == "__main__":
    sys.exit(main())
