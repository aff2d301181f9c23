"""A temporary Prefect server on a new home starts on a copy of the migrated empty database
the install made, instead of migrating its own; other databases are left alone."""

import os
import sqlite3
import subprocess
import sys

import prefect
import pytest

from flows.local_server import database_template, make_database_template, seed_database
from tests.conftest import REPO_ROOT


def _revision(path) -> str:
    with sqlite3.connect(path) as db:
        return db.execute("select version_num from alembic_version").fetchone()[0]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A template made as the install makes it (Prefect's own migration), in a temp folder."""
    return make_database_template(tmp_path_factory.mktemp("share") / "prefect.db")


def test_the_install_made_this_environments_template():
    made = database_template()
    assert made.is_file(), "scripts/setup.sh runs python -m flows.local_server make-template"
    assert prefect.__version__ in made.name
    assert not list(made.parent.glob(".prefect-db-*"))  # no half-made template left


def test_a_new_home_is_seeded_and_its_server_runs_a_flow_on_it(template, tmp_path):
    home = tmp_path / "home"
    seeded = seed_database(f"sqlite+aiosqlite:///{home}/prefect.db", template)
    assert seeded == home / "prefect.db"
    assert seeded.read_bytes() == template.read_bytes()
    assert not list(home.glob(".*partial"))
    code = (
        "from prefect import flow\n"
        "from flows.local_server import local_prefect_server\n"
        "@flow\n"
        "def hello(): return 'ran'\n"
        "with local_prefect_server():\n"
        "    print('FLOW', hello())\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FLOW ran" in out.stdout
    with sqlite3.connect(seeded) as db:
        assert db.execute("select count(*) from flow_run").fetchone()[0] == 1
    assert _revision(seeded) == _revision(template)  # nothing left to migrate


def test_an_existing_database_and_other_kinds_are_never_seeded(template, tmp_path):
    existing = tmp_path / "prefect.db"
    existing.write_bytes(b"a user's database")
    assert seed_database(f"sqlite+aiosqlite:///{existing}", template) is None
    assert existing.read_bytes() == b"a user's database"
    for url in (
        "postgresql+asyncpg://user@localhost/prefect",
        "sqlite+aiosqlite:///file::memory:?cache=shared&uri=true&check_same_thread=false",
    ):
        assert seed_database(url, template) is None
    missing = tmp_path / "no-template.db"
    assert seed_database(f"sqlite+aiosqlite:///{tmp_path}/new.db", missing) is None
    assert not (tmp_path / "new.db").exists()  # the server migrates its own, as before
