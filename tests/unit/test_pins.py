"""`constraints.txt` (the pins the tests ran with) agrees with `pyproject.toml` (the ranges
trainflow declares), and the environment the tests run in is the pinned one."""

import tomllib
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO_ROOT


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO_ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[canonicalize_name(name)] = version
    return pins


def _declared() -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    lines = project["dependencies"] + [r for group in extras.values() for r in group]
    return [Requirement(line) for line in lines]


def test_every_declared_dependency_is_pinned_within_its_range():
    pins = _pins()
    outside = []
    for requirement in _declared():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name} is declared in pyproject.toml but not pinned"
        if not requirement.specifier.contains(pins[name], prereleases=True):
            outside.append(f"{requirement.name}=={pins[name]} not in {requirement.specifier}")
    assert outside == []


def test_the_environment_is_the_pinned_one():
    pins = _pins()
    differ = []
    for requirement in _declared():
        name = canonicalize_name(requirement.name)
        installed = metadata.version(requirement.name)
        if installed.split("+")[0] != pins[name]:
            differ.append(f"{requirement.name}: installed {installed}, pinned {pins[name]}")
    assert differ == [], "run scripts/setup.sh again: " + "; ".join(differ)


def test_the_old_streaming_package_is_not_installed_beside_the_fork():
    # Both install the `streaming` package: one would overwrite the other's files.
    assert "mosaicml-streaming" not in _pins()
    try:
        metadata.version("mosaicml-streaming")
    except metadata.PackageNotFoundError:
        return
    raise AssertionError("mosaicml-streaming is installed beside streaming-community")
