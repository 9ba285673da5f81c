"""The deployments of one machine, served by this process: training-run, outer-round, learner.

`islands serve` registers them against the Prefect API in use and turns every flow run started
from the UI, the API or a schedule into a local process. Parameters are pydantic models, so the
UI's run form shows every field with its default and help text, and the server refuses a value
the schema forbids (enforce_parameter_schema). The embedded stack's learner runner is this
module run as `python -m islands.flows.serve`: it serves the learner deployment alone.

Each flow run is a fork of one warm process that has imported torch, Prefect and the flows
already, not a fresh interpreter that imports them again for every learner.

On clusters the same flows are deployed to work pools instead (islands/infra/prefect.yaml).
"""

from __future__ import annotations

import asyncio
import copyreg
import multiprocessing
import multiprocessing.forkserver
import sys
from dataclasses import dataclass, field
from datetime import timedelta

import prefect.flow_engine
from prefect import Flow
from prefect.exceptions import TerminationSignal
from prefect.runner import Runner

from islands.core.config import RunConfig
from islands.flows.learner import learner
from islands.flows.outer_round import outer_round
from islands.flows.training_run import training_run

DEPLOYMENT = "local"
# Runs this machine may execute at once: every learner of a run plus its driver.
RUN_LIMIT = 64
# What the fork server imports once, so that a flow run starts in a fraction of a second.
# torch._dynamo (with sympy) is imported by torch.optim when a learner builds its optimizer, and
# s3fs (with aiobotocore and aiohttp) by fsspec when a learner opens its first store: each fork
# would import them again.
PRELOAD = ["islands.flows.learner", "islands.flows.outer_round", "islands.flows.training_run", "torch._dynamo", "s3fs"]


@dataclass(frozen=True)
class Deployment:
    """A flow and the options of its deployment `<flow>/local`."""

    flow: Flow
    options: dict = field(default_factory=dict)

    @property
    def full_name(self) -> str:
        return f"{self.flow.name}/{DEPLOYMENT}"


def learner_deployment() -> Deployment:
    return Deployment(learner, {"description": "Learners as processes on this machine.", "tags": ["islands"]})


def driver_deployments(config: RunConfig, interval_s: float | None = None, cron: str | None = None) -> list[Deployment]:
    """training-run/local (with `config` as the form's defaults and an optional schedule) and
    outer-round/local (to publish or retry one round by hand)."""
    run = Deployment(
        training_run,
        {
            "description": "Train a run: launch the learners, publish outer rounds, report.",
            "parameters": {"config": config.model_dump(mode="json")},
            "interval": timedelta(seconds=interval_s) if interval_s is not None else None,
            "cron": cron,
            "enforce_parameter_schema": True,
            "tags": ["islands"],
        },
    )
    round_ = Deployment(
        outer_round,
        {
            "description": "Publish one outer round of an existing run from the deltas already in storage.",
            "enforce_parameter_schema": True,
            "tags": ["islands"],
        },
    )
    return [run, round_]


class ForkServer:
    """Stands in for the `multiprocessing` module inside prefect.flow_engine, which starts a
    served flow's runs with get_context("spawn"): a fresh interpreter per run."""

    context = multiprocessing.context

    def __init__(self, preload: list[str]) -> None:
        self._ctx = multiprocessing.get_context("forkserver")
        self._ctx.set_forkserver_preload(preload)

    def get_context(self, method: str | None = None) -> multiprocessing.context.BaseContext:
        return self._ctx


def _by_reference(flow: Flow) -> tuple:
    """Pickle a module-level flow as its module's attribute. The fork has the module imported,
    and a flow pickled by value keeps only the globals its code names: `config: RunConfig`
    would no longer resolve when Prefect validates the run's parameters."""
    module = sys.modules[flow.fn.__module__]
    if getattr(module, flow.fn.__name__, None) is flow:
        return getattr, (module, flow.fn.__name__)
    return object.__reduce_ex__(flow, 2)


def fork_flow_runs(preload: list[str]) -> None:
    """Start this process's flow runs as forks of a server that has imported `preload`; start
    that server now, so that it is warm before the first run."""
    prefect.flow_engine.multiprocessing = ForkServer(preload)  # type: ignore[assignment]
    copyreg.pickle(Flow, _by_reference)
    multiprocessing.forkserver.ensure_running()


def serve_deployments(deployments: list[Deployment]) -> None:
    """Register the deployments and run their flow runs here until interrupted. They are added
    as flows (Runner.add_flow), so runs start from the flow in memory, not from its entrypoint."""
    fork_flow_runs(PRELOAD)
    runner = Runner(limit=RUN_LIMIT)
    for d in deployments:
        runner.add_flow(d.flow, name=DEPLOYMENT, **d.options)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal):
        pass


if __name__ == "__main__":
    serve_deployments([learner_deployment()])
