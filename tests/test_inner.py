import math

import pytest
import torch
from safetensors.torch import load, save

from islands.core.config import InnerSettings
from islands.core.data import BatchSampler
from islands.core.inner import InnerTrainer, carried, lr_at
from islands.core.model import build_model

DATA = bytes((i * 7 + i // 13) % 256 for i in range(8192))
CFG = InnerSettings(lr=1e-3, warmup_steps=2, total_steps=20)


def make_trainer(model_seed=0, sampler_seed=0, **kwargs):
    sampler = BatchSampler(DATA, batch_size=2, block_size=16, seed=sampler_seed)
    return InnerTrainer(build_model("tiny", model_seed), sampler, CFG, **kwargs)


def base_weights(seed=0):
    return {k: v.clone() for k, v in build_model("tiny", seed).state_dict().items()}


def test_lr_schedule_points():
    cfg = InnerSettings(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(1e-4)
    assert lr_at(4, cfg) == pytest.approx(5e-4)
    assert lr_at(9, cfg) == pytest.approx(1e-3)
    assert lr_at(10, cfg) == pytest.approx(1e-3)
    assert lr_at(60, cfg) == pytest.approx(5.5e-4)  # halfway down the cosine
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(10_000, cfg) == pytest.approx(1e-4)
    assert lr_at(0, InnerSettings(warmup_steps=0)) == pytest.approx(1e-3)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"lr": 0}, "lr"),
        ({"warmup_steps": 700}, "total_steps"),
        ({"min_lr_ratio": 2}, "min_lr_ratio"),
        ({"beta2": 1.0}, "beta2"),
    ],
)
def test_inner_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"(?s)InnerSettings.*\b{field}\b"):
        InnerSettings(**kwargs)


def test_weight_decay_only_on_matrices():
    trainer = make_trainer()
    decay, no_decay = trainer.optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(trainer.model.parameters()))


def test_run_phase_returns_base_minus_local():
    trainer = make_trainer(model_seed=1)
    base = base_weights(0)
    base_copy = {k: v.clone() for k, v in base.items()}
    seen = []
    result = trainer.run_phase(base, steps=3, on_step=lambda step, loss: seen.append((step, loss)))
    assert result.steps == 3 and trainer.step == 3
    assert result.tokens == 3 * 2 * 16
    assert [s for s, _ in seen] == [1, 2, 3] and [loss for _, loss in seen] == result.losses
    assert result.loss == pytest.approx(sum(result.losses) / 3)
    assert abs(result.losses[0] - math.log(256)) < 0.2
    for name, param in trainer.model.named_parameters():
        assert result.delta[name].dtype == torch.float32
        assert torch.equal(result.delta[name], base[name] - param.detach())
        assert torch.equal(base[name], base_copy[name])  # base itself is untouched
    assert result.delta["wte.weight"].abs().max() > 0


def test_inner_optimizer_state_persists_across_phases():
    base = base_weights()
    trainer = make_trainer()
    trainer.run_phase(base, steps=3)
    first_param = next(trainer.model.parameters())
    assert float(trainer.optimizer.state[first_param]["step"]) == 3.0

    adam_steps = []

    def record(step, loss):
        adam_steps.append(float(trainer.optimizer.state[first_param]["step"]))

    trainer.run_phase(base, steps=1, on_step=record)
    assert adam_steps == [4.0] and trainer.step == 4

    # Same weights, data position and schedule step, but a fresh AdamW: the step comes out different.
    fresh = make_trainer()
    fresh.sampler.load_state_dict(trainer.sampler.state_dict())
    fresh.step = trainer.step
    kept, reset = trainer.run_phase(base, 1), fresh.run_phase(base, 1)
    assert not torch.equal(kept.delta["wte.weight"], reset.delta["wte.weight"])


def test_should_stop_ends_the_phase_early():
    trainer = make_trainer()
    calls = []

    def should_stop():
        calls.append(trainer.step)
        return trainer.step >= 2

    result = trainer.run_phase(base_weights(), steps=5, should_stop=should_stop)
    assert result.steps == 2 and result.tokens == 2 * 32 and len(result.losses) == 2
    assert calls == [0, 1, 2]
    assert torch.equal(result.delta["ln_f.weight"], base_weights()["ln_f.weight"] - trainer.model.ln_f.weight.detach())


def test_rebase_carries_the_progress_so_far_onto_the_newer_model():
    """Mid-phase, a newer global model arrives: the local weights move by exactly newer − base,
    training goes on from there, and the delta is measured against the newer model."""
    base, newer = base_weights(0), base_weights(1)
    rebased, by_hand = make_trainer(), make_trainer()
    offered = []

    def rebase():
        offered.append(rebased.step)
        return newer if rebased.step == 2 else None

    result = rebased.run_phase(base, steps=3, rebase=rebase)
    assert offered == [0, 1, 2] and result.steps == 3 and result.rebased_at == [2]
    # The same by hand: two steps from base, shift by newer − base, one more step.
    by_hand.run_phase(base, steps=2)
    shifted = {k: v.clone() for k, v in base.items()}
    for name, p in by_hand.model.named_parameters():
        shifted[name] = p.detach() + (newer[name] - base[name])
    by_hand.run_phase(shifted, steps=1)
    for name, p in rebased.model.named_parameters():
        assert torch.equal(p, dict(by_hand.model.named_parameters())[name])
        assert torch.equal(result.delta[name], newer[name] - p.detach())


def test_carried_puts_a_learners_unmerged_progress_back_on_the_round():
    theta = {"w": torch.tensor([1.0, 2.0])}
    assert carried(theta, []) is theta
    deltas = [{"w": torch.tensor([0.5, 0.0])}, {"w": torch.tensor([0.25, -1.0])}]  # base − local
    base = carried(theta, deltas)
    assert torch.equal(base["w"], torch.tensor([0.25, 3.0])) and list(base) == ["w"]
    assert base["w"] is not base["w"] and torch.equal(base["w"], base["w"])  # made at each look, the same bits


def test_slowdown_sleeps_for_the_extra_time_of_each_step():
    ticks = iter(range(1000))
    sleeps = []
    trainer = make_trainer(clock=lambda: 0.25 * next(ticks), sleep=sleeps.append)
    trainer.run_phase(base_weights(), steps=3, slowdown=1.0)
    assert sleeps == []
    result = trainer.run_phase(base_weights(), steps=3, slowdown=3.0)
    # Each step spans one clock tick (0.25 s) of compute, so a third of the speed sleeps 2 × 0.25 s.
    assert sleeps == [0.5, 0.5, 0.5]
    assert result.seconds == pytest.approx(0.25 * 7)
    with pytest.raises(ValueError, match="slowdown"):
        trainer.run_phase(base_weights(), steps=1, slowdown=0.5)


def test_a_step_floor_caps_the_rate_whatever_the_compute_took():
    """min_step_s is a rate cap, not a slowdown: a step slowed by other processes eats into the
    headroom instead of adding to the wait, and the phase keeps the capped rate."""
    now, sleeps = [0.0], []
    computes = iter([0.25, 0.5, 1.5, 0.25])

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        now[0] += seconds

    trainer = make_trainer(clock=lambda: now[0], sleep=sleep)
    train_step = trainer.train_step

    def step_taking_the_next_compute_time() -> float:
        now[0] += next(computes)
        return train_step()

    trainer.train_step = step_taking_the_next_compute_time
    result = trainer.run_phase(base_weights(), steps=4, min_step_s=1.0)
    # The 1.5 s step waits for nothing, and the step after it waits only until 4 floors are up.
    assert sleeps == [0.75, 0.5, 0.25]
    assert result.seconds == pytest.approx(4.0)
    computes = iter([1.5, 0.25])
    trainer.run_phase(base_weights(), steps=1, min_step_s=1.0)
    trainer.run_phase(base_weights(), steps=1, min_step_s=1.0)
    assert sleeps[-1] == 0.75  # each phase counts from its own start: an overrun does not carry over
    computes = iter([0.25])
    trainer.run_phase(base_weights(), steps=1, slowdown=5.0, min_step_s=1.0)
    assert sleeps[-1] == pytest.approx(1.0)  # with both, the longer wait: 4 × 0.25 s
    with pytest.raises(ValueError, match="min_step_s"):
        trainer.run_phase(base_weights(), steps=1, min_step_s=-1.0)


def test_catch_up_puts_the_schedule_at_the_runs_average_step_either_way():
    trainer = make_trainer()
    per_step = trainer.sampler.tokens_per_batch
    trainer.run_phase(base_weights(), 4)
    trainer.catch_up(tokens_applied=4 * 10 * per_step, learners=4)  # the run is at step 10; this one trained 4
    assert (trainer.step, trainer.schedule_step) == (4, 10)
    trainer.run_phase(base_weights(), 2)
    assert trainer.schedule_step == 12  # the phase's own steps move it on from there
    trainer.catch_up(tokens_applied=4 * 3 * per_step, learners=4)  # ahead of the run: it waits for the others
    assert (trainer.step, trainer.schedule_step) == (6, 3)


def test_state_dict_is_flat_and_safetensors_ready():
    trainer = make_trainer()
    trainer.run_phase(base_weights(), steps=2)
    state = trainer.state_dict()
    assert {"opt.step", "trainer.step", "sampler.generator", "sampler.draws"} <= set(state)
    assert "opt.exp_avg.wte.weight" in state and "opt.exp_avg_sq.blocks.0.ln_1.weight" in state
    assert int(state["opt.step"]) == 2 and int(state["trainer.step"]) == 2 and int(state["sampler.draws"]) == 2
    assert all(t.is_contiguous() and t.device.type == "cpu" for t in state.values())
    assert len({t.data_ptr() for t in state.values()}) == len(state)
    n_params = len(list(trainer.model.parameters()))
    assert sum(k.startswith("opt.exp_avg.") for k in state) == n_params


@pytest.mark.parametrize("steps_before", [0, 2])
def test_state_items_are_the_state_dict_one_tensor_at_a_time(steps_before):
    trainer = make_trainer()
    trainer.run_phase(base_weights(), steps=steps_before)
    items, whole = list(trainer.state_items()), trainer.state_dict()
    assert [k for k, _ in items] == list(whole) and all(torch.equal(v, whole[k]) for k, v in items)
    moments = {id(s[k]) for s in trainer.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")}
    assert not any(id(v) in moments for _, v in items)  # copies: the next phase's steps leave them be
    assert all(p.grad is None for p in trainer.model.parameters())  # a phase ends without its gradients


@pytest.mark.parametrize("steps_before", [0, 3])
@pytest.mark.parametrize("own", [False, True])
def test_restore_through_safetensors_continues_bit_identically(steps_before, own):
    base = base_weights()
    uninterrupted = make_trainer()
    first = uninterrupted.run_phase(base, steps=steps_before)
    blob = save(uninterrupted.state_dict())
    next_base = {k: base[k] - first.delta[k] for k in base}
    expected = uninterrupted.run_phase(next_base, steps=3)

    restored = make_trainer(model_seed=5, sampler_seed=77)
    restored.load_state_dict(load(blob), own=own)
    assert restored.step == steps_before
    got = restored.run_phase(next_base, steps=3)
    assert got.losses == expected.losses
    for name in expected.delta:
        assert torch.equal(got.delta[name], expected.delta[name]), name
    assert restored.step == uninterrupted.step == steps_before + 3


def test_load_state_dict_rejects_a_state_from_another_model():
    state = make_trainer().state_dict()
    state["opt.exp_avg.extra.weight"] = torch.zeros(1)
    del state["trainer.step"]
    with pytest.raises(ValueError, match="missing \\['trainer.step'\\].*extra.weight"):
        make_trainer().load_state_dict(state)


def test_load_state_dict_rejects_moments_of_another_shape():
    state = make_trainer().state_dict()
    state["opt.exp_avg.wte.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="wte.weight has shape \\(3, 3\\)"):
        make_trainer().load_state_dict(state)
