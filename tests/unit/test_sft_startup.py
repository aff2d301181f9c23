"""The SFT pipeline's launch agent, started ahead: what it imports for its ranks."""

from flows import command
from trainflow.launch import backends
from trainflow.launch.standby import AgentAhead
from trainflow.workloads import sft_startup


def test_the_agent_imports_deepspeed_for_its_ranks_only_when_they_use_it(monkeypatch):
    preloads: list[list[str]] = []

    def standby(options, preload, check, then):
        preloads.append(list(preload))
        return AgentAhead()

    monkeypatch.setattr(backends, "standby", standby)
    for technique in ("ddp", "fsdp", "deepspeed"):
        sft_startup.start_agent(command.parse_args("sft", ["--technique", technique]))
    workload = sft_startup.WORKLOAD
    assert preloads == [[workload], [workload], [workload, "deepspeed"]]
