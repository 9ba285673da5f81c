"""Bad deltas, written into a regional bucket as if by a learner, are quarantined with a reason the
next manifest records, and the run goes on; an inflated token claim is capped, not trusted.

Four fake learners (two per region) write honest pseudo-gradients for the tiny model next to one
bad object per kind; the outer-round flow then runs against the session's S3 and Prefect API.
"""

from __future__ import annotations

import struct
import zlib
from types import SimpleNamespace

import pytest
import torch
from fake_learner import TOKENS, delta_bytes, metadata, new_run, pseudo_gradient, put

from islands.core.compress import to_wire
from islands.flows.outer_round import outer_round
from islands.ops.audit import audit_run
from islands.storage import layout
from islands.storage.codec import MAX_HEADER_BYTES, encode, encode_wire
from islands.storage.rounds import read_manifest

RUN = "bad-deltas"
HONEST = ["north-0", "south-0", "north-1", "south-1"]


def _flip_header(data: bytes) -> bytes:
    out = bytearray(data)
    for i in range(9, 17):  # inside the JSON header, just after its opening brace
        out[i] ^= 0xFF
    return bytes(out)


def _flip_tensor_bytes(data: bytes) -> bytes:
    out = bytearray(data)
    out[-100] ^= 0x10  # one bit inside the last tensor's values
    return bytes(out)


def _with(tensors: dict, **changes) -> dict:
    return {**tensors, **changes}


def _deflated(size: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(zlib.compress(bytes(size))), dtype=torch.uint8)


def _int4_bomb(tensors: dict, name: str, declared: list[int] | None = None) -> dict:
    """int4 wire tensors whose `name` inflates to 256 MB of zeros: as its own shape's integers (too
    many for it), or as the integers of the `declared` shape it claims instead."""
    wire = to_wire(tensors, "int4")
    wire.pop(name + ".q", None)
    wire[name + ".z"] = _deflated(2**28)
    if declared is not None:
        wire[name + ".shape"] = torch.tensor(declared)
    return wire


@pytest.fixture(scope="module")
def run(on_stack):
    """Two rounds with bad deltas among honest ones: what was expected, the manifests, the audit."""
    with pytest.MonkeyPatch.context() as mp:
        # Only safetensors may parse delta bytes: any unpickling would fail the test.
        mp.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called on untrusted bytes"))
        config, stores = new_run(RUN, learners_per_region=2)
        g = pseudo_gradient(stores, RUN, seed=99)
        name = sorted(g)[0]
        honest = delta_bytes(config, stores, "north-0", 0, 0, seed=0)

        def bad(learner: str, phase: int, tensors: dict | None = None, base_round: int = 0, **meta) -> bytes:
            m = {**metadata(config, learner, phase, base_round), **meta}
            return encode(tensors if tensors is not None else g, {k: v for k, v in m.items() if v is not None})

        def bad_int4(learner: str, phase: int, wire: dict) -> bytes:
            return encode_wire(wire, metadata(config, learner, phase, 0), "int4")

        for i, learner in enumerate(HONEST):
            tokens = TOKENS * 1000 if learner == "south-1" else TOKENS  # south-1 lies about its tokens
            data = (
                honest
                if i == 0
                else encode(pseudo_gradient(stores, RUN, seed=i), metadata(config, learner, 0, 0, tokens))
            )
            put(config, stores, learner, 0, data)
        expected = {
            put(config, stores, "north-0", 1, honest[: len(honest) // 2]): "does not fit the object",
            put(config, stores, "north-0", 2, _flip_header(bad("north-0", 2))): "header is not JSON",
            put(config, stores, "north-1", 7, _flip_tensor_bytes(bad("north-1", 7))): "do not match the body_sha256",
            put(
                config, stores, "north-0", 3, struct.pack("<Q", 10**6) + bad("north-0", 3)[8:100]
            ): "larger than the object",
            put(
                config, stores, "north-0", 4, struct.pack("<Q", MAX_HEADER_BYTES + 1) + bad("north-0", 4)[8:]
            ): "oversized header",
            put(
                config,
                stores,
                "south-0",
                1,
                bad("south-0", 1, {("not.a.param" if k == name else k): v for k, v in g.items()}),
            ): "wrong tensor names",
            put(config, stores, "south-0", 2, bad("south-0", 2, _with(g, **{name: torch.zeros(3, 3)}))): "wrong shape",
            put(
                config,
                stores,
                "south-0",
                3,
                bad("south-0", 3, _with(g, **{name: torch.ones(g[name].shape, dtype=torch.int32)})),
            ): "wrong dtype",
            put(
                config,
                stores,
                "south-0",
                4,
                bad("south-0", 4, _with(g, **{name: torch.full(g[name].shape, float("nan"))})),
            ): "non-finite",
            put(
                config,
                stores,
                "north-1",
                1,
                bad("north-1", 1, _with(g, **{name: torch.full(g[name].shape, float("inf"))})),
            ): "non-finite",
            put(
                config, stores, "north-1", 2, bad("north-1", 2, {k: v * 1e4 for k, v in g.items()})
            ): "above the model's own norm",
            put(config, stores, "north-1", 8, bad("north-1", 8, {k: v * 30 for k, v in g.items()})): "far outside",
            put(config, stores, "north-1", 9, bad("north-1", 9, seconds="soon")): "metadata seconds",
            put(config, stores, "south-0", 7, bad("south-0", 7, tokens="9" * 400)): "metadata tokens",
            put(config, stores, "south-0", 8, bad("south-0", 8, loss="nan")): "metadata loss",
            put(config, stores, "north-1", 3, bad("north-1", 3, run="someone-else")): "wrong run id",
            put(config, stores, "north-1", 4, bad("north-1", 4, base_round=7)): "from the future",
            put(config, stores, "south-1", 1, bad("south-1", 1, tokens=None)): "metadata missing: tokens",
            put(config, stores, "south-1", 2, bad("south-1", 2) + b"\0" * 5_000_000): "oversized:",
            put(config, stores, "south-1", 3, bad_int4("south-1", 3, _int4_bomb(g, name))): "inflate to more than",
            put(config, stores, "south-1", 4, bad_int4("south-1", 4, _int4_bomb(g, name, [2**31]))): "wrong shape",
        }
        north = stores.region("north")
        for key, reason in (
            (layout.delta_key(RUN, "south-0", 9), "does not belong to region 'north'"),
            (layout.deltas_prefix(RUN) + "stray.bin", "not a delta key"),
            (layout.delta_key(RUN, "north-0", 0).replace("000000", "0000000"), "not a delta key"),
            (layout.delta_key(RUN, "north-0", 0).replace("north-0", "NORTH-0"), "not a delta key"),
            (layout.deltas_prefix(RUN) + "x/" + layout.delta_key(RUN, "north-0", 0), "not a delta key"),
        ):
            assert north.put_if_absent(key, honest)
            expected[key] = reason
        south = stores.region("south")
        read_before = south.io.bytes_read
        outer_round(run_id=RUN, round=1, store=stores.template)
        south_read = south.io.bytes_read - read_before
        first, _ = read_manifest(stores.global_, RUN, 1)

        for i, learner in enumerate(HONEST):
            put(config, stores, learner, 5, delta_bytes(config, stores, learner, 5, 1, seed=10 + i))
        expected_2 = {put(config, stores, "north-0", 6, honest): "duplicate of consumed delta"}
        outer_round(run_id=RUN, round=2, store=stores.template)
        second, _ = read_manifest(stores.global_, RUN, 2)
        report = audit_run(stores, RUN, replay=True)
    return SimpleNamespace(
        stores=stores,
        expected=expected,
        first=first,
        expected_2=expected_2,
        second=second,
        report=report,
        south_read=south_read,
    )


def test_each_bad_delta_is_quarantined_with_its_reason(run):
    recorded = {e.key: e for e in run.first.excluded}
    assert set(run.expected) <= set(recorded), f"not quarantined: {sorted(set(run.expected) - set(recorded))}"
    for key, reason in run.expected.items():
        assert recorded[key].kind == "quarantined"
        assert reason in recorded[key].reason, (key, recorded[key].reason)
    assert not set(run.expected) & {c.key for c in run.first.contributions}


def test_the_round_goes_on_with_the_honest_deltas_and_caps_the_liar(run):
    by_learner = {c.learner: c for c in run.first.contributions}
    assert sorted(by_learner) == sorted(HONEST)
    liar = by_learner["south-1"]
    assert liar.tokens == liar.tokens_counted == TOKENS  # what its 5 inner steps can hold
    assert liar.weight == pytest.approx(by_learner["north-0"].weight)
    assert run.first.tokens_applied == sum(c.tokens_counted for c in run.first.contributions) == 4 * TOKENS


def test_a_resubmitted_copy_of_a_merged_delta_is_not_applied_twice(run):
    recorded = {e.key: e for e in run.second.excluded}
    for key, reason in run.expected_2.items():
        assert recorded[key].kind == "quarantined" and reason in recorded[key].reason
    assert len(run.second.contributions) == len(HONEST)


def test_bytes_are_read_only_after_the_size_check(run):
    sizes = run.stores.region("south").list(f"runs/{RUN}/deltas/")
    oversized = next(k for k, reason in run.expected.items() if reason == "oversized:")
    round_one = {k: n for k, n in sizes.items() if not k.endswith("000005.safetensors")}
    assert run.south_read == sum(round_one.values()) - round_one[oversized]


def test_audit_passes_and_replays_a_run_full_of_bad_deltas(run):
    report = run.report
    assert report.ok, report.summary()
    assert report.replayed == 3
    assert all(row["lost"] == 0 for row in report.ledger.values()), report.ledger
    assert report.ledger["south-1"]["applied"] == 2 * TOKENS
