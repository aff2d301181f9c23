"""Two launches on one machine register their datasets' shared memory one at a time: `streaming`
picks the first unused prefix and then creates it, so two picking at once took the same one
and the second failed with `FileExistsError: '/000055_locals'` (seen under a parallel test run).
"""

import os
import subprocess
import sys
import time

from tests.unit.conftest_data import REPO_ROOT, tabular_config
from trainflow.data.prepare import prepare_dataset
from trainflow.data.shm import registering

READER = """
import sys
from trainflow.data import LoaderConfig, build_dataloader
print("ready", flush=True)
loader = build_dataloader(sys.argv[1], "train", LoaderConfig(batch_size=16))
print("built", sum(1 for _ in loader), flush=True)
"""


def test_a_reader_registers_only_once_another_launch_has_released_the_lock(tmp_path):
    uri = prepare_dataset(tabular_config(tmp_path, num_rows=64)).uri
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TRAINFLOW_HOME": str(tmp_path / "home")}
    env.pop("RANK", None)
    with registering(True):  # another launch's rank 0, registering
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, uri],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert reader.stdout is not None
            assert reader.stdout.readline() == "ready\n", reader.stderr.read()
            time.sleep(3)  # a tiny split's loader is built in well under a second
            assert reader.poll() is None  # waiting for the lock
        except BaseException:
            reader.kill()
            raise
    out, err = reader.communicate(timeout=120)
    assert reader.returncode == 0, err[-3000:]
    assert out == "built 4\n"
