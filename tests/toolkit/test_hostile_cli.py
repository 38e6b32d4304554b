"""The hostile-input catalogue: one row per input that must be refused, run through every command that reads it.

Each row builds one hostile input from small fixtures (a hand-written Hugging Face Llama directory with a
tokenizer, its `export --from` artifact, a preset exported with external data, a golden directory) and each
command that reads that input must end with exit status 2 and exactly one line on stderr, naming the file or
the field: never a traceback, never 1 (a verdict) or 3 (a toolkit bug). A guard turns a hang into a failure.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import resource
import shutil
import signal
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from artifact import MANIFEST_FILE, METADATA_KEY, MODEL_FILE
from tests.toolkit.test_cli import assert_user_error, invoke

HUGE = "9" * 5000  # past Python's 4,300-digit limit of int <-> str conversion
DEEP = "[" * 100_000 + "]" * 100_000
CHAT_TEMPLATE = "{% for m in messages %}<|user|>{{ m['content'] }}</s>{% endfor %}<|assistant|>"
# A location no one may write to, root included (sysfs refuses new entries).
UNWRITABLE = Path("/sys/toolkit-hostile-cli")
HANG_SECONDS = 120


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- fixtures


def hf_llama_dir(directory: Path) -> Path:
    """A tiny Llama as a Hugging Face directory (config.json, model.safetensors, tokenizer files), written by
    hand: the weights only need the shapes transformers' names imply."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=100, special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>"], show_progress=False
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", "hello world"] * 10, trainer)
    vocab, width, ff, heads, kv_heads = tok.get_vocab_size(), 16, 24, 4, 2
    head = width // heads
    config = {
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": width,
        "intermediate_size": ff,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
    }
    shapes = {
        "model.embed_tokens.weight": (vocab, width),
        "model.layers.0.self_attn.q_proj.weight": (heads * head, width),
        "model.layers.0.self_attn.k_proj.weight": (kv_heads * head, width),
        "model.layers.0.self_attn.v_proj.weight": (kv_heads * head, width),
        "model.layers.0.self_attn.o_proj.weight": (width, heads * head),
        "model.layers.0.mlp.gate_proj.weight": (ff, width),
        "model.layers.0.mlp.up_proj.weight": (ff, width),
        "model.layers.0.mlp.down_proj.weight": (width, ff),
        "model.layers.0.input_layernorm.weight": (width,),
        "model.layers.0.post_attention_layernorm.weight": (width,),
        "model.norm.weight": (width,),
    }
    g = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(shape, generator=g) * (0.3 if len(shape) == 2 else 1) for name, shape in shapes.items()
    }
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / "model.safetensors"))
    tok.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


@dataclass
class Env:
    checkpoint: Path  # the Hugging Face directory
    lm: Path  # its `export --from` artifact (KV cache, tokenizer)
    external: Path  # decoder-small exported as float16 with its weights in model.onnx.data
    golden: Path  # a golden directory of `lm`


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> Env:
    root = tmp_path_factory.mktemp("hostile-cli")
    checkpoint = hf_llama_dir(root / "hf")
    lm, external, golden = root / "lm", root / "external", root / "golden"
    for args in (
        ("export", "--from", checkpoint, "--no-verify", "--out", lm),
        ("export", "--preset", "decoder-small", "--external-data", "--dtype", "float16", "--out", external),
        ("check", lm, "--backends", "ort-cpu", "--save-golden", golden),
    ):
        result = invoke(*args)
        assert result.exit_code == 0, (args, result.output, result.exception)
    return Env(checkpoint, lm, external, golden)


# --------------------------------------------------------------------------- making hostile copies


def copy_of(source: Path, tmp: Path) -> Path:
    target = tmp / "input"
    shutil.copytree(source, target)
    return target


def rehash(directory: Path) -> None:
    """Record the files' current sha256 in manifest.json, so only the hostile change itself is seen."""
    path = directory / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    for entry in manifest["graphs"]:
        entry["sha256"] = sha256(directory / entry["file"])
        for name in entry.get("external_data") or {}:
            entry["external_data"][name] = sha256(directory / name)
    for name in manifest.get("extra_files") or {}:
        manifest["extra_files"][name] = sha256(directory / name)
    path.write_text(json.dumps(manifest))


def edit_manifest(directory: Path, edit: Callable[[dict], None]) -> Path:
    path = directory / MANIFEST_FILE
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    return path


def edit_graph(directory: Path, edit: Callable[[onnx.ModelProto], None]) -> None:
    path = directory / MODEL_FILE
    model = onnx.load(str(path), load_external_data=False)
    edit(model)
    path.write_bytes(model.SerializeToString())
    rehash(directory)


def edit_json(path: Path, edit: Callable[[dict], object]) -> Path:
    data = json.loads(path.read_text())
    replaced = edit(data)
    path.write_text(json.dumps(data if replaced is None else replaced))
    return path


def with_huge_int(text: str, key: str) -> str:
    """`text` (JSON) with the integer value of its first `key` replaced by a 5,000-digit one."""
    start = text.index(f'"{key}"')
    colon = text.index(":", start) + 1
    end = colon
    while text[end] in " 0123456789":
        end += 1
    return text[:colon] + " " + HUGE + text[end:]


# Each maker: (env, tmp) -> (the hostile input's path, fragments the error line must contain).
Made = tuple[Path, tuple[str, ...]]


def external_length_disagrees(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.external, tmp)

    def edit(model):
        tensor = next(t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
        info = {e.key: e for e in tensor.external_data}
        info["length"].value = str(int(info["length"].value) - 4)  # still inside the file, one element short

    edit_graph(directory, edit)
    return directory, (MODEL_FILE, "length")


def manifest_huge_int(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.lm, tmp)
    path = directory / MANIFEST_FILE
    path.write_text(with_huge_int(path.read_text(), "vocab_size"))
    return directory, (MANIFEST_FILE, "digits")


def lone_onnx_huge_int(env: Env, tmp: Path) -> Made:
    model = onnx.load(str(env.lm / MODEL_FILE))
    prop = next(p for p in model.metadata_props if p.key == METADATA_KEY)
    prop.value = with_huge_int(prop.value, "vocab_size")
    path = tmp / MODEL_FILE
    path.write_bytes(model.SerializeToString())
    return path, (str(path), "embedded manifest", "digits")


def output_without_dtype(env: Env, tmp: Path) -> Made:
    """An output spec without a dtype reads as float32, which this graph's (float16) outputs are not."""
    directory = copy_of(env.external, tmp)
    edit_manifest(directory, lambda m: m["graphs"][0]["outputs"][-1].pop("dtype"))
    return directory, (MODEL_FILE, "logits", "dtype float16")


def output_not_in_graph(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.lm, tmp)
    edit_manifest(directory, lambda m: m["graphs"][0]["outputs"][0].update(name="not_an_output"))
    return directory, (MODEL_FILE, "not_an_output", "manifest")


def preset_object(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.lm, tmp)
    edit_manifest(directory, lambda m: m.update(preset={"name": "x"}))
    return directory, (MANIFEST_FILE, "preset")


def vocab_1e30(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.lm, tmp)
    edit_manifest(directory, lambda m: m["config"].update(vocab_size=1e30))
    return directory, ("manifest", "vocab_size")


def graph_dims_disagree(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.lm, tmp)

    def edit(model):
        dim = next(i for i in model.graph.input if i.name == "input_ids").type.tensor_type.shape.dim[0]
        dim.Clear()
        dim.dim_value = 3  # the manifest says "batch"

    edit_graph(directory, edit)
    return directory, (MODEL_FILE, "input_ids")


def hf_file(name: str, edit: Callable[[dict], object], *fields: str):
    """A copy of the checkpoint with its JSON file `name` edited; the error must name the file and `fields`."""

    def make(env: Env, tmp: Path) -> Made:
        directory = copy_of(env.checkpoint, tmp)
        edit_json(directory / name, edit)
        return directory, (name, *fields)

    return make


def hf_config(edit: Callable[[dict], object], *fields: str):
    return hf_file("config.json", edit, *fields)


def hf_tokenizer_config(edit: Callable[[dict], object], *fields: str):
    return hf_file("tokenizer_config.json", edit, *fields)


def hf_config_huge_int(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.checkpoint, tmp)
    path = directory / "config.json"
    path.write_text(with_huge_int(path.read_text(), "hidden_size"))
    return directory, ("config.json", "digits")


def safetensors_fifo(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.checkpoint, tmp)
    (directory / "model.safetensors").unlink()
    os.mkfifo(directory / "model.safetensors")
    return directory, ("model.safetensors", "not a regular file")


def artifact_tokenizer_config(edit: Callable[[dict], object], *fields: str):
    def make(env: Env, tmp: Path) -> Made:
        directory = copy_of(env.lm, tmp)
        edit_json(directory / "tokenizer_config.json", edit)
        rehash(directory)
        return directory, ("tokenizer_config.json", *fields)

    return make


def input_ids_of_rank(rank: int):
    def make(env: Env, tmp: Path) -> Made:
        path = tmp / "inputs.npz"
        np.savez(path, input_ids=np.ones((1,) * (rank - 1) + (4,), dtype=np.int64))
        return path, ("input_ids", "rank")

    return make


def config_file(text: str | bytes, *fields: str):
    def make(env: Env, tmp: Path) -> Made:
        path = tmp / "config.json"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return path, (str(path), *fields)

    return make


def llama_config(**fields) -> str:
    config = {"vocab_size": 96, "layers": 2, "width": 16, "heads": 4, "ff_width": 40, "max_positions": 32}
    return json.dumps({"family": "llama", "config": {**config, **fields}})


def tolerances(name: str, text: str, *fields: str):
    def make(env: Env, tmp: Path) -> Made:
        path = tmp / name
        path.write_text(text)
        return path, (str(path), *fields)

    return make


def golden_nested(env: Env, tmp: Path) -> Made:
    directory = copy_of(env.golden, tmp)
    (directory / "golden.json").write_text(DEEP)
    return directory, ("golden.json", "nested")


def golden_npz_bomb(env: Env, tmp: Path) -> Made:
    """inputs.npz replaced by 100 MB of zeros (a few hundred KB compressed), its file hash updated in the index:
    only the unpacked size, read from the zip directory, can refuse it before it is inflated."""
    directory = copy_of(env.golden, tmp)
    path = directory / "inputs.npz"
    np.savez_compressed(path, input_ids=np.zeros((12_500_000,), dtype=np.int64))
    edit_json(directory / "golden.json", lambda index: index["groups"]["inputs"].update(sha256=sha256(path)))
    return directory, ("inputs.npz", "input_ids")


def nothing(env: Env, tmp: Path) -> Made:
    return env.lm, ()


# --------------------------------------------------------------------------- commands


def artifact_commands(path: Path, tmp: Path) -> dict[str, list]:
    return {
        "check": ["check", path, "--backends", "ort-cpu"],
        "run": ["run", path, "--backend", "ort-cpu"],
        "generate": ["generate", path, "--prompt", "the fox", "--max-new-tokens", "1"],
        "inspect": ["inspect", path],
        "quantize": ["quantize", path, "--bits", "8", "--out", tmp / "quantized"],
        "bench": [
            "bench", path, "--in-process", "--backends", "ort-cpu", "--prompt-len", "2", "--new-tokens", "1",
            "--batch", "1", "--repeats", "1", "--warmup", "0",
        ],
    }  # fmt: skip


def command_line(kind: str, command: str, path: Path, env: Env, tmp: Path) -> list:
    if kind == "artifact":
        return artifact_commands(path, tmp)[command]
    if kind == "chat":
        return ["generate", path, "--prompt", "hi", "--chat", "--max-new-tokens", "1"]
    if kind == "checkpoint":
        return ["export", "--from", path, "--no-verify", "--out", tmp / "out"]
    if kind == "inputs":
        return {"check": ["check", env.lm, "--backends", "ort-cpu", "--inputs", path]}.get(
            command, ["run", env.lm, "--backend", "ort-cpu", "--inputs", path]
        )
    if kind == "config":
        return ["export", "--config", path, "--out", tmp / "out"]
    if kind == "tolerances":
        return ["check", env.lm, "--backends", "ort-cpu", "--tolerances", path]
    if kind == "golden":
        return ["check", env.lm, "--backends", "ort-cpu", "--golden", path]
    if kind == "seed":
        return {
            "generate": ["generate", env.lm, "--prompt", "hi", "--max-new-tokens", "1", "--seed", "-1"],
            "check": ["check", env.lm, "--backends", "ort-cpu", "--seed", "-1"],
            "run": ["run", env.lm, "--backend", "ort-cpu", "--seed", "-1"],
        }[command]
    raise AssertionError(kind)


ALL_ARTIFACT = ("check", "run", "generate", "inspect", "quantize", "bench")
TOKENIZER_READERS = ("generate", "quantize")


@dataclass(frozen=True)
class Row:
    kind: str
    make: Callable[[Env, Path], Made]
    commands: tuple[str, ...]


CATALOGUE: dict[str, Row] = {
    # Artifacts and manifests.
    "external-data-length-vs-shape": Row("artifact", external_length_disagrees, ALL_ARTIFACT),
    "manifest-5000-digit-integer": Row("artifact", manifest_huge_int, ALL_ARTIFACT),
    "lone-onnx-embedded-manifest-5000-digit-integer": Row("artifact", lone_onnx_huge_int, ALL_ARTIFACT),
    "output-spec-without-dtype": Row("artifact", output_without_dtype, ALL_ARTIFACT),
    "output-name-not-in-graph": Row("artifact", output_not_in_graph, ALL_ARTIFACT),
    "preset-as-object": Row("artifact", preset_object, ALL_ARTIFACT),
    "vocab-size-1e30": Row("artifact", vocab_1e30, ALL_ARTIFACT),
    "graph-input-dims-disagree-with-manifest": Row("artifact", graph_dims_disagree, ALL_ARTIFACT),
    # Hugging Face config.json.
    "hf-config-a-list": Row("checkpoint", hf_config(lambda c: [c]), ("export",)),
    "hf-config-zero-heads": Row(
        "checkpoint", hf_config(lambda c: c.update(num_attention_heads=0), "num_attention_heads"), ("export",)
    ),
    "hf-config-heads-as-string": Row(
        "checkpoint", hf_config(lambda c: c.update(num_attention_heads="4"), "num_attention_heads"), ("export",)
    ),
    "hf-config-eps-as-list": Row(
        "checkpoint", hf_config(lambda c: c.update(rms_norm_eps=[1e-5]), "rms_norm_eps"), ("export",)
    ),
    "hf-config-rope-parameters-as-string": Row(
        "checkpoint", hf_config(lambda c: c.update(rope_parameters="default"), "rope_parameters"), ("export",)
    ),
    "hf-config-5000-digit-integer": Row("checkpoint", hf_config_huge_int, ("export",)),
    "hf-config-nested-deep": Row(
        "checkpoint",
        hf_config(lambda c: c.update(rope_parameters=json.loads("[" * 200 + "]" * 200)), "nested"),
        ("export",),
    ),
    "safetensors-fifo": Row("checkpoint", safetensors_fifo, ("export",)),
    # tokenizer_config.json: the checkpoint's, and the artifact's copy.
    "hf-tokenizer-config-a-list": Row("checkpoint", hf_tokenizer_config(lambda c: [c]), ("export",)),
    "hf-tokenizer-config-integer-chat-template": Row(
        "checkpoint", hf_tokenizer_config(lambda c: c.update(chat_template=7), "chat_template"), ("export",)
    ),
    "hf-tokenizer-config-bos-token-as-number": Row(
        "checkpoint", hf_tokenizer_config(lambda c: c.update(bos_token=1), "bos_token"), ("export",)
    ),
    "artifact-tokenizer-config-a-list": Row("artifact", artifact_tokenizer_config(lambda c: [c]), TOKENIZER_READERS),
    "artifact-tokenizer-config-string-bos-id": Row(
        "artifact", artifact_tokenizer_config(lambda c: c.update(bos_id="1"), "bos_id"), TOKENIZER_READERS
    ),
    "artifact-tokenizer-config-integer-chat-template": Row(
        "artifact", artifact_tokenizer_config(lambda c: c.update(chat_template=7), "chat_template"), TOKENIZER_READERS
    ),
    "chat-template-raising-a-python-error": Row(
        "chat", artifact_tokenizer_config(lambda c: c.update(chat_template="{{ 1/0 }}"), "chat template"), ("generate",)
    ),
    # Inputs, configs, tolerances and golden files.
    "inputs-input-ids-rank-1": Row("inputs", input_ids_of_rank(1), ("check", "run")),
    "inputs-input-ids-rank-3": Row("inputs", input_ids_of_rank(3), ("check", "run")),
    "config-not-utf8": Row("config", config_file(b'{"family": "llama\xff"}', "UTF-8"), ("export",)),
    "config-5000-digit-integer": Row(
        "config", config_file(with_huge_int(llama_config(), "layers"), "digits"), ("export",)
    ),
    "config-1e8-layers": Row("config", config_file(llama_config(layers=10**8), "layers", "at most"), ("export",)),
    "config-vocabulary-1e10": Row(
        "config", config_file(llama_config(vocab_size=10**10), "vocab_size", "at most"), ("export",)
    ),
    "tolerances-json-nested-100000-deep": Row("tolerances", tolerances("tolerances.json", DEEP, "nested"), ("check",)),
    "tolerances-toml-nested-100000-deep": Row(
        "tolerances", tolerances("tolerances.toml", "a = " + DEEP, "nested"), ("check",)
    ),
    "tolerances-json-5000-digit-integer": Row(
        "tolerances", tolerances("tolerances.json", '{"float32": {"atol": ' + HUGE + "}}", "digits"), ("check",)
    ),
    "golden-json-nested-100000-deep": Row("golden", golden_nested, ("check",)),
    "golden-npz-unpacked-size-bounded": Row("golden", golden_npz_bomb, ("check",)),
    "seed-negative": Row("seed", nothing, ("generate", "check", "run")),
}

CASES = [pytest.param(row, command, id=f"{row}::{command}") for row, r in CATALOGUE.items() for command in r.commands]


@contextlib.contextmanager
def hang_guard(what: str):
    """Fail, instead of hanging the suite, when a command blocks (a FIFO read, a spin)."""

    def expire(signum, frame):
        raise AssertionError(f"{what} still running after {HANG_SECONDS} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(HANG_SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("row,command", CASES)
def test_hostile_input_is_one_line_and_exit_2(env, tmp_path, row, command):
    entry = CATALOGUE[row]
    path, fragments = entry.make(env, tmp_path)
    args = command_line(entry.kind, command, path, env, tmp_path)
    tracemalloc.start()
    try:
        with hang_guard(f"{row} {command}"):
            result = invoke(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"{row} {command}: exit {result.exit_code}: {result.stderr.strip()}")  # the catalogue's lines, with -rP
    assert_user_error(result, *fragments)
    if row == "golden-npz-unpacked-size-bounded":
        assert peak < 30 << 20, f"{peak:,} bytes allocated: the 100 MB member was inflated before it was refused"


# --------------------------------------------------------------------------- outputs


def output_commands(env: Env, target: Path) -> dict[str, list]:
    return {
        "export": ["export", "--preset", "decoder-small", "--out", target],
        "check-html": ["check", env.lm, "--backends", "ort-cpu", "--html", target],
        "check-json": ["check", env.lm, "--backends", "ort-cpu", "--json", target],
        "run-save": ["run", env.lm, "--backend", "ort-cpu", "--save", target],
        "check-save-golden": ["check", env.lm, "--backends", "ort-cpu", "--save-golden", target],
        "quantize": ["quantize", env.lm, "--bits", "8", "--out", target],
    }


OUTPUTS = ("export", "check-html", "check-json", "run-save", "check-save-golden", "quantize")


@pytest.mark.parametrize("command", OUTPUTS)
def test_an_unwritable_output_location_is_exit_2(env, command):
    target = UNWRITABLE / "out"
    result = invoke(*output_commands(env, target)[command])
    assert_user_error(result, str(UNWRITABLE))


@contextlib.contextmanager
def file_size_limit(limit: int):
    """RLIMIT_FSIZE: a write past `limit` bytes fails with EFBIG (SIGXFSZ ignored), as on a full quota."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


@pytest.mark.parametrize("command", OUTPUTS)
def test_a_full_output_location_is_exit_2(env, tmp_path, command):
    target = tmp_path / ("out.html" if "html" in command else "out.npz" if "save" in command else "out")
    args = output_commands(env, target)[command]
    with file_size_limit(256):
        result = invoke(*args)
    # quantize writes its evaluation copy beside the target first, and names that hidden sibling.
    where = str(target.parent) if command == "quantize" else str(target)
    assert_user_error(result, where, os.strerror(errno.EFBIG), "free space or choose a writable location")
    assert not target.exists()
