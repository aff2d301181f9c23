"""A framework pipeline refuses what cannot run, naming it, before any server or rank starts."""

import sys
from pathlib import Path

import pytest

from flows import axolotl, llm_foundry, unsloth
from trainflow.configs.frameworks import FRAMEWORKS, PRESETS_DIR, FrameworkConfig
from trainflow.frameworks import startup


def _usage_error(main, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_a_positional_config_file_is_the_framework_config():
    assert startup.command_line(["my.yaml", "--gpus", "4"]) == [
        "--framework-config",
        "my.yaml",
        "--gpus",
        "4",
    ]
    assert startup.command_line(["--gpus", "4"]) == ["--gpus", "4"]


def test_a_missing_config_file_is_named(tmp_path, capsys):
    err = _usage_error(axolotl.main, [str(tmp_path / "nope.yaml")], capsys)
    assert "--framework-config" in err and "nope.yaml: no such file" in err


def test_a_config_file_that_is_not_a_mapping_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    err = _usage_error(llm_foundry.main, [str(bad)], capsys)
    assert f"{bad}: expected a YAML mapping, got list" in err


def test_a_missing_environment_names_the_command_that_makes_it(tmp_path, capsys):
    err = _usage_error(
        llm_foundry.main, ["--python", str(tmp_path / "env" / "bin" / "python")], capsys
    )
    assert "LLM Foundry runs in its own environment" in err
    assert "bash scripts/setup-framework.sh llm-foundry" in err


def test_unsloth_refuses_cpu_ranks_for_a_config_that_needs_a_gpu(capsys):
    recipe = PRESETS_DIR / "unsloth-llama-3.2-3b.yaml"  # require_gpu: true
    # The environment is given as this interpreter, so the refusal is the device's alone.
    err = _usage_error(unsloth.main, [str(recipe), "--python", sys.executable], capsys)
    assert "Unsloth cannot train on CPU ranks" in err and "require_gpu: true" in err


def test_an_environment_that_cannot_start_ranks_is_named(tmp_path):
    import subprocess

    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "env")], check=True
    )
    config = FrameworkConfig(
        framework_config=str(PRESETS_DIR / FRAMEWORKS["axolotl"].tiny_config),
        python=str(tmp_path / "env" / "bin" / "python"),
    )
    with pytest.raises(
        ValueError, match=r"cannot run the ranks: .*torch.*setup-framework.sh axolotl"
    ):
        startup.check_environment(FRAMEWORKS["axolotl"], config)


@pytest.mark.parametrize("name", sorted(FRAMEWORKS))
def test_each_framework_ships_its_configs_and_rank_side(name):
    framework = FRAMEWORKS[name]
    assert (PRESETS_DIR / framework.tiny_config).is_file()
    assert Path("scripts/frameworks", f"{name}.txt").is_file()
    rank_side = framework.rank_module()  # imports in this environment: no framework import
    assert callable(rank_side.train) and callable(rank_side.pipeline_overrides)


def test_the_model_and_length_come_from_the_config_file_unless_given(tmp_path):
    axolotl_spec = FRAMEWORKS["axolotl"]
    recipe = FrameworkConfig(framework_config="axolotl-olmo3-7b").resolved(axolotl_spec)
    assert (recipe.model, recipe.max_length) == ("allenai/Olmo-3-1025-7B", 8192)
    given = FrameworkConfig(framework_config="axolotl-olmo3-7b", model="m", max_length=128)
    assert given.resolved(axolotl_spec) is given
    bare = tmp_path / "bare.yaml"
    bare.write_text("sequence_len: 64\n")
    with pytest.raises(ValueError, match=r"bare.yaml: sets nothing at base_model; .* --model"):
        FrameworkConfig(framework_config=str(bare)).resolved(axolotl_spec)


def test_a_shipped_config_is_found_by_name_and_an_unknown_one_is_named():
    config = FrameworkConfig(framework_config="llm-foundry-tiny")
    assert config.framework_config == str(PRESETS_DIR / "llm-foundry-tiny.yaml")
    with pytest.raises(
        ValueError, match="nope: no such file .* one of the shipped: axolotl-olmo3-7b"
    ):
        FrameworkConfig(framework_config="nope")
