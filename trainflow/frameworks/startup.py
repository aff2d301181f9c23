"""The framework pipelines' start-up: their defaults, command line and checks (`PipelineSpec`).

`python -m flows.axolotl [CONFIG.yaml] [options]` starts from the framework's shipped tiny
config; what can be checked in a second (the config file, the framework's environment, the
ranks' device) is checked before the Prefect server starts, and whether the environment can
start our ranks while it starts.
"""

from trainflow.configs.frameworks import (
    FRAMEWORKS,
    PRESETS_DIR,
    Framework,
    FrameworkConfig,
    FrameworkSetupError,
)
from trainflow.launch.plan import check_cpu_oversubscription


def defaults(name: str) -> FrameworkConfig:
    """What `python -m flows.NAME` and the flow start from: the framework's shipped tiny config."""
    framework = FRAMEWORKS[name.replace("_", "-")]  # the pipeline llm_foundry: llm-foundry
    return FrameworkConfig(
        framework=framework.name,
        framework_config=str(PRESETS_DIR / framework.tiny_config),
        registered_model_name=f"{framework.name}-sft",
    )


def command_line(argv: list[str]) -> list[str]:
    """`python -m flows.NAME CONFIG.yaml [options]`: the positional config file becomes
    `--framework-config`."""
    if argv and not argv[0].startswith("-"):
        return ["--framework-config", argv[0], *argv[1:]]
    return list(argv)


def _framework(config: FrameworkConfig) -> Framework:
    if config.framework is None:
        raise ValueError("framework: none given (each framework's flow sets its own)")
    return FRAMEWORKS[config.framework]


def resolve(config: FrameworkConfig) -> FrameworkConfig:
    """The config for its framework, with the model and sequence length from its file."""
    framework = _framework(config)
    return config.for_framework(framework).resolved(framework)


def check_files(config: FrameworkConfig) -> None:
    """`check_setup` for the config's framework, before the Prefect server starts."""
    check_setup(_framework(config), config)


def deep_check(config: FrameworkConfig) -> None:
    """`check_environment` for the config's framework, while the Prefect server starts."""
    check_environment(_framework(config), config)


def check_setup(framework: Framework, config: FrameworkConfig) -> FrameworkConfig:
    """What can be checked in a second, before the Prefect server or any rank starts: the config
    file, the framework's environment, the ranks' device. Returns the config for `framework`
    (`for_framework`), resolved (`resolved`: the model and sequence length from the file when
    not given).

    Raises:
        FrameworkSetupError: naming the file, the environment (and the command that makes it) or
            why the framework cannot train on these ranks.
        ValueError: the config names another framework, or a file that names no model.
    """
    config = config.for_framework(framework).resolved(framework)
    python = config.interpreter(framework)
    if not python.exists():
        where = "--python" if config.python else f".venvs/{framework.name}"
        raise FrameworkSetupError(
            f"{framework.title} runs in its own environment, and {python} does not exist "
            f"({where}): create it with `{framework.setup_command()}`"
        )
    plan = config.launch_plan()
    check_cpu_oversubscription(plan)
    # The framework's own say on this device and config (Unsloth: a config that needs a GPU).
    can_train = getattr(framework.rank_module(), "check_can_train", None)
    if plan.device == "cpu" and can_train is not None:
        reason = can_train(config.framework_config)
        if reason:
            raise FrameworkSetupError(
                f"{framework.title} cannot train on CPU ranks: {reason}. Run it where CUDA GPUs "
                "are (--gpu-type H100 --gpus 8, or a GPU deployment)"
            )
    return config


def check_environment(framework: Framework, config: FrameworkConfig) -> str:
    """The environment can start our ranks (torch and trainflow import there); its versions."""
    from trainflow.errors import LaunchConfigError
    from trainflow.launch.environment import check_interpreter

    try:
        return check_interpreter(str(config.interpreter(framework)))
    except LaunchConfigError as exc:
        hint = f"(for {framework.title}: `{framework.setup_command()}`)"
        raise FrameworkSetupError(f"{exc} {hint}") from None
