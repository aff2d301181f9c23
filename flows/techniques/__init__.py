"""Technique subflows by name; a pipeline picks one with its config's `technique.name`.

    trained = techniques[config.technique.name](
        workload=workload, technique=config.technique, resources=config.resources)

Adding a technique: one module here with its subflow, one line in `techniques`.
"""

from typing import Any

from prefect import Flow

from flows.techniques.ddp import ddp
from flows.techniques.deepspeed import deepspeed
from flows.techniques.fsdp import fsdp

techniques: dict[str, Flow[..., Any]] = {
    "ddp": ddp,
    "fsdp": fsdp,
    "deepspeed": deepspeed,
}
