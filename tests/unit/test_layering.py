"""The library stays free of Prefect: ranks start fast and run under any launcher."""

import ast
import subprocess
import sys
from pathlib import Path

import trainflow

PACKAGE = Path(trainflow.__file__).parent
ADAPTER = "trainflow.launch.prefect_adapter"


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
    assert "trainflow.launch.backends" in modules and "trainflow.launch.worker" in modules
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


# --- import rules: no loops, and each layer imports only downwards (docs/architecture.md) -----


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The trainflow modules `path` imports anywhere: at the top, inside functions (a lazy
    import is still a dependency) and under `TYPE_CHECKING` alike."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            # A module's own package (its `__init__`) is not a dependency worth a loop.
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: _imports(path, name, set(files)) for name, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_loops_among_trainflow_modules():
    assert _cycles(_graph()) == []


def test_the_cycle_check_finds_a_loop():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The launch package's layers, lowest first: a module imports its own layer or lower ones.
LAUNCH_LAYERS = [
    {"spec", "plan"},
    {"guard", "ship", "run_dir", "processes", "logs", "diagnosis", "environment", "standby"}
    | {"temp"}
    | {"listen"}
    | {"failures", "worker", "agent", "supervisor"},
    {"local", "ray_placement", "ray_gang", "board", "follower", "prefect_adapter", "backends"},
    {"decorator"},
]
# Nothing the launch package may import: what runs on top of it.
ABOVE_LAUNCH = ("trainflow.workloads", "trainflow.configs", "trainflow.strategies", "flows")
# What the compat layer may import besides itself: the errors it raises.
BELOW_COMPAT = ("trainflow.compat", "trainflow.errors")


def _layer(module: str) -> int:
    short = module.removeprefix("trainflow.launch.")
    return next(i for i, layer in enumerate(LAUNCH_LAYERS) if short in layer)


def test_launch_layers_import_downwards_only():
    graph = _graph()
    modules = [m for m in graph if m.startswith("trainflow.launch.")]
    assert {m.removeprefix("trainflow.launch.") for m in modules} == set().union(*LAUNCH_LAYERS)
    upwards = [
        f"{m} -> {t}"
        for m in modules
        for t in graph[m]
        if t.startswith("trainflow.launch.") and _layer(t) > _layer(m)
    ]
    assert upwards == []


def test_launch_never_imports_workloads_flows_or_configs():
    graph = _graph()
    wrong = [
        f"{m} -> {t}"
        for m in graph
        if m.startswith("trainflow.launch")
        for t in graph[m]
        if t.startswith(ABOVE_LAUNCH)
    ]
    assert wrong == []


def test_compat_imports_no_trainflow_module_above_it():
    graph = _graph()
    wrong = [
        f"{m} -> {t}"
        for m in graph
        if m.startswith("trainflow.compat")
        for t in graph[m]
        if not t.startswith(BELOW_COMPAT)
    ]
    assert wrong == []
