"""Readers that only report (a run's summary, `islands status`) read a learner's deltas, which
may hold anything: a delta whose header does not read reports nothing, and never fails them."""

from __future__ import annotations

import torch

from islands.core.config import RunConfig
from islands.flows.training_run import bytes_by_region
from islands.ops.status import newest_delta
from islands.storage import layout
from islands.storage.codec import encode
from islands.storage.rounds import reported_metadata
from islands.storage.store import Stores

RUN = "report-run"


def delta(phase: int, written: int) -> bytes:
    meta = {"run": RUN, "learner": "north-0", "phase": str(phase), "io_written": str(written), "io_read": "7"}
    return encode({"w": torch.zeros(64)}, meta)


def test_a_truncated_or_missing_delta_reports_nothing_and_the_newest_readable_one_counts():
    stores = Stores("memory://report-{bucket}", ["north"])
    north = stores.region("north")
    north.put_if_absent(layout.delta_key(RUN, "north-0", 1), delta(1, 1000))
    truncated = layout.delta_key(RUN, "north-0", 2)
    north.put_if_absent(truncated, delta(2, 2000)[:-100])
    assert reported_metadata(north, truncated) == {}
    assert reported_metadata(north, layout.delta_key(RUN, "north-0", 9)) == {}  # gone
    config = RunConfig(run_id=RUN, regions=["north"], speed={}, quorum={"min_quorum": 1})
    assert bytes_by_region(config, stores)["north"] == {"written": 1000, "read": 7}
    assert newest_delta(stores, RUN, "north-0", "north") == {"phase": 2, "finished_at": 0.0, "seconds": 0.0}
