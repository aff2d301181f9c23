"""Hyperparameter sweep: many trials of one pipeline under a rank budget, the best promoted.

    python -m flows.sweep mlp --space '{"learning_rate": {"log_uniform": [1e-4, 1e-2]}}' \\
        --trials 8 --metric eval_mse --mode min --budget 4
    python -m flows.sweep sft --space '{"training.optimizer.learning_rate": \\
        {"log_uniform": [1e-5, 1e-3]}, "lora_settings.r": [8, 16]}' \\
        --trials 12 --metric eval_loss --mode min --pruner median
    python -m flows.sweep --resume SWEEP_RUN_ID      # continue a stopped sweep
    python -m flows.sweep --help

Each trial is a subflow run of the pipeline and a child of the sweep's MLflow run. Training
holds the trial's ranks in the Prefect global concurrency limit `--pool` (sized `--budget`),
so sweeps and runs sharing the pool never start more ranks than it has. The best trial's
model gets `--alias` (champion) only when it passed the pipeline's own gate. See
docs/sweeps.md.

Deploy: `prefect --no-prompt deploy --name sweep/cpu-local` (see prefect.yaml).
"""

import concurrent.futures
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any, cast

import optuna
from prefect import flow
from prefect.futures import PrefectConcurrentFuture, PrefectFuture
from prefect.runtime import flow_run
from prefect.task_runners import ThreadPoolTaskRunner
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from flows.skeleton import PipelineResult
from tasks.sweep import (
    cancel_trials,
    ensure_rank_pool,
    pipeline_flow,
    publish_trials,
    run_trial,
)
from trainflow import storage, tracking
from trainflow import sweep as space_lib
from trainflow.cli import run_pipeline
from trainflow.configs.base import check_resume_config
from trainflow.paths import (
    RUN_CONFIG_FILE,
    STOP_FILE,
    SafeName,
    run_output_dir,
)
from trainflow.pipelines import PIPELINES, pipeline

# Tag on a trial's MLflow run the sweep ended itself (a pruned trial).
TRIAL_STATE_TAG = "trainflow.sweep.trial_state"
# What a sweep may not change when it is resumed: they define its study.
_STUDY_FIELDS = ("pipeline", "space", "base", "sampler", "seed", "metric", "mode")


def _registered(name: str) -> str:
    pipeline(name)  # ValueError naming the registered pipelines
    return name


# Any pipeline of `trainflow.pipelines`; the UI lists them.
Pipeline = Annotated[
    str, AfterValidator(_registered), Field(json_schema_extra={"enum": list(PIPELINES)})
]

# How long a stopped sweep waits for its trials to checkpoint and end before it exits.
STOP_WAIT_S = 120.0


class SweepConfig(BaseModel):
    """The pipeline, the space searched, how trials are chosen and stopped, the rank budget."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    pipeline: Pipeline = Field(
        "mlp", description="Pipeline every trial runs (its flow in flows/; any registered one)."
    )
    space: space_lib.SearchSpace = Field(
        default_factory=dict,
        description='Dotted config field -> a list of values, or {"log_uniform": [lo, hi]}, '
        '{"uniform": [lo, hi]}, {"int": [lo, hi]}; e.g. {"learning_rate": [1e-3, 3e-3]}.',
    )
    base: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the pipeline shared by every trial (as in its --config file); "
        "its own defaults for the rest.",
    )
    trials: int = Field(12, ge=1, description="Trials in all (a grid runs at most its size).")
    metric: str | None = Field(
        None,
        description="Metric of the pipeline's result to optimise; none: the pipeline's own "
        "(mlp eval_mse, sft eval_loss, two_tower eval_auroc, ...).",
    )
    mode: space_lib.Mode | None = Field(
        None,
        description="Whether a lower or higher metric is better; none: the pipeline's own "
        "for its metric.",
    )
    sampler: space_lib.Sampler = Field(
        "tpe", description="grid: every combination; random; tpe: Optuna's TPE."
    )
    seed: int = Field(0, description="Seed of the sampler.")
    pruner: space_lib.Pruner = Field(
        "none",
        description="Stop poor trials early from their logged intermediate metric: median "
        "(worse than the median at that step) or asha (successive halving); none.",
    )
    prune_metric: str = Field(
        "train_loss", description="Intermediate metric the ranks log that the pruner reads."
    )
    prune_mode: space_lib.Mode = Field(
        "min", description="Whether a lower or higher intermediate metric is better."
    )
    prune_startup_trials: int = Field(
        2, ge=0, description="Median pruner: trials that finish before any is pruned."
    )
    prune_warmup_steps: int = Field(
        0, ge=0, description="Steps a trial runs before it can be pruned (ASHA: first rung)."
    )
    budget: int = Field(
        2,
        ge=1,
        description="Ranks (GPUs, or CPU processes) the pool runs at once; the pool's "
        "size is set to it.",
    )
    pool: str = Field(
        "gpus", description="Prefect global concurrency limit the trials' training holds."
    )
    parallel: int | None = Field(
        None,
        ge=1,
        description="Trials in flight at once (training, waiting for ranks, or evaluating). "
        "None: what the budget trains at once plus one, so one trial's start-up and "
        "registration overlap another's training.",
    )
    keep_versions: bool = Field(
        True,
        description="Keep the other trials' registered models (without the alias); "
        "--no-keep-versions deletes those versions at the end.",
    )
    alias: SafeName = Field("champion", description="Alias the best passing trial's model gets.")
    poll_s: float = Field(
        2.0, gt=0, description="Seconds between looks at the running trials' metrics."
    )
    resume: SafeName | None = Field(
        None,
        description="MLflow run id of a stopped sweep: continue it; its finished trials are "
        "not run again, the ones it was running start over.",
    )

    def training_fields(self) -> dict[str, Any]:
        """What defines the study: a resumed sweep keeps these (`check_resume_config`)."""
        return self.model_dump(mode="json", include=set(_STUDY_FIELDS))

    def trial_config(self, params: dict[str, Any] | None = None) -> Any:
        """A trial's validated pipeline config: `base`, the trial's values, nothing else."""
        merged = space_lib.with_params(self.base_config().model_dump(), params or {})
        return space_lib.config_class(self.pipeline).model_validate(merged)

    def base_config(self) -> Any:
        """`base` over the pipeline's defaults (its default preset), as its config."""
        return space_lib.start_config(self.pipeline, self.base)

    @property
    def objective(self) -> tuple[str, space_lib.Mode]:
        """The metric optimised and its direction (the pipeline's own unless given)."""
        spec = PIPELINES[self.pipeline]
        if self.metric is None:
            return spec.sweep_metric, self.mode or spec.sweep_mode
        if self.mode is None and self.metric == spec.sweep_metric:
            return self.metric, spec.sweep_mode
        return self.metric, self.mode or "min"

    @property
    def ranks_per_trial(self) -> int:
        return int(self.base_config().gpus)

    @property
    def target(self) -> str:
        return self.objective[0]

    @property
    def direction(self) -> space_lib.Mode:
        return self.objective[1]

    @model_validator(mode="after")
    def _check(self) -> "SweepConfig":
        self.metric, self.mode = self.objective
        base = self.base_config()
        if self.space:
            space_lib.check_space(type(base), base.model_dump(), self.space, self.sampler)
        if base.gpus > self.budget:
            raise ValueError(
                f"a trial takes gpus={base.gpus} ranks but the budget is {self.budget}: "
                "no trial could ever start"
            )
        return self


class SweepResult(PipelineResult):
    """The sweep's MLflow run and the best trial: its model version, alias and metrics."""

    best_trial: int | None = Field(description="Number of the best complete trial, if any.")
    num_complete: int = Field(description="Trials that finished with a metric.")
    num_pruned: int = Field(description="Trials the pruner stopped early.")
    num_failed: int = Field(description="Trials that failed.")
    failures: list[str] = Field(
        default_factory=list, description="How each failed trial failed (`trial N: error`)."
    )


# Prefect types the decorator's `task_runner` as a `TaskRunner[PrefectFuture]`, an invariant
# parameter its own `ThreadPoolTaskRunner` (of `PrefectConcurrentFuture`s) does not match.
@flow(name="sweep", log_prints=True, task_runner=ThreadPoolTaskRunner(max_workers=64))  # type: ignore[arg-type]
def sweep(config: SweepConfig = SweepConfig()) -> SweepResult:
    """Run trials of one pipeline under a rank budget; promote the best that passes its gate."""
    if not config.space:
        raise ValueError("space is empty: give at least one field to search (--space)")
    base = config.trial_config()
    pipeline_flow(config.pipeline)  # imported here, before trial threads need it
    ensure_rank_pool(config.pool, config.budget)
    with tracking.pipeline_run(
        base.experiment_name,
        run_name=f"sweep-{config.pipeline}-{flow_run.get_name() or 'local'}",
        params=config.model_dump(exclude={"resume"}),
        tags={"trainflow.sweep": config.pipeline, "prefect_flow_run_id": str(flow_run.get_id())},
        resume_run_id=config.resume,
    ) as parent:
        folder = run_output_dir("sweep", parent)
        _save_config(config, parent)
        print(
            f"sweep {parent} (MLflow experiment {base.experiment_name!r}); if it stops, "
            f"continue it with: python -m flows.sweep --resume {parent}"
        )
        study = space_lib.open_study(
            folder,
            parent,
            config.direction,
            space_lib.make_sampler(config.sampler, config.seed),
            space_lib.make_pruner(
                config.pruner, config.prune_startup_trials, config.prune_warmup_steps
            ),
        )
        if config.sampler == "grid":
            space_lib.enqueue_grid(study, config.space)
        if requeued := space_lib.requeue_interrupted(study):
            print(f"trials {requeued} were running when the sweep stopped: they start over")
        _Trials(config, parent, study).run()
        return _promote(config, base, parent, study)


def _save_config(config: SweepConfig, parent: str) -> None:
    """Keep the sweep's config beside its study (what `--resume` starts from); refuse a resume
    that changes what the study searches."""
    path = run_output_dir("sweep", parent) / RUN_CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    if config.resume and path.exists():
        check_resume_config("sweep", config, parent)
    path.write_text(json.dumps(config.model_dump(mode="json", exclude={"resume"}), indent=2))


def first_done(
    futures: list[PrefectConcurrentFuture[Any]], timeout_s: float
) -> set[PrefectConcurrentFuture[Any]]:
    """The futures that are done, once one is or `timeout_s` has passed.

    Not `prefect.futures.wait(..., timeout=...)`: in the main thread, its timeout is a SIGALRM
    that can land while the waiting thread takes its lock back, and the wait then fails
    ('release unlocked lock') instead of returning. A stopped sweep waits on its trials that
    way, and a Ctrl-C once ended in that error and exit status 1 instead of 130.
    """
    by_inner = {future.wrapped_future: future for future in futures}
    done, _ = concurrent.futures.wait(
        by_inner, timeout=timeout_s, return_when=concurrent.futures.FIRST_COMPLETED
    )
    return {by_inner[inner] for inner in done}


class _Trials:
    """The sweep's loop: keep trials in flight, feed the pruner, record how each ended."""

    def __init__(self, config: SweepConfig, parent: str, study: optuna.Study):
        self.config, self.parent, self.study = config, parent, study
        self.keys = list(config.space)
        self.in_flight: dict[int, tuple[optuna.Trial, PrefectConcurrentFuture[Any]]] = {}
        self.run_ids: dict[int, str] = {}
        self.reported: dict[int, set[int]] = {}
        self.pruning: set[int] = set()
        at_once = max(1, config.budget // config.ranks_per_trial)
        self.parallel = config.parallel or at_once + 1
        wanted = config.trials
        if config.sampler == "grid":
            wanted = min(wanted, space_lib.grid_size(config.space))
        self.wanted = wanted

    def run(self) -> None:
        self.publish()
        try:
            while True:
                self.start_trials()
                if not self.in_flight:
                    return
                futures = [future for _, future in self.in_flight.values()]
                self.watch(first_done(futures, self.config.poll_s))
        except BaseException as exc:
            # Stopped (Ctrl-C, SIGTERM, a cancel): stop the trials as a preemption would (a
            # checkpoint, their runs KILLED) and leave them RUNNING in the study, so a resume
            # starts them over. A trial not yet training stops as soon as its ranks start.
            # Their flow runs end Cancelled, as the sweep's does.
            pending = dict(self.in_flight)
            stopped = {number: future for number, (_, future) in pending.items()}
            deadline = time.monotonic() + STOP_WAIT_S
            while pending and time.monotonic() < deadline:
                for number in pending:
                    self.stop(number)
                done = first_done([future for _, future in pending.values()], 1.0)
                for number, (trial, future) in list(pending.items()):
                    if future in done:
                        del pending[number]
                        if future.state.is_completed():  # it ended before the stop: keep it
                            self.finish(number, trial, future)
                            del stopped[number]
            if stopped:
                why = f"The sweep was stopped ({type(exc).__name__}), and this trial with it."
                try:
                    cancel_trials(stopped, why)
                except Exception as error:  # noqa: BLE001 - the stop is what to raise
                    print(f"trials {sorted(stopped)} stay as Prefect saw them end: {error}")
            raise

    def stop(self, number: int) -> bool:
        """Ask trial `number`'s training to stop (its stop file); False before its run exists.

        The launch sees the file within a second, the ranks checkpoint and end, and the trial's
        pipeline raises `StopRequested` (not retried), which ends its MLflow run KILLED.
        """
        run_id = self.run_id(number)
        if run_id is None:
            return False
        # The trial may not have made its output folder yet: it finds the file when it does.
        folder = self.trial_folder(run_id)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / STOP_FILE).touch()
        return True

    def start_trials(self) -> None:
        while (
            len(self.in_flight) < self.parallel
            and space_lib.counted(self.study) + len(self.in_flight) < self.wanted
        ):
            trial = self.study.ask()
            params = space_lib.suggest(trial, self.config.space)
            trial_config = self.config.trial_config(params).model_copy(
                update={"parent_run_id": self.parent, "gpu_pool": self.config.pool}
            )
            trial.set_user_attr(space_lib.STARTED, time.time())
            print(f"trial {trial.number} starts: {params}")
            # The sweep's task runner is a thread pool: its futures are concurrent ones.
            future = cast(
                PrefectConcurrentFuture[Any],
                run_trial.submit(self.config.pipeline, trial.number, trial_config),
            )
            self.in_flight[trial.number] = (trial, future)

    def watch(self, done: set[PrefectConcurrentFuture[Any]]) -> None:
        """Report new intermediate values, prune what the pruner says, record finished ones."""
        if self.config.pruner != "none":
            for number, (trial, future) in self.in_flight.items():
                if number in self.pruning or future in done:
                    continue
                self.report(number, trial)
                if trial.should_prune() and self.training(number):
                    print(f"trial {number} pruned: its {self.config.prune_metric} is behind")
                    if self.stop(number):
                        self.pruning.add(number)
        ended = [n for n, (_, future) in self.in_flight.items() if future in done]
        for number in ended:
            self.finish(number, *self.in_flight.pop(number))
        if ended:
            self.publish()

    def run_id(self, number: int) -> str | None:
        """The trial's MLflow run (found by its flow run name) once it exists."""
        if number not in self.run_ids:
            suffix = f"-trial-{number}"
            for name, run_id in tracking.child_runs(self.parent).items():
                if name.endswith(suffix):
                    self.run_ids[number] = run_id
        return self.run_ids.get(number)

    def trial_folder(self, run_id: str) -> Path:
        """A trial's run folder on this machine (its `output_root`, which `base` may set)."""
        root = getattr(self.config.base_config(), "output_root", None)
        return storage.local_run_dir(self.config.pipeline, run_id, root)

    def training(self, number: int) -> bool:
        """Whether the trial's ranks are still at work (its progress is under 100%)."""
        run_id = self.run_id(number)
        if run_id is None:
            return False
        done = tracking.read_progress(self.trial_folder(run_id) / tracking.PROGRESS_FILE)
        return done is not None and done < 100.0

    def report(self, number: int, trial: optuna.Trial) -> None:
        """Pass the intermediate values the ranks logged since the last look to the pruner."""
        run_id = self.run_id(number)
        if run_id is None:
            return
        seen = self.reported.setdefault(number, set())
        # The pruner compares in the study's direction; flip a metric that goes the other way.
        sign = 1.0 if self.config.prune_mode == self.config.direction else -1.0
        for step, value in sorted(
            tracking.metric_history(run_id, self.config.prune_metric).items()
        ):
            if step not in seen:
                trial.report(sign * value, step)
                seen.add(step)

    def finish(self, number: int, trial: optuna.Trial, future: PrefectFuture[Any]) -> None:
        """Record how the trial ended: complete with its metric, pruned, or failed."""
        run_id = self.run_id(number)
        if run_id:
            trial.set_user_attr(space_lib.RUN_ID, run_id)
        trial.set_user_attr(space_lib.ENDED, time.time())
        try:
            result: PipelineResult = future.result()
        except BaseException as exc:
            if number in self.pruning:
                if run_id:
                    tracking.end_run(run_id, "KILLED", {TRIAL_STATE_TAG: "pruned"})
                self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                print(f"trial {number} stopped early (pruned)")
                return
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            trial.set_user_attr(space_lib.ERROR, message[:500])
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            print(f"trial {number} failed: {message}")
            return
        if run_id is not None and self.config.pruner != "none":
            self.report(number, trial)
        trial.set_user_attr(space_lib.VERSION, result.model_version)
        trial.set_user_attr(space_lib.PASSED, result.champion)
        value = result.metrics.get(self.config.target)
        if value is None:
            have = ", ".join(sorted(result.metrics))
            trial.set_user_attr(space_lib.ERROR, f"no metric {self.config.target!r} (has {have})")
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return
        self.study.tell(trial, value)
        print(f"trial {number} complete: {self.config.target} {value:.4g}")

    def publish(self) -> None:
        rows = space_lib.trial_rows(self.study)
        metric = self.config.target
        publish_trials(
            key=f"sweep-{self.config.pipeline.replace('_', '-')}-trials",
            title=f"Sweep of {self.config.pipeline}: {len(rows)} trials",
            table=space_lib.markdown_table(rows, metric, self.keys),
            figure=space_lib.metric_plot(rows, metric, self.keys),
        )


def _promote(config: SweepConfig, base: Any, parent: str, study: optuna.Study) -> SweepResult:
    """Give the alias to the best trial's model if it passed the gate; log the sweep's outcome."""
    rows = space_lib.trial_rows(study)
    best = space_lib.best_row(rows, config.direction)
    name = base.registered_model_name
    promoted = best is not None and best.passed_gate and best.model_version is not None
    if best is not None and best.model_version and promoted:
        tracking.set_alias(name, best.model_version, config.alias)
        print(f"trial {best.number} is the best: {name} v{best.model_version} is {config.alias}")
    elif best is not None:
        print(f"trial {best.number} is the best but did not pass the gate: no {config.alias}")
    if not config.keep_versions:
        for row in rows:
            if row.model_version and (best is None or row.number != best.number):
                tracking.delete_model_version(name, row.model_version)
    states = [r.state for r in rows]
    summary = {
        "num_complete": states.count("complete"),
        "num_pruned": states.count("pruned"),
        "num_failed": states.count("failed"),
    }
    metrics: dict[str, float] = {}
    if best is not None and best.value is not None:
        metrics[f"best_{config.target}"] = best.value
    tracking.log_metrics(parent, {**metrics, **{k: float(v) for k, v in summary.items()}})
    tracking.log_figure(
        parent, space_lib.metric_plot(rows, config.target, list(config.space)), "sweep.png"
    )
    return SweepResult(
        mlflow_run_id=parent,
        technique=base.technique.name,
        registered_model_name=name,
        model_version=best.model_version if best else None,
        champion=promoted,
        alias=config.alias if promoted else None,
        prefect_flow_run_id=str(flow_run.get_id()),
        checkpoint_uri=None,
        metrics=metrics,
        tracking_uri=tracking.tracking_uri(),
        best_trial=best.number if best else None,
        failures=[f"trial {r.number}: {r.error}" for r in rows if r.state == "failed"],
        **summary,
    )


def main(argv: list[str] | None = None) -> SweepResult:
    from flows.local_server import starting_prefect_server

    args = list(sys.argv[1:] if argv is None else argv)
    if args and not args[0].startswith("-"):
        args = ["--pipeline", *args]  # the pipeline may come first, as a word
    result: SweepResult = run_pipeline(
        sweep, SweepConfig(), args, __doc__, server=starting_prefect_server
    )
    if result.num_complete == 0:
        why = "; ".join(result.failures) or "every trial was pruned or stopped"
        print(f"python -m flows.sweep: error: no trial succeeded: {why}", file=sys.stderr)
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    from trainflow.cli import exit_now

    main(sys.argv[1:])
    exit_now()  # the pipeline is done: skip only the interpreter's teardown
