"""A pipeline's launch agent, started ahead: what it imports for its ranks."""

import pytest

from flows import command
from trainflow import cli
from trainflow.launch import backends
from trainflow.launch.standby import AgentAhead
from trainflow.pipelines import pipeline
from trainflow.workloads import sft_startup


@pytest.fixture
def preloads(monkeypatch) -> list[list[str]]:
    """The modules each agent started in the test was asked to import."""
    started: list[list[str]] = []

    def standby(options, preload, check, then):
        started.append(list(preload))
        return AgentAhead()

    monkeypatch.setattr(backends, "standby", standby)
    return started


def test_the_sft_agent_imports_deepspeed_for_its_ranks_only_when_they_use_it(preloads):
    for technique in ("ddp", "fsdp", "deepspeed", "auto"):
        sft_startup.start_agent(command.parse_args("sft", ["--technique", technique]))
    workload = sft_startup.WORKLOAD
    # `auto` chooses at launch: ranks that get DeepSpeed then import it themselves.
    assert preloads == [[workload], [workload], [workload, "deepspeed"], [workload]]


def test_any_pipelines_agent_imports_deepspeed_when_its_technique_is_deepspeed(preloads):
    module = pipeline("transformer").workload.module
    for technique in ("ddp", "fsdp", "deepspeed"):
        config = command.parse_args("transformer", ["--technique", technique])
        cli.start_launch_agent(config, module)
    assert preloads == [[module], [module], [module, "deepspeed"]]
