"""`toolkit generate`: stream text from a language-model artifact."""

from __future__ import annotations

import click

from models.tokenizer import TextTokenizer
from runners.generate import CachedLM, Sampling, generate
from runners.registry import create_runner
from toolkit.artifacts import load_artifact
from toolkit.errors import ModelFileError


@click.command("generate")
@click.argument("artifact_dir", type=click.Path())
@click.option("--prompt", required=True, help="The prompt text (the user message with --chat).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the checkpoint's chat template.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--backend", default="ort-cpu", show_default=True, help="eager, ort-cpu, onnx-reference, ...")
def command(artifact_dir, prompt, chat, max_new_tokens, temperature, top_k, top_p, seed, backend):
    """Generate text from ARTIFACT_DIR (an export made with --from), streaming it to stdout."""
    artifact = load_artifact(artifact_dir)
    if artifact.directory is None or not (artifact.directory / "tokenizer.json").is_file():
        raise ModelFileError(f"{artifact_dir}: no tokenizer in the artifact; export a checkpoint with --from")
    tokenizer = TextTokenizer.from_artifact(artifact.directory)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
    prompt_ids = tokenizer.encode(text)
    lm = CachedLM(create_runner(backend, artifact), artifact.config().max_positions)
    emitted = ""
    tokens: list[int] = []

    def stream(token: int) -> None:
        nonlocal emitted
        tokens.append(token)
        text_so_far = tokenizer.decode(tokens)
        # Emit only completed characters: a partial UTF-8 sequence decodes to U+FFFD until it is whole.
        if not text_so_far.endswith("\ufffd") and text_so_far.startswith(emitted):
            click.echo(text_so_far[len(emitted):], nl=False)
            emitted = text_so_far

    stop = tuple(t for t in (tokenizer.eos_id,) if t is not None)
    result = generate(lm, prompt_ids, max_new_tokens=max_new_tokens,
                      sampling=Sampling(temperature, top_k, top_p, seed), stop_ids=stop, on_token=stream)
    click.echo(tokenizer.decode(tokens)[len(emitted):])  # flush what was held back (a partial character)
    click.echo(f"[{len(result.tokens)} tokens, finish: {result.finish_reason}, prompt {len(prompt_ids)} tokens "
               f"prefill {result.prefill_seconds * 1e3:.0f} ms, decode {result.decode_tokens_per_second:.1f} tokens/s "
               f"on {backend}]", err=True)
