"""Resource resolution. GPUs cannot exist here, so GPU inventories are mocked (named so)."""

import pytest

from trainflow import distributed
from trainflow.launch.plan import GpuInventory, ResourceError, gpu_name_matches, resolve_resources

H100x8 = GpuInventory(("NVIDIA H100 80GB HBM3",) * 8)
A100x4 = GpuInventory(("NVIDIA A100-SXM4-80GB",) * 4)
NO_GPU = GpuInventory(())


@pytest.mark.parametrize(
    ("requested", "actual", "match"),
    [
        ("H100", "NVIDIA H100 80GB HBM3", True),
        ("h100", "NVIDIA H100 80GB HBM3", True),
        ("A10", "NVIDIA A10", True),
        ("A10", "NVIDIA A100-SXM4-80GB", False),
        ("A100", "NVIDIA A100-SXM4-80GB", True),
        ("RTX 4090", "NVIDIA GeForce RTX 4090", True),
        ("H10", "NVIDIA H100 80GB HBM3", False),
    ],
)
def test_gpu_names_match_whole_words_only(requested, actual, match):
    assert gpu_name_matches(requested, actual) is match


def test_cpu_forces_cpu_ranks_even_with_mocked_gpus():
    res = resolve_resources(4, "cpu", inventory=H100x8)
    assert (res.device, res.nproc_per_node, res.nnodes) == ("cpu", 4, 1)


def test_none_uses_mocked_gpus_when_present_and_cpu_otherwise():
    assert resolve_resources(8, None, inventory=H100x8).device == "cuda"
    assert resolve_resources(2, None, inventory=NO_GPU).device == "cpu"


def test_matching_gpu_type_with_mocked_gpus():
    res = resolve_resources(16, "H100", nnodes=2, inventory=H100x8)
    assert (res.device, res.nproc_per_node, res.world_size, res.gpu_name) == (
        "cuda",
        8,
        16,
        "NVIDIA H100 80GB HBM3",
    )


def test_wrong_gpu_type_names_request_and_what_is_present_with_mocked_gpus(monkeypatch):
    monkeypatch.delenv("TRAINFLOW_CPU_FALLBACK", raising=False)
    with pytest.raises(ResourceError) as info:
        resolve_resources(2, "A10", inventory=A100x4)
    assert "'A10'" in str(info.value) and "4x NVIDIA A100-SXM4-80GB" in str(info.value)
    with pytest.raises(ResourceError, match="'H100'.*no GPU"):
        resolve_resources(2, "H100", inventory=NO_GPU)


def test_cpu_fallback_runs_cpu_ranks_with_a_warning(monkeypatch, caplog):
    monkeypatch.setenv("TRAINFLOW_CPU_FALLBACK", "1")
    res = resolve_resources(2, "H100", inventory=NO_GPU)
    assert res.device == "cpu" and res.nproc_per_node == 2
    assert "TRAINFLOW_CPU_FALLBACK=1" in caplog.text


def test_more_ranks_than_mocked_gpus_is_an_error():
    with pytest.raises(ResourceError, match="needs 8 GPUs per node.*4x NVIDIA A100"):
        resolve_resources(8, "A100", inventory=A100x4)


@pytest.mark.parametrize(
    ("gpus", "nnodes", "message"),
    [
        (0, 1, "gpus must be a positive integer"),
        (3, 2, "does not divide evenly"),
        (2, 0, "nnodes must be a positive integer"),
    ],
)
def test_bad_counts_fail_at_decoration_time(gpus, nnodes, message):
    with pytest.raises(ResourceError, match=message):
        distributed(gpus=gpus, nnodes=nnodes)


def test_bad_options_name_the_option():
    with pytest.raises(ValueError, match="timeout must be a positive"):
        distributed(gpus=1, timeout=0)
    with pytest.raises(ValueError, match="max_restarts"):
        distributed(gpus=1, max_restarts=-1)
    with pytest.raises(ValueError, match="env must map str to str"):
        distributed(gpus=1, env={"A": 1})


def test_this_machine_without_gpus_rejects_a_gpu_type(monkeypatch):
    monkeypatch.delenv("TRAINFLOW_CPU_FALLBACK", raising=False)
    if GpuInventory.detect().count:
        pytest.skip("this machine has GPUs")

    @distributed(gpus=2, gpu_type="H100")
    def f():
        return 1

    with pytest.raises(
        ResourceError, match="gpu_type='H100' requested, but this machine has no GPU"
    ):
        f.distributed()


def test_cpu_ranks_far_beyond_the_cores_are_refused_naming_the_count():
    from trainflow.launch.plan import check_cpu_oversubscription

    with pytest.raises(ResourceError, match=r"gpus=16 would start 16 CPU ranks .* 2 cores"):
        check_cpu_oversubscription(resolve_resources(16, "cpu"), cores=2)
    check_cpu_oversubscription(resolve_resources(8, "cpu"), cores=2)  # 4 per core: allowed


def test_cpu_ranks_beyond_the_cores_warn(caplog):
    from trainflow.launch.plan import check_cpu_oversubscription

    check_cpu_oversubscription(resolve_resources(2, "cpu"), cores=2)
    assert "compete for cores" not in caplog.text
    check_cpu_oversubscription(resolve_resources(3, "cpu"), cores=2)
    assert "3 CPU ranks on 2 cores" in caplog.text


def test_gpu_ranks_are_not_counted_against_cpu_cores_with_mocked_gpus():
    from trainflow.launch.plan import check_cpu_oversubscription

    check_cpu_oversubscription(resolve_resources(8, "H100", inventory=H100x8), cores=1)
