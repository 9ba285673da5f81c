"""The driver runs each outer round as a subflow in its own process, under its own heartbeat."""

from prefect.settings import get_current_settings

from islands.flows import training_run


def test_a_round_subflow_sends_no_heartbeat_of_its_own_and_the_driver_keeps_its_own(monkeypatch):
    seen = []

    def outer_round(run_id: str, round: int, store: str) -> dict:  # noqa: A002 - the flow's own signature
        seen.append((run_id, round, store, get_current_settings().flows.heartbeat_frequency))
        return {"round": round}

    monkeypatch.setattr(training_run, "outer_round", outer_round)
    before = get_current_settings().flows.heartbeat_frequency
    assert training_run.run_round("r", 7, "s3://islands-{bucket}") == {"round": 7}
    assert seen == [("r", 7, "s3://islands-{bucket}", None)]
    assert before is not None
    assert get_current_settings().flows.heartbeat_frequency == before
