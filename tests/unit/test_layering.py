"""The library stays free of Prefect: ranks start fast and run under any launcher."""

import subprocess
import sys
from pathlib import Path

import trainflow

PACKAGE = Path(trainflow.__file__).parent
ADAPTER = "trainflow.prefect_adapter"


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        if name != ADAPTER:
            names.append(name)
    return names


def test_no_trainflow_module_imports_prefect():
    modules = _modules()
    assert "trainflow.launcher" in modules and "trainflow._worker" in modules
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_only_the_adapter_mentions_prefect_imports():
    offenders = [
        str(p)
        for p in PACKAGE.rglob("*.py")
        if p.name != "prefect_adapter.py"
        and any(
            line.lstrip().startswith(("import prefect", "from prefect"))
            for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []
