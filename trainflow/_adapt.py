"""What a rank adjusts so that framework code and code written for GPUs runs on the launched ranks.

The worker calls `install` on every rank before it loads the user's function. Code written for a
managed notebook (`init_process_group("nccl")`, a Hugging Face `Trainer`, a Lightning
`Trainer(devices="auto")`, a DeepSpeed engine) then runs distributed over exactly the ranks the
launcher started, with no change.

Every launch (the environment contract):

- Lightning: `devices="auto"` is the ranks launched on this node and `num_nodes` the launched
  nodes, so Lightning joins the launch instead of counting the node's GPUs.
- Hugging Face accelerate (the `Trainer`, TRL), Lightning and DeepSpeed each check, once they
  have set up, that they see the launched world. One that ended single-process inside a
  multi-rank launch raises `SingleProcessFrameworkError` naming it, rather than training one
  independent copy per rank.

CPU ranks (`gpu_type="cpu"`, or the CPU fallback of GPU code; never on GPU ranks):

- the `Trainer` runs as CPU (`use_cpu`), which also lets `bf16=True` run on CPU;
- `init_process_group("nccl")` / `new_group` / `init_device_mesh("cuda")` use gloo and the CPU,
  `device_id` is dropped and `torch.cuda.set_device` does nothing;
- `torch.autocast("cuda", dtype=torch.bfloat16)` autocasts on the CPU;
- `DistributedDataParallel(device_ids=[i])` of a CPU module drops `device_ids`;
- Lightning's `accelerator="gpu"` becomes the CPU and `devices=N` the launched ranks;
- DeepSpeed uses none of its compiled ops and torch's Adam, rather than compiling C++ on every
  rank for minutes.

Each adaptation actually made is noted in the run directory (`adaptations/rank_N.json`); the
caller reports them in one warning when the launch ends, and rank 0 prints each one once.

`sys.meta_path` gets a finder that runs a hook right after a watched module is first imported,
so nothing is imported that the function does not import itself.
"""

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainflow.errors import SingleProcessFrameworkError

ADAPTATIONS_DIR = "adaptations"

_state: dict[str, Any] = {"folder": None, "rank": 0, "made": []}


def _note(what: str) -> None:
    """Record one adaptation (once per rank) in the run directory; rank 0 also prints it."""
    made: list[str] = _state["made"]
    if what in made:
        return
    made.append(what)
    folder: Path | None = _state["folder"]
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"rank_{_state['rank']}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(made))
        os.replace(tmp, path)
    if _state["rank"] == 0:
        print(f"[trainflow] CPU ranks: {what}", flush=True)


def read_adaptations(run_dir: Path) -> list[str]:
    """Every adaptation any rank of the launch in `run_dir` made, in first-seen order."""
    seen: list[str] = []
    folder = run_dir / ADAPTATIONS_DIR
    for path in sorted(folder.glob("rank_*.json")) if folder.is_dir() else []:
        with contextlib.suppress(OSError, ValueError):
            for what in json.loads(path.read_text()):
                if what not in seen:
                    seen.append(what)
    return seen


def _world() -> tuple[int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return world, local


def _single_process(framework: str, seen: int, detail: str = "") -> SingleProcessFrameworkError:
    world, _ = _world()
    rank = os.environ.get("RANK", "0")
    return SingleProcessFrameworkError(
        f"rank {rank}: {framework} set itself up for {seen} process(es){detail}, but this launch "
        f"has {world} ranks: each rank would train its own copy of the model on all the data. "
        f"Let {framework} take the launched world (do not pin it to one device or process)."
    )


# --- running a hook right after a module is imported ---------------------------------------


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, hook: Callable[[types.ModuleType], None]):
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook(module)

    def __getattr__(self, name: str) -> Any:  # resource readers, get_data, ...
        return getattr(self._loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `hooks[name](module)` once, right after module `name` is first imported."""

    def __init__(self) -> None:
        self.hooks: dict[str, Callable[[types.ModuleType], None]] = {}
        self._finding: set[str] = set()

    def watch(self, name: str, hook: Callable[[types.ModuleType], None]) -> None:
        module = sys.modules.get(name)
        if module is not None:
            hook(module)
        else:
            self.hooks[name] = hook

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.hooks or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding.discard(fullname)
        if spec is None or spec.loader is None:
            return spec
        # A spec may be asked for without an import following (`importlib.util.find_spec` to
        # see whether a package is installed): the hook is dropped only once it has run.
        spec.loader = _HookedLoader(spec.loader, functools.partial(self._run, fullname))
        return spec

    def _run(self, name: str, module: types.ModuleType) -> None:
        hook = self.hooks.pop(name, None)
        if hook is not None:
            hook(module)


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace `owner.name` with `make(original)`, keeping the original's name and docs."""
    original = getattr(owner, name)
    setattr(owner, name, functools.wraps(original)(make(original)))


def _bound(fn: Callable[..., Any], args: tuple, kwargs: dict) -> inspect.BoundArguments:
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound


# --- torch: GPU calls on CPU ranks ------------------------------------------------------------


def _is_nccl(backend: object) -> bool:
    return backend is not None and "nccl" in str(backend).lower()


def _adapt_torch_for_cpu() -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def gloo_for_nccl(
        called: str, drop_device_id: bool
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A group constructor with nccl run as gloo (and `device_id` dropped); `called` is
        how the note shows the nccl call."""

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def create(*args: Any, **kwargs: Any) -> Any:
                bound = _bound(original, args, kwargs)
                if _is_nccl(bound.arguments.get("backend")):
                    bound.arguments["backend"] = "gloo"
                    _note(f"{called} runs with gloo")
                if drop_device_id and bound.arguments.get("device_id") is not None:
                    bound.arguments["device_id"] = None
                    _note("init_process_group(device_id=...) is ignored")
                return original(*bound.args, **bound.kwargs)

            return create

        return make

    make_init = gloo_for_nccl("init_process_group('nccl')", drop_device_id=True)
    make_new_group = gloo_for_nccl("new_group(backend='nccl')", drop_device_id=False)

    _wrap(c10d, "init_process_group", make_init)
    dist.init_process_group = c10d.init_process_group
    _wrap(c10d, "new_group", make_new_group)
    dist.new_group = c10d.new_group

    def set_device(device: object) -> None:
        _note("torch.cuda.set_device(...) does nothing")

    torch.cuda.set_device = set_device

    from torch.distributed import device_mesh

    def make_mesh(original: Callable[..., Any]) -> Callable[..., Any]:
        def init_device_mesh(device_type: str, *args: Any, **kwargs: Any) -> Any:
            if device_type == "cuda":
                device_type = "cpu"
                _note("init_device_mesh('cuda', ...) builds a CPU mesh")
            return original(device_type, *args, **kwargs)

        return init_device_mesh

    _wrap(device_mesh, "init_device_mesh", make_mesh)
    dist.init_device_mesh = device_mesh.init_device_mesh  # type: ignore[attr-defined]

    autocast = torch.amp.autocast_mode.autocast
    original_autocast_init = autocast.__init__

    def autocast_init(
        self: Any, device_type: str, dtype: Any = None, *args: Any, **kw: Any
    ) -> None:
        if device_type == "cuda" and dtype == torch.bfloat16:
            device_type = "cpu"
            _note("torch.autocast('cuda', dtype=torch.bfloat16) autocasts on the CPU")
        original_autocast_init(self, device_type, dtype, *args, **kw)

    autocast.__init__ = functools.wraps(original_autocast_init)(autocast_init)  # type: ignore[method-assign]

    from torch.nn.parallel import DistributedDataParallel

    def make_ddp_init(original: Callable[..., Any]) -> Callable[..., Any]:
        def ddp_init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
            bound = _bound(original, (self, module, *args), kwargs)
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            if on_cpu and bound.arguments.get("device_ids") is not None:
                bound.arguments["device_ids"] = None
                bound.arguments["output_device"] = None
                _note("DistributedDataParallel(device_ids=...) of a CPU module drops device_ids")
            original(*bound.args, **bound.kwargs)

        return ddp_init

    _wrap(DistributedDataParallel, "__init__", make_ddp_init)


# --- Hugging Face: the Trainer and accelerate --------------------------------------------------


def _adapt_training_arguments(module: types.ModuleType) -> None:
    """On CPU ranks the Trainer runs as CPU: DDP over gloo, and bf16 allowed on the CPU."""
    arguments = module.TrainingArguments

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __post_init__(self: Any) -> None:
            if not self.use_cpu:
                self.use_cpu = True
                _note("the Hugging Face Trainer runs with use_cpu=True")
            if self.deepspeed and os.environ.pop("ACCELERATE_USE_CPU", None) is not None:
                # accelerate hands the model to DeepSpeed only when the environment does not
                # say CPU (else it wraps it in DDP, silently); use_cpu still picks gloo.
                pass
            original(self)

        return __post_init__

    _wrap(arguments, "__post_init__", make)


def shard_with_fsdp2_on_cpu(trainer: Any) -> None:
    """Have a Hugging Face Trainer asked for FSDP shard with FSDP2 on CPU ranks.

    accelerate 1.15 turns FSDP on only for accelerator devices and otherwise wraps the model in
    DDP without a word; `fully_shard` itself works on a CPU mesh over gloo. The plugin is
    rebuilt from the `FSDP_*` environment the Trainer's arguments filled.
    """
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = AcceleratorState()
    plugin = FullyShardedDataParallelPlugin()
    plugin.activation_checkpointing = trainer.args.fsdp_config.get(
        "activation_checkpointing", False
    )
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True


def _adapt_trainer(module: types.ModuleType) -> None:
    """FSDP asked of the Trainer on CPU ranks: FSDP2 (FSDP1 needs an accelerator device)."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def create_accelerator_and_postprocess(self: Any) -> None:
            fsdp = bool(self.args.fsdp)
            if fsdp and os.environ.get("FSDP_VERSION", "1") != "2":
                os.environ["FSDP_VERSION"] = "2"
                # Sharded checkpoints: accelerate's full-state-dict load under FSDP2 has only
                # rank 0 join the broadcast.
                os.environ["FSDP_STATE_DICT_TYPE"] = "SHARDED_STATE_DICT"
                _note("the Trainer's FSDP shards with FSDP2 (fully_shard) on the CPU")
            original(self)
            if fsdp:
                shard_with_fsdp2_on_cpu(self)

        return create_accelerator_and_postprocess

    _wrap(module.Trainer, "create_accelerator_and_postprocess", make)


def _check_accelerate(module: types.ModuleType) -> None:
    state = module.PartialState

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            original(self, *args, **kwargs)
            world, _ = _world()
            if world > 1 and self.num_processes != world:
                raise _single_process(
                    "Hugging Face accelerate",
                    self.num_processes,
                    f" (distributed type {self.distributed_type})",
                )

        return __init__

    _wrap(state, "__init__", make)


# --- Lightning ---------------------------------------------------------------------------------


def _adapt_lightning(cpu: bool) -> Callable[[types.ModuleType], None]:
    def hook(module: types.ModuleType) -> None:
        trainer = module.Trainer

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                bound = _bound(original, (self, *args), kwargs)
                world, local = _world()
                given = bound.arguments
                if cpu and str(given.get("accelerator")) in ("gpu", "cuda"):
                    _note(f"Lightning accelerator={given['accelerator']!r} runs on the CPU")
                    given["accelerator"] = "cpu"
                devices = given.get("devices")
                if devices in ("auto", -1, "-1"):
                    given["devices"] = local
                    given["num_nodes"] = max(world // local, 1)
                elif cpu and devices != local:
                    _note(f"Lightning devices={devices!r} is taken as the {local} launched ranks")
                    given["devices"] = local
                    given["num_nodes"] = max(world // local, 1)
                original(*bound.args, **bound.kwargs)
                if world > 1 and self.world_size != world:
                    raise _single_process("Lightning", self.world_size)

            return __init__

        _wrap(trainer, "__init__", make)

    return hook


# --- DeepSpeed ---------------------------------------------------------------------------------

_DEEPSPEED_ADAM = ("adam", "adamw")


def _plain_adam(config: Any) -> Any:
    """A copy of a DeepSpeed config whose Adam is torch's, not a compiled one."""
    if isinstance(config, (str, os.PathLike)) and Path(config).is_file():
        config = json.loads(Path(config).read_text())
    if not isinstance(config, dict):
        return config
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in _DEEPSPEED_ADAM:
        params = dict(optimizer.get("params") or {})
        if not params.get("torch_adam"):
            params["torch_adam"] = True
            _note(f"DeepSpeed's {optimizer['type']} is torch's (no compiled fused Adam)")
            config = {**config, "optimizer": {**optimizer, "params": params}}
    return config


def _adapt_deepspeed(cpu: bool) -> Callable[[types.ModuleType], None]:
    def hook(module: types.ModuleType) -> None:
        if cpu:
            # No compiled op is available: DeepSpeed then neither probes compilers for every op
            # nor JIT-builds its shared-memory all-reduce on each rank.
            module.ops.__compatible_ops__ = {}

        def make(original: Callable[..., Any]) -> Callable[..., Any]:
            def initialize(*args: Any, **kwargs: Any) -> Any:
                if cpu:
                    for key in ("config", "config_params"):
                        if kwargs.get(key) is not None:
                            kwargs[key] = _plain_adam(kwargs[key])
                    ds_args: Any = kwargs.get("args")
                    path = getattr(ds_args, "deepspeed_config", None)
                    if path is not None and kwargs.get("config") is None:
                        kwargs["config"] = _plain_adam(path)
                        ds_args.deepspeed_config = None
                result = original(*args, **kwargs)
                world, _ = _world()
                seen = getattr(result[0], "world_size", world)
                if world > 1 and seen != world:
                    raise _single_process("DeepSpeed", seen)
                return result

            return initialize

        _wrap(module, "initialize", make)

    return hook


# --- entry point -------------------------------------------------------------------------------


def install(run_dir: Path, rank: int, device: str) -> None:
    """Put this rank's adaptations in place (call once, before the user's code is loaded)."""
    _state.update(folder=run_dir / ADAPTATIONS_DIR, rank=rank, made=[])
    cpu = device == "cpu"
    finder = _AfterImport()
    sys.meta_path.insert(0, finder)
    if cpu:
        _adapt_torch_for_cpu()
        finder.watch("transformers.training_args", _adapt_training_arguments)
        finder.watch("transformers.trainer", _adapt_trainer)
    finder.watch("accelerate.state", _check_accelerate)
    for package in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        finder.watch(package, _adapt_lightning(cpu))
    finder.watch("deepspeed", _adapt_deepspeed(cpu))
