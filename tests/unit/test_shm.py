"""Which `streaming` leftovers a pipeline waits for before it cleans up after its ranks."""

import mmap
import os
import time

import pytest

from trainflow.data.shm import GRACE_S, SHM_DIR, clean_stale_streaming_state, too_young_to_judge

pytestmark = [
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm"),
    # Other tests' runs clean up stale shared memory, this test's leftover included.
    pytest.mark.alone,
]


@pytest.fixture
def leftover():
    path = SHM_DIR / "999987_locals"  # a prefix no streaming run here comes near
    path.write_bytes(b"\0" * mmap.PAGESIZE)
    yield path
    path.unlink(missing_ok=True)


def test_young_unmapped_memory_is_waited_for_then_removed(leftover):
    assert str(leftover) in too_young_to_judge()
    assert str(leftover) not in clean_stale_streaming_state()  # not judged yet
    old = time.time() - GRACE_S - 1
    os.utime(leftover, (old, old))
    assert str(leftover) not in too_young_to_judge()
    assert str(leftover) in clean_stale_streaming_state()
    assert not leftover.exists()


def test_memory_a_live_process_maps_is_neither_waited_for_nor_removed(leftover):
    with open(leftover, "r+b") as file, mmap.mmap(file.fileno(), mmap.PAGESIZE) as mapped:
        # Another run's: waiting would not change that.
        assert str(leftover) not in too_young_to_judge()
        old = time.time() - GRACE_S - 1
        os.utime(leftover, (old, old))
        assert str(leftover) not in clean_stale_streaming_state()
        assert mapped[0] == 0 and leftover.exists()
