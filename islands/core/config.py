"""The run configuration: one pydantic model, so the TOML file, the CLI flags and the Prefect UI
form share the same fields, defaults, help text and validation.

The defaults are the embedded demo: four regions with one learner each, one region at a third of
the speed, the `tiny` model, twelve outer rounds.

The README's configuration reference is made from these fields (`reference_table`), so it cannot
say other than the code: `python -m islands.core.config --write README.md` rewrites it.
"""

from __future__ import annotations

import argparse
import os
import re
import secrets
import tomllib
import types
import typing
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo

from islands.core.codecs import FLOAT_CODECS, INTEGER_CODECS, Codec

DEMO_SPEED = {"eu-west": 0.33}
# The bucket of checkpoints and manifests; every other bucket is a region's, named after it.
GLOBAL_BUCKET = "global"
# Where a run without `store` keeps its buckets: the embedded S3 endpoint (AWS_ENDPOINT_URL).
EMBEDDED_STORE = "s3://islands-{bucket}"
# Run and region names: they become bucket names and key segments, so plain ASCII of a fixed form.
NAME = r"[a-z0-9][a-z0-9-]{1,40}[a-z0-9]"
NAME_RULE = "3–42 characters: lowercase letters, digits or '-', beginning and ending with a letter or digit"
_NAME = re.compile(NAME, re.ASCII)


class ConfigError(ValueError):
    """A configuration problem, phrased as one line naming the field and what to do."""


# Every number of a run is finite and bounded: inf or nan in any float field, or a value past its
# upper bound, is refused when the config is read, so a run that starts can always be resumed.
_FINITE = ConfigDict(extra="forbid", allow_inf_nan=False)
DAY_S = 86400.0
MAX_STEP_S = 3600.0  # min_step_s: an hour per inner step is a rehearsal's slowest


class _Section(BaseModel):
    model_config = ConfigDict(**_FINITE, frozen=True)


class InnerSettings(_Section):
    """Each learner's own optimizer (AdamW) and its schedule; its state never leaves the learner
    (DiLoCo, arXiv 2311.08105: syncing it gave nothing)."""

    lr: float = Field(1e-3, gt=0, le=1, description="Peak inner AdamW learning rate.")
    warmup_steps: int = Field(50, ge=0, description="Linear warm-up, in inner steps.")
    total_steps: int = Field(600, gt=0, description="Inner steps over which the cosine decays to min_lr_ratio.")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="Final learning rate as a fraction of lr.")
    weight_decay: float = Field(0.1, ge=0, le=1, description="AdamW weight decay on matrices and embeddings (0: none).")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW's first-moment decay.")
    beta2: float = Field(0.95, ge=0, lt=1, description="AdamW's second-moment decay.")
    grad_clip: float = Field(1.0, ge=0, le=1e6, description="Global gradient-norm clip (0: none).")
    batch_size: int = Field(16, gt=0, description="Sequences per inner step, over all of a learner's GPUs together.")
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="Sequences per forward/backward pass; gradients accumulate over batch_size / this (and the GPUs) to one step, so the step does not depend on the GPU's memory (empty: the whole batch at once). Lower it when a GPU runs out of memory.",
    )
    activation_checkpointing: bool = Field(
        False,
        description="Recompute each transformer block's activations in the backward pass instead of keeping them: less memory, about a third more compute.",
    )
    compile: bool = Field(False, description="Compile the model with torch.compile before the first step.")

    @model_validator(mode="after")
    def _schedule(self) -> InnerSettings:
        if self.total_steps < self.warmup_steps:
            raise ValueError(
                f"total_steps: {self.total_steps} is shorter than warmup_steps {self.warmup_steps}; "
                "the cosine must start after the warm-up"
            )
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size: {self.micro_batch_size} does not divide batch_size {self.batch_size}; use a divisor of it"
            )
        return self


class MergeSettings(_Section):
    """How the synchronizer turns the deltas that arrived into one outer step."""

    outer_lr: float = Field(0.7, gt=0, le=2, description="Outer Nesterov learning rate η (the papers' 0.7).")
    outer_momentum: float = Field(
        0.8, ge=0, lt=1, description="Outer Nesterov momentum μ (0.8 beat the papers' 0.9 here, stale deltas or not)."
    )
    staleness_lambda: float = Field(0.5, ge=0, le=1e3, description="Weight = tokens / (1 + λ·staleness).")
    max_staleness: int = Field(4, ge=0, description="Deltas staler than this many rounds are dropped (recorded).")
    token_cap: float = Field(
        2.0, ge=1, le=1e3, description="A token claim counts at most this × the median of its peers."
    )
    norm_limit: float = Field(
        10.0,
        gt=1,
        le=1e6,
        description="A delta's L2 norm may be at most this × the median norm of the deltas merged in the last five rounds, and never above the model's own; with three or more in a round, also within this factor of the round's median, either way. Others are quarantined.",
    )


class SynchronizerSettings(_Section):
    """The synchronizer's own process: how much of the model it handles at once."""

    chunk_mb: int = Field(
        64,
        ge=1,
        le=65536,
        description="The merge reads θ, the outer state and every delta, and writes the round's objects, this many MB of float32 values at a time (whole 128-value blocks); its memory is a fixed multiple of it, whatever the model's size.",
    )


MAX_TOPK_CHUNK = 2**18  # one MB of float32 values: every synchronizer.chunk_mb is whole top-k chunks


# A plain integer with bounds, checked against these, rather than a Literal: with a Literal of
# ints in the schema, the Prefect UI's run form did not submit (its Submit stayed put).
TOPK_VALUE_BITS = (2, 4, 8)


class TopkSettings(_Section):
    """The `topk` codec's settings (SparseLoCo, arXiv 2508.15706): of each chunk of a tensor's
    values, the k largest in magnitude travel, with their positions; what is left waits in the
    sender's error-feedback residual. One section for deltas and updates alike."""

    chunk: int = Field(
        4096,
        ge=2,
        le=MAX_TOPK_CHUNK,
        description=f"Values per chunk: a power of two, at most {MAX_TOPK_CHUNK} so the synchronizer's merge chunks (synchronizer.chunk_mb) are whole chunks.",
    )
    k: int = Field(64, ge=1, description="Values sent of each chunk, the largest in magnitude (at most chunk).")
    value_bits: int = Field(
        2,
        ge=min(TOPK_VALUE_BITS),
        le=max(TOPK_VALUE_BITS),
        description="Bits of each value sent, 2, 4 or 8: its sign and a magnitude on a grid of the chunk's largest (one scale per chunk).",
    )
    beta: float = Field(
        0.95,
        gt=0,
        le=1,
        description="Error-feedback decay, each learner's and the synchronizer's: an encoding sends from the new values plus beta × what earlier ones left (1: plain error feedback).",
    )

    @model_validator(mode="after")
    def _chunk(self) -> TopkSettings:
        if self.value_bits not in TOPK_VALUE_BITS:
            raise ValueError(f"value_bits: {self.value_bits} is not one of {', '.join(map(str, TOPK_VALUE_BITS))}")
        if self.chunk & (self.chunk - 1):
            raise ValueError(f"chunk: {self.chunk} is not a power of two; use one, e.g. 4096")
        if self.k > self.chunk:
            raise ValueError(f"k: {self.k} is more than the chunk's {self.chunk} values")
        return self


class QuorumSettings(_Section):
    """When an outer round stops collecting."""

    min_quorum: int = Field(
        2, ge=1, description="Q_min: learners with a fresh delta needed before the grace window opens."
    )
    max_quorum: int | None = Field(
        None, ge=1, description="Q_max: close at once with this many (default: every learner)."
    )
    grace_max_s: float = Field(
        20.0, ge=0, le=DAY_S, description="Longest extra wait for learners expected soon after Q_min."
    )
    grace_fraction: float | None = Field(
        0.5,
        ge=0,
        le=100,
        description="The grace is also at most this fraction of the median recent phase time (null, e.g. left empty in the UI form: grace_max_s alone).",
    )
    round_timeout_s: float = Field(
        600.0,
        gt=0,
        le=7 * DAY_S,
        description="Hard deadline of a round, from its start (round 1's includes the learners' start-up); merge what arrived, or fail with none.",
    )
    poll_s: float = Field(
        0.5, gt=0, le=60, description="How often the synchronizer lists the regional buckets (at most round_timeout_s)."
    )

    @model_validator(mode="after")
    def _bounds(self) -> QuorumSettings:
        if self.max_quorum is not None and self.max_quorum < self.min_quorum:
            raise ValueError(
                f"max_quorum: must lie between min_quorum ({self.min_quorum}) and the number of learners, "
                f"got {self.max_quorum}"
            )
        if self.poll_s > self.round_timeout_s:
            raise ValueError(f"poll_s: {self.poll_s:g} s is longer than round_timeout_s {self.round_timeout_s:g} s")
        return self


class RunConfig(BaseModel):
    """Everything a training run needs; every field has a default that works on one machine."""

    model_config = _FINITE

    run_id: str | None = Field(None, description="Run name (lowercase, digits, '-'); a fresh one when empty.")
    regions: list[str] = Field(
        ["us-east", "eu-west", "ap-south", "sa-east"], description="One bucket and work pool per region."
    )
    learners_per_region: int = Field(1, ge=1, le=64, description="Learners in each region.")
    rounds: int = Field(
        12, ge=1, description="Outer rounds to publish after round 0 (at most, with target_loss or token_budget)."
    )
    target_loss: float | None = Field(
        None,
        gt=0,
        le=1e3,
        description="Stop early once a published round's held-out eval loss is at most this (empty: run all the rounds).",
    )
    token_budget: int | None = Field(
        None,
        gt=0,
        description="Stop early once the rounds have merged this many trained tokens into the global model (empty: no budget).",
    )
    inner_steps: int = Field(50, description="H: inner steps per phase between two deltas.")
    model: str = Field(
        "tiny",
        description="The model: a preset, tiny (~0.9M params) or small (~11M); a Hugging Face model folder or config.json (a path, file:// or s3://), built from the seed or, when the folder has weights, loaded; or python:package.module:function, a factory returning a torch.nn.Module whose forward(input_ids, labels) returns the loss.",
    )
    corpus: str = Field(
        "stdlib",
        description="Token shards (a folder with its dataset.json, from `islands prepare`), or text: an fsspec URL, glob or folder of .txt, .jsonl or .parquet files; 'stdlib' = Python's own sources. The held-out split is eval_corpus, else the last shard (of text: its last 5 %).",
    )
    eval_corpus: str | None = Field(
        None, description="The held-out split, in any form corpus takes (empty: taken from corpus)."
    )
    tokenizer: str | None = Field(
        None,
        description="Tokenizer of a text corpus (or the one its token shards were made with, which must be the copy `islands prepare` kept beside them): a tokenizer.json or a Hugging Face tokenizer folder (empty: the token shards' own copy; for text, bytes, vocabulary 256). Its vocabulary must fit the model's; islands export writes it beside the model.",
    )
    seed: int = Field(0, description="Seed of the initial model and of every learner's data order.")
    speed: dict[str, float] = Field(
        DEMO_SPEED, description="Per-region compute speed (1 = full); a slower region really takes longer."
    )
    min_step_s: dict[str, float] = Field(
        {},
        description="Per-region floor on an inner step's wall time, in seconds, held over each phase: a learner that computes faster waits out the rest, and a step slowed by other processes is made up by shorter waits after it, so its rate stays capped whatever else the machine runs.",
    )
    codec: Codec = Field(
        "fp32",
        description=f"Wire format of deltas: {', '.join(FLOAT_CODECS)}, {'/'.join(INTEGER_CODECS)} with one scale per 128 values, or topk (the [topk] section).",
    )
    update_codec: Codec = Field(
        "bf16",
        description="Wire format of the outer update published beside each checkpoint, which learners one round behind fetch instead of it.",
    )
    store: str | None = Field(
        None,
        description="Bucket URL template with {bucket}, e.g. s3://islands-{bucket}; empty = the embedded S3 endpoint.",
    )
    object_lock_days: int | None = Field(
        None,
        ge=1,
        le=36500,
        description="Keep each round's manifest and checkpoints under S3 Object Lock (compliance mode) for this many days, so that no credential, an admin's included, can delete or replace them before (empty: no lock). Needs an s3:// global bucket with Object Lock; the embedded one is given it.",
    )
    learner_deployment: str = Field(
        "learner/local",
        description="Deployment that runs learners; '{region}' and '{learner}' are replaced by the learner's region and name (a deployment per learner can hold that learner's own credentials).",
    )
    learner_wait_s: float = Field(
        0.0, ge=0, le=DAY_S, description="Longest a learner waits for a newer round before training on (0: never)."
    )
    rebase: bool = Field(
        True, description="Fold a round published mid-phase into the phase in progress (fresher deltas, no waiting)."
    )
    lr_catch_up: bool = Field(
        True,
        description="Start each phase at the learners' average progress in the inner learning-rate schedule, so a slow learner anneals with the others and a fast one does not anneal early.",
    )
    carry: bool = Field(
        True,
        description="Start each phase from the learner's own weights, keeping its deltas no round has merged yet instead of retraining them.",
    )
    paced: bool = Field(
        True,
        description="Scale a phase's inner steps to the learner's rate: H for the fastest learners, H × its rate / the fastest's for a slower one, so its phases end with theirs and its deltas come as often and as fresh.",
    )
    gpus_per_learner: int = Field(
        1,
        ge=1,
        le=64,
        description="Processes (one per GPU; gloo processes on a CPU) that train each learner's phase together, launched by the learner as one torchrun job; 1: the learner trains in its own process.",
    )
    parallel: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="How a torchrun phase splits the work: ddp (every GPU holds the model and its optimizer) or fsdp (FSDP2 shards parameters, gradients and optimizer state over the GPUs, for a model that does not fit one GPU with its optimizer).",
    )
    learner_relaunches: int = Field(
        2,
        ge=0,
        le=100,
        description="Times the driver relaunches a learner whose flow run failed or crashed, from its saved state; one that dies again after that is given up, and the run ends with exit status 1 (at once when no learner is left).",
    )
    torch_threads: int | None = Field(None, ge=1, description="Threads per learner (default: cores shared evenly).")
    eval_batches: int = Field(16, gt=0, description="Held-out batches in each evaluation of a round's checkpoint.")
    eval_every: int = Field(
        1,
        ge=0,
        description="Evaluate every N-th round's checkpoint on the held-out split, round 0 included, and the run's last round whatever N; 0: the last round only. The synchronizer evaluates between rounds, so rarer evaluations let the next round close sooner; target_loss is checked on the rounds evaluated.",
    )
    inner: InnerSettings = InnerSettings()
    merge: MergeSettings = MergeSettings()
    quorum: QuorumSettings = QuorumSettings()
    synchronizer: SynchronizerSettings = SynchronizerSettings()
    topk: TopkSettings = TopkSettings()

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None and not _NAME.fullmatch(v):
            raise ValueError(f"use {NAME_RULE}, e.g. run-7f3a")
        return v

    @field_validator("regions")
    @classmethod
    def _regions(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one region")
        bad = [r for r in v if not _NAME.fullmatch(r) or r == GLOBAL_BUCKET]
        if bad:
            raise ValueError(f"{bad} cannot name a region: use {NAME_RULE}, and not '{GLOBAL_BUCKET}'")
        if len(set(v)) != len(v):
            raise ValueError("regions must be distinct")
        return v

    @field_validator("inner_steps")
    @classmethod
    def _h(cls, v: int) -> int:
        if v <= 0:
            raise ValueError(f"must be a positive number of inner steps, got {v}")
        return v

    @field_validator("store")
    @classmethod
    def _store(cls, v: str | None) -> str | None:
        if v is not None and "{bucket}" not in v:
            raise ValueError("must contain '{bucket}', e.g. s3://islands-{bucket} or file:///data/islands/{bucket}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        n = self.num_learners
        for field, per_region in (("speed", self.speed), ("min_step_s", self.min_step_s)):
            unknown = sorted(set(per_region) - set(self.regions))
            if unknown:
                raise ValueError(f"{field}: unknown region {unknown[0]!r}; regions are {', '.join(self.regions)}")
        slow = {r: f for r, f in self.speed.items() if not 0 < f <= 1}
        if slow:
            raise ValueError(f"speed: {slow} must be in (0, 1]")
        negative = {r: s for r, s in self.min_step_s.items() if not 0 <= s <= MAX_STEP_S}
        if negative:
            raise ValueError(f"min_step_s: {negative} must be seconds in [0, {MAX_STEP_S:g}]")
        if self.quorum.min_quorum > n:
            raise ValueError(
                f"quorum.min_quorum: {self.quorum.min_quorum} is more than the {n} learners; lower it or add learners"
            )
        if self.quorum.max_quorum is not None and not self.quorum.min_quorum <= self.quorum.max_quorum <= n:
            raise ValueError(f"quorum.max_quorum: must lie between min_quorum and the {n} learners")
        if self.object_lock_days is not None and not (self.store or EMBEDDED_STORE).startswith("s3://"):
            raise ValueError(
                "object_lock_days: needs an s3:// store (S3 Object Lock); a folder cannot keep objects under retention"
            )
        per_rank = self.inner.batch_size // self.gpus_per_learner
        if self.inner.batch_size % self.gpus_per_learner or per_rank % (self.inner.micro_batch_size or per_rank):
            raise ValueError(
                f"gpus_per_learner: inner.batch_size {self.inner.batch_size} must split into {self.gpus_per_learner} equal "
                "slices, each a multiple of inner.micro_batch_size; change batch_size, micro_batch_size or gpus_per_learner"
            )
        if self.target_loss is not None and self.eval_every == 0:
            raise ValueError(
                "eval_every: 0 evaluates the last round only, so target_loss could never end the run; set eval_every >= 1"
            )
        return self

    @property
    def num_learners(self) -> int:
        return len(self.regions) * self.learners_per_region

    @property
    def max_quorum(self) -> int:
        return self.quorum.max_quorum or self.num_learners

    def learners(self) -> list[tuple[str, str, int]]:
        """(learner, region, global index) for every learner, in a fixed order."""
        out = []
        for i in range(self.learners_per_region):
            for region in self.regions:
                out.append((f"{region}-{i}", region, len(out)))
        return sorted(out, key=lambda t: t[2])

    def threads_per_learner(self) -> int:
        return self.torch_threads or max(1, (os.cpu_count() or 1) // self.num_learners)

    def slowdown(self, region: str) -> float:
        return 1.0 / self.speed.get(region, 1.0)

    def end_rule(self) -> str:
        """When the run ends, in words: its rounds, or its target loss or token budget when set."""
        parts = [f"{self.rounds} rounds"]
        if self.target_loss is not None:
            parts.append(f"eval loss {self.target_loss:g}")
        if self.token_budget is not None:
            parts.append(f"{self.token_budget:,} tokens merged")
        return " or ".join(parts)

    def evaluates(self, round_: int, tokens_applied: int) -> bool:
        """Whether round `round_`, with `tokens_applied` tokens merged so far, is evaluated once
        published: every eval_every-th round, and the one that ends the run."""
        return (self.eval_every > 0 and round_ % self.eval_every == 0) or self.ended_by(
            round_, None, tokens_applied
        ) is not None

    def ended_by(self, round_: int, eval_loss: float | None, tokens_applied: int) -> str | None:
        """Why the run is over once round `round_` is published with `eval_loss` (None: not
        evaluated yet) and `tokens_applied` tokens merged so far (Manifest.tokens_applied); None: go on."""
        if self.target_loss is not None and eval_loss is not None and eval_loss <= self.target_loss:
            return f"round {round_} reached the target eval loss {self.target_loss:g} ({eval_loss:.4f})"
        if self.token_budget is not None and tokens_applied >= self.token_budget:
            return f"round {round_} merged the token budget of {self.token_budget:,} ({tokens_applied:,})"
        if round_ >= self.rounds:
            return f"all {self.rounds} rounds published"
        return None


def store_template(config: RunConfig) -> str:
    return config.store or EMBEDDED_STORE


def embedded_buckets(regions: list[str]) -> list[str]:
    """The embedded S3 endpoint's bucket names: the global bucket's, then each region's."""
    return [EMBEDDED_STORE.removeprefix("s3://").format(bucket=b) for b in (GLOBAL_BUCKET, *regions)]


def new_run_id() -> str:
    return f"run-{secrets.token_hex(3)}"


def explain(exc: ValidationError) -> str:
    """One line per problem: the field's dotted path, what was wrong, what to do."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "config"
        msg = err["msg"].removeprefix("Value error, ")
        named = re.fullmatch(r"([a-z_][a-z0-9_.]*): (.*)", msg, flags=re.S)
        if err["type"] == "value_error" and named:  # a check across fields names the one to change
            where = ".".join([*(str(p) for p in err["loc"]), named[1]])
            msg = named[2]
        if err["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling against the README's config reference"
        lines.append(f"{where}: {msg}")
    return "\n".join(lines)


def read_toml(path: Path) -> dict:
    """The `--config` file's tables; ConfigError in one line when it is missing, unreadable or not TOML."""
    try:
        return tomllib.loads(Path(path).read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"--config: {path} does not exist") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config: {path} is not valid TOML ({exc})") from exc
    except OSError as exc:
        raise ConfigError(f"--config: {path} cannot be read ({exc.strerror})") from exc


def load_config(path: Path | None, overrides: dict) -> RunConfig:
    """TOML file (optional) with CLI overrides on top; raise ConfigError naming the field."""
    data: dict = {} if path is None else read_toml(path)
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        if not field:
            data[key] = value
        elif isinstance(data.setdefault(section, {}), dict):
            data[section][field] = value
        else:
            raise ConfigError(f"{section}: must be a table of fields, e.g. [{section}] with {field} = ...")
    if "regions" in data and "speed" not in data:
        # The demo's slow region applies only where the run has that region.
        data["speed"] = {r: f for r, f in DEMO_SPEED.items() if r in data["regions"]}
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain(exc)) from exc


# -- the README's configuration reference ------------------------------------------------------
REFERENCE_BEGIN = "<!-- config reference: generated by `python -m islands.core.config --write README.md` -->"
REFERENCE_END = "<!-- end of config reference -->"
_BOUNDS = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤"}  # pydantic's Field bounds, as the reference writes them


def _toml(value) -> str:
    """A default as it is written in the TOML file; unset for None (TOML has no null: leave it out)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }" if value else "{}"
    return repr(value)


def _kind(annotation) -> str:
    """The values a field takes, in words."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_kind(a) for a in typing.get_args(annotation) if a is not type(None))
    if typing.get_origin(annotation) is Literal:
        return ", ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in typing.get_args(annotation))
    if typing.get_origin(annotation) is list:
        return f"list of {_kind(typing.get_args(annotation)[0])}"
    if typing.get_origin(annotation) is dict:
        return f"table: region = {_kind(typing.get_args(annotation)[1])}"
    return {bool: "true or false", int: "integer", float: "number", str: "text"}[annotation]


def _allowed(field: FieldInfo) -> str:
    bounds = [
        f"{sign} {getattr(m, bound):g}" for m in field.metadata for bound, sign in _BOUNDS.items() if hasattr(m, bound)
    ]
    return ", ".join([_kind(field.annotation), *bounds])


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def reference_table() -> str:
    """The configuration reference: one row per field of RunConfig and of its sections, with its
    default as written in TOML, the values it takes and its help text."""
    rows = ["| field | default | values | meaning |", "|---|---|---|---|"]
    sections = []
    for name, field in RunConfig.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, _Section):
            sections.append((name, field.annotation))
            continue
        rows.append(f"| `{name}` | `{_toml(field.default)}` | {_allowed(field)} | {field.description} |")
    for section, model in sections:
        rows.append(f"| **[{section}]** | | | {_one_line(model.__doc__)} |")
        for name, field in model.model_fields.items():
            rows.append(f"| `{section}.{name}` | `{_toml(field.default)}` | {_allowed(field)} | {field.description} |")
    return "\n".join(rows)


def with_reference(readme: str) -> str:
    """`readme` with the text between the reference's markers replaced by `reference_table()`."""
    begin, end = readme.find(REFERENCE_BEGIN), readme.find(REFERENCE_END)
    if begin < 0 or end < begin:
        raise ValueError(f"the README has no configuration reference between {REFERENCE_BEGIN!r} and {REFERENCE_END!r}")
    return readme[: begin + len(REFERENCE_BEGIN)] + "\n" + reference_table() + "\n" + readme[end:]


def main(argv: list[str] | None = None) -> None:
    """Print the configuration reference, or write it into a README between its markers."""
    p = argparse.ArgumentParser(prog="python -m islands.core.config", description=main.__doc__)
    p.add_argument("--write", type=Path, metavar="README", help="rewrite the reference in this file")
    args = p.parse_args(argv)
    if args.write is None:
        print(reference_table())
    else:
        args.write.write_text(with_reference(args.write.read_text()))


if __name__ == "__main__":
    main()
