"""The eager model rebuilt from an artifact, and the float64 oracle that widens it a block at a time."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from exporters.onnx_export import export_model
from models.artifacts import open_artifact
from models.registry import build_model, get_family
from runners.eager import computing_in, model_from_artifact

CONFIG = {
    "vocab_size": 112,
    "layers": 3,
    "width": 48,
    "heads": 6,
    "kv_heads": 2,
    "ff_width": 80,
    "max_positions": 40,
    "tie_embeddings": True,
}


@pytest.fixture(scope="module")
def model():
    config = get_family("llama").config_from_dict(CONFIG)
    return build_model("llama", config, seed=3)


def snapshot(module):
    return {k: (v.dtype, v.clone()) for k, v in module.state_dict(keep_vars=True).items()} | {
        f"buffer:{k}": (v.dtype, v.clone()) for k, v in module.named_buffers()
    }


def test_by_block_is_bit_identical_to_a_float64_copy(model):
    ids = torch.from_numpy(np.random.default_rng(0).integers(0, CONFIG["vocab_size"], (2, 9)))
    copy64 = copy.deepcopy(model).to(torch.float64)
    heads, width = CONFIG["kv_heads"], CONFIG["width"] // CONFIG["heads"]
    empty = [(torch.zeros(2, heads, 0, width, dtype=torch.float64),) * 2 for _ in range(CONFIG["layers"])]
    with torch.no_grad():
        want = copy64(ids, past=empty)
        before = snapshot(model)
        with computing_in(model, torch.float64):
            got = model(ids, past=empty)
            # the blocks are float32 between calls: only the one running is widened
            assert all(p.dtype == torch.float32 for p in model.block.parameters())
            assert model.embed_tokens.weight.dtype == torch.float64
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == torch.float64
            assert torch.equal(got[name], want[name]), name
        # decode with the float64 cache the prefill returned, as the check's oracle does
        past = [(got[f"present.{i}.key"], got[f"present.{i}.value"]) for i in range(CONFIG["layers"])]
        step = ids[:, -1:]
        want_step = copy64(step, past=[(k.clone(), v.clone()) for k, v in past])
        with computing_in(model, torch.float64):
            got_step = model(step, past=past)
        assert torch.equal(got_step["logits"], want_step["logits"])
    after = snapshot(model)
    for name, (dtype, value) in before.items():
        assert after[name][0] == dtype and torch.equal(after[name][1], value), name
    assert model.lm_head.weight is model.embed_tokens.weight  # the tie survives


def test_a_failing_forward_still_restores_the_model(model):
    before = snapshot(model)
    with pytest.raises(RuntimeError, match="boom"), computing_in(model, torch.float64):
        hook = model.block[1].register_forward_hook(lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
        try:
            model(torch.zeros((1, 3), dtype=torch.int64))
        finally:
            hook.remove()
    after = snapshot(model)
    for name, (dtype, value) in before.items():
        assert after[name][0] == dtype and torch.equal(after[name][1], value), name


def test_float32_inside_is_the_model_converted(model):
    # A float32 model holds its RoPE frequencies in float64; computing in float32 rounds them as .to() does.
    converted = copy.deepcopy(model).to(torch.float32)
    assert model.block[0].attention.inv_freq.dtype == torch.float64
    ids = torch.zeros((1, 4), dtype=torch.int64)
    with torch.no_grad(), computing_in(model, torch.float32):
        got = model(ids)["logits"]
    assert torch.equal(got, converted(ids)["logits"])
    assert model.block[0].attention.inv_freq.dtype == torch.float64


def test_a_float64_model_runs_as_it_is(model):
    copy64 = copy.deepcopy(model).to(torch.float64)
    with computing_in(copy64, torch.float64) as same:
        assert same is copy64
        assert not copy64.block[0]._forward_pre_hooks


@pytest.fixture(scope="module")
def external(tmp_path_factory, model):
    config = get_family("llama").config_from_dict(CONFIG)
    out = tmp_path_factory.mktemp("eager") / "art"
    export_model(model, "llama", config, out, variant="serving", external_data=True)
    return open_artifact(out)


def test_weights_are_read_from_external_data_exactly(external, model):
    assert any(g.entry.external_data for g in external.graphs)
    rebuilt = model_from_artifact(external)
    for name, value in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], value), name
    assert rebuilt.lm_head.weight is rebuilt.embed_tokens.weight


def test_check_by_block_gives_the_same_verdict_and_numbers(external, monkeypatch):
    import toolkit.check.crosscheck as crosscheck

    reports = {}
    for threshold in (1 << 40, 0):  # a float64 copy, then the float32 model widened by block
        monkeypatch.setattr(crosscheck, "BY_BLOCK_BYTES", threshold)
        models = crosscheck.EagerModels.load(external)
        assert (models.float64 is models.float32) == (threshold == 0)
        report = crosscheck.cross_check(external, ["eager", "ort-cpu"], models=models, decode_steps=2)
        assert report.passed
        reports[threshold] = json.dumps(
            [[o.name, o.max_abs, o.allowed] for b in report.backends for o in b.comparison.outputs]
        )
    assert reports[1 << 40] == reports[0]
