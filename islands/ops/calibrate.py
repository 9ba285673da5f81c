"""`islands simulate --calibrate RUN`: a recorded run's own timings fed to the simulator, and its
rounds, quorum closings and delta bytes set beside what the simulation predicts from them.

The timings come from the run's manifests (each merged delta's tokens, bytes, finish time, phase
length and when the synchronizer first saw it; each round's closing and creation time) and its
config.json (H, the quorum and merge rules, which learner is in which region); the model itself
is islands.core.simulate's `calibrated`.
"""

from __future__ import annotations

from datetime import datetime

from islands.core.config import RunConfig
from islands.core.simulate import RecordedDelta, RecordedRound, SimConfig, calibrated, compare, simulate
from islands.storage.manifest import Manifest
from islands.storage.rounds import read_chain, read_config
from islands.storage.store import Stores


def recorded_rounds(chain: list[Manifest]) -> list[RecordedRound]:
    """Rounds 1… of a manifest chain, as the simulator reads them."""
    return [
        RecordedRound(
            m.round,
            datetime.fromisoformat(m.created_at).timestamp(),
            m.quorum.closed_by,
            tuple(
                RecordedDelta(c.learner, c.region, c.phase, c.tokens, c.bytes, c.finished_at, c.seconds, c.seen_at)
                for c in m.contributions
            ),
            sum(m.timings.get(k, 0.0) for k in ("load_s", "merge_s", "publish_s")) if m.timings else None,
            m.quorum.waited_s,
        )
        for m in chain
        if m.round >= 1
    ]


def sim_config_of(config: RunConfig, rounds: list[RecordedRound]) -> SimConfig:
    return calibrated(
        rounds,
        {name: region for name, region, _ in config.learners()},
        config.inner_steps,
        config.quorum,
        config.merge,
        paced=config.paced,
    )


def calibration(run_id: str, template: str, seed: int = 0) -> dict:
    """The recorded run beside its simulation (phase times drawn with `seed`):
    {"recorded", "predicted", "error"} (relative)."""
    config = read_config(Stores(template, []).global_, run_id)
    stores = Stores(template, config.regions)
    rounds = recorded_rounds([m for m, _ in read_chain(stores.global_, run_id)])
    sim = sim_config_of(config, rounds).model_copy(update={"seed": seed})
    return compare(rounds, sim, simulate(sim))
