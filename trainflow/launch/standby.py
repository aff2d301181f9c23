"""Agents started before their launch is asked for: `prewarm` one, a launch `claim`s it.

A pipeline knows how it will train (the ranks' environment, the workload's modules) long before
it launches: it still prepares data and opens its MLflow run. An agent started then imports
torch's elastic agent and the workload's modules meanwhile, and its ranks, forked from it, start
with them loaded (on CPU ranks; spawned GPU ranks import their own).

The caller and a standby agent talk over two pipes, never files: the agent's stdin carries the
calls to run ahead (one JSON line, at once) and later the claim (its launch folder and the
caller's environment, which can hold tokens); a second pipe carries each call's outcome back,
one JSON line each, in order. A launch whose `AgentKey` (environment, interpreter, start method,
working directory) is the one the agent was started with claims it; otherwise it is discarded.
It exits with the process that started it, like any agent.
"""

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from trainflow.launch import temp
from trainflow.launch.processes import kill_process_group
from trainflow.launch.run_dir import RunDir

# A call an agent runs ahead: (`module:function`, a JSON argument).
Call = tuple[str, Any]


@dataclass(frozen=True)
class AgentKey:
    """What a launch's agent must have been started with for that launch to claim it."""

    env: dict[str, str]  # what the launch adds to the caller's environment
    start_method: str
    python: str
    cwd: str = field(default_factory=os.getcwd)


class _StandbyAgent:
    """One agent started ahead, and the caller's ends of its two pipes."""

    def __init__(self, key: AgentKey, preload: Sequence[str], calls: Sequence[Call]):
        self.key = key
        self.calls = list(calls)
        # Its output until a launch claims it (then it goes to that launch's agent log): in
        # the temp folder, as no launch folder exists yet. Those of callers that died with
        # their agents (both SIGKILLed) are cleared first.
        temp.remove_left_by_dead(temp.STANDBY_PREFIX)
        fd, log_path = tempfile.mkstemp(prefix=temp.own_prefix(temp.STANDBY_PREFIX), suffix=".log")
        os.close(fd)
        self.log = Path(log_path)
        read_end, write_end = os.pipe()
        try:
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    [key.python, "-m", "trainflow.launch.agent", "--standby", str(self.log)]
                    + ["--outcomes", str(write_end), *preload],
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    pass_fds=(write_end,),
                    env={**os.environ, **key.env},
                )
        finally:
            os.close(write_end)
        self.outcomes_pipe: IO[bytes] = os.fdopen(read_end, "rb")
        self.outcomes: list[dict[str, Any] | None] = []
        self.reading = threading.Lock()
        assert self.proc.stdin is not None
        calls_line = [{"function": f, "argument": a} for f, a in self.calls]
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(json.dumps(calls_line).encode() + b"\n")
            self.proc.stdin.flush()

    def fits(self, key: AgentKey) -> bool:
        return self.proc.poll() is None and key == self.key

    def claim(self, rd: RunDir) -> subprocess.Popen:
        """Hand the agent its launch folder and the caller's environment as it is now (MLflow
        and Prefect set theirs meanwhile); it runs that launch from here on."""
        assert self.proc.stdin is not None
        message = {"run_dir": str(rd.path), "env": {**os.environ, **self.key.env}}
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.close()
        return self.proc

    def outcome(self, index: int) -> dict[str, Any] | None:
        """The outcome of call `index`, waited for; None if the agent ended before it sent
        one, or skipped it after an earlier call's refusal (the caller then does it itself)."""
        with self.reading:
            while len(self.outcomes) <= index:
                line = self.outcomes_pipe.readline() if not self.outcomes_pipe.closed else b""
                if not line:
                    return None
                outcome = json.loads(line)
                self.outcomes.append(None if "skipped" in outcome else outcome)
            return self.outcomes[index]

    def discard(self, grace_s: float = 3.0) -> None:
        """Stop the agent: SIGTERM, which lets a call it runs ahead clean up (a dataset's
        staging folder), then SIGKILL to what is left of its group after `grace_s`."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace_s)
        kill_process_group(self.proc.pid)
        self.proc.wait()
        with self.reading:
            self.outcomes_pipe.close()
        self.log.unlink(missing_ok=True)


class AgentAhead:
    """What `prewarm` returns: call it to stop the agent if no launch has used it;
    `check_outcome()` waits for the check it was asked to run ahead, `outcome(call)` for any
    of the calls."""

    def __init__(self, agent: _StandbyAgent | None = None, check: Call | None = None) -> None:
        self._agent = agent
        self._check = check

    def __call__(self) -> None:
        agent = self._agent
        if agent is not None and _pool.take(agent):
            agent.discard()

    def check_outcome(self) -> dict[str, Any] | None:
        """The outcome of the check: see `outcome`."""
        return None if self._check is None else self.outcome(self._check)

    def outcome(self, call: Call) -> dict[str, Any] | None:
        """The outcome of `call`, one of those the agent was asked to run ahead
        (`trainflow.launch.agent.run_calls`): `value`, `refused` or `failed`. None when no
        agent ran it (none was started: a remote launch, TRAINFLOW_STANDBY=0; an agent started
        earlier for other calls; an agent that exited first, or skipped it after an earlier
        call's refusal): the caller does it itself."""
        agent = self._agent
        if agent is None or call not in agent.calls:
            return None
        return agent.outcome(agent.calls.index(call))


class _Pool:
    """The agents this process started ahead that no launch has claimed yet."""

    def __init__(self) -> None:
        self.agents: list[_StandbyAgent] = []
        self.lock = threading.Lock()

    def start(self, key: AgentKey, preload: Sequence[str], calls: Sequence[Call]) -> _StandbyAgent:
        with self.lock:
            agent = next((a for a in self.agents if a.fits(key)), None)
            if agent is None:
                agent = _StandbyAgent(key, preload, calls)
                self.agents.append(agent)
            return agent

    def take(self, agent: _StandbyAgent) -> bool:
        """Remove `agent` if it is still unclaimed; whether it was."""
        with self.lock:
            if agent not in self.agents:
                return False
            self.agents.remove(agent)
            return True

    def take_fitting(self, key: AgentKey) -> _StandbyAgent | None:
        with self.lock:
            agent = next((a for a in self.agents if a.fits(key)), None)
            if agent is not None:
                self.agents.remove(agent)
            return agent

    def take_all(self) -> list[_StandbyAgent]:
        with self.lock:
            agents, self.agents = self.agents, []
            return agents


_pool = _Pool()


def prewarm(
    key: AgentKey, preload: Sequence[str] = (), check: Call | None = None, then: Sequence[Call] = ()
) -> AgentAhead:
    """Start the agent of a launch with `key` now, importing `preload` (module names).

    The next launch with the same key in this process claims it (any thread); a launch with
    another key starts its own. An unclaimed agent for the same key already waiting is kept
    instead of starting another. `check` and `then` are calls it runs first, in order, before
    its imports (see `trainflow.launch.agent.run_calls`); after a call that does not return a
    value, the rest are skipped.
    """
    calls = [*([check] if check is not None else []), *then]
    return AgentAhead(_pool.start(key, preload, calls), check)


def claim(key: AgentKey, rd: RunDir) -> subprocess.Popen | None:
    """The process of a standby agent that fits `key`, now running the launch in `rd`; else
    None (the launch starts its own agent)."""
    agent = _pool.take_fitting(key)
    return None if agent is None else agent.claim(rd)


def discard_standbys() -> None:
    """Stop every agent this process started ahead that no launch has used."""
    for agent in _pool.take_all():
        agent.discard()
