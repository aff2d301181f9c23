"""The sweep's pure logic: dotted keys, the space checked against the pipeline's config, the
grid, interrupted trials and the trial table."""

import optuna
import pytest

from trainflow import sweep
from trainflow.configs.mlp import MLPConfig
from trainflow.configs.transformer import TransformerConfig


def test_dotted_keys_set_nested_fields_and_refuse_unknown_ones():
    base = TransformerConfig().model_dump()
    out = sweep.with_params(base, {"training.optimizer.learning_rate": 0.5, "gpus": 4})
    assert out["training"]["optimizer"]["learning_rate"] == 0.5 and out["gpus"] == 4
    assert base["training"]["optimizer"]["learning_rate"] != 0.5  # the base is not changed
    with pytest.raises(KeyError, match="'training.lr' is not a field"):
        sweep.with_params(base, {"training.lr": 0.1})
    with pytest.raises(KeyError, match="'gpus' is not a section"):
        sweep.with_params(base, {"gpus.count": 1})


def test_a_bad_space_names_the_field_before_anything_starts():
    base = MLPConfig().model_dump()

    def check(space, sampler="tpe"):
        sweep.check_space(MLPConfig, base, space, sampler)

    with pytest.raises(ValueError, match=r"space 'learning_rate': value -0.1 .*greater than 0"):
        check({"learning_rate": {"uniform": [-0.1, 0.1]}})
    with pytest.raises(ValueError, match="space 'hidden': 'hidden' is not a field"):
        check({"hidden": [8, 16]})
    with pytest.raises(ValueError, match="space 'batch_size': value 8192 .*no full step fits"):
        check({"batch_size": [64, 8192]})
    with pytest.raises(ValueError, match="space 'learning_rate': grid search needs a list"):
        check({"learning_rate": {"log_uniform": [1e-4, 1e-2]}}, sampler="grid")
    with pytest.raises(ValueError, match="log_uniform bounds must be > 0"):
        check({"learning_rate": {"log_uniform": [0, 1e-2]}})
    check({"learning_rate": {"log_uniform": [1e-4, 1e-2]}, "hidden_size": {"int": [8, 64]}})


def test_suggested_values_stay_in_the_space():
    space = {
        "learning_rate": sweep.LogUniform(log_uniform=(1e-4, 1e-2)),
        "hidden_size": sweep.IntRange(int=(8, 64)),
        "noise_std": sweep.Uniform(uniform=(0.0, 0.1)),
        "seed": [1, 2],
    }
    study = optuna.create_study(sampler=sweep.make_sampler("random", seed=0))
    for _ in range(20):
        params = sweep.suggest(study.ask(), space)
        assert 1e-4 <= params["learning_rate"] <= 1e-2
        assert 8 <= params["hidden_size"] <= 64 and isinstance(params["hidden_size"], int)
        assert 0.0 <= params["noise_std"] <= 0.1 and params["seed"] in (1, 2)


def test_interrupted_trials_run_again_and_do_not_count():
    space = {"learning_rate": [1e-3, 3e-3], "hidden_size": [8, 16]}
    study = optuna.create_study(sampler=sweep.make_sampler("grid", seed=0))
    sweep.enqueue_grid(study, space)
    first, second = study.ask(), study.ask()
    assert sweep.suggest(first, space) == {"learning_rate": 1e-3, "hidden_size": 8}
    first.set_user_attr(sweep.ENDED, 1.0)
    study.tell(first, 0.5)
    interrupted = sweep.suggest(second, space)
    # A sweep started again finds `second` still running: it stopped with the sweep.
    sweep.enqueue_grid(study, space)  # not queued twice
    assert sweep.requeue_interrupted(study) == [second.number]
    assert sweep.counted(study) == 1
    rerun = [sweep.suggest(study.ask(), space) for _ in range(3)]
    assert rerun[2] == interrupted
    assert {tuple(p.values()) for p in rerun} == {(3e-3, 8), (3e-3, 16), (1e-3, 16)}
    states = [r.state for r in sweep.trial_rows(study)]
    assert states[:2] == ["complete", "interrupted"]


def test_trial_table_and_plot_show_every_trial():
    study = optuna.create_study()
    for lr, value in [(1e-3, 0.4), (1e-2, 0.2)]:
        trial = study.ask()
        trial.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
        study.enqueue_trial({"learning_rate": lr})
        study.tell(trial, value)
    failed = study.ask()
    failed.suggest_float("learning_rate", 1e-4, 1e-1, log=True)
    failed.set_user_attr(sweep.ERROR, "rank 1 failed")
    failed.set_user_attr(sweep.ENDED, 2.0)
    study.tell(failed, state=optuna.trial.TrialState.FAIL)
    rows = sweep.trial_rows(study)
    table = sweep.markdown_table(rows, "eval_mse", ["learning_rate"])
    assert table.count("\n") == 4 and "failed: rank 1 failed" in table
    assert sweep.best_row(rows, "min").value == 0.2
    assert sweep.best_row(rows, "max").value == 0.4
    figure = sweep.metric_plot(rows, "eval_mse", ["learning_rate"])
    assert figure.axes[0].get_xlabel() == "learning_rate"
