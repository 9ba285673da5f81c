"""A learner asks storage whether to stop on its training thread, before every step and every
phase; the asks are rate-limited so they cost two requests every few seconds, not every step."""

from islands.core.config import RunConfig
from islands.storage import layout
from islands.storage.store import Stores
from islands.tasks import train_phase
from islands.tasks.train_phase import STOP_CHECK_S, LearnerSession

RUN = "stop-check-run"


def test_storage_is_asked_at_most_every_few_seconds_and_a_stop_stays(monkeypatch):
    config = RunConfig(run_id=RUN, regions=["north"], speed={}, quorum={"min_quorum": 1})
    stores = Stores("memory://stop-check-{bucket}", config.regions)
    session = LearnerSession.open(config, RUN, "north-0", stores)
    asked = []
    monkeypatch.setattr(
        train_phase, "stop_requested", lambda store, run: asked.append(run) or store.exists(layout.stop_key(run))
    )

    assert not session.must_stop() and len(asked) == 1  # the first ask goes to storage
    stores.global_.put_if_absent(layout.stop_key(RUN), b"{}")
    assert not session.must_stop() and len(asked) == 1  # asked a moment ago: not asked again
    session.stop_checked_at -= STOP_CHECK_S  # as if the last ask were STOP_CHECK_S older
    assert session.must_stop() and len(asked) == 2
    stores.global_.delete(layout.stop_key(RUN))
    session.stop_checked_at -= 10 * STOP_CHECK_S
    assert session.must_stop() and len(asked) == 2  # a stop, once seen, stays without asking
