"""Readers that only report (a run's summary, `islands status`) read a learner's deltas, which
may hold anything: a delta whose header does not read reports nothing, and never fails them."""

from __future__ import annotations

import struct

import torch

from islands.core.config import RunConfig
from islands.flows.artifacts import bytes_sent
from islands.flows.cli import main
from islands.ops.status import newest_delta
from islands.storage import layout
from islands.storage.codec import encode
from islands.storage.manifest import Contribution, Manifest
from islands.storage.rounds import reported_metadata
from islands.storage.store import Stores
from islands.tasks.publish import publish_initial

RUN = "report-run"


def delta(phase: int, written: int) -> bytes:
    meta = {"run": RUN, "learner": "north-0", "region": "north", "phase": str(phase), "finished_at": "1.7e9"}
    meta |= {"io_written": str(written), "io_read": "7"}
    return encode({"w": torch.zeros(64)}, meta)


def test_a_truncated_or_missing_delta_reports_nothing_and_the_newest_readable_one_counts():
    stores = Stores("memory://report-{bucket}", ["north"])
    north = stores.region("north")
    north.put_if_absent(layout.delta_key(RUN, "north-0", 1), delta(1, 1000))
    truncated = layout.delta_key(RUN, "north-0", 2)
    north.put_if_absent(truncated, delta(2, 2000)[:-100])
    assert reported_metadata(north, truncated) == {}
    assert reported_metadata(north, layout.delta_key(RUN, "north-0", 9)) == {}  # gone
    assert newest_delta(stores, RUN, "north-0", "north") == {"phase": 1, "finished_at": 1.7e9, "seconds": 0.0}


def nested_header(depth: int = 100_000) -> bytes:
    """A safetensors object whose header nests `depth` JSON arrays: no parser's stack holds it."""
    header = b'{"w":' + b"[" * depth + b"]" * depth + b"}"
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + bytes(16)


def test_status_and_audit_read_a_delta_nested_past_any_stack_as_unreadable_not_a_traceback(tmp_path, capsys):
    template = f"file://{tmp_path}/store/{{bucket}}"
    config = RunConfig(run_id=RUN, regions=["north"], speed={}, eval_every=0, store=template, quorum={"min_quorum": 1})
    stores = Stores(template, config.regions)
    stores.global_.put_if_absent(layout.config_key(RUN), config.model_dump_json().encode())
    publish_initial(config, RUN, stores)
    stores.region("north").put_if_absent(layout.delta_key(RUN, "north-0", 1), nested_header())
    capsys.readouterr()
    assert main(["status", RUN, "--store", template]) == 0
    out = capsys.readouterr().out
    assert "north-0" in out and "Traceback" not in out
    assert main(["audit", RUN, "--store", template]) == 0
    out = capsys.readouterr().out
    assert f"runs/{RUN}/deltas/north-0/000001.safetensors: pending but unreadable" in out
    assert "nested too deeply" in out


def test_the_summary_counts_bytes_from_the_store_and_merged_deltas_not_from_a_planted_newest_one():
    """A region's bytes written are what its bucket holds of the run; bytes read, the counters of
    its learners' newest merged delta. A newer object under a learner's key claiming it wrote
    nothing (or read a terabyte) moves neither."""
    stores = Stores("memory://sent-{bucket}", ["north"])
    north = stores.region("north")
    merged, planted = delta(1, 1000), encode({"w": torch.zeros(64)}, {"io_written": "0", "io_read": str(10**12)})
    north.put_if_absent(layout.delta_key(RUN, "north-0", 1), merged)
    north.put_if_absent(layout.delta_key(RUN, "north-0", 2), planted)
    north.put_if_absent(layout.delta_key(RUN, "north-0", 3), nested_header(10))
    config = RunConfig(run_id=RUN, regions=["north"], speed={}, quorum={"min_quorum": 1})
    took = Contribution.model_construct(
        learner="north-0", region="north", phase=1, key=layout.delta_key(RUN, "north-0", 1)
    )
    sent = bytes_sent(
        config, stores, [Manifest.model_construct(contributions=[]), Manifest.model_construct(contributions=[took])]
    )
    assert sent["north"] == {"written": len(merged) + len(planted) + len(nested_header(10)), "read": 7}
