"""Patches into torch: its elastic agent (how it stops workers, how its rendezvous names
events), and GPU calls made on CPU ranks (`cpu_fallback`).

Written and tested for torch 2.14 (trainflow's own environment) and the torch of each
framework's environment (2.7 for LLM Foundry, 2.13 for Axolotl): the agent and the ranks run
there too.
"""

import inspect
import itertools
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from trainflow.compat.adaptations import note
from trainflow.compat.patching import declare, relies_on, replace, skip

TORCH = ">=2.7,<2.15"
_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"

STOP_WORKERS = declare(
    "torch: LocalElasticAgent._stop_workers",
    "torch",
    TORCH,
    target=f"{_AGENT}._stop_workers",
    params=("self", "worker_group"),
    why="the agent kills failed attempts' survivors with SIGKILL instead of a SIGTERM that "
    "our ranks only note (a 30 s wait before every restart)",
)
SHUTDOWN = declare(
    "torch: LocalElasticAgent._shutdown",
    "torch",
    TORCH,
    target=f"{_AGENT}._shutdown",
    params=("death_sig",),
    why="called by the `_stop_workers` replacement with death_sig=SIGKILL",
)
GET_METHOD_NAME = declare(
    "torch: dynamic_rendezvous.get_method_name",
    "torch",
    TORCH,
    target="torch.distributed.elastic.rendezvous.dynamic_rendezvous:get_method_name",
    params=("depth",),
    why="torch names each rendezvous event with inspect.stack(), tens of ms a call in an agent "
    "that has imported transformers",
)
INIT_PROCESS_GROUP = declare(
    "torch: distributed_c10d.init_process_group",
    "torch",
    TORCH,
    target="torch.distributed.distributed_c10d:init_process_group",
    params=("backend", "init_method", "timeout", "world_size", "rank", "store", "device_id"),
    why="every rank: a group the user's code opens itself gets the launch's collective_timeout "
    "unless it passes timeout=, and one opened again after a destroy store keys of its own; "
    "CPU ranks: init_process_group('nccl') runs with gloo, device_id dropped",
)
NEW_GROUP = declare(
    "torch: distributed_c10d.new_group",
    "torch",
    TORCH,
    target="torch.distributed.distributed_c10d:new_group",
    params=("backend",),
    why="CPU ranks: new_group(backend='nccl') runs with gloo",
)
SET_DEVICE = declare(
    "torch: cuda.set_device",
    "torch",
    TORCH,
    target="torch.cuda:set_device",
    params=("device",),
    why="CPU ranks: torch.cuda.set_device does nothing",
)
INIT_DEVICE_MESH = declare(
    "torch: device_mesh.init_device_mesh",
    "torch",
    TORCH,
    target="torch.distributed.device_mesh:init_device_mesh",
    params=("device_type",),
    why="CPU ranks: init_device_mesh('cuda') builds a CPU mesh",
)
AUTOCAST = declare(
    "torch: amp.autocast.__init__",
    "torch",
    TORCH,
    target="torch.amp.autocast_mode:autocast.__init__",
    params=("self", "device_type", "dtype"),
    why="CPU ranks: torch.autocast('cuda', dtype=torch.bfloat16) autocasts on the CPU",
)
CUDA_LAZY_INIT = declare(
    "torch: cuda._lazy_init",
    "torch",
    TORCH,
    target="torch.cuda:_lazy_init",
    why="CPU ranks: `.to('cuda:N')` / `.cuda()` fail naming the CPU fallback and what to "
    "change, not with torch's 'Cannot re-initialize CUDA in forked subprocess'",
    public_api="none: torch has no hook on CUDA's lazy initialisation",
)
RENDEZVOUS_STORE = declare(
    "torch: c10d_rendezvous_backend.TCPStore",
    "torch",
    TORCH,
    target="torch.distributed.elastic.rendezvous.c10d_rendezvous_backend:TCPStore",
    why="the agent's c10d rendezvous store listens on one address (loopback for one node), "
    "not on every interface",
    public_api="none: the c10d rendezvous backend builds its TCPStore itself, from a host "
    "that a TCPStore server ignores",
)
SHARED_STORE = declare(
    "torch: DynamicRendezvousHandler._create_tcp_store_server",
    "torch",
    TORCH,
    target="torch.distributed.elastic.rendezvous.dynamic_rendezvous:"
    "DynamicRendezvousHandler._create_tcp_store_server",
    params=("self", "master_addr", "master_port"),
    why="the store the ranks share at MASTER_PORT listens on one address, not on every interface",
    public_api="none: the handler builds the store itself",
)
DDP_INIT = declare(
    "torch: DistributedDataParallel.__init__",
    "torch",
    TORCH,
    target="torch.nn.parallel:DistributedDataParallel.__init__",
    params=("self", "module", "device_ids", "output_device"),
    why="CPU ranks: DistributedDataParallel(device_ids=[i]) of a CPU module drops device_ids",
)


# --- the elastic agent -------------------------------------------------------------------------


def stop_workers_with_sigkill() -> None:
    """Have the agent stop its workers after a failure or before a restart with SIGKILL.

    Torch sends SIGTERM, but our ranks treat SIGTERM as a request to stop at the end of the
    step (`runtime.should_stop`), which ranks waiting on a dead peer never reach: the agent
    would wait its 30 s before it kills them. Ranks used to die on that SIGTERM at once, with
    no cleanup; SIGKILL keeps that. A SIGTERM to the agent itself (a node shutdown, the
    caller's Ctrl-C) still reaches the workers as SIGTERM, with `shutdown_timeout` to stop.
    Without `_shutdown(death_sig=...)` torch's own 30 s wait stays (slower, not wrong).
    """
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    gone = relies_on(SHUTDOWN)
    if gone:
        skip(SHUTDOWN, "; ".join(gone))
        return

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _stop_workers(self: Any, worker_group: Any, *args: Any, **kwargs: Any) -> None:
            self._shutdown(death_sig=signal.SIGKILL)

        return _stop_workers

    replace(STOP_WORKERS, LocalElasticAgent, "_stop_workers", make)


def bind_elastic_stores(server: Callable[..., Any]) -> None:
    """Have the agent's two store servers, the c10d rendezvous store and the store its ranks
    share at `MASTER_PORT`, built by `server(port, **tcpstore_kwargs)`, which listens on one
    address only (`trainflow.launch.listen`): torch's `TCPStore` server listens on every
    interface whatever host it is given. Clients stay torch's own."""
    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, dynamic_rendezvous

    def make_rendezvous(original: Callable[..., Any]) -> Callable[..., Any]:
        def rendezvous_store(host: str, port: int, is_master: bool = False, **kwargs: Any) -> Any:
            if not is_master:
                return original(host, port, is_master=False, **kwargs)
            return server(port, **kwargs)

        return rendezvous_store

    def make_shared(original: Callable[..., Any]) -> Callable[..., Any]:
        def _create_tcp_store_server(self: Any, master_addr: str, master_port: int) -> Any:
            return server(master_port, multi_tenant=True)

        return _create_tcp_store_server

    if c10d_rendezvous_backend.TCPStore is TCPStore:  # not replaced yet
        replace(RENDEZVOUS_STORE, c10d_rendezvous_backend, "TCPStore", make_rendezvous)
    replace(
        SHARED_STORE,
        dynamic_rendezvous.DynamicRendezvousHandler,
        "_create_tcp_store_server",
        make_shared,
    )


def caller_name(depth: int = 2) -> str:
    """The name of the function `depth` frames up (0: this one), from the frame alone, where
    torch's `get_method_name` reads every frame's source with `inspect.stack()`."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:
        return "no_method_name"


def name_rendezvous_events_cheaply() -> None:
    """torch's rendezvous names the method behind each event it records with
    `inspect.stack()`, which reads every frame's source and searches every loaded module for
    it: tens of milliseconds a call in an agent that has imported transformers and TRL (4600
    modules), several calls per rendezvous and per shutdown. The name alone comes from the
    frame (`caller_name`)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_method_name(depth: int = 2) -> str:
            return caller_name(depth + 1)  # one frame more: this one

        return get_method_name

    replace(GET_METHOD_NAME, dynamic_rendezvous, "get_method_name", make)


# --- process groups the user's code opens itself ------------------------------------------------


def own_groups(timeout_s: float) -> None:
    """Process groups the user's code (or a framework) opens with `dist.init_process_group`.

    - Without `timeout=`, each collective is bounded by the launch's `collective_timeout`, as
      in the group the launcher opens, instead of torch's default (30 minutes for gloo, 10 for
      nccl). An explicit `timeout=` stays.
    - A default group opened again after one was destroyed (streaming's `StreamingDataset`
      opens one for its set-up and destroys it; Lightning's Trainer then opens its own) gets
      keys of its own in the agent's store: under torch's own keys each rank read its peers'
      addresses from the first group, long closed, and the second group never connected.
    """
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    opened = itertools.count()

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            bound = _bound(original, args, kwargs)
            given = bound.arguments
            if given.get("timeout") is None:
                given["timeout"] = timedelta(seconds=timeout_s)
            again = next(opened)
            from_env = given.get("store") is None and given.get("init_method") in (None, "env://")
            if again and from_env and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"],
                    int(os.environ["MASTER_PORT"]),
                    is_master=False,
                    timeout=given["timeout"],
                )
                attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                given["store"] = dist.PrefixStore(f"attempt_{attempt}/group_{again}", store)
                given["init_method"] = None
                if given.get("rank", -1) == -1:
                    given["rank"] = int(os.environ["RANK"])
                if given.get("world_size", -1) == -1:
                    given["world_size"] = int(os.environ["WORLD_SIZE"])
            return original(*bound.args, **bound.kwargs)

        return init_process_group

    if replace(INIT_PROCESS_GROUP, c10d, "init_process_group", make):
        dist.init_process_group = c10d.init_process_group


# --- GPU calls on CPU ranks --------------------------------------------------------------------


def _bound(fn: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


def _is_nccl(backend: object) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def _gloo_for_nccl(
    called: str, drop_device_id: bool
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A group constructor with nccl run as gloo (and `device_id` dropped); `called` is how
    the note shows the nccl call."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create(*args: Any, **kwargs: Any) -> Any:
            bound = _bound(original, args, kwargs)
            if _is_nccl(bound.arguments.get("backend")):
                bound.arguments["backend"] = "gloo"
                note(f"{called} runs with gloo")
            if drop_device_id and bound.arguments.get("device_id") is not None:
                bound.arguments["device_id"] = None
                note("init_process_group(device_id=...) is ignored")
            return original(*bound.args, **bound.kwargs)

        return create

    return make


def no_cuda_on_cpu_ranks() -> RuntimeError:
    """The error for code that reaches for CUDA on a CPU rank (`.to("cuda:0")`, `.cuda()`).

    Torch's own is about the start method ("Cannot re-initialize CUDA in forked subprocess"),
    as CPU ranks are forked; but no start method would give a CPU rank a GPU. Torch's stays
    as the cause.
    """
    rank = os.environ.get("RANK", "0")
    why = (
        "this launch is the CPU fallback of GPU code (TRAINFLOW_CPU_FALLBACK=1: the machine "
        "has not the GPUs the decorator asks for)"
        if os.environ.get("TRAINFLOW_CPU_FALLBACK") == "1"
        else "this launch runs CPU ranks (gpu_type='cpu')"
    )
    return RuntimeError(
        f"rank {rank} has no CUDA device: {why}. A tensor or module moved to 'cuda' "
        "(.to('cuda:N'), .cuda(), device='cuda') cannot run here. Move it to the "
        "rank's device instead: trainflow.runtime.get_device(), or "
        "torch.device('cuda' if torch.cuda.is_available() else 'cpu'); the rest of the GPU "
        "code is adapted (init_process_group('nccl') runs with gloo, torch.cuda.set_device "
        "does nothing). Or run it where the GPUs are."
    )


def explain_lazy_init(original: Callable[[], None]) -> Callable[[], None]:
    """`torch.cuda._lazy_init` whose failure on a CPU rank names the fallback
    (`no_cuda_on_cpu_ranks`), keeping torch's exception class: a CPU build raises
    `AssertionError` ("Torch not compiled with CUDA enabled"), a CUDA build without a device
    `RuntimeError`, and code that probes CUDA catches the one it expects (axolotl's peer-access
    check catches `AssertionError`)."""

    def _lazy_init() -> None:
        try:
            original()
        except (RuntimeError, AssertionError) as exc:
            explained = no_cuda_on_cpu_ranks()
            if isinstance(exc, AssertionError):
                raise AssertionError(*explained.args) from exc
            raise explained from exc

    return _lazy_init


def adapt_for_cpu() -> None:
    """GPU calls run on CPU ranks: nccl groups as gloo, CUDA meshes and autocast on the CPU,
    `set_device` and DDP's `device_ids` ignored. Each adaptation made is noted."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import device_mesh
    from torch.nn.parallel import DistributedDataParallel

    make_init = _gloo_for_nccl("init_process_group('nccl')", drop_device_id=True)
    if replace(INIT_PROCESS_GROUP, c10d, "init_process_group", make_init):
        dist.init_process_group = c10d.init_process_group
    make_group = _gloo_for_nccl("new_group(backend='nccl')", drop_device_id=False)
    if replace(NEW_GROUP, c10d, "new_group", make_group):
        dist.new_group = c10d.new_group

    def make_set_device(original: Callable[..., Any]) -> Callable[..., Any]:
        def set_device(device: object) -> None:
            note("torch.cuda.set_device(...) does nothing")

        return set_device

    replace(SET_DEVICE, torch.cuda, "set_device", make_set_device)

    replace(CUDA_LAZY_INIT, torch.cuda, "_lazy_init", explain_lazy_init)

    def make_mesh(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
            if device_type == "cuda":
                device_type = "cpu"
                note("init_device_mesh('cuda', ...) builds a CPU mesh")
            return original(device_type, *args, **kwargs)

        return init_device_mesh

    if replace(INIT_DEVICE_MESH, device_mesh, "init_device_mesh", make_mesh):
        dist.init_device_mesh = device_mesh.init_device_mesh  # type: ignore[attr-defined]

    def make_autocast(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, device_type: str, dtype: Any = None, *args: Any, **kw: Any) -> None:
            if device_type == "cuda" and dtype == torch.bfloat16:
                device_type = "cpu"
                note("torch.autocast('cuda', dtype=torch.bfloat16) autocasts on the CPU")
            original(self, device_type, dtype, *args, **kw)

        return __init__

    replace(AUTOCAST, torch.amp.autocast_mode.autocast, "__init__", make_autocast)

    def make_ddp_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            bound = _bound(original, (self, module, *args), kwargs)
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            if on_cpu and bound.arguments.get("device_ids") is not None:
                bound.arguments["device_ids"] = None
                bound.arguments["output_device"] = None
                note("DistributedDataParallel(device_ids=...) of a CPU module drops device_ids")
            original(*bound.args, **bound.kwargs)

        return __init__

    replace(DDP_INIT, DistributedDataParallel, "__init__", make_ddp_init)
