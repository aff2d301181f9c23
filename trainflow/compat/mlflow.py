"""Patches into MLflow: its map of installed distributions to the modules they provide, built
ahead and kept on disk (`tracking.warm_model_logging`).

Written and tested for MLflow 3.17 (trainflow's environment) and 2.22 (LLM Foundry's).
"""

from typing import Any

from trainflow.compat.patching import check, declare, relies_on

MLFLOW = ">=2.22,<3.18"

PACKAGE_MAP = declare(
    "mlflow: requirements_utils._MODULES_TO_PACKAGES",
    "mlflow",
    MLFLOW,
    target="mlflow.utils.requirements_utils:_MODULES_TO_PACKAGES",
    why="MLflow builds the map the first time a process logs a model, 1 to 2.5 s on 2 cores; "
    "built ahead and kept on disk, rank 0 logs its model without building it",
)
BUILD_PACKAGE_MAP = declare(
    "mlflow: requirements_utils._init_modules_to_packages_map",
    "mlflow",
    MLFLOW,
    target="mlflow.utils.requirements_utils:_init_modules_to_packages_map",
    why="builds the map (see the map's patch)",
)


def _requirements_utils() -> Any:
    try:
        from mlflow.utils import requirements_utils
    except ImportError:
        return None
    return requirements_utils


def package_map_unbuilt() -> bool:
    """Whether MLflow still has to build its package map in this process: False when built
    already, or when MLflow keeps it elsewhere (a version this patch does not know)."""
    utils = _requirements_utils()
    if utils is None or relies_on(PACKAGE_MAP) or relies_on(BUILD_PACKAGE_MAP):
        return False
    check(PACKAGE_MAP)
    return utils._MODULES_TO_PACKAGES is None


def set_package_map(modules_to_packages: dict[str, list[str]]) -> None:
    """Hand MLflow a map built earlier (read back from disk)."""
    _requirements_utils()._MODULES_TO_PACKAGES = modules_to_packages


def build_package_map() -> dict[str, list[str]]:
    """Have MLflow build its map now; the map."""
    utils = _requirements_utils()
    utils._init_modules_to_packages_map()
    return dict(utils._MODULES_TO_PACKAGES)
