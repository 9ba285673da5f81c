"""Benchmark results and their one markdown table: benchmark, our figure, the bar, holds.

Every row is a ratio measured in the same run; the raw figures and the exact settings follow
the table, and a missed bar says what limits it. A few rows are figures without a bar (`figure`):
printed beside the bars, judged by none, with what to read them against.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Row:
    benchmark: str
    ours: float | None  # None: could not be measured in this run (limit says why)
    bar: str  # e.g. "≤ 1.04"; for a figure, "none" and what to read it against
    holds: bool | None  # None: a figure, judged by no bar
    limit: str = ""  # what limits it, when the bar is missed (for a figure: why it was not measured)


def at_most(benchmark: str, ours: float | None, bar: float, limit: str = "") -> Row:
    ok = ours is not None and math.isfinite(ours) and ours <= bar
    return Row(benchmark, ours, f"≤ {bar:g}", ok, "" if ok else limit)


def at_least(benchmark: str, ours: float | None, bar: float, limit: str = "") -> Row:
    ok = ours is not None and math.isfinite(ours) and ours >= bar
    return Row(benchmark, ours, f"≥ {bar:g}", ok, "" if ok else limit)


def within(benchmark: str, ours: float | None, target: float, rel: float, limit: str = "") -> Row:
    ok = ours is not None and math.isfinite(ours) and abs(ours / target - 1) <= rel
    return Row(benchmark, ours, f"{target:.3g} ± {rel:.0%}", ok, "" if ok else limit)


def figure(benchmark: str, ours: float | None, beside: str = "", limit: str = "") -> Row:
    """A figure reported without a bar; `beside` says what to read it against."""
    return Row(benchmark, ours, f"none: {beside}" if beside else "none", None, limit if ours is None else "")


@dataclass
class Result:
    name: str
    rows: list[Row] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)
    seconds: float = 0.0


def table(results: list[Result]) -> str:
    lines = ["| benchmark | our figure | the bar | holds |", "|---|---|---|---|"]
    for res in results:
        for row in res.rows:
            ours = "n/a" if row.ours is None else f"{row.ours:.4g}"
            lines.append(f"| {row.benchmark} | {ours} | {row.bar} | {holds(row)} |")
    return "\n".join(lines)


def holds(row: Row) -> str:
    return "—" if row.holds is None else "yes" if row.holds else "no"


def limits(res: Result) -> list[str]:
    """What limits each missed bar, and why a figure could not be measured."""
    return [
        f"- {'not measured' if row.holds is None else 'missed'}: {row.benchmark}: {row.limit}"
        for row in res.rows
        if row.limit
    ]


def details(results: list[Result]) -> str:
    out = []
    for res in results:
        out.append(f"\n## {res.name} ({res.seconds:.0f} s)")
        out.extend(limits(res))
        out.append("raw: " + json.dumps(res.raw, indent=1, sort_keys=True, default=str))
        out.append("settings: " + json.dumps(res.settings, indent=1, sort_keys=True, default=str))
    return "\n".join(out)


def timed(run: Callable[[bool], Result], quick: bool) -> Result:
    t0 = time.monotonic()
    res = run(quick)
    res.seconds = time.monotonic() - t0
    return res


def report(results: list[Result], quick: bool) -> str:
    note = "\n\n(--quick: a smoke test at toy sizes; the figures do not judge the bars)" if quick else ""
    return table(results) + note + "\n" + details(results) + "\n"


def print_report(results: list[Result], quick: bool) -> None:
    print(report(results, quick), end="", flush=True)


def standalone(run: Callable[[bool], Result]) -> None:
    """`python -m benchmarks.<name> [--quick]`: one benchmark, the same report."""
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="toy sizes: a smoke test in a minute or two")
    args = p.parse_args()
    print_report([timed(run, args.quick)], args.quick)
    sys.exit(0)
