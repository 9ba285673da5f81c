"""Training and evaluation batches cut from bytes already in memory.

Every random choice comes from a generator the caller seeds, and the sampler's position can be saved
and restored, so a learner that restarts sees exactly the batches it would have seen.
"""

import torch

from tasks.core.model import autocast_context, causal_loss


def split_held_out(data: bytes, fraction: float = 0.05) -> tuple[bytes, bytes]:
    """Return (train, held_out); the held-out part is the tail, so every learner agrees on it."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"held-out fraction must be between 0 and 1 (exclusive), got {fraction}")
    cut = len(data) - int(len(data) * fraction)
    if cut == len(data) or cut == 0:
        raise ValueError(f"cannot hold out {fraction} of {len(data)} bytes: one side would be empty; use more data")
    return data[:cut], data[cut:]


def shard(data: bytes, index: int, count: int, *, block_size: int = 128) -> bytes:
    """The index-th of count contiguous, disjoint shards that together cover all of data."""
    if count < 1:
        raise ValueError(f"shard count must be at least 1, got {count}")
    if not 0 <= index < count:
        raise ValueError(f"shard index {index} is out of range for {count} shards (0..{count - 1})")
    start, end = len(data) * index // count, len(data) * (index + 1) // count
    if end - start < 2 * block_size:
        raise ValueError(
            f"shard {index} of {count} would hold {end - start} bytes, shorter than 2 blocks of "
            f"{block_size}; use fewer shards or more data"
        )
    return data[start:end]


class BatchSampler:
    """Random windows of block_size + 1 bytes; y is x shifted left by one byte."""

    def __init__(self, data: bytes, batch_size: int, block_size: int, seed: int):
        if batch_size < 1 or block_size < 1:
            raise ValueError(f"batch_size and block_size must be positive, got {batch_size}, {block_size}")
        if len(data) < block_size + 1:
            raise ValueError(f"{len(data)} bytes cannot fill one block of {block_size} + 1 bytes")
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.batch_size = batch_size
        self.block_size = block_size
        self.generator = torch.Generator().manual_seed(seed)
        self.draws = 0
        self._window = torch.arange(block_size + 1)

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.data) - self.block_size, (self.batch_size,), generator=self.generator)
        windows = self.data[starts[:, None] + self._window].long()
        self.draws += 1
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"generator": self.generator.get_state(), "draws": torch.tensor(self.draws)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.generator.set_state(state["generator"].to(torch.uint8).contiguous())
        self.draws = int(state["draws"])


def eval_batches(
    data: bytes, batch_size: int, block_size: int, n_batches: int, seed: int = 0
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
