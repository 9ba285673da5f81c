"""Serve the learner deployment on this machine: each learner flow run becomes a local process.

The embedded stack runs this as its learner runner; on a cluster the same flow is deployed to
one work pool per region instead (infra/prefect.yaml).
"""

from __future__ import annotations

from prefect import serve

from flows.learner import learner

DEPLOYMENT = "local"


def main() -> None:
    serve(learner.to_deployment(name=DEPLOYMENT, description="Learners as processes on this machine."), limit=64)


if __name__ == "__main__":
    main()
