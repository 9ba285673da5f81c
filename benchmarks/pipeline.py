"""The decoupled pipeline itself, driven the way a user drives it: `islands run --config … --json`
against one embedded stack (moto's S3 server, a Prefect API, the learner runner) per process.

A run is read back from storage alone: the manifest chain, and every delta's own metadata
(tokens, finished_at, the learner's I/O counters), so trained, applied and sent figures come
from what crossed the wire, not from the driver's memory.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path

import torch

from benchmarks.heldout import BATCH, CORPUS, EVAL_BATCHES, PRESET
from islands.core.codecs import Codec
from islands.core.config import EMBEDDED_STORE, embedded_buckets, load_config
from islands.storage import layout
from islands.storage.manifest import Manifest, Quorum, RoundSettings
from islands.storage.rounds import get_tensors, object_metadata, put_tensors, read_chain, with_eval_losses
from islands.storage.store import Stores
from islands.tasks.publish import commit

REGIONS = ("us-east", "eu-west", "ap-south", "sa-east")
STORE = EMBEDDED_STORE
_STACK: dict = {}  # the running stack: stack, home, env
_EXIT_HOOKS = False


def stack_env() -> dict[str, str]:
    """Environment of this process's embedded stack, started on first use and stopped at exit
    or by `new_stack`."""
    global _EXIT_HOOKS
    if not _STACK:
        from islands.infra.stack import LocalStack

        home = Path(tempfile.mkdtemp(prefix="islands-bench-"))
        stack = LocalStack(home, embedded_buckets(REGIONS), keep=False).start(record=True)
        if not _EXIT_HOOKS:
            atexit.register(new_stack)
            # SIGTERM (a timeout, `kill`) ends the process through atexit too, so no server is left behind.
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
            _EXIT_HOOKS = True
        _STACK.update(stack=stack, home=home, env={**stack.env(), "ISLANDS_HOME": str(home)})
        os.environ.update(_STACK["env"])
    return _STACK["env"]


def new_stack() -> None:
    """Stop the stack and forget its runs, so the next run starts on a new one. What a stack
    holds grows with every run on it (moto's objects, GBs over a suite, which its listings
    scan; the Prefect server's database; the learner runner's history), so a benchmark part
    that shares no run with the part before it starts on an empty stack, as it would alone."""
    if _STACK:
        _STACK["stack"].stop()
        shutil.rmtree(_STACK["home"], ignore_errors=True)
        _STACK.clear()
        _RUNS.clear()
        # fsspec hands out one S3 file system per set of arguments; those made so far hold the
        # old endpoint's clients.
        from s3fs import S3FileSystem

        S3FileSystem.clear_instance_cache()


@dataclass(frozen=True)
class Spec:
    """One pipeline run; equal specs in one process share the run."""

    name: str
    inner_steps: int
    rounds: int
    seed: int = 0
    codec: Codec = "fp32"
    update_codec: Codec = "bf16"
    speed: tuple[tuple[str, float], ...] = (("eu-west", 1 / 3),)
    min_step_s: tuple[tuple[str, float], ...] = ()
    min_quorum: int = 2
    learner_wait_s: float = 0.0
    rebase: bool = True
    carry: bool = True
    round_timeout_s: float = 600.0
    warmup: int = 50
    total_steps: int = 600
    chaos: tuple[str, ...] = ()
    init: str | None = None  # a name in WARM_STARTS: round 0 is that model instead of the seeded one
    target_loss: float | None = None  # end the run at the first round this good (RunConfig.target_loss)
    token_budget: int | None = None  # end the run once its rounds have merged this many tokens
    eval_every: int = 1  # 0: the synchronizer evaluates the last round only (RunConfig.eval_every)
    eval_batches: int = EVAL_BATCHES  # held-out batches of the synchronizer's evaluations (`eval_batches`)
    model: str = PRESET  # RunConfig.model

    def config(self) -> dict:
        return {
            "run_id": f"b-{self.name}-{hashlib.sha1(repr(self).encode()).hexdigest()[:6]}",
            "regions": list(REGIONS),
            "rounds": self.rounds,
            "inner_steps": self.inner_steps,
            "model": self.model,
            "corpus": CORPUS,
            "seed": self.seed,
            "speed": dict(self.speed),
            "min_step_s": dict(self.min_step_s),
            "codec": self.codec,
            "update_codec": self.update_codec,
            "eval_batches": self.eval_batches,
            "eval_every": self.eval_every,
            "learner_wait_s": self.learner_wait_s,
            "rebase": self.rebase,
            "carry": self.carry,
            "inner": {"batch_size": BATCH, "warmup_steps": self.warmup, "total_steps": self.total_steps},
            "quorum": {"min_quorum": self.min_quorum, "round_timeout_s": self.round_timeout_s},
            **{
                key: value
                for key, value in (("target_loss", self.target_loss), ("token_budget", self.token_budget))
                if value is not None
            },
        }


QUICK_EVAL_BATCHES = 4


def eval_batches(quick: bool) -> int:
    """Held-out batches of the synchronizer's own evaluations: a quarter of EVAL_BATCHES at
    --quick, where the faults runs evaluate every round on its way and the figures judge nothing.
    The parts' own held-out losses (benchmarks.heldout) use EVAL_BATCHES either way."""
    return QUICK_EVAL_BATCHES if quick else EVAL_BATCHES


WARM_STARTS: dict[str, dict[str, torch.Tensor]] = {}
_RUNS: dict[Spec, Run] = {}


def toml(data: dict, section: str = "") -> str:
    """Just enough TOML for a RunConfig: scalars, lists of strings and one level of tables."""
    lines, tables = [], []
    for key, value in data.items():
        if isinstance(value, dict):
            tables.append((key, value))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    out = ([f"[{section}]"] if section else []) + lines
    for key, value in tables:
        out.append(toml(value, f"{section}.{key}" if section else key))
    return "\n".join(out)


def seed_round0(spec: Spec, stores: Stores) -> None:
    """Write the run's config and a round 0 holding the warm-start model, as create_run would."""
    config = load_config(None, spec.config())
    run = config.run_id
    stores.global_.put_if_absent(
        layout.config_key(run), json.dumps(config.model_dump(mode="json"), sort_keys=True, indent=1).encode()
    )
    params = WARM_STARTS[spec.init]
    ref = put_tensors(stores.global_, lambda sha: layout.model_key(run, 0, sha), params, {"run": run, "round": "0"})
    from benchmarks.heldout import loss

    commit(
        stores.global_,
        Manifest(
            run=run,
            round=0,
            parent_round=None,
            parent_sha256=None,
            created_at=datetime.now().astimezone().isoformat(),
            model=ref,
            outer=None,
            eval_loss=loss(params) if config.evaluates(0, 0) else None,
            settings=RoundSettings.of(config),
            quorum=Quorum(received=0, learners=[n for n, _, _ in config.learners()], waited_s=0.0, closed_by="initial"),
        ),
    )


def run(spec: Spec) -> Run:
    """Run the pipeline for `spec` (once per process) and read it back."""
    if spec in _RUNS:
        return _RUNS[spec]
    env = {**os.environ, **stack_env()}
    stores = Stores(STORE, list(REGIONS))
    if spec.init is not None:
        seed_round0(spec, stores)
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(toml(spec.config()))
    cmd = [sys.executable, "-m", "islands.flows.cli", "run", "--config", fh.name, "--json"]
    for c in spec.chaos:
        cmd += ["--chaos", c]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    os.unlink(fh.name)
    if proc.returncode != 0:
        raise RuntimeError(f"pipeline run {spec.name} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    _RUNS[spec] = result = Run(spec, summary, stores)
    return result


@dataclass
class Delta:
    learner: str
    key: str
    bytes: int
    tokens: int
    seconds: float
    finished_at: float
    io_read: int
    io_written: int
    metadata: dict[str, str]  # all of it, as the learner wrote it


def _ts(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


@dataclass
class Run:
    spec: Spec
    summary: dict
    stores: Stores
    _models: dict = field(default_factory=dict)

    @property
    def run_id(self) -> str:
        return self.summary["run_id"]

    @cached_property
    def chain(self) -> list[Manifest]:
        return with_eval_losses(self.stores.global_, [m for m, _ in read_chain(self.stores.global_, self.run_id)])

    @cached_property
    def deltas(self) -> list[Delta]:
        """Every delta the learners wrote, with the claims in its own metadata."""
        out = []
        for region in REGIONS:
            store = self.stores.region(region)
            for key, size in sorted(store.list(layout.deltas_prefix(self.run_id)).items()):
                if layout.parse_delta_key(key) is None:
                    continue
                m = object_metadata(store, key)
                out.append(
                    Delta(
                        m["learner"],
                        key,
                        size,
                        int(m["tokens"]),
                        float(m["seconds"]),
                        float(m["finished_at"]),
                        int(m.get("io_read", 0)),
                        int(m.get("io_written", 0)),
                        m,
                    )
                )
        return out

    def published_at(self, round_: int) -> float:
        return _ts(self.chain[round_].created_at)

    def trained_tokens(self, round_: int) -> int:
        """Tokens in deltas finished by the time `round_` was published (merged or not)."""
        t = self.published_at(round_)
        return sum(d.tokens for d in self.deltas if d.finished_at <= t)

    def applied_tokens(self, round_: int) -> int:
        return sum(c.tokens for m in self.chain[1 : round_ + 1] for c in m.contributions)

    def round_at_budget(self, tokens: int) -> int:
        """First round by which the learners had trained `tokens`; the last round if never."""
        for m in self.chain:
            if self.trained_tokens(m.round) >= tokens:
                return m.round
        return self.chain[-1].round

    def model(self, round_: int) -> dict[str, torch.Tensor]:
        if round_ not in self._models:
            self._models[round_] = get_tensors(self.stores.global_, self.chain[round_].model)
        return self._models[round_]

    def seconds_to_loss(self, target: float) -> float | None:
        """Wall-clock from round 0 to the first round whose held-out loss is at most `target`."""
        for m in self.chain[1:]:
            if m.eval_loss <= target:
                return _ts(m.created_at) - self.published_at(0)
        return None
