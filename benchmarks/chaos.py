"""Many faults, one run, nothing lost.

One pipeline run (`python -m flows.<pipeline>`, its MLflow run and its registered version) is hit
by a seeded schedule of faults at random training steps, one at a time, each once the run has
recovered from the one before:

- `rank_kill`: SIGKILL of one rank (the OOM killer); torch elastic restarts the ranks
  (`--max-restarts`), which continue from the last complete checkpoint.
- `agent_kill`: SIGKILL of the launch's elastic agent; the launch fails, and the pipeline
  relaunches training (`--retries`) or, if the pipeline's process ended, the benchmark
  continues the run with `--resume RUN_ID`.
- `sigterm`: SIGTERM to the pipeline's whole process group (`timeout`, Kubernetes); the ranks
  checkpoint the step reached, the run ends KILLED, and `--resume RUN_ID` continues it.
- `hang`: one rank's main thread stops where it is (it sleeps for an hour); the hang watchdog
  (`--hang-timeout-s`) or the peers' collective timeout ends the launch, and training is
  relaunched from the last checkpoint.
- `torn_checkpoint`: the next checkpoint's files are truncated to half and its writer is
  SIGKILLed before the completion marker: the run continues from the checkpoint before it.
- `disk_full`: the next checkpoint write raises `OSError(ENOSPC)` on one rank.
- `mlflow_down`: the MLflow tracking server is stopped for a while, then started again.
- `prefect_restart`: the Prefect API server is stopped and started again.

The in-rank faults (hang, torn checkpoint, full disk) come from
`benchmarks/chaos_inject/site/sitecustomize.py`, on the run's PYTHONPATH; nothing in the library
knows about them. The servers are real ones on loopback that the benchmark starts
(`benchmarks/chaos_inject/servers.py`).

Then it checks that nothing was lost: the final weights equal, tensor for tensor
(`torch.equal`), those of an uninterrupted run of the same command and seed; the run registered
exactly one model version and its weights equal the uninterrupted run's version; no MLflow run is
left RUNNING; no process is left; no new entry is left in /tmp or /dev/shm. Progress lines go to
stderr; the last line of stdout is one JSON object. Everything (MLflow store, Prefect database,
checkpoints, data) lives in a temporary folder that is deleted at the end.

    python -m benchmarks.chaos --faults 5 --seed 3 --pipeline mlp     # the CI form, ~3 min
    python -m benchmarks.chaos --faults 30 --seed 1 --pipeline mlp
"""

import argparse
import contextlib
import faulthandler
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.chaos_inject.servers import MlflowServer, PrefectServer, Server
from trainflow.launch.run_dir import RunDir

REPO = Path(__file__).resolve().parents[1]
SITE = Path(__file__).resolve().parent / "chaos_inject" / "site"
CONTROL_ENV = "CHAOS_CONTROL"
KINDS = (
    "rank_kill",
    "agent_kill",
    "sigterm",
    "hang",
    "torn_checkpoint",
    "disk_full",
    "mlflow_down",
    "prefect_restart",
)
# The faults the ranks inject themselves, at their next checkpoint (the sitecustomize's names).
ARMED = {"torn_checkpoint": "torn", "disk_full": "enospc"}
OUTAGES = ("mlflow_down", "prefect_restart")
HANG_TIMEOUT_S = 8
MLFLOW_OUTAGE_S = 3.0
# How long one fault may take to be recovered from before it counts as not survived.
RECOVERY_TIMEOUT_S = 300.0
RUN_TIMEOUT_S = 1800.0

# Small runs of each pipeline that checkpoint often; the schedule draws from their steps.
PIPELINES: dict[str, list[str]] = {
    "mlp": [
        *("--num-train-samples", "16384", "--batch-size", "32", "--num-epochs", "2"),
        *("--hidden-size", "256", "--checkpoint-every", "8", "--log-every", "8"),
    ],
    "sft": [
        *("--max-steps", "120", "--checkpoint-every", "10", "--training-logging-steps", "10"),
        *("--evaluation-num-samples", "16", "--evaluation-max-new-tokens", "8"),
    ],
    "two_tower": ["--training-num-epochs", "3", "--checkpoint-every", "10"],
    "detection": ["--checkpoint-every", "5"],
}


def recovery_args(faults: int) -> list[str]:
    """Enough restarts and relaunches for every fault, and a hang watchdog that fires soon."""
    return [
        *("--max-restarts", str(faults + 2), "--retries", str(faults + 2)),
        *("--hang-timeout-s", str(HANG_TIMEOUT_S), "--collective-timeout-s", "60"),
        *("--stop-grace-s", "15", "--keep-checkpoints", "2"),
    ]


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Fault:
    kind: str
    step: int  # the step the schedule drew; it is injected once training reached it
    injected_at: float | None = None
    injected_step: int | None = None
    injected_in: tuple[int, int] = (0, 0)  # (launch, attempt) training was in
    recovered_at: float | None = None
    recovered_step: int | None = None
    resumed: bool = False
    lost_s: float | None = None
    note: str = ""

    @property
    def survived(self) -> bool:
        return self.injected_at is not None and self.recovered_at is not None


def schedule(faults: int, seed: int, steps: int, kinds: list[str]) -> list[Fault]:
    """`faults` faults at distinct random steps, kinds in a seeded order that uses every kind
    before any kind again."""
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < faults:
        order += rng.sample(kinds, len(kinds))
    first, last = max(3, steps // 20), steps - max(3, steps // 20)
    at = sorted(rng.sample(range(first, last), faults))
    return [Fault(kind, step) for kind, step in zip(order, at, strict=False)]


class Run:
    """One pipeline run, through however many processes it takes (`--resume`)."""

    def __init__(self, name: str, pipeline: str, args: list[str], env: dict, root: Path):
        self.name, self.pipeline, self.args, self.root = name, pipeline, args, root
        self.home = root / "home"
        self.env = {**env, "TRAINFLOW_HOME": str(self.home)}
        self.proc: subprocess.Popen | None = None
        self.processes = 0
        self.run_id: str | None = None
        self.seen: dict[int, psutil.Process] = {}
        self.used: set[str] = set()  # /tmp and /dev/shm entries its processes held
        self.looked_at = 0.0

    def start(self, *extra: str) -> None:
        self.processes += 1
        out = self.root / f"{self.name}-{self.processes}.log"
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"flows.{self.pipeline}", *self.args, *extra],
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a terminal's foreground job: its own process group
            )
        self.out = out

    def resume(self) -> None:
        assert self.run_id is not None
        self.start("--resume", self.run_id)

    def exited(self) -> int | None:
        """The exit code of the current process, None while it runs."""
        self.watch_processes()
        return None if self.proc is None else self.proc.poll()

    def watch_processes(self) -> None:
        """Remember every process of the run seen so far (to check that none is left)."""
        if self.proc is None:
            return
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.proc.pid)
            for p in [root, *root.children(recursive=True)]:
                self.seen.setdefault(p.pid, p)
        if time.monotonic() - self.looked_at > 1.0:
            self.looked_at = time.monotonic()
            for p in list(self.seen.values()):
                self.used |= shared_entries(p)

    def made(self, entry: str) -> bool:
        """Whether a /tmp or /dev/shm entry is this run's: one of its processes held it open
        or mapped it, or it is named after one of them."""
        name = entry.rsplit("/", 1)[-1]
        return entry in self.used or any(re.search(rf"\b{pid}\b", name) for pid in self.seen)

    def output_tail(self) -> str:
        return self.out.read_text(errors="replace")[-4000:]

    def find_run_id(self) -> str | None:
        if self.run_id is None:
            found = list((self.home / "outputs" / self.pipeline).glob("*/config.json"))
            if found:
                self.run_id = found[0].parent.name
        return self.run_id

    @property
    def run_dir(self) -> Path:
        assert self.run_id is not None
        return self.home / "outputs" / self.pipeline / self.run_id

    def launches(self) -> list[RunDir]:
        """The launch folders of this run, oldest first."""
        dirs = [p for p in (self.home / "runs").glob("*") if (p / "spec.json").is_file()]
        return [RunDir(p) for p in sorted(dirs, key=lambda p: (p / "spec.json").stat().st_mtime)]

    def beats(self) -> list[dict]:
        """Every rank's last heartbeat in every launch: step, wall time, attempt, and the
        launch's place in `launches()`."""
        return [
            {**b, "launch": i}
            for i, rd in enumerate(self.launches())
            for b in rd.heartbeats().values()
        ]

    def position(self) -> tuple[int, int]:
        """(launch, attempt) of the newest heartbeat: where training stands now."""
        return max(((b["launch"], b["attempt"]) for b in self.beats()), default=(0, 0))

    def step(self) -> int:
        return max((b["step"] for b in self.beats()), default=0)

    def ranks(self) -> dict[int, int]:
        """Pids of the ranks of the newest launch's latest attempt that are alive."""
        launches = self.launches()
        if not launches:
            return {}
        procs = launches[-1].rank_processes()
        attempt = max((p["attempt"] for p in procs.values()), default=0)
        return {
            r: p["pid"]
            for r, p in procs.items()
            if p["attempt"] == attempt and psutil.pid_exists(p["pid"])
        }

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def left(self) -> list[str]:
        """Processes of this run still alive (after it ended)."""
        alive = []
        for p in self.seen.values():
            with contextlib.suppress(psutil.Error):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        return alive


def wait_for(what: str, test, timeout_s: float, run: Run | None = None, poll_s: float = 0.05):
    """Poll `test()` until it returns something true; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not (value := test()):
        if time.monotonic() > deadline:
            tail = f"\n{run.output_tail()}" if run is not None else ""
            raise TimeoutError(f"{what}: not within {timeout_s:g}s{tail}")
        time.sleep(poll_s)
    return value


class Outage(threading.Thread):
    """A server stopped for `down_s`, then started again, while the run goes on (and the next
    faults land): training does not wait for either server, so an outage is survived when the
    server came back and the run still ended well. Its time lost is the longest stretch in
    which training made no step while the server was down or starting, less one step's time,
    leaving out the time another fault was being recovered from."""

    def __init__(
        self, fault: Fault, server: Server, down_s: float, chaos: "Chaos", keeper: Executor
    ):
        super().__init__(daemon=True)
        self.fault, self.server, self.down_s, self.keeper = fault, server, down_s, keeper
        self.run_, self.step_s, self.busy = chaos.run, chaos.step_s, chaos.busy
        self.back_at: float | None = None
        self.stall = 0.0
        self.error: Exception | None = None

    def run(self) -> None:  # type: ignore[override]
        fault = self.fault
        self.server.stop()
        restart = threading.Thread(target=self._restart, daemon=True)
        restart.start()
        step, since = self.run_.step(), time.time()
        while restart.is_alive():
            now, current = time.time(), self.run_.step()
            if current != step or self.busy.is_set():
                step, since = current, now
            self.stall = max(self.stall, now - since)
            time.sleep(0.05)
        if self.back_at is not None:
            assert fault.injected_at is not None
            log(
                f"{self.server.name} server back {self.back_at - fault.injected_at:.1f}s after "
                f"it was stopped (training stalled {self.stall:.1f}s at most meanwhile)"
            )

    def _restart(self) -> None:
        time.sleep(self.down_s)
        try:
            # Started from the chaos run's long-lived server thread: the guard's parent-death
            # signal follows the thread that started it, and this one ends now.
            self.keeper.submit(self.server.spawn).result()
            self.server.wait(time.monotonic() + 300)
            self.back_at = time.time()
        except Exception as exc:  # reported as the fault not survived
            self.error = exc
            log(f"the {self.server.name} server did not come back: {exc}")

    def settle(self, finished: bool) -> None:
        """Record the outcome once the run ended."""
        fault = self.fault
        assert fault.injected_at is not None
        if self.back_at is not None:
            fault.note += f", back after {self.back_at - fault.injected_at:.1f}s"
        if finished and self.back_at is not None:
            fault.recovered_at, fault.recovered_step = self.back_at, fault.injected_step
            fault.lost_s = round(max(0.0, self.stall - self.step_s), 2)


class Chaos:
    """Injects the faults into one run and follows it to its end."""

    def __init__(
        self,
        run: Run,
        control: Path,
        servers: tuple[MlflowServer, PrefectServer],
        keeper: Executor,
        step_s: float,
    ):
        """`keeper` starts the servers again: a thread that lives as long as they must."""
        self.run, self.control, self.step_s = run, control, step_s
        self.mlflow, self.prefect = servers
        self.keeper = keeper
        # Set while a fault that stops training is recovered from: an outage's stall
        # measure leaves that time out.
        self.busy = threading.Event()
        self.outages: list[Outage] = []
        (control / "armed").mkdir(parents=True)
        (control / "fired").mkdir()

    def follow(self, faults: list[Fault]) -> bool:
        """Start the run, inject `faults`, see it to its end; whether it finished."""
        run = self.run
        run.start()
        wait_for(
            "the run's MLflow run id",
            lambda: run.find_run_id() or run.exited() is not None,
            600,
            run,
        )
        if run.run_id is None:
            raise RuntimeError(f"the run ended before it started:\n{run.output_tail()}")
        for fault in faults:
            if not self.reach(fault.step):
                log(f"the run ended before step {fault.step}: {fault.kind} not injected")
                break
            if fault.kind not in OUTAGES:
                self.busy.set()
            self.inject(fault)
            self.recover(fault)
            self.busy.clear()
            if not fault.survived and fault.kind not in OUTAGES:
                return False
        finished = self.finish()
        for outage in self.outages:
            outage.settle(finished)
        return finished

    def reach(self, step: int) -> bool:
        """Wait until training reached `step`, continuing the run if its process ended."""
        run = self.run
        while run.step() < step:
            code = run.exited()
            if code == 0:
                return False
            if code is not None:
                log(f"the run's process exited {code} between faults; resuming it")
                run.resume()
            time.sleep(0.02)
        return True

    def inject(self, fault: Fault) -> None:
        run = self.run
        fault.injected_step = run.step()
        fault.injected_in = run.position()
        fault.injected_at = time.time()
        kind = fault.kind
        if kind in ("rank_kill", "hang"):
            ranks = wait_for("a live rank", run.ranks, 60, run)
            rank = random.Random(fault.step).choice(sorted(ranks))
            os.kill(ranks[rank], signal.SIGKILL if kind == "rank_kill" else signal.SIGUSR2)
            fault.note = f"rank {rank}"
        elif kind == "agent_kill":
            ranks = wait_for("a live rank", run.ranks, 60, run)
            agent = os.getpgid(next(iter(ranks.values())))  # the agent leads the ranks' group
            os.kill(agent, signal.SIGKILL)
            fault.note = f"agent pid {agent}"
        elif kind == "sigterm":
            assert run.proc is not None
            os.killpg(run.proc.pid, signal.SIGTERM)
        elif kind in ARMED:
            name = ARMED[kind]
            (self.control / "armed" / name).touch()
            fired = self.control / "fired" / f"{name}.json"
            record = wait_for(f"{kind} to fire", lambda: self.fired(fired), 120, run)
            fault.injected_at, fault.injected_step = record["time"], record["step"]
            fault.note = f"rank {record['rank']}, checkpoint of step {record['step']}"
        elif kind in OUTAGES:
            server = self.mlflow if kind == "mlflow_down" else self.prefect
            for other in self.outages:
                if other.server is server:
                    other.join()  # one outage of a server at a time
            down_s = MLFLOW_OUTAGE_S if kind == "mlflow_down" else 0.0
            outage = Outage(fault, server, down_s, self, self.keeper)
            self.outages.append(outage)
            outage.start()
            fault.note = f"{server.name} server stopped"
        log(f"injected {kind} at step {fault.injected_step} {fault.note}".rstrip())

    def fired(self, path: Path) -> dict | None:
        self.run.exited()
        if not path.is_file():
            return None
        record = json.loads(path.read_text())
        path.unlink()
        return record

    def recover(self, fault: Fault) -> None:
        if fault.kind in OUTAGES:
            return  # the outage runs on beside the next faults; `Outage` follows it
        self.recover_training(fault)

    def recover_training(self, fault: Fault) -> None:
        """Wait until training passes the step reached at the fault (resuming if needed).

        That must be ranks started after it (a later attempt or launch), not a survivor
        finishing its step.
        """
        run = self.run
        assert fault.injected_at is not None and fault.injected_step is not None
        after, beyond, since = fault.injected_at, fault.injected_step, fault.injected_in
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while time.monotonic() < deadline:
            done = [
                b
                for b in run.beats()
                if b["time"] > after and b["step"] > beyond and (b["launch"], b["attempt"]) > since
            ]
            if done:
                first = min(done, key=lambda b: b["time"])
                fault.recovered_at, fault.recovered_step = first["time"], first["step"]
                log(
                    f"recovered from {fault.kind}: step {first['step']} "
                    f"{first['time'] - fault.injected_at:.1f}s after it"
                    + (" (resumed)" if fault.resumed else "")
                )
                return
            code = run.exited()
            if code is not None:
                if code == 0:  # it ended well: the fault was survived
                    fault.recovered_at, fault.recovered_step = time.time(), run.step()
                    log(f"recovered from {fault.kind}: the run finished")
                    return
                log(f"{fault.kind}: the run's process exited {code}; resuming it")
                fault.resumed = True
                run.resume()
            time.sleep(0.05)
        log(f"no recovery from {fault.kind} within {RECOVERY_TIMEOUT_S:g}s")

    def finish(self) -> bool:
        """Wait for the run to end, resuming it if it stops; whether it finished."""
        run = self.run
        for outage in self.outages:
            outage.join()
        for _ in range(3):
            wait_for("the run to end", lambda: run.exited() is not None, RUN_TIMEOUT_S, run, 0.2)
            code = run.exited()
            if code == 0:
                return True
            log(f"the run's process exited {code} after the last fault; resuming it")
            run.resume()
        return False


def reference_run(run: Run) -> float:
    """Run it through without faults; return its seconds per training step."""
    run.start()
    first: float | None = None
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while (code := run.exited()) is None and time.monotonic() < deadline:
        if first is None and run.step() >= 1:
            first = time.time()
        time.sleep(0.05)
    if code != 0:
        raise RuntimeError(f"the uninterrupted run failed ({code}):\n{run.output_tail()}")
    run.find_run_id()
    steps, last = run.step(), max(b["time"] for b in run.beats())
    return (last - (first or last)) / max(steps - 1, 1)


def trained_weights(run_dir: Path) -> dict:
    """The run's final weights as exported for evaluation: `model.pt` (our loop, Lightning),
    or the Trainer's saved model (`*.safetensors`)."""
    import torch
    from safetensors.torch import load_file

    if (run_dir / "model.pt").is_file():
        return torch.load(run_dir / "model.pt", map_location="cpu", weights_only=True)
    files = sorted(
        p
        for p in run_dir.rglob("*.safetensors")
        if not {"checkpoints", "initial"} & set(p.relative_to(run_dir).parts)
    )
    state: dict = {}
    for path in files:
        state |= {f"{path.parent.name}/{k}": v for k, v in load_file(path).items()}
    return state


def version_weights(name: str, version: str, into: Path) -> dict:
    """Every tensor in a registered model version's files."""
    import mlflow
    import torch
    from safetensors.torch import load_file

    folder = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=into))
    state: dict = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.suffix == ".safetensors":
            state |= {f"{rel}/{k}": v for k, v in load_file(path).items()}
        elif path.suffix in (".pt", ".pth"):
            loaded = torch.load(path, map_location="cpu", weights_only=False)
            if isinstance(loaded, torch.nn.Module):
                loaded = loaded.state_dict()
            if isinstance(loaded, dict):
                state |= {f"{rel}/{k}": v for k, v in loaded.items() if torch.is_tensor(v)}
    return state


def differing(want: dict, got: dict) -> list[str]:
    """Names of tensors missing, extra or not bit-identical (`torch.equal`)."""
    import torch

    names = sorted(set(want) | set(got))
    return [n for n in names if n not in want or n not in got or not torch.equal(want[n], got[n])]


def registered_versions(client, name: str) -> list:
    return sorted(client.search_model_versions(f"name='{name}'"), key=lambda v: int(v.version))


def runs_left_running(client) -> list[str]:
    experiments = [e.experiment_id for e in client.search_experiments()]
    return [
        r.info.run_id
        for r in client.search_runs(experiments, filter_string="attributes.status = 'RUNNING'")
    ]


def shared_entries(proc: psutil.Process) -> set[str]:
    """The /tmp and /dev/shm entries (first level) a process holds open or has mapped."""
    found = set()
    with contextlib.suppress(psutil.Error):
        paths = [f.path for f in proc.open_files()] + [m.path for m in proc.memory_maps()]
        for path in paths:
            for folder in ("/tmp/", "/dev/shm/"):
                if path.startswith(folder):
                    found.add(folder + path[len(folder) :].split("/", 1)[0])
    return found


def temp_entries() -> set[str]:
    found = set()
    for folder in ("/tmp", "/dev/shm"):
        with contextlib.suppress(OSError):
            found |= {f"{folder}/{name}" for name in os.listdir(folder)}
    return found


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--faults", type=int, default=8, help="Faults to inject.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the fault schedule.")
    parser.add_argument("--pipeline", choices=sorted(PIPELINES), default="sft")
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help="Comma-separated fault kinds to draw from."
    )
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"--kinds: unknown {', '.join(unknown)} (known: {', '.join(KINDS)})")
    # `timeout` and schedulers send SIGTERM: clean up (servers, runs, the folder) as on Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    faulthandler.register(signal.SIGUSR1)
    before = temp_entries()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="trainflow-chaos-") as tmp:
        row = chaos(args.pipeline, args.faults, args.seed, kinds, Path(tmp))
    # What other processes on the machine made meanwhile is not counted (but reported).
    new, made = temp_entries() - before, row.pop("made")
    mine = {e for e in new if made(e)}
    row["files_left"] = sorted(mine) + row["files_left"]
    row["files_new_by_others"] = len(new - mine)
    row["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(row))
    return row


def chaos(pipeline: str, num_faults: int, seed: int, kinds: list[str], tmp: Path) -> dict:
    # The run's temporary files go to a folder of its own, where all that is left is its own.
    private_tmp, server_tmp = tmp / "tmp", tmp / "server-tmp"
    private_tmp.mkdir()
    server_tmp.mkdir()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    base_env["TMPDIR"] = str(server_tmp)
    mlflow_server = MlflowServer(tmp / "mlflow", base_env)
    prefect_server = PrefectServer(tmp / "prefect-server", base_env)
    control = tmp / "control"
    env = {
        **base_env,
        "TMPDIR": str(private_tmp),
        "MLFLOW_TRACKING_URI": mlflow_server.url,
        "PREFECT_API_URL": prefect_server.url,
        "PREFECT_HOME": str(tmp / "prefect-client"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PYTHONPATH": os.pathsep.join([str(SITE), str(REPO), base_env.get("PYTHONPATH", "")]),
        CONTROL_ENV: str(control),
    }
    os.environ["MLFLOW_TRACKING_URI"] = mlflow_server.url
    args = [*PIPELINES[pipeline], *recovery_args(num_faults)]
    runs: list[Run] = []
    servers = (mlflow_server, prefect_server)
    # Restarts happen on this thread: a server's guard dies with the thread that started it.
    keeper = ThreadPoolExecutor(max_workers=1, thread_name_prefix="servers")
    try:
        log("starting MLflow and Prefect servers")
        for server in (mlflow_server, prefect_server):
            server.spawn()
        for server in (mlflow_server, prefect_server):
            server.wait(time.monotonic() + 300)
        reference = Run(
            "reference",
            pipeline,
            [*args, "--registered-model-name", f"{pipeline}-reference"],
            env,
            tmp / "reference",
        )
        runs.append(reference)
        reference.root.mkdir()
        log(f"uninterrupted run: python -m flows.{pipeline} {' '.join(reference.args)}")
        t0 = time.monotonic()
        step_s = reference_run(reference)
        reference_s = time.monotonic() - t0
        total_steps = reference.step()
        log(f"uninterrupted: {total_steps} steps in {reference_s:.1f}s ({step_s:.3f}s a step)")
        drawn = schedule(num_faults, seed, total_steps, kinds)
        run = Run(
            "chaos",
            pipeline,
            [*args, "--registered-model-name", f"{pipeline}-chaos"],
            env,
            tmp / "chaos",
        )
        runs.append(run)
        run.root.mkdir()
        plan = ", ".join(f"{f.kind}@{f.step}" for f in drawn)
        log(f"faults (seed {seed}): {plan}")
        t0 = time.monotonic()
        finished = Chaos(run, control, servers, keeper, step_s).follow(drawn)
        chaos_s = time.monotonic() - t0
        for fault in drawn:
            if fault.survived and fault.lost_s is None:
                assert fault.recovered_at and fault.injected_at
                redo = (fault.recovered_step or 0) - (fault.injected_step or 0)
                fault.lost_s = round(
                    max(0.0, fault.recovered_at - fault.injected_at - redo * step_s), 2
                )
        row = check(pipeline, reference, run, finished, tmp)
    finally:
        for r in runs:
            r.kill()
        mlflow_server.stop()
        prefect_server.stop()
        keeper.shutdown()
    row["processes_left"] = [p for r in runs for p in r.left()]
    row["made"] = lambda entry: any(r.made(entry) for r in runs)
    # torch's compile cache (`torchinductor_<user>`) is meant to outlive a run.
    row["files_left"] = sorted(
        f"$TMPDIR/{p.name}"
        for p in private_tmp.iterdir()
        if not p.name.startswith("torchinductor_")
    )
    return summarize(row, pipeline, seed, drawn, reference_s, chaos_s, run)


def check(pipeline: str, reference: Run, run: Run, finished: bool, tmp: Path) -> dict:
    """Compare the chaos run with the uninterrupted one: weights, registry, MLflow runs."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    row: dict = {"run_finished": finished}
    if not finished or run.run_id is None:
        row["weights_identical"] = False
        row["runs_left_running"] = len(runs_left_running(client))
        return row
    want, got = trained_weights(reference.run_dir), trained_weights(run.run_dir)
    bad = differing(want, got)
    row["tensors_compared"] = len(want)
    row["weights_identical"] = bool(want) and not bad
    if bad:
        row["tensors_differing"] = bad[:10]
    ref_versions = registered_versions(client, f"{pipeline}-reference")
    versions = registered_versions(client, f"{pipeline}-chaos")
    row["versions_registered"] = len(versions)
    same = False
    if len(versions) == 1 and versions[0].run_id == run.run_id and ref_versions:
        want_v = version_weights(f"{pipeline}-reference", ref_versions[-1].version, tmp / "ref-v")
        got_v = version_weights(f"{pipeline}-chaos", versions[0].version, tmp / "chaos-v")
        same = bool(want_v) and not differing(want_v, got_v)
    row["registered_version_identical"] = same
    row["mlflow_run_status"] = client.get_run(run.run_id).info.status
    row["runs_left_running"] = len(runs_left_running(client))
    return row


def summarize(
    row: dict, pipeline: str, seed: int, faults: list[Fault], ref_s: float, chaos_s: float, run
) -> dict:
    injected = [f for f in faults if f.injected_at is not None]
    by_kind: dict[str, dict] = {}
    for f in injected:
        k = by_kind.setdefault(f.kind, {"injected": 0, "survived": 0, "seconds_lost": 0.0})
        k["injected"] += 1
        k["survived"] += f.survived
        k["seconds_lost"] = round(k["seconds_lost"] + (f.lost_s or 0.0), 2)
    return {
        "benchmark": "chaos",
        "pipeline": pipeline,
        "seed": seed,
        "faults_planned": len(faults),
        "faults_injected": len(injected),
        "faults_survived": sum(f.survived for f in injected),
        **row,
        "resumes": run.processes - 1,
        "by_kind": by_kind,
        "seconds_lost": round(sum(f.lost_s or 0.0 for f in injected), 1),
        "uninterrupted_s": round(ref_s, 1),
        "chaos_s": round(chaos_s, 1),
        "faults": [
            {
                "kind": f.kind,
                "step": f.injected_step,
                "lost_s": f.lost_s,
                "resumed": f.resumed,
                **({"note": f.note} if f.note else {}),
            }
            for f in injected
        ],
    }


if __name__ == "__main__":
    row = main()
    ok = row["faults_survived"] == row["faults_injected"] and row["weights_identical"]
    sys.exit(0 if ok else 1)
