"""Training and evaluation batches, cut from a corpus of token shards streamed chunk by chunk.

A corpus is a list of shards (flat arrays of token ids; the byte-level text corpus is one shard of
bytes held in memory). Every learner reads only its own contiguous range of the shards
(`assign`), one chunk of at most `chunk_tokens` at a time with the next chunk read ahead in the
background, so its memory is two chunks whatever the corpus's size. Batches are random windows
of the current chunk; after about one chunk's worth of tokens the sampler moves to the next
chunk, and after the learner's last chunk back to its first.

Every random choice comes from a generator the caller seeds, and the sampler's cursor (chunk,
draws, generator) can be saved and restored, so a learner that restarts sees exactly the batches
it would have seen.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from islands.core.model import autocast_context, causal_loss


class TokenRangeError(ValueError):
    """A shard holds a token id the model has no embedding for."""


@dataclass(frozen=True)
class Segment:
    """Tokens [start, end) of shard `shard`."""

    shard: int
    start: int
    end: int

    @property
    def tokens(self) -> int:
        return self.end - self.start


class ShardReader(Protocol):
    """Where a corpus's tokens come from: named shards of known length, read by ranges."""

    names: list[str]
    lengths: list[int]
    chunk_tokens: int | None  # tokens per read (None: a segment at once)

    def read(self, shard: int, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of `shard` as uint8 or int32 (so torch can index with them)."""
        ...


class InMemory:
    """One shard already in memory: the byte-level text corpus (tokens are bytes, vocabulary 256)
    or text tokenized when the run starts."""

    def __init__(self, tokens: bytes | np.ndarray, name: str = "memory", chunk_tokens: int | None = None):
        self.tokens = np.frombuffer(bytearray(tokens), np.uint8) if isinstance(tokens, bytes | bytearray) else tokens
        self.names = [name]
        self.lengths = [len(self.tokens)]
        self.chunk_tokens = chunk_tokens

    def read(self, shard: int, start: int, end: int) -> np.ndarray:
        return self.tokens[start:end]


def _tail_cut(length: int, fraction: float) -> int:
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be between 0 and 1 (exclusive), got {fraction}")
    cut = length - int(length * fraction)
    if cut == length or cut == 0:
        raise ValueError(f"cannot hold out {fraction} of {length} tokens: one side would be empty; use more data")
    return cut


def split_held_out(data: bytes, fraction: float = 0.05) -> tuple[bytes, bytes]:
    """Return (train, held_out); the held-out part is the tail, so every learner agrees on it."""
    cut = _tail_cut(len(data), fraction)
    return data[:cut], data[cut:]


def split_shards(lengths: list[int], fraction: float = 0.05) -> tuple[list[Segment], list[Segment]]:
    """(train, held_out) over shards: the last shard is held out when there are two or more, the
    tail `fraction` of the only one otherwise (as `split_held_out` cuts bytes)."""
    if len(lengths) >= 2:
        return [Segment(i, 0, n) for i, n in enumerate(lengths[:-1])], [Segment(len(lengths) - 1, 0, lengths[-1])]
    cut = _tail_cut(lengths[0], fraction)
    return [Segment(0, 0, cut)], [Segment(0, cut, lengths[0])]


def _range(total: int, index: int, count: int, block_size: int) -> tuple[int, int]:
    if count < 1:
        raise ValueError(f"shard count must be at least 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is out of range for {count} shards (0..{count - 1})")
    start, end = total * index // count, total * (index + 1) // count
    if end - start < 2 * block_size:
        raise ValueError(
            f"shard {index} of {count} would hold {end - start} tokens, shorter than 2 blocks of "
            f"{block_size}; use fewer shards or more data"
        )
    return start, end


def shard(data: bytes, index: int, count: int, *, block_size: int = 128) -> bytes:
    """The index-th of count contiguous, disjoint shards that together cover all of data."""
    start, end = _range(len(data), index, count, block_size)
    return data[start:end]


def assign(segments: list[Segment], index: int, count: int, *, block_size: int = 128) -> list[Segment]:
    """Learner `index` of `count`'s part of `segments`: the index-th of count contiguous,
    disjoint token ranges over them laid end to end (whole shards when there are many), so
    every learner computes every learner's part alike and reads only its own."""
    start, end = _range(sum(s.tokens for s in segments), index, count, block_size)
    out, at = [], 0
    for s in segments:
        lo, hi = max(start, at), min(end, at + s.tokens)
        if lo < hi:
            out.append(Segment(s.shard, s.start + lo - at, s.start + hi - at))
        at += s.tokens
    return out


@dataclass(frozen=True)
class Cursor:
    """Where a stream stands: the chunk starting `offset` tokens into its `segment`-th segment,
    in its `epoch`-th pass over them."""

    segment: int = 0
    offset: int = 0
    epoch: int = 0


class Stream:
    """A learner's segments, chunk by chunk, the next chunk read in the background (one ahead).

    A chunk is at most the reader's `chunk_tokens` long, except that a segment's tail too short for a window
    joins the chunk before it. Segments shorter than one window are skipped. Each chunk's ids are
    checked against `vocab_size` as it is read: a shard with an id the model has no embedding
    for fails the read, naming the shard and the offset."""

    def __init__(
        self,
        reader: ShardReader,
        segments: list[Segment],
        window: int,
        vocab_size: int | None = None,
    ):
        self.reader = reader
        self.segments = [s for s in segments if s.tokens >= window]
        if not self.segments:
            raise ValueError(
                f"{sum(s.tokens for s in segments)} tokens cannot fill one block of {window - 1} + 1 tokens"
            )
        self.window = window
        self.chunk_tokens = max(reader.chunk_tokens or max(s.tokens for s in self.segments), window)
        self.vocab_size = vocab_size
        self.cursor = Cursor()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="read-ahead")
        self._current: tuple[Cursor, Future] | None = None
        self._ahead: tuple[Cursor, Future] | None = None

    def span(self, cursor: Cursor) -> Segment:
        """The tokens of the chunk at `cursor`."""
        seg = self.segments[cursor.segment]
        start = seg.start + cursor.offset
        end = min(start + self.chunk_tokens, seg.end)
        if seg.end - end < self.window:
            end = seg.end
        return Segment(seg.shard, start, end)

    def following(self, cursor: Cursor) -> Cursor:
        span = self.span(cursor)
        seg = self.segments[cursor.segment]
        if span.end < seg.end:
            return Cursor(cursor.segment, span.end - seg.start, cursor.epoch)
        if cursor.segment + 1 < len(self.segments):
            return Cursor(cursor.segment + 1, 0, cursor.epoch)
        return Cursor(0, 0, cursor.epoch + 1)

    def _read(self, span: Segment) -> torch.Tensor:
        tokens = self.reader.read(span.shard, span.start, span.end)
        if len(tokens) != span.tokens:
            raise ValueError(
                f"shard {self.reader.names[span.shard]}: read {len(tokens)} tokens at offset {span.start}, "
                f"expected {span.tokens}; the shard is shorter than its dataset manifest says"
            )
        if self.vocab_size is not None and len(tokens) and int(tokens.max()) >= self.vocab_size:
            at = int(np.argmax(tokens >= self.vocab_size))
            raise TokenRangeError(
                f"corpus: shard {self.reader.names[span.shard]} holds token id {int(tokens[at])} at offset "
                f"{span.start + at}, at or above the model's vocabulary of {self.vocab_size}; tokenize with "
                "a tokenizer whose vocabulary fits the model"
            )
        return torch.from_numpy(np.ascontiguousarray(tokens))

    def _fetch(self, cursor: Cursor) -> Future:
        return self._pool.submit(self._read, self.span(cursor))

    def current(self) -> torch.Tensor:
        """The chunk at the cursor (waiting for its read if it is not in yet)."""
        if self._current is None or self._current[0] != self.cursor:
            if self._ahead is not None and self._ahead[0] == self.cursor:
                self._current = self._ahead
            else:
                self._current = (self.cursor, self._fetch(self.cursor))
            self._ahead = None
        chunk = self._current[1].result()
        if self._ahead is None:
            nxt = self.following(self.cursor)
            self._ahead = (nxt, self._current[1] if self.span(nxt) == self.span(self.cursor) else self._fetch(nxt))
        return chunk

    def advance(self) -> None:
        self.cursor = self.following(self.cursor)

    def seek(self, cursor: Cursor) -> None:
        if (
            not 0 <= cursor.segment < len(self.segments)
            or not 0 <= cursor.offset < self.segments[cursor.segment].tokens
        ):
            raise ValueError(f"cursor {cursor} lies outside this learner's {len(self.segments)} segments")
        self.cursor = cursor


class BatchSampler:
    """Random windows of block_size + 1 tokens of the stream's current chunk; y is x shifted left
    by one token. After as many tokens as the chunk holds it moves to the next chunk. Bytes are a
    stream of one chunk in memory."""

    def __init__(self, data: bytes | Stream, batch_size: int, block_size: int, seed: int):
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be positive, got {batch_size}, {block_size}")
        if isinstance(data, bytes | bytearray):
            data = Stream(InMemory(data), [Segment(0, 0, len(data))], block_size + 1)
        if data.window != block_size + 1:
            raise ValueError(f"the stream cuts windows of {data.window} tokens, not block_size {block_size} + 1")
        self.stream = data
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.draws = 0
        self.chunk_draws = 0  # draws from the current chunk
        self._window = torch.arange(block_size + 1)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.stream.current()
        starts = torch.randint(len(data) - self.block_size, (self.batch_size,), generator=self.generator)
        windows = data[starts[:, None] + self._window].long()
        self.draws += 1
        self.chunk_draws += 1
        if self.chunk_draws * self.tokens_per_batch >= len(data):
            self.stream.advance()
            self.chunk_draws = 0
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        c = self.stream.cursor
        return {
            "generator": self.generator.get_state(),
            "draws": torch.tensor(self.draws),
            "chunk_draws": torch.tensor(self.chunk_draws),
            "segment": torch.tensor(c.segment),
            "offset": torch.tensor(c.offset),
            "epoch": torch.tensor(c.epoch),
        }

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"].to(torch.uint8).contiguous())
        self.draws = int(state["draws"])
        self.chunk_draws = int(state["chunk_draws"])
        self.stream.seek(Cursor(int(state["segment"]), int(state["offset"]), int(state["epoch"])))


def eval_batches(
    data: bytes | Stream, batch_size: int, block_size: int, n_batches: int, seed: int = 0
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed set of batches, so held-out losses from different runs and rounds compare."""
    sampler = BatchSampler(data, batch_size, block_size, seed)
    return [sampler.next_batch() for _ in range(n_batches)]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device | None = None,
) -> float:
    """Mean loss over the batches, in eval mode; the model's train/eval mode is restored after."""
    if not batches:
        raise ValueError("evaluate needs at least one batch")
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        total = 0.0
        for x, y in batches:
            with autocast_context(device):
                loss = causal_loss(model, x.to(device), y.to(device))
            total += loss.item()
    finally:
        model.train(was_training)
    return total / len(batches)
