"""What trainflow relies on inside Prefect: how Prefect starts its own temporary server
(`flows/local_server.py` starts the same one under a guard). Prefect is not imported here:
the library stays free of it (`tests/unit/test_layering.py`).

Written and tested for Prefect 3.9.
"""

from trainflow.compat.patching import check, declare

PREFECT = ">=3.4,<3.10"

SERVER_APP = declare(
    "prefect: server.api.server:create_app (SubprocessASGIServer's command)",
    "prefect",
    PREFECT,
    target="prefect.server.api.server:create_app",
    outside="refuse",
    why="the local server is Prefect's own temporary server, started the way "
    "SubprocessASGIServer starts it, under a guard that stops it with the flow's process",
    public_api="prefect.server.api.server.SubprocessASGIServer, which gives no control over "
    "the server's process group",
)
PRIVATE_SERVER_SETTINGS = declare(
    "prefect: PREFECT__SERVER_EPHEMERAL, PREFECT__SERVER_FINAL",
    "prefect",
    PREFECT,
    target="prefect.server.api.server:SubprocessASGIServer",
    why="the private settings Prefect gives its temporary server: no UI build, the "
    "ephemeral server's own database handling",
)

# The uvicorn factory Prefect's temporary server runs.
SERVER_APP_FACTORY = "prefect.server.api.server:create_app"


def temporary_server_env() -> dict[str, str]:
    """The private settings Prefect's temporary server runs with."""
    check(SERVER_APP)
    check(PRIVATE_SERVER_SETTINGS)
    return {"PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}


def kept_server_env(env: dict[str, str]) -> dict[str, str]:
    """`env` (a temporary server's) as `prefect server start` runs its server: not ephemeral."""
    check(SERVER_APP)
    check(PRIVATE_SERVER_SETTINGS)
    kept = {k: v for k, v in env.items() if k != "PREFECT__SERVER_EPHEMERAL"}
    return {**kept, "PREFECT__SERVER_FINAL": "1"}
