"""Two real ranks (gloo) reading one split: disjoint, complete, and exactly resumable."""

import pytest

from tests.unit.conftest_data import (
    batch_ids,
    interleave,
    read_epoch_then_resume,
    tabular_config,
)
from trainflow import distributed
from trainflow.data import LoaderConfig, build_dataloader, prepare_dataset

read_on_two_ranks = distributed(gpus=2, gpu_type="cpu", timeout=180, init_process_group=True)(
    read_epoch_then_resume
)


@pytest.mark.slow
def test_two_ranks_partition_the_split_and_resume_exactly_on_two_and_on_one_rank(tmp_path):
    dataset = prepare_dataset(tabular_config(tmp_path, num_rows=240, shard_size="2kb"))
    config = LoaderConfig(batch_size=6, seed=11)
    num_batches = 7  # per rank: the state lands at global sample k = 7 * 6 * 2 = 84

    ranks = read_on_two_ranks.distributed(dataset.uri, "train", config, num_batches)

    # One epoch: disjoint per rank, together every sample exactly once, in a shuffled order.
    per_rank = [sorted(i for batch in r["epoch"] for i in batch) for r in ranks]
    assert set(per_rank[0]).isdisjoint(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == list(range(240))
    order = interleave([r["epoch"] for r in ranks])
    assert order != sorted(order)

    # The saved state is the same on both ranks and counts global samples.
    k = num_batches * config.batch_size * 2
    assert ranks[0]["state"] == ranks[1]["state"]
    assert ranks[0]["state"]["sample_in_epoch"] == k
    assert interleave([r["head"] for r in ranks]) == order[:k]

    # Resumed on two ranks: exactly the rest of the uninterrupted run.
    assert interleave([r["tail"] for r in ranks]) == order[k:]

    # Resumed on one rank (this process): the same rest, in the same order.
    loader = build_dataloader(dataset.uri, "train", config, state=ranks[0]["state"])
    assert [i for batch in batch_ids(loader) for i in batch] == order[k:]
