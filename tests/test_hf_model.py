"""Models beyond the presets: a Hugging Face config folder (tied embeddings) and python: factories,
built under the run's seed, synced as their float trainable parameters with each tie once."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_models import write_llama

from islands.core.config import InnerSettings
from islands.core.data import BatchSampler
from islands.core.inner import InnerTrainer
from islands.core.model import (
    ModelError,
    assign_params,
    build_model,
    causal_loss,
    check_model,
    params_of,
    skeleton,
    spec_vocab_and_context,
    vocab_and_context,
)
from islands.storage.codec import decode_state, encode_state

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(write_llama(tmp_path_factory.mktemp("llama")))


def test_hf_config_builds_bit_identically_per_seed(llama):
    a, b, c = (params_of(build_model(llama, s)) for s in (7, 7, 8))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert params_of(build_model(f"file://{llama}/config.json", 7).float()).keys() == a.keys()
    assert vocab_and_context(build_model(llama, 0)) == (512, 64)


def test_tied_weights_are_one_parameter_stored_once_and_tied_again(llama):
    model = build_model(llama, 0)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    params = params_of(model)
    assert "lm_head.weight" not in params and "model.embed_tokens.weight" in params
    stored = decode_state(encode_state(params, {}))  # safetensors refuses shared storage: one tensor
    again = skeleton(llama, 0)
    assign_params(again, stored)
    assert again.lm_head.weight is again.model.embed_tokens.weight
    x = torch.randint(512, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.equal(causal_loss(again, x, x), causal_loss(model, x, x))


def test_a_phase_on_an_hf_model_trains_the_tie_once(llama):
    model = build_model(llama, 0)
    data = bytes(range(256)) * 64
    trainer = InnerTrainer(model, BatchSampler(data, 4, 32, seed=0), InnerSettings(lr=3e-3, warmup_steps=1))
    base = params_of(build_model(llama, 0))
    result = trainer.run_phase(base, 6)
    assert result.delta.keys() == base.keys()
    assert result.losses[-1] < result.losses[0]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    restored = InnerTrainer(build_model(llama, 0), BatchSampler(data, 4, 32, seed=0), InnerSettings())
    restored.load_state_dict(trainer.state_dict())


def test_a_folder_with_weights_is_loaded_with_them(llama, tmp_path):
    trained = build_model(llama, 3)
    with torch.no_grad():
        trained.model.norm.weight.fill_(0.5)
    trained.save_pretrained(tmp_path)
    loaded = params_of(build_model(str(tmp_path), 0))
    assert all(torch.equal(loaded[k], v) for k, v in params_of(trained).items())


def test_a_factory_syncs_float_trainable_parameters_only():
    model = build_model("python:hf_models:bigram", 1)
    assert params_of(model).keys() == {"table.weight"}
    assert torch.equal(
        params_of(model)["table.weight"], params_of(build_model("python:hf_models:bigram", 1))["table.weight"]
    )
    assert vocab_and_context(model) == (256, 32)
    check_model("python:hf_models:bigram")


def test_a_specs_vocabulary_and_context_are_the_built_models(llama):
    """Read from the config where there is one, without building weights; the same as asking the model."""
    for spec in ("tiny", "small", llama, "python:hf_models:bigram"):
        assert spec_vocab_and_context(spec, 0) == vocab_and_context(build_model(spec, 0)), spec


@pytest.mark.parametrize(
    "spec, says",
    [
        ("/nowhere/model", "model: /nowhere/model is neither a preset"),
        ("/nowhere/config.json", "model: /nowhere/config.json does not exist"),
        ("python:no_such_module:build", "model: cannot import 'no_such_module'"),
        ("python:hf_models:missing", "model: hf_models has no function 'missing'"),
        ("python:hf_models:not_a_module", "not a torch.nn.Module"),
        ("python:hf_models:logits_only", "not a scalar loss"),
    ],
)
def test_bad_models_are_refused_naming_the_field(spec, says):
    with pytest.raises(ModelError) as caught:
        check_model(spec)
    assert str(caught.value).startswith("model: ") and says in str(caught.value) and "\n" not in str(caught.value)


def test_a_config_that_does_not_parse_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"^model: .*config.json is not a transformers config"):
        check_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(ModelError, match=r"^model: "):
        check_model(str(tmp_path))


@pytest.mark.parametrize("model", ["/nowhere/model", "python:hf_models:logits_only"])
def test_the_cli_refuses_a_bad_model_before_writing_anything(model, tmp_path):
    store = tmp_path / "store"
    done = subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", "run", "--model", model, "--store", f"file://{store}/{{bucket}}"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("islands: model: "), lines
    assert not store.exists()
