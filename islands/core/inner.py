"""A learner's inner loop: H AdamW steps from a published checkpoint, returned as a pseudo-gradient.

The AdamW state, the step count and the data position live across phases and are never reset
(DiLoCo, arXiv 2311.08105, keeps the inner optimizer local); state_dict() lets them survive a restart bit for bit.

Inside a region with several GPUs the trainer runs as one torch.distributed job (`parallel="ddp"`
or `"fsdp"`, one process per GPU under torchrun): every rank draws the same batch and trains on its
own slice of it, the gradients are averaged (DDP's all-reduce, or FSDP2's reduce-scatter onto each
rank's shard), so the ranks together hold the weights and optimizer state one process training on
the whole batch would.

On CUDA a step runs under bf16 autocast with float32 master weights and fused AdamW; a batch is
split into micro-batches whose gradients accumulate, so the global batch is the same on any GPU.
"""

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.nn.parallel import DistributedDataParallel

from islands.core.config import InnerSettings
from islands.core.data import BatchSampler
from islands.core.model import autocast_context, causal_loss, load_params, synced


class OutOfMemory(RuntimeError):
    """A step did not fit the GPU's memory; the message names the setting to lower."""


def _rank(batch_size: int, parallel: str) -> tuple[int, int]:
    """(rank, world size) of the initialized process group; each rank takes an equal batch slice."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            f"InnerTrainer(parallel={parallel!r}) needs torch.distributed initialized first: launch with torchrun"
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    if batch_size % world:
        raise ValueError(f"batch_size {batch_size} does not split evenly over {world} ranks; use a multiple of {world}")
    return rank, world


def blocks(model: nn.Module) -> list[nn.Module]:
    """A transformer's blocks: the items of its outermost nn.ModuleLists (GPT's `blocks`, a
    Hugging Face model's `layers`), the units that are checkpointed and sharded one by one."""
    lists: list[str] = []
    found: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not any(name.startswith(f"{outer}.") for outer in lists):
            lists.append(name)
            found.extend(module)
    return found


def checkpoint_activations(model: nn.Module) -> None:
    """Recompute each block's activations in the backward pass: a Hugging Face model's own
    activation_checkpointing_enable() (on the model or the module it wraps), else torch's
    composable checkpoint on every block (parameter names stay as they were, so state dicts and
    deltas do not change)."""
    hf = next((m for m in model.modules() if hasattr(m, "activation_checkpointing_enable")), None)
    if hf is not None:
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        return
    found = blocks(model)
    if not found:
        raise ValueError(
            "inner.activation_checkpointing: the model has neither activation_checkpointing_enable() nor an "
            "nn.ModuleList of blocks to checkpoint; set it to false"
        )
    for block in found:
        checkpoint(block)


class OnHost(Mapping):
    """Tensors copied device→host on a side stream into pinned buffers: the default stream (the
    next step) never waits for the copy, and the host waits for it only when it first reads one."""

    def __init__(self, tensors: dict[str, torch.Tensor], done: torch.cuda.Event | None = None):
        self._tensors, self._done = tensors, done

    def _ready(self) -> dict[str, torch.Tensor]:
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._ready()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ready())

    def __len__(self) -> int:
        return len(self._tensors)


def to_host(
    tensors: dict[str, torch.Tensor], stream: torch.cuda.Stream | None, copy: bool = True
) -> Mapping[str, torch.Tensor]:
    """CPU copies of `tensors` (each its own contiguous storage, as safetensors wants); from CUDA,
    non-blocking copies on `stream` (OnHost). `copy=False`: tensors already on the CPU and owned
    by the caller alone stay as they are (no second copy of a model's size)."""
    if stream is None:
        return {k: v.detach().to("cpu", copy=copy).contiguous() for k, v in tensors.items()}
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    out = {}
    with torch.cuda.stream(stream):
        for key, value in tensors.items():
            out[key] = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
            out[key].copy_(value.detach(), non_blocking=True)
            value.record_stream(stream)  # its memory is not reused before the copy is done
    return OnHost(out, stream.record_event())


def lr_at(step: int, cfg: InnerSettings) -> float:
    """Linear warmup to lr over warmup_steps, cosine down to min_lr_ratio·lr at total_steps, then flat."""
    min_lr = cfg.min_lr_ratio * cfg.lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.total_steps:
        return min_lr
    progress = (step - cfg.warmup_steps) / (cfg.total_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - min_lr)


class Carried(Mapping[str, torch.Tensor]):
    """θ with the progress of `deltas` (each base − local) applied, made a tensor at a time when
    asked, to the same bits each time: where a learner whose deltas θ does not hold yet stands,
    without a model's size of its own beside θ (the round the learner holds anyway)."""

    def __init__(self, params: Mapping[str, torch.Tensor], deltas: list[Mapping[str, torch.Tensor]]):
        self.params, self.deltas = params, deltas

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.params[name] - sum(d[name] for d in self.deltas)

    def __iter__(self) -> Iterator[str]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)


def carried(params: Mapping[str, torch.Tensor], deltas: list[Mapping[str, torch.Tensor]]) -> Mapping[str, torch.Tensor]:
    """θ itself when there are no deltas, else θ with their progress applied (Carried). The
    deltas and θ must not change while it is in use: it reads them again at every look."""
    return Carried(params, deltas) if deltas else params


@dataclass
class PhaseResult:
    delta: dict[str, torch.Tensor]  # float32, base − local: the pseudo-gradient, DiLoCo's sign
    steps: int
    tokens: int
    loss: float  # mean training loss over the phase; nan when no step ran
    seconds: float
    losses: list[float]
    rebased_at: list[int] = field(default_factory=list)  # steps done before each rebase


class InnerTrainer:
    def __init__(
        self,
        model: torch.nn.Module,
        sampler: BatchSampler,
        cfg: InnerSettings,
        device: torch.device = torch.device("cpu"),
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
        parallel: str | None = None,
    ):
        if parallel not in (None, "ddp", "fsdp"):
            raise ValueError(f"parallel must be None, 'ddp' or 'fsdp', got {parallel!r}")
        self.model = model.to(device)
        self.parallel = parallel
        self.rank, self.world_size = _rank(sampler.batch_size, parallel) if parallel else (0, 1)
        self.micro_batch = cfg.micro_batch_size or sampler.batch_size // self.world_size
        if (sampler.batch_size // self.world_size) % self.micro_batch:
            raise ValueError(
                f"inner.micro_batch_size: {self.micro_batch} does not divide the {sampler.batch_size // self.world_size} "
                f"sequences of each of the {self.world_size} ranks; use a divisor of it"
            )
        if cfg.activation_checkpointing:
            checkpoint_activations(self.model)
        # The module that trains: DDP all-reduces its gradients; FSDP2 shards self.model in place
        # (its parameters become DTensors under the same names). self.model is the model itself.
        self.ddp = None
        if parallel == "ddp":
            self.ddp = DistributedDataParallel(self.model, device_ids=[device.index] if device.type == "cuda" else None)
        elif parallel == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in blocks(self.model):
                fully_shard(block)
            fully_shard(self.model)
        self.net = self.model if self.ddp is None else self.ddp
        if cfg.compile:
            self.net = torch.compile(self.net)
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.sampler = sampler
        self.cfg = cfg
        self.device = device
        self.clock = clock
        self.sleep = sleep
        self.step = 0
        self.lr_offset = 0  # catch_up's lead (or lag) of the schedule against the steps trained
        # Frozen and integer parameters are not trained; found once, as the model will not change.
        self.named = named = synced(model)
        # Weight decay on matrices and embeddings only, not on LayerNorm gains (nanoGPT).
        decay = [(n, p) for n, p in named if p.dim() >= 2]
        no_decay = [(n, p) for n, p in named if p.dim() < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": [p for _, p in decay], "weight_decay": cfg.weight_decay},
                {"params": [p for _, p in no_decay], "weight_decay": 0.0},
            ],
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            fused=device.type == "cuda",  # one kernel for all parameters; the CPU keeps the loop
        )
        # Names in the optimizer's own parameter order, which its state_dict numbers from 0.
        self._opt_names = [n for n, _ in decay + no_decay]

    def run_phase(
        self,
        base: Mapping[str, torch.Tensor],
        steps: int,
        slowdown: float = 1.0,
        min_step_s: float = 0.0,
        on_step: Callable[[int, float], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
        rebase: Callable[[], Mapping[str, torch.Tensor] | None] | None = None,
    ) -> PhaseResult:
        """Train `steps` inner steps from base and return base − local.

        slowdown > 1 stands in for a slower region: after each step the trainer sleeps
        (slowdown − 1) × that step's compute time. min_step_s caps the rate instead: the n-th step
        of the phase does not end before n × min_step_s after the phase began, so a step that
        took longer than the floor (CPU taken by other processes, a late wake-up, a rebase) is
        made up by the shorter waits after it, and the learner loses rate only once that CPU
        eats the whole headroom (with both, the longer wait).
        on_step gets (total inner steps so far, loss).
        should_stop is asked before each step; the result then covers only the steps done.
        rebase is asked before each step too: when it returns a newer global model, the outer
        update (newer − base) is added to the local weights and the phase goes on from there, so
        the delta is measured against the newer model instead of arriving stale.
        """
        if steps < 0:
            raise ValueError(f"steps must be >= 0, got {steps}")
        if slowdown < 1.0:
            raise ValueError(f"slowdown must be >= 1 (1 is full speed), got {slowdown}")
        if not min_step_s >= 0:
            raise ValueError(f"min_step_s must be seconds >= 0, got {min_step_s}")
        self.begin(base)
        losses: list[float] = []
        rebased_at: list[int] = []
        started = self.clock()
        for _ in range(steps):
            if should_stop is not None and should_stop():
                break
            if rebase is not None and (newer := rebase()) is not None:
                self.shift(base, newer)
                base = newer
                rebased_at.append(len(losses))
            step_started = self.clock()
            loss = self.train_step()
            step_ended = self.clock()
            losses.append(loss)
            if on_step is not None:
                on_step(self.step, loss)
            wait = max((slowdown - 1.0) * (step_ended - step_started), started + len(losses) * min_step_s - step_ended)
            if wait > 0:
                self.sleep(wait)
        seconds = self.clock() - started
        delta = self.delta(base)
        return PhaseResult(
            delta=delta,
            steps=len(losses),
            tokens=len(losses) * self.sampler.tokens_per_batch,
            loss=sum(losses) / len(losses) if losses else math.nan,
            seconds=seconds,
            losses=losses,
            rebased_at=rebased_at,
        )

    def catch_up(self, tokens_applied: int, learners: int) -> None:
        """Put the learning-rate schedule at the run's average step (tokens applied over
        `learners` learners), ahead of or behind this learner's own steps: a slow learner whose
        peers are further along anneals with them instead of sending high-rate deltas late, and
        a fast one, which trains more than its share of the budget, does not anneal early. `step`
        keeps counting the steps trained (the token ledger reads it); only the schedule moves,
        and the caller sets it again each phase (it is not part of the saved state)."""
        self.lr_offset = tokens_applied // (learners * self.sampler.tokens_per_batch) - self.step

    @property
    def schedule_step(self) -> int:
        """Where the learning-rate schedule stands: steps trained, moved by any catch-up."""
        return self.step + self.lr_offset

    def begin(self, base: Mapping[str, torch.Tensor]) -> None:
        """Load `base` as the local weights: a phase starts here."""
        if self.parallel == "fsdp":
            with torch.no_grad():
                for name, p in self.named:
                    p.copy_(self._like(base[name], p))
        else:
            load_params(self.model, base)
        self.model.train()

    @torch.no_grad()
    def delta(self, base: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """base − local weights in float32 on the CPU: the phase's pseudo-gradient so far."""
        diffs = {name: base[name].to(p.device, torch.float32) - self._full(p).float() for name, p in self.named}
        return to_host(diffs, self.copy_stream, copy=False)

    @torch.no_grad()
    def shift(self, base: Mapping[str, torch.Tensor], newer: Mapping[str, torch.Tensor]) -> None:
        """Local weights += newer − base: the phase's progress so far, carried onto `newer`."""
        for name, p in self.named:
            p.add_(self._like(newer[name].float() - base[name].float(), p))

    def train_step(self) -> float:
        """One AdamW step on the next batch, at the schedule's learning rate; returns its loss."""
        lr = lr_at(self.schedule_step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        x, y = self.sampler.next_batch()
        if self.world_size > 1:
            x, y = x.chunk(self.world_size)[self.rank], y.chunk(self.world_size)[self.rank]
        try:
            loss = self._accumulate(x.to(self.device), y.to(self.device))
            if self.cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_([p for _, p in self.named], self.cfg.grad_clip)
            self.optimizer.step()
            # Gradients live through a step only: between steps (while the follower fetches a
            # round, a rebase shifts the weights, a phase's delta is made) they are a model's size
            # held for nothing.
            self.optimizer.zero_grad(set_to_none=True)
        except torch.cuda.OutOfMemoryError:
            raise OutOfMemory(
                f"inner.micro_batch_size: {self.micro_batch} sequences per forward/backward ran the {self.device} out "
                f"of memory; lower inner.micro_batch_size (a divisor of batch_size {self.sampler.batch_size}, which stays "
                "the global batch) or set inner.activation_checkpointing = true"
            ) from None
        self.step += 1
        if self.world_size > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)  # the loss of the whole batch: the mean of the ranks' equal slices
            loss /= self.world_size
        return loss.item()  # also waits for the device, so the step's compute time is real

    # FSDP2's modules are imported only where a job shards: they add seconds to every learner's start.
    def _full(self, p: torch.Tensor) -> torch.Tensor:
        """A parameter (or its optimizer moment) whole: FSDP2 holds only this rank's shard of it."""
        if self.parallel == "fsdp":
            from torch.distributed.tensor import DTensor

            if isinstance(p, DTensor):
                return p.full_tensor()
        return p

    def _like(self, full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """`full` placed as `p` is: this rank's shard of it under FSDP2, else on p's device."""
        if self.parallel == "fsdp":
            from torch.distributed.tensor import DTensor, distribute_tensor

            if isinstance(p, DTensor):
                return distribute_tensor(full.to(p.device, p.dtype), p.device_mesh, p.placements)
        return full.to(p.device, p.dtype)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over x's micro-batches, each loss scaled by its share of x, so the
        summed gradients are the whole slice's; ranks synchronize gradients on the last one only.
        Returns the slice's mean loss."""
        self.optimizer.zero_grad(set_to_none=True)
        parts = list(zip(x.split(self.micro_batch), y.split(self.micro_batch)))
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(parts):
            last = i == len(parts) - 1
            if self.parallel == "fsdp":
                self.model.set_requires_gradient_sync(last)
            with self.ddp.no_sync() if self.ddp is not None and not last else nullcontext():
                with autocast_context(self.device):
                    loss = causal_loss(self.model, xm, ym, self.net) / len(parts)
                loss.backward()
            total += loss.detach().float()
        return total

    def state_items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """`state_dict()`'s entries one at a time, each copied to the host only when it is asked
        for: a writer that stores each before asking for the next holds one tensor, not the
        optimizer's two moments. The trainer must not step until the last one is taken."""
        params = dict(self.model.named_parameters())
        opt_step = 0
        for name in self._opt_names:
            slot = self.optimizer.state.get(params[name], {})
            if "step" in slot:
                opt_step = int(slot["step"])
        for name in self._opt_names:
            slot = self.optimizer.state.get(params[name], {})
            for key in ("exp_avg", "exp_avg_sq"):
                moment = (
                    self._full(slot[key]) if key in slot else torch.zeros(params[name].shape, dtype=params[name].dtype)
                )
                yield f"opt.{key}.{name}", moment.detach().to("cpu", copy=True).contiguous()
        yield "opt.step", torch.tensor(opt_step, dtype=torch.int64)
        yield "trainer.step", torch.tensor(self.step, dtype=torch.int64)
        for key, value in self.sampler.state_dict().items():
            yield f"sampler.{key}", value.detach().to("cpu", copy=True).contiguous()

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat, CPU, contiguous tensors with no shared storage: ready for safetensors."""
        params = dict(self.model.named_parameters())
        state: dict[str, torch.Tensor] = {}
        opt_step = 0
        for name in self._opt_names:
            slot = self.optimizer.state.get(params[name], {})
            for key in ("exp_avg", "exp_avg_sq"):
                state[f"opt.{key}.{name}"] = self._full(slot[key] if key in slot else torch.zeros_like(params[name]))
            if "step" in slot:
                opt_step = int(slot["step"])
        state = dict(to_host(state, self.copy_stream))
        state["opt.step"] = torch.tensor(opt_step, dtype=torch.int64)
        state["trainer.step"] = torch.tensor(self.step, dtype=torch.int64)
        for key, value in self.sampler.state_dict().items():
            state[f"sampler.{key}"] = value.detach().to("cpu", copy=True).contiguous()
        return state

    def load_state_dict(self, state: dict[str, torch.Tensor], own: bool = False) -> None:
        """Restore a saved state. `own`: the tensors were made for this call alone (read from a
        file) and become the optimizer's moments as they are, with no second copy."""
        expected = self._state_keys()
        missing, unexpected = expected - set(state), set(state) - expected
        if missing or unexpected:
            raise ValueError(
                f"inner trainer state does not match this model: missing {sorted(missing)[:5]}, "
                f"unexpected {sorted(unexpected)[:5]}; was it saved with another model preset?"
            )
        params = dict(self.model.named_parameters())
        for name in self._opt_names:
            saved = state[f"opt.exp_avg.{name}"].shape
            if saved != params[name].shape:  # a DTensor's shape is the whole parameter's
                raise ValueError(
                    f"inner trainer state for {name} has shape {tuple(saved)}, the model has "
                    f"{tuple(params[name].shape)}; was it saved with another model preset?"
                )
        opt_step = int(state["opt.step"])
        current = self.optimizer.state_dict()
        opt_state = {}
        if opt_step > 0:
            # AdamW keeps its step as a float32 scalar; a fresh optimizer (step 0) has no state at all.
            # Clones, so training never writes into the caller's tensors (unless they are its own).
            def moment(key: str, name: str) -> torch.Tensor:
                placed = self._like(state[key], params[name])
                return placed if own else placed.clone()

            opt_state = {
                index: {
                    "step": torch.tensor(float(opt_step), dtype=torch.float32),
                    "exp_avg": moment(f"opt.exp_avg.{name}", name),
                    "exp_avg_sq": moment(f"opt.exp_avg_sq.{name}", name),
                }
                for index, name in enumerate(self._opt_names)
            }
        self.optimizer.load_state_dict({"state": opt_state, "param_groups": current["param_groups"]})
        self.step = int(state["trainer.step"])
        self.sampler.load_state_dict(
            {key.removeprefix("sampler."): value for key, value in state.items() if key.startswith("sampler.")}
        )

    def _state_keys(self) -> set[str]:
        keys = {f"opt.{key}.{name}" for key in ("exp_avg", "exp_avg_sq") for name in self._opt_names}
        keys |= {"opt.step", "trainer.step"}
        return keys | {f"sampler.{key}" for key in self.sampler.state_dict()}
