"""The models a run trains, all built by `build_model(spec, seed)`:

- `tiny`, `small`: a byte-level decoder-only transformer, small enough to train on a laptop CPU.
  Bytes are the vocabulary (256 tokens), so any text trains without a tokenizer.
- a Hugging Face model folder or its `config.json` (a local path here; `storage.model_files`
  brings an `s3://` one to local disk first): `AutoModelForCausalLM.from_config` under the run's
  seed, or `from_pretrained` when the folder holds weights (continued pre-training, as DiLoCo,
  arXiv 2311.08105, starts from a pre-trained checkpoint). Nothing of the folder runs: transformers
  is told `trust_remote_code=False`, a folder asking for code of its own (`auto_map`, an unknown
  `model_type`) is refused by name (`asks_for_code`), and weights are read from safetensors
  only, never unpickled (`pickled_weights`).
- `python:package.module:function`: a factory returning any `torch.nn.Module` whose
  `forward(input_ids, labels)` returns the loss or an object with `.loss`. The module, or its
  `.config`, names its vocabulary as `vocab_size` and its context as `block_size` (or
  `max_position_embeddings`), which `vocab_and_context` reads.

What is synced is a model's float parameters that require grad (`synced`), each once: tied
weights (an HF model's input embedding and output head) are one parameter under its first name, so
a checkpoint, delta or update stores it once (safetensors refuses shared storage) and the merge
takes it once; `load_params` and `assign_params` tie it again. Buffers are rebuilt with the model.
"""

import copy
import importlib
import json
import math
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
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


class ModelError(ValueError):
    """A `model` that cannot be built, phrased as one line naming the field and what to do."""


FACTORY = "python:"
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# Files torch would unpickle: a folder holding them and no safetensors is refused, never loaded.
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# The files of a Hugging Face folder in which it can ask transformers to import code it ships.
CODE_FIELDS_IN = ("config.json", "tokenizer_config.json")


def asks_for_code(name: str, raw: bytes) -> str | None:
    """What in `name` (config.json or tokenizer_config.json of a Hugging Face folder, its bytes
    `raw`) would have transformers import code the folder ships, as "FILE: FIELD", or None: an
    `auto_map`, or a config's `model_type` transformers does not know (only remote code builds
    one). A file that is no JSON object asks for nothing; its parser refuses it later."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    if "auto_map" in data:
        return f"{name}: auto_map"
    kind = data.get("model_type")
    if name == "config.json" and kind is not None:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

        if not isinstance(kind, str) or kind not in CONFIG_MAPPING_NAMES:
            return f"{name}: model_type {kind!r} is not one transformers knows"
    return None


def refuse_code(folder: Path) -> None:
    """Raise ModelError when the local model folder asks for code of its own (`asks_for_code`)."""
    for name in CODE_FIELDS_IN:
        path = folder / name
        if path.is_file() and (why := asks_for_code(name, path.read_bytes())):
            raise ModelError(
                f"model: {folder} asks to run code it ships ({why}); islands runs no code from model folders: "
                "use a model_type transformers knows, or a python:package.module:function factory"
            )


def pickled_weights(folder: Path) -> list[str]:
    """The files of `folder` that loading it would unpickle: its pickle files (`PICKLES`) when it
    holds no safetensors (which are loaded instead, when it does)."""
    files = [p for p in folder.iterdir() if p.is_file()]
    if any(p.name.endswith((".safetensors", ".safetensors.index.json")) for p in files):
        return []
    return sorted(p.name for p in files if p.name.endswith(PICKLES))


def build_model(spec: str, seed: int) -> nn.Module:
    """The model `spec` names (a preset, a local HF folder or config.json, or a python: factory).
    The same spec and seed give bit-identical weights; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec in PRESETS:
            return GPT(PRESETS[spec])
        if spec.startswith(FACTORY):
            return _from_factory(spec)
        return _from_hf(spec)


def hf_folder(spec: str) -> tuple[Path, bool]:
    """(the folder of an HF `spec`, whether its weights are to be loaded): a folder's weights are,
    when it has them; a config.json alone is built from the seed."""
    path = Path(spec.removeprefix("file://"))
    if path.name == "config.json":
        if not path.is_file():
            raise ModelError(
                f"model: {spec} does not exist; give a preset (tiny, small), a model folder or its config.json"
            )
        return path.parent, False
    if not (path / "config.json").is_file():
        raise ModelError(
            f"model: {spec} is neither a preset ({', '.join(sorted(PRESETS))}), a python: factory, "
            "nor a folder with a config.json; give one of those"
        )
    if pickles := pickled_weights(path):
        raise ModelError(
            f"model: {path} holds pickle weights ({', '.join(pickles[:3])}) and no safetensors; islands never "
            "unpickles: save them as model.safetensors (transformers' save_pretrained does) or give the config.json alone"
        )
    return path, any((path / name).is_file() for name in WEIGHTS)


def hf_config(spec: str):
    """The transformers config of an HF `spec`, or ModelError saying why it does not parse."""
    from transformers import AutoConfig

    folder, _ = hf_folder(spec)
    refuse_code(folder)
    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, OSError, KeyError, TypeError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelError(
            f"model: {folder / 'config.json'} is not a transformers config ({reason}); fix or replace it"
        ) from exc


def _from_hf(spec: str) -> nn.Module:
    from transformers import AutoModelForCausalLM

    folder, weights = hf_folder(spec)
    config = hf_config(spec)
    try:
        if weights:
            return AutoModelForCausalLM.from_pretrained(
                folder, dtype=torch.float32, trust_remote_code=False, use_safetensors=True
            )
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=False)
    except (ValueError, OSError, KeyError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise ModelError(f"model: {folder} is not a causal language model transformers can build ({reason})") from exc


def factory_of(spec: str):
    """The function a `python:package.module:function` spec names, or ModelError."""
    target = spec.removeprefix(FACTORY)
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ModelError(f"model: {spec!r} must be python:package.module:function, e.g. python:mymodels.gpt:build")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelError(f"model: cannot import {module_name!r} ({exc}); install it or put it on PYTHONPATH") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ModelError(f"model: {module_name} has no function {attr!r}; name the function that returns the model")
    return factory


def _from_factory(spec: str) -> nn.Module:
    model = factory_of(spec)()
    if not isinstance(model, nn.Module):
        raise ModelError(f"model: {spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def check_model(spec: str) -> None:
    """Raise ModelError when `spec` cannot be trained, before a run writes anything: an HF config
    must parse and name a causal LM transformers builds (built without memory, on the meta device);
    a factory's model must return a scalar loss from forward(input_ids, labels) on one short batch."""
    if spec in PRESETS:
        return
    if not spec.startswith(FACTORY):
        from transformers import AutoModelForCausalLM

        config = hf_config(spec)
        try:
            with torch.device("meta"):
                AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        except (ValueError, KeyError) as exc:
            reason = " ".join(str(exc).split())[:200]
            raise ModelError(f"model: {spec} is not a causal language model transformers can build ({reason})") from exc
        return
    model = build_model(spec, 0)
    try:
        vocab, context = vocab_and_context(model)
    except ModelError as exc:
        raise ModelError(f"model: {spec}: {exc}") from exc
    ids = torch.zeros(1, min(8, context), dtype=torch.long)
    try:
        loss = causal_loss(model, ids, ids)
    except TypeError as exc:
        raise ModelError(f"model: {spec}: {exc}; make forward return the loss") from exc
    except Exception as exc:  # noqa: BLE001 - any failure of user code is the model's problem
        raise ModelError(f"model: {spec}: forward(input_ids, labels) failed ({type(exc).__name__}: {exc})") from exc
    if not loss.is_floating_point():
        raise ModelError(f"model: {spec}: forward returned a {loss.dtype} loss; return a float scalar")


def vocab_and_context(model: nn.Module) -> tuple[int, int]:
    """(vocabulary size, context length) of a model: from its `.config` (GPT's vocab_size and
    block_size, an HF config's vocab_size and max_position_embeddings) or, for a factory's
    module, from those attributes on the module itself."""
    return _shape(getattr(model, "config", None), model, name=type(model).__name__)


def spec_vocab_and_context(spec: str, seed: int) -> tuple[int, int]:
    """`vocab_and_context` of the model `spec` names, read from its config where it has one (a
    preset, an HF config), so that checking a corpus or bounding token claims builds no weights;
    a factory's module is built (as a skeleton) to be asked."""
    if spec in PRESETS:
        return _shape(PRESETS[spec], name=spec)
    if not spec.startswith(FACTORY):
        return _shape(hf_config(spec), name=spec)
    return vocab_and_context(skeleton(spec, seed))


def _shape(*sources, name: str) -> tuple[int, int]:
    for source in sources:
        vocab = getattr(source, "vocab_size", None)
        context = getattr(source, "block_size", None) or getattr(source, "max_position_embeddings", None)
        if isinstance(vocab, int) and isinstance(context, int):
            return vocab, context
    raise ModelError(
        f"{name} names no vocab_size and block_size (or max_position_embeddings); set them on the module or its .config"
    )


def synced(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a run syncs: float ones that require grad, each once (a tied weight under
    its first name). Frozen and integer parameters stay as the model was built."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]


def params_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's synced weights as plain tensors of their own, unchanged by its training after."""
    return {k: v.detach().clone() for k, v in synced(model)}


def own_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """A model's synced weights as tensors sharing its memory: θ without a copy, for a model
    nobody trains afterwards (`own_params(build_model(...))` is round 0, in 1× its bytes)."""
    return {k: v.detach() for k, v in synced(model)}


def _check_names(model: nn.Module, params: dict[str, torch.Tensor]) -> dict[str, nn.Parameter]:
    own = dict(synced(model))
    if set(own) != set(params):
        missing, unexpected = sorted(set(own) - set(params)), sorted(set(params) - set(own))
        raise ValueError(f"weights do not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return own


@torch.no_grad()
def load_params(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Copy synced weights into `model` in place (a tied weight is one parameter, so both its
    uses take the value)."""
    for name, p in _check_names(model, params).items():
        p.copy_(params[name])


def assign_params(model: nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Make `params`' tensors the model's own, without a copy, and tie each tied weight again:
    every module attribute that held one parameter holds the one new parameter."""
    own = _check_names(model, params)
    _replace(model, {id(p): nn.Parameter(params[name]) for name, p in own.items()})


def _replace(model: nn.Module, new: dict[int, nn.Parameter]) -> None:
    """Put new[id(p)] wherever the model holds parameter p, under each of its names (ties included)."""
    for qualified, p in model.named_parameters(remove_duplicate=False):
        if id(p) in new:
            owner, _, attr = qualified.rpartition(".")
            setattr(model.get_submodule(owner), attr, new[id(p)])


def skeleton(spec: str, seed: int) -> nn.Module:
    """The model `spec` names with its synced weights left out (meta tensors), for θ to be given
    to it with `assign_params` without a copy; buffers and frozen weights are as built."""
    return copy.deepcopy(_template(spec, seed))


@lru_cache(maxsize=4)
def _template(spec: str, seed: int) -> nn.Module:
    """Built on the CPU once and emptied: built on the meta device, a GPT's initialisation would
    run nn.init.normal_'s Python reference, whose first call imports torch._dynamo: a second of
    CPU on the way from a run's start to its first evaluation, spent for nothing."""
    model = build_model(spec, seed)
    _replace(model, {id(p): nn.Parameter(torch.empty_like(p, device="meta")) for _, p in synced(model)})
    return model


def is_hf(model: nn.Module) -> bool:
    """Whether `model` is a transformers model (whose forward takes labels it shifts itself)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def causal_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, net: nn.Module | None = None) -> torch.Tensor:
    """The next-token loss of `model` on inputs x and targets y (x shifted by one), computed by
    `net` (the module that trains: `model` itself or its DDP wrapper). A transformers model is
    given x alone and its logits scored against y, since its own `labels` would be shifted once
    more; every other model is asked forward(x, y)."""
    net = net or model
    if is_hf(model):
        logits = net(input_ids=x).logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
    return loss_of(net(x, y))


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
