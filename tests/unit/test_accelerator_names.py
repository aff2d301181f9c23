"""GPU and accelerator type names: the reference's names and ours are accepted wherever a GPU
type is given; unknown ones are refused, listing the known names. GPUs cannot exist here, so
GPU inventories are faked (named so)."""

import pytest
from pydantic import ValidationError

from trainflow import distributed
from trainflow.launch.plan import (
    ACCELERATOR_TYPES,
    KNOWN_GPUS,
    GpuInventory,
    ResourceError,
    cluster_plan,
    known_gpu_type,
    resolve_resources,
)
from trainflow.resources import Resources

FAKE_H100x8 = GpuInventory(("NVIDIA H100 80GB HBM3",) * 8)
FAKE_A10 = GpuInventory(("NVIDIA A10",))
NO_GPU = GpuInventory(())


def add_one(x: int) -> int:
    return x + 1


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("GPU_1xA10", "A10"),
        ("GPU_1xH100", "H100"),
        ("GPU_8xH100", "H100"),
        ("GPU_8xB300", "B300"),
        ("H100", "H100"),
        ("A10", "A10"),
        ("a100", "a100"),
        ("B300", "B300"),
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"),
        ("RTX 4090", "RTX 4090"),
        ("cpu", "cpu"),
        ("CPU", "cpu"),
        (None, None),
    ],
)
def test_the_reference_names_and_ours_are_known(name, meant):
    assert known_gpu_type(name) == meant


@pytest.mark.parametrize("name", ["banana", "TPUv5", "H10", "GPU_4xH100", ""])
def test_unknown_names_are_refused_listing_the_known_ones(name):
    with pytest.raises(ResourceError) as info:
        known_gpu_type(name)
    message = str(info.value)
    assert f"gpu_type={name!r}" in message
    if name.startswith("GPU_"):  # an accelerator type: the valid types are listed
        assert all(known in message for known in (*ACCELERATOR_TYPES, "'cpu'"))
    else:
        assert all(known in message for known in (*KNOWN_GPUS, *ACCELERATOR_TYPES, "'cpu'"))


def test_an_unknown_gpu_type_is_refused_even_with_the_cpu_fallback(monkeypatch):
    monkeypatch.setenv("TRAINFLOW_CPU_FALLBACK", "1")
    with pytest.raises(ResourceError, match="gpu_type='banana' is not a GPU type"):
        resolve_resources(2, "banana", inventory=NO_GPU)
    with pytest.raises(ResourceError, match="gpu_type='banana'"):
        distributed(gpus=2, gpu_type="banana")
    with pytest.raises(ResourceError, match="gpu_type='banana'"):
        cluster_plan(2, "banana", 2, "ray://head:10001")
    # A known GPU that is not here still falls back to CPU ranks.
    assert resolve_resources(2, "H100", inventory=NO_GPU).device == "cpu"


def test_gpu_8xh100_runs_on_a_faked_h100_node():
    plan = resolve_resources(8, "GPU_8xH100", inventory=FAKE_H100x8)
    assert (plan.device, plan.nproc_per_node, plan.gpu_name) == (
        "cuda",
        8,
        "NVIDIA H100 80GB HBM3",
    )
    plan = resolve_resources(16, "GPU_8xH100", nnodes=2, inventory=FAKE_H100x8)
    assert (plan.device, plan.nproc_per_node, plan.nnodes) == ("cuda", 8, 2)
    assert resolve_resources(1, "GPU_1xA10", inventory=FAKE_A10).device == "cuda"


def test_gpu_8xh100_as_a_pipeline_gpu_type_plans_on_a_faked_h100_node(monkeypatch):
    monkeypatch.setattr(GpuInventory, "detect", classmethod(lambda cls: FAKE_H100x8))
    plan = Resources(gpus=8, gpu_type="GPU_8xH100").launch_plan()
    assert (plan.device, plan.nproc_per_node) == ("cuda", 8)
    fn = distributed(gpus=8, gpu_type="GPU_8xH100")(add_one)
    assert (fn.options.gpus, fn.options.gpu_type, fn.options.nnodes) == (8, "H100", 1)


def test_a_pipeline_config_refuses_an_unknown_gpu_type_naming_the_known_ones():
    with pytest.raises(ValidationError) as info:
        Resources(gpus=2, gpu_type="banana")
    assert "gpu_type='banana' is not a GPU type" in str(info.value)
    assert "GPU_8xH100" in str(info.value) and "H100" in str(info.value)
    assert Resources(gpus=2, gpu_type="cpu").gpu_type == "cpu"
