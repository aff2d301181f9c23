"""Prepare a dataset: source -> transform -> MDS shards, cached by content.

python -m flows.prepare                          # the 'instructions' preset
python -m flows.prepare --preset interactions
python -m flows.prepare --config my_data.yaml    # any DataConfig as YAML
python -m flows.prepare --help
"""

import functools
import sys

from prefect import flow

from tasks.data import prepare_dataset
from trainflow.cli import pipeline_config
from trainflow.data.config import DataConfig, PreparedDataset, load_preset, preset_names

PRESETS = {name: functools.partial(load_preset, name) for name in preset_names()}


@flow(name="prepare", log_prints=True)
def prepare(config: DataConfig = load_preset("instructions")) -> PreparedDataset:
    """Publish `config`'s dataset as MDS shards (a cache hit if it already is)."""
    return prepare_dataset(config)


def _config_from_args(argv: list[str] | None = None) -> DataConfig:
    return pipeline_config(prepare, load_preset("instructions"), argv, __doc__, PRESETS)


def main(argv: list[str] | None = None) -> PreparedDataset:
    """Parse, check the local files, then prepare under a local Prefect server if none is set.

    Bad input (an option, more processes than cores, a missing file, a row that does not
    parse, a column the transform needs) exits 2 with one line naming it, before the server
    starts; a data error found later exits 1 the same way, not with a traceback.
    """
    from flows.local_server import local_prefect_server
    from trainflow.data.checks import check_files, check_num_proc
    from trainflow.data.errors import DataError

    config = _config_from_args(argv)
    try:
        check_num_proc(config.num_proc, "--num-proc")
        check_files(config)
    except DataError as exc:
        print(f"python -m flows.prepare: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        with local_prefect_server():
            result = prepare(config)
    except DataError as exc:
        print(f"python -m flows.prepare: error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    print(result.model_dump_json(indent=2))
    return result


if __name__ == "__main__":
    from trainflow.cli import exit_now

    main(sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown
