"""Hardware profiles: which work pool and job variables run a pipeline at a given size.

A pipeline's `gpus`, `gpu_type` and `nnodes` pick the profile before the run starts, so the
flow run lands on machines that have the GPUs it asks for:

- CPU ranks (`gpu_type` "cpu", or none given) -> the `cpu-local` process pool (one node);
- a GPU type on one node -> the `k8s-gpu` Kubernetes pool, with a GPU resource request and a
  node selector on the GPU product label (`deployments/k8s-gpu-job-template.json`);
- a GPU type on several nodes -> the `k8s-gpu-multinode` Kubernetes pool: an Indexed Job with
  one pod per node, pod 0 hosting the rendezvous under a headless Service
  (`deployments/k8s-multinode-job-template.json`, docs/kubernetes.md).

`render_manifests` renders a profile's Kubernetes objects the way the worker does, to inspect
or validate them; `python -m deployments.profiles --help` prints them.
"""

import argparse
import copy
import json
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CPU_POOL = "cpu-local"
GPU_POOL = "k8s-gpu"
MULTINODE_POOL = "k8s-gpu-multinode"
# Node labels as set by NVIDIA's GPU feature discovery (`nvidia.com/gpu.product`).
GPU_PRODUCTS = {
    "H100": "NVIDIA-H100-80GB-HBM3",
    "H200": "NVIDIA-H200",
    "A100": "NVIDIA-A100-SXM4-80GB",
    "A10": "NVIDIA-A10G",
    "L4": "NVIDIA-L4",
}

DEPLOYMENTS_DIR = Path(__file__).resolve().parent
# Base job template of each Kubernetes pool (`prefect work-pool create --base-job-template`).
JOB_TEMPLATES = {
    GPU_POOL: DEPLOYMENTS_DIR / "k8s-gpu-job-template.json",
    MULTINODE_POOL: DEPLOYMENTS_DIR / "k8s-multinode-job-template.json",
}
# Pod label that the multi-node template sets to its `service_name`; the headless Service
# selects on it, so one Service serves every multi-node run of its namespace.
SERVICE_LABEL = "trainflow.dev/rendezvous-service"
# Set in every multi-node pod from the Job controller's pod label; the rendezvous endpoint and
# run id are built from it, since Prefect's worker names the job only when it creates it.
JOB_NAME_ENV = "TRAINFLOW_K8S_JOB_NAME"
JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# What Prefect's worker puts in `command` when a deployment leaves it empty.
FLOW_RUN_COMMAND = ("prefect", "flow-run", "execute")
# Keys that Prefect's Kubernetes worker requires in the pod spec of every job template (its own
# default template has them). Kubernetes has no such pod fields: the API server drops them
# with a warning, so rendered manifests leave them out.
WORKER_ONLY_POD_KEYS = ("parallelism", "completions")

_PLACEHOLDER = re.compile(r"\{\{\s*([\w.-]+)\s*\}\}")


class ProfileError(ValueError):
    """No profile can run the requested size (raised before any run is created)."""


@dataclass(frozen=True)
class Profile:
    """Where a run goes: the deployment suffix, the work pool and its job variables."""

    deployment: str
    work_pool: str
    job_variables: dict[str, Any] = field(default_factory=dict)


def node_range(nnodes: int | str) -> tuple[int, int]:
    """`(min, max)` nodes of `nnodes`: a count (`2`, `"2"`) or an elastic range (`"2:4"`).

    Raises:
        ProfileError: anything else, or a range that is not `min:max` with 1 <= min <= max.
    """
    if isinstance(nnodes, bool):
        raise ProfileError(f"nnodes must be an integer >= 1 or 'min:max', got {nnodes!r}")
    if isinstance(nnodes, int):
        if nnodes < 1:
            raise ProfileError(f"nnodes must be >= 1, got nnodes={nnodes}")
        return nnodes, nnodes
    if isinstance(nnodes, str):
        parts = nnodes.strip().split(":")
        if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
            low, high = int(parts[0]), int(parts[-1])
            if 1 <= low <= high:
                return low, high
    raise ProfileError(
        f"nnodes={nnodes!r}: expected a node count >= 1 or an elastic range 'min:max' "
        "with 1 <= min <= max (e.g. '2:4')"
    )


def requested_size(config: dict[str, Any]) -> tuple[int, str | None, int | str]:
    """`(gpus, gpu_type, nnodes)` of a pipeline config, flat or under `resources`.

    `nnodes` stays a string when it is an elastic range ("2:4"); `select_profile` checks it.
    """
    section = config.get("resources", config)
    nnodes = section.get("nnodes", 1)
    if not (isinstance(nnodes, str) and ":" in nnodes):
        nnodes = node_range(nnodes)[1]
    return int(section.get("gpus", 2)), section.get("gpu_type"), nnodes


def select_profile(gpus: int, gpu_type: str | None, nnodes: int | str = 1) -> Profile:
    """Pick the profile for a run of `gpus` ranks of `gpu_type` over `nnodes` nodes.

    `nnodes` may be an elastic range "min:max"; the job is then sized for `max` nodes and
    `gpus` counts the ranks at `max` nodes.

    Raises:
        ProfileError: unknown GPU type, counts that do not divide, a malformed `nnodes`, or
            several nodes of CPU ranks.
    """
    _, max_nodes = node_range(nnodes)
    if gpus < 1:
        raise ProfileError(f"gpus and nnodes must be >= 1, got gpus={gpus}, nnodes={nnodes}")
    if gpus % max_nodes:
        raise ProfileError(f"gpus={gpus} does not divide evenly across nnodes={max_nodes}")
    if gpu_type is None or gpu_type.lower() == "cpu":
        if max_nodes > 1:
            raise ProfileError(
                f"nnodes={nnodes!r} with gpu_type={gpu_type!r}: multi-node runs need a GPU "
                f"type (gpu_type, one of {', '.join(GPU_PRODUCTS)}); CPU ranks run on one "
                "node of the cpu-local pool (nnodes=1)"
            )
        return Profile("cpu-local", CPU_POOL)
    key = gpu_type.upper()
    if key not in GPU_PRODUCTS:
        raise ProfileError(
            f"gpu_type={gpu_type!r} has no hardware profile; known: {', '.join(GPU_PRODUCTS)}"
        )
    sizing = {
        "gpus_per_node": gpus // max_nodes,
        "node_selector": {"nvidia.com/gpu.product": GPU_PRODUCTS[key]},
    }
    if max_nodes == 1:
        return Profile(key.lower(), GPU_POOL, sizing)
    return Profile(f"{key.lower()}-multinode", MULTINODE_POOL, {"nnodes": max_nodes, **sizing})


def load_job_template(work_pool: str) -> dict[str, Any]:
    """The base job template of a Kubernetes work pool (`job_configuration` + `variables`)."""
    if work_pool not in JOB_TEMPLATES:
        raise ProfileError(
            f"work pool {work_pool!r} has no Kubernetes job template; known: "
            f"{', '.join(JOB_TEMPLATES)}"
        )
    return json.loads(JOB_TEMPLATES[work_pool].read_text())


def service_manifest(
    namespace: str = "default", name: str = "trainflow-multinode", port: int = 29400
) -> dict[str, Any]:
    """The headless Service that gives each multi-node pod a DNS name.

    Created once per namespace and shared by every multi-node run there: it selects all pods
    carrying `SERVICE_LABEL=name`, and each pod `<job>-<index>` of a run is then reachable as
    `<job>-<index>.<name>.<namespace>.svc.<cluster domain>`. Unready pods are published too,
    so pod 0 resolves as soon as it has an address.
    """
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"app.kubernetes.io/part-of": "trainflow"},
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {SERVICE_LABEL: name},
            "ports": [{"name": "rendezvous", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def render_manifests(
    profile: Profile,
    *,
    command: list[str] | tuple[str, ...] | str = FLOW_RUN_COMMAND,
    name: str = "trainflow",
    namespace: str = "default",
    env: dict[str, str] | None = None,
    labels: dict[str, str] | None = None,
    **variables: Any,
) -> list[dict[str, Any]]:
    """The Kubernetes objects a run of `profile` creates: the Job, then the headless Service
    (multi-node profiles only; it is shared, applied once per namespace).

    Placeholders are filled as Prefect's worker does: the template's variable defaults, then
    the profile's job variables, then `variables` (any other template variable); a value that
    is exactly "{{ x }}" becomes the value of `x` with its type. The worker then adds what only
    a flow run has (PREFECT_* variables, prefect.io labels, the generated job name); that part
    is not rendered here.

    Raises:
        ProfileError: the profile's pool has no Kubernetes template, a variable the template
            does not declare, or a placeholder left without a value.
    """
    template = load_job_template(profile.work_pool)
    schema = template["variables"]["properties"]
    given = {
        **profile.job_variables,
        **variables,
        "name": name,
        "namespace": namespace,
        "env": dict(env or {}),
        "labels": dict(labels or {}),
        "command": shlex.split(command) if isinstance(command, str) else list(command),
    }
    undeclared = sorted(set(given) - set(schema))
    if undeclared:
        raise ProfileError(
            f"{', '.join(undeclared)}: not a variable of the {profile.work_pool} job template "
            f"({JOB_TEMPLATES[profile.work_pool].name}); known: {', '.join(schema)}"
        )
    values = {k: v["default"] for k, v in schema.items() if v.get("default") is not None}
    if isinstance(values.get("env"), dict):
        given["env"] = {**values["env"], **given["env"]}
    values.update(given)
    config = _fill(template["job_configuration"], values)
    job = config["job_manifest"]
    pod = job["spec"]["template"]
    pod_spec = pod["spec"]
    for key in WORKER_ONLY_POD_KEYS:
        pod_spec.pop(key, None)
    container = pod_spec["containers"][0]
    # As the worker does: the job's `env` first, then the template's own entries it does
    # not override (those may refer to earlier ones as $(NAME)).
    env_list = [{"name": k, "value": str(v)} for k, v in config["env"].items()]
    template_env = container.get("env")
    if isinstance(template_env, list):
        env_list += [e for e in template_env if e["name"] not in config["env"]]
    container["env"] = env_list
    if isinstance(container.get("args"), str):
        container["args"] = shlex.split(container["args"])
    pod_metadata = pod.setdefault("metadata", {})
    pod_metadata["labels"] = {**pod_metadata.get("labels", {}), **config["labels"]}
    manifests = [job]
    if profile.work_pool == MULTINODE_POOL:
        manifests.append(service_manifest(namespace, values["service_name"], values["rdzv_port"]))
    return manifests


def _fill(template: Any, values: dict[str, Any]) -> Any:
    """Fill "{{ name }}" placeholders like Prefect's `apply_values`, but refuse missing values."""
    if isinstance(template, dict):
        return {k: _fill(v, values) for k, v in template.items()}
    if isinstance(template, list):
        return [_fill(v, values) for v in template]
    if not isinstance(template, str):
        return template
    names = _PLACEHOLDER.findall(template)
    missing = sorted({n for n in names if n not in values})
    if missing:
        raise ProfileError(f"no value for template variable(s) {', '.join(missing)}")
    whole = _PLACEHOLDER.fullmatch(template)
    if whole:
        return copy.deepcopy(values[whole.group(1)])
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)


def main(argv: list[str] | None = None) -> None:
    """Print a profile's manifests, or the shared headless Service, as YAML."""
    import yaml

    parser = argparse.ArgumentParser(
        prog="python -m deployments.profiles",
        description="Print the Kubernetes objects of a hardware profile as YAML.",
    )
    sub = parser.add_subparsers(dest="what", required=True)
    svc = sub.add_parser("service", help="The headless Service of multi-node runs (apply once).")
    svc.add_argument("--namespace", default="default")
    svc.add_argument("--name", default="trainflow-multinode", help="The pools' service_name.")
    svc.add_argument("--port", type=int, default=29400, help="The pools' rdzv_port.")
    man = sub.add_parser("manifests", help="The Job (and Service) of a run of this size.")
    man.add_argument("--gpus", type=int, required=True)
    man.add_argument("--gpu-type", required=True)
    man.add_argument("--nnodes", default="1", help="Node count, or an elastic range min:max.")
    man.add_argument("--namespace", default="default")
    man.add_argument("--name", default="trainflow")
    args = parser.parse_args(argv)
    try:
        if args.what == "service":
            docs = [service_manifest(args.namespace, args.name, args.port)]
        else:
            nnodes = args.nnodes if ":" in args.nnodes else node_range(args.nnodes)[1]
            profile = select_profile(args.gpus, args.gpu_type, nnodes)
            docs = render_manifests(profile, name=args.name, namespace=args.namespace)
    except ProfileError as exc:
        parser.exit(2, f"error: {exc}\n")
    sys.stdout.write(yaml.safe_dump_all(docs, sort_keys=False))


if __name__ == "__main__":
    main(sys.argv[1:])
