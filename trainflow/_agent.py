"""The helper process that hosts torch's elastic agent for one launch.

Started by the caller in its own session (`python -m trainflow._agent RUN_DIR`), so that the
agent, its workers and anything they start form one process group the caller can stop at once,
and the caller's process keeps no elastic signal handlers or multiprocessing helpers behind.
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from trainflow import _worker
from trainflow.run_dir import RunDir


def _exit_with_parent(parent_pid: int) -> None:
    """If the caller dies without stopping us (SIGKILL, OOM), take the whole group down."""
    while True:
        if os.getppid() != parent_pid:
            os.killpg(os.getpgrp(), signal.SIGKILL)
        time.sleep(0.5)


def main(run_dir: str) -> int:
    rd = RunDir(Path(run_dir))
    spec = rd.read_spec()
    threading.Thread(target=_exit_with_parent, args=(spec["caller_pid"],), daemon=True).start()

    config = LaunchConfig(
        min_nodes=spec["nnodes"],
        max_nodes=spec["nnodes"],
        nproc_per_node=spec["nproc_per_node"],
        run_id=spec["run_id"],
        rdzv_backend="c10d",
        rdzv_endpoint=spec["rdzv_endpoint"],
        rdzv_configs={"timeout": spec["rdzv_timeout_s"]},
        max_restarts=spec["max_restarts"],
        monitor_interval=0.1,
        start_method=spec["start_method"],
        shutdown_timeout=spec["shutdown_timeout_s"],
        logs_specs=DefaultLogsSpecs(log_dir=str(rd.path / "elastic")),
    )
    try:
        elastic_launch(config, _worker.main)(str(rd.path))
    except ChildFailedError as exc:
        rd.agent_error.write_text(exc.format_msg())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
