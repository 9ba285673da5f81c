"""The results file: what `python -m benchmarks` measured, where and when, in
benchmarks/results/latest.md (read by people) and latest.json (every raw figure and setting).

A figure is only worth what its provenance says, so each run is stamped with the commit it ran
(and whether the tree held uncommitted changes), the UTC dates it started and finished, the
machine (cores, CPU model, memory, Python and torch) and its wall time. The file holds one
section per part: a run replaces the sections of the parts it ran and keeps every other part's
section with the stamp of the run that wrote it, so `--only wire` after a whole suite leaves
the suite's other parts as they were and says which run each came from. History lives in git.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import torch

from benchmarks.report import Result, Row, limits, table

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
KEPT_OUT = ":(exclude)benchmarks/results"  # the file this writes does not make the tree dirty


class ResultsFileError(ValueError):
    """latest.json is not a file this module wrote."""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def source(root: Path = ROOT) -> dict:
    """The commit checked out, and the paths that differ from it (the results file aside)."""
    try:
        commit = git(root, "rev-parse", "HEAD").strip()
        status = git(root, "status", "--porcelain", "--untracked-files=normal", "--", ".", KEPT_OUT)
    except (OSError, subprocess.CalledProcessError):
        return {"commit": None, "dirty": None, "changed": []}
    changed = [line[3:] for line in status.splitlines() if line.strip()]
    return {"commit": commit, "dirty": bool(changed), "changed": changed}


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def machine() -> dict:
    """What the figures ran on: those that follow the machine's speed (times, tokens/s) are read
    against it."""
    cpu, mem = proc_fields("/proc/cpuinfo"), proc_fields("/proc/meminfo").get("MemTotal", "")
    return {
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu.get("model name") or cpu.get("Model") or platform.processor() or None,
        "memory_gib": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "system": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "niceness": os.nice(0),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def proc_fields(path: str) -> dict[str, str]:
    """The `key: value` lines of a /proc file, each key's first; none where there is no /proc."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for key, _, value in (line.partition(":") for line in lines):
        if value.strip():
            fields.setdefault(key.strip(), value.strip())
    return fields


def stamp(argv: list[str], quick: bool, parts: list[str]) -> dict:
    """A run's stamp at its start; `finish` adds its end."""
    return {
        "command": " ".join(["python -m benchmarks", *map(shlex.quote, argv)]),
        "quick": quick,
        "parts_run": parts,
        **source(),
        "started": now(),
        "machine": machine(),
    }


def finish(run: dict, wall_s: float, time_row: Row | None) -> dict:
    """The run's end: its wall time and the row that reports it (`None`: no row for this run)."""
    return {**run, "finished": now(), "wall_s": round(wall_s, 1), "time_row": asdict(time_row) if time_row else None}


def part(res: Result, time_row: Row | None) -> dict:
    return {
        "name": res.name,
        "seconds": round(res.seconds, 1),
        "rows": [asdict(r) for r in res.rows],
        "time_row": asdict(time_row) if time_row else None,
        "raw": res.raw,
        "settings": res.settings,
    }


def read(directory: Path) -> list[dict]:
    """The runs latest.json holds, each with the parts whose sections it still wrote."""
    path = directory / "latest.json"
    if not path.exists():
        return []
    try:
        runs = json.loads(path.read_text(encoding="utf-8"))["runs"]
        names = [p["name"] for run in runs for p in run["parts"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ResultsFileError(
            f"{path}: not a results file python -m benchmarks wrote ({type(exc).__name__}: {exc}); "
            "restore it with git checkout or move it away"
        ) from exc
    if len(names) != len(set(names)):
        raise ResultsFileError(f"{path}: a part has two sections; restore it with git checkout or move it away")
    return runs


def merge(runs: list[dict], new: dict, order: list[str]) -> list[dict]:
    """`new` replaces the sections of the parts it ran; runs left with no section go; runs and
    parts in the suite's order."""
    new = {**new, "parts": list({p["name"]: p for p in new["parts"]}.values())}  # a part run twice: its last
    mine = {p["name"] for p in new["parts"]}
    kept = [{**r, "parts": [p for p in r["parts"] if p["name"] not in mine]} for r in runs]
    rank = {name: i for i, name in enumerate(order)}

    def key(p: dict) -> int:
        return rank.get(p["name"], len(order))

    out = [{**r, "parts": sorted(r["parts"], key=key)} for r in [*kept, new] if r["parts"]]
    return sorted(out, key=lambda r: key(r["parts"][0]))


def write(directory: Path, new: dict, order: list[str]) -> None:
    """Merge run `new` into latest.json and latest.md in `directory`."""
    runs = merge(read(directory), new, order)
    directory.mkdir(parents=True, exist_ok=True)
    write_whole(
        directory / "latest.json",
        json.dumps({"runs": runs}, indent=1, sort_keys=True, ensure_ascii=False, default=str) + "\n",
    )
    write_whole(directory / "latest.md", markdown(runs))


def write_whole(path: Path, text: str) -> None:
    """Write `text` to `path` whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def markdown(runs: list[dict]) -> str:
    out = [
        "# Benchmark results",
        "",
        "Written by `python -m benchmarks` (`make bench`, `make bench-quick`, `--only NAME`), not by hand. What each row",
        "measures and why its bar is that number: [docs/benchmarks.md](../../docs/benchmarks.md). A run replaces the",
        "sections of the parts it ran and keeps the others, so each table below is headed by the run that wrote it.",
        "Every raw figure and setting is also in [latest.json](latest.json).",
    ]
    for i, run in enumerate(runs, 1):
        results = results_of(run)
        out += ["", f"## Run {i}: `{run['command']}`", "", *stamp_lines(run), "", table(results)]
        missed = [line for res in results for line in limits(res)]
        out += ["", "What limits each missed bar, and why a figure is missing:", "", *missed] if missed else []
    out += ["", "## Raw figures and settings"]
    for i, run in enumerate(runs, 1):
        for p in run["parts"]:
            out += ["", f"### {p['name']} (run {i}, {p['seconds']:.0f} s)", "", "Raw figures:", "", *fenced(p["raw"])]
            out += ["", "Settings:", "", *fenced(p["settings"])]
    return "\n".join(out) + "\n"


def stamp_lines(run: dict) -> list[str]:
    m = run["machine"]
    if run["commit"] is None:
        commit = "unknown (not a git checkout)"
    elif run["dirty"]:
        commit = f"`{run['commit']}` with uncommitted changes in {', '.join(f'`{c}`' for c in run['changed'])}"
    else:
        commit = f"`{run['commit']}`, the tree clean"
    held = [p["name"] for p in run["parts"]]
    since = [name for name in run["parts_run"] if name not in held]
    lines = [
        f"- commit: {commit}",
        f"- date (UTC): {run['started']} to {run['finished']}",
        f"- machine: {m['cores']} cores ({m['cores_usable']} usable), {m['cpu_model']}, {m['memory_gib']} GiB memory; "
        f"{m['system']}; Python {m['python']}, torch {m['torch']}; niceness {m['niceness']}, "
        f"load average {' / '.join(map(str, m['load_average_at_start']))} at the start",
        f"- wall time: {run['wall_s'] / 60:.1f} minutes ({run['wall_s']:.0f} s) for {', '.join(run['parts_run'])}",
    ]
    if since:
        lines.append(f"- sections since replaced by a later run: {', '.join(since)}")
    if run["quick"]:
        lines.append("- `--quick`: a smoke test at toy sizes; the figures do not judge the bars")
    return lines


def results_of(run: dict) -> list[Result]:
    """The run's parts and, last, its time rows: the run's own, then each part's it still holds."""
    times = [run["time_row"], *(p["time_row"] for p in run["parts"])]
    return [*map(result, run["parts"]), Result("time", rows=[Row(**t) for t in times if t])]


def result(p: dict) -> Result:
    return Result(p["name"], [Row(**r) for r in p["rows"]], p.get("raw", {}), p.get("settings", {}), p["seconds"])


def fenced(value: object) -> list[str]:
    return ["```json", json.dumps(value, indent=1, sort_keys=True, ensure_ascii=False, default=str), "```"]
