"""Command lines generated from the pipeline configs."""

import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from trainflow.cli import parse_config
from trainflow.workloads.mlp import MLPConfig


def _parse(*argv: str) -> MLPConfig:
    return parse_config(MLPConfig, MLPConfig(), list(argv), prog="mlp", description="")


def test_options_override_defaults_and_none_unsets():
    config = _parse("--gpus", "4", "--gpu-type", "H100", "--max-steps", "7")
    assert (config.gpus, config.gpu_type, config.max_steps) == (4, "H100", 7)
    assert _parse("--gpu-type", "none").gpu_type is None
    assert _parse().num_epochs == MLPConfig().num_epochs


def test_invalid_value_names_the_option(capsys):
    with pytest.raises(SystemExit) as info:
        _parse("--gpus", "0")
    assert info.value.code == 2
    assert "--gpus: Input should be greater than or equal to 1" in capsys.readouterr().err


def test_cross_field_check_runs_before_any_worker(capsys):
    with pytest.raises(SystemExit):
        _parse("--batch-size", "4096", "--gpus", "4")
    assert "exceeds num_train_samples" in capsys.readouterr().err


def test_help_documents_every_option():
    out = subprocess.run(
        [sys.executable, "-m", "flows.mlp", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name, field in MLPConfig.model_fields.items():
        flag = "--" + name.replace("_", "-")
        assert flag in out, flag
        assert field.description.split()[0] in out
    assert "python -m flows.mlp" in out


def test_union_option_takes_a_name_or_json_and_switches_variant():
    from trainflow.workloads.transformer import TransformerConfig

    def parse(*argv):
        return parse_config(TransformerConfig, TransformerConfig(), list(argv), "t", "")

    assert parse().technique.name == "fsdp"
    assert parse("--technique", "ddp").technique.name == "ddp"
    zero3 = parse("--technique", '{"name": "deepspeed", "zero_stage": 3}').technique
    assert (zero3.name, zero3.zero_stage) == ("deepspeed", 3)


def test_unknown_union_variant_names_the_option(capsys):
    from trainflow.workloads.transformer import TransformerConfig

    with pytest.raises(SystemExit):
        parse_config(TransformerConfig, TransformerConfig(), ["--technique", "zero9"], "t", "")
    assert "--technique" in capsys.readouterr().err


def _started_ahead(argv: list[str], check=None) -> list:
    from trainflow.cli import start_ahead
    from trainflow.configs.sft import load_sft_preset

    started: list = []
    start_ahead("sft", load_sft_preset("debug_cpu"), argv, None, check, started.append)
    return started


def test_a_valid_command_line_starts_its_agent_ahead_with_the_config_it_names(capsys):
    (config,) = _started_ahead(["--max-steps", "7", "--technique", "fsdp"])
    assert (config.max_steps, config.technique.name) == (7, "fsdp")
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    "argv", [["--help"], ["--max-steps", "0"], ["--no-such-option"], ["--gpus", "64"]]
)
def test_a_command_line_that_will_not_run_starts_nothing_ahead_and_says_nothing(argv, capsys):
    # Help, a bad value, an unknown option, more CPU ranks than this machine can run: all
    # reported once, by the pipeline's own reading of the same command line.
    assert _started_ahead(argv) == []
    assert capsys.readouterr() == ("", "")


def test_a_data_file_the_check_refuses_starts_nothing_ahead():
    def refuse(config):
        raise ValueError("dataset: line 3 is not JSON")

    assert _started_ahead([], check=refuse) == []


def test_the_sft_command_starts_its_agent_before_it_imports_prefect():
    code = (
        "import sys, runpy, trainflow.cli as cli\n"
        "def spy(*args): print('PREFECT_LOADED', 'prefect' in sys.modules); raise SystemExit(0)\n"
        "cli.start_ahead = spy\n"
        "sys.orig_argv = [sys.executable, '-m', 'flows.sft', '--max-steps', '3']\n"
        "sys.argv = ['flows/sft.py', '--max-steps', '3']\n"
        "runpy.run_module('flows.sft', run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert "PREFECT_LOADED False" in done.stdout, done.stderr[-2000:]


def test_a_pipeline_command_imports_without_the_collector_and_runs_its_flow_with_it():
    # `python -m flows.NAME` turns the cyclic collector off for its start-up (imports); the
    # flow itself must run with it on.
    code = (
        "import gc, sys\n"
        "sys.orig_argv = [sys.executable, '-m', 'flows.mlp']\n"
        "import flows\n"
        "print('STARTUP', gc.isenabled())\n"
        "from trainflow.cli import run_pipeline\n"
        "from trainflow.workloads.mlp import MLPConfig\n"
        "class Flow:\n"
        "    name = 'mlp'\n"
        "    def __call__(self, config):\n"
        "        print('FLOW', gc.isenabled())\n"
        "        raise SystemExit(0)\n"
        "run_pipeline(Flow(), MLPConfig(), [], None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["STARTUP", "False", "FLOW", "True"], done.stderr[-2000:]
