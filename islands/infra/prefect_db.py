"""The embedded Prefect server's SQLite database, migrated once per installed Prefect.

On a fresh home the server runs every migration before it answers: about 4 of the 7 seconds it
takes to start on two cores. Once one server has migrated a fresh database, a copy of it (the
template, in the user's cache, named for the Prefect version) seeds the next fresh home, and a
marker beside each database names the Prefect that migrated it, so a server on a database at
that version's head is started without the migrations (`migrate_on_start` off). Another
Prefect version finds no template and no matching marker: it migrates as before.
A server pointed at another database (a connection URL) is left alone.
"""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Mapping
from contextlib import closing
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

CONNECTION_SETTINGS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")
NO_MIGRATIONS = {"PREFECT_SERVER_DATABASE_MIGRATE_ON_START": "false"}


def template_path(env: Mapping[str, str], prefect: str) -> Path:
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "islands" / f"prefect-{prefect}.db"


def marker_path(db: Path) -> Path:
    return db.with_name(db.name + ".migrated-by")


@dataclass(frozen=True)
class Database:
    path: Path
    template: Path
    prefect: str  # the installed Prefect's version
    migrated: bool  # at that version's head already: the server need not migrate it
    fresh: bool  # created by this start from nothing: once migrated, it can become the template
    seeded: bool  # copied from the template by this start

    def server_env(self) -> dict[str, str]:
        return NO_MIGRATIONS if self.migrated else {}

    def started(self) -> None:
        """The server answers, so its migrations are done: mark the database, and keep a copy of
        a fresh one as the template (its history is empty: nothing of a user's runs is copied)."""
        if self.migrated:
            return
        marker_path(self.path).write_text(self.prefect)
        if self.fresh and not self.template.exists():
            try:
                snapshot(self.path, self.template)
            except (OSError, sqlite3.Error):
                pass  # no cache to write to (a read-only home): every fresh home migrates, as before

    def failed(self) -> None:
        """A server that did not start from the template's copy: drop the template, so the next
        fresh home migrates from nothing and makes a new one."""
        if self.seeded:
            self.template.unlink(missing_ok=True)


def prepare(env: Mapping[str, str]) -> Database | None:
    """The database the server will open under PREFECT_HOME, a fresh one seeded from the
    template when there is one; None when the server is given another database."""
    if any(env.get(name) for name in CONNECTION_SETTINGS):
        return None
    prefect = version("prefect")
    db, template = Path(env["PREFECT_HOME"]) / "prefect.db", template_path(env, prefect)
    fresh, seeded = not db.exists(), False
    if fresh and template.exists():
        db.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copyfile(template, db)
            marker_path(db).write_text(prefect)
            fresh, seeded = False, True
        except OSError:  # an unreadable template: this home migrates from nothing
            db.unlink(missing_ok=True)
    marker = marker_path(db)
    migrated = db.exists() and marker.exists() and marker.read_text() == prefect
    return Database(db, template, prefect, migrated, fresh, seeded)


def snapshot(source: Path, dest: Path) -> None:
    """A consistent copy of a live SQLite database (the server may be writing), put in place at once."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    with closing(sqlite3.connect(source)) as src, closing(sqlite3.connect(tmp)) as out:
        src.backup(out)
    os.replace(tmp, dest)
