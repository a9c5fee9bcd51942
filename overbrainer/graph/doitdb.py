"""doit's own database (``.doit.db`` in the run folder): a cache, never the truth. The
stamps say what is done (`tasks._UpToDate`), so whatever befalls doit's records costs a
few stats and never a step: a database sqlite cannot read is set aside and started anew
(`set_aside_damaged_db`), and one that cannot be opened or saved (a full disk, a folder
that cannot be written) gives one warning line instead of doit's traceback (`KeptSqlite`,
the backend bakes use: ``DOIT_CONFIG["backend"] = BACKEND``)."""

from __future__ import annotations

import os
import sqlite3
import sys

from doit.dependency import SqliteDB

from ..folder import RunFolder

__all__ = ["BACKEND", "BACKEND_PLUGIN", "KeptSqlite", "set_aside_damaged_db"]

BACKEND = "overbrainer-sqlite3"
BACKEND_PLUGIN = {"BACKEND": {BACKEND: f"{__name__}:KeptSqlite"}}  # DoitMain(extra_config=...)


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class KeptSqlite(SqliteDB):
    """doit's sqlite3 backend whose file may fail: kept in memory for this bake when it
    cannot be opened, and left as it was when it cannot be saved, each with one warning."""

    desc = "doit's sqlite3 database; a failure to open or save it warns (the stamps keep what is done)"

    def _sqlite3(self, name):
        try:
            return super()._sqlite3(name)
        except Exception as e:  # sqlite's error, or doit's DatabaseException around it
            if not _storage_problem(e):
                raise
            _warn(f"{name} cannot be opened ({_reason(e)}); this bake keeps doit's records in memory "
                  "(the stamps say what is done)")
            return super()._sqlite3(":memory:")

    def dump(self):
        try:
            super().dump()
        except (sqlite3.Error, OSError) as e:
            try:
                self._conn.rollback()
                self._conn.close()
            except sqlite3.Error:
                pass
            self._dirty = set()
            _warn(f"{self.name} not saved ({_reason(e)}); the stamps keep what is done, so the next bake "
                  "loses nothing")


def _storage_problem(e: BaseException) -> bool:
    """Whether `e` is about the database's file (space, permissions, I/O), not a bug."""
    if isinstance(e, (sqlite3.OperationalError, OSError)):
        return True
    text = str(e)
    return any(w in text for w in ("disk is full", "unable to open", "readonly", "disk I/O error"))


def _reason(e: BaseException) -> str:
    text = str(e).rsplit("Original error: ", 1)[-1]
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def set_aside_damaged_db(folder: RunFolder) -> None:
    """doit's database that sqlite cannot read is moved aside, with one warning line on
    stderr, and doit starts a new one: nothing is lost but a few stats."""
    db = folder.doit_db
    if not db.is_file():
        return
    try:
        with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
            con.execute("SELECT count(*) FROM sqlite_master").fetchone()
        con.close()
        return
    except sqlite3.Error as e:
        problem = str(e)
    aside = db.with_name(db.name + ".damaged")
    os.replace(db, aside)
    _warn(f"{db} is damaged ({problem}); set aside as {aside.name} and rebuilt from the stamps")
