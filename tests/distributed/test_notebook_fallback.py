"""What a notebook user of the CPU fallback runs into, on 2 real gloo CPU ranks.

Code written for a managed notebook's GPUs (`gpu_type="H100"`) runs here with
TRAINFLOW_CPU_FALLBACK=1: accelerate's own self-tests, a TRL FSDP run that saves its model,
Lightning reading MDS shards, a `.to("cuda:N")`, and a process group the cell opens itself.
"""

import pytest

from trainflow import distributed


@pytest.fixture
def cpu_fallback(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_CPU_FALLBACK", "1")


# --- accelerate's self-tests ----------------------------------------------------------------


@distributed(gpus=2, gpu_type="H100")
def accelerate_self_test(script: str) -> str:
    """One of the scripts accelerate ships to test a distributed setup (`accelerate test`)."""
    import importlib

    module = importlib.import_module(f"accelerate.test_utils.scripts.{script}")
    if script != "test_ops":
        module.main()
        return script
    # test_ops's main() as accelerate 1.8 to 1.13 ship it (the Axolotl and LLM Foundry
    # environments): a bare PartialState(), with no `cpu=` from the environment.
    from accelerate import PartialState

    state = PartialState()
    for name in [n for n in dir(module) if n.startswith("test_")]:  # gather, reduce, ...
        getattr(module, name)(state)
    state.destroy_process_group()
    return f"{script} on {state.num_processes} {state.device.type} processes"


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("test_ops", "test_ops on 2 cpu processes"),
        ("test_sync", "test_sync"),
        ("test_script", "test_script"),
    ],
)
def test_accelerate_self_tests_pass_on_cpu_fallback_ranks(cpu_fallback, script, expected):
    assert accelerate_self_test.distributed(script) == [expected, expected]
