"""Data defects as a user meets them: the pipelines' commands and the prepare flow on a real
Prefect server.

- `python -m flows.prepare --num-proc 100000` is a usage error naming the option, the figure
  and the limit, before anything starts;
- a dataset file named in any script is taken, and a refused one names the option;
- bad two-tower rows are refused naming file, line and column, not with a traceback;
- a damaged published dataset is rebuilt by the next prepare run, not handed out again
  from the Prefect cache, and one whose manifest is missing is rebuilt in place.
"""

import gc
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import flows.prepare
from flows import command
from flows.prepare import prepare
from tests.conftest import REPO_ROOT
from tests.unit.conftest_data import chat_config, instruction_rows, tabular_config, write_jsonl
from trainflow.data import DataError, prepare_dataset
from trainflow.data.checks import check_files
from trainflow.data.paths import stream_cache_dir
from trainflow.workloads import sft

CORES = len(os.sched_getaffinity(0))  # what this process may use


def _command(cwd: Path, pipeline: str, *args: str) -> subprocess.CompletedProcess:
    """`python -m flows.<pipeline> ARGS` as a user runs it, with its own trainflow home."""
    return subprocess.run(
        [sys.executable, "-m", f"flows.{pipeline}", *args],
        cwd=cwd,
        env={
            **os.environ,
            "PYTHONPATH": str(REPO_ROOT),
            "MLFLOW_TRACKING_URI": "",
            "HF_HUB_OFFLINE": "1",
            "TRAINFLOW_HOME": str(cwd / "home"),
        },
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("figure", [100000, CORES + 1])
def test_prepare_refuses_more_processes_than_cores_before_anything_starts(figure, tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        flows.prepare.main(["--num-proc", str(figure), "--output-root", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert f"--num-proc={figure}" in err and f"the limit is {CORES}" in err, err
    assert "Traceback" not in err and "Starting temporary server" not in err
    assert not (tmp_path / "out").exists()


UNICODE_FILE = "données-训练.jsonl"


def test_sft_takes_a_dataset_file_named_in_any_script(tmp_path):
    path = tmp_path / "x" / UNICODE_FILE
    path.parent.mkdir()
    write_jsonl(instruction_rows(60, seed=3), path)
    config = command.parse_args("sft", ["--dataset", str(path)])
    data = config.data_config().model_copy(update={"output_root": str(tmp_path / "out")})
    assert data.name == "données-训练"
    check_files(data)
    result = prepare_dataset(data)
    assert Path(result.uri).name.startswith("données-训练-")
    assert (
        len(sft.read_split(result.uri, "train")["input_ids"]) == result.splits["train"].num_samples
    )
    gc.collect()

    # What the user ran: the command plans the run on that file, without a traceback.
    proc = _command(tmp_path, "sft", "--dataset", str(path), "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("pipeline", "option", "value"),
    [
        ("sft", "--dataset", "/nonexistent/données-训练.jsonl"),
        ("sft", "--dataset", "nope"),
        ("two_tower", "--data-dataset", "/nonexistent/données-训练.csv"),
        ("two_tower", "--data-dataset", "données-训练.txt"),
    ],
)
def test_a_refused_dataset_names_its_option(pipeline, option, value, capsys):
    with pytest.raises(SystemExit) as info:
        command.parse_args(pipeline, [option, value])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert f"error: {option}: " in err and value in err, err


def test_bad_two_tower_rows_are_refused_naming_file_line_and_column(tmp_path):
    lines = (REPO_ROOT / "data" / "interactions.csv").read_text().splitlines()[:2001]
    lines[58] = "57,abc,88,3,1"
    path = tmp_path / "clicks.csv"
    path.write_text("\n".join(lines) + "\n")
    proc = _command(tmp_path, "two_tower", "--data-dataset", str(path), "--dry-run")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert (
        f"data.user_column='user_id': file {path} of split 'train': line 59, column 'user_id' "
        "holds 'abc'; expected an integer (int64)"
    ) in proc.stderr


def test_a_damaged_published_dataset_is_rebuilt_by_the_next_prepare_run(prefect_api, tmp_path):
    config = chat_config(tmp_path, num_rows=96)
    built = prepare(config, return_state=True).result()
    shard = sorted((Path(built.uri) / "train").glob("shard.*"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    shutil.rmtree(stream_cache_dir(built.uri), ignore_errors=True)
    with pytest.raises(DataError, match=str(shard)):
        sft.read_split(built.uri, "train")  # a training run meets it, and says which file
    gc.collect()

    state = prepare(config, return_state=True)
    rebuilt = state.result()
    assert state.name == "Completed" and not rebuilt.cache_hit
    assert rebuilt.uri == built.uri
    assert len(sft.read_split(rebuilt.uri, "train")["input_ids"]) == 96
    gc.collect()


def test_a_published_dataset_without_its_manifest_is_rebuilt_in_place(prefect_api, tmp_path):
    config = tabular_config(tmp_path)
    built = prepare(config, return_state=True).result()
    (Path(built.uri) / "manifest.json").unlink()

    state = prepare(config, return_state=True)
    rebuilt = state.result()
    assert state.name == "Completed" and not rebuilt.cache_hit
    assert (Path(rebuilt.uri) / "manifest.json").is_file()
    assert os.listdir(Path(built.uri).parent) == [Path(built.uri).name]
