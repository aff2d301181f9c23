"""What a rank adjusts so that framework code and code written for GPUs runs on the launched ranks.

The worker calls `install` on every rank before it loads the user's function. Code written for a
managed notebook (`init_process_group("nccl")`, a Hugging Face `Trainer`, a Lightning
`Trainer(devices="auto")`, a DeepSpeed engine) then runs distributed over exactly the ranks the
launcher started, with no change.

Every launch (the environment contract):

- `dist.init_process_group(...)` called without `timeout=` (by the user's code, or a framework)
  bounds each collective by the launch's `collective_timeout`, as the launcher's own group does.
- a default group opened again after one was destroyed (streaming's set-up, then Lightning's)
  connects: it gets store keys of its own rather than the closed group's addresses.
- Lightning: `devices="auto"` is the ranks launched on this node and `num_nodes` the launched
  nodes, so Lightning joins the launch instead of counting the node's GPUs.
- Hugging Face accelerate (the `Trainer`, TRL), Lightning and DeepSpeed each check, once they
  have set up, that they see the launched world. One that ended single-process inside a
  multi-rank launch raises `SingleProcessFrameworkError` naming it, rather than training one
  independent copy per rank.
- accelerate unwraps a model (the `Trainer` saving it) without importing DeepSpeed, unless
  DeepSpeed is already imported: a DDP or FSDP rank never loads it.

CPU ranks (`gpu_type="cpu"`, or the CPU fallback of GPU code; never on GPU ranks):

- the `Trainer` runs as CPU (`use_cpu`), which also lets `bf16=True` run on CPU;
- a bare `PartialState()` reads `ACCELERATE_USE_CPU` as `Accelerator()` does;
- `init_process_group("nccl")` / `new_group` / `init_device_mesh("cuda")` use gloo and the CPU,
  `device_id` is dropped and `torch.cuda.set_device` does nothing;
- `torch.autocast("cuda", dtype=torch.bfloat16)` autocasts on the CPU;
- `DistributedDataParallel(device_ids=[i])` of a CPU module drops `device_ids`;
- CUDA asked for (`.to("cuda:0")`, `.cuda()`) fails naming the CPU ranks and what to change;
- Lightning's `accelerator="gpu"` becomes the CPU and `devices=N` the launched ranks;
- DeepSpeed uses none of its compiled ops and torch's Adam, rather than compiling C++ on every
  rank for minutes.

Each adaptation actually made is noted in the run directory (`adaptations/rank_N.json`); the
caller reports them in one warning when the launch ends, and rank 0 prints each one once.

`sys.meta_path` gets a finder that runs a hook right after a watched module is first imported,
so nothing is imported that the function does not import itself. The patches themselves live
in the module of their package (`compat.torch`, `compat.transformers`, `compat.lightning`,
`compat.deepspeed`), each with the versions it was written for; the record of what was adapted
is `compat.adaptations`.
"""

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainflow.compat import deepspeed, lightning, torch, transformers
from trainflow.compat.adaptations import record

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


def install(run_dir: Path, rank: int, device: str, collective_timeout_s: float) -> None:
    """Put this rank's adaptations in place (call once, before the user's code is loaded).

    `collective_timeout_s` bounds the collectives of a process group the user's code opens
    without `timeout=` (the launch's `collective_timeout`)."""
    record.start(run_dir, rank)
    cpu = device == "cpu"
    finder = _AfterImport()
    sys.meta_path.insert(0, finder)
    torch.own_groups(collective_timeout_s)
    if cpu:
        torch.adapt_for_cpu()
        finder.watch("transformers.training_args", transformers.adapt_training_arguments)
        finder.watch("transformers.trainer", transformers.adapt_trainer)
    finder.watch("accelerate.state", transformers.check_accelerate(cpu))
    finder.watch("accelerate.utils.other", transformers.unwrap_without_deepspeed)
    for package in ("lightning.pytorch.trainer.trainer", "pytorch_lightning.trainer.trainer"):
        finder.watch(package, lightning.adapt_trainer(cpu))
    finder.watch("deepspeed", deepspeed.adapt(cpu))
