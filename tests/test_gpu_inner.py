"""What a GPU's memory decides, on the CPU: micro-batches accumulate to the step of the whole batch,
checkpointed blocks recompute to the same delta, and running out of memory names the setting to lower."""

from __future__ import annotations

import pytest
import torch

from islands.core.config import ConfigError, InnerSettings, load_config
from islands.core.data import BatchSampler
from islands.core.inner import InnerTrainer, OutOfMemory, blocks
from islands.core.model import MLP, build_model, params_of

DATA = bytes((i * 7 + i // 13) % 256 for i in range(8192))
STEPS = 3


def trainer_of(model: torch.nn.Module, **settings) -> InnerTrainer:
    cfg = InnerSettings(lr=1e-3, warmup_steps=1, total_steps=10, batch_size=8, **settings)
    return InnerTrainer(model, BatchSampler(DATA, 8, 16, seed=0), cfg)


def phase_delta(model: torch.nn.Module, **settings) -> dict[str, torch.Tensor]:
    return dict(trainer_of(model, **settings).run_phase(params_of(model), STEPS).delta)


def assert_same_delta(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Equal within float tolerance: AdamW divides each gradient by its own magnitude, so
    summation order shows in the last digits of the steps of near-zero gradients (atol: 1/300
    of a step of lr 1e-3)."""
    assert a.keys() == b.keys()
    assert max(t.abs().max().item() for t in a.values()) > 1e-3  # the phase moved the weights
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5, msg=name)


def test_micro_batches_accumulate_to_the_step_and_delta_of_the_whole_batch():
    whole, accumulated = trainer_of(build_model("tiny", 0)), trainer_of(build_model("tiny", 0), micro_batch_size=2)
    # One step's gradients and loss: AdamW would hide a wrongly scaled sum (it is scale-invariant).
    batch = whole.sampler.next_batch()
    assert whole._accumulate(*batch).item() == pytest.approx(accumulated._accumulate(*batch).item(), rel=1e-5)
    for (name, p), q in zip(whole.model.named_parameters(), accumulated.model.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert_same_delta(phase_delta(build_model("tiny", 0)), phase_delta(build_model("tiny", 0), micro_batch_size=2))


def test_checkpointed_blocks_recompute_in_the_backward_and_give_the_same_delta(monkeypatch):
    plain = phase_delta(build_model("tiny", 0))
    model = build_model("tiny", 0)
    mlp, forward, runs = blocks(model)[0].mlp, MLP.forward, []

    def counted(self, x):
        runs.extend([1] if self is mlp else [])
        return forward(self, x)

    monkeypatch.setattr(MLP, "forward", counted)  # the recompute calls forward itself, past the hooks
    checkpointed = phase_delta(model, activation_checkpointing=True, micro_batch_size=4)
    assert len(runs) == STEPS * 2 * 2  # two micro-batches a step, each block run again in the backward
    assert_same_delta(plain, checkpointed)


def test_a_hugging_face_model_checkpoints_through_its_own_switch():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model, reference = LlamaForCausalLM(config), LlamaForCausalLM(config)
    reference.load_state_dict(model.state_dict())
    checkpointed = phase_delta(model, activation_checkpointing=True)
    assert model.is_activation_checkpointing
    assert_same_delta(phase_delta(reference), checkpointed)


def test_out_of_memory_names_the_setting_to_lower(monkeypatch):
    model = build_model("tiny", 0)

    def no_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(model, "forward", no_memory)
    with pytest.raises(OutOfMemory) as exc:
        phase_delta(model, micro_batch_size=4)
    message = str(exc.value)
    assert "\n" not in message and exc.value.__cause__ is None
    assert message.startswith("inner.micro_batch_size: 4 sequences") and "lower inner.micro_batch_size" in message


@pytest.mark.parametrize(
    "overrides,field",
    [
        ({"inner.batch_size": 16, "inner.micro_batch_size": 3}, "inner.micro_batch_size"),
        ({"inner.batch_size": 16, "gpus_per_learner": 3}, "gpus_per_learner"),
        ({"inner.batch_size": 16, "inner.micro_batch_size": 16, "gpus_per_learner": 2}, "gpus_per_learner"),
        ({"parallel": "zero3"}, "parallel"),
    ],
)
def test_batch_splits_that_do_not_divide_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert str(exc.value).startswith(f"{field}: ")
