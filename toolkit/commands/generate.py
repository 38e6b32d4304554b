"""`toolkit generate`: stream text from a language-model artifact."""

from __future__ import annotations

import click

from models.artifacts import artifact_config, open_artifact
from models.tokenizer import load_tokenizer
from runners.decoding.generate import CachedLM, Sampling, generate
from runners.registry import create_runner
from toolkit.commands.common import SEED_MAX
from toolkit.serve.streaming import TextStream


@click.command("generate")
@click.argument("artifact_dir", type=click.Path())
@click.option("--prompt", required=True, help="The prompt text (the user message with --chat).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the checkpoint's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=click.IntRange(min=0, max=SEED_MAX), default=0, show_default=True)
@click.option("--backend", default="ort-cpu", show_default=True, help="eager, ort-cpu, onnx-reference, ...")
def command(artifact_dir, prompt, chat, max_new_tokens, temperature, top_k, top_p, seed, backend):
    """Generate text from ARTIFACT_DIR (an export made with --from), streaming it to stdout."""
    artifact = open_artifact(artifact_dir)
    tokenizer = load_tokenizer(artifact, artifact_dir)
    # The prompt is text either way: a "</s>" in it is its characters, only the template's markup is control tokens.
    prompt_ids = tokenizer.encode_chat([{"role": "user", "content": prompt}]) if chat else tokenizer.encode(prompt)
    lm = CachedLM(create_runner(backend, artifact), artifact_config(artifact).max_positions)
    text = TextStream(tokenizer.decode)  # whole characters as they complete; flush() gives what is held back

    def stream(token: int) -> None:
        if token in tokenizer.stop_ids:  # it ends the text without being part of it, as in `toolkit serve`
            return
        if delta := text.push(token):
            click.echo(delta, nl=False)

    result = generate(
        lm,
        prompt_ids,
        max_new_tokens=max_new_tokens,
        sampling=Sampling(temperature, top_k, top_p, seed),
        stop_ids=tokenizer.stop_ids,  # the tokenizer's eos and generation_config.json's eos_token_id
        on_token=stream,
    )
    click.echo(text.flush())
    click.echo(
        f"[{len(result.tokens)} tokens, finish: {result.finish_reason}, prompt {len(prompt_ids)} tokens "
        f"prefill {result.prefill_seconds * 1e3:.0f} ms, decode {result.decode_tokens_per_second:.1f} tokens/s "
        f"on {backend}]",
        err=True,
    )
