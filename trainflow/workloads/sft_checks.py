"""The checks of an SFT config that need the model's libraries, kept apart from the training code.

A launch's standby agent runs `check_ahead` as soon as it has imported what the checks need
(torch, transformers' model classes) and before it imports what only training needs (TRL,
datasets, streaming, DeepSpeed, MLflow's store): the pipeline's process has its answer
seconds earlier, and goes on while the agent finishes its imports.
"""

from typing import Any

from trainflow.configs.sft import AutoTechnique, SFTConfig
from trainflow.strategies.job import check_technique

__all__ = ["check_ahead", "check_config", "check_names"]


def check_config(config: SFTConfig) -> None:
    """Refuse, before data is prepared or any rank starts, input the ranks would only fail on.

    A local chat file must parse row by row (`check_files`), and the names must be ones the
    Trainer and the model know (`check_names`).

    Raises:
        ValueError: naming the option or file, the bad value and what would be valid.
    """
    from trainflow.data.checks import check_files

    check_files(config.data_config())
    check_names(config)


def check_names(config: SFTConfig) -> None:
    """The learning-rate schedule must be one the Trainer knows, and every LoRA target must
    name modules of the model (built on the meta device: no weights, no memory).

    Raises:
        ValueError: naming the option, the bad value and what would be valid.
    """
    from transformers import SchedulerType

    from trainflow.data.checks import check_files

    check_files(config.data_config())
    schedules = [s.value for s in SchedulerType]
    if config.training.lr_scheduler not in schedules:
        raise ValueError(
            f"training.lr_scheduler={config.training.lr_scheduler!r} is not a schedule the "
            f"Trainer knows; use one of {schedules}"
        )
    if config.lora:
        # Here, not at the top: only LoRA targets need the model (seconds of imports), and
        # `--dry-run` checks the names of a run without them in about a second.
        import torch

        from trainflow.data.tokenizer import load_tokenizer
        from trainflow.models.causal_lm import build_causal_lm

        tokenizer = load_tokenizer(config.tokenizer_path())
        with torch.device("meta"):
            model = build_causal_lm(config.model, tokenizer, seed=0, pretrained=False)
        names = [name for name, _ in model.named_modules() if name]
        leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
        for target in config.lora_settings.target_modules:
            if not any(name == target or name.endswith(f".{target}") for name in names):
                raise ValueError(
                    f"lora_settings.target_modules: {target!r} names no module of "
                    f"{config.model}; its modules are named {leaves}"
                )


def check_ahead(config: dict[str, Any]) -> dict[str, Any]:
    """Every check of `config` that needs this module's libraries, in one call: for a launch's
    standby agent to run while the pipeline's process starts, which then need not import them
    (`trainflow.launch.backends.standby`). The names (`check_config`), the memory plan (a run that
    does not fit is refused) and the technique on the model built on the meta device, for the
    technique the plan chose.

    Returns the model's shape, for the pipeline's own memory plan, and the configs checked:
    the one given and the one with its technique resolved (`technique: auto`).

    Raises:
        ValueError: naming the option, file or model that is wrong (`MemoryFitError` too).
    """
    from dataclasses import asdict

    from trainflow.data.tokenizer import load_tokenizer
    from trainflow.memory import plan_sft
    from trainflow.models.causal_lm import build_causal_lm

    given = SFTConfig.model_validate(config)
    check_config(given)
    plan = plan_sft(given)
    resolved = given.with_technique(plan.technique)
    technique = resolved.technique
    # `with_technique` takes a concrete technique: the plan has resolved `auto`.
    assert not isinstance(technique, AutoTechnique)
    tokenizer = load_tokenizer(resolved.tokenizer_path())
    check_technique(
        lambda: build_causal_lm(resolved.model, tokenizer, seed=0, pretrained=False),
        technique,
        resolved.resources,
        "hf",
    )
    checked = [given.model_dump(mode="json"), resolved.model_dump(mode="json")]
    return {"shape": asdict(plan.shape), "checked": checked}
