"""The training-run flow (the driver): create or continue a run, launch learners, run outer
rounds until the last one, the target loss or the token budget, stop the learners, report.
Learners and synchronizer meet only in object storage, never in a collective: Decoupled DiLoCo
(arXiv 2604.21428) run as Prefect flows.

Learners are flow runs of a deployment, so on a cluster each runs in its region's work pool and
on one machine the local runner starts them as processes — the same call either way.

Each driver start claims a new epoch of the run's lease and keeps it beating (storage.lease); the
learners it launches follow that epoch. A resumed driver first waits for the learners of older
epochs to end — they stop as soon as they see the newer epoch — so one learner never has two
processes writing its phases.
"""

from __future__ import annotations

import json
import time
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment
from prefect.runtime import flow_run
from prefect.settings import temporary_settings
from prefect.states import Cancelling

from islands.core.config import RunConfig, new_run_id, store_template
from islands.flows.artifacts import RunProgress, bytes_sent, publish_report
from islands.flows.buckets import prepare_buckets
from islands.flows.chaos import Chaos
from islands.flows.learner_runs import retire_learners
from islands.flows.learner_watch import LearnerWatch
from islands.flows.outer_round import outer_round, summarize
from islands.ops.progress import ProgressView
from islands.storage import layout, lease
from islands.storage.rounds import evaluated, latest_round, read_chain, with_eval_losses
from islands.storage.store import Stores
from islands.tasks.crash import LEARNER_POINTS, armed, crash_point, parse
from islands.tasks.evaluate import round_loss
from islands.tasks.publish import publish_initial

LEARNER_EXIT_S = 120.0


def _name() -> str:
    cfg = flow_run.parameters["config"]
    run_id = cfg.get("run_id") if isinstance(cfg, dict) else cfg.run_id
    return run_id or "training-run"


def create_run(config: RunConfig, stores: Stores) -> None:
    """Write the run's config once; a different config under the same run id is refused."""
    body = json.dumps(config.model_dump(mode="json"), sort_keys=True, indent=1).encode()
    if not stores.global_.put_if_absent(layout.config_key(config.run_id), body):
        existing = json.loads(stores.global_.get(layout.config_key(config.run_id)))
        if existing != config.model_dump(mode="json"):
            raise ValueError(
                f"run {config.run_id} already exists with another config; choose a new --run-id or `islands resume`"
            )
    if latest_round(stores.global_, config.run_id) is None:
        publish_initial(config, config.run_id, stores)


def learner_crash() -> str | None:
    """The driver's crash setting when it names a learner point: the learners die there."""
    spec = armed()
    return spec if spec is not None and parse(spec)[0] in LEARNER_POINTS else None


def launch_learner(config: RunConfig, store: str, learner: str, region: str, epoch: int) -> UUID:
    fr = run_deployment(
        config.learner_deployment.replace("{region}", region).replace("{learner}", learner),
        parameters={
            "run_id": config.run_id,
            "learner": learner,
            "store": store,
            "driver": epoch,
            "crash": learner_crash(),
        },
        flow_run_name=f"learner-{learner}",
        timeout=0,
        tags=[config.run_id, region],
    )
    return fr.id


def wait_learners(ids: list[UUID], timeout_s: float, cancel: bool) -> dict[str, str]:
    """Wait for learner runs to end (they stop by themselves); cancel what is still running."""
    deadline = time.monotonic() + (0 if cancel else timeout_s)
    with get_client(sync_client=True) as client:
        while True:
            runs = [client.read_flow_run(i) for i in ids]
            running = [r for r in runs if not r.state or not r.state.is_final()]
            if not running or time.monotonic() >= deadline:
                break
            time.sleep(0.25)
        for r in running:
            client.set_flow_run_state(r.id, Cancelling(), force=True)
        return {r.name: (r.state.name if r.state else "?") for r in runs}


def run_round(run: str, round_: int, store: str) -> dict:
    """Outer round `round_` as a subflow of the driver, without a heartbeat of its own: it runs
    in the driver's process, whose heartbeat covers it, and Prefect's heartbeat thread sleeps in
    one-second steps, which held each round's end up to a second before the next could begin."""
    with temporary_settings(updates={"flows.heartbeat_frequency": None}):
        return outer_round(run_id=run, round=round_, store=store)


@flow(name="training-run", flow_run_name=_name)
def training_run(config: RunConfig, chaos: list[str] | None = None) -> dict:
    """Train until `config.rounds` outer rounds are published, or a round reaches
    `config.target_loss` or `config.token_budget`; returns the run summary.

    `chaos`: learner kills/restarts and synchronizer crashes to rehearse (flows.chaos), e.g.
    ["kill:eu-west@round3", "crash:synchronizer@publish.after_model"].
    """
    t0 = time.time()
    if config.run_id is None:
        config = config.model_copy(update={"run_id": new_run_id()})
    run, store = config.run_id, store_template(config)
    stores = Stores(store, config.regions)
    prepare_buckets(config, stores)
    create_run(config, stores)
    start = latest_round(stores.global_, run) or 0
    epoch = lease.claim(stores.global_, run, {"flow_run": str(flow_run.id), "from_round": start, "at": time.time()})
    with lease.Heartbeat(stores.global_, run, epoch):
        return drive(config, stores, start, epoch, Chaos.parse(chaos or []), t0)


def drive(config: RunConfig, stores: Stores, start: int, epoch: int, chaos: Chaos, t0: float) -> dict:
    """Rounds start+1..target under driver epoch `epoch`, then the summary."""
    log = get_run_logger()
    run, store = config.run_id, stores.template
    view = ProgressView(run)
    newest = read_chain(stores.global_, run)[-1][0]
    # A synchronizer that died between a round's manifest and its evaluation left it to us.
    newest = evaluated(newest, round_loss(config, stores.global_, newest))
    view.header(newest, config)
    progress = RunProgress(run, config.rounds, start)
    retired = retire_learners(run) if epoch > 0 else []
    if retired:
        log.warning("%s: learner runs %s of an earlier driver never ended; marked cancelled", run, ", ".join(retired))
    ended = config.ended_by(newest.round, newest.eval_loss, newest.tokens_applied)
    failed = None

    def report(line: str) -> None:
        log.warning("%s: %s", run, line)
        view.note(line)

    def launch(learner: str, region: str) -> UUID:
        flow_run_id = launch_learner(config, store, learner, region, epoch)
        watch.launched(learner, flow_run_id)
        return flow_run_id

    watch = LearnerWatch(config, stores.global_, epoch, report)
    with watch:
        if ended is None:
            for learner, region, _ in config.learners():
                launch(learner, region)
        log.info(
            "%s: %d learners launched under driver epoch %d; from round %d until %s",
            run,
            len(watch.flow_runs()),
            epoch,
            start + 1,
            config.end_rule(),
        )
        try:
            r = start
            while ended is None:
                r += 1
                chaos.crash_round(run, r, store)
                try:
                    published = run_round(run, r, store)
                except Exception:
                    if not watch.none_left():
                        raise
                    published = None
                if published is not None:
                    view.round(published)
                    progress.update(r)
                    crash_point("round.after_publish", r)
                    killed = [learner for learner, region, _ in config.learners() if region in chaos.due(r)]
                    watch.taken_down(killed, "stopped by --chaos")
                    chaos.after_round(run, r, config.learners(), launch)
                for learner, region in watch.to_relaunch():
                    launch(learner, region)
                    report(f"learner {learner} ({region}) relaunched from its saved state")
                if watch.none_left():
                    lost = "; ".join(f"{learner}: {why}" for learner, why in watch.given_up().items())
                    ended = failed = f"no learner left to train ({lost or 'all stopped'})"
                    r -= published is None
                else:
                    ended = config.ended_by(r, published["eval_loss"], published["tokens_applied"])
        finally:
            if ended is not None:
                log.info("%s: done: %s", run, ended)
                progress.end(ended)
                stores.global_.put_if_absent(layout.stop_key(run), json.dumps({"rounds": r, "why": ended}).encode())
            watch.stop()
            learner_ids = watch.flow_runs()
            learner_states = wait_learners(learner_ids, LEARNER_EXIT_S, cancel=ended is None) if learner_ids else {}
    lost = watch.given_up()
    if lost and failed is None:
        failed = "learners lost: " + "; ".join(f"{learner}: {why}" for learner, why in lost.items())
    if failed:
        log.error("%s: %s", run, failed)
    chain = with_eval_losses(stores.global_, [m for m, _ in read_chain(stores.global_, run)])
    rows = [summarize(m) for m in chain[1:]]
    summary = {
        "run_id": run,
        "rounds_published": chain[-1].round,
        "ended": ended,
        "eval_loss_round0": chain[0].eval_loss,
        "eval_loss_final": chain[-1].eval_loss,
        "bytes": bytes_sent(config, stores, chain),
        "wall_s": round(time.time() - t0, 1),
        "checkpoints": f"{stores.global_.url}/{layout.rounds_prefix(run)}",
        "learners": learner_states,
        "failed": failed,
        **({"chaos": chaos.log} if chaos.log else {}),
    }
    publish_report(summary, rows, chain, stores)
    view.footer(summary)
    return summary
