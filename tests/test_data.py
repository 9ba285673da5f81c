import numpy as np
import pytest
import torch

from islands.core.data import (
    BatchSampler,
    Cursor,
    InMemory,
    Segment,
    Stream,
    TokenRangeError,
    assign,
    eval_batches,
    evaluate,
    shard,
    split_held_out,
    split_shards,
)
from islands.core.model import build_model

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
    assert set(state) == {"generator", "draws", "chunk_draws", "segment", "offset", "epoch"}
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


# -- shards, streams and the cursor ---------------------------------------------------------------


class Counting(InMemory):
    """Shards of consecutive ids (shard s holds s·10⁶ + 0, 1, …), counting the reads."""

    def __init__(self, lengths: list[int], chunk_tokens: int):
        self.names = [f"s{i}.bin" for i in range(len(lengths))]
        self.lengths = lengths
        self.chunk_tokens = chunk_tokens
        self.reads: list[tuple[int, int, int]] = []

    def read(self, shard: int, start: int, end: int) -> np.ndarray:
        self.reads.append((shard, start, end))
        return np.arange(start, end, dtype=np.int32) + shard * 1_000_000


def test_the_last_shard_is_held_out_and_learners_split_the_rest_into_disjoint_ranges():
    train, held = split_shards([1000, 500, 700])
    assert train == [Segment(0, 0, 1000), Segment(1, 0, 500)] and held == [Segment(2, 0, 700)]
    assert split_shards([1000]) == ([Segment(0, 0, 950)], [Segment(0, 950, 1000)])  # bytes: the tail 5 %
    parts = [assign(train, i, 3, block_size=16) for i in range(3)]
    assert parts == [
        [Segment(0, 0, 500)],
        [Segment(0, 500, 1000)],
        [Segment(1, 0, 500)],
    ]
    assert assign(train, 0, 2, block_size=16) == [Segment(0, 0, 750)]
    assert assign(train, 1, 2, block_size=16) == [Segment(0, 750, 1000), Segment(1, 0, 500)]


def test_a_stream_reads_only_its_segments_a_chunk_at_a_time_and_wraps_around():
    reader = Counting([1000, 500, 700], chunk_tokens=300)
    stream = Stream(reader, [Segment(0, 750, 1000), Segment(1, 0, 500)], window=17)
    spans = []
    for _ in range(5):
        spans.append(stream.span(stream.cursor))
        chunk = stream.current()
        assert chunk.tolist() == list(
            range(spans[-1].start + spans[-1].shard * 10**6, spans[-1].end + spans[-1].shard * 10**6)
        )
        stream.advance()
    # 250 tokens of shard 0, then shard 1 in chunks of 300 with its 200-token tail kept whole,
    # then around again (epoch 1); never a token of another learner's range.
    assert spans == [
        Segment(0, 750, 1000),
        Segment(1, 0, 300),
        Segment(1, 300, 500),
        Segment(0, 750, 1000),
        Segment(1, 0, 300),
    ]
    assert stream.cursor == Cursor(1, 300, 1)
    assert all(s != 2 and not (s == 0 and a < 750) for s, a, _ in reader.reads)
    assert len(reader.reads) <= 6  # each chunk read once, plus at most one read ahead


def test_a_restored_sampler_continues_exactly_across_chunks():
    def sampler(seed):
        return BatchSampler(
            Stream(Counting([4000, 3000], 700), [Segment(0, 0, 4000), Segment(1, 0, 3000)], 17), 8, 16, seed
        )

    first = sampler(3)
    for _ in range(13):  # past a chunk boundary (700 / 128 draws per chunk)
        first.next_batch()
    state = first.state_dict()
    assert int(state["segment"]) == 0 and int(state["offset"]) > 0
    expected = [first.next_batch() for _ in range(30)]
    second = sampler(999)
    second.load_state_dict(state)
    for x, y in expected:
        a, b = second.next_batch()
        assert torch.equal(a, x) and torch.equal(b, y)


def test_an_id_outside_the_vocabulary_fails_the_read_naming_shard_and_offset():
    tokens = np.arange(2000, dtype=np.int32) % 250
    tokens[1234] = 300
    stream = Stream(
        InMemory(tokens, name="shard-000007.bin", chunk_tokens=1000), [Segment(0, 0, 2000)], 17, vocab_size=256
    )
    stream.current()  # the first chunk is clean
    stream.advance()
    with pytest.raises(
        TokenRangeError,
        match=r"shard shard-000007.bin holds token id 300 at offset 1234, at or above the model's vocabulary of 256",
    ):
        stream.current()
