"""Framework environments store what they share with .venv once (scripts/share_packages.py).

Real distributions as pip lays them out (dist-info with METADATA and a hashed RECORD, console
scripts in bin/), in two folders standing for .venv and a framework environment.
"""

import base64
import hashlib
import importlib.util
import os
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "share_packages.py"
spec = importlib.util.spec_from_file_location("share_packages", SCRIPT)
share_packages = importlib.util.module_from_spec(spec)
spec.loader.exec_module(share_packages)


def _venv(root: Path) -> Path:
    site = root / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (root / "bin").mkdir()
    return site


def _install(site: Path, name: str, version: str, files: dict[str, str], requires=(), scripts=()):
    """Lay out a distribution the way pip installs a wheel."""
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    records = []
    for relative, text in files.items():
        path = site / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        records.append(f"{relative},sha256={digest.decode()},{len(text)}")
        if relative.endswith(".py"):  # pip's compiled bytecode: in RECORD, no hash
            pyc = path.parent / "__pycache__" / f"{path.stem}.cpython-311.pyc"
            pyc.parent.mkdir(exist_ok=True)
            pyc.write_bytes(b"compiled " + text.encode())
            records.append(f"{pyc.relative_to(site)},,")
    for script in scripts:
        bin_path = site.parents[2] / "bin" / script
        bin_path.write_text(f"#!{site.parents[2] / 'bin' / 'python'}\nimport {name}\n")
        bin_path.chmod(0o755)
        records.append(f"../../../bin/{script},sha256=x,1")
    (site / info).mkdir()
    metadata = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    metadata += [f"Requires-Dist: {r}" for r in requires]
    (site / info / "METADATA").write_text("\n".join(metadata) + "\n")
    (site / info / "INSTALLER").write_text("pip\n")
    records += [f"{info}/METADATA,,", f"{info}/INSTALLER,,", f"{info}/RECORD,,"]
    (site / info / "RECORD").write_text("\n".join(records) + "\n")


def _same(a: Path, b: Path) -> bool:
    return os.path.samefile(a, b)


@pytest.fixture
def envs(tmp_path):
    main = _venv(tmp_path / "main")
    framework_root = tmp_path / "framework"
    framework = _venv(framework_root)
    _install(
        main,
        "bigtorch",
        "2.0",
        {"bigtorch/__init__.py": "torch", "bigtorch/lib.so": "x" * 1000},
        requires=[
            "toolkit[blas]==13.0; python_version >= '3'",
            "helper>=1.0",
            "optional-thing==1.0; extra == 'opt'",
        ],
        scripts=["bigrun"],
    )
    _install(
        main,
        "toolkit",
        "13.0",
        {"toolkit/__init__.py": "tk"},
        requires=["blas==1; extra == 'blas'"],
    )
    _install(main, "blas", "1", {"blas/__init__.py": "blas"})
    _install(main, "helper", "1.5", {"helper.py": "help"})
    _install(main, "optional-thing", "1.0", {"optional_thing.py": "opt"})
    _install(main, "numpy", "2.1", {"numpy/__init__.py": "np 2.1"})
    return main, framework_root, framework


def test_seed_links_pinned_distributions_and_what_they_need(envs, tmp_path, capsys):
    main, framework_root, framework = envs
    requirements = tmp_path / "framework.txt"
    requirements.write_text("# a framework\nbigtorch==2.0\nnumpy==2.4  # newer than .venv's\n")

    share_packages.main(["--from-site", str(main), "seed", str(framework_root), str(requirements)])

    installed = share_packages.distributions(framework)
    # The pin, its exact dependency with the extra it asks for, and a range .venv satisfies.
    assert set(installed) == {"bigtorch", "toolkit", "blas", "helper"}
    assert installed["bigtorch"].version == "2.0"
    for relative in (
        "bigtorch/lib.so",
        "bigtorch/__pycache__/__init__.cpython-311.pyc",
        "blas/__init__.py",
    ):
        assert _same(main / relative, framework / relative), relative
    # Its install records are the framework environment's own, not links into .venv.
    info = "bigtorch-2.0.dist-info/RECORD"
    assert not _same(main / info, framework / info)
    # A console script runs this environment's interpreter.
    script = (framework_root / "bin" / "bigrun").read_text()
    assert script.splitlines()[0] == f"#!{framework_root.absolute() / 'bin' / 'python'}"
    assert os.access(framework_root / "bin" / "bigrun", os.X_OK)
    assert "4 distributions linked from .venv before install" in capsys.readouterr().out


def test_link_replaces_identical_distributions_only(envs, capsys):
    main, framework_root, framework = envs
    _install(framework, "helper", "1.5", {"helper.py": "help"})  # the same files
    _install(
        framework, "numpy", "2.1", {"numpy/__init__.py": "np rebuilt"}
    )  # same version, other bytes

    share_packages.main(["--from-site", str(main), "link", str(framework_root)])

    assert _same(main / "helper.py", framework / "helper.py")
    assert _same(
        main / "__pycache__/helper.cpython-311.pyc",
        framework / "__pycache__/helper.cpython-311.pyc",
    )
    assert not _same(main / "numpy/__init__.py", framework / "numpy/__init__.py")
    assert (framework / "numpy/__init__.py").read_text() == "np rebuilt"
    assert "1 more distributions identical to .venv's now linked" in capsys.readouterr().out

    # Running it again changes nothing.
    share_packages.main(["--from-site", str(main), "link", str(framework_root)])
    assert "0 more distributions" in capsys.readouterr().out


def test_replacing_a_linked_file_the_way_pip_does_leaves_venv_alone(envs):
    main, framework_root, framework = envs
    _install(framework, "helper", "1.5", {"helper.py": "help"})
    share_packages.main(["--from-site", str(main), "link", str(framework_root)])
    target = framework / "helper.py"
    # pip unlinks an installed file before writing its replacement; uninstalling unlinks it.
    target.unlink()
    target.write_text("helper 2.0")
    assert (main / "helper.py").read_text() == "help"
    (framework / "__pycache__/helper.cpython-311.pyc").unlink()
    assert (main / "__pycache__/helper.cpython-311.pyc").exists()


def test_a_bytecode_file_without_its_source_in_venv_is_removed(envs):
    main, framework_root, framework = envs
    _install(framework, "helper", "1.5", {"helper.py": "help"})
    extra_pyc = framework / "__pycache__" / "helper.cpython-312.pyc"  # another Python's
    extra_pyc.write_bytes(b"compiled for the old source")
    record = next(framework.glob("helper-1.5.dist-info")) / "RECORD"
    record.write_text(record.read_text() + "__pycache__/helper.cpython-312.pyc,,\n")

    share_packages.main(["--from-site", str(main), "link", str(framework_root)])

    assert _same(main / "helper.py", framework / "helper.py")
    assert not extra_pyc.exists()  # compiled from a source file that is now .venv's


def test_a_folder_that_is_no_virtual_environment_is_named(tmp_path):
    with pytest.raises(SystemExit, match=r"nowhere: no lib/pythonX.Y/site-packages"):
        share_packages.main(["link", str(tmp_path / "nowhere")])
