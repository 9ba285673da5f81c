"""What the synchronizer knows when an outer round opens, read from the global bucket alone.

Everything here is derived from the manifest chain — which deltas are consumed, each learner's
recent phase times, the current model and momentum — never from listings or local memory, so a
second synchronizer or a retried flow run reaches the same view.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from itertools import count
from pathlib import Path

import torch

from islands.core.compress import RESIDUAL_PREFIX
from islands.core.config import RunConfig
from islands.core.data import Stream, eval_batches
from islands.core.quorum import HISTORY, LearnerHistory, history_of
from islands.storage.corpus import held_out_part
from islands.storage.manifest import Manifest
from islands.storage.model_files import step_tokens
from islands.storage.rounds import SpooledTensors, chunks_of, numel_of, read_chain, spool_tensors
from islands.storage.spool import OwnedFolder, remove_dead, spool_prefix
from islands.storage.store import Stores

_CHAINS: dict[tuple[str, str], list[tuple[Manifest, str]]] = {}  # checked chains this process has read
_READS = count()  # parent files get names of their own: a reload spools them afresh beside the old


@lru_cache(maxsize=2)
def held_out_batches(
    corpus: str,
    batch_size: int,
    block_size: int,
    n: int,
    *,
    eval_corpus: str | None = None,
    tokenizer: str | None = None,
    vocab_size: int | None = None,
) -> list:
    """The `n` batches every round is evaluated on, from the held-out split's first chunk onwards."""
    reader, segments = held_out_part(corpus, eval_corpus, tokenizer)
    return eval_batches(Stream(reader, segments, block_size + 1, vocab_size), batch_size, block_size, n, seed=0)


@dataclass
class RoundState:
    config: RunConfig
    run: str
    round: int  # the round this synchronizer is about to publish
    stores: Stores
    chain: list[tuple[Manifest, str]]
    # θ of the parent round and its outer momentum: spooled to local files by `load` and read a
    # chunk at a time (SpooledTensors), or tensors in memory; the merge leaves both as they are.
    model: Mapping[str, torch.Tensor]
    momentum: Mapping[str, torch.Tensor] | None
    residual: Mapping[str, torch.Tensor] = field(default_factory=dict)  # what the update codec dropped so far

    @classmethod
    def load(cls, config: RunConfig, run: str, stores: Stores) -> RoundState:
        key = (stores.global_.url, run)
        chain = _CHAINS[key] = read_chain(stores.global_, run, _CHAINS.get(key))
        if not chain:
            raise RuntimeError(f"run {run} has no round 0 in {stores.global_.url}")
        state = cls(config, run, chain[-1][0].round + 1, stores, chain, {}, None)
        state.read_parent()
        return state

    def read_parent(self) -> None:
        """θ_{r−1}, its momentum and residual copied from the global bucket to this round's spool,
        their sha256 checked; nothing of them is held in memory."""
        parent, n = self.chain[-1][0], next(_READS)
        for old in (self.model, self.momentum):
            if isinstance(old, SpooledTensors):
                old.file.path.unlink(missing_ok=True)  # read again: the files before go
        try:
            self.model = SpooledTensors(
                spool_tensors(self.stores.global_, parent.model, self.spool_dir / f"parent-model-{n}.safetensors")
            )
            if parent.outer:
                outer = spool_tensors(
                    self.stores.global_, parent.outer, self.spool_dir / f"parent-outer-{n}.safetensors"
                )
                self.momentum = SpooledTensors(outer, skip=RESIDUAL_PREFIX)
                self.residual = SpooledTensors(outer, prefix=RESIDUAL_PREFIX)
            else:
                self.momentum, self.residual = None, {}
        except BaseException:
            self.drop_spool()
            raise

    @property
    def chunk_values(self) -> int:
        """float32 values the merge and the checks read of each tensor at a time (synchronizer.chunk_mb)."""
        return self.config.synchronizer.chunk_mb * 2**20 // 4

    @cached_property
    def spool(self) -> OwnedFolder:
        """Where this round's deltas wait between collect and merge; fresh for every process and
        every try, so a spooled file is never trusted beyond the process that read it. Spools that
        synchronizers of this run left when they were killed are removed first."""
        remove_dead(spool_prefix(self.run))
        return OwnedFolder(spool_prefix(self.run, self.round))

    @property
    def spool_dir(self) -> Path:
        return self.spool.path

    def drop_spool(self) -> None:
        if "spool" in self.__dict__:
            self.__dict__.pop("spool").remove()

    @property
    def parent(self) -> tuple[Manifest, str]:
        return self.chain[-1]

    @cached_property
    def consumed(self) -> set[tuple[str, str]]:
        return set().union(*(m.consumed() for m, _ in self.chain))

    @cached_property
    def consumed_shas(self) -> dict[str, str]:
        """sha256 → key of every delta already merged, for spotting re-submitted copies."""
        return {c.sha256: c.key for m, _ in self.chain for c in m.contributions}

    @cached_property
    def consumed_bodies(self) -> dict[str, str]:
        """body_sha256 → key of every delta already merged, quarantined or dropped whose tensor
        bytes read as such: the same tensors under a new key (a new phase number) are not taken
        again, whatever metadata they come with."""
        bodies: dict[str, str] = {}
        for m, _ in self.chain:
            for item in [*m.contributions, *m.excluded]:
                if item.body_sha256 is not None:
                    bodies.setdefault(item.body_sha256, item.key)
        return bodies

    def history(self) -> dict[str, LearnerHistory]:
        """Each learner's recent phase times, last arrival and time between arrivals, from the
        manifests; arrivals on the synchronizer's clock (when it saw a delta) where they say it."""
        merged: dict[str, list] = defaultdict(list)
        for manifest, _ in self.chain:
            for c in manifest.contributions:
                merged[c.learner].append(c)
        return {learner: history_of(merged.get(learner, [])) for learner, _, _ in self.config.learners()}

    def recent_norms(self) -> list[float]:
        """Norms of the deltas merged in the last HISTORY rounds (merge.norm_limit compares with them)."""
        return [c.norm for m, _ in self.chain[-HISTORY:] for c in m.contributions if c.norm is not None]

    @cached_property
    def model_norm(self) -> float:
        """‖θ_{r−1}‖, taken before the merge turns θ into θ_r (merge.norm_limit)."""
        return math.sqrt(
            sum(
                float(chunk.double().pow(2).sum())
                for name in self.model
                for chunk in chunks_of(self.model, name, self.chunk_values)
            )
        )

    @cached_property
    def step_tokens(self) -> int:
        return step_tokens(self.config)

    def reload(self) -> None:
        """θ_{r−1}, its momentum and residual read again from storage (after a merge that failed
        part way through them)."""
        self.read_parent()
        self.__dict__.pop("model_norm", None)

    def max_delta_bytes(self) -> int:
        """Largest acceptable delta object: the model in fp32 plus a generous header."""
        return sum(numel_of(self.model, name) * 4 for name in self.model) + 1_000_000
