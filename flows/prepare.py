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


if __name__ == "__main__":
    from flows.local_server import local_prefect_server

    config = _config_from_args(sys.argv[1:])
    with local_prefect_server():
        result = prepare(config)
    print(result.model_dump_json(indent=2))
