"""The results file: every run stamped with where its figures came from, and a part run alone
replacing its own section only. No benchmark runs here: the parts are stand-ins."""

import json
import re
import subprocess

import pytest

import benchmarks.__main__ as suite
from benchmarks import record
from benchmarks.report import Result, at_least, at_most, figure, table


def fake(figures: dict[str, float]):
    """Stand-ins for the parts, each reporting one row with its figure."""

    def part(name):
        return lambda quick: Result(
            name, rows=[at_least(f"{name}: ratio", figures[name], 1.0, "why")], raw={"x": figures[name]}
        )

    return {name: part(name) for name in figures}


def read_json(directory) -> dict:
    return json.loads((directory / "latest.json").read_text())


def sections(directory) -> dict[str, dict]:
    """Each part's section with the run that wrote it."""
    return {p["name"]: {**p, "run": run} for run in read_json(directory)["runs"] for p in run["parts"]}


def test_the_writer_stamps_a_run_with_commit_date_machine_and_wall_time(tmp_path):
    res = Result("wire", rows=[at_least("wire: ring / ours", 16.5, 15), at_most("wire: loss", 1.01, 1.005, "why")])
    res.raw, res.settings, res.seconds = {"sent": 123}, {"H": 10}, 42.0
    run = record.finish(record.stamp(["--only", "wire"], False, ["wire"]), 43.5, None)
    run["parts"] = [record.part(res, suite.part_time(res, quick=False))]
    record.write(tmp_path, run, suite.ORDER)

    (written,) = read_json(tmp_path)["runs"]
    assert re.fullmatch(r"[0-9a-f]{40}", written["commit"])
    assert written["commit"] == subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    assert isinstance(written["dirty"], bool) and isinstance(written["changed"], list)
    for when in ("started", "finished"):
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", written[when])
    m = written["machine"]
    assert m["cores"] >= 1 and m["cpu_model"] and m["memory_gib"] > 0 and m["python"] and m["torch"]
    assert written["wall_s"] == 43.5 and written["command"] == "python -m benchmarks --only wire"
    (part,) = written["parts"]
    assert part["raw"] == {"sent": 123} and part["settings"] == {"H": 10} and part["seconds"] == 42.0
    assert [r["ours"] for r in part["rows"]] == [16.5, 1.01] and part["time_row"]["bar"] == "≤ 25"

    md = (tmp_path / "latest.md").read_text()
    assert "| wire: ring / ours | 16.5 | ≥ 15 | yes |" in md
    assert "| wire: loss | 1.01 | ≤ 1.005 | no |" in md and "- missed: wire: loss: why" in md
    assert "| time: wire, minutes | 0.7 | ≤ 25 | yes |" in md
    assert f"`{written['commit']}`" in md and written["started"] in md and m["cpu_model"] in md
    assert "0.7 minutes (44 s) for wire" in md and '"sent": 123' in md and '"H": 10' in md


def test_a_part_run_alone_replaces_its_section_and_keeps_the_others(tmp_path, monkeypatch):
    monkeypatch.setattr(suite.pipeline, "new_stack", lambda: None)
    args = ["--out", str(tmp_path / "out"), "--results", str(tmp_path)]
    monkeypatch.setattr(suite, "BENCHMARKS", fake({name: 2.0 for name in suite.SUITE}))
    assert suite.main(args) == 0
    first = sections(tmp_path)
    assert list(first) == list(suite.SUITE)
    (suite_run,) = read_json(tmp_path)["runs"]
    assert suite_run["time_row"]["benchmark"] == "time: whole suite, minutes"
    assert suite_run["time_row"]["holds"] is None  # the whole suite's time is reported, not judged

    monkeypatch.setattr(suite, "BENCHMARKS", fake({"wire": 3.0, "codec": 0.5}))
    assert suite.main(["--only", "wire", "--only", "codec", *args]) == 0
    after = sections(tmp_path)
    assert after["wire"]["raw"] == {"x": 3.0} and after["codec"]["raw"] == {"x": 0.5}
    assert after["wire"]["run"]["started"] >= first["wire"]["run"]["started"]
    for name in set(suite.SUITE) - {"wire"}:
        assert after[name]["raw"] == {"x": 2.0}
        assert (
            after[name]["run"]["command"] == first[name]["run"]["command"] == f"python -m benchmarks {' '.join(args)}"
        )
    runs = read_json(tmp_path)["runs"]
    assert [[p["name"] for p in r["parts"]] for r in runs] == [
        ["quality", "quality_robust", "faults", "utilization", "dataplane", "merge_memory", "learner_memory"]
        + ["large_run", "simulation"],
        ["wire", "codec"],
    ]
    assert runs[1]["time_row"] is None  # two full-size parts: each part's own time row, no run row

    md = (tmp_path / "latest.md").read_text()
    assert md.count("## Run ") == 2
    assert "- sections since replaced by a later run: wire" in md
    assert "| wire: ratio | 3 | ≥ 1 | yes |" in md and "| quality: ratio | 2 | ≥ 1 | yes |" in md
    assert "| codec: ratio | 0.5 | ≥ 1 | no |" in md

    monkeypatch.setattr(suite, "BENCHMARKS", fake({"quality": 4.0}))
    assert suite.main(["--quick", "--only", "quality", *args]) == 0
    runs = read_json(tmp_path)["runs"]
    assert [r["quick"] for r in runs] == [True, False, False]  # the quick run holds quality, the first section
    assert runs[0]["time_row"]["benchmark"] == "time: --quick suite, minutes"
    assert "`--quick`: a smoke test at toy sizes" in (tmp_path / "latest.md").read_text()


def test_a_results_file_it_did_not_write_stops_the_run_before_it_starts(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(suite, "BENCHMARKS", {"wire": lambda quick: calls.append(quick) or Result("wire")})
    (tmp_path / "latest.json").write_text('{"rows": []}')
    with pytest.raises(SystemExit) as stop:
        suite.main(["--only", "wire", "--out", str(tmp_path / "out"), "--results", str(tmp_path)])
    assert stop.value.code == 2 and calls == []
    assert "latest.json: not a results file python -m benchmarks wrote" in capsys.readouterr().err


def test_the_tree_is_dirty_for_any_change_but_the_results_file(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code")
    (tmp_path / "benchmarks" / "results" / "latest.md").write_text("# results\n")
    clean = record.source(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{40}", clean["commit"]) and clean["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert record.source(tmp_path) | {"commit": None} == {"commit": None, "dirty": True, "changed": ["code.py"]}
    assert record.source(tmp_path / "benchmarks" / "results" / "nowhere") == {
        "commit": None,
        "dirty": None,
        "changed": [],
    }


def test_a_figure_is_printed_without_a_bar():
    rows = [figure("faults: (b)/(a)", 1.05, "read beside the compute ratio, 1.333"), figure("f", None, "x", "not run")]
    lines = table([Result("faults", rows=rows)]).splitlines()
    assert lines[2] == "| faults: (b)/(a) | 1.05 | none: read beside the compute ratio, 1.333 | — |"
    assert lines[3] == "| f | n/a | none: x | — |" and rows[1].limit == "not run" and rows[0].limit == ""
