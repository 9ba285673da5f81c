"""The benchmark suite's fast part runs and prints its one table with a number in every row.

Only the format is checked, never the figures: they depend on the machine.
"""

import json
import re
import subprocess
import sys

from benchmarks.heldout import BATCH, PRESET
from benchmarks.report import Result, at_least, at_most, table, within
from islands.core.model import build_model


def test_table_rows_say_yes_or_no_against_their_bar():
    rows = [
        at_least("a", 16.0, 15),
        at_most("b", 1.05, 1.04, "why"),
        within("c", 1.2, 1.33, 0.15),
        at_least("d", None, 1, "not run"),
    ]
    text = table([Result("x", rows=rows)])
    lines = text.splitlines()
    assert lines[0] == "| benchmark | our figure | the bar | holds |"
    assert [line.rsplit("|", 2)[1].strip() for line in lines[2:]] == ["yes", "no", "yes", "no"]
    assert "n/a" in lines[-1] and rows[1].limit == "why" and rows[0].limit == ""


def test_quick_dataplane_prints_one_table_with_numbers(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "dataplane", "--only", "merge_memory"]
        + ["--out", str(tmp_path)]
        + ["--results", str(tmp_path / "results")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    start = lines.index("| benchmark | our figure | the bar | holds |")
    rows = [line for line in lines[start + 2 :] if line.startswith("|")]
    # throughput and memory at K=2 and K=4, SeaweedFS against moto at each, the merge's memory at
    # two sizes and their ratio, the suite's own time
    assert len(rows) == 10
    assert sum(row.startswith("| merge memory:") for row in rows) == 3
    assert rows[-1].startswith("| time: --quick suite, minutes |")
    for row in rows:
        _, name, ours, bar, holds, _ = (c.strip() for c in row.split("|"))
        assert name.startswith(("dataplane:", "merge memory:", "time:"))
        assert re.fullmatch(r"-?\d+(\.\d+)?(e[-+]?\d+)?", ours), row
        if "SeaweedFS / moto" in name:
            assert bar.startswith("none:") and holds == "—", row
        else:
            assert re.search(r"\d", bar) and holds in ("yes", "no")
    assert "raw:" in proc.stdout and "settings:" in proc.stdout
    assert (tmp_path / "dataplane-quick.md").read_text().startswith("| benchmark |")  # written as it finished
    written = (tmp_path / "results" / "latest.md").read_text()
    assert all(row in written for row in rows)  # the results file holds the printed table
    assert json.loads((tmp_path / "results" / "latest.json").read_text())["runs"][0]["parts"][0]["name"] == "dataplane"


def test_a_live_runs_schedule_replayed_with_its_own_codecs_rebuilds_its_model_bit_for_bit(tmp_path):
    """codec_live replays each of two pipeline runs from its objects alone (benchmarks.retrace):
    with the run's own codecs, the replay must land on the published model exactly."""
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--only", "codec_live", "--out", str(tmp_path)]
        + ["--results", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"rebuilds the published model bit for bit": true') == 2, proc.stdout[-3000:]
    assert proc.stdout.count("| codec on a live schedule, H=") == 2


def test_dataplane_splits_each_steps_cpu_by_process_and_kind():
    import os

    from benchmarks.dataplane import cpu_s, spent

    before = cpu_s(os.getpid())  # this process stands in for the server too
    sum(i * i for i in range(3_000_000))
    after = cpu_s(os.getpid())
    steps = spent([("start", before), ("work", after)])
    assert list(steps) == ["work"]
    assert set(steps["work"]) == {"user", "sys", "server_user", "server_sys"}
    assert steps["work"]["user"] > 0 and steps["work"]["server_user"] > 0


def test_a_part_that_fails_keeps_the_time_it_spent(tmp_path, monkeypatch):
    import time

    import benchmarks.__main__ as suite

    def broken(quick: bool) -> Result:
        time.sleep(0.6)
        raise RuntimeError("round 1 had nothing in")

    monkeypatch.setitem(suite.BENCHMARKS, "dataplane", broken)
    assert suite.main(["--quick", "--only", "dataplane", "--out", str(tmp_path), "--results", str(tmp_path)]) == 1
    report = (tmp_path / "dataplane-quick.md").read_text()
    assert "| dataplane: did not complete | n/a | runs | no |" in report
    assert "RuntimeError: round 1 had nothing in" in report
    assert "## dataplane (1 s)" in report  # not 0 s: the suite's time counts it


def test_a_part_keeps_the_stack_only_when_it_reads_the_part_before_it(tmp_path, monkeypatch):
    """Each full-size part starts on a new stack, as it would alone, except where it reads runs
    the part just before it made: so those pairs must stay next to each other in the suite.
    --quick runs every part on one stack."""
    import benchmarks.__main__ as suite

    assert suite.keeps_stack("faults", "utilization", quick=False)
    assert not suite.keeps_stack("quality", "wire", quick=False)  # wire's own budget: no run to share
    assert not suite.keeps_stack("utilization", "dataplane", quick=False)
    assert suite.keeps_stack("utilization", "dataplane", quick=True)
    order = list(suite.SUITE)
    assert order.index("utilization") == order.index("faults") + 1

    calls = []

    def part(name):
        return lambda quick: calls.append(name) or Result(name)

    monkeypatch.setattr(suite.pipeline, "new_stack", lambda: calls.append("new stack"))
    monkeypatch.setattr(suite, "BENCHMARKS", {name: part(name) for name in suite.SUITE})
    assert suite.main(["--out", str(tmp_path), "--results", str(tmp_path)]) == 0
    assert calls == [
        "new stack",
        "quality",
        "new stack",
        "wire",
        "new stack",
        "quality_robust",
        "new stack",
        "faults",
        "utilization",
        "new stack",
        "dataplane",
        "merge_memory",
        "learner_memory",
        "new stack",
        "large_run",
        "simulation",
    ]
    calls.clear()
    assert suite.main(["--quick", "--out", str(tmp_path), "--results", str(tmp_path)]) == 0
    assert calls == list(suite.SUITE)


def test_s3_endpoint_compares_cpu_per_request_of_both_servers():
    from benchmarks import s3_endpoint

    res = s3_endpoint.run(quick=True)
    (row,) = res.rows
    assert row.benchmark.startswith("S3 endpoint: CPU per request") and row.ours > 0
    assert all(
        ms > 0 for ms in res.raw["moto_server_cpu_ms_per_request"] + res.raw["s3_served_directly_cpu_ms_per_request"]
    )


def test_bare_trains_every_learner_at_once_each_in_a_fork():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bare", "--learners", "2", "--steps", "2", "--inner-steps", "1"],
        capture_output=True,
        text=True,
        check=True,
    )
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["steps"] for r in runs] == [2, 2]
    assert runs[0]["tokens"] == runs[1]["tokens"] == 2 * BATCH * build_model(PRESET, 0).config.block_size
