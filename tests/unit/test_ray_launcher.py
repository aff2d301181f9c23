"""Node counts and ranges, and when a launch goes to a Ray cluster (no cluster needed here).

The launches themselves run on a real two-node Ray cluster in
tests/distributed/test_ray_multinode.py.
"""

import sys

import pytest
from pydantic import ValidationError

from trainflow import distributed
from trainflow.errors import LaunchConfigError
from trainflow.launch.plan import ResourceError, node_range, resolve_resources
from trainflow.launch.ray_placement import RayLaunch, ray_address, resolve_plan
from trainflow.launch.spec import LaunchOptions, rank_label
from trainflow.resources import Resources


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (1, (1, 1)),
        (3, (3, 3)),
        ("2", (2, 2)),
        ("2:4", (2, 4)),
        (" 1 : 2 ", (1, 2)),
        ("3:3", (3, 3)),
    ],
)
def test_node_counts_and_ranges(given, expected):
    assert node_range(given) == expected


@pytest.mark.parametrize(
    "bad", [0, -1, True, 1.5, "", "a", "0:2", "3:2", "2:", ":2", "1:2:3", None]
)
def test_bad_node_counts_name_the_field(bad):
    with pytest.raises(ResourceError, match=r"nnodes must be a positive integer or a range"):
        node_range(bad)


def test_pipeline_resources_take_a_range_and_refuse_nonsense():
    assert Resources(nnodes="2:4").nnodes == "2:4"
    assert Resources(nnodes="3:3").nnodes == 3
    assert Resources(nnodes="2").nnodes == 2
    with pytest.raises(ValidationError, match=r"nnodes\n.*range 'min:max'"):
        Resources(nnodes="4:2")


def test_a_range_plans_for_its_largest_size():
    plan = resolve_resources(4, "cpu", "1:2")
    assert (plan.nproc_per_node, plan.nnodes, plan.min_nodes) == (2, 2, 1)
    with pytest.raises(ResourceError, match="gpus=3 does not divide evenly across nnodes=2"):
        distributed(gpus=3, nnodes="1:2")


def test_the_ray_plan_asks_the_cluster_for_gpus_without_looking_at_this_machine():
    gpu = resolve_plan(LaunchOptions(gpus=16, gpu_type="H100", nnodes=2))
    assert (gpu.device, gpu.nproc_per_node, gpu.nnodes) == ("cuda", 8, 2)
    cpu = resolve_plan(LaunchOptions(gpus=2, gpu_type="cpu", nnodes="1:2"))
    assert (cpu.device, cpu.nproc_per_node, cpu.min_nodes) == ("cpu", 1, 1)


def test_which_launches_go_to_ray(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ray_address(LaunchOptions(gpus=2, nnodes=2)) is None  # nodes join by rendezvous
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert ray_address(LaunchOptions(gpus=2, nnodes=2)) == "10.0.0.1:6379"
    assert ray_address(LaunchOptions(gpus=2, nnodes="1:2")) == "10.0.0.1:6379"
    # One node stays on this machine even when a cluster is around...
    assert ray_address(LaunchOptions(gpus=2)) is None
    # ...unless the call names the cluster.
    assert ray_address(LaunchOptions(gpus=2, ray_address="auto")) == "auto"


def test_rank_labels_name_the_node_on_multi_node_launches():
    assert rank_label(3, LaunchOptions(gpus=4)) == "[rank 3]"
    assert rank_label(3, LaunchOptions(gpus=4, nnodes=2)) == "[node 1 rank 3]"
    assert rank_label(5, LaunchOptions(gpus=16, nnodes="1:2")) == "[node 0 rank 5]"


def test_without_ray_installed_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if the extra were not installed
    with pytest.raises(LaunchConfigError, match=r"pip install 'trainflow\[ray\]'"):
        RayLaunch(LaunchOptions(gpus=2, nnodes=2, ray_address="auto"), None)


def test_the_local_launcher_never_imports_ray():
    import subprocess

    code = (
        "import sys\n"
        "from trainflow import distributed\n"
        "import trainflow.launch.backends, trainflow.launch.ray_placement\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
