"""Liveness under hostile objects: a real run while 1,000 random objects land in its regional buckets.

`islands run` (both regions, a quorum of both learners, a round timeout far above what a round
needs) runs on the session stack while a thread writes, create-only and seeded so that a failure
reproduces (ISLANDS_FUZZ_SEED), random bytes, truncated and mutated real deltas and
safetensors with hostile headers under keys in the learners' own folders (far ahead, at their
next numbers, in odd spellings) and anywhere else under the run's prefix, a batch as each round
opens. Every round must still close with both learners in, never by its timeout; the learners
must write past what took their keys and live; and `islands status` and `islands audit --replay`
must end in 0 or 1, one line per problem, with every merge replayed bit for bit.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import re
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import STACK_REGIONS, run_args
from fake_learner import TEMPLATE

from islands.core.model import build_model
from islands.storage import layout
from islands.storage.codec import CodecError, check_body, encode, read_header
from islands.storage.rounds import read_chain
from islands.storage.store import Stores

RUN = "fuzz-run"
ROUNDS = 4
OBJECTS = 1000
BATCHES = [350, 300, 250, 100]  # written as rounds 1, 2, 3 and 4 open: the last round's is the smallest
WRITERS = 4  # puts at once
FLOOR_S = 0.25  # how old a listing of a learner's folder may be when a key at its next numbers is chosen
STEP_S = 0.6  # each learner's inner step takes at least this long: rounds of a few seconds, not one
TIMEOUT_S = 180  # the round timeout: far above what a round needs (its learners' start included)
SEED = int(os.environ.get("ISLANDS_FUZZ_SEED", "58"))
LEARNERS = {f"{region}-0": region for region in STACK_REGIONS}
FAR = [999_998, 999_999, 1_000_000, 1_000_001, 1_234_567, 9_999_999, 99_999_999, 999_999_999]
assert sum(BATCHES) == OBJECTS


def cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "islands.flows.cli", *args],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


NEST = "@nest@"  # stands, in a header spelled by hand, for arrays nested deeper than json.dumps goes


def safetensors(header: object, body: bytes = b"", depth: int = 0) -> bytes:
    """A safetensors object spelled by hand: any header (NEST: `depth` nested arrays), any body."""
    text = header if isinstance(header, bytes) else json.dumps(header, allow_nan=True).encode()
    text = text.replace(json.dumps(NEST).encode(), b"[" * depth + b'"x"' + b"]" * depth)
    return struct.pack("<Q", len(text)) + text + body


def split(real: bytes) -> tuple[int, dict]:
    """(where the body starts, header) of a real delta."""
    (n,) = struct.unpack("<Q", real[:8])
    return 8 + n, json.loads(real[8 : 8 + n])


def stand_in(learner: str) -> bytes:
    """A delta as `learner` would write it for phase 0, until it has written one of its own."""
    params = build_model("tiny", 0).state_dict()
    gen = torch.Generator().manual_seed(SEED)
    meta = {
        "run": RUN,
        "learner": learner,
        "region": LEARNERS[learner],
        "phase": "0",
        "base_round": "0",
        "start_round": "0",
        "rebases": "",
        "inner_steps": "8",
        "tokens": str(8 * 16 * 128),
        "loss": "5.5",
        "seconds": "4.0",
        "finished_at": f"{time.time():.3f}",
    }
    return encode({k: torch.randn(v.shape, generator=gen) * 1e-3 for k, v in params.items()}, meta)


class Fuzzer:
    """Writes the random objects: `batch(n)` picks n times a kind of bytes and a key, from one
    seeded generator, and puts them create-only into a regional bucket (a key already taken is
    skipped), WRITERS at a time."""

    def __init__(self, stores: Stores, seed: int):
        self.stores, self.rng = stores, random.Random(seed)
        self.reals = {learner: stand_in(learner) for learner in LEARNERS}  # learner → its newest delta seen
        self.floors: dict[str, tuple[float, int]] = {}  # learner → (when read, floor)
        self.lock = threading.Lock()
        self.written: dict[tuple[str, str], str] = {}  # (region, key) → sha256 of what was put there
        self.outcomes: Counter[tuple[str, str]] = Counter()  # (where, written / taken / refused)
        self.refused: dict[str, str] = {}  # an example of each error the store refused a write with
        self.kinds: Counter[str] = Counter()
        self.chosen: set[tuple[str, str]] = set()  # (region, key) of every object made
        self.next_keys: list[tuple[str, str]] = []  # (region, key) planted at a learner's next numbers

    # -- what the learners wrote -----------------------------------------------------------
    def own_delta(self, learner: str) -> bytes | None:
        """The learner's newest delta that reads as its own (not one this fuzzer planted, or a
        key the store folded into its spelling): its metadata names its key, its body its hash."""
        store = self.stores.region(LEARNERS[learner])
        keys = {
            p[1]: k
            for k in store.list(layout.learner_deltas_prefix(RUN, learner))
            if (p := layout.parse_delta_key(k)) is not None and (LEARNERS[learner], k) not in self.written
        }
        for phase in sorted(keys, reverse=True):
            data = store.get(keys[phase])
            try:
                _, meta = read_header(data)
                check_body(data, meta)
            except CodecError:
                continue
            if meta.get("learner") == learner and meta.get("phase") == str(phase) and "body_sha256" in meta:
                return data
        return None

    def floor(self, learner: str) -> int:
        """The end of the unbroken run of numbers 0, 1, … its folder holds (theirs and ours), as
        listed at most FLOOR_S ago."""
        at, floor = self.floors.get(learner, (-math.inf, -1))
        if time.monotonic() - at > FLOOR_S:
            store = self.stores.region(LEARNERS[learner])
            listed = store.list(layout.learner_deltas_prefix(RUN, learner))
            held = {p[1] for k in listed if (p := layout.parse_delta_key(k))}
            floor = -1
            while floor + 1 in held:
                floor += 1
            self.floors[learner] = (time.monotonic(), floor)
        return floor

    def read_reals(self) -> None:
        """Each learner's newest delta of its own, once it has written one."""
        for learner in LEARNERS:
            if (data := self.own_delta(learner)) is not None:
                self.reals[learner] = data

    # -- the bytes -------------------------------------------------------------------------
    def real(self) -> bytes:
        return self.reals[self.rng.choice(sorted(self.reals))]

    def random_bytes(self) -> bytes:
        size = self.rng.choice([0, 1, 7, 8, 9, 16, self.rng.randrange(4096), self.rng.randrange(64)])
        if self.rng.random() < 0.2:  # a length prefix that reads as small
            return struct.pack("<Q", self.rng.randrange(size + 64)) + self.rng.randbytes(size)
        return self.rng.randbytes(size)

    def truncated(self) -> bytes:
        real = self.real()
        start, _ = split(real)
        if self.rng.random() < 0.85:  # mostly in or just past the header: small
            return real[: self.rng.randrange(min(len(real), start + 256))]
        return real[: self.rng.randrange(len(real))]

    def flipped(self, where: str) -> bytes:
        real = bytearray(self.real())
        start, _ = split(bytes(real))
        lo, hi = (0, start) if where == "header" else (start, len(real))
        for _ in range(self.rng.randint(1, 4)):
            real[self.rng.randrange(lo, hi)] ^= self.rng.randrange(1, 256)
        return bytes(real)

    def hostile_header(self, learner: str, phase: int) -> bytes:
        """A well-formed length prefix and JSON (mostly), saying what no delta may say."""
        rng = self.rng
        _, header = split(self.real())
        meta = dict(header.pop("__metadata__"))
        meta.update(learner=learner, region=LEARNERS.get(learner, "nowhere"), phase=str(phase))
        names = sorted(header)
        name = rng.choice(names)
        entry = dict(header[name])
        nested, depth = NEST, rng.choice([10, 300, 1500])
        choices = [
            lambda: {name: {**entry, "shape": [2**40, 2**40]}},
            lambda: {name: {**entry, "shape": [2**63, 2**63, 2**63]}},
            lambda: {name: {**entry, "shape": [-1, 4]}},
            lambda: {name: {**entry, "shape": [1] * rng.randrange(200, 1000)}},
            lambda: {name: {**entry, "shape": [float("nan")]}},
            lambda: {name: {**entry, "dtype": rng.choice(["F64", "I64", "U8", "BOOL", "F8_E4M3", "Q4", "", "f32"])}},
            lambda: {name: {**entry, "dtype": rng.choice([7, None, [], {"F32": 1}])}},
            lambda: {name: {**entry, "data_offsets": [0, 2**64]}},
            lambda: {name: {**entry, "data_offsets": [8, 4]}},
            lambda: {name: {**entry, "data_offsets": [float("nan"), float("inf")]}},
            lambda: {name: {**entry, "data_offsets": "0..4"}},
            lambda: {name: nested},
            lambda: {"__metadata__": {**meta, "loss": float("nan")}},
            lambda: {"__metadata__": {**meta, "tokens": nested}},
            lambda: {"__metadata__": nested},
            lambda: {"__metadata__": {**meta, "phase": "9" * rng.randrange(20, 3000)}},
            lambda: {"__metadata__": meta, **header},  # the model's table, no tensor bytes behind it
            lambda: {"__metadata__": meta, name: {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
            lambda: nested,
            lambda: [meta],
            lambda: rng.choice([1, "header", None, float("nan")]),
        ]
        body = b""
        if rng.random() < 0.3:  # a few NaN bytes behind it
            body = struct.pack("<4f", *[float("nan")] * 4)
        data = safetensors(rng.choice(choices)(), body, depth)
        if rng.random() < 0.1:  # the header as text it is not
            data = safetensors(b"{" * rng.randrange(1, 3000) + b"\xff\xfe NaN")
        if rng.random() < 0.1:  # a length prefix that lies
            data = struct.pack("<Q", rng.choice([0, 2**63, 2**64 - 1, len(data) + 1, 16 * 2**20 + 1])) + data[8:]
        return data

    def nan_delta(self, learner: str, phase: int) -> bytes:
        """A delta of the model's names and shapes, metadata right for its key, values NaN."""
        _, header = split(self.real())
        meta = dict(header.pop("__metadata__"))
        meta.pop("body_sha256", None)
        meta.pop("codec", None)
        meta.update(learner=learner, region=LEARNERS.get(learner, "nowhere"), phase=str(phase))
        return encode({k: torch.full(v["shape"], float("nan")) for k, v in header.items()}, meta)

    # -- the keys ------------------------------------------------------------------------------
    def key(self) -> tuple[str, str, str, int]:
        """(where, region, key, phase the key reads as) of a key the kinds of the issue choose among."""
        rng = self.rng
        learner = rng.choice(sorted(LEARNERS))
        region = LEARNERS[learner] if rng.random() < 0.9 else rng.choice(STACK_REGIONS)
        where = rng.choices(["far", "next", "odd", "elsewhere"], weights=[3, 2, 3, 2])[0]
        if where == "far":
            phase = rng.choice(
                [
                    rng.choice(FAR),
                    rng.randrange(900_000, 10**6),
                    rng.randrange(10**6, 10**7),
                    rng.randrange(10**7, 10**9),
                ]
            )
            if rng.random() < 0.25:  # a saved state, far ahead
                return where, region, layout.learner_state_key(RUN, learner, phase), phase
            return where, region, layout.delta_key(RUN, learner, phase), phase
        if where == "next":
            floor, mine = self.floor(learner), LEARNERS[learner]
            free = (
                n for n in itertools.count(floor + 1) if (mine, layout.delta_key(RUN, learner, n)) not in self.chosen
            )
            phase = [next(free) for _ in range(3)][rng.randrange(3)]
            key = layout.delta_key(RUN, learner, phase)
            if rng.random() < 0.25:  # the state the learner would write beside that delta
                key = layout.learner_state_key(RUN, learner, phase)
            if region == LEARNERS[learner]:
                self.next_keys.append((region, key))
            return where, region, key, phase
        if where == "odd":
            phase = rng.choice([self.floor(learner) + rng.randint(1, 3), rng.randrange(10**6)])
            folder, canonical = layout.learner_deltas_prefix(RUN, learner), f"{phase:06d}.safetensors"
            odd = rng.choice(
                [
                    folder + "0" + canonical,
                    folder + "00" + canonical,
                    folder.replace(learner, learner.upper()) + canonical,
                    folder.replace(learner, learner.capitalize()) + canonical,
                    folder + canonical.upper(),
                    folder + canonical + rng.choice(["~", ".tmp", ".1", "x", " ", "%00", "/"]),
                    folder + canonical + "/" + canonical,
                    folder.replace(f"/{learner}/", f"//{learner}/") + canonical,
                    folder + "/" + canonical,
                    folder + "./" + canonical,
                    folder + "x/../" + canonical,
                    folder + canonical.replace(str(phase % 10), "\u0663", 1),
                    folder + f"{phase:07d}.safetensors",
                    folder + f"+{phase:05d}.safetensors",
                    folder + f"{phase}.safetensors",
                    folder.rstrip("/") + canonical,
                    layout.learner_state_prefix(RUN, learner) + f"state-0{phase:06d}.safetensors",
                    layout.learner_state_prefix(RUN, learner) + f"STATE-{phase:06d}.safetensors",
                ]
            )
            return where, region, odd, phase
        folders = ["deltas", "learners", "cache", "rounds", "liveness", "drivers", "probes", rng.randbytes(3).hex()]
        names = [
            f"{rng.choice(['north', 'south', 'east', 'nobody', 'North', ''])}-{rng.randrange(1000)}",
            f"{rng.randrange(10**6):06d}",
            f"{rng.randrange(10**6):06d}.safetensors",
            f"state-{rng.randrange(10**6):06d}.safetensors",
            f"model-{rng.randbytes(8).hex()}.safetensors",
            f"{rng.randrange(10**4):06d}-{rng.randrange(10**4):04d}-{rng.choice(['up', 'down'])}.json",
            rng.choice(["manifest.json", "config.json", "stop.json", "eval.json"]),
            rng.randbytes(rng.randint(1, 8)).hex(),
        ]
        parts = [rng.choice(folders)] + [rng.choice(names) for _ in range(rng.randint(0, 3))]
        return where, region, layout.run_prefix(RUN) + "/".join(parts), 0

    # -- the writes ----------------------------------------------------------------------------
    def batch(self, n: int) -> list[tuple[str, str]]:
        """Write n objects; the (region, key) of those written."""
        with ThreadPoolExecutor(WRITERS) as pool:
            done = [pool.submit(self.put, *self.make()) for _ in range(n)]
        return [written for f in done if (written := f.result()) is not None]

    def make(self) -> tuple[str, str, str, bytes]:
        """A key not chosen before (so that a key taken is one the learners took), and bytes."""
        rng = self.rng
        for _ in range(10):
            where, region, key, phase = self.key()
            if (region, key) not in self.chosen:
                break
        self.chosen.add((region, key))
        learner = next((name for name in LEARNERS if f"/{name}/" in key), rng.choice(sorted(LEARNERS)))
        kind = rng.choices(
            ["random", "truncated", "header-flip", "body-flip", "hostile-header", "nan"], weights=[30, 25, 3, 3, 38, 1]
        )[0]
        data = {
            "random": self.random_bytes,
            "truncated": self.truncated,
            "header-flip": lambda: self.flipped("header"),
            "body-flip": lambda: self.flipped("body"),
            "hostile-header": lambda: self.hostile_header(learner, phase),
            "nan": lambda: self.nan_delta(learner, phase),
        }[kind]()
        self.kinds[kind] += 1
        return where, region, key, data

    def put(self, where: str, region: str, key: str, data: bytes) -> tuple[str, str] | None:
        try:
            wrote = self.stores.region(region).put_if_absent(key, data)
        except Exception as exc:  # noqa: BLE001 - a key the store will not take is the attacker's loss
            with self.lock:
                self.outcomes[where, "refused"] += 1
                self.refused.setdefault(type(exc).__name__, f"{exc}"[:160])
            return None
        with self.lock:
            if wrote:
                self.written[region, key] = hashlib.sha256(data).hexdigest()
            self.outcomes[where, "written" if wrote else "taken"] += 1
        return (region, key) if wrote else None


@pytest.mark.slow
def test_a_run_keeps_its_rounds_while_1000_random_objects_land_in_its_buckets(on_stack):
    stores = Stores(TEMPLATE, STACK_REGIONS)
    fuzzer = Fuzzer(stores, SEED)
    stop, done_at, errors = threading.Event(), [], []
    status_mid: list[subprocess.CompletedProcess] = []
    batches: list[tuple[int, float, float]] = []  # (round, seconds into the run it began, ended)
    seen_by: dict[tuple[str, str], int] = {}  # (region, key) → a round whose collection began after it was written

    def newest_round() -> int:
        return next(r for r in range(ROUNDS, -1, -1) if r == 0 or stores.global_.exists(layout.manifest_key(RUN, r)))

    def fuzz() -> None:
        try:
            for r, size in enumerate(BATCHES):
                # A batch as round r + 1 opens: round r is published (round 0: the run is made).
                while not stop.is_set() and not stores.global_.exists(layout.manifest_key(RUN, r)):
                    stop.wait(0.1)
                if stop.is_set():
                    return
                fuzzer.read_reals()
                if r == 1:  # once, while the learners train and junk lies in their folders
                    status_thread.start()
                began = time.monotonic()
                written = fuzzer.batch(size)
                batches.append((r + 1, round(began - t0, 1), round(time.monotonic() - t0, 1)))
                # Round n is published now: round n + 2 begins later, and its first look lists all.
                seen_by.update(dict.fromkeys(written, newest_round() + 2))
            done_at.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported by the test, not lost in a thread
            errors.append(exc)

    status_thread = threading.Thread(target=lambda: status_mid.append(cli("status", RUN, timeout=120)), daemon=True)

    thread = threading.Thread(target=fuzz, daemon=True)
    t0 = time.monotonic()
    thread.start()
    try:
        proc = cli(
            *run_args(RUN, STACK_REGIONS, ROUNDS),
            "--quorum.min-quorum",
            "2",
            "--quorum.round-timeout-s",
            str(TIMEOUT_S),
            *(f"--min-step-s={region}={STEP_S}" for region in STACK_REGIONS),
            "--json",
            timeout=420,
        )
    finally:
        ended = time.monotonic()
        stop.set()
        thread.join()
        if status_thread.ident is not None:
            status_thread.join()
    took = ended - t0
    assert not errors, errors
    tag = f"seed {SEED}"
    assert done_at and done_at[0] <= ended, (
        f"{tag}: the objects were not all written while the run ran: batches {batches} of {took:.0f} s\n"
        + proc.stdout[-3000:]
    )
    assert sum(fuzzer.kinds.values()) == OBJECTS

    # The run: every round published, its learners alive to the end.
    assert proc.returncode == 0, f"{tag}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["rounds_published"] == ROUNDS, summary
    assert summary["failed"] is None, summary["failed"]
    assert set(summary["learners"].values()) == {"Completed"}, summary["learners"]
    assert " died: " not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-6000:]

    # Every round closed with both learners in, long before its timeout.
    chain = [m for m, _ in read_chain(stores.global_, RUN)]
    assert [m.round for m in chain] == list(range(ROUNDS + 1))
    rounds = chain[1:]
    closed = [(m.round, m.quorum.closed_by, round(m.quorum.waited_s, 1)) for m in rounds]
    assert all(by != "timeout" and waited < TIMEOUT_S / 2 for _, by, waited in closed), f"{tag}: {closed}"
    assert all(sorted(m.quorum.learners) == sorted(LEARNERS) for m in rounds), closed

    # Nothing planted was merged: every merged delta is one a learner wrote.
    planted = set(fuzzer.written.values())
    merged = [c for m in rounds for c in m.contributions]
    assert not [c.key for c in merged if c.sha256 in planted], f"{tag}: a planted object was merged"
    assert all(c.learner in LEARNERS and c.region == LEARNERS[c.learner] for c in merged)
    # Every planted object under the run's deltas that was there when a round's collection began
    # is quarantined: none is left aside for later. (One a store keeps under another spelling,
    # such as `a//b` folded into `a/b`, is judged under that spelling: not listed as written.)
    quarantined = {(e.region, e.key) for m in rounds for e in m.excluded if e.kind == "quarantined"}
    listed = {(region, k) for region in STACK_REGIONS for k in stores.region(region).list(layout.deltas_prefix(RUN))}
    judged = {k for k, r in seen_by.items() if r <= ROUNDS and k in listed}
    assert judged, "no planted object was there for a round to judge"
    assert judged <= quarantined, f"{tag}: planted, listed, not quarantined: {sorted(judged - quarantined)[:10]}"
    # The learners found some of their next keys taken and wrote past them.
    skipped = {k for r, k in fuzzer.next_keys if (r, k) in fuzzer.written}
    assert skipped, "no learner found its next key taken"

    # status and audit: 0 or 1, no traceback, one line per problem.
    reports_began = time.monotonic()
    with ThreadPoolExecutor(2) as pool:  # side by side: each mostly starts Python and waits on the store
        status_done = pool.submit(cli, "status", RUN, timeout=120)
        audit_done = pool.submit(cli, "audit", RUN, "--replay", timeout=300)
        status, audit = status_done.result(), audit_done.result()
    reports_s = time.monotonic() - reports_began
    for name, done in [("status (mid-run)", p) for p in status_mid] + [("status", status), ("audit", audit)]:
        assert done.returncode in (0, 1), f"{tag}: {name} exited {done.returncode}\n{done.stderr[-4000:]}"
        assert "Traceback" not in done.stdout + done.stderr, f"{tag}: {name}\n{done.stderr[-4000:]}"
        assert all(len(line) < 400 for line in done.stdout.splitlines()), f"{tag}: {name}: a line too long"
    assert status_mid, "status was not run during the run"
    lines = audit.stdout.splitlines()
    head = re.fullmatch(
        rf"islands audit {RUN}: (OK|\d+ PROBLEMS?) \((\d+) rounds, \d+ objects hashed, (\d+) rounds replayed bit for bit\)",
        lines[0],
    )
    assert head, audit.stdout[-4000:]
    assert int(head.group(2)) == ROUNDS and int(head.group(3)) == ROUNDS + 1, f"{tag}: not every merge replayed"
    ledger_end = next((i for i in range(2, len(lines)) if not lines[i]), len(lines))
    problems = [line for line in lines[ledger_end:] if line and not line.startswith("note: ")]
    # None names a round: junk in a learner's folder may be a problem of the run (its newest
    # state key unreadable, so its trained tokens unknown), never of a merge.
    assert all(re.fullmatch(r"run  \S+: [^\n]+", line) for line in problems), f"{tag}: {problems}"
    assert audit.returncode == (1 if problems else 0), audit.stdout[-4000:]

    print(
        f"\nfuzz run ({tag}): {ROUNDS} rounds in {took:.0f} s (batches at {batches}); "
        f"{len(fuzzer.written)} of {OBJECTS} objects written: {dict(sorted(fuzzer.outcomes.items()))}; "
        f"refused e.g. {fuzzer.refused}; kinds {dict(fuzzer.kinds)}; {len(quarantined)} quarantined "
        f"({len(judged)} planted ones listed in time); {len(skipped)} of the learners' next keys taken; "
        f"rounds {closed}; audit {head.group(1)}: {problems}; status exits {[p.returncode for p in status_mid]} "
        f"{status.returncode}; status and audit took {reports_s:.0f} s"
    )
