"""The app a local Prefect server runs (`flows.server_app`)."""

import subprocess
import sys

from tests.conftest import REPO_ROOT


def test_the_server_app_is_prefects_built_without_the_collector_which_is_on_again():
    code = (
        "import gc\n"
        "from flows.server_app import create_app\n"
        "app = create_app()\n"
        "from fastapi import FastAPI\n"
        "print(isinstance(app, FastAPI), gc.isenabled(), gc.get_freeze_count() > 0,\n"
        "      gc.get_stats()[2]['collections'])\n"
        "print(sorted(getattr(r, 'path', '') for r in app.routes))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    built, routes = done.stdout.splitlines()[-2:]
    assert built.split()[:3] == ["True", "True", "True"], built
    assert int(built.split()[3]) < 2, built  # no full collection while Prefect's app loaded
    assert "'/api'" in routes, routes  # Prefect's API, mounted
