"""MLflow's map of installed packages, built once per environment and kept for later runs."""

import json
import subprocess
import sys

import pytest
from mlflow.utils import requirements_utils

from tests.conftest import REPO_ROOT
from trainflow import tracking
from trainflow.tracking import package_map_file, warm_model_logging


@pytest.fixture
def unbuilt(monkeypatch, tmp_path):
    monkeypatch.setattr(tracking, "package_map_folder", lambda: tmp_path)
    monkeypatch.setattr(requirements_utils, "_MODULES_TO_PACKAGES", None)


def test_the_install_built_the_map_a_run_from_the_checkout_reads(tmp_path):
    """scripts/setup.sh builds it (python -m flows.local_server make-template) in the
    environment's folder; a run from the checkout, or from elsewhere with the checkout on
    PYTHONPATH, finds it there."""
    code = "from trainflow.tracking import package_map_file as f; print(f(), f().is_file())"
    for cwd, env in ((REPO_ROOT, {}), (tmp_path, {"PYTHONPATH": str(REPO_ROOT)})):
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=cwd,
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()
        assert out[0].startswith(f"{sys.prefix}/share/trainflow/"), out
        assert out[1] == "True", f"no map built by the install at {out[0]}"


def test_the_map_is_built_once_then_read_back(unbuilt):
    warm_model_logging()
    built = requirements_utils._MODULES_TO_PACKAGES
    assert built["torch"] == ["torch"] and "mlflow" in built
    kept = package_map_file()
    assert json.loads(kept.read_text()) == built
    kept.write_text(json.dumps({"marker": ["read back"]}))
    requirements_utils._MODULES_TO_PACKAGES = None
    warm_model_logging()
    assert requirements_utils._MODULES_TO_PACKAGES == {"marker": ["read back"]}


def test_installing_anything_gives_the_environment_another_map(unbuilt, monkeypatch, tmp_path):
    before = package_map_file()
    site = tmp_path / "site"
    (site / "newpkg-1.0.dist-info").mkdir(parents=True)
    monkeypatch.setattr(sys, "path", [*sys.path, str(site)])
    installed = package_map_file()
    assert installed != before
    (site / "newpkg-1.0.dist-info").rename(site / "newpkg-1.1.dist-info")
    assert package_map_file() not in (before, installed)


def test_a_kept_map_that_cannot_be_read_is_built_again(unbuilt):
    kept = package_map_file()
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text("{not json")
    warm_model_logging()
    assert requirements_utils._MODULES_TO_PACKAGES["torch"] == ["torch"]
    assert json.loads(kept.read_text()) == requirements_utils._MODULES_TO_PACKAGES
