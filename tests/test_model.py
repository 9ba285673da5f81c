import math

import pytest
import torch

from islands.core.model import GPT, PRESETS, GPTConfig, autocast_context, build_model


def test_preset_param_counts():
    assert 800_000 <= build_model("tiny", 0).num_params() <= 1_000_000
    assert 10_000_000 <= build_model("small", 0).num_params() <= 20_000_000
    assert PRESETS["tiny"] == GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)


def test_same_seed_gives_identical_weights_and_different_seed_does_not():
    a, b, c = build_model("tiny", 7), build_model("tiny", 7), build_model("tiny", 8)
    for (name, pa), (_, pb), (_, pc) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_build_model_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny", 0)
    assert torch.equal(torch.rand(3), expected)


def test_no_shared_storage_between_parameters():
    pointers = [t.data_ptr() for t in build_model("tiny", 0).state_dict().values()]
    assert len(set(pointers)) == len(pointers)


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(ValueError, match="small.*tiny"):
        build_model("huge", 0)


def test_forward_shapes_and_initial_loss_near_uniform():
    model = build_model("tiny", 0)
    idx = torch.randint(256, (3, 17), generator=torch.Generator().manual_seed(0))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 256) and loss is None
    _, loss = model(idx, idx)
    assert loss.shape == ()
    assert abs(loss.item() - math.log(256)) < 0.1


def test_sequence_longer_than_block_is_refused():
    model = GPT(GPTConfig(block_size=8, n_layer=1, n_head=2, n_embd=16))
    with pytest.raises(ValueError, match="block_size 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_a_few_adamw_steps_lower_the_loss_on_a_fixed_batch():
    model = build_model("tiny", 0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(256, (4, 32), generator=gen)
    y = torch.randint(256, (4, 32), generator=gen)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        _, loss = model(x, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


def test_autocast_is_a_no_op_on_cpu():
    with autocast_context(torch.device("cpu")):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
