"""`islands status RUN`: where a run stands, from its buckets and, when reachable, the Prefect API.

Storage is the truth for rounds and deltas; Prefect adds whether a learner's flow run is still
running. A learner is *alive* while its newest delta is younger than a few of its usual phase
times, *late* past that, *dead* well past it or when its flow run ended badly.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterator
from datetime import datetime

from islands.core.config import EMBEDDED_STORE, RunConfig
from islands.core.validate import read_field
from islands.ops.progress import loss_text
from islands.storage import layout
from islands.storage.manifest import Manifest
from islands.storage.rounds import read_chain, read_config, reported_metadata, stop_requested, with_eval_losses
from islands.storage.store import ObjectMissing, StoreError, Stores

LATE_AFTER = 2.0  # usual phase times without a new delta before a learner counts as late
DEAD_AFTER = 5.0  # ... and as dead
BAD_ENDINGS = {"FAILED", "CRASHED", "CANCELLED", "CANCELLING"}


def locate(store: str | None) -> str:
    """The store template to read: --store; else the S3 endpoint in the environment; else a running
    `islands up` (whose API is then used too)."""
    from islands.infra.stack import default_data_dir, find_running, stack_env

    if store is not None:
        return store
    if os.environ.get("AWS_ENDPOINT_URL"):
        return EMBEDDED_STORE
    data_dir = default_data_dir()
    running = find_running(data_dir)
    if running:
        env = stack_env(data_dir, running["s3_url"], running["api_url"])
        os.environ.update({k: v for k, v in env.items() if k not in os.environ})
        return EMBEDDED_STORE
    raise StoreError(
        f"no store to read: pass --store, set AWS_ENDPOINT_URL, or start `islands up` to serve the buckets "
        f"kept in {data_dir / 'seaweedfs'}"
    )


def learner_flow_states(run_id: str) -> dict[str, str] | None:
    """State of each learner's newest flow run tagged with the run, or None without a reachable API."""
    from islands.infra.prefect_server import api_healthy

    api = os.environ.get("PREFECT_API_URL")
    if not api or not api_healthy(api):
        return None
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, FlowRunFilterTags
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=[run_id]), name=FlowRunFilterName(like_="learner-")
            ),
            sort=FlowRunSort.EXPECTED_START_TIME_ASC,
        )
    # Ascending, so a restarted learner's newest run wins.
    return {r.name.removeprefix("learner-"): r.state.type.value for r in runs if r.state}


def round_row(m: Manifest) -> dict:
    return {
        "round": m.round,
        "closed_by": m.quorum.closed_by,
        "received": m.quorum.received,
        "max_quorum": m.settings.max_quorum,
        "contributors": [f"{c.learner}@s{c.staleness}" for c in m.contributions],
        "excluded": [f"{e.key}: {e.reason}" for e in m.excluded],
        "eval_loss": m.eval_loss,
        "tokens_applied": m.tokens_applied,
        "created_at": m.created_at,
    }


READ_AT_MOST = 16  # objects read back from a learner's newest key, looking for its newest delta


def newest_delta(stores: Stores, run: str, learner: str, region: str) -> dict | None:
    """Phase, finish time and phase seconds of the learner's newest delta, from its metadata.

    Newest by phase, among the objects under its delta keys that read as its deltas (`reports`):
    anyone holding its keys may write anything there, and a key of junk is not its newest delta
    (nor is a finish time of 0, in 1970). At most READ_AT_MOST of them are read, newest first."""
    store = stores.region(region)
    phases = {
        parsed[1]: key
        for key in store.list(layout.learner_deltas_prefix(run, learner))
        if (parsed := layout.parse_delta_key(key)) and parsed[0] == learner
    }
    for phase in sorted(phases, reverse=True)[:READ_AT_MOST]:
        meta = reported_metadata(store, phases[phase])
        # The learner's own words: read within their bounds, so no delta can make status fail.
        if reports(meta, run, learner, region, phase):
            return {
                "phase": phase,
                "finished_at": read_field(meta, "finished_at", 0.0),
                "seconds": read_field(meta, "seconds", 0.0),
            }
    return None


def reports(meta: dict, run: str, learner: str, region: str, phase: int) -> bool:
    """Whether a delta's metadata reads as the report of its key's phase: it names the run, the
    learner, its region and the key's phase, and says when it finished."""
    said = {name: read_field(meta, name, "") for name in ("run", "learner", "region", "phase")}
    return said == {"run": run, "learner": learner, "region": region, "phase": phase} and (
        read_field(meta, "finished_at", 0.0) > 0
    )


def liveness(finished: bool, flow_state: str | None, age_s: float, usual_s: float | None) -> str:
    """alive / late / dead / done, from the flow run's state and how overdue the next delta is."""
    if flow_state in BAD_ENDINGS:
        return "dead"
    if finished or flow_state == "COMPLETED":
        return "done"
    if usual_s is None:
        return "starting"
    if age_s <= LATE_AFTER * usual_s:
        return "alive"
    return "late" if age_s <= DEAD_AFTER * usual_s else "dead"


def learner_rows(
    config: RunConfig, stores: Stores, chain: list[Manifest], finished: bool, states: dict[str, str] | None, now: float
) -> list[dict]:
    started = datetime.fromisoformat(chain[0].created_at).timestamp()
    rows = []
    for learner, region, _ in config.learners():
        merged = [c for m in chain for c in m.contributions if c.learner == learner]
        newest = newest_delta(stores, config.run_id, learner, region)
        seconds = [c.seconds for c in merged] or ([newest["seconds"]] if newest else [])
        usual = statistics.median(seconds) + config.learner_wait_s if seconds else None
        age = now - (newest["finished_at"] if newest else started)
        state = states.get(learner) if states is not None else None
        rows.append(
            {
                "learner": learner,
                "region": region,
                "status": liveness(finished, state, age, usual),
                "flow_run": state,
                "newest_phase": newest["phase"] if newest else None,
                "newest_delta_age_s": round(age, 1) if newest else None,
                "usual_phase_s": round(usual, 1) if usual is not None else None,
                "rounds_contributed": len(
                    {m.round for m in chain if any(c.learner == learner for c in m.contributions)}
                ),
                "tokens_merged": sum(c.tokens for c in merged),
            }
        )
    return rows


class NoSuchRun(StoreError):
    """The run has no config or no round 0 in the store (yet)."""


def run_status(run_id: str, store: str | None = None, now: float | None = None) -> dict:
    template = locate(store)
    # Prefect first: a watch pays for its import before the run it waits for starts.
    states = learner_flow_states(run_id)
    try:
        config = read_config(Stores(template, []).global_, run_id)
    except ObjectMissing:
        raise NoSuchRun(f"{run_id}: no such run in {template}; check the run id or pass --store") from None
    stores = Stores(template, config.regions)
    chain = with_eval_losses(stores.global_, [m for m, _ in read_chain(stores.global_, run_id)])
    if not chain:
        raise NoSuchRun(f"{run_id}: created in {template}, its round 0 not published yet")
    newest = chain[-1]
    finished = config.ended_by(newest.round, newest.eval_loss, newest.tokens_applied) is not None or stop_requested(
        stores.global_, run_id
    )
    return {
        "run_id": run_id,
        "store": template,
        "state": "finished" if finished else "running",
        "rounds_target": config.rounds,
        "target_loss": config.target_loss,
        "token_budget": config.token_budget,
        "tokens_applied": newest.tokens_applied,
        "rounds_published": chain[-1].round,
        "eval_loss": chain[-1].eval_loss,
        "prefect_api": os.environ.get("PREFECT_API_URL") if states is not None else None,
        "rounds": [round_row(m) for m in chain[1:]],
        "learners": learner_rows(config, stores, chain, finished, states, time.time() if now is None else now),
    }


def watch(run_id: str, store: str | None, every_s: float, sleep=time.sleep) -> Iterator[dict | NoSuchRun]:
    """The run's status every `every_s` seconds until it is finished. A run not created yet
    yields why and is waited for, so a watch can start before the run does."""
    while True:
        try:
            report = run_status(run_id, store)
        except NoSuchRun as exc:
            yield exc
        else:
            yield report
            if report["state"] == "finished":
                return
        sleep(every_s)


def render(s: dict) -> str:
    lines = [
        f"{s['run_id']}: {s['state']}, {s['rounds_published']}/{s['rounds_target']} rounds published; "
        f"latest eval loss {loss_text(s['eval_loss'])} (round {s['rounds_published']})"
        + (f", target {s['target_loss']:g}" if s["target_loss"] is not None else "")
        + (
            f"; {s['tokens_applied']:,} of {s['token_budget']:,} budgeted tokens merged"
            if s["token_budget"] is not None
            else ""
        ),
        f"store {s['store']}; Prefect {s['prefect_api'] or 'not reachable (learner states from storage only)'}",
        "",
        f"{'round':>5}  {'closed by':<12} {'in':>5}  {'eval loss':>9}  contributors (learner@staleness)",
    ]
    for r in s["rounds"]:
        extra = f"  excluded {len(r['excluded'])}" if r["excluded"] else ""
        lines.append(
            f"{r['round']:>5}  {r['closed_by']:<12} {r['received']:>2}/{r['max_quorum']:<2}  {loss_text(r['eval_loss']):>9}  "
            f"{', '.join(r['contributors'])}{extra}"
        )
    lines += [
        "",
        f"{'learner':<16} {'region':<12} {'status':<9} {'phase':>5} {'delta age':>9} {'usual':>7} {'rounds':>6}  flow run",
    ]
    for row in s["learners"]:
        age = f"{row['newest_delta_age_s']:.0f} s" if row["newest_delta_age_s"] is not None else "—"
        usual = f"{row['usual_phase_s']:.0f} s" if row["usual_phase_s"] is not None else "—"
        phase = row["newest_phase"] if row["newest_phase"] is not None else "—"
        lines.append(
            f"{row['learner']:<16} {row['region']:<12} {row['status']:<9} {phase:>5} {age:>9} {usual:>7} "
            f"{row['rounds_contributed']:>6}  {row['flow_run'] or '—'}"
        )
    return "\n".join(lines)
