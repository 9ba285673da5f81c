"""`islands audit`: prove from object storage alone that nothing was lost and nothing applied twice.

It walks every round's manifest (the hash chain, each round in its place), re-reads and hashes
every object a manifest names, checks that each round's model is its parent's plus its published
update (what learners rebuild it from) and that its evaluation, once written, is of that model,
balances each learner's token ledger, and with `replay` recomputes every merge from its recorded
deltas and checks the published bits. Reads go through storage/ only — no Prefect, no local
state — so anyone with read access to the buckets can audit.

Two checks reach past the chain, whose newest manifest nothing in storage vouches for: given the
manifest sha256s the Prefect API recorded as each round was committed (ops.witness), every
round's manifest must be one of them, so a chain rewritten consistently in storage fails; and in a
run with object_lock_days, a round object must have one version only, since Object Lock keeps
the first one however many are stacked on it.

Token ledger, per learner:  lost = trained − applied − capped − dropped − pending.
  trained  trainer steps in the learner's newest saved state × batch × block (the learner's own
           count, independent of its deltas); the sum of its deltas' claims when it saved none
  applied  tokens of its deltas merged, as counted (manifest contributions' tokens_counted)
  capped   tokens its merged deltas claimed beyond what was counted (merge.token_cap)
  dropped  tokens of its deltas quarantined or dropped as stale (manifest exclusions)
  pending  claims of its deltas in the regional bucket that no manifest names yet
lost > 0 is a problem (trained work whose delta is nowhere). lost < 0 is work done twice: a
learner that stopped after writing a delta but before saving its state re-trains from the
older state.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from functools import cached_property

import torch
from pydantic import ValidationError

from islands.core.compress import residual_state, split_residual
from islands.core.config import MergeSettings
from islands.core.merge import Candidate, apply_update, encode_update, merge_round, plan_merge
from islands.core.model import build_model, own_params
from islands.core.validate import claimed_tokens
from islands.ops.witness import Witness
from islands.storage import layout
from islands.storage.codec import (
    CodecError,
    body_sha256,
    decode,
    decode_state,
    encode_state,
    encode_wire,
    packed,
    read_header,
)
from islands.storage.manifest import Contribution, Manifest, ObjectRef
from islands.storage.model_files import local_model, step_tokens
from islands.storage.rounds import checkpoint_metadata, object_header, read_config, read_evaluation
from islands.storage.store import (
    AccessDenied,
    IntegrityError,
    ObjectMissing,
    ObjectStore,
    StoreError,
    Stores,
    sha256_hex,
)

LEDGER = ("trained", "applied", "capped", "dropped", "pending", "lost")


@dataclass(frozen=True)
class Problem:
    round: int | None
    object: str
    what: str

    def line(self) -> str:
        where = f"round {self.round}" if self.round is not None else "run"
        return f"{where}  {self.object}: {self.what}"


@dataclass
class AuditReport:
    run: str
    rounds: int = 0  # newest round with a manifest
    problems: list[Problem] = field(default_factory=list)
    ledger: dict[str, dict[str, int]] = field(default_factory=dict)
    objects: int = 0  # objects whose bytes were hashed against a manifest
    replayed: int | None = None  # rounds recomputed bit for bit; None without replay
    witnessed: int | None = None  # newest round whose manifest the Prefect API's record vouches for
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {"ok": self.ok, **asdict(self)}

    def summary(self) -> str:
        """One screen: verdict, what was checked, the ledger, then every problem and note."""
        checked = f"{self.rounds} rounds, {self.objects} objects hashed"
        if self.replayed is not None:
            checked += f", {self.replayed} rounds replayed bit for bit"
        verdict = "OK" if self.ok else f"{len(self.problems)} PROBLEM{'S' * (len(self.problems) != 1)}"
        lines = [f"islands audit {self.run}: {verdict} ({checked})", ""]
        lines.append(f"{'learner':<16}" + "".join(f"{c:>12}" for c in LEDGER))
        for learner, row in sorted(self.ledger.items()):
            lines.append(f"{learner:<16}" + "".join(f"{row[c]:>12,}" for c in LEDGER))
        if self.problems:
            lines += ["", *(p.line() for p in self.problems)]
        if self.notes:
            lines += ["", *(f"note: {n}" for n in self.notes)]
        return "\n".join(lines)


@dataclass
class _Round:
    """A round as the walk left it: its manifest bytes' hash and, once verified, its checkpoint."""

    round: int
    key: str
    sha256: str
    manifest: Manifest | None
    model: bytes | None = None
    outer: bytes | None = None
    update: bytes | None = None


def audit_run(stores: Stores, run: str, replay: bool, witness: Witness | None = None) -> AuditReport:
    """Check run `run` in `stores` (whose regions must be the run's), and its manifests against
    `witness` when given; never raises on bad data."""
    return _Audit(stores, run, replay, witness).run()


class _Audit:
    def __init__(self, stores: Stores, run: str, replay: bool, witness: Witness | None = None):
        self.stores, self.run_id, self.replay, self.witness = stores, run, replay, witness
        self.manifest_shas: dict[int, str] = {}  # round → sha256 of its manifest's bytes in storage
        self.config = read_config(stores.global_, run)
        self.report = AuditReport(run=run, replayed=0 if replay else None)
        self.named: dict[tuple[str, str], int] = {}  # (region, delta key) → the round whose manifest named it
        self.merged: dict[str, tuple[int, str]] = {}  # delta sha256 → (round, key) that merged it
        self.merged_bodies: dict[str, tuple[int, str]] = {}  # its tensor bytes' sha256 → (round, key)
        self.applied = 0  # tokens merged into the rounds walked so far
        self.books: dict[str, Counter] = defaultdict(Counter)

    def problem(self, round_: int | None, key: str, what: str) -> None:
        self.report.problems.append(Problem(round_, key, what))

    def run(self) -> AuditReport:
        found = {
            r: k
            for k in self.stores.global_.list(layout.rounds_prefix(self.run_id))
            if (r := layout.parse_manifest_key(k)) is not None
        }
        if not found:
            self.problem(None, layout.rounds_prefix(self.run_id), "no manifest at all: the run has no round 0")
            return self.report
        self.report.rounds = max(found)
        parent: _Round | None = None
        for r in range(self.report.rounds + 1):
            key = layout.manifest_key(self.run_id, r)
            if r not in found:
                self.problem(r, key, f"missing: round {r} has no manifest, yet round {self.report.rounds} has one")
                parent = None
                continue
            current = self.walk_round(r, key, parent)
            self.manifest_shas[r] = current.sha256
            if self.replay and current.manifest is not None:
                self.replay_round(current, parent)
            parent = current
        self.balance()
        self.check_witness()
        if self.config.object_lock_days is not None:
            self.check_versions()
        return self.report

    # -- beyond the chain --------------------------------------------------------------------
    def check_witness(self) -> None:
        """Every round the Prefect API recorded must be in storage with the recorded manifest."""
        if self.witness is None:
            self.report.notes.append("no Prefect API answered: the newest manifest was checked against storage alone")
            return
        for r, shas in sorted(self.witness.shas.items()):
            key = layout.manifest_key(self.run_id, r)
            stored = self.manifest_shas.get(r)
            if stored is None:
                self.problem(
                    r, key, f"the Prefect API recorded this manifest (sha256 {min(shas)[:12]}…), storage has none"
                )
            elif stored not in shas:
                self.problem(
                    r,
                    key,
                    f"sha256 {stored[:12]}… is not the {min(shas)[:12]}… the Prefect API recorded when round {r} "
                    "was committed: the chain was rewritten in storage",
                )
        vouched = [r for r, sha in self.manifest_shas.items() if sha in self.witness.shas.get(r, set())]
        self.report.witnessed = max(vouched, default=None)
        newest = self.report.rounds
        if self.report.witnessed == newest:
            self.report.notes.append(
                f"round {newest}'s manifest is the one the Prefect API at {self.witness.api} recorded"
            )
        else:
            self.report.notes.append(
                f"round {newest}'s manifest has no record in the Prefect API at {self.witness.api}"
                + (f"; round {self.report.witnessed}'s has" if self.report.witnessed is not None else "")
            )

    def check_versions(self) -> None:
        """Under Object Lock a round object's first version stays; a second one is a rewrite."""
        store = self.stores.global_
        try:
            counts = store.version_counts(layout.rounds_prefix(self.run_id))
        except AccessDenied as exc:
            self.report.notes.append(f"object versions not checked: {exc}")
            return
        for key, n in sorted(counts.items()):
            if n > 1:
                self.problem(
                    layout.parse_round_key(key),
                    key,
                    f"{n} versions: written again or deleted after publishing (its first version, under Object Lock, "
                    "is the one published)",
                )

    # -- the chain and the objects --------------------------------------------------------
    def walk_round(self, r: int, key: str, parent: _Round | None) -> _Round:
        raw = self.stores.global_.get(key)
        self.report.objects += 1
        current = _Round(r, key, sha256_hex(raw), None)
        try:
            current.manifest = m = Manifest.from_bytes(raw)
        except ValueError as exc:  # JSON and pydantic errors alike
            self.problem(r, key, f"unreadable manifest ({_first_line(exc)})")
            return current
        if parent is not None and m.parent_sha256 != parent.sha256:
            self.problem(
                parent.round,
                parent.key,
                f"sha256 {parent.sha256[:12]}… is not the parent_sha256 {str(m.parent_sha256)[:12]}… that round {r}'s "
                "manifest records: one of the two manifests was changed after publishing",
            )
        if m.run != self.run_id:
            self.problem(r, key, f"records run {m.run!r}, but is stored under run {self.run_id!r}")
        if m.round != r:
            self.problem(r, key, f"records round {m.round}, but is stored as round {r}: rounds reordered or copied")
        expected_parent = None if r == 0 else r - 1
        if m.parent_round != expected_parent:
            self.problem(
                r,
                key,
                f"parent_round {m.parent_round}, expected {expected_parent}: the chain skips or reorders a round",
            )
        current.model = self.fetch_checkpoint(r, m.model, layout.model_key(self.run_id, r, m.model.sha256))
        if r == 0:
            if m.outer is not None or m.contributions:
                self.problem(r, key, "round 0 must have no outer state and no contributions")
        elif m.outer is None:
            self.problem(r, key, "no outer state named: every merged round records its momentum")
        else:
            current.outer = self.fetch_checkpoint(r, m.outer, layout.outer_key(self.run_id, r, m.outer.sha256))
        if r > 0:
            self.walk_update(r, key, m, current, parent)
            self.check_evaluation(r, m)
        self.walk_deltas(r, m)
        return current

    def walk_update(self, r: int, key: str, m: Manifest, current: _Round, parent: _Round | None) -> None:
        """The update is named, intact, and θ_{r−1} + update is θ_r — what learners rely on."""
        if m.update is None:
            self.problem(r, key, "no update named: every merged round records the update it applied")
            return
        current.update = self.fetch_checkpoint(r, m.update, layout.update_key(self.run_id, r, m.update.sha256))
        if current.update is None or current.model is None or parent is None or parent.model is None:
            return
        try:
            params = apply_update(decode_state(parent.model), decode(current.update)[0])
        except (CodecError, KeyError, RuntimeError) as exc:
            self.problem(r, m.update.key, f"cannot be applied to round {r - 1}'s model ({_first_line(exc)})")
            current.update = None  # nothing to replay it against
            return
        rebuilt = sha256_hex(encode_state(params, checkpoint_metadata(self.run_id, r)))
        if rebuilt != m.model.sha256:
            self.problem(
                r,
                m.update.key,
                f"round {r - 1}'s model + this update gives sha256 {rebuilt[:12]}…, the "
                f"published model is {m.model.sha256[:12]}…: learners cannot rebuild round {r}",
            )

    def check_evaluation(self, r: int, m: Manifest) -> None:
        """A round's evaluation names its model (a missing one is not a loss: it is recomputed)."""
        try:
            read_evaluation(self.stores.global_, m)
        except (IntegrityError, ValueError) as exc:
            self.problem(r, layout.eval_key(self.run_id, r), _first_line(exc))

    def fetch(self, r: int, store: ObjectStore, key: str, sha256: str, size: int | None) -> bytes | None:
        """The named bytes, or None after recording why they are not the named ones."""
        try:
            data = store.get(key, max_bytes=size)
        except ObjectMissing:
            self.problem(r, key, f"missing: named by round {r}'s manifest, not found in {store.url}")
            return None
        except StoreError as exc:
            self.problem(r, key, f"not the named object: {exc}")
            return None
        self.report.objects += 1
        actual = sha256_hex(data)
        if size is not None and len(data) != size:
            self.problem(r, key, f"{len(data)} bytes, the manifest records {size}")
        elif actual != sha256:
            self.problem(
                r, key, f"sha256 {actual[:12]}… ≠ recorded {sha256[:12]}…: bytes changed or swapped after publishing"
            )
        else:
            return data
        return None

    def fetch_checkpoint(self, r: int, ref: ObjectRef, expected_key: str) -> bytes | None:
        if ref.key != expected_key:
            self.problem(
                r, ref.key, f"named as round {r}'s object, but its content address in round {r} is {expected_key}"
            )
        return self.fetch(r, self.stores.global_, ref.key, ref.sha256, ref.bytes)

    def region_store(self, r: int, key: str, region: str | None) -> ObjectStore | None:
        store = self.stores.regions.get(region or "")
        if store is None:
            self.problem(r, key, f"region {region!r} is not one of the run's regions {sorted(self.stores.regions)}")
        return store

    def claim(self, r: int, region: str | None, key: str) -> None:
        """A delta (a key in a region's bucket) may be consumed by one manifest, once."""
        if (region or "", key) in self.named:
            self.problem(
                r, key, f"named by round {self.named[region or '', key]} and again by round {r}: consumed twice"
            )
        self.named.setdefault((region or "", key), r)

    def walk_deltas(self, r: int, m: Manifest) -> None:
        self.applied += sum(c.tokens_counted for c in m.contributions)
        if m.tokens_applied != self.applied:
            self.problem(
                r,
                layout.manifest_key(self.run_id, r),
                f"says {m.tokens_applied:,} tokens applied so far; "
                f"its contributions and its parents' add up to {self.applied:,}",
            )
        for c in m.contributions:
            self.claim(r, c.region, c.key)
            self.books[c.learner]["applied"] += c.tokens_counted
            self.books[c.learner]["capped"] += c.tokens - c.tokens_counted
            if c.sha256 in self.merged and self.merged[c.sha256][1] != c.key:
                first_round, first_key = self.merged[c.sha256]
                self.problem(r, c.key, f"same bytes as {first_key}, merged in round {first_round}: applied twice")
            self.merged.setdefault(c.sha256, (r, c.key))
            store = self.region_store(r, c.key, c.region)
            data = store and self.fetch(r, store, c.key, c.sha256, c.bytes)
            if data:
                try:
                    meta = read_header(data)[1]
                except CodecError as exc:
                    self.problem(r, c.key, f"merged, yet its header does not read: {exc}")
                    continue
                self.check_claims(r, c, meta)
                self.check_tensors_once(r, c, body_sha256(data))
        for e in m.excluded:
            self.claim(r, e.region, e.key)
            self.books[e.learner or "?"]["dropped"] += e.tokens
            if e.sha256 is not None and (store := self.region_store(r, e.key, e.region)) is not None:
                self.fetch(r, store, e.key, e.sha256, None)

    def check_tensors_once(self, r: int, c: Contribution, body: str) -> None:
        """The same tensor bytes, under whatever key and metadata, are merged once."""
        if c.body_sha256 is not None and c.body_sha256 != body:
            self.problem(r, c.key, f"body_sha256 {c.body_sha256[:12]}… recorded, its tensor bytes hash to {body[:12]}…")
        first_round, first_key = self.merged_bodies.setdefault(body, (r, c.key))
        if first_key != c.key and self.merged[c.sha256][1] == c.key:  # a copy of all its bytes is named already
            self.problem(r, c.key, f"same tensors as {first_key}, merged in round {first_round}: applied twice")

    def check_claims(self, r: int, c: Contribution, meta: dict[str, str]) -> None:
        """What the delta says about itself must be what the manifest recorded."""
        recorded = {
            "run": self.run_id,
            "learner": c.learner,
            "phase": str(c.phase),
            "base_round": str(c.base_round),
        }
        wrong = {k: meta.get(k) for k, v in recorded.items() if meta.get(k) != v}
        if c.tokens != claimed_tokens(meta, self.config.inner_steps, self.tokens_per_step):
            wrong["tokens"] = meta.get("tokens")
        if wrong:
            self.problem(r, c.key, f"delta metadata {wrong} disagrees with the manifest's record")
        if c.staleness != r - 1 - c.base_round:
            self.problem(
                r,
                c.key,
                f"staleness {c.staleness} recorded, but round {r - 1} − base round {c.base_round} = {r - 1 - c.base_round}",
            )

    # -- replay ------------------------------------------------------------------------------
    def replay_round(self, current: _Round, parent: _Round | None) -> None:
        r, m = current.round, current.manifest
        if r == 0:
            initial = own_params(build_model(local_model(self.config.model), self.config.seed))
            if self.same_bits(r, m.model, _as_published(current.model, initial)):
                self.report.replayed += 1
            return
        unverified = (parent.model, current.model, current.outer, current.update) if parent is not None else (None,)
        if any(b is None for b in unverified) or (r > 1 and parent.outer is None):
            self.report.notes.append(
                f"round {r} not replayed: its own or its parent's checkpoint failed the checks above"
            )
            return
        rule = m.settings.merge
        if not self.plan_matches(r, current.key, m, rule):
            return
        deltas = [self.delta_tensors(c.region, c.key, c.sha256) for c in m.contributions]
        if any(d is None for d in deltas):
            self.report.notes.append(f"round {r} not replayed: a merged delta failed the checks above")
            return
        momentum, residual = split_residual(decode_state(parent.outer)) if parent.outer is not None else (None, {})
        params = decode_state(parent.model)
        target, new_momentum = merge_round(params, momentum, deltas, [c.weight for c in m.contributions], rule)
        update, model, new_residual = encode_update(params, target, residual, m.update.codec, m.settings.topk)
        replayed_update = encode_wire(update, read_header(current.update)[1], m.update.codec)
        if sha256_hex(replayed_update) != m.update.sha256 and packed(replayed_update) == packed(current.update):
            replayed_update = current.update  # the same integers, deflated by another zlib build
        checks = [
            (m.model, _as_published(current.model, model)),
            (m.outer, _as_published(current.outer, {**new_momentum, **residual_state(new_residual)})),
            (m.update, replayed_update),
        ]
        if all([self.same_bits(r, ref, replayed) for ref, replayed in checks]):
            self.report.replayed += 1

    def plan_matches(self, r: int, key: str, m: Manifest, rule: MergeSettings) -> bool:
        """The merge rule, run again over the recorded candidates, gives the recorded weights and drops."""
        dropped = [e for e in m.excluded if e.kind == "dropped"]
        candidates = [Candidate(c.learner, c.phase, c.base_round, c.tokens) for c in m.contributions]
        for e in dropped:
            store = self.stores.regions.get(e.region or "")
            try:
                base = int(read_header(store.get(e.key, sha256=e.sha256))[1]["base_round"])
            except (AttributeError, KeyError, ValueError, StoreError, CodecError) as exc:
                self.report.notes.append(f"round {r}: plan of {e.key} not replayed ({_first_line(exc)})")
                return True
            candidates.append(Candidate(e.learner or "?", e.phase or 0, base, e.tokens))
        try:
            weighted, plan_dropped = plan_merge(r - 1, candidates, rule)
        except ValueError as exc:
            self.problem(r, key, f"recorded candidates cannot be merged: {exc}")
            return False
        got = [(w.candidate.learner, w.candidate.phase, w.staleness, w.tokens_counted, w.weight) for w in weighted]
        want = [(c.learner, c.phase, c.staleness, c.tokens_counted, c.weight) for c in m.contributions]
        if got != want:
            self.problem(r, key, f"recorded weights {want} are not the merge rule's {got}")
            return False
        got_d = sorted((d.candidate.learner, d.candidate.phase, d.reason) for d in plan_dropped)
        want_d = sorted((e.learner or "?", e.phase or 0, e.reason) for e in dropped)
        if got_d != want_d:
            self.problem(r, key, f"recorded drops {want_d} are not the merge rule's {got_d}")
            return False
        return True

    def delta_tensors(self, region: str, key: str, sha256: str) -> dict[str, torch.Tensor] | None:
        try:
            return decode(self.stores.regions[region].get(key, sha256=sha256))[0]
        except (KeyError, StoreError, CodecError):
            return None

    def same_bits(self, r: int, ref: ObjectRef, replayed: bytes) -> bool:
        """The replayed object's bytes hash as the published ones."""
        sha = sha256_hex(replayed)
        if sha != ref.sha256:
            self.problem(
                r,
                ref.key,
                f"replay gives sha256 {sha[:12]}…, published {ref.sha256[:12]}…: not the merge of its recorded deltas",
            )
            return False
        return True

    # -- the token ledger --------------------------------------------------------------------
    def balance(self) -> None:
        for region, store in self.stores.regions.items():
            for key in sorted(store.list(layout.deltas_prefix(self.run_id))):
                parsed = layout.parse_delta_key(key)
                if parsed is not None and (region, key) not in self.named:
                    self.books[parsed[0]]["pending"] += self.pending_claim(store, key)
        tokens_per_step = self.tokens_per_step
        regions = {name: region for name, region, _ in self.config.learners()}
        for learner in sorted(set(regions) | set(self.books)):
            row = self.books[learner]
            accounted = row["applied"] + row["capped"] + row["dropped"] + row["pending"]
            steps = self.trained_steps(learner, regions[learner]) if learner in regions else None
            row["trained"] = accounted if steps is None else steps * tokens_per_step
            row["lost"] = row["trained"] - accounted
            where = layout.learner_state_prefix(self.run_id, learner)
            if row["lost"] > 0:
                self.problem(
                    None,
                    where,
                    f"{row['lost']:,} tokens trained by {learner} are neither applied, dropped "
                    "nor pending: a delta was deleted or its record is wrong",
                )
            elif row["lost"] < 0:
                self.report.notes.append(
                    f"{learner}: {-row['lost']:,} tokens were trained twice (a delta written "
                    "before a restart from an older saved state)"
                )
            self.report.ledger[learner] = {c: row[c] for c in LEDGER}

    @cached_property
    def tokens_per_step(self) -> int:
        return step_tokens(self.config)

    def pending_claim(self, store: ObjectStore, key: str) -> int:
        try:
            return claimed_tokens(object_header(store, key)[1], self.config.inner_steps, self.tokens_per_step)
        except (CodecError, StoreError) as exc:
            self.report.notes.append(f"{key}: pending but unreadable, counted as 0 tokens ({_first_line(exc)})")
            return 0

    def trained_steps(self, learner: str, region: str) -> int | None:
        """The trainer step counter of the learner's newest saved state, read without the tensors."""
        store = self.stores.regions.get(region)
        if store is None:
            return None
        states = {
            p: k
            for k in store.list(layout.learner_state_prefix(self.run_id, learner))
            if (p := layout.parse_state_key(k)) is not None
        }
        if not states:
            return None
        key = states[max(states)]
        try:
            table, _, start = object_header(store, key)
            info = table["trainer.step"]
            if info["dtype"] != "I64" or info["shape"] != []:
                raise CodecError(f"trainer.step is {info['dtype']}{info['shape']}, not an int64 scalar")
            lo, hi = info["data_offsets"]
            return int.from_bytes(store.get_range(key, start + lo, start + hi), "little", signed=True)
        except (CodecError, StoreError, KeyError) as exc:
            self.problem(None, key, f"learner state unreadable, so its trained tokens are unknown ({_first_line(exc)})")
            return None


def _as_published(published: bytes, tensors: dict[str, torch.Tensor]) -> bytes:
    """Replayed tensors serialized as publish did: its metadata, canonical bytes."""
    return encode_state(tensors, read_header(published)[1])


def _first_line(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return f"{exc.error_count()} schema errors, first: {exc.errors()[0]['msg']}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
