"""Patches into DeepSpeed: no compiled op off CUDA, torch's Adam and the world check on CPU
ranks.

Written and tested for DeepSpeed 0.19.
"""

import json
import os
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainflow.compat.adaptations import launched_world, note, single_process
from trainflow.compat.patching import check, declare, replace

DEEPSPEED = ">=0.17,<0.20"

COMPATIBLE_OPS = declare(
    "deepspeed: ops.__compatible_ops__",
    "deepspeed",
    DEEPSPEED,
    target="deepspeed.ops:__compatible_ops__",
    why="off CUDA, saying no compiled op is available stops each rank probing compilers for "
    "every op (~10 s) and JIT-building a shared-memory all-reduce (minutes on a cold cache)",
)
INITIALIZE = declare(
    "deepspeed: initialize",
    "deepspeed",
    DEEPSPEED,
    target="deepspeed:initialize",
    params=("args", "config", "config_params"),
    why="CPU ranks: Adam is torch's (no compiled fused Adam); an engine that ended "
    "single-process inside a multi-rank launch fails, naming it",
)


def no_compiled_ops(module: Any = None) -> None:
    """Tell DeepSpeed (`module`, imported if not given) that no compiled op is available."""
    if module is None:
        import deepspeed

        module = deepspeed
    check(COMPATIBLE_OPS)
    ops = vars(module.ops)
    # DeepSpeed 0.19 probes on the first read of the name (the module's `__getattr__` compiles
    # a test program per op): reading it here would run the very probe this prevents, so only
    # the module's own namespace is looked at, and the name is set before anything reads it.
    if not isinstance(ops.get("__compatible_ops__"), dict) and "__getattr__" not in ops:
        return  # gone: DeepSpeed probes (slower, not wrong); the test says so
    module.ops.__compatible_ops__ = {}


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
            note(f"DeepSpeed's {optimizer['type']} is torch's (no compiled fused Adam)")
            config = {**config, "optimizer": {**optimizer, "params": params}}
    return config


def adapt(cpu: bool) -> Callable[[types.ModuleType], None]:
    def hook(module: types.ModuleType) -> None:
        if cpu:
            no_compiled_ops(module)

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
                world, _ = launched_world()
                seen = getattr(result[0], "world_size", world)
                if world > 1 and seen != world:
                    raise single_process("DeepSpeed", seen)
                return result

            return initialize

        replace(INITIALIZE, module, "initialize", make)

    return hook
