"""Ranks started with another interpreter (a framework's own virtual environment).

The stand-in environment is a real virtual environment made here with `python -m venv`, so
that its `sys.executable` and `sys.prefix` differ from the caller's; a `.pth` file lends it
this environment's packages (torch, psutil, cloudpickle), as a framework's environment would
have its own.
"""

import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

from trainflow import RankError, runtime
from trainflow.errors import LaunchConfigError
from trainflow.launch.backends import launch
from trainflow.launch.environment import check_interpreter, interpreter, rank_sys_path
from trainflow.launch.spec import LaunchOptions
from trainflow.paths import trainflow_home


def _make_venv(folder: Path, lend_packages: bool) -> str:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True)
    python = folder / "bin" / "python"
    if lend_packages:
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
        lines = [f"import site; site.addsitedir({p!r})" for p in ours]
        (Path(purelib) / "lend_packages.pth").write_text("\n".join(lines) + "\n")
    return str(python)


@pytest.fixture(scope="module")
def other_python(tmp_path_factory) -> str:
    return _make_venv(tmp_path_factory.mktemp("framework-env"), lend_packages=True)


def where_am_i() -> dict:
    """Runs on each rank: what interpreter and environment contract it sees."""
    print(f"running on {sys.executable}", flush=True)
    return {
        "executable": sys.executable,
        "prefix": sys.prefix,
        "rank": runtime.get_global_rank(),
        "env": {
            k: os.environ.get(k)
            for k in (
                "RANK",
                "LOCAL_RANK",
                "WORLD_SIZE",
                "MASTER_ADDR",
                "MASTER_PORT",
                "TRAINFLOW_DEVICE",
                "CUDA_VISIBLE_DEVICES",
                "VIRTUAL_ENV",
                "MY_SETTING",
            )
        },
        "path_head": os.environ["PATH"].split(os.pathsep)[0],
        "pythonpath": os.environ.get("PYTHONPATH", ""),
    }


def fail_on_rank_one() -> None:
    if runtime.get_global_rank() == 1:
        raise ValueError("bad batch on rank one")


def test_ranks_run_on_the_other_interpreter_with_the_same_contract(other_python):
    lines: list[tuple[int, str]] = []
    opts = LaunchOptions(
        gpus=2, gpu_type="cpu", timeout=120, python=other_python, env={"MY_SETTING": "kept"}
    )
    result = launch(where_am_i, options=opts, on_line=lambda r, line: lines.append((r, line)))
    venv = str(Path(other_python).parent.parent)
    assert [v["rank"] for v in result.values] == [0, 1]
    for value in result.values:
        assert value["executable"] == other_python != sys.executable
        assert value["prefix"] == venv
        env = value["env"]
        assert env["RANK"] == str(value["rank"]) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == str(value["rank"]) and env["MASTER_ADDR"]
        assert env["TRAINFLOW_DEVICE"] == "cpu" and env["CUDA_VISIBLE_DEVICES"] == ""
        assert env["MY_SETTING"] == "kept" and env["VIRTUAL_ENV"] == venv
        assert value["path_head"] == str(Path(other_python).parent)
        # The caller's installed packages are not on the ranks' path; its project folder is.
        assert "site-packages" not in value["pythonpath"]
        assert str(Path(__file__).parents[2]) in value["pythonpath"].split(os.pathsep)
    # Rank output arrives line by line, tagged with its rank.
    assert (0, f"running on {other_python}") in lines
    assert (1, f"running on {other_python}") in lines


def test_a_rank_error_on_the_other_interpreter_names_the_rank(other_python):
    opts = LaunchOptions(gpus=2, gpu_type="cpu", timeout=120, python=other_python)
    with pytest.raises(RankError) as info:
        launch(fail_on_rank_one, options=opts, on_line=lambda r, line: None)
    assert info.value.rank == 1
    assert "bad batch on rank one" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)


def test_an_environment_without_torch_fails_before_any_rank_starts(tmp_path):
    bare = _make_venv(tmp_path / "bare", lend_packages=False)
    refused = r"python=.*bare/bin/python cannot run the ranks.*torch"
    with pytest.raises(LaunchConfigError, match=refused):
        check_interpreter(bare)
    runs = trainflow_home() / "runs"
    runs_before = set(runs.glob("*"))
    with pytest.raises(LaunchConfigError, match="setup-framework.sh"):
        launch(where_am_i, options=LaunchOptions(gpus=2, gpu_type="cpu", python=bare))
    assert set(runs.glob("*")) == runs_before


def test_a_missing_interpreter_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"python='.*nowhere/bin/python': no executable"):
        LaunchOptions(gpus=2, python=str(tmp_path / "nowhere" / "bin" / "python"))


def test_the_callers_own_interpreter_keeps_its_whole_path():
    path = ["/project", "/x/site-packages"]
    assert rank_sys_path(path, interpreter(LaunchOptions(gpus=1))) == path
    assert rank_sys_path(path, interpreter(LaunchOptions(gpus=1, python=sys.executable))) == path
