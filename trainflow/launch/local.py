"""The local backend: torch's elastic agent on this machine, running one node's ranks.

Every other backend ends here on each node it places: Ray runs a `LocalLaunch` on every node,
a launch board's followers run one each. A launch writes its spec, payload and sources into a
fresh run folder, claims the agent started ahead for it (`standby`) or starts one
(`python -m trainflow.launch.agent RUN_DIR`), supervises it (`Supervisor`) and explains how it
ended (`failures`).
"""

import logging
import os
import subprocess
import uuid
from datetime import datetime

from trainflow.compat.adaptations import read_adaptations
from trainflow.data.shm import release_streaming_state_since, streaming_prefixes
from trainflow.errors import LaunchConfigError
from trainflow.launch import standby, temp
from trainflow.launch.environment import (
    check_interpreter,
    interpreter,
    launch_env,
    rank_sys_path,
    start_method,
)
from trainflow.launch.failures import LaunchCase, collect
from trainflow.launch.logs import LogTail, print_line
from trainflow.launch.plan import (
    LaunchPlan,
    check_cpu_oversubscription,
    node_range,
    resolve_resources,
)
from trainflow.launch.run_dir import RunDir, keep_run_dirs, prune_run_dirs
from trainflow.launch.ship import Shipment
from trainflow.launch.spec import (
    RDZV_ENDPOINT_ENV,
    RUN_ID_ENV,
    LaunchOptions,
    LaunchResult,
    LaunchSpec,
    LineSink,
)
from trainflow.launch.supervisor import Supervisor
from trainflow.paths import trainflow_home

logger = logging.getLogger("trainflow.launch")

# How long the rendezvous waits for every node, when the call sets no timeout.
DEFAULT_RDZV_TIMEOUT_S = 900


class LocalLaunch:
    """One node's launch: plan, start, watch, stop, collect."""

    def __init__(
        self,
        options: LaunchOptions,
        sink: LineSink = print_line,
        rendezvous: tuple[str, str, bool] | None = None,
    ):
        """`rendezvous`: (endpoint, run id, whether this node hosts the store), given by a
        backend that places the nodes itself (Ray, a launch board)."""
        self.options = options
        self.sink = sink
        self.given_rendezvous = rendezvous

    def rendezvous(self) -> tuple[str, str]:
        """The endpoint and run id every node of this launch meets at."""
        if self.given_rendezvous is not None:
            return self.given_rendezvous[0], self.given_rendezvous[1]
        if node_range(self.options.nnodes) == (1, 1):
            return "127.0.0.1:0", uuid.uuid4().hex
        endpoint, run_id = os.environ.get(RDZV_ENDPOINT_ENV), os.environ.get(RUN_ID_ENV)
        if not endpoint or not run_id:
            raise LaunchConfigError(
                f"nnodes={self.options.nnodes} needs a rendezvous shared by all nodes: set "
                f"{RDZV_ENDPOINT_ENV}=host:port (reachable from every node) and {RUN_ID_ENV} "
                "to the same value on each node, then call .distributed() on every node"
            )
        return endpoint, run_id

    def run(self, shipment: Shipment) -> LaunchResult:
        """Run `shipment` on this node's ranks; its result, or the error that explains why
        not. Interrupted, it stops the ranks gracefully and re-raises."""
        opts = self.options
        res = resolve_resources(opts.gpus, opts.gpu_type, opts.nnodes)
        check_cpu_oversubscription(res)  # 1000 CPU ranks on 2 cores: refused, nothing started
        prune_run_dirs(trainflow_home() / "runs", keep_run_dirs())
        rendezvous = self.rendezvous()
        python = interpreter(opts)
        if opts.python is not None:
            check_interpreter(python)  # a missing or broken environment fails before any rank
        sys_path = rank_sys_path(shipment.sys_path, python)
        env = launch_env(opts, res, sys_path)
        spec = self._spec(shipment, res, rendezvous, python, sys_path, env)
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        rd = RunDir(trainflow_home() / "runs" / f"{stamp}-{shipment.name}-{uuid.uuid4().hex[:8]}")
        rd.create(spec, shipment.payload, shipment.sources)
        self._announce(shipment.name, rd, res)
        case = LaunchCase(shipment.name, opts, rd, res, shipment.shipped)
        streams_before = streaming_prefixes()
        proc = None
        try:
            key = standby.AgentKey(env, spec.start_method, python)
            proc = standby.claim(key, rd) or self._start_agent(rd, python, env)
            supervisor = Supervisor(case, proc, LogTail(rd, self.sink))
            verdict = supervisor.run()
            if verdict is not None:
                raise verdict
            return collect(case, proc.returncode)
        finally:
            adapted = read_adaptations(rd.path)
            if adapted:
                logger.warning(
                    "%s.distributed() ran on CPU ranks with these adaptations: %s",
                    shipment.name,
                    "; ".join(adapted),
                )
            rd.discard_payloads()  # on every path, Ctrl-C included
            if proc is None or proc.poll() is not None:  # the agent was killed: its share
                temp.remove_recorded_ranks_temp(rd.ranks_temp)
            # Every process of the launch has ended: the data streams' shared memory its
            # ranks left (stopped mid-epoch by a hang, a failure, Ctrl-C) goes too.
            release_streaming_state_since(streams_before)

    def _spec(
        self,
        shipment: Shipment,
        res: LaunchPlan,
        rendezvous: tuple[str, str],
        python: str,
        sys_path: list[str],
        env: dict[str, str],
    ) -> LaunchSpec:
        opts = self.options
        endpoint, run_id = rendezvous
        return LaunchSpec(
            function=shipment.qualname,
            run_id=run_id,
            rdzv_endpoint=endpoint,
            rdzv_timeout_s=int(opts.timeout) if opts.timeout else DEFAULT_RDZV_TIMEOUT_S,
            rdzv_is_host=self.given_rendezvous[2] if self.given_rendezvous else None,
            nnodes=res.nnodes,
            min_nodes=res.min_nodes or res.nnodes,
            nproc_per_node=res.nproc_per_node,
            device=res.device,
            max_restarts=opts.max_restarts,
            shutdown_timeout_s=opts.stop_grace,
            collective_timeout_s=opts.collective_timeout,
            hang_timeout_s=opts.hang_timeout,
            init_process_group=opts.init_process_group,
            start_method=start_method(res),
            sys_path=sys_path,
            python=python,
            code_files=shipment.code_files,
            # Names only: values (tokens, keys) travel in the agent's environment and are
            # never written to disk.
            env_names=sorted(env),
            caller_pid=os.getpid(),
        )

    @staticmethod
    def _start_agent(rd: RunDir, python: str, env: dict[str, str]) -> subprocess.Popen:
        with open(rd.agent_log, "wb") as agent_log:
            return subprocess.Popen(
                [python, "-m", "trainflow.launch.agent", str(rd.path)],
                stdin=subprocess.DEVNULL,
                stdout=agent_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**os.environ, **env},
            )

    def _announce(self, name: str, rd: RunDir, res: LaunchPlan) -> None:
        text = (
            f"{name}.distributed(): {res.world_size} {res.device} rank(s) on "
            f"{res.nnodes} node(s); rank logs in {rd.logs}"
        )
        logger.info(text)
        if self.sink is print_line:  # a terminal or notebook: say where the logs are
            print(f"[trainflow] {text}", flush=True)
