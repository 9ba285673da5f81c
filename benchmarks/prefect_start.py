"""How long the embedded Prefect server takes to answer on a fresh home: migrating an empty
database against starting from the migrated template (infra.prefect_db), side by side.

Every fresh stack pays this: each `python -m benchmarks` process, a first `make run`, a test
session. Timed from launch to /api/health answering, alternating the two, each on a new home
(and, for the migrating one, a new cache, so no template is found). The bar is ours, not the
issue's: the template must start the server at least 1.5× sooner, or it is not worth keeping a
file in the user's cache. An ablation beside the suite: `--only prefect_start`.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.report import Result, at_least, standalone
from islands.infra.prefect_server import PrefectServer


def start_s(root: Path, cache: Path) -> tuple[float, bool]:
    """Seconds until a server on a new home under `root` answers, and whether it migrated."""
    home = Path(tempfile.mkdtemp(dir=root))
    server = PrefectServer(home / "server.log")
    t0 = time.monotonic()
    server.start({**os.environ, "PREFECT_HOME": str(home), "XDG_CACHE_HOME": str(cache)})
    seconds = time.monotonic() - t0
    server.stop()
    return seconds, not server.database.migrated


def run(quick: bool) -> Result:
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="islands-prefect-start-") as tmp:
        root, cache = Path(tmp), Path(tmp) / "cache"
        start_s(root, cache)  # makes the template, and warms the imports both sides use
        migrating, seeded = [], []
        for i in range(repeats):
            seconds, migrated = start_s(root, root / f"empty-cache-{i}")
            assert migrated, "a fresh cache holds no template"
            migrating.append(seconds)
            seconds, migrated = start_s(root, cache)
            assert not migrated, "the template was not used"
            seeded.append(seconds)
    a, b = statistics.median(migrating), statistics.median(seeded)
    res = Result(
        "prefect_start",
        settings={"repeats": repeats, "order": "alternating, each on a new home"},
        raw={"migrating_s": migrating, "from_template_s": seeded},
    )
    res.rows.append(
        at_least(
            "Prefect server start: migrating a fresh database / from the migrated template",
            a / b,
            1.5,
            "the migrations are a small part of the server's start on this machine",
        )
    )
    return res


if __name__ == "__main__":
    standalone(run)
