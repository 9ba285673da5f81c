"""The deployments of one machine, served by this process: training-run, outer-round, learner.

`islands serve` registers them against the Prefect API in use and turns every flow run started
from the UI, the API or a schedule into a local process. Parameters are pydantic models, so the
UI's run form shows every field with its default and help text, and the server refuses a value
the schema forbids (enforce_parameter_schema). The embedded stack's learner runner is this
module run as `python -m flows.serve`: it serves the learner deployment alone.

On clusters the same flows are deployed to work pools instead (infra/prefect.yaml).
"""

from __future__ import annotations

from datetime import timedelta

from prefect import serve
from prefect.deployments.runner import RunnerDeployment

from flows.config import RunConfig
from flows.learner import learner
from flows.outer_round import outer_round
from flows.training_run import training_run

DEPLOYMENT = "local"
# Runs this machine may execute at once: every learner of a run plus its driver.
RUN_LIMIT = 64


def learner_deployment() -> RunnerDeployment:
    return learner.to_deployment(
        name=DEPLOYMENT, description="Learners as processes on this machine.", tags=["islands"],
    )


def driver_deployments(config: RunConfig, interval_s: float | None = None, cron: str | None = None) -> list[RunnerDeployment]:
    """training-run/local (with `config` as the form's defaults and an optional schedule) and
    outer-round/local (to publish or retry one round by hand)."""
    run = training_run.to_deployment(
        name=DEPLOYMENT,
        description="Train a run: launch the learners, publish outer rounds, report.",
        parameters={"config": config.model_dump(mode="json")},
        interval=timedelta(seconds=interval_s) if interval_s is not None else None,
        cron=cron,
        enforce_parameter_schema=True,
        tags=["islands"],
    )
    round_ = outer_round.to_deployment(
        name=DEPLOYMENT,
        description="Publish one outer round of an existing run from the deltas already in storage.",
        enforce_parameter_schema=True,
        tags=["islands"],
    )
    return [run, round_]


def serve_deployments(deployments: list[RunnerDeployment]) -> None:
    """Register the deployments and run their flow runs here until interrupted."""
    serve(*deployments, limit=RUN_LIMIT, print_starting_message=False)


if __name__ == "__main__":
    serve_deployments([learner_deployment()])
