"""The SFT throughput benchmark compares like with like: both sides, run for a few steps on 2
gloo ranks, have the same Trainer settings, train on the same non-padding tokens and feed the
model the same first batch on every rank."""

import pytest
import torch

from benchmarks import sft_throughput
from trainflow.data.tokenizer import load_tokenizer
from trainflow.workloads.sft import LMCollate, load_sft_preset

pytestmark = pytest.mark.slow

STEPS = 10  # one logging interval: TRL's token count is logged at step 10


def test_both_sides_train_on_the_same_batches_with_the_same_settings(tmp_path):
    result = sft_throughput.compare(STEPS, 2, tmp_path, dump_first_batch=True)
    ours, plain = result["pipeline"], result["plain"]

    assert result["settings_differ"] == {}
    assert plain["settings"]["weight_decay"] == 0.0 and plain["settings"]["max_steps"] == STEPS
    assert ours["tokens"] == plain["tokens"] > 0
    # The pipeline's first batch on each rank, from the ids its Trainer drew, through its own
    # collate; the plain side's as its Trainer's loader gives it.
    config = load_sft_preset("debug_cpu")
    collate = LMCollate(load_tokenizer(config.tokenizer_path()).pad_token_id, config.max_length)
    for rank, batches in enumerate(ours["batches"]):
        assert len(batches) == STEPS
        assert len(batches[0]) == config.training.per_device_batch_size
        expected = collate([result["rows"][i] for i in batches[0]])
        got = torch.load(tmp_path / sft_throughput.FIRST_BATCH.format(rank=rank))
        assert set(got) == {"input_ids", "attention_mask", "labels"}
        for key in got:
            assert torch.equal(got[key], expected[key]), (rank, key)
        assert (got["labels"] == -100).any() and (got["labels"] != -100).any()
    # The two ranks trained on different rows.
    first, second = (set(i for b in rank for i in b) for rank in ours["batches"])
    assert not first & second
