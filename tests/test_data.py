import pytest
import torch

from tasks.core.data import BatchSampler, eval_batches, evaluate, shard, split_held_out
from tasks.core.model import build_model

DATA = bytes(range(256)) * 40  # 10,240 bytes; byte i is i % 256, so windows are easy to check


def test_split_held_out_is_the_tail():
    train, held_out = split_held_out(DATA, 0.05)
    assert len(held_out) == 512 and len(train) == 10_240 - 512
    assert train + held_out == DATA
    assert held_out == DATA[-512:]
    assert split_held_out(DATA, 0.05) == (train, held_out)


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.1, 1.5])
def test_split_held_out_rejects_bad_fractions(fraction):
    with pytest.raises(ValueError, match="fraction"):
        split_held_out(DATA, fraction)


def test_split_held_out_refuses_an_empty_side():
    with pytest.raises(ValueError, match="empty"):
        split_held_out(b"abc", 0.1)


def test_shards_are_contiguous_disjoint_and_cover_everything():
    data = DATA + b"xyz"  # not divisible by 3
    shards = [shard(data, i, 3) for i in range(3)]
    assert b"".join(shards) == data
    assert [len(s) for s in shards] == [3414, 3414, 3415]
    assert shard(data, 0, 1) == data


@pytest.mark.parametrize("index,count,match", [(3, 3, "out of range"), (-1, 2, "out of range"), (0, 0, "at least 1")])
def test_shard_rejects_bad_index_or_count(index, count, match):
    with pytest.raises(ValueError, match=match):
        shard(DATA, index, count)


def test_shard_shorter_than_two_blocks_is_refused():
    with pytest.raises(ValueError, match="shorter than 2 blocks of 128"):
        shard(DATA, 0, 50)  # 204 bytes < 256
    assert len(shard(DATA, 0, 50, block_size=64)) == 204


def test_batches_are_windows_shifted_by_one():
    sampler = BatchSampler(DATA, batch_size=5, block_size=16, seed=0)
    x, y = sampler.next_batch()
    assert x.shape == y.shape == (5, 16) and x.dtype == y.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y, (x + 1) % 256)
    assert torch.equal((x[:, 1:] - x[:, :-1]) % 256, torch.ones(5, 15, dtype=torch.int64))
    assert sampler.tokens_per_batch == 80


def test_same_seed_same_batches_other_seed_other_batches():
    a, b, c = (BatchSampler(DATA, 4, 8, seed) for seed in (1, 1, 2))
    xa, xb, xc = a.next_batch()[0], b.next_batch()[0], c.next_batch()[0]
    assert torch.equal(xa, xb) and not torch.equal(xa, xc)


def test_restored_sampler_continues_with_the_same_batches():
    uninterrupted = BatchSampler(DATA, 4, 8, seed=3)
    for _ in range(5):
        uninterrupted.next_batch()
    state = uninterrupted.state_dict()
    assert set(state) == {"generator", "draws"}
    assert state["generator"].dtype == torch.uint8 and int(state["draws"]) == 5
    expected = [uninterrupted.next_batch() for _ in range(3)]

    restored = BatchSampler(DATA, 4, 8, seed=999)
    restored.load_state_dict(state)
    assert restored.draws == 5
    for x_expected, y_expected in expected:
        x, y = restored.next_batch()
        assert torch.equal(x, x_expected) and torch.equal(y, y_expected)


def test_sampler_needs_one_block_of_data():
    with pytest.raises(ValueError, match="one block"):
        BatchSampler(b"0123456789", 2, 10, seed=0)
    BatchSampler(b"0123456789A", 2, 10, seed=0).next_batch()  # exactly one window fits


def test_eval_batches_are_deterministic():
    first = eval_batches(DATA, 3, 16, n_batches=4, seed=5)
    second = eval_batches(DATA, 3, 16, n_batches=4, seed=5)
    assert len(first) == 4
    for (x1, y1), (x2, y2) in zip(first, second):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(first[0][0], eval_batches(DATA, 3, 16, n_batches=1, seed=6)[0][0])


def test_evaluate_returns_mean_loss_and_restores_mode():
    model = build_model("tiny", 0)
    batches = eval_batches(DATA, 2, 16, n_batches=3)
    model.train()
    loss = evaluate(model, batches)
    assert model.training
    expected = sum(model(x, y)[1].item() for x, y in batches) / 3
    assert loss == pytest.approx(expected, rel=1e-6)
    model.eval()
    evaluate(model, batches, torch.device("cpu"))
    assert not model.training
