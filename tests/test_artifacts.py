"""What the UI is given, built from manifests alone: the round table, manifest links, the loss
chart and the run report; and how `islands status` judges a learner alive, late or dead."""

from __future__ import annotations

import base64
import xml.etree.ElementTree as ET

import pytest

from islands.core.config import MergeSettings, QuorumSettings
from islands.flows import cli, commands
from islands.flows.artifacts import browser_url, loss_curves, report_markdown, round_table
from islands.ops import status
from islands.ops.plot import data_uri, line_chart
from islands.ops.status import NoSuchRun, liveness
from islands.storage.manifest import Contribution, Excluded, Manifest, ObjectRef, Quorum, RoundSettings
from islands.storage.store import Stores

SVG = "{http://www.w3.org/2000/svg}"


def contribution(learner: str, phase: int, tokens: int, loss: float, staleness: int = 0) -> Contribution:
    return Contribution(
        learner=learner,
        region=learner.rsplit("-", 1)[0],
        phase=phase,
        base_round=0,
        staleness=staleness,
        tokens=tokens,
        tokens_counted=tokens,
        weight=tokens / (1 + staleness),
        loss=loss,
        bytes=1000,
        key=f"k/{learner}/{phase}",
        sha256="ef" * 32,
        finished_at=1.75e9,
        seconds=3.0,
        seen_at=1.75e9 + 0.5,
    )


def manifest(round_: int, eval_loss: float, contributions=(), excluded=()) -> Manifest:
    return Manifest(
        run="run-abc",
        round=round_,
        parent_round=round_ - 1 if round_ else None,
        parent_sha256=None,
        created_at="2026-01-01T00:00:00+00:00",
        model=ObjectRef(key="m", sha256="cd" * 32, bytes=10),
        outer=None,
        contributions=list(contributions),
        excluded=list(excluded),
        settings=RoundSettings(merge=MergeSettings(), quorum=QuorumSettings(min_quorum=1), num_learners=2),
        quorum=Quorum(
            received=len(contributions),
            learners=[],
            waited_s=1.5,
            closed_by="quorum+grace" if round_ else "initial",
        ),
        eval_loss=eval_loss,
    )


CHAIN = [
    manifest(0, 5.5),
    manifest(1, 4.0, [contribution("east-0", 0, 1000, 5.0), contribution("west-0", 0, 1000, 5.1)]),
    manifest(
        2,
        3.5,
        [contribution("east-0", 1, 1000, 4.2)],
        [
            Excluded(
                kind="quarantined",
                key="k/west-0/1",
                reason="non-finite values",
                learner="west-0",
                region="west",
                phase=1,
                tokens=1000,
            )
        ],
    ),
]


def test_round_table_lists_merged_and_quarantined_deltas_with_reasons():
    rows = round_table(CHAIN[2])
    assert [r["status"] for r in rows] == ["merged", "quarantined: non-finite values"]
    assert rows[0] | {"weight": None} == {
        "learner": "east-0",
        "region": "east",
        "phase": 1,
        "base round": 0,
        "staleness": 0,
        "tokens": 1000,
        "weight": None,
        "loss": 4.2,
        "bytes": 1000,
        "status": "merged",
    }
    assert rows[1]["learner"] == "west-0" and rows[1]["weight"] == 0


def test_manifest_links_open_in_a_browser(monkeypatch):
    url = "s3://islands-global/runs/r/rounds/000001/manifest.json"
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert browser_url(url) == "http://127.0.0.1:9000/islands-global/runs/r/rounds/000001/manifest.json"
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert browser_url(url) == (
        "https://s3.console.aws.amazon.com/s3/object/islands-global?prefix=runs/r/rounds/000001/manifest.json"
    )
    assert browser_url("file:///data/global/m.json") == "file:///data/global/m.json"


def test_loss_curves_put_eval_and_training_loss_on_one_token_axis():
    curves = loss_curves(CHAIN)
    assert curves == {
        "global eval loss": [(0, 5.5), (2000, 4.0), (3000, 3.5)],
        "east-0 train loss": [(1000, 5.0), (3000, 4.2)],
        "west-0 train loss": [(1000, 5.1)],
    }


def test_line_chart_is_an_svg_with_one_polyline_per_series():
    svg = line_chart(loss_curves(CHAIN), "tokens", "loss")
    root = ET.fromstring(svg)
    assert root.tag == f"{SVG}svg"
    lines = root.findall(f"{SVG}polyline")
    assert len(lines) == 3
    # Lower loss is drawn higher up the page: y grows downwards in SVG.
    eval_points = [tuple(map(float, p.split(","))) for p in lines[0].get("points").split()]
    assert [x for x, _ in eval_points] == sorted(x for x, _ in eval_points)
    assert eval_points[0][1] < eval_points[-1][1]
    assert {t.text for t in root.iter(f"{SVG}text")} >= {"east-0 train loss", "tokens", "loss", "3k"}
    assert base64.b64decode(data_uri(svg).split(",", 1)[1]).decode() == svg


def test_line_chart_refuses_nothing_to_draw():
    with pytest.raises(ValueError, match="at least one finite point"):
        line_chart({"eval": [(0.0, float("nan"))]}, "x", "y")


def test_report_has_the_chart_quorum_decisions_bytes_and_where_things_are():
    summary = {
        "run_id": "run-abc",
        "eval_loss_round0": 5.5,
        "eval_loss_final": 3.5,
        "rounds_published": 2,
        "wall_s": 42.0,
        "ended": "round 2 reached the target eval loss 3.5 (3.5000)",
        "checkpoints": "s3://islands-global/runs/run-abc/rounds/",
        "bytes": {"east": {"written": 2_000_000, "read": 1_000_000}, "synchronizer": {"written": 5, "read": 7}},
    }
    rows = [
        {
            "round": m.round,
            "closed_by": m.quorum.closed_by,
            "learners": "x",
            "waited_s": 1.5,
            "eval_loss": m.eval_loss,
            "excluded": [f"{e.key}: {e.reason}" for e in m.excluded],
        }
        for m in CHAIN[1:]
    ]
    md = report_markdown(summary, rows, CHAIN, Stores("memory://islands-{bucket}", ["east", "west"]))
    assert "![loss curve of run-abc](data:image/svg+xml;base64," in md
    assert "at round 2, in 42 s. Ended: round 2 reached the target eval loss 3.5 (3.5000)." in md
    assert "| 2 | quorum+grace | 1/2 (Q_min 1) | 1.5 | x | k/west-0/1: non-finite values | 3.5000 |" in md
    assert "| east | 2.00 MB | 1.00 MB |" in md
    assert "- west: deltas and learner states under `memory://islands-west/runs/run-abc/`" in md
    assert "`memory://islands-global/runs/run-abc/config.json`" in md


@pytest.mark.parametrize(
    "finished,flow_state,age,usual,expected",
    [
        (False, "RUNNING", 5.0, 10.0, "alive"),
        (False, None, 25.0, 10.0, "late"),
        (False, "RUNNING", 60.0, 10.0, "dead"),
        (False, "CRASHED", 1.0, 10.0, "dead"),
        (False, "RUNNING", 30.0, None, "starting"),
        (True, "RUNNING", 500.0, 10.0, "done"),
        (False, "COMPLETED", 500.0, 10.0, "done"),
    ],
)
def test_liveness(finished, flow_state, age, usual, expected):
    assert liveness(finished, flow_state, age, usual) == expected


def test_a_watch_waits_for_the_run_and_ends_once_it_is_finished(monkeypatch):
    looks = iter([NoSuchRun("r: no such run"), {"state": "running"}, {"state": "finished"}, {"state": "not looked at"}])

    def look(run_id, store):
        seen = next(looks)
        if isinstance(seen, Exception):
            raise seen
        return seen

    monkeypatch.setattr(status, "run_status", look)
    slept = []
    out = [str(x) if isinstance(x, NoSuchRun) else x["state"] for x in status.watch("r", None, 2.5, sleep=slept.append)]
    assert out == ["r: no such run", "running", "finished"] and slept == [2.5, 2.5]


def test_a_watch_needs_seconds_between_looks(capsys):
    assert cli.main(["status", "run-r", "--watch", "0"]) == commands.EXIT_CONFIG
    assert "--watch 0: give the seconds between two looks" in capsys.readouterr().err
