"""Where every object of a run lives: the one place that spells keys.

Global bucket (written by the synchronizer and the driver)::

    runs/<run>/config.json
    runs/<run>/rounds/<r:06d>/model-<sha16>.safetensors   # θ_r, content-addressed
    runs/<run>/rounds/<r:06d>/outer-<sha16>.safetensors   # Nesterov momentum + update residual after r
    runs/<run>/rounds/<r:06d>/update-<sha16>.safetensors  # θ_r − θ_{r−1} in the update codec (r ≥ 1)
    runs/<run>/rounds/<r:06d>/manifest.json               # commit point of round r
    runs/<run>/rounds/<r:06d>/eval.json                   # θ_r's held-out loss, written after the manifest (r ≥ 1)
    runs/<run>/stop.json                                  # the driver asks learners to stop
    runs/<run>/drivers/<epoch:06d>.json                   # a driver's claim (each run or resume)
    runs/<run>/drivers/<epoch:06d>/beat-<seq:08d>         # its heartbeat (the newest two kept)

Any bucket a driver checks before a run writes there (storage.probe)::

    probes/<token>                                        # written twice, create-only, deleted at once

Regional bucket (written by that region's learners)::

    runs/<run>/deltas/<learner>/<phase:06d>.safetensors
    runs/<run>/learners/<learner>/state-<phase:06d>.safetensors
    runs/<run>/cache/<r:06d>/model-<sha16>.safetensors    # the region's copy of a global object,
    runs/<run>/cache/<r:06d>/update-<sha16>.safetensors   #   same round and content address
    runs/<run>/cache/<r:06d>/<name>.claim                 # "one learner is fetching it", put-if-absent

The regional cache lets a region pull each checkpoint or update across regions once, however many
learners it has. It is kept for the life of the run and deleted with the run's prefix: it never
holds more than the global bucket's rounds, and a copy is made only when a learner needed it.

Checkpoints are named by their content so that two synchronizers racing on one round never
overwrite each other's bytes; only the manifest (put-if-absent) decides which one is the round.
"""

from __future__ import annotations

import re

from islands.core.config import NAME


def run_prefix(run: str) -> str:
    return f"runs/{run}/"


def config_key(run: str) -> str:
    return f"runs/{run}/config.json"


def stop_key(run: str) -> str:
    return f"runs/{run}/stop.json"


def drivers_prefix(run: str) -> str:
    return f"runs/{run}/drivers/"


def driver_key(run: str, epoch: int) -> str:
    return drivers_prefix(run) + f"{epoch:06d}.json"


def beat_key(run: str, epoch: int, seq: int) -> str:
    return drivers_prefix(run) + f"{epoch:06d}/beat-{seq:08d}"


def probe_key(token: str) -> str:
    return f"probes/{token}"


def round_prefix(run: str, round_: int) -> str:
    return f"runs/{run}/rounds/{round_:06d}/"


def rounds_prefix(run: str) -> str:
    return f"runs/{run}/rounds/"


def manifest_key(run: str, round_: int) -> str:
    return round_prefix(run, round_) + "manifest.json"


def eval_key(run: str, round_: int) -> str:
    return round_prefix(run, round_) + "eval.json"


def model_key(run: str, round_: int, sha256: str) -> str:
    return round_prefix(run, round_) + f"model-{sha256[:16]}.safetensors"


def outer_key(run: str, round_: int, sha256: str) -> str:
    return round_prefix(run, round_) + f"outer-{sha256[:16]}.safetensors"


def update_key(run: str, round_: int, sha256: str) -> str:
    return round_prefix(run, round_) + f"update-{sha256[:16]}.safetensors"


def cache_key(run: str, global_key: str) -> str:
    """Where a region keeps its copy of a round's object from the global bucket."""
    rounds = rounds_prefix(run)
    if not global_key.startswith(rounds):
        raise ValueError(f"{global_key} is not an object of a round of run {run}; only those are cached")
    return f"runs/{run}/cache/" + global_key[len(rounds) :]


def claim_key(cached_key: str) -> str:
    return cached_key.rsplit(".", 1)[0] + ".claim"


def deltas_prefix(run: str) -> str:
    return f"runs/{run}/deltas/"


def learner_deltas_prefix(run: str, learner: str) -> str:
    return f"runs/{run}/deltas/{learner}/"


def delta_key(run: str, learner: str, phase: int) -> str:
    return learner_deltas_prefix(run, learner) + f"{phase:06d}.safetensors"


def learner_state_prefix(run: str, learner: str) -> str:
    return f"runs/{run}/learners/{learner}/"


def learner_state_key(run: str, learner: str, phase: int) -> str:
    return learner_state_prefix(run, learner) + f"state-{phase:06d}.safetensors"


_ROUND_OBJECT = re.compile(r"runs/[^/]+/rounds/([0-9]{6})/", re.ASCII)
_ROUND_MANIFEST = re.compile(r"runs/[^/]+/rounds/([0-9]{6})/manifest\.json", re.ASCII)
# A delta key, whole: learners write it, so it is read by this one anchored ASCII pattern, and
# only its one spelling (`delta_key` of what it parses to) is a delta key: no other key (another
# case, a nested or doubled slash, non-ASCII digits, more leading zeros) names the same (learner,
# phase). Learner names are a region name, '-' and an index (RunConfig.learners).
_DELTA = re.compile(rf"runs/{NAME}/deltas/({NAME}-(?:0|[1-9][0-9]{{0,2}}))/([0-9]{{6,9}})\.safetensors", re.ASCII)
_STATE = re.compile(rf"runs/{NAME}/learners/{NAME}-[0-9]{{1,3}}/state-([0-9]{{6,9}})\.safetensors", re.ASCII)
_DRIVER = re.compile(r"runs/[^/]+/drivers/([0-9]{6})(?:\.json|/beat-([0-9]{8}))", re.ASCII)


def parse_manifest_key(key: str) -> int | None:
    """Round number of a manifest key, None for any other key."""
    m = _ROUND_MANIFEST.fullmatch(key)
    return int(m.group(1)) if m else None


def parse_round_key(key: str) -> int | None:
    """Round number of any object of a round (its manifest, checkpoints, evaluation), None otherwise."""
    m = _ROUND_OBJECT.match(key)
    return int(m.group(1)) if m else None


def parse_delta_key(key: str) -> tuple[str, int] | None:
    """(learner, phase) of a delta key, None for any other key (see _DELTA)."""
    m = _DELTA.fullmatch(key)
    if m is None or key != delta_key(key.split("/", 2)[1], m.group(1), int(m.group(2))):
        return None
    return m.group(1), int(m.group(2))


def parse_state_key(key: str) -> int | None:
    """Phase of a learner-state key, None for any other key."""
    m = _STATE.fullmatch(key)
    return int(m.group(1)) if m and key.endswith(f"state-{int(m.group(1)):06d}.safetensors") else None


def parse_driver_key(key: str) -> tuple[int, int | None] | None:
    """(epoch, beat seq) of a driver key — seq None for the claim itself — None for any other key."""
    m = _DRIVER.fullmatch(key)
    return (int(m.group(1)), int(m.group(2)) if m.group(2) else None) if m else None


def liveness_prefix(run: str) -> str:
    return f"runs/{run}/liveness/"


def liveness_key(run: str, learner: str, epoch: int, seq: int, state: str) -> str:
    """A learner's launch ("up") or death ("down") as its driver of epoch `epoch` saw it, event `seq`."""
    return liveness_prefix(run) + f"{learner}/{epoch:06d}-{seq:04d}-{state}.json"


_LIVENESS = re.compile(
    rf"runs/{NAME}/liveness/({NAME}-[0-9]{{1,3}})/([0-9]{{6}})-([0-9]{{4}})-(up|down)\.json", re.ASCII
)


def parse_liveness_key(key: str) -> tuple[str, int, int, str] | None:
    """(learner, epoch, seq, state) of a liveness key, None for any other key."""
    m = _LIVENESS.fullmatch(key)
    return (m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)) if m else None
