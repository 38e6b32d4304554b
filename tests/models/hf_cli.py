"""Each architecture of tests/models/test_hf_decoders.py through the CLI: export --from (verified against
transformers by default), check with the transformers oracle and decode steps, and greedy generation
token-identical to transformers' generate. The cases are split over modules so that pytest-xdist's
--dist loadscope runs them on both workers."""

from __future__ import annotations

import torch

from tests.models.test_hf_decoders import SEQ, build
from tests.toolkit.test_cli import invoke


def export_check_generate(name, tokenizer, tmp_path):
    """export --from (verified against transformers by default), check with the transformers oracle and decode
    steps, and greedy generation token-identical to transformers' generate."""
    directory = tmp_path / "hf"
    hf = build(name, tokenizer, directory)
    check_and_generate(name, hf, tokenizer, directory, tmp_path / "artifact")


def check_and_generate(name, hf, tokenizer, directory, out, *export_options):
    """export_check_generate for the checkpoint `hf` saved in `directory`, exported with `export_options`
    (a lowering); the check's output comes back."""
    result = invoke("export", "--from", directory, "--out", out, *export_options)
    assert result.exit_code == 0, result.output
    assert "verified against the original" in result.output
    check = invoke("check", out, "--oracle", "transformers", "--decode-steps", 3, "--seq-len", SEQ - 3)
    assert check.exit_code == 0, check.output
    assert "oracle transformers: PASS" in check.output
    prompt = "the quick brown fox"
    ids = [tokenizer.token_to_id("<s>")] + tokenizer.encode(prompt).ids
    eos = tokenizer.token_to_id("</s>")
    with torch.no_grad():
        greedy = hf.generate(
            torch.tensor([ids]),
            do_sample=False,
            max_new_tokens=20,
            eos_token_id=eos,
            pad_token_id=eos,
            output_scores=True,
            return_dict_in_generate=True,
        )
    for step, scores in enumerate(greedy.scores):  # a near-tie would make greedy depend on rounding, not the import
        top = torch.topk(scores[0], 2).values
        assert float(top[0] - top[1]) > 1e-4, f"{name}: near-tie at step {step}; change the case's seed or switches"
    generated = greedy.sequences[0, len(ids) :].tolist()
    result = invoke("generate", out, "--prompt", prompt, "--max-new-tokens", 20)
    assert result.exit_code == 0, result.output
    assert result.stdout.removesuffix("\n") == tokenizer.decode(generated, skip_special_tokens=True)
    return check.output
