"""What the Prefect UI shows: a table and a manifest link per round, a progress bar per run, and a
report with the loss curve, the quorum decisions, the bytes sent and where everything is.

Each round also leaves the sha256 of its manifest as the synchronizer committed it, in an artifact
of its own: a second witness of the chain's head, kept by the Prefect API rather than the
buckets, so a rewrite of the whole chain in storage (every manifest re-hashed consistently, which
the chain alone cannot show) still differs from it. `islands audit` compares them (ops.witness).
"""

from __future__ import annotations

import os
from urllib.parse import quote, urlparse

from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from islands.core.config import RunConfig
from islands.core.validate import read_field
from islands.ops.plot import data_uri, line_chart
from islands.ops.progress import loss_text
from islands.storage import layout
from islands.storage.manifest import Manifest
from islands.storage.rounds import reported_metadata
from islands.storage.store import Stores


def round_table(manifest: Manifest) -> list[dict]:
    rows = [
        {
            "learner": c.learner,
            "region": c.region,
            "phase": c.phase,
            "base round": c.base_round,
            "staleness": c.staleness,
            "tokens": c.tokens,
            "weight": round(c.weight, 1),
            "loss": round(c.loss, 4),
            "bytes": c.bytes,
            "status": "merged",
        }
        for c in manifest.contributions
    ]
    rows += [
        {
            "learner": e.learner,
            "region": e.region,
            "phase": e.phase,
            "base round": None,
            "staleness": None,
            "tokens": e.tokens,
            "weight": 0,
            "loss": None,
            "bytes": None,
            "status": f"{e.kind}: {e.reason}",
        }
        for e in manifest.excluded
    ]
    return rows


def browser_url(url: str) -> str:
    """A link a browser can open for an object URL: the embedded endpoint serves objects over plain
    HTTP; real S3 objects open in the AWS console; local folders stay file:// URLs."""
    parsed = urlparse(url)
    if parsed.scheme != "s3":
        return url
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        return f"{endpoint.rstrip('/')}/{parsed.netloc}{parsed.path}"
    return f"https://s3.console.aws.amazon.com/s3/object/{parsed.netloc}?prefix={quote(parsed.path.lstrip('/'))}"


def witness_key(run: str, round_: int) -> str:
    return f"{run}-round-{round_:03d}-sha256"


def publish_round_artifacts(manifest: Manifest, manifest_url: str, sha256: str) -> None:
    """The round's table, its manifest link and the witness of its manifest's sha256."""
    q, rule = manifest.quorum, manifest.settings
    key = f"{manifest.run}-round-{manifest.round:03d}"
    link = browser_url(manifest_url)
    create_table_artifact(
        round_table(manifest),
        key=key,
        description=(
            f"{manifest.run} round {manifest.round}: closed by {q.closed_by} with {q.received}/{rule.max_quorum} learners "
            f"(Q_min {rule.quorum.min_quorum}) after {q.waited_s:.1f} s; eval loss {loss_text(manifest.eval_loss)}; "
            f"{len(manifest.excluded)} excluded. Manifest: [{manifest_url}]({link})"
        ),
    )
    create_link_artifact(
        link,
        link_text=manifest_url,
        key=f"{key}-manifest",
        description=f"{manifest.run} round {manifest.round}: manifest",
    )
    create_table_artifact(
        [{"round": manifest.round, "manifest": manifest_url, "sha256": sha256}],
        key=witness_key(manifest.run, manifest.round),
        description=(
            f"{manifest.run} round {manifest.round}: the sha256 of its manifest as committed, a witness of the chain "
            "kept outside storage (`islands audit` compares it)"
        ),
    )


class RunProgress:
    """A progress artifact that moves with the published rounds."""

    def __init__(self, run: str, rounds: int, done: int):
        self.run, self.rounds = run, rounds
        self.id = create_progress_artifact(
            100.0 * done / rounds, key=f"{run}-progress", description=f"{run}: rounds published"
        )

    def update(self, done: int) -> None:
        update_progress_artifact(
            self.id, 100.0 * done / self.rounds, description=f"{self.run}: {done}/{self.rounds} rounds"
        )

    def end(self, why: str) -> None:
        """Full once the run is over, also when it ends early at its target loss."""
        update_progress_artifact(self.id, 100.0, description=f"{self.run}: {why}")


def loss_curves(manifests: list[Manifest]) -> dict[str, list[tuple[float, float]]]:
    """Global eval loss per round and each learner's training loss per merged delta, both against
    the tokens merged into the global model so far."""
    curves: dict[str, list[tuple[float, float]]] = {"global eval loss": []}
    merged = 0
    for m in manifests:
        for c in sorted(m.contributions, key=lambda c: (c.learner, c.phase)):
            curves.setdefault(f"{c.learner} train loss", []).append((merged + c.tokens_counted, c.loss))
        merged += sum(c.tokens_counted for c in m.contributions)
        if m.eval_loss is not None:
            curves["global eval loss"].append((merged, m.eval_loss))
    return curves


def bytes_sent(config: RunConfig, stores: Stores, manifests: list[Manifest]) -> dict[str, dict[str, int]]:
    """Bytes each region's learners wrote and read, and the synchronizer's, for the run's summary.

    Nothing a learner says about itself is taken on its word alone: what a region wrote is what
    its bucket holds of the run, as the store lists it (deltas, learner states, cached rounds);
    what it read, the counters of each learner's newest delta that a round merged, so one that
    passed the synchronizer's checks, read within their bounds. An object planted under a
    learner's keys, or a delta no round took, moves neither."""
    newest: dict[str, tuple[int, str, str]] = {}  # learner → (phase, region, key) of its newest merged delta
    for m in manifests:
        for c in m.contributions:
            if c.phase >= newest.get(c.learner, (-1, "", ""))[0]:
                newest[c.learner] = (c.phase, c.region, c.key)
    out = {}
    for region in config.regions:
        store = stores.region(region)
        read = 0
        for _, where, key in newest.values():
            if where == region:
                read += read_field(reported_metadata(store, key), "io_read", 0)
        out[region] = {"written": sum(store.list(layout.run_prefix(config.run_id)).values()), "read": read}
    g = stores.global_.io
    out["synchronizer"] = {
        "written": g.bytes_written,
        "read": g.bytes_read + sum(s.io.bytes_read for s in stores.regions.values()),
    }
    return out


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB"


def report_markdown(summary: dict, rows: list[dict], manifests: list[Manifest], stores: Stores) -> str:
    run = summary["run_id"]
    chart = line_chart(loss_curves(manifests), "tokens merged into the global model", "loss (nats/byte)")
    lines = [
        f"# {run}",
        "",
        f"Eval loss {loss_text(summary['eval_loss_round0'])} at round 0 → {loss_text(summary['eval_loss_final'])} at round "
        f"{summary['rounds_published']}, in {summary['wall_s']:.0f} s."
        + (f" Ended: {summary['ended']}." if summary.get("ended") else ""),
        "",
        f"![loss curve of {run}]({data_uri(chart)})",
        "",
        "## Quorum decisions",
        "",
        "| round | closed by | learners in | waited s | contributors (learner@staleness) | excluded | eval loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for r, m in zip(rows, manifests[1:]):
        q, rule = m.quorum, m.settings
        excluded = "; ".join(r["excluded"]) or "—"
        lines.append(
            f"| {r['round']} | {r['closed_by']} | {q.received}/{rule.max_quorum} (Q_min {rule.quorum.min_quorum}) | {r['waited_s']:.1f} "
            f"| {r['learners']} | {excluded} | {loss_text(r['eval_loss'])} |"
        )
    lines += ["", "## Bytes sent", "", "| who | wrote | read |", "|---|---|---|"]
    lines += [f"| {who} | {_mb(b['written'])} | {_mb(b['read'])} |" for who, b in summary["bytes"].items()]
    g = stores.global_.url
    lines += [
        "",
        "## Where everything is",
        "",
        f"- config: `{g}/{layout.config_key(run)}`",
        f"- checkpoints, outer state and manifests: `{summary['checkpoints']}`",
    ]
    lines += [
        f"- {region}: deltas and learner states under `{s.url}/{layout.run_prefix(run)}`"
        for region, s in stores.regions.items()
    ]
    lines += ["", f"Check it: `islands status {run}`, `islands audit {run} --replay`."]
    return "\n".join(lines)


def publish_report(summary: dict, rows: list[dict], manifests: list[Manifest], stores: Stores) -> None:
    run = summary["run_id"]
    create_markdown_artifact(
        report_markdown(summary, rows, manifests, stores), key=f"{run}-report", description=f"{run}: run report"
    )
