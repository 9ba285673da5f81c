"""What the Prefect UI shows: a table per round, a progress bar per run, a report at the end."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, update_progress_artifact

from storage.manifest import Manifest


def round_table(manifest: Manifest) -> list[dict]:
    rows = [
        {
            "learner": c.learner, "region": c.region, "phase": c.phase, "base round": c.base_round,
            "staleness": c.staleness, "tokens": c.tokens, "weight": round(c.weight, 1), "loss": round(c.loss, 4),
            "bytes": c.bytes, "status": "merged",
        }
        for c in manifest.contributions
    ]
    rows += [
        {
            "learner": e.learner, "region": e.region, "phase": e.phase, "base round": None, "staleness": None,
            "tokens": e.tokens, "weight": 0, "loss": None, "bytes": None, "status": f"{e.kind}: {e.reason}",
        }
        for e in manifest.excluded
    ]
    return rows


def publish_round_artifacts(manifest: Manifest, manifest_url: str) -> None:
    q = manifest.quorum
    create_table_artifact(
        round_table(manifest),
        key=f"{manifest.run}-round-{manifest.round:03d}",
        description=(
            f"{manifest.run} round {manifest.round}: closed by {q.closed_by} with {q.received}/{q.max_quorum} learners "
            f"after {q.waited_s:.1f} s; eval loss {manifest.eval_loss:.4f}. Manifest: {manifest_url}"
        ),
    )


class RunProgress:
    """A progress artifact that moves with the published rounds."""

    def __init__(self, run: str, rounds: int, done: int):
        self.run, self.rounds = run, rounds
        self.id = create_progress_artifact(100.0 * done / rounds, key=f"{run}-progress", description=f"{run}: rounds published")

    def update(self, done: int) -> None:
        update_progress_artifact(self.id, 100.0 * done / self.rounds, description=f"{self.run}: {done}/{self.rounds} rounds")


def publish_report(run: str, summary: dict, rows: list[dict], where: str) -> None:
    lines = [
        f"# {run}",
        "",
        f"Eval loss: {summary['eval_loss_round0']:.4f} at round 0 → {summary['eval_loss_final']:.4f} at round "
        f"{summary['rounds_published']}; {summary['wall_s']:.0f} s.",
        "",
        f"Checkpoints and manifests: `{where}`",
        "",
        "| round | closed by | learners | waited s | eval loss |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {r['round']} | {r['closed_by']} | {r['learners']} | {r['waited_s']:.1f} | {r['eval_loss']:.4f} |" for r in rows]
    create_markdown_artifact("\n".join(lines), key=f"{run}-report", description=f"{run}: run report")
