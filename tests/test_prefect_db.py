"""The Prefect server's database is migrated once per installed Prefect: a fresh home is seeded
from a migrated template, a home already at that version's head is not migrated again, and
anything else migrates as before."""

import os
import sqlite3
from contextlib import closing

import pytest
from served_stack import Api

from islands.infra import prefect_db
from islands.infra.prefect_server import PrefectServer


def make_db(path, rows=()):
    path.parent.mkdir(parents=True, exist_ok=True)
    with closing(sqlite3.connect(path)) as con:
        con.execute("create table flow (name text)")
        con.executemany("insert into flow values (?)", [(r,) for r in rows])
        con.commit()


def rows(path):
    with closing(sqlite3.connect(path)) as con:
        return [r for (r,) in con.execute("select name from flow")]


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setattr(prefect_db, "version", lambda _: "3.0.0")
    return {"PREFECT_HOME": str(tmp_path / "home"), "XDG_CACHE_HOME": str(tmp_path / "cache")}


def test_a_fresh_home_without_a_template_migrates_and_becomes_the_template(env, tmp_path):
    db = prefect_db.prepare(env)
    assert (db.fresh, db.migrated, db.seeded) == (True, False, False)
    assert db.server_env() == {}
    make_db(db.path)  # what the server's migrations create
    db.started()
    assert prefect_db.marker_path(db.path).read_text() == "3.0.0"
    assert db.template == tmp_path / "cache" / "islands" / "prefect-3.0.0.db"
    assert rows(db.template) == []


def test_a_fresh_home_is_seeded_from_the_template_and_not_migrated(env, tmp_path):
    make_db(prefect_db.template_path(env, "3.0.0"))
    db = prefect_db.prepare(env)
    assert (db.fresh, db.migrated, db.seeded) == (False, True, True)
    assert db.server_env() == {"PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false"}
    assert rows(db.path) == []


def test_a_used_home_never_becomes_the_template(env, tmp_path):
    """Its history is a user's runs: a home that existed before this start is marked, not copied."""
    make_db(tmp_path / "home" / "prefect.db", rows=["someone's flow"])
    db = prefect_db.prepare(env)
    assert (db.fresh, db.migrated) == (False, False)
    db.started()
    assert prefect_db.marker_path(db.path).read_text() == "3.0.0"
    assert not db.template.exists()
    assert prefect_db.prepare(env).migrated  # the next start skips the migrations


def test_another_prefect_version_migrates_again(env, tmp_path):
    make_db(tmp_path / "home" / "prefect.db")
    prefect_db.marker_path(tmp_path / "home" / "prefect.db").write_text("2.9.0")
    make_db(prefect_db.template_path(env, "2.9.0"))
    db = prefect_db.prepare(env)
    assert not db.migrated and db.server_env() == {}


def test_a_server_that_fails_on_the_seeded_copy_drops_the_template(env):
    make_db(prefect_db.template_path(env, "3.0.0"))
    db = prefect_db.prepare(env)
    db.failed()
    assert not db.template.exists()
    fresh_elsewhere = prefect_db.prepare({**env, "PREFECT_HOME": env["PREFECT_HOME"] + "2"})
    assert fresh_elsewhere.fresh and not fresh_elsewhere.migrated


def test_without_a_cache_to_write_to_the_server_still_starts(env, tmp_path):
    """A read-only or missing cache folder costs the template, never the start."""
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    db = prefect_db.prepare(env)
    make_db(db.path)
    db.started()
    assert prefect_db.marker_path(db.path).read_text() == "3.0.0" and not db.template.exists()


@pytest.mark.parametrize("setting", prefect_db.CONNECTION_SETTINGS)
def test_a_server_given_another_database_is_left_alone(env, setting):
    assert prefect_db.prepare({**env, setting: "postgresql+asyncpg://db/prefect"}) is None


def test_a_real_server_starts_from_the_template_and_serves_the_api(tmp_path):
    """Two fresh homes: the first migrates and makes the template, the second starts from it
    with the migrations off and answers the API (a flow written, then read back)."""
    cache = tmp_path / "cache"
    seen = []
    for home in (tmp_path / "first", tmp_path / "second"):
        server = PrefectServer(home / "server.log")
        server.start({**os.environ, "PREFECT_HOME": str(home), "XDG_CACHE_HOME": str(cache)})
        try:
            seen.append(server.database)
            api = Api(server.api_url)
            made = api.call("POST", "/flows/", {"name": f"flow-{home.name}"})
            assert api.call("GET", f"/flows/{made['id']}")["name"] == f"flow-{home.name}"
        finally:
            server.stop()
    first, second = seen
    assert (first.fresh, first.migrated) == (True, False)
    assert (second.seeded, second.migrated) == (True, True)
    assert first.template == second.template and second.template.exists()
