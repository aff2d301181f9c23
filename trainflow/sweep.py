"""Hyperparameter sweeps: the search space, how trials are sampled and pruned, the trial table.

A space maps dotted config fields (`training.optimizer.learning_rate`) to a list of values
(grid or categorical) or a range (`{"log_uniform": [1e-5, 1e-3]}`, `{"uniform": [0, 1]}`,
`{"int": [8, 64]}`). Sampling and pruning are Optuna's: grid, random and TPE samplers; a median
or successive-halving (ASHA) pruner fed by the metrics the trials' ranks log. The study lives in
a SQLite file under the sweep's output folder, so a stopped sweep continues where it was.

Pure logic: the flow (`flows/sweep.py`) runs the trials and talks to Prefect.
"""

import builtins
import copy
import itertools
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import optuna
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from trainflow.cli import merge_options
from trainflow.pipelines import PIPELINES

Scalar = str | int | float | bool | None


class LogUniform(BaseModel):
    """Floats drawn with a uniform logarithm between the two bounds (learning rates)."""

    model_config = ConfigDict(extra="forbid")
    log_uniform: tuple[float, float] = Field(description="Low and high bound, both > 0.")


class Uniform(BaseModel):
    """Floats drawn uniformly between the two bounds."""

    model_config = ConfigDict(extra="forbid")
    uniform: tuple[float, float] = Field(description="Low and high bound.")


class IntRange(BaseModel):
    """Integers drawn uniformly between the two bounds, both included."""

    model_config = ConfigDict(extra="forbid")
    # Named as it is written in a space; `builtins.int` because the field shadows the type.
    int: tuple[builtins.int, builtins.int] = Field(description="Low and high bound, included.")


Dimension = list[Scalar] | LogUniform | Uniform | IntRange
SearchSpace = dict[str, Dimension]
_SPACE = TypeAdapter(SearchSpace)
Sampler = Literal["grid", "random", "tpe"]
Pruner = Literal["none", "median", "asha"]
Mode = Literal["min", "max"]


def config_class(pipeline: str) -> type[BaseModel]:
    """The pipeline's own pydantic config class (`trainflow.pipelines`)."""
    return PIPELINES[pipeline].config_class()


def start_config(pipeline: str, base: Mapping[str, Any]) -> BaseModel:
    """A trial's starting config: the pipeline's defaults (its default preset, as
    `python -m flows.<pipeline>` starts from), with `base`'s options over them.

    Raises:
        ValidationError: `base` is not a valid config of the pipeline.
    """
    spec = PIPELINES[pipeline]
    merged = merge_options(spec.defaults().model_dump(), dict(base))
    return spec.config_class().model_validate(merged)


def _bounds(dimension: Dimension) -> list[Scalar]:
    """The values that stand for a dimension when checking it: every choice, or both bounds."""
    if isinstance(dimension, list):
        return list(dimension)
    if isinstance(dimension, LogUniform):
        return list(dimension.log_uniform)
    if isinstance(dimension, Uniform):
        return list(dimension.uniform)
    return list(dimension.int)


def with_params(base: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """`base` (a config as a dict) with each dotted key of `params` set; KeyError names a key
    that is not a field (a typo must not become a silently ignored option)."""
    out = copy.deepcopy(dict(base))
    for dotted, value in params.items():
        node = out
        *parents, leaf = dotted.split(".")
        for depth, part in enumerate(parents):
            if not isinstance(node.get(part), dict):
                raise KeyError(f"{'.'.join(parents[: depth + 1])!r} is not a section of the config")
            node = node[part]
        if leaf not in node:
            raise KeyError(f"{dotted!r} is not a field of the config")
        node[leaf] = value
    return out


def check_space(
    config_type: type[BaseModel], base: Mapping[str, Any], space: SearchSpace, sampler: Sampler
) -> None:
    """Refuse, before any trial starts, a space a trial's config would reject.

    Every key must be a field of the pipeline's config, and each choice (or both bounds of a
    range) must pass the config's own validation with the other options as in `base`.

    Raises:
        ValueError: naming the key, the value and the config's complaint.
    """
    if not space:
        raise ValueError("space is empty: give at least one field to search")
    space = _SPACE.validate_python(space)
    name = config_type.__name__
    for key, dimension in space.items():
        if isinstance(dimension, list) and not dimension:
            raise ValueError(f"space {key!r}: no values")
        if sampler == "grid" and not isinstance(dimension, list):
            raise ValueError(f"space {key!r}: grid search needs a list of values, not a range")
        low, high = _bounds(dimension)[0], _bounds(dimension)[-1]
        if not isinstance(dimension, list) and not low < high:  # type: ignore[operator]
            raise ValueError(f"space {key!r}: low bound {low!r} is not below high {high!r}")
        if isinstance(dimension, LogUniform) and low <= 0:  # type: ignore[operator]
            raise ValueError(f"space {key!r}: log_uniform bounds must be > 0")
        for value in _bounds(dimension):
            try:
                config_type.model_validate(with_params(base, {key: value}))
            except KeyError as exc:
                raise ValueError(f"space {key!r}: {exc.args[0]} ({name})") from None
            except ValidationError as exc:
                problems = "; ".join(
                    f"{'.'.join(str(p) for p in e['loc']) or key}: {e['msg']}" for e in exc.errors()
                )
                raise ValueError(
                    f"space {key!r}: value {value!r} is not a valid {name}: {problems}"
                ) from None


def grid_size(space: SearchSpace) -> int:
    """Trials of a full grid over lists of values."""
    return math.prod(len(d) for d in space.values() if isinstance(d, list))


def suggest(trial: optuna.Trial, space: SearchSpace) -> dict[str, Any]:
    """Draw one trial's values from the space (the sampler decides how)."""
    params: dict[str, Any] = {}
    for key, dimension in space.items():
        if isinstance(dimension, list):
            params[key] = trial.suggest_categorical(key, dimension)
        elif isinstance(dimension, LogUniform):
            params[key] = trial.suggest_float(key, *dimension.log_uniform, log=True)
        elif isinstance(dimension, Uniform):
            params[key] = trial.suggest_float(key, *dimension.uniform)
        else:
            params[key] = trial.suggest_int(key, *dimension.int)
    return params


def make_sampler(kind: Sampler, seed: int) -> optuna.samplers.BaseSampler:
    """Optuna's random or TPE sampler; a grid is enqueued instead (`enqueue_grid`)."""
    if kind == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    return optuna.samplers.RandomSampler(seed=seed)


def enqueue_grid(study: optuna.Study, space: SearchSpace) -> None:
    """Queue every combination of a new study's lists, in order.

    Optuna's `GridSampler` stops the study from inside `tell` once the grid is exhausted,
    which only an `optimize` loop allows; queued trials give the same grid to `ask`, and
    they stay queued in the storage when a sweep stops.
    """
    if study.trials:
        return
    keys = list(space)
    for values in itertools.product(*(space[k] for k in keys)):  # type: ignore[misc]
        study.enqueue_trial(dict(zip(keys, values, strict=True)))


def make_pruner(kind: Pruner, startup_trials: int, warmup_steps: int) -> optuna.pruners.BasePruner:
    """No pruning, the median rule, or asynchronous successive halving (ASHA).

    The median rule stops a trial whose intermediate value is worse than the median of the
    finished trials at the same step, once `startup_trials` have finished and the trial is
    past `warmup_steps`; ASHA keeps the best third at each rung, from `warmup_steps` on.
    """
    if kind == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=startup_trials, n_warmup_steps=warmup_steps
        )
    if kind == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(min_resource=max(1, warmup_steps))
    return optuna.pruners.NopPruner()


def study_storage(path: Path, attempts: int = 5) -> optuna.storages.RDBStorage:
    """Optuna's SQLite storage at `path`, set up safely against a concurrent reader.

    Two processes opening a new study file at once (the sweep, and a dashboard or a check that
    reads it) race in Optuna's schema stamp: the loser gets `UNIQUE constraint failed:
    alembic_version`. The schema is complete by then, so the loser opens it again.
    """
    import sqlalchemy.exc

    for attempt in range(attempts):
        try:
            return optuna.storages.RDBStorage(f"sqlite:///{path}")
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            if attempt == attempts - 1:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def open_study(
    folder: Path, name: str, mode: Mode, sampler: optuna.samplers.BaseSampler, pruner: Any
) -> optuna.Study:
    """The sweep's study in `folder/study.db`: created on first use, continued on a resume."""
    folder.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(
        storage=study_storage(folder / "study.db"),
        study_name=name,
        direction="minimize" if mode == "min" else "maximize",
        sampler=sampler,
        pruner=pruner,
        load_if_exists=True,
    )


# Attributes the sweep stores on each Optuna trial (its row in the trial table).
RUN_ID = "mlflow_run_id"
STARTED = "started"
ENDED = "ended"
ERROR = "error"
VERSION = "model_version"
PASSED = "passed_gate"


def _interrupted(trial: optuna.trial.FrozenTrial) -> bool:
    """A failed trial the sweep never saw end: it was running when the sweep stopped."""
    return trial.state == optuna.trial.TrialState.FAIL and ENDED not in trial.user_attrs


def requeue_interrupted(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by a sweep that stopped: end them interrupted, run their values again.

    They do not count towards the sweep's trials; returns their numbers.
    """
    stale = [t for t in study.trials if t.state == optuna.trial.TrialState.RUNNING]
    for trial in stale:
        study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
        study.enqueue_trial(trial.params, skip_if_exists=False)
    return [t.number for t in stale]


def counted(study: optuna.Study) -> int:
    """Trials that finished (complete, pruned or failed), not counting interrupted ones."""
    return sum(1 for t in study.trials if t.state.is_finished() and not _interrupted(t))


@dataclass(frozen=True)
class TrialRow:
    """One trial in the table: its values, metric, state and time."""

    number: int
    params: dict[str, Any]
    value: float | None
    state: str
    duration_s: float | None
    run_id: str | None
    model_version: str | None
    passed_gate: bool
    error: str | None


def _state(trial: optuna.trial.FrozenTrial) -> str:
    if _interrupted(trial):
        return "interrupted"
    return {
        optuna.trial.TrialState.COMPLETE: "complete",
        optuna.trial.TrialState.PRUNED: "pruned",
        optuna.trial.TrialState.FAIL: "failed",
        optuna.trial.TrialState.RUNNING: "running",
        optuna.trial.TrialState.WAITING: "waiting",
    }[trial.state]


def trial_rows(study: optuna.Study) -> list[TrialRow]:
    """The study's trials as table rows, in the order they were asked."""
    rows = []
    for t in study.trials:
        attrs = t.user_attrs
        started, ended = attrs.get(STARTED), attrs.get(ENDED)
        rows.append(
            TrialRow(
                number=t.number,
                params=dict(t.params),
                value=t.value if t.state == optuna.trial.TrialState.COMPLETE else None,
                state=_state(t),
                duration_s=ended - started if started and ended else None,
                run_id=attrs.get(RUN_ID),
                model_version=attrs.get(VERSION),
                passed_gate=bool(attrs.get(PASSED, False)),
                error=attrs.get(ERROR),
            )
        )
    return rows


def best_row(rows: list[TrialRow], mode: Mode) -> TrialRow | None:
    """The complete trial with the best metric, or None when none completed."""
    done = [r for r in rows if r.state == "complete" and r.value is not None]
    if not done:
        return None
    pick = min if mode == "min" else max
    return pick(done, key=lambda r: r.value)  # type: ignore[arg-type, return-value]


def _shown(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def markdown_table(rows: list[TrialRow], metric: str, keys: list[str]) -> str:
    """The trial table: number, values, metric, state, duration, model version."""
    head = ["trial", *keys, metric, "state", "duration (s)", "model"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        model = r.model_version or "-"
        if r.model_version and not r.passed_gate:
            model += " (gate not passed)"
        state = f"{r.state}: {r.error}" if r.error else r.state
        cells = [
            str(r.number),
            *(_shown(r.params.get(k, "")) for k in keys),
            _shown(r.value) if r.value is not None else "-",
            state.replace("|", "/").replace("\n", " ")[:200],
            f"{r.duration_s:.1f}" if r.duration_s is not None else "-",
            model,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def metric_plot(rows: list[TrialRow], metric: str, keys: list[str]) -> Any:
    """A matplotlib figure: the metric against each searched field (one panel per field).

    Numeric fields spread on their axis (log-scaled when every value is > 0 and they span more
    than a factor of 20); other values are placed as categories.
    """
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    done = [r for r in rows if r.value is not None]
    fig = Figure(figsize=(4 * max(1, len(keys)), 3.2), dpi=100)
    axes = fig.subplots(1, max(1, len(keys)), squeeze=False)[0]
    for ax, key in zip(axes, keys, strict=False):
        values = [r.params.get(key) for r in done]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        numeric = len(numbers) == len(values)
        if numeric:
            xs: list[Any] = numbers
            positive = [v for v in numbers if v > 0]
            if positive and len(positive) == len(values) and max(positive) / min(positive) > 20:
                ax.set_xscale("log")
        else:
            labels = sorted({str(v) for v in values})
            xs = [labels.index(str(v)) for v in values]
            ax.set_xticks(range(len(labels)), labels)
        ax.scatter(xs, [r.value for r in done])
        ax.set(xlabel=key, ylabel=metric)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{metric} by trial ({len(done)} complete)")
    fig.tight_layout()
    return fig
