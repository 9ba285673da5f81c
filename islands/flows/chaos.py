"""Fault rehearsal: `islands run --chaos SPEC` injects real faults into a real run.

    kill:REGION@roundN             SIGKILL that region's learner processes once round N is
                                   published; they stay dead
    restart:REGION@roundN          the same, then launch new learner flow runs that resume from
                                   their saved state (a region killed earlier is only relaunched:
                                   kill:R@round10 + restart:R@round20 takes R away for 10 rounds)
    stall:s3@40s+20s               the S3 endpoint stops answering 40 s into the run, for 20 s
                                   (infra.s3_proxy; clients wait and retry through it)
    crash:synchronizer@POINT[@roundN]
                                   the synchronizer dies (SIGKILL) at crash point POINT of round N
                                   (default: the first round); the driver then finishes that round
                                   from islands.storage, exactly as `islands resume` would

The synchronizer normally runs inside the driver, so for a crashing round it runs as a child
process with the crash point armed, and the driver survives to resume it. Parsing imports no
Prefect: the CLI checks specs before the stack's settings are in place.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from uuid import UUID

from islands.tasks.crash import ENV as CRASH_ENV
from islands.tasks.crash import POINTS, SYNCHRONIZER_POINTS

KINDS = ("kill", "restart", "stall", "crash")
_ROUND = re.compile(r"^round(\d+)$")
_STALL = re.compile(r"^(\d+(?:\.\d+)?)s\+(\d+(?:\.\d+)?)s$")


class ChaosError(ValueError):
    """A --chaos spec that cannot be used; the message names the bad part and the right form."""


@dataclass(frozen=True)
class Stall:
    at_s: float
    for_s: float


@dataclass
class Chaos:
    kills: dict[int, list[str]] = field(default_factory=dict)  # round → regions killed for good
    restarts: dict[int, list[str]] = field(default_factory=dict)  # round → regions killed and relaunched
    crashes: list[tuple[str, int | None]] = field(default_factory=list)  # (point, round or None: first)
    stalls: list[Stall] = field(default_factory=list)
    log: list[str] = field(default_factory=list)
    dead: set[str] = field(default_factory=set)  # regions killed and not relaunched yet

    @classmethod
    def parse(cls, specs: list[str]) -> Chaos:
        """Specs as given to --chaos (each may be comma-separated)."""
        chaos = cls()
        for part in (p.strip() for spec in specs for p in spec.split(",")):
            if part:
                chaos._add(part)
        return chaos

    def _add(self, part: str) -> None:
        kind, sep, rest = part.partition(":")
        if not sep or kind not in KINDS:
            raise ChaosError(
                f"--chaos {part!r}: start with one of {', '.join(k + ':' for k in KINDS)}, e.g. kill:eu-west@round3"
            )
        target, _, when = rest.partition("@")
        if kind in ("kill", "restart"):
            m = _ROUND.match(when)
            if not target or not m or int(m.group(1)) < 1:
                raise ChaosError(
                    f"--chaos {part!r}: write {kind}:REGION@roundN with N >= 1, e.g. {kind}:eu-west@round3"
                )
            (self.kills if kind == "kill" else self.restarts).setdefault(int(m.group(1)), []).append(target)
        elif kind == "stall":
            m = _STALL.match(when)
            if target != "s3" or not m or float(m.group(2)) <= 0:
                raise ChaosError(f"--chaos {part!r}: write stall:s3@STARTs+LENGTHs, e.g. stall:s3@40s+20s")
            self.stalls.append(Stall(float(m.group(1)), float(m.group(2))))
        else:
            point, _, at = when.partition("@")
            m = _ROUND.match(at) if at else None
            if target != "synchronizer" or point not in SYNCHRONIZER_POINTS or (at and not m):
                valid = ", ".join(p for p in POINTS if p in SYNCHRONIZER_POINTS)
                raise ChaosError(f"--chaos {part!r}: write crash:synchronizer@POINT[@roundN]; POINT is one of {valid}")
            self.crashes.append((point, int(m.group(1)) if m else None))

    def check(self, regions: list[str], rounds: int) -> None:
        """Faults must name regions and rounds of this run."""
        for kind, plan in (("kill", self.kills), ("restart", self.restarts)):
            for r, targets in plan.items():
                unknown = sorted(set(targets) - set(regions))
                if unknown:
                    raise ChaosError(
                        f"--chaos {kind}:{unknown[0]}@round{r}: no such region; regions are {', '.join(regions)}"
                    )
                if r >= rounds:
                    raise ChaosError(
                        f"--chaos {kind}:{targets[0]}@round{r}: the run ends at round {rounds}; pick a round below it"
                    )
        for point, r in self.crashes:
            if r is not None and r > rounds:
                raise ChaosError(f"--chaos crash:synchronizer@{point}@round{r}: the run has only {rounds} rounds")

    def crash_round(self, run: str, r: int, store: str) -> None:
        """Publish round r in a child synchronizer that dies at its crash point, if one is due."""
        due = [p for p, at in self.crashes if at in (r, None)]
        self.crashes = [(p, at) for p, at in self.crashes if at not in (r, None)]
        for point in due:
            proc = subprocess.run(
                [sys.executable, "-m", "islands.flows.outer_round", run, str(r), store],
                env={**os.environ, CRASH_ENV: f"{point}@{r}"},
            )
            outcome = "killed (SIGKILL)" if proc.returncode == -signal.SIGKILL else f"exited with {proc.returncode}"
            self._note(f"round {r}: synchronizer {outcome} at {point}; the driver resumes the round")

    def due(self, r: int) -> list[str]:
        """The regions whose learners are killed once round r is published."""
        return self.kills.get(r, []) + self.restarts.get(r, [])

    def after_round(
        self, run: str, r: int, learners: list[tuple[str, str, int]], relaunch: Callable[[str, str], UUID]
    ) -> list[UUID]:
        """Kill (and relaunch) the learners due at round r; returns the new learner runs."""
        from islands.flows.learner_runs import kill_learners

        launched = []
        for region in self.due(r):
            if region in self.dead:
                note = f"round {r}: {region}'s learners are down since an earlier kill"
            else:
                note = f"round {r}: killed {', '.join(kill_learners(run, region))} (SIGKILL)"
                self.dead.add(region)
            if region in self.restarts.get(r, []):
                launched += [relaunch(learner, region) for learner, where, _ in learners if where == region]
                self.dead.discard(region)
                note += "; relaunched from saved state"
            self._note(note)
        return launched

    def _note(self, line: str) -> None:
        from prefect import get_run_logger

        self.log.append(line)
        get_run_logger().warning("chaos: %s", line)
