"""`--dry-run`: plan a run without its GPUs, its hub or its servers, and say whether it fits.

    plan = plan_run(PIPELINES["sft"], config, deployment=("sft/gpt-oss-120b", "k8s-gpu"))
    print(plan.text())          # placement, memory per candidate, data, checkpoints, where
    plan.fits                   # False: `plan.problems` names what does not fit

Everything here is a check that needs neither the run's GPUs nor the network: the config, its
files and names, the memory estimate (model shapes from `memory.KNOWN_MODELS` or a local
config), the data already prepared. Nothing starts: no Prefect server, no MLflow run, no rank.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainflow.launch.plan import ResourceError, cluster_plan, node_range, plan_launch
from trainflow.pipelines import PipelineSpec


@dataclass
class RunPlan:
    """What a run would do, line by line, and what would stop it."""

    pipeline: str
    sections: dict[str, list[str]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return not self.problems

    def add(self, section: str, line: str) -> None:
        self.sections.setdefault(section, []).append(line)

    def text(self) -> str:
        out = [f"dry run of {self.pipeline}: nothing was started"]
        for section, lines in self.sections.items():
            out.append(f"{section}:")
            out.extend(f"  {line}" for line in lines)
        verdict = "the run would fit" if self.fits else "the run would NOT fit"
        out.append(f"verdict: {verdict}")
        out.extend(f"  - {problem}" for problem in self.problems)
        return "\n".join(out)

    def markdown(self) -> str:
        out = [f"# Dry run of {self.pipeline}", ""]
        for section, lines in self.sections.items():
            out += [f"## {section}", "", *(f"- {line}" for line in lines), ""]
        out += ["## Verdict", "", "The run would fit." if self.fits else "The run would NOT fit:"]
        out += [f"- {problem}" for problem in self.problems]
        return "\n".join(out) + "\n"


def plan_run(
    spec: PipelineSpec,
    config: Any,
    *,
    deployment: tuple[str, str | None] | None = None,
    detect: bool = True,
) -> RunPlan:
    """The plan of `spec`'s run with `config`.

    Args:
        spec: The pipeline.
        config: Its validated config.
        deployment: The deployment and work pool the config's preset is deployed as, if any.
        detect: Ask `nvidia-smi` for this machine's GPUs (tests pass False).
    """
    plan = RunPlan(spec.name)
    resolve = spec.startup_hook("resolve")  # a framework's file gives the model
    if resolve is not None:
        try:
            config = resolve(config)
        except ValueError as exc:
            plan.problems.append(str(exc))
            return plan
    _placement(plan, config)
    _technique(plan, spec, config, detect)
    _checks(plan, spec, config)
    _data(plan, config)
    _checkpoints(plan, config)
    _where(plan, spec, deployment)
    return plan


def _placement(plan: RunPlan, config: Any) -> None:
    try:
        low, high = node_range(config.nnodes)
        target = cluster_plan(config.gpus, config.gpu_type, config.nnodes, "the run's machines")
    except ResourceError as exc:
        plan.problems.append(str(exc))
        return
    kind = "CPU ranks" if target.device == "cpu" else f"{config.gpu_type} GPUs"
    nodes = f"{low}-{high}" if low != high else str(high)
    plan.add("placement", f"{nodes} node(s) x {target.nproc_per_node} rank(s) of {kind}")
    try:
        here = plan_launch(config.gpus, config.gpu_type, config.nnodes, config.ray_address)
        where = "a Ray cluster" if here.cluster else "this machine"
        plan.add("placement", f"{where} can run it ({here.world_size} {here.device} ranks)")
    except ResourceError as exc:
        plan.add("placement", f"not on this machine ({exc}); the plan is for the run's machines")


def _technique(plan: RunPlan, spec: PipelineSpec, config: Any, detect: bool) -> None:
    technique = getattr(config, "technique", None)
    if technique is None:
        return
    if not hasattr(technique, "describe"):  # a framework trains with its own settings
        plan.add("technique", f"{technique.title}'s own, from {config.framework_config}")
        plan.add("technique", "memory per GPU: the framework's config decides; not estimated")
        return
    plan.add("technique", f"requested: {technique.describe()}")
    if hasattr(config, "training_setup") and hasattr(config, "model"):
        _memory(plan, config, detect)
    else:
        plan.add("technique", "memory per GPU: not estimated for this workload (a small model)")


def _memory(plan: RunPlan, config: Any, detect: bool) -> None:
    from trainflow.memory import (
        MemoryFitError,
        auto_candidates,
        available_memory,
        estimate,
        fits,
        model_shape,
        plan_sft,
    )

    try:
        shape = model_shape(config.model, config.tokenizer_path())
    except MemoryFitError as exc:
        plan.add("technique", f"memory per GPU: not estimated ({exc})")
        return
    setup = config.training_setup()
    available = available_memory(config.gpu_memory_gb, config.gpu_type, detect=detect)
    plan.add("technique", f"model: {shape.describe()}; available: {available.describe()}")
    candidates = auto_candidates(config.compute_precision(), setup.activation_checkpointing)
    if config.technique.name != "auto":
        candidates = [config.technique] + [
            c for c in candidates if c.describe() != config.technique.describe()
        ]
    for candidate in candidates:
        found = estimate(shape, setup, candidate)
        verdict = "fits" if fits(found, available) else "does not fit"
        if available.gb is None:
            verdict = "not checked"
        mark = "requested" if candidate is config.technique else "candidate"
        plan.add("technique", f"{mark} {found.technique}: {found.breakdown()}: {verdict}")
    try:
        chosen = plan_sft(config, detect=detect)
    except MemoryFitError as exc:
        plan.problems.append(str(exc))
        return
    if config.technique.name == "auto":
        plan.add("technique", f"auto -> {chosen.technique.describe()}")


def _checks(plan: RunPlan, spec: PipelineSpec, config: Any) -> None:
    """The pipeline's own checks that need no GPU and no network."""
    if spec.checks is not None and (not hasattr(config, "model") or _local_model(config)):
        _run_check(plan, "config, files and names", spec.check(), config)
        return
    check_files = spec.startup_hook("check_files")
    if check_files is not None:
        _run_check(plan, "data files", check_files, config)
    if spec.checks is None:
        plan.add("checks", "config: valid (the workload has no further checks)")
    else:
        plan.add("checks", "model names: checked at launch (the model's config is on the hub)")


def _local_model(config: Any) -> bool:
    model = str(getattr(config, "model", ""))
    return model.startswith("tiny-") or Path(model).is_dir()


def _run_check(plan: RunPlan, what: str, check: Any, config: Any) -> None:
    try:
        check(config)
    except ValueError as exc:
        plan.problems.append(f"{what}: {exc}")
        return
    plan.add("checks", f"{what}: passed")


def _data(plan: RunPlan, config: Any) -> None:
    make = getattr(config, "data_config", None)
    if make is None:
        plan.add("data", "generated by the workload on each rank")
        return
    try:
        data = make()
    except TypeError:  # made from files a step of the flow generates first (detection)
        plan.add("data", "generated by the flow, then prepared as MDS shards")
        return
    plan.add("data", f"source: {_describe_source(data.source)}")
    published = _published(data)
    if published is None:
        plan.add("data", "not prepared yet: the flow prepares it as MDS shards first")
        return
    for split, info in published.splits.items():
        shards = _shards(published.uri, split)
        plan.add(
            "data",
            f"{split}: {info.num_samples} rows, {shards} shard(s), "
            f"{info.num_bytes / 2**20:.1f} MiB (prepared: {published.uri})",
        )


def _describe_source(source: Any) -> str:
    if getattr(source, "kind", None) == "hub":
        return f"hub dataset {source.name} (rows known once it is downloaded)"
    parts = []
    for split, files in source.files.items():
        rows = sum(_count_rows(Path(f)) for f in files)
        parts.append(f"{split}: {len(files)} file(s), {rows} rows")
    return "local files; " + "; ".join(parts)


def _count_rows(path: Path) -> int:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(path).metadata.num_rows)
    with path.open("rb") as f:
        lines = sum(1 for line in f if line.strip())
    return lines - 1 if path.suffix == ".csv" else lines


def _published(data: Any) -> Any:
    from trainflow.data.prepare import find_published

    try:
        return find_published(data)
    except Exception:  # a hub tokenizer offline, an unreadable store: said as not prepared
        return None


def _shards(uri: str, split: str) -> int | str:
    from trainflow.data.store import read_index

    index = read_index(uri, split)
    return "?" if index is None else len(json.loads(index).get("shards", []))


def _checkpoints(plan: RunPlan, config: Any) -> None:
    every = getattr(config, "checkpoint_every", None)
    if every is None:
        return
    keep = getattr(config, "keep_checkpoints", None)
    if every == 0:
        plan.add("checkpoints", "none: a crash restarts from step 0")
        return
    steps = _steps(config)
    total = f" of {steps}" if steps else ""
    plan.add("checkpoints", f"every {every} step(s){total}, at the end and on a stop; keep {keep}")


def _steps(config: Any) -> int | None:
    for holder in (config, getattr(config, "training", None)):
        for name in ("max_steps", "num_steps"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def _where(plan: RunPlan, spec: PipelineSpec, deployment: tuple[str, str | None] | None) -> None:
    local = f"python -m flows.{spec.name}: a temporary local Prefect server, no work pool"
    if deployment is None:
        plan.add("where", local)
        return
    name, pool = deployment
    plan.add("where", f"deployment {name} on work pool {pool or '(none)'}; or {local}")
