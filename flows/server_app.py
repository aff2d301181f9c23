"""The app a local Prefect server runs (uvicorn's factory, `flows.local_server`): Prefect's
own (`trainflow.compat.prefect.SERVER_APP_FACTORY`), built with the cyclic collector off.

Most of a server's start is importing Prefect's server app (about 3 s of one core on a 2-core
machine, beside the run's launch agent), and the collector's full collections of the growing
heap during those imports free next to nothing: without them the start takes about a fifth
less CPU. What was built is then frozen out of the collector's sight (it lives as long as the
server) and the collector is on again before the server serves.
"""

import gc
import importlib
from typing import Any

from trainflow.compat import prefect as prefect_compat


def create_app() -> Any:
    """Prefect's server app, imported and built with the collector off."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        module, _, name = prefect_compat.SERVER_APP_FACTORY.partition(":")
        return getattr(importlib.import_module(module), name)()
    finally:
        if was_on:
            gc.freeze()
            gc.enable()
