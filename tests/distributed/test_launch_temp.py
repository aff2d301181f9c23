"""A launch leaves nothing in the temp folder: its ranks get their own, removed after them."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from trainflow import distributed
from trainflow.launch import temp


@distributed(gpus=2, gpu_type="cpu", timeout=120)
def litter() -> dict:
    """What libraries do to the temp folder: a `TemporaryDirectory` that is never cleaned up
    (the rank ends with `os._exit`, so its finalizer does not run), a folder made and kept,
    and a child process's file."""
    kept = tempfile.TemporaryDirectory(prefix="kept-")
    made = tempfile.mkdtemp(prefix="made-")
    Path(made, "file").write_text("x")
    child = "import tempfile; tempfile.mkstemp(prefix='child-')"
    subprocess.run([sys.executable, "-c", child], check=True)
    return {
        "temp": tempfile.gettempdir(),
        "entries": sorted(p.name[:5] for p in Path(tempfile.gettempdir()).iterdir()),
        "kept": kept.name,
        "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    }


def test_what_ranks_leave_in_the_temp_folder_goes_with_the_launch(tmp_path, monkeypatch):
    system = tmp_path / "tmp"
    system.mkdir()
    monkeypatch.setenv("TMPDIR", str(system))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)
    # An agent SIGKILLed with its ranks left its folder; one of a live process stays.
    dead = system / f"{temp.RANKS_PREFIX}{2**22 + 7}-abc"
    (dead / "made-x").mkdir(parents=True)
    live = system / f"{temp.RANKS_PREFIX}1-abc"
    live.mkdir()

    results = litter.distributed()

    folders = {r["temp"] for r in results}
    assert len(folders) == 1, "both ranks of the node share one temp folder"
    folder = Path(folders.pop())
    assert folder.parent == system and folder.name.startswith(temp.RANKS_PREFIX)
    assert all(r["kept"].startswith(str(folder)) for r in results)
    assert all(set(r["entries"]) >= {"kept-", "made-", "child"} for r in results)
    # torch's compiler cache stays where it is without a launch, so it outlives one.
    assert {r["inductor"] for r in results} == {temp.inductor_cache_default(str(system))}
    assert sorted(p.name for p in system.iterdir()) == [live.name]


def test_only_this_users_entries_of_dead_owners_are_removed(tmp_path):
    dead_pid = 2**22 + 7  # above Linux's largest process id
    dead_log = tmp_path / f"{temp.STANDBY_PREFIX}{dead_pid}-x.log"
    live_log = tmp_path / f"{temp.own_prefix(temp.STANDBY_PREFIX)}y.log"
    unrelated = tmp_path / f"{temp.STANDBY_PREFIX}notapid-z.log"
    for path in (dead_log, live_log, unrelated):
        path.write_text("")
    dead_folder = tmp_path / f"{temp.RANKS_PREFIX}{dead_pid}-q"
    (dead_folder / "inner").mkdir(parents=True)

    assert temp.remove_left_by_dead(temp.STANDBY_PREFIX, tmp_path) == [dead_log]
    assert temp.remove_left_by_dead(temp.RANKS_PREFIX, tmp_path) == [dead_folder]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live_log.name, unrelated.name])
