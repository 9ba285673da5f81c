"""A manifest records the settings its round ran with once, typed, and readers refuse a manifest of
a schema_version they do not know with one line naming both versions."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from islands.core.config import MergeSettings, QuorumSettings, RunConfig
from islands.flows.training_run import create_run
from islands.ops.audit import audit_run
from islands.storage import layout
from islands.storage.manifest import SCHEMA_VERSION, Manifest, RoundSettings, SchemaVersionError
from islands.storage.rounds import read_manifest
from islands.storage.store import Stores


def new_run(run_id: str) -> tuple[RunConfig, Stores]:
    """Round 0 of a run in memory: no evaluation, no learner; settings off their defaults."""
    config = RunConfig(
        run_id=run_id,
        regions=["north", "south", "east"],
        speed={},
        rounds=2,
        eval_every=0,
        merge={"outer_lr": 0.6, "max_staleness": 3},
        quorum={"min_quorum": 1, "max_quorum": 2, "grace_fraction": None},
    )
    stores = Stores(f"memory://{run_id}-{{bucket}}", config.regions)
    create_run(config, stores)
    return config, stores


def keys(doc) -> Counter:
    """How often each key occurs anywhere in a JSON document."""
    found: Counter = Counter()
    if isinstance(doc, dict):
        for k, v in doc.items():
            found[k] += 1
            found += keys(v)
    elif isinstance(doc, list):
        for v in doc:
            found += keys(v)
    return found


def test_a_rounds_manifest_holds_each_setting_once_and_reads_back_typed():
    config, stores = new_run("manifest-settings")
    m, _ = read_manifest(stores.global_, config.run_id, 0)
    assert m.schema_version == SCHEMA_VERSION == 2
    assert isinstance(m.settings.merge, MergeSettings) and isinstance(m.settings.quorum, QuorumSettings)
    assert m.settings == RoundSettings.of(config)
    assert m.settings.merge.outer_lr == 0.6 and m.settings.quorum.grace_fraction is None
    assert (m.settings.num_learners, m.settings.max_quorum) == (3, 2)
    assert RoundSettings.of(config.model_copy(update={"quorum": QuorumSettings(min_quorum=1)})).max_quorum == 3

    doc = json.loads(m.to_bytes())
    counts = keys(doc)
    for name in (*MergeSettings.model_fields, *QuorumSettings.model_fields, "num_learners"):
        assert counts[name] == 1, name
    assert "hyper" not in counts
    assert set(doc["quorum"]) == {"received", "learners", "waited_s", "closed_by"}  # the decision only
    assert Manifest.from_bytes(m.to_bytes()) == m and Manifest.from_bytes(m.to_bytes()).to_bytes() == m.to_bytes()


@pytest.mark.parametrize(
    "version, found",
    [(1, "schema_version 1"), (3, "schema_version 3"), ("2", "schema_version '2'"), (None, "no schema_version")],
)
def test_a_manifest_of_an_unknown_schema_version_is_refused_in_one_line(version, found):
    config, stores = new_run("manifest-version")
    doc = json.loads(read_manifest(stores.global_, config.run_id, 0)[0].to_bytes())
    if version is None:
        del doc["schema_version"]
    else:
        doc["schema_version"] = version
    with pytest.raises(SchemaVersionError) as caught:
        Manifest.from_bytes(json.dumps(doc).encode())
    message = str(caught.value)
    assert message == (
        f"manifest has {found}, and this version of islands reads schema_version 2 only; "
        "read it with the version that wrote it"
    )
    assert isinstance(caught.value, ValueError) and "\n" not in message


def test_audit_reports_a_manifest_of_an_unknown_schema_version_as_a_problem():
    config, stores = new_run("manifest-audit")
    key = layout.manifest_key(config.run_id, 0)
    doc = json.loads(stores.global_.get(key))
    doc["schema_version"] = 1
    stores.global_.delete(key)
    assert stores.global_.put_if_absent(key, json.dumps(doc).encode())
    report = audit_run(stores, config.run_id, replay=True)
    assert [(p.round, p.what) for p in report.problems if p.object == key] == [
        (
            0,
            "unreadable manifest (manifest has schema_version 1, and this version of islands reads schema_version 2 "
            "only; read it with the version that wrote it)",
        )
    ]
    assert not report.ok
