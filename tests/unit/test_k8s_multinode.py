"""Multi-node Kubernetes profile: the Indexed Job and headless Service a run creates.

No cluster is reachable here: the rendered objects are checked against the Kubernetes OpenAPI
schema (kubernetes-validate, strict) and against what Prefect's templating and worker make
of the template.
"""

import asyncio
import copy
import io
import json
import os
import re
import subprocess
import sys
import uuid
from contextlib import redirect_stdout

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prefect.server.schemas.actions import validate_base_job_template
from prefect.utilities.templating import apply_values, find_placeholders
from prefect.workers.base import BaseJobConfiguration

from deployments import profiles
from deployments.catalog import REPO_ROOT
from deployments.profiles import (
    GPU_POOL,
    JOB_NAME_ENV,
    JOB_NAME_LABEL,
    MULTINODE_POOL,
    SERVICE_LABEL,
    ProfileError,
    load_job_template,
    render_manifests,
    requested_size,
    select_profile,
    service_manifest,
)
from trainflow.launch.board import BOARD_ENV, NODE_INDEX_ENV
from trainflow.launch.spec import RDZV_ENDPOINT_ENV, RUN_ID_ENV

# The oldest schema every feature used here is GA in (podFailurePolicy 1.31), and the newest.
K8S_VERSIONS = ("1.33", kubernetes_validate.latest_version())
SIZES = [(16, "H100", 2), (32, "A100", 4)]
DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _expand(env: list[dict]) -> dict[str, str]:
    """Container env as the kubelet builds it: `$(NAME)` expands to an entry defined earlier."""
    seen: dict[str, str] = {}
    for entry in env:
        value = entry.get("value", f"<from {entry.get('valueFrom')}>")
        seen[entry["name"]] = re.sub(
            r"\$\((\w+)\)", lambda m: seen.get(m.group(1), m.group(0)), value
        )
    return seen


def _pod(job: dict) -> tuple[dict, dict, dict]:
    template = job["spec"]["template"]
    return template["metadata"], template["spec"], template["spec"]["containers"][0]


@pytest.mark.parametrize(("gpus", "gpu_type", "nnodes"), SIZES)
def test_rendered_objects_are_valid_kubernetes_and_form_one_gang(gpus, gpu_type, nnodes):
    profile = select_profile(gpus, gpu_type, nnodes)
    manifests = render_manifests(profile, name="mlp", namespace="ml")
    assert [m["kind"] for m in manifests] == ["Job", "Service"]
    for version in K8S_VERSIONS:
        for obj in manifests:
            kubernetes_validate.validate(obj, version, strict=True)
    assert "{{" not in json.dumps(manifests)

    job, service = manifests
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == nnodes
    assert spec["backoffLimit"] == 0
    labels, pod, container = _pod(job)
    per_node = gpus // nnodes
    assert container["resources"]["requests"]["nvidia.com/gpu"] == per_node
    assert container["resources"]["limits"]["nvidia.com/gpu"] == per_node
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": profiles.GPU_PRODUCTS[gpu_type]}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["restartPolicy"] == "Never"
    (shm,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and volume["emptyDir"]["sizeLimit"]
    assert container["args"] == list(profiles.FLOW_RUN_COMMAND)

    # The headless Service selects these pods and names their subdomain.
    assert service["spec"]["clusterIP"] == "None"
    assert service["metadata"]["namespace"] == job["metadata"]["namespace"] == "ml"
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= labels["labels"].items()


@pytest.mark.parametrize(("gpus", "gpu_type", "nnodes"), SIZES)
def test_every_pod_gets_the_same_rendezvous_on_pod_zero(gpus, gpu_type, nnodes):
    job, service = render_manifests(select_profile(gpus, gpu_type, nnodes), namespace="ml")
    _, pod, container = _pod(job)
    names = [e["name"] for e in container["env"]]
    assert names.index(JOB_NAME_ENV) < names.index(RDZV_ENDPOINT_ENV)
    assert names.index(JOB_NAME_ENV) < names.index(RUN_ID_ENV)
    (job_name_entry,) = [e for e in container["env"] if e["name"] == JOB_NAME_ENV]
    assert job_name_entry["valueFrom"] == {
        "fieldRef": {"fieldPath": f"metadata.labels['{JOB_NAME_LABEL}']"}
    }
    # The API server names the job (generateName, at most 45 + 6 characters from Prefect);
    # the kubelet then expands $(...) on each pod, and pod `index` is `<job>-<index>`.
    job_name = "a" * 45 + "-x7k2p"
    env = _expand(
        [
            {"name": e["name"], "value": job_name} if e["name"] == JOB_NAME_ENV else e
            for e in container["env"]
        ]
    )
    port = container["ports"][0]["containerPort"]
    pod_zero_fqdn = f"{job_name}-0.{pod['subdomain']}.ml.svc.cluster.local"
    # Pod 0's own FQDN, the first name of its /etc/hosts entry: torch elastic makes the node
    # whose canonical hostname is the endpoint's host the store's host, even before DNS has
    # a record for it.
    assert env[RDZV_ENDPOINT_ENV] == f"{pod_zero_fqdn}:{port}"
    assert env[RUN_ID_ENV] == job_name
    # Pod 0 also hosts the launch board its followers read each launch from.
    assert names.index(JOB_NAME_ENV) < names.index(BOARD_ENV)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["launch-board"] != ports["rendezvous"] == port
    assert env[BOARD_ENV] == f"{pod_zero_fqdn}:{ports['launch-board']}"
    assert all(DNS_LABEL.match(part) and len(part) <= 63 for part in pod_zero_fqdn.split("."))
    assert len(f"{job_name}-{nnodes - 1}") <= 63  # the pods' hostnames
    assert service["spec"]["ports"][0]["port"] == port


def test_pod_zero_runs_the_flow_run_and_the_other_pods_follow():
    """The container's command, run as the kubelet would (command, then args) by a real shell:
    pod 0 executes Prefect's command; any other index starts
    `python -m trainflow.launch.follower`."""
    job, _ = render_manifests(select_profile(16, "H100", 2), command="echo flow-run execute")
    _, _, container = _pod(job)
    assert container["args"] == ["echo", "flow-run", "execute"]
    argv = [*container["command"], *container["args"]]
    assert "$(" not in json.dumps(argv)  # nothing the kubelet would expand
    env = {"PATH": f"{os.path.dirname(sys.executable)}:{os.environ.get('PATH', '')}"}
    for index in ({}, {NODE_INDEX_ENV: "0"}):
        pod_zero = subprocess.run(
            argv, env={**env, **index}, capture_output=True, text=True, timeout=30
        )
        assert (pod_zero.returncode, pod_zero.stdout) == (0, "flow-run execute\n")
    # A follower without a board to read from says so (exit 2) instead of running the flow.
    pod_one = subprocess.run(
        argv, env={**env, NODE_INDEX_ENV: "1"}, capture_output=True, text=True, timeout=60
    )
    assert pod_one.stdout == ""
    assert pod_one.returncode == 2, pod_one.stderr
    assert pod_one.stderr.startswith(
        f"python -m trainflow.launch.follower: error: no launch board: set {BOARD_ENV}=host:port"
    )


def test_variables_reach_the_rendered_objects():
    profile = select_profile(16, "H100", 2)
    job, service = render_manifests(
        profile,
        namespace="research",
        env={"HF_TOKEN_FILE": "/secrets/hf"},
        labels={"team": "nlp"},
        service_name="rdzv",
        rdzv_port=23456,
        cluster_domain="k8s.example",
        shm_size="16Gi",
        command="python -m flows.mlp",
        board_port=23457,
    )
    labels, pod, container = _pod(job)
    env = _expand(container["env"])
    assert env[RDZV_ENDPOINT_ENV].endswith("-0.rdzv.research.svc.k8s.example:23456")
    assert env[BOARD_ENV].endswith("-0.rdzv.research.svc.k8s.example:23457")
    assert env["HF_TOKEN_FILE"] == "/secrets/hf"
    assert env["PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"] == "crash"
    assert labels["labels"] == {SERVICE_LABEL: "rdzv", "team": "nlp"}
    assert job["metadata"]["labels"] == {"team": "nlp"}
    assert pod["volumes"][0]["emptyDir"]["sizeLimit"] == "16Gi"
    assert container["args"] == ["python", "-m", "flows.mlp"]
    assert service == service_manifest("research", "rdzv", 23456)
    with pytest.raises(ProfileError, match="rdzv_prot: not a variable of the k8s-gpu-multinode"):
        render_manifests(profile, rdzv_prot=1)
    with pytest.raises(ProfileError, match="'cpu-local' has no Kubernetes job template"):
        render_manifests(select_profile(2, "cpu"))


def test_single_node_gpu_profile_renders_one_valid_job():
    (job,) = render_manifests(select_profile(8, "H100"))
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    assert job["spec"]["template"]["spec"]["containers"][0]["env"] == []


def test_template_placeholders_are_declared_and_defaults_fit_their_schema():
    template = load_job_template(MULTINODE_POOL)
    assert validate_base_job_template(template) is template
    used = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]))}
    declared = set(template["variables"]["properties"])
    assert used == declared  # nothing undeclared, nothing declared and unused
    defaults = {
        k: v["default"]
        for k, v in template["variables"]["properties"].items()
        if v.get("default") is not None
    }
    jsonschema.validate(defaults, template["variables"])
    job_vars = select_profile(32, "A100", 4).job_variables
    jsonschema.validate({**defaults, **job_vars}, template["variables"])
    # The env names the launcher reads are the ones the template sets.
    job_manifest = template["job_configuration"]["job_manifest"]
    _, _, container = _pod(job_manifest)
    env_names = [e["name"] for e in container["env"]]
    assert {RDZV_ENDPOINT_ENV, RUN_ID_ENV, BOARD_ENV} <= set(env_names)


@pytest.mark.parametrize("size", [(16, "H100", 2), (32, "A100", "2:4"), (8, "L4", 1)])
def test_rendering_substitutes_like_prefect(size):
    profile = select_profile(*size)
    template = load_job_template(profile.work_pool)
    schema = template["variables"]["properties"]
    values = {k: v["default"] for k, v in schema.items() if v.get("default") is not None}
    values.update(profile.job_variables, command=["prefect", "flow-run", "execute"])
    ours = profiles._fill(template["job_configuration"], values)
    assert ours == apply_values(template["job_configuration"], values)
    assert ours["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["resources"][
        "limits"
    ] == {"nvidia.com/gpu": profile.job_variables["gpus_per_node"]}


def test_template_is_a_valid_prefect_job_configuration():
    template = load_job_template(MULTINODE_POOL)
    assert set(template) == {"job_configuration", "variables"}
    assert template["variables"]["type"] == "object"
    # Prefect's Kubernetes worker refuses a job template whose pod spec lacks these two keys.
    pod_spec = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert {k: pod_spec[k] for k in profiles.WORKER_ONLY_POD_KEYS} == {
        "parallelism": 1,
        "completions": 1,
    }
    values = {**select_profile(16, "H100", 2).job_variables, "env": {"FOO": "1"}}
    config = asyncio.run(
        BaseJobConfiguration.from_template_and_values(template, values, client=object())
    )
    assert config.name == "trainflow"
    assert config.env == {"PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR": "crash", "FOO": "1"}


def test_prefect_kubernetes_worker_builds_the_rendered_job():
    worker = pytest.importorskip("prefect_kubernetes.worker")
    from prefect.client.schemas.objects import FlowRun

    profile = select_profile(32, "A100", 4)
    template = load_job_template(MULTINODE_POOL)
    values = {**profile.job_variables, "namespace": "ml"}
    config = asyncio.run(
        worker.KubernetesWorkerJobConfiguration.from_template_and_values(
            template, values, client=object()
        )
    )
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="crazy-zebra"))
    built = copy.deepcopy(config.job_manifest)
    (rendered, _) = render_manifests(profile, namespace="ml")
    # Drop what only a flow run has, and the pod keys Kubernetes itself drops.
    for meta in (built["metadata"], built["spec"]["template"]["metadata"]):
        meta["labels"] = {
            k: v
            for k, v in meta["labels"].items()
            if not k.startswith(("prefect.io/", "app.kubernetes.io/"))
        }
    built["metadata"].pop("annotations", None)
    _, pod, container = _pod(built)
    for key in profiles.WORKER_ONLY_POD_KEYS:
        pod.pop(key)
    container["env"] = [
        e
        for e in container["env"]
        if not e["name"].startswith("PREFECT_")
        or e["name"] == "PREFECT_FLOW_RUN_EXECUTE_SIGTERM_BEHAVIOR"
    ]
    assert built == rendered


def test_elastic_range_sizes_the_job_at_its_maximum():
    profile = select_profile(32, "H100", "2:4")
    assert profile.work_pool == MULTINODE_POOL
    assert profile.job_variables["nnodes"] == 4
    assert profile.job_variables["gpus_per_node"] == 8
    assert requested_size({"gpus": 32, "gpu_type": "H100", "nnodes": "2:4"}) == (32, "H100", "2:4")
    assert requested_size({"resources": {"gpus": 16, "gpu_type": "H100", "nnodes": "2"}}) == (
        16,
        "H100",
        2,
    )
    assert select_profile(8, "H100", "1:1").work_pool == GPU_POOL


@pytest.mark.parametrize("nnodes", ["4:2", "0:2", "2:", ":4", "a:b", "1:2:3", "", "two", 0, -1])
def test_malformed_node_counts_are_refused_naming_nnodes(nnodes):
    with pytest.raises(ProfileError, match="nnodes"):
        select_profile(16, "H100", nnodes)


@pytest.mark.parametrize(("gpu_type", "nnodes"), [("cpu", 2), (None, "2:4"), ("CPU", 3)])
def test_multi_node_cpu_runs_are_refused_naming_the_fields(gpu_type, nnodes):
    with pytest.raises(ProfileError, match=r"nnodes=.* with gpu_type=.*need a GPU type"):
        select_profile(12, gpu_type, nnodes)


def test_docs_show_the_service_that_service_manifest_builds():
    text = (REPO_ROOT / "docs" / "kubernetes.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    (service,) = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "Service"]
    assert service == service_manifest(service["metadata"]["namespace"])
    assert "prefect work-pool create k8s-gpu-multinode --type kubernetes" in text


def test_command_line_prints_the_manifests_as_yaml(capsys):
    out = io.StringIO()
    with redirect_stdout(out):
        profiles.main(["service", "--namespace", "ml"])
    assert list(yaml.safe_load_all(out.getvalue())) == [service_manifest("ml")]
    out = io.StringIO()
    with redirect_stdout(out):
        profiles.main(["manifests", "--gpus", "16", "--gpu-type", "H100", "--nnodes", "2"])
    assert list(yaml.safe_load_all(out.getvalue())) == render_manifests(
        select_profile(16, "H100", 2)
    )
    with pytest.raises(SystemExit) as exit_info:
        profiles.main(["manifests", "--gpus", "4", "--gpu-type", "cpu", "--nnodes", "2"])
    assert exit_info.value.code == 2
    assert "multi-node runs need a GPU type" in capsys.readouterr().err


def test_prefect_kubernetes_worker_accepts_the_single_node_template():
    worker = pytest.importorskip("prefect_kubernetes.worker")
    profile = select_profile(8, "H100", 1)
    template = load_job_template(profile.work_pool)
    config = asyncio.run(
        worker.KubernetesWorkerJobConfiguration.from_template_and_values(
            template, {**profile.job_variables, "namespace": "ml"}, client=object()
        )
    )
    container = config.job_manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 8}


def test_every_pod_keeps_runs_on_the_shared_volume_a_claim_makes_shared():
    """By default each pod's /shared is its own; given a ReadWriteMany claim, every pod mounts
    it and keeps a run's folder there (TRAINFLOW_OUTPUT_ROOT), so the nodes' checkpoint shards
    land in one folder and a resumed run on other pods finds them. An object store URI
    replaces the folder the same way."""
    profile = select_profile(16, "H100", 2)
    claim = {"name": "shared", "persistentVolumeClaim": {"claimName": "team-rwx"}}
    job, _ = render_manifests(profile, shared_volume=claim)
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(job, version, strict=True)
    _, pod, container = _pod(job)
    assert claim in pod["volumes"]
    assert {"name": "shared", "mountPath": "/shared"} in container["volumeMounts"]
    assert _expand(container["env"])["TRAINFLOW_OUTPUT_ROOT"] == "/shared/outputs"
    default_job, _ = render_manifests(profile)
    assert {"name": "shared", "emptyDir": {}} in _pod(default_job)[1]["volumes"]
    bucket, _ = render_manifests(profile, output_root="s3://team/runs")
    assert _expand(_pod(bucket)[2]["env"])["TRAINFLOW_OUTPUT_ROOT"] == "s3://team/runs"
