"""`python -m benchmarks [--quick] [--only NAME ...]`: the measured-performance suite, one table.

Each benchmark also runs alone: `python -m benchmarks.<name> [--quick]`. A benchmark that
fails outright gets a row saying so, and the suite goes on with the others (exit status 1).
"""

from __future__ import annotations

import argparse
import sys
import traceback

from benchmarks import dataplane, faults, quality, utilization, wire
from benchmarks.report import Result, Row, print_report, timed

BENCHMARKS = {
    "quality": quality.run,
    "quality_robust": quality.run_robust,
    "wire": wire.run,
    "faults": faults.run,
    "utilization": utilization.run,
    "dataplane": dataplane.run,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="toy sizes: a smoke test of every path in a few minutes")
    p.add_argument("--only", action="append", choices=sorted(BENCHMARKS), metavar="NAME",
                   help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}")
    args = p.parse_args(argv)
    results, failed = [], False
    for name in args.only or list(BENCHMARKS):
        try:
            results.append(timed(BENCHMARKS[name], args.quick))
        except Exception as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
            failed = True
            traceback.print_exc()
            results.append(Result(name, rows=[Row(f"{name}: did not complete", None, "runs", False, f"{type(exc).__name__}: {exc}")]))
    print_report(results, args.quick)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
