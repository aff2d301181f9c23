"""Data configs, `trainflow.data` and `trainflow.paths` import without torch or the data stack.

Flow modules validate their default configs when they are imported (`--help`, deployments,
Prefect's parameter checks), so these must not pay for torch, `streaming` or `transformers`.
"""

import subprocess
import sys

import pytest

from tests.unit.conftest_data import REPO_ROOT
from trainflow.data import config

HEAVY = ("torch", "streaming", "datasets", "transformers", "trl")


def _in_a_new_process(code: str) -> list[str]:
    """Run `code` in a new interpreter; its output lines, the last one being the heavy
    modules it ended up importing."""
    code += f"import sys\nprint(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO_ROOT
    )
    return out.stdout.strip().splitlines()


def test_configs_import_and_validate_without_heavy_modules():
    validated, loaded = _in_a_new_process(
        "import trainflow.data.config, trainflow.data, trainflow.paths\n"
        "assert trainflow.data.DataConfig is trainflow.data.config.DataConfig\n"
        "preset = trainflow.data.load_preset('instructions')\n"
        "print(preset.compression, preset.shard_size, preset.hashes)\n"
    )
    assert validated == "zstd 1mb ['sha1']"
    assert loaded == "[]", f"importing the data configs imported {loaded}"


def test_lazy_exports_resolve_and_unknown_names_fail():
    import trainflow.data as data
    from trainflow.data import prepare

    assert data.prepare_dataset is prepare.prepare_dataset
    assert data.dataset_fingerprint is prepare.dataset_fingerprint
    assert all(getattr(data, name) is not None for name in data.__all__)
    with pytest.raises(
        AttributeError, match="'trainflow.data' has no attribute 'prepare_dataset2'"
    ):
        data.prepare_dataset2  # noqa: B018


def test_values_skipping_streaming_checks_pass_them():
    """The shortcut sets in `config` may only hold values streaming's own checks accept."""
    from streaming.base.compression import is_compression
    from streaming.base.constant import SHM_TO_CLEAN
    from streaming.base.hashing import get_hashes
    from streaming.base.util import bytes_to_int

    from trainflow.data.shm import SHM_NAMES

    assert list(SHM_NAMES) == SHM_TO_CLEAN  # what the pipeline's process cleans up
    assert all(is_compression(c) for c in config.KNOWN_COMPRESSIONS)
    assert config.KNOWN_HASHES.issubset(get_hashes())
    assert all(0 < bytes_to_int(s) < 2**32 for s in config.KNOWN_SHARD_SIZES)


def test_finding_a_published_dataset_and_naming_a_workload_import_no_heavy_modules():
    """A pipeline's process looks its cached dataset up, cleans what streaming left behind and
    hands the ranks their workload without torch or the data stack: the ranks import them."""
    found, loaded = _in_a_new_process(
        "from trainflow.data import load_preset\n"
        "from trainflow.data.prepare import find_published\n"
        "from trainflow.strategies.job import Workload\n"
        "from trainflow.data.shm import clean_stale_streaming_state\n"
        "clean_stale_streaming_state()\n"
        "from trainflow.configs.sft import load_sft_preset\n"
        "print(find_published(load_preset('instructions').model_copy("
        f"update={{'output_root': {str(REPO_ROOT / 'no-such-root')!r}}})))\n"
        "Workload(train_fn='trainflow.workloads.sft:train', "
        "model_fn='trainflow.workloads.sft:build_model', "
        "config=load_sft_preset('debug_cpu'), output_dir='out')\n"
    )
    assert found == "None"
    assert loaded == "[]", f"finding a dataset or naming a workload imported {loaded}"
