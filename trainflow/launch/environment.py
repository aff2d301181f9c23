"""The interpreter, import path and environment a launch's agent and ranks run with."""

import os
import subprocess
import sys
from collections.abc import Sequence

from trainflow.errors import LaunchConfigError
from trainflow.launch.plan import LaunchPlan
from trainflow.launch.ship import caller_sys_path
from trainflow.launch.spec import START_METHOD_ENV, LaunchOptions, check_interpreter_path


def interpreter(options: LaunchOptions) -> str:
    """The Python the agent and ranks run on: `options.python`, else the caller's."""
    return os.path.abspath(options.python) if options.python else sys.executable


def rank_sys_path(sys_path: Sequence[str], python: str) -> list[str]:
    """The caller's import path as ranks running on `python` get it.

    Ranks on another interpreter (a framework's own environment) keep only the caller's own
    folders (its project, its notebook's folder): the caller's installed packages and standard
    library would shadow the versions that environment was made with.
    """
    if python == sys.executable:
        return list(sys_path)
    own = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix)}
    kept = []
    for entry in sys_path:
        real = os.path.realpath(entry)
        parts = real.split(os.sep)
        if "site-packages" in parts or "dist-packages" in parts:
            continue
        if any(real == p or real.startswith(p + os.sep) for p in own):
            continue
        kept.append(entry)
    return kept


_interpreters_checked: dict[str, str] = {}


def check_interpreter(python: str) -> str:
    """Check that `python` can run our agent and ranks; return its version line.

    Run before a launch on another interpreter, so that an environment that was never made,
    or lacks torch or trainflow, fails with its name before any rank starts. Cached per
    interpreter for the life of this process.

    Raises:
        LaunchConfigError: it cannot start, naming the interpreter and the import that failed.
    """
    check_interpreter_path(python)
    python = os.path.abspath(python)
    if python in _interpreters_checked:
        return _interpreters_checked[python]
    probe = (
        "import sys, torch, trainflow.launch.agent, trainflow.launch.worker; "
        "print(sys.version.split()[0], 'torch', torch.__version__)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(rank_sys_path(caller_sys_path(), python))}
    try:
        done = subprocess.run(
            [python, "-c", probe], capture_output=True, text=True, env=env, timeout=300
        )
    except subprocess.TimeoutExpired as exc:
        raise LaunchConfigError(f"python={python}: did not start within 300 s") from exc
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        why = lines[-1] if lines else f"exit code {done.returncode}"
        raise LaunchConfigError(
            f"python={python} cannot run the ranks: {why}. "
            "Its environment needs torch, psutil, cloudpickle and trainflow itself; "
            "`bash scripts/setup-framework.sh NAME` installs them."
        )
    _interpreters_checked[python] = done.stdout.strip()
    return _interpreters_checked[python]


def launch_env(
    options: LaunchOptions, res: LaunchPlan, sys_path: Sequence[str] | None = None
) -> dict[str, str]:
    """What the agent and its ranks get on top of the caller's environment.

    `sys_path`: the ranks' import path (`rank_sys_path`); None: the caller's, as ranks on
    `options`' interpreter get it.
    """
    python = interpreter(options)
    if sys_path is None:
        sys_path = rank_sys_path(caller_sys_path(), python)
    env = {
        "PYTHONUNBUFFERED": "1",
        "TRAINFLOW_DEVICE": res.device,
        "PYTHONPATH": os.pathsep.join(sys_path),
    }
    if python != sys.executable:
        # What activating that environment would do: a rank that starts `python` or a
        # framework's own command (`accelerate`, `composer`) gets that environment's.
        bin_dir = os.path.dirname(python)
        env["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", os.defpath)])
        env["VIRTUAL_ENV"] = os.path.dirname(bin_dir)
    if res.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # what torchrun does, to avoid oversubscription
    if res.device == "cpu":
        # What accelerate (the Hugging Face Trainer) and DeepSpeed read to run as CPU ranks;
        # without them the Trainer trains alone on each rank.
        env.update(CUDA_VISIBLE_DEVICES="", ACCELERATE_USE_CPU="true", DS_ACCELERATOR="cpu")
    env.update(options.env)
    return env


def start_method(res: LaunchPlan) -> str:
    """fork on CPU: ranks start ~2x sooner, as torch is already imported in the agent.

    spawn on GPUs, the method torch recommends with CUDA, where start-up time is small next
    to training. TRAINFLOW_START_METHOD overrides either.
    """
    method = os.environ.get(START_METHOD_ENV) or ("fork" if res.device == "cpu" else "spawn")
    if method not in ("fork", "spawn", "forkserver"):
        raise LaunchConfigError(f"{START_METHOD_ENV}={method!r}: use fork, spawn or forkserver")
    return method
