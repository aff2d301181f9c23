"""Hardware profiles pick the pool and GPU request before a run is created."""

import json

import pytest
from prefect.utilities.templating import apply_values

from deployments.catalog import REPO_ROOT, deployments
from deployments.profiles import (
    GPU_POOL,
    MULTINODE_POOL,
    ProfileError,
    requested_size,
    select_profile,
)
from trainflow.configs.frameworks import shipped_configs
from trainflow.configs.sft import sft_preset_names


def test_cpu_runs_go_to_the_process_pool():
    for gpu_type in (None, "cpu", "CPU"):
        profile = select_profile(2, gpu_type)
        assert (profile.deployment, profile.work_pool, profile.job_variables) == (
            "cpu-local",
            "cpu-local",
            {},
        )


def test_gpu_runs_request_gpus_and_select_nodes_by_product():
    profile = select_profile(8, "h100")
    assert profile.deployment == "h100" and profile.work_pool == GPU_POOL
    assert profile.job_variables == {
        "gpus_per_node": 8,
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    }
    assert select_profile(1, "A10").job_variables["node_selector"] == {
        "nvidia.com/gpu.product": "NVIDIA-A10G"
    }


@pytest.mark.parametrize(
    ("gpus", "gpu_type", "nnodes", "message"),
    [
        (8, "TPUv5", 1, "gpu_type='TPUv5' has no hardware profile; known: H100"),
        (0, "H100", 1, "gpus and nnodes must be >= 1"),
        (6, "H100", 4, "does not divide evenly"),
        (16, "cpu", 2, "nnodes=2 with gpu_type='cpu': multi-node runs need a GPU type"),
        (16, "H100", "4:2", "nnodes='4:2': expected a node count >= 1 or an elastic range"),
    ],
)
def test_impossible_sizes_are_refused_before_a_run_exists(gpus, gpu_type, nnodes, message):
    with pytest.raises(ProfileError, match=message):
        select_profile(gpus, gpu_type, nnodes)


def test_multi_node_gpu_runs_go_to_the_multinode_pool():
    profile = select_profile(16, "H100", 2)
    assert (profile.deployment, profile.work_pool) == ("h100-multinode", MULTINODE_POOL)
    assert profile.job_variables == {
        "nnodes": 2,
        "gpus_per_node": 8,
        "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    }


def test_kubernetes_template_renders_gpu_request_and_node_selector():
    template = json.loads((REPO_ROOT / "deployments" / "k8s-gpu-job-template.json").read_text())
    defaults = {k: v.get("default") for k, v in template["variables"]["properties"].items()}
    values = {**defaults, **select_profile(4, "A100").job_variables}
    job = apply_values(template["job_configuration"], values)["job_manifest"]
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 4}
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 4
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}


def test_gpu_deployments_in_prefect_yaml_match_their_profile():
    for entry in deployments():
        if entry.work_pool not in (GPU_POOL, MULTINODE_POOL):
            continue
        if "config" in entry.parameters:
            size = requested_size(entry.parameters["config"])
        else:  # remote-call/<gpu>: each call brings its own function; the pool gives a node
            size = (8, entry.name.upper(), 1)
        profile = select_profile(*size)
        # A preset's deployment is named after the preset (`sft/gpt-oss-20b`, or a framework's
        # shipped config, `axolotl/axolotl-olmo3-7b`); the others after their profile, which is
        # what `flows.launch` looks for.
        assert entry.name in (profile.deployment, *sft_preset_names(), *shipped_configs())
        assert entry.job_variables == profile.job_variables


def test_size_is_read_from_flat_or_nested_configs():
    assert requested_size({"gpus": 8, "gpu_type": "H100"}) == (8, "H100", 1)
    assert requested_size({"resources": {"gpus": 4, "gpu_type": "cpu", "nnodes": 1}}) == (
        4,
        "cpu",
        1,
    )
