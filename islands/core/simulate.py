"""A whole run in simulated time: regions, links and failures, driven by the run's own policy.

The synchronizer's decisions are islands.core.quorum's `decide` (with its grace window and round
timeout), its weights islands.core.merge's `plan_merge` (staleness discount and maximum staleness)
and a phase's steps islands.core.pace's `phase_steps`: the same functions a run calls, fed
simulated arrivals and a simulated clock. Nothing here trains or moves bytes; a learner's phase is
an interval of time, its delta a count of bits on its region's link.

The model, and what it leaves out (docs/operations.md, "Will it pay off for my regions?"):

- A learner is a group of chips training one replica (`chips_per_learner`), so a million chips
  are a few hundred objects, not a million. It fails at `chips_per_learner / chip_mtbf_h` per
  hour: any chip failing stops its replica, which restarts `recover_s` later from the newest
  round and loses the phase in progress. A region outage stops every learner of the region and
  its link for its duration.
- A phase is `phase_steps(H, …)` steps of `step_s` (× `straggler_factor` for the fraction of
  phases that straggle, × a draw of spread `phase_cv`), paced as a learner paces: on its own
  rate as its last phase measured it (H for its first, its rate not known yet) against each
  learner's rate in its newest merged delta, as the newest round it sees records them, so a
  phase that ran slow shortens the next one; the learner starts its next phase at once and folds in every round
  that becomes visible meanwhile (it rebases), so a delta's base is the newest round visible when
  its last step begins. Its delta leaves in `fragments` equal pieces spread over the phase, each
  through its region's link (a FIFO queue at `link_gbps`, `latency_s` on top, a storage stall of
  `stall_s` for the fraction `stall_fraction` of uploads); it arrives with its last piece.
- A round closes as `decide` says, counting towards the quorum only the deltas from its parent
  round (`quorum_arrivals`); its merge and publication take `publish_s`, and the next round
  starts collecting `between_rounds_s` later; each learner of a region downloads the round's
  update (update codec) through the same link, and sees the round once it has. A timeout with
  nothing arrived closes no round: collecting starts over.
- Synchronous DiLoCo and data-parallel run in lockstep under the same failures: every learner
  trains H steps (data-parallel: H steps with a ring all-reduce of the gradient each step, hidden
  behind `backward_share` of a step), the slowest sets the pace, and any failure or outage stops
  all of them until the failed learner is back (`recover_s`); synchronous DiLoCo then redoes the
  round in progress, data-parallel everything since its last checkpoint (`checkpoint_s`).
- `calibrated` builds a simulation of a recorded run from its own timings, each learner's phase
  times among them (`phase_step_s`; islands.ops.calibrate reads them from its manifests), and
  `compare` sets its rounds, closings and bytes beside them.
- Goodput is tokens merged (lockstep: tokens of completed rounds or steps kept) over the tokens
  every learner would train at its own speed, never failing and never waiting, in the same wall
  time. Bandwidth is what a region's link carries in its busier direction (a ring all-reduce
  sends and receives as much; a learner's deltas go up, rounds come down).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationError, model_validator

from islands.core.codecs import FLOAT_CODECS, SPARSE_CODECS, Codec, bits_of
from islands.core.config import (
    _FINITE,
    DAY_S,
    NAME,
    NAME_RULE,
    ConfigError,
    MergeSettings,
    QuorumSettings,
    TopkSettings,
    _Section,
    explain,
    read_toml,
)
from islands.core.merge import Candidate, plan_merge
from islands.core.pace import credible, phase_steps
from islands.core.quorum import HISTORY, LearnerHistory, decide, history_of, quorum_arrivals
from islands.core.sparse import Layout, bits_per_value

YEAR_H = 24 * 365.0


def wire_bits(codec: Codec, topk: TopkSettings | None = None) -> float:
    """Bits a value travels as: a float's width, an integer's bits and its share of a block's
    bfloat16 scale (islands.core.compress: 16 bits per 128 values), or topk's positions, values
    and scale over a whole chunk (islands.core.sparse, with `topk`'s settings or the default ones)."""
    if codec in SPARSE_CODECS:
        return bits_per_value(Layout.of(topk or TopkSettings()))
    if codec in FLOAT_CODECS:
        return 32.0 if codec == "fp32" else 16.0
    return bits_of(codec) + 16 / 128


class Region(_Section):
    name: str = Field(pattern=f"^{NAME}$", description=f"The region's name ({NAME_RULE}).")
    learners: int = Field(1, ge=1, le=100_000, description="Learners in the region (each one replica).")
    chips_per_learner: int = Field(1, ge=1, le=10_000_000, description="Chips that train one replica together.")
    step_s: float = Field(1.0, gt=0, le=3600, description="Seconds per inner step on this region's hardware.")
    link_gbps: float = Field(10.0, gt=0, le=1e6, description="The region's link to the synchronizer, Gbit/s.")
    latency_s: float = Field(0.05, ge=0, le=600, description="One-way latency of that link, seconds.")
    start_s: float = Field(0.0, ge=0, le=DAY_S, description="Seconds into the run its learners start training.")
    phase_step_s: list[list[Annotated[float, Field(gt=0, le=3600)]]] = Field(
        [],
        description="Seconds per step of each phase, by phase, one list per learner of the region (a recorded run's, as calibration sets them): each phase takes its own instead of step_s and the phase_cv draw, a phase past the list the list's median.",
    )

    @model_validator(mode="after")
    def _one_trace_per_learner(self) -> Region:
        if len(self.phase_step_s) > self.learners or any(not t for t in self.phase_step_s):
            raise ValueError(f"phase_step_s: at most {self.learners} lists (one per learner), none of them empty")
        return self


class RunSim(_Section):
    params: float = Field(1e9, gt=0, le=1e14, description="The model's parameters (sets every transfer's size).")
    tokens_per_step: int = Field(
        1_000_000, gt=0, le=10**12, description="Tokens one learner trains per inner step (its global batch)."
    )
    inner_steps: int = Field(100, ge=1, le=1_000_000, description="H: inner steps per phase.")
    paced: bool = Field(True, description="Slower learners train fewer steps per phase (islands.core.pace).")
    fragments: int = Field(1, ge=1, le=1024, description="Pieces a delta is sent in, spread over the phase.")
    codec: Codec = Field("int4", description="The deltas' codec.")
    update_codec: Codec = Field("fp32", description="The rounds' codec, as learners download them.")
    publish_s: float = Field(5.0, ge=0, le=DAY_S, description="A round's merge and publication, seconds.")
    between_rounds_s: float = Field(
        0.0,
        ge=0,
        le=DAY_S,
        description="From a round's publication to the next round collecting, seconds (its held-out evaluation, the next round's start); deltas that land meanwhile wait for it.",
    )
    phase_cv: float = Field(
        0.0, ge=0, le=10, description="Spread of a phase's time: its standard deviation over its mean (0: none)."
    )
    delta_bytes: float | None = Field(
        None, gt=0, le=1e15, description="Bytes of one delta as measured (empty: params × the codec's bits)."
    )
    hours: float = Field(24.0, gt=0, le=YEAR_H, description="Wall time simulated.")


class Outage(_Section):
    region: str = Field(description="The region that goes down.")
    at_s: float = Field(ge=0, le=100 * YEAR_H * 3600, description="When, seconds into the run.")
    for_s: float = Field(gt=0, le=100 * YEAR_H * 3600, description="How long, seconds.")


class Faults(_Section):
    chip_mtbf_h: float | None = Field(
        None, gt=0, le=1e9, description="Mean hours between failures of one chip (empty: chips never fail)."
    )
    recover_s: float = Field(600.0, ge=0, le=DAY_S, description="A failed learner is back this long after.")
    outages: list[Outage] = Field(default_factory=list, description="Region-wide outages, as planned.")
    region_mtbf_h: float | None = Field(
        None, gt=0, le=1e9, description="Mean hours between random outages of one region (empty: none)."
    )
    region_outage_s: float = Field(3600.0, gt=0, le=30 * DAY_S, description="How long a random outage lasts.")
    straggler_fraction: float = Field(0.0, ge=0, le=1, description="Fraction of phases that run slow.")
    straggler_factor: float = Field(2.0, ge=1, le=1000, description="How much slower a straggling phase runs.")
    stall_fraction: float = Field(0.0, ge=0, le=1, description="Fraction of uploads held up by storage.")
    stall_s: float = Field(30.0, ge=0, le=DAY_S, description="How long a storage stall holds an upload.")


class Baselines(_Section):
    grad_bits: int = Field(16, ge=1, le=64, description="Bits of a gradient or pseudo-gradient in the all-reduce.")
    backward_share: float = Field(
        2 / 3, ge=0, le=1, description="Share of a step the gradient all-reduce hides behind."
    )
    reconfigure_s: float = Field(
        60.0, ge=0, le=DAY_S, description="Pause of every learner when one leaves or rejoins a lockstep run."
    )


class SimConfig(_Section):
    model_config = _FINITE
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seeds every random draw.")
    window_s: float = Field(60.0, gt=0, le=DAY_S, description="Peak bandwidth is the busiest window this long.")
    regions: list[Region] = Field(min_length=1, max_length=1000, description="The regions and their learners.")
    run: RunSim = Field(default_factory=RunSim)
    quorum: QuorumSettings = Field(default_factory=QuorumSettings)
    merge: MergeSettings = Field(default_factory=MergeSettings)
    topk: TopkSettings = Field(default_factory=TopkSettings)
    faults: Faults = Field(default_factory=Faults)
    baselines: Baselines = Field(default_factory=Baselines)

    @model_validator(mode="after")
    def _consistent(self) -> SimConfig:
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"regions: names must differ, got {names}")
        learners = sum(r.learners for r in self.regions)
        if learners > 100_000:
            raise ValueError(f"regions: at most 100000 learners in all, got {learners}; put more chips in each")
        if self.quorum.min_quorum > learners:
            raise ValueError(f"quorum.min_quorum: {self.quorum.min_quorum} is more than the {learners} learners")
        if self.quorum.max_quorum is not None and self.quorum.max_quorum > learners:
            raise ValueError(f"quorum.max_quorum: {self.quorum.max_quorum} is more than the {learners} learners")
        for o in self.faults.outages:
            if o.region not in names:
                raise ValueError(f"faults.outages: region {o.region!r} is not one of {names}")
        return self

    @property
    def chips(self) -> int:
        return sum(r.learners * r.chips_per_learner for r in self.regions)


def load_sim_config(path: Path, overrides: dict | None = None) -> SimConfig:
    """A simulation's TOML with `overrides` on top ("seed", "run.hours"); raise ConfigError naming the field."""
    data = read_toml(path)
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        if name:
            data.setdefault(section, {})[name] = value
        else:
            data[key] = value
    try:
        return SimConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(explain(exc)) from exc


# -- the failures, drawn once and shared by every scheme -----------------------------------------


@dataclass(frozen=True)
class Timeline:
    """When each learner is down: sorted, non-overlapping (start, end) intervals per learner,
    its own failures and its region's outages merged."""

    down: list[list[tuple[float, float]]]
    starts: list[list[float]]  # each learner's interval starts, for bisect
    any_down: list[tuple[float, float]]  # when at least one learner is down
    any_starts: list[float]

    def failure_in(self, i: int, start: float, end: float) -> tuple[float, float] | None:
        """The first down interval of learner i that overlaps [start, end)."""
        return _overlap(self.down[i], self.starts[i], start, end)

    def anyone_down_in(self, start: float, end: float) -> tuple[float, float] | None:
        """The first stretch of time overlapping [start, end) when some learner is down."""
        return _overlap(self.any_down, self.any_starts, start, end)


def _overlap(
    intervals: list[tuple[float, float]], starts: list[float], start: float, end: float
) -> tuple[float, float] | None:
    k = bisect.bisect_right(starts, start) - 1
    if k >= 0 and intervals[k][1] > start:
        return intervals[k]
    k += 1
    if k < len(intervals) and intervals[k][0] < end:
        return intervals[k]
    return None


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def draw_timeline(cfg: SimConfig, horizon: float, rng: random.Random) -> tuple[Timeline, dict[str, list]]:
    f = cfg.faults
    outages: dict[str, list[tuple[float, float]]] = {r.name: [] for r in cfg.regions}
    for o in f.outages:
        outages[o.region].append((o.at_s, o.at_s + o.for_s))
    if f.region_mtbf_h is not None:
        for r in cfg.regions:
            t = rng.expovariate(1 / (f.region_mtbf_h * 3600))
            while t < horizon:
                outages[r.name].append((t, t + f.region_outage_s))
                t += f.region_outage_s + rng.expovariate(1 / (f.region_mtbf_h * 3600))
    down = []
    for r in cfg.regions:
        for _ in range(r.learners):
            own: list[tuple[float, float]] = []
            if f.chip_mtbf_h is not None:
                rate = r.chips_per_learner / (f.chip_mtbf_h * 3600)
                t = rng.expovariate(rate)
                while t < horizon:
                    own.append((t, t + f.recover_s))
                    t += f.recover_s + rng.expovariate(rate)
            down.append(_merged(own + outages[r.name]))
    union = _merged([iv for d in down for iv in d])
    timeline = Timeline(down, [[s for s, _ in d] for d in down], union, [s for s, _ in union])
    return timeline, {k: _merged(v) for k, v in outages.items()}


# -- links ---------------------------------------------------------------------------------------


@dataclass
class Link:
    """A region's link: one FIFO queue per direction at `gbps`, bits counted per window."""

    gbps: float
    latency_s: float
    window_s: float
    outages: list[tuple[float, float]]
    free_at: dict[str, float] = field(default_factory=lambda: {"up": 0.0, "down": 0.0})
    windows: dict[str, dict[int, float]] = field(default_factory=lambda: {"up": {}, "down": {}})
    bits: dict[str, float] = field(default_factory=lambda: {"up": 0.0, "down": 0.0})

    def send(self, direction: str, ready: float, bits: float) -> float:
        """Queue `bits` ready at `ready`; when they arrive at the other end. A transfer waits out
        an outage of the region that it would start in."""
        start = max(ready, self.free_at[direction])
        for s, e in self.outages:
            if s <= start < e:
                start = e
        end = start + bits / (self.gbps * 1e9)
        self.free_at[direction] = end
        self.count(start, end, bits, direction)
        return end + self.latency_s

    def count(self, start: float, end: float, bits: float, direction: str = "up") -> None:
        self.bits[direction] += bits
        w, windows = self.window_s, self.windows[direction]
        if end <= start:
            windows[int(start // w)] = windows.get(int(start // w), 0.0) + bits
            return
        rate = bits / (end - start)
        k = int(start // w)
        while k * w < end:
            overlap = min(end, (k + 1) * w) - max(start, k * w)
            windows[k] = windows.get(k, 0.0) + rate * overlap
            k += 1

    def gbps_over(self, seconds: float) -> tuple[float, float]:
        """(mean, peak) Gbit/s of the busier direction: all its bits over `seconds`, its busiest window."""
        mean = max(self.bits.values()) / seconds / 1e9
        peak = max(max(w.values(), default=0.0) for w in self.windows.values()) / min(self.window_s, seconds) / 1e9
        return mean, peak


# -- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundRecord:
    number: int
    closed_at: float
    reason: str
    learners: tuple[str, ...]  # whose deltas it merged
    staleness: tuple[int, ...]
    tokens: int  # merged
    dropped: int  # deltas too stale to merge


@dataclass
class Scheme:
    name: str
    tokens: float  # merged (lockstep: kept)
    ideal_tokens: float
    busy_s: float  # learner-seconds of compute, kept or lost
    learner_s: float
    rounds: int
    links: dict[str, tuple[float, float]]  # region → (mean, peak) Gbit/s
    closings: dict[str, int] = field(default_factory=dict)
    staleness: dict[int, int] = field(default_factory=dict)
    records: list[RoundRecord] = field(default_factory=list)

    @property
    def goodput(self) -> float:
        return self.tokens / self.ideal_tokens if self.ideal_tokens else 0.0

    @property
    def utilization(self) -> float:
        return self.busy_s / self.learner_s if self.learner_s else 0.0

    @property
    def mean_gbps(self) -> float:
        return statistics.fmean(m for m, _ in self.links.values())

    @property
    def peak_gbps(self) -> float:
        return max(p for _, p in self.links.values())

    def summary(self) -> dict:
        return {
            "goodput": self.goodput,
            "utilization": self.utilization,
            "mean_gbps": self.mean_gbps,
            "peak_gbps": self.peak_gbps,
            "rounds": self.rounds,
            "closings": dict(self.closings),
            "staleness": {str(k): v for k, v in sorted(self.staleness.items())},
            "links": {k: {"mean_gbps": m, "peak_gbps": p} for k, (m, p) in self.links.items()},
        }


@dataclass(frozen=True)
class Result:
    chips: int
    learners: int
    seconds: float
    decoupled: Scheme
    sync_diloco: Scheme
    data_parallel: Scheme

    def summary(self) -> dict:
        return {
            "chips": self.chips,
            "learners": self.learners,
            "hours": self.seconds / 3600,
            "decoupled": self.decoupled.summary(),
            "sync_diloco": self.sync_diloco.summary(),
            "data_parallel": self.data_parallel.summary(),
        }


# -- decoupled DiLoCo, event by event ------------------------------------------------------------


@dataclass
class _Learner:
    name: str
    index: int
    region: str
    step_s: float
    rate: float  # tokens per second at its region's step time, never failing or straggling
    phase: int = 0
    measured: float | None = None  # tokens per second of its last phase, as it paces the next
    trace: list[float] = field(default_factory=list)  # seconds per step of each phase, recorded


@dataclass(frozen=True)
class _Arrival:
    at: float  # when the synchronizer can see it: its `seen_at` once merged (quorum.MergedDelta)
    learner: str
    region: str
    phase: int
    rebased_at: float  # its last step's start: the newest round visible then is its base
    tokens: int
    seconds: float
    finished_at: float

    @property
    def seen_at(self) -> float:
        return self.at


class Decoupled:
    """The synchronizer and the learners on one simulated clock. Learners' phase starts are the
    events, taken in time order; before each the synchronizer catches up to that time, so the
    learner sees exactly the rounds visible by then (as benchmarks.replay does step by step)."""

    def __init__(self, cfg: SimConfig, timeline: Timeline, rng: random.Random, links: dict[str, Link]) -> None:
        self.cfg, self.timeline, self.rng, self.links = cfg, timeline, rng, links
        self.horizon = cfg.run.hours * 3600
        self.learners: list[_Learner] = []
        for r in cfg.regions:
            for k in range(r.learners):
                rate = cfg.run.tokens_per_step / r.step_s
                trace = r.phase_step_s[k] if k < len(r.phase_step_s) else []
                self.learners.append(_Learner(f"{r.name}-{k}", len(self.learners), r.name, r.step_s, rate, trace=trace))
        self.names = [L.name for L in self.learners]
        self.by_region = {r.name: [L for L in self.learners if L.region == r.name] for r in cfg.regions}
        self.policy = cfg.quorum
        # Each learner's newest merged rate, and what round r's rates come to for pacing: their
        # fastest credible one (pace.credible), one number a round however many learners there are.
        self.rates: dict[str, float] = {}
        self.pace_rate: list[float | None] = [None]
        self.delta_bits = (
            cfg.run.params * wire_bits(cfg.run.codec, cfg.topk)
            if cfg.run.delta_bytes is None
            else 8 * cfg.run.delta_bytes
        )
        self.update_bits = cfg.run.params * wire_bits(cfg.run.update_codec, cfg.topk)
        # Round r is visible in region g from visible[g][r] on.
        self.visible: dict[str, list[float]] = {r.name: [0.0] for r in cfg.regions}
        self.records: list[RoundRecord] = []
        self.history = {n: LearnerHistory([], None) for n in self.names}
        self.recent: dict[str, list[_Arrival]] = {n: [] for n in self.names}  # merged, newest last
        self.arrived: dict[str, float] = {}  # learners counting towards the quorum (quorum_arrivals)
        self.seen: set[tuple[str, int]] = set()  # (learner, phase) of every delta in this round
        self.pending: list[_Arrival] = []  # sorted by arrival
        self.collecting_since = 0.0
        self.cursor = 0.0  # the synchronizer has decided up to here
        self.closings: dict[str, int] = {}
        self.busy_s = 0.0
        self.merged_tokens = 0

    def newest(self, region: str, t: float) -> int:
        return bisect.bisect_right(self.visible[region], t) - 1

    def run(self, on_progress: Callable[[float], None] | None = None) -> Scheme:
        start = {r.name: r.start_s for r in self.cfg.regions}
        clock = [(start[L.region], L.index) for L in self.learners]
        heapq.heapify(clock)
        shown = 0.0
        while clock:
            t, i = heapq.heappop(clock)
            if t >= self.horizon:
                continue
            self.synchronize(t)
            nxt = self.phase(self.learners[i], t)
            if nxt < self.horizon:
                heapq.heappush(clock, (nxt, i))
            if on_progress is not None and t - shown >= self.horizon / 200:
                shown = t
                on_progress(t / self.horizon)
        self.synchronize(self.horizon)
        ideal = sum(L.rate for L in self.learners) * self.horizon
        staleness: dict[int, int] = {}
        for rec in self.records:
            for s in rec.staleness:
                staleness[s] = staleness.get(s, 0) + 1
        return Scheme(
            "decoupled",
            tokens=self.merged_tokens,
            ideal_tokens=ideal,
            busy_s=self.busy_s,
            learner_s=len(self.learners) * self.horizon,
            rounds=len(self.records),
            links={g: link.gbps_over(self.horizon) for g, link in self.links.items()},
            closings=self.closings,
            staleness=staleness,
            records=self.records,
        )

    def phase(self, L: _Learner, t: float) -> float:
        """L starts a phase at t, unless it is down; when it next starts one."""
        run, faults = self.cfg.run, self.cfg.faults
        down = self.timeline.failure_in(L.index, t, t)
        if down is not None:
            return down[1]
        fastest = self.pace_rate[self.newest(L.region, t)]
        rates = [] if fastest is None else [fastest]
        steps = phase_steps(run.inner_steps, L.measured, rates) if run.paced else run.inner_steps
        slow = faults.straggler_factor if self.rng.random() < faults.straggler_fraction else 1.0
        if L.trace:
            step_s = slow * (L.trace[L.phase] if L.phase < len(L.trace) else statistics.median(L.trace))
        else:
            if run.phase_cv:
                slow *= max(0.1, self.rng.gauss(1.0, run.phase_cv))
            step_s = L.step_s * slow
        end = t + steps * step_s
        failure = self.timeline.failure_in(L.index, t, end)
        if failure is not None:  # the phase in progress is lost; back once recovered
            self.busy_s += max(0.0, min(failure[0], self.horizon) - t)
            return failure[1]
        self.busy_s += min(end, self.horizon) - t
        L.measured = steps * run.tokens_per_step / (end - t)
        link = self.links[L.region]
        arrive = end
        pieces = run.fragments
        for p in range(pieces):
            ready = t + (p + 1) * (end - t) / pieces
            if faults.stall_fraction and self.rng.random() < faults.stall_fraction:
                ready += faults.stall_s
            arrive = max(arrive, link.send("up", ready, self.delta_bits / pieces))
        a = _Arrival(arrive, L.name, L.region, L.phase, end - step_s, steps * run.tokens_per_step, end - t, end)
        bisect.insort(self.pending, a, key=lambda x: x.at)
        L.phase += 1
        return end

    def synchronize(self, until: float) -> None:
        """The synchronizer's events (arrivals seen, rechecks, closes) up to time `until`."""
        now = max(self.collecting_since, self.cursor)
        names = self.names
        while now <= until:
            for a in self.pending:
                if a.at > now:
                    break
                if (a.learner, a.phase) not in self.seen:
                    self.seen.add((a.learner, a.phase))
                    self.history[a.learner] = self.history[a.learner].seen(a.finished_at, a.seconds)
                    base = self.newest(a.region, a.rebased_at)
                    for learner, at in quorum_arrivals([(a.learner, base, a.at)], len(self.records)).items():
                        self.arrived.setdefault(learner, at)
            d = decide(self.policy, self.collecting_since, now, self.arrived, names, self.history)
            if d.close and d.reason == "timeout" and not self.seen:
                self.closings["timeout-empty"] = self.closings.get("timeout-empty", 0) + 1
                self.collecting_since = now  # nothing to merge: collecting starts over
            elif d.close:
                self.close_round(now, d.reason or "")
                now = max(now, self.collecting_since)
                continue
            k = bisect.bisect_right(self.pending, now, key=lambda x: x.at)
            later = [self.pending[k].at] if k < len(self.pending) else []
            if d.recheck_at is not None:
                later.append(d.recheck_at)
            if not d.close and not later:
                later.append(self.collecting_since + self.policy.round_timeout_s)
            if d.close:
                later.append(now + self.policy.round_timeout_s)
            now = min(later)
        self.cursor = until

    def close_round(self, now: float, reason: str) -> None:
        """Merge every delta arrived by `now` (the newest per learner waits for no older one),
        weighted by plan_merge; publish the round to each region through its link."""
        take = [a for a in self.pending if a.at <= now]
        self.pending = [a for a in self.pending if a.at > now]
        last = len(self.records)
        # Rebasing each step, a delta counts from the round visible when its last step began
        # (known by now: every round visible by then closed before this one).
        candidates = [Candidate(a.learner, a.phase, self.newest(a.region, a.rebased_at), a.tokens) for a in take]
        weighted, dropped = plan_merge(last, candidates, self.cfg.merge)
        tokens = sum(w.candidate.tokens for w in weighted)
        self.merged_tokens += tokens
        self.records.append(
            RoundRecord(
                last + 1,
                now,
                reason,
                tuple(w.candidate.learner for w in weighted),
                tuple(w.staleness for w in weighted),
                tokens,
                len(dropped),
            )
        )
        self.closings[reason] = self.closings.get(reason, 0) + 1
        by = {(a.learner, a.phase): a for a in take}
        for w in weighted:
            a = by[(w.candidate.learner, w.candidate.phase)]
            self.rates[a.learner] = a.tokens / a.seconds
            self.recent[a.learner] = [*self.recent[a.learner], a][-HISTORY:]
        for name in {*(learner for learner, _ in self.seen), *(w.candidate.learner for w in weighted)}:
            self.history[name] = history_of(self.recent[name])
        self.arrived.clear()
        self.seen.clear()
        self.pace_rate.append(max(credible(list(self.rates.values())), default=None))
        published = now + self.cfg.run.publish_s
        for g, members in self.by_region.items():
            seen = [self.links[g].send("down", published, self.update_bits) for _ in members]
            self.visible[g].append(max(seen, default=published))
        self.collecting_since = published + self.cfg.run.between_rounds_s


# -- synchronous DiLoCo and data-parallel, in lockstep -------------------------------------------


def _ring_bits(cfg: SimConfig) -> float:
    """Bits each region's link sends (and as many it receives) in one ring all-reduce of the
    gradient between regions (inside a region the reduction is local)."""
    k = len(cfg.regions)
    return 2 * (k - 1) / k * cfg.run.params * cfg.baselines.grad_bits


def _all_reduce_s(cfg: SimConfig) -> float:
    k = len(cfg.regions)
    if k == 1:
        return 0.0
    return _ring_bits(cfg) / (min(r.link_gbps for r in cfg.regions) * 1e9) + 2 * (k - 1) * max(
        r.latency_s for r in cfg.regions
    )


def lockstep(cfg: SimConfig, timeline: Timeline, rng: random.Random, data_parallel: bool) -> Scheme:
    """The learners that are up train H steps together at the slowest one's pace (data-parallel
    with a ring all-reduce of the gradient every step, synchronous DiLoCo of the pseudo-gradient
    after the H); elastic, as the published baseline is: a learner that fails leaves, its share of
    the segment lost, and the rest go on after `reconfigure_s`; one that recovers rejoins at the
    next segment, after another `reconfigure_s`."""
    run, faults, horizon = cfg.run, cfg.faults, cfg.run.hours * 3600
    learners = [r for r in cfg.regions for _ in range(r.learners)]
    n = len(learners)
    comm, bits = _all_reduce_s(cfg), _ring_bits(cfg)
    transfer = bits / (min(r.link_gbps for r in cfg.regions) * 1e9)
    pause = cfg.baselines.reconfigure_s
    p_slow = 1 - (1 - faults.straggler_fraction) ** n
    links = {r.name: Link(r.link_gbps, r.latency_s, cfg.window_s, []) for r in cfg.regions}
    t, tokens, busy, rounds = 0.0, 0.0, 0.0, 0
    names = [f"{r.name}-{k}" for r in cfg.regions for k in range(r.learners)]
    records: list[RoundRecord] = []
    was_up: set[int] = set(range(n))
    while t < horizon:
        up = [i for i in range(n) if timeline.failure_in(i, t, t) is None]
        if not up:
            t = min(timeline.failure_in(i, t, t)[1] for i in range(n))  # type: ignore[index]
            continue
        if set(up) - was_up:  # learners back: the group regroups first
            was_up = set(up)
            t += pause
            continue
        was_up = set(up)
        slowest = max(learners[i].step_s for i in up)
        if data_parallel:
            step = slowest + max(0.0, comm - cfg.baselines.backward_share * slowest)
            segment = run.inner_steps * step
        else:
            step, segment = slowest, run.inner_steps * slowest + comm
        dur = segment * (faults.straggler_factor if rng.random() < p_slow else 1.0)
        end = t + dur
        if end > horizon:
            busy += sum(min(horizon - t, run.inner_steps * learners[i].step_s) for i in up)
            break
        failed = {}
        for i in up:
            hit = timeline.failure_in(i, t, end)
            if hit is not None:
                failed[i] = hit[0]
        kept = [i for i in up if i not in failed]
        tokens += len(kept) * run.inner_steps * run.tokens_per_step
        if data_parallel:  # a learner that fails mid-segment kept its steps until then
            tokens += sum(math.floor((f - t) / (dur / run.inner_steps)) for f in failed.values()) * run.tokens_per_step
        busy += sum(run.inner_steps * learners[i].step_s for i in kept)
        busy += sum(min(f - t, run.inner_steps * learners[i].step_s) for i, f in failed.items())
        for link in links.values():
            if data_parallel:
                link.count(t, end, run.inner_steps * bits)
            else:
                link.count(end - comm, end - comm + transfer, bits)
        rounds += run.inner_steps if data_parallel else 1
        if not data_parallel:
            records.append(
                RoundRecord(
                    rounds,
                    end,
                    "all-in",
                    tuple(names[i] for i in kept),
                    (0,) * len(kept),
                    len(kept) * run.inner_steps * run.tokens_per_step,
                    0,
                )
            )
        t = end + pause * len(failed)
        was_up -= set(failed)
    ideal = sum(r.learners * run.tokens_per_step / r.step_s for r in cfg.regions) * horizon
    return Scheme(
        "data_parallel" if data_parallel else "sync_diloco",
        tokens=tokens,
        ideal_tokens=ideal,
        busy_s=busy,
        learner_s=n * horizon,
        rounds=rounds,
        links={g: link.gbps_over(horizon) for g, link in links.items()},
        records=records,
    )


def simulate(cfg: SimConfig, on_progress: Callable[[float], None] | None = None) -> Result:
    """The three schemes over the same drawn failures; deterministic for a seed."""
    horizon = cfg.run.hours * 3600
    timeline, outages = draw_timeline(cfg, horizon, random.Random(cfg.seed))
    links = {r.name: Link(r.link_gbps, r.latency_s, cfg.window_s, outages[r.name]) for r in cfg.regions}
    decoupled = Decoupled(cfg, timeline, random.Random(cfg.seed + 1), links).run(on_progress)
    sync = lockstep(cfg, timeline, random.Random(cfg.seed + 2), data_parallel=False)
    dp = lockstep(cfg, timeline, random.Random(cfg.seed + 3), data_parallel=True)
    if on_progress is not None:
        on_progress(1.0)
    return Result(cfg.chips, sum(r.learners for r in cfg.regions), horizon, decoupled, sync, dp)


def report(result: Result, cfg: SimConfig) -> list[str]:
    """The figures as printable lines, the three schemes side by side."""
    d = result.decoupled
    lines = [
        f"{result.chips:,} chips in {result.learners:,} learners over {len(cfg.regions)} regions, "
        f"{result.seconds / 3600:g} h simulated, {cfg.run.params / 1e9:g}B parameters, H={cfg.run.inner_steps}",
        f"{'':<24}{'decoupled':>12}{'sync DiLoCo':>13}{'data-parallel':>15}",
    ]
    schemes = (result.decoupled, result.sync_diloco, result.data_parallel)
    for label, get in (
        ("goodput", lambda s: f"{s.goodput:.1%}"),
        ("learner utilization", lambda s: f"{s.utilization:.1%}"),
        ("rounds (dp: steps)", lambda s: f"{s.rounds:,}"),
        ("mean Gbit/s per link", lambda s: f"{s.mean_gbps:.3g}"),
        ("peak Gbit/s per link", lambda s: f"{s.peak_gbps:.3g}"),
    ):
        lines.append(f"{label:<24}{get(schemes[0]):>12}{get(schemes[1]):>13}{get(schemes[2]):>15}")
    closings = ", ".join(f"{k} {v}" for k, v in sorted(d.closings.items())) or "none"
    lines.append(f"decoupled closings: {closings}")
    total = sum(d.staleness.values())
    spread = ", ".join(f"{k}: {v / total:.1%}" for k, v in sorted(d.staleness.items())) if total else "none"
    lines.append(f"decoupled staleness of merged deltas: {spread}")
    dropped = sum(r.dropped for r in d.records)
    if dropped:
        lines.append(f"decoupled deltas dropped as too stale: {dropped}")
    for g, (mean, peak) in d.links.items():
        lines.append(f"  link {g}: decoupled mean {mean:.3g} Gbit/s, peak {peak:.3g}")
    return lines


# -- calibration on a recorded run ---------------------------------------------------------------


@dataclass(frozen=True)
class RecordedDelta:
    learner: str
    region: str
    phase: int
    tokens: int
    bytes: int
    finished_at: float  # unix seconds, the learner's clock
    seconds: float  # its phase
    seen_at: float  # the synchronizer's clock when it first listed the delta


@dataclass(frozen=True)
class RecordedRound:
    number: int
    closed_at: float  # unix seconds: the manifest's creation
    closed_by: str
    deltas: tuple[RecordedDelta, ...]
    after_close_s: float | None = None  # from the quorum's close to the manifest: load, merge, publish
    waited_s: float | None = None  # from the round's start collecting to its quorum's close


def calibrated(
    rounds: list[RecordedRound],
    learners: dict[str, str],
    inner_steps: int,
    quorum: QuorumSettings,
    merge: MergeSettings,
    paced: bool = True,
) -> SimConfig:
    """A simulation of a recorded run from its own timings: each learner's seconds per step in
    each phase (`trace_of`), each region's step time from its learners' time between deltas (the
    median per phase) over the steps a delta covers, when its learners started (their first
    phase), how much a phase's time varies, the link's latency from finish to seen, a round's
    publication from its quorum's close to its manifest, the time from a manifest to the next
    round collecting, a delta's measured bytes, and the wall time from the learners' first phase
    to the last round. `learners`: learner → region; `rounds` from 1 on."""
    deltas = [d for r in rounds for d in r.deltas]
    if not deltas:
        raise ValueError("the recorded run merged no delta: nothing to calibrate on")
    tokens_per_step = max(1, max(d.tokens for d in deltas) // inner_steps)
    t0 = min(d.finished_at - d.seconds for d in deltas)
    by_learner: dict[str, list[RecordedDelta]] = {}
    for d in sorted(deltas, key=lambda d: d.phase):
        by_learner.setdefault(d.learner, []).append(d)
    step_s: dict[str, list[float]] = {}
    starts: dict[str, list[float]] = {}
    spreads: list[float] = []
    for name, ds in by_learner.items():
        # Seconds per step, from one delta's finish to the next's over the steps the next covers
        # (deltas of the next phase only; without two, the phase's own seconds).
        per_step = [
            (b.finished_at - a.finished_at) / (b.tokens / tokens_per_step)
            for a, b in zip(ds, ds[1:])
            if b.phase == a.phase + 1 and b.tokens > 0
        ] or [d.seconds / max(d.tokens / tokens_per_step, 1e-9) for d in ds]
        region = learners.get(name, ds[0].region)
        step_s.setdefault(region, []).append(statistics.median(per_step))
        if len(per_step) > 1:
            spreads.append(statistics.stdev(per_step) / statistics.fmean(per_step))
        cycle = statistics.median(per_step) * statistics.median(d.tokens for d in ds) / tokens_per_step
        # Its first phase began its first merged delta's phases earlier (start-up differs by learner).
        first = ds[0]
        starts.setdefault(region, []).append(max(0.0, first.finished_at - first.seconds - first.phase * cycle - t0))
    lags: dict[str, list[float]] = {}
    for d in deltas:
        lags.setdefault(d.region, []).append(max(0.0, d.seen_at - d.finished_at))
    publish = [r.after_close_s for r in rounds if r.after_close_s is not None] or [
        r.closed_at - max(d.seen_at for d in r.deltas) for r in rounds if r.closed_by == "all-in" and r.deltas
    ]
    between = [
        b.closed_at - b.after_close_s - b.waited_s - a.closed_at
        for a, b in zip(rounds, rounds[1:])
        if b.after_close_s is not None and b.waited_s is not None
    ]
    regions = []
    for region in dict.fromkeys(learners.values()):
        count = sum(1 for g in learners.values() if g == region)
        traces = [trace_of(by_learner[n], tokens_per_step) for n in sorted(learners) if learners[n] == region]
        regions.append(
            {
                "name": region,
                "learners": count,
                "step_s": statistics.median(
                    step_s.get(region, [statistics.median(s for v in step_s.values() for s in v)])
                ),
                "link_gbps": 1e5,  # the measured lag carries the transfer
                "latency_s": statistics.median(lags.get(region, [0.0])),
                "start_s": statistics.median(starts.get(region, [0.0])),
                "phase_step_s": [t for t in traces if t],
            }
        )
    wall = max(r.closed_at for r in rounds) - t0
    return SimConfig.model_validate(
        {
            "regions": regions,
            "run": {
                "params": 1.0,
                "tokens_per_step": tokens_per_step,
                "inner_steps": inner_steps,
                "paced": paced,
                "phase_cv": min(10.0, statistics.median(spreads)) if spreads else 0.0,
                "publish_s": max(0.0, statistics.median(publish)) if publish else 0.0,
                "between_rounds_s": max(0.0, statistics.median(between)) if between else 0.0,
                "delta_bytes": statistics.fmean(d.bytes for d in deltas),
                "hours": (wall + 1e-3) / 3600,
            },
            "quorum": quorum.model_dump(),
            "merge": merge.model_dump(),
        }
    )


def trace_of(deltas: list[RecordedDelta], tokens_per_step: int) -> list[float]:
    """A learner's seconds per step in each of its phases, by phase number, from its merged
    deltas: from the previous phase's finish to this one's (what the learner does between
    phases included) where both are recorded, else the phase's own seconds, over its steps; a
    phase it did not get merged (lost, dropped or past the record) takes the median of the rest."""
    by_phase = {d.phase: d for d in deltas if d.tokens > 0 and d.seconds > 0}
    own = {
        phase: ((d.finished_at - by_phase[phase - 1].finished_at) if phase - 1 in by_phase else d.seconds)
        * tokens_per_step
        / d.tokens
        for phase, d in by_phase.items()
    }
    if not own:
        return []
    typical = statistics.median(own.values())
    return [own.get(phase, typical) for phase in range(max(own) + 1)]


def compare(rounds: list[RecordedRound], cfg: SimConfig, result: Result) -> dict:
    """The recorded run's rounds, closings and delta bytes beside the simulation's, with the
    relative error of each."""
    sim = result.decoupled.records
    bytes_per = cfg.run.delta_bytes or cfg.run.params * wire_bits(cfg.run.codec, cfg.topk) / 8
    real = {
        "rounds": len(rounds),
        "closings": {k: sum(r.closed_by == k for r in rounds) for k in sorted({r.closed_by for r in rounds})},
        "deltas": sum(len(r.deltas) for r in rounds),
        "bytes": sum(d.bytes for r in rounds for d in r.deltas),
    }
    predicted = {
        "rounds": len(sim),
        "closings": {k: sum(r.reason == k for r in sim) for k in sorted({r.reason for r in sim})},
        "deltas": sum(len(r.learners) for r in sim),
        "bytes": bytes_per * sum(len(r.learners) for r in sim),
    }

    def off(a: float, b: float) -> float:
        return abs(b - a) / a if a else float(b != 0)

    closings = set(real["closings"]) | set(predicted["closings"])
    return {
        "recorded": real,
        "predicted": predicted,
        "error": {
            "rounds": off(real["rounds"], predicted["rounds"]),
            "closings": {k: off(real["closings"].get(k, 0), predicted["closings"].get(k, 0)) for k in sorted(closings)},
            "bytes": off(real["bytes"], predicted["bytes"]),
        },
    }
