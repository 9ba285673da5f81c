"""What a collect poll lists: everything once, then only what is new in each learner's folder
(tests/test_liveness_keys.py: what no key can hide); and how it reads what it found."""

import threading
import time
from types import SimpleNamespace

import pytest

from islands.storage import layout
from islands.storage.store import ObjectStore
from islands.tasks import collect
from islands.tasks.collect import DeltaWatch


@pytest.fixture(params=["file", "s3"])
def store(request, tmp_path):
    if request.param == "file":
        return ObjectStore(f"file://{tmp_path / 'bucket'}")
    return ObjectStore(f"s3://{request.getfixturevalue('s3_bucket')}")


def test_later_looks_list_only_new_keys_one_request_per_learner(store):
    old = [layout.delta_key("run", learner, p) for learner in ("north-0", "north-1") for p in range(3)]
    for key in old:
        store.put_if_absent(key, b"d")
    watch = DeltaWatch(store, "run", ["north-0", "north-1"])
    assert set(watch.look()) == set(old)  # the first look lists everything
    assert watch.look() == {}
    new = {layout.delta_key("run", "north-0", 3): 2, layout.delta_key("run", "north-1", 3): 2}
    for key in new:
        store.put_if_absent(key, b"dd")
    lists = store.io.lists
    assert watch.look() == new
    assert store.io.lists == lists + 2
    assert watch.look() == {}


def test_the_last_look_finds_keys_outside_the_learners_folders(store):
    watch = DeltaWatch(store, "r", ["n-0"])
    watch.look()
    stray = [layout.delta_key("r", "s-0", 0), layout.deltas_prefix("r") + "stray.bin"]
    for key in [*stray, layout.delta_key("r", "n-0", 0)]:
        store.put_if_absent(key, b"d")
    assert set(watch.look()) == {layout.delta_key("r", "n-0", 0)}  # a poll looks in n-0's folder only
    everything = watch.look(everything=True)
    assert [k for k in everything if not watch.owned(k)] == sorted(stray)


def test_new_deltas_are_read_two_at_a_time_in_order(monkeypatch):
    """While one delta is being hashed and written, the next one downloads."""
    running, most = [0], [0]
    lock = threading.Lock()

    def slow_inspect(state, region, key, size):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(0.1)
        with lock:
            running[0] -= 1
        return key

    monkeypatch.setattr(collect, "inspect", slow_inspect)
    state = SimpleNamespace(spool_dir=None, consumed_shas={}, consumed_bodies={}, model_norm=1.0, step_tokens=1)
    found = [("east", f"k{i}", 1) for i in range(6)]
    assert collect.inspect_all(state, found) == [key for _, key, _ in found]
    assert most[0] == collect.READERS == 2
    assert collect.inspect_all(state, []) == []
