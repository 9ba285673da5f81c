"""A byte-level decoder-only transformer, small enough to train on a laptop CPU.

Bytes are the vocabulary (256 tokens), so any text trains without a tokenizer. The input and output
embeddings are separate tensors: weight tying would make two state-dict keys share storage, which
safetensors refuses to write.
"""

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(block_size=128, n_layer=4, n_head=4, n_embd=128),
    "small": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd {config.n_embd} is not divisible by n_head {config.n_head}")
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Output(NamedTuple):
    """What GPT.forward returns: unpacks as (logits, loss), and has `.loss` as transformers'
    outputs do, so `loss_of` reads every model the same way."""

    logits: torch.Tensor
    loss: torch.Tensor | None


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2: scale the projections into the residual stream by depth so its variance stays put.
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Output:
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return Output(logits, None)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return Output(logits, loss)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(preset: str, seed: int) -> GPT:
    """Same preset and seed give bit-identical weights; the global RNG is left as it was."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid presets: {', '.join(sorted(PRESETS))}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(PRESETS[preset])


def skeleton(config: GPTConfig) -> GPT:
    """A GPT of `config`'s shapes without weights (meta tensors), for a θ to be assigned to it
    (load_state_dict(assign=True)) without a copy."""
    return copy.deepcopy(_meta_gpt(config))


@lru_cache(maxsize=4)
def _meta_gpt(config: GPTConfig) -> GPT:
    """Built on the CPU once and emptied: built on the meta device, its initialisation would run
    nn.init.normal_'s Python reference, whose first call imports torch._dynamo: a second of CPU on the
    way from a run's start to its first evaluation, spent for nothing."""
    with torch.random.fork_rng(devices=[]):
        return GPT(config).to_empty(device="meta")


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A model's weights as plain tensors of their own (`params_of(build_model(...))` is round 0)."""
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def loss_of(output) -> torch.Tensor:
    """The training loss from what a model's forward(input_ids, labels) returned: the scalar
    itself, or an object holding it as `.loss` (GPT's Output, transformers' outputs)."""
    loss = output if isinstance(output, torch.Tensor) else getattr(output, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(
            f"the model's forward(input_ids, labels) returned {type(output).__name__}, "
            "not a scalar loss or an object with a scalar .loss"
        )
    return loss


def autocast_context(device: torch.device):
    """bf16 autocast on CUDA; on CPU, full float32 (bf16 matmuls are slow there and change results)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return nullcontext()
