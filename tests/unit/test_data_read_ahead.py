"""The loader's read-ahead thread on a real published dataset: the same batches in the same
order, a resume state that counts only the batches handed out, errors raised where they
happen, and no thread left behind by an epoch the caller leaves early."""

import threading
import time

import pytest
from pydantic import ValidationError

from tests.unit.conftest_data import batch_ids, tabular_config
from trainflow.data import LoaderConfig, PadCollate, build_dataloader, prepare_dataset


@pytest.fixture
def clicks(tmp_path):
    """A published 200-row tabular dataset (train only)."""
    return prepare_dataset(tabular_config(tmp_path, shard_size="2kb"))


class CountingCollate(PadCollate):
    """PadCollate that counts the batches it built, and fails the one numbered `fail_at`."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.built = 0
        self.fail_at = fail_at

    def __call__(self, samples):
        self.built += 1
        if self.built == self.fail_at:
            raise ValueError(f"bad batch {self.built}")
        return super().__call__(samples)


_EARLIER: set[threading.Thread] = set()


@pytest.fixture(autouse=True)
def _earlier_threads():
    """Read-ahead threads of other tests' loaders in this process (one a Trainer left in a
    reference cycle lives until the collector runs) are not this test's."""
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name == "trainflow-read-ahead")
    yield


def _read_ahead_threads() -> list[threading.Thread]:
    """This test's read-ahead threads still alive."""
    return [
        t for t in threading.enumerate() if t.name == "trainflow-read-ahead" and t not in _EARLIER
    ]


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.01)
    return condition()


def test_read_ahead_gives_the_batches_of_reading_in_the_loop(clicks):
    inline = LoaderConfig(batch_size=8, seed=3, prefetch=0)
    ahead = inline.model_copy(update={"prefetch": 3})
    assert batch_ids(build_dataloader(clicks.uri, "train", ahead)) == batch_ids(
        build_dataloader(clicks.uri, "train", inline)
    )


def test_batches_read_ahead_are_not_in_the_resume_state(clicks):
    config = LoaderConfig(batch_size=8, seed=1, prefetch=2)
    collate = CountingCollate()
    loader = build_dataloader(clicks.uri, "train", config, collate_fn=collate)
    epoch = iter(loader)
    first = [next(epoch)["id"].tolist() for _ in range(3)]
    # One batch in hand, two queued, perhaps one more waiting for room in the queue.
    assert _wait_for(lambda: collate.built >= 5)
    assert collate.built <= 6
    state = loader.state_dict()
    assert state["sample_in_epoch"] == 24
    rest = batch_ids(build_dataloader(clicks.uri, "train", config, state=state))
    everything = batch_ids(build_dataloader(clicks.uri, "train", config))
    assert first + rest == everything


def test_start_reading_reads_before_the_loop_asks(clicks):
    config = LoaderConfig(batch_size=8, seed=2, prefetch=2)
    collate = CountingCollate()
    loader = build_dataloader(clicks.uri, "train", config, collate_fn=collate)
    loader.start_reading()
    assert _wait_for(lambda: collate.built >= 2)
    assert batch_ids(loader) == batch_ids(build_dataloader(clicks.uri, "train", config))
    assert loader.state_dict()["sample_in_epoch"] == 200


def test_an_error_while_reading_ahead_is_raised_at_its_batch(clicks):
    collate = CountingCollate(fail_at=4)
    loader = build_dataloader(
        clicks.uri, "train", LoaderConfig(batch_size=8, prefetch=2), collate_fn=collate
    )
    got = []
    with pytest.raises(ValueError, match="bad batch 4"):
        for batch in loader:
            got.append(batch)
    assert len(got) == 3
    assert _wait_for(lambda: not _read_ahead_threads())


def test_an_epoch_left_early_stops_its_thread(clicks):
    loader = build_dataloader(clicks.uri, "train", LoaderConfig(batch_size=8, prefetch=2))
    epoch = iter(loader)
    next(epoch)
    assert _read_ahead_threads()
    epoch.close()  # what the garbage collector does to an epoch the Trainer leaves
    assert _wait_for(lambda: not _read_ahead_threads())
    assert loader.state_dict()["sample_in_epoch"] == 8


def test_leaving_an_epoch_does_not_wait_for_the_threads_next_look(clicks, monkeypatch):
    from trainflow.data import loader as loader_module

    # The thread, waiting for room in the full queue, would look whether it was closed only
    # after this long; leaving the epoch must not wait for that.
    monkeypatch.setattr(loader_module._ReadAhead, "_POLL_S", 60.0)
    collate = CountingCollate()
    loader = build_dataloader(
        clicks.uri, "train", LoaderConfig(batch_size=8, prefetch=2), collate_fn=collate
    )
    epoch = iter(loader)
    next(epoch)
    assert _wait_for(lambda: collate.built >= 4)  # queue full, one more waiting to go in
    started = time.monotonic()
    epoch.close()
    assert time.monotonic() - started < 30.0
    assert not _read_ahead_threads()
    assert loader.state_dict()["sample_in_epoch"] == 8


def test_without_read_ahead_batches_are_built_when_asked(clicks):
    collate = CountingCollate()
    loader = build_dataloader(
        clicks.uri, "train", LoaderConfig(batch_size=8, prefetch=0), collate_fn=collate
    )
    loader.start_reading()  # a no-op without read-ahead
    epoch = iter(loader)
    next(epoch)
    next(epoch)
    time.sleep(0.2)
    assert collate.built == 2 and not _read_ahead_threads()


def test_a_negative_prefetch_names_the_field():
    with pytest.raises(ValidationError, match="prefetch"):
        LoaderConfig(batch_size=8, prefetch=-1)
