"""Prepare a dataset: source -> transform -> MDS shards, cached by content.

python -m flows.prepare                          # the 'instructions' preset
python -m flows.prepare --preset interactions
python -m flows.prepare --config my_data.yaml    # any DataConfig as YAML
"""

import argparse

import yaml
from prefect import flow

from tasks.data import prepare_dataset
from trainflow.data import DataConfig, PreparedDataset, load_preset


@flow(name="prepare", log_prints=True)
def prepare(config: DataConfig = load_preset("instructions")) -> PreparedDataset:
    """Publish `config`'s dataset as MDS shards (a cache hit if it already is)."""
    return prepare_dataset(config)


def _config_from_args(argv: list[str] | None = None) -> DataConfig:
    parser = argparse.ArgumentParser(description="Prepare a dataset as MDS shards.")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--preset", default="instructions", help="shipped preset name")
    group.add_argument("--config", help="path to a DataConfig YAML file")
    args = parser.parse_args(argv)
    if args.config:
        with open(args.config) as f:
            return DataConfig.model_validate(yaml.safe_load(f))
    return load_preset(args.preset)


if __name__ == "__main__":
    result = prepare(_config_from_args())
    print(result.model_dump_json(indent=2))
