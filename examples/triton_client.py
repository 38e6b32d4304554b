"""Greedy decoding from the Triton model that `toolkit export --variant serving --triton-repo REPO` writes,
with the KV cache kept on the server (the default --triton-cache server).

The protocol, one sequence per generation:

- Every request carries the same sequence id (a nonzero integer no other live sequence uses); Triton routes
  the sequence's requests to the model instance that holds its cache.
- The first request says sequence_start. Triton then starts the sequence's cache from the model config's
  initial_state: a few zeroed rows (one, in the configs the toolkit writes) that every request masks out.
- The last request says sequence_end; Triton frees the sequence's cache after it. A sequence left without
  one is freed after max_sequence_idle_microseconds (60 s), and its next request is refused.
- Each request sends only what is new: input_ids [1, T] (the prompt first, then one generated token at a
  time), position_ids [1, T] (continuing after the tokens sent before) and past_mask [1, cache rows]: 0 for
  the starting rows, 1 for each token the server already holds. It gets logits [1, T, vocab] back.

Run against a server (`tritonserver --model-repository REPO`, gRPC on port 8001):

    python examples/triton_client.py --model decoder-small --prompt-ids 1,2,3 --max-new-tokens 8
    python examples/triton_client.py --model smollm2 --artifact smollm2 --prompt "The capital of France is"

The protocol part (step_inputs, generate) takes any `infer` callable; tests/exporters/test_triton.py runs it
against the real graph on ONNX Runtime with Triton's state carry emulated.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable, Iterable

import numpy as np

# infer(inputs, start, end) -> logits [1, T, vocab]: one request of the sequence, with its start/end flags.
Infer = Callable[[dict[str, np.ndarray], bool, bool], np.ndarray]


def starting_rows(config: dict) -> int:
    """The cache rows a sequence starts with (masked on every request), from the model config as a dict
    (gRPC get_model_config(as_json=True)["config"]): the initial_state's size on the state's -1 axis."""
    states = config.get("sequence_batching", {}).get("state", [])
    if not states:
        raise SystemExit(
            f"model {config.get('name')!r} keeps no KV cache on the server; export it with --triton-cache server"
        )
    state = states[0]
    axis = [int(d) for d in state["dims"]].index(-1)  # JSON carries int64 dims as strings
    return int(state["initial_state"][0]["dims"][axis])


def step_inputs(new_ids: list[int], held: int, starting: int) -> dict[str, np.ndarray]:
    """One request's inputs: the new token ids, their positions after the `held` tokens the server's cache
    already has, and past_mask over the cache (the `starting` rows masked, the held tokens kept)."""
    return {
        "input_ids": np.array([new_ids], dtype=np.int64),
        "position_ids": np.arange(held, held + len(new_ids), dtype=np.int64)[None],
        "past_mask": np.array([[0] * starting + [1] * held], dtype=np.int64),
    }


def generate(
    infer: Infer, prompt: list[int], max_new_tokens: int, starting: int, stop: Iterable[int] = ()
) -> list[int]:
    """Greedy decoding over one sequence: the prompt on the first request, then one token per request."""
    if not prompt or max_new_tokens < 1:
        raise SystemExit("give a non-empty prompt and at least one new token")
    stop = set(stop)
    tokens: list[int] = []
    new, held = list(prompt), 0
    for step in range(max_new_tokens):
        last = step == max_new_tokens - 1
        logits = infer(step_inputs(new, held, starting), step == 0, last)
        held += len(new)
        token = int(np.argmax(logits[0, -1]))
        tokens.append(token)
        if token in stop and not last:
            # sequence_end rides on an inference request like any other, so ending early costs one more
            # one-token step; it frees the cache now rather than after the idle timeout.
            infer(step_inputs([token], held, starting), False, True)
            break
        new = [token]
    return tokens


def request_tensors(inputs: dict[str, np.ndarray]) -> list:
    """The request's tritonclient.grpc InferInputs, each with its Triton datatype ("INT64")."""
    from tritonclient.grpc import InferInput
    from tritonclient.utils import np_to_triton_dtype

    tensors = []
    for name, array in inputs.items():
        tensor = InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def triton_infer(client, model: str, sequence_id: int) -> Infer:
    """`infer` over a tritonclient.grpc InferenceServerClient: one sequence's requests to `model`."""
    from tritonclient.grpc import InferRequestedOutput

    def infer(inputs: dict[str, np.ndarray], start: bool, end: bool) -> np.ndarray:
        result = client.infer(
            model,
            request_tensors(inputs),
            outputs=[InferRequestedOutput("logits")],
            sequence_id=sequence_id,
            sequence_start=start,
            sequence_end=end,
        )
        return result.as_numpy("logits")

    return infer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="localhost:8001", help="Triton's gRPC endpoint")
    parser.add_argument("--model", required=True, help="the model's name in the repository")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt-ids", help="comma-separated token ids")
    prompt.add_argument("--prompt", help="text, encoded with --artifact's tokenizer")
    parser.add_argument("--artifact", help="the exported artifact directory (its tokenizer) for --prompt")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--sequence-id", type=int, help="default: a random one")
    args = parser.parse_args(argv)

    tokenizer = None
    if args.prompt is not None:
        if not args.artifact:
            parser.error("--prompt needs --artifact (its tokenizer); or give --prompt-ids")
        from models.artifacts import open_artifact
        from models.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(open_artifact(args.artifact), args.artifact)
        ids = tokenizer.encode(args.prompt)
    else:
        ids = [int(i) for i in args.prompt_ids.split(",")]

    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(args.url)
    sequence_id = args.sequence_id or random.randrange(1, 2**63)
    stop = tokenizer.stop_ids if tokenizer else ()
    try:
        starting = starting_rows(client.get_model_config(args.model, as_json=True)["config"])
        tokens = generate(triton_infer(client, args.model, sequence_id), ids, args.max_new_tokens, starting, stop)
    except InferenceServerException as error:
        raise SystemExit(f"triton at {args.url}, model {args.model!r}: {error.message()}") from None
    print(tokenizer.decode(tokens) if tokenizer else " ".join(map(str, tokens)))


if __name__ == "__main__":
    main()
