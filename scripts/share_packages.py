"""Store packages that a framework environment shares with .venv once, as hard links.

    python scripts/share_packages.py seed .venvs/unsloth scripts/frameworks/unsloth.txt
    python scripts/share_packages.py link .venvs/unsloth

Each framework environment (scripts/setup-framework.sh) is a full virtual environment, and
several hold the same large distributions as .venv: Unsloth's torch 2.14.1 with its CUDA
libraries (5.4 GiB), and in every one MLflow's and streaming's dependencies (oci, scipy,
sympy: about 1 GB). Four separate copies came to 26 GB, more than a small build machine has
free. Here an identical distribution is stored once: the framework environment's files are
hard links to .venv's.

- `seed VENV REQUIREMENTS`, before `pip install -r REQUIREMENTS`: links in the distributions
  that REQUIREMENTS pins (`name==version`) at the version .venv has, and what they depend on
  that .venv has at a version the dependency (and any pin of REQUIREMENTS) accepts, extras
  followed (torch's `cuda-toolkit[...]`, `nvidia-*`, triton). pip then finds them satisfied,
  so the largest ones are never copied and the disk never holds both copies.
- `link VENV`, after the install: replaces every distribution of VENV that is identical to
  .venv's (same name, version and file hashes, as their RECORD files list them) with links.

Run it with .venv's interpreter: .venv is the environment it reads. It uses the standard
library and pip's own `packaging` only. Where the two folders cannot hold hard links to each
other (another filesystem), it says so and changes nothing: each keeps its own copies.

Hard links are safe here because neither pip nor Python writes into an installed file: pip
unlinks a file before writing one in its place, and uninstalling removes the link only;
Python writes bytecode to a new file and renames it. Each distribution is linked whole,
its sources and their `__pycache__` together, so bytecode always matches its source.
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import shutil
import sys
import sysconfig
from pathlib import Path

try:  # pip's own copy of `packaging`: present in every environment that has pip
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name as canonical
except ImportError:  # pragma: no cover
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name as canonical


def site_packages(venv: Path) -> Path:
    found = sorted(venv.glob("lib/python*/site-packages"))
    if not found:
        raise SystemExit(f"{venv}: no lib/pythonX.Y/site-packages; is it a virtual environment?")
    return found[0]


def distributions(site: Path) -> dict[str, metadata.Distribution]:
    return {canonical(d.metadata["Name"]): d for d in metadata.distributions(path=[str(site)])}


def pins(requirements: Path) -> dict[str, Requirement]:
    """The `name==version` requirements of a requirements file, by name."""
    found = {}
    for line in requirements.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        requirement = Requirement(line)
        if any(spec.operator in ("==", "===") for spec in requirement.specifier):
            found[canonical(requirement.name)] = requirement
    return found


def _holds(requirement: Requirement, extras: set[str]) -> bool:
    """Whether a dependency applies here, for a distribution asked for with these extras."""
    marker = requirement.marker
    return marker is None or any(marker.evaluate({"extra": e}) for e in extras | {""})


def _content(dist: metadata.Distribution) -> dict[str, str]:
    """A distribution's files inside site-packages with their RECORD hashes."""
    info = _info_dir(dist)
    return {
        str(f): f.hash.value
        for f in dist.files or []
        if f.hash and not str(f).startswith("..") and str(f).split("/")[0] != info
    }


def _info_dir(dist: metadata.Distribution) -> str:
    """The name of the distribution's own *.dist-info folder."""
    for f in dist.files or []:
        if str(f).endswith(".dist-info/RECORD"):
            return str(f).split("/")[0]
    return ""


def _size(dist: metadata.Distribution) -> int:
    total = 0
    for f in dist.files or []:
        path = Path(dist.locate_file(f))
        if not str(f).startswith("..") and path.is_file() and not path.is_symlink():
            total += path.stat().st_size
    return total


def _link(source: Path, target: Path) -> None:
    """Make target a hard link to source, replacing whatever is there in one rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    spare = target.with_name(f".{target.name}.link-{os.getpid()}")
    os.link(source, spare)
    os.replace(spare, target)


def _can_link(source_dir: Path, target_dir: Path) -> bool:
    probe = source_dir / f".share-probe-{os.getpid()}"
    probe.write_bytes(b"")
    try:
        os.link(probe, target_dir / probe.name)
    except OSError as error:
        print(f"not sharing packages: {target_dir} cannot link to {source_dir} ({error})")
        return False
    finally:
        probe.unlink()
        (target_dir / probe.name).unlink(missing_ok=True)
    return True


def _seed_one(dist: metadata.Distribution, site: Path, venv: Path) -> None:
    """Install dist into site as links to its files; its dist-info and scripts are copied."""
    info = _info_dir(dist)
    python = venv.absolute() / "bin" / "python"
    for f in dist.files or []:
        source = Path(dist.locate_file(f))
        if not source.is_file():
            continue
        relative = str(f)
        if relative.startswith(".."):  # a console script in bin/: point it at this venv
            target = (site / relative).resolve()
            if target.parent != (venv / "bin").resolve():
                continue
            text = source.read_bytes()
            if text.startswith(b"#!"):
                text = b"#!" + str(python).encode() + text[text.index(b"\n") :]
            target.write_bytes(text)
            target.chmod(source.stat().st_mode)
        elif relative.split("/")[0] == info:
            (site / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, site / relative)
        else:
            _link(source, site / relative)


def seed(venv: Path, requirements: Path, main_site: Path) -> None:
    site = site_packages(venv)
    if not _can_link(main_site, site):
        return
    ours, theirs, wanted = distributions(main_site), distributions(site), pins(requirements)

    def same(name: str, requirement: Requirement) -> bool:
        """.venv has it at a version this requirement and the framework's own pin accept."""
        dist, pinned = ours.get(name), wanted.get(name)
        return bool(dist) and all(
            r.specifier.contains(dist.version, prereleases=True)
            for r in (requirement, pinned)
            if r is not None
        )

    # The pinned distributions .venv has at that version, then what they depend on that
    # .venv has at an accepted version (torch's cuda-toolkit[...], nvidia-*, triton),
    # following extras. pip keeps an installed distribution that satisfies the resolution.
    todo = [(name, r) for name, r in wanted.items() if same(name, r)]
    chosen: dict[str, metadata.Distribution] = {}
    extras: dict[str, set[str]] = {}
    while todo:
        name, requirement = todo.pop()
        asked = set(requirement.extras)
        if name in theirs or (name in chosen and asked <= extras[name]):
            continue
        chosen[name] = ours[name]
        extras[name] = extras.get(name, set()) | asked
        for line in ours[name].requires or []:
            dependency = Requirement(line)
            dep = canonical(dependency.name)
            if _holds(dependency, extras[name]) and same(dep, dependency):
                todo.append((dep, dependency))
    for dist in chosen.values():
        _seed_one(dist, site, venv)
    size = sum(_size(d) for d in chosen.values())
    gib = size / 2**30
    print(f"{venv}: {len(chosen)} distributions linked from .venv before install ({gib:.1f} GiB)")


def link(venv: Path, main_site: Path) -> None:
    site = site_packages(venv)
    if not _can_link(main_site, site):
        return
    ours = distributions(main_site)
    count = saved = 0
    for name, dist in distributions(site).items():
        source = ours.get(name)
        if source is None or source.version != dist.version:
            continue
        content = _content(dist)
        if not content or content != _content(source):
            continue
        info = _info_dir(dist)
        theirs = {str(f) for f in dist.files or [] if not str(f).startswith("..")}
        theirs = {f for f in theirs if f.split("/")[0] != info}  # its own install records stay
        mine = {str(f) for f in source.files or [] if not str(f).startswith("..")}
        fresh = 0
        for relative in sorted(theirs):
            target, original = site / relative, main_site / relative
            if relative in mine and original.is_file():
                if target.exists() and os.path.samefile(original, target):
                    continue
                fresh += target.stat().st_size if target.is_file() else 0
                _link(original, target)
            elif relative.endswith(".pyc"):
                target.unlink(missing_ok=True)  # compiled from the source it no longer has
        if fresh:
            count += 1
            saved += fresh
    gib = saved / 2**30
    print(f"{venv}: {count} more distributions identical to .venv's now linked ({gib:.1f} GiB)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    seeding = commands.add_parser("seed", help="link in pinned distributions before install")
    seeding.add_argument("venv", type=Path)
    seeding.add_argument("requirements", type=Path)
    linking = commands.add_parser("link", help="link identical distributions after install")
    linking.add_argument("venv", type=Path)
    parser.add_argument(
        "--from-site",
        type=Path,
        default=Path(sysconfig.get_paths()["purelib"]),
        help="site-packages to share from (default: this interpreter's, i.e. .venv's)",
    )
    args = parser.parse_args(argv)
    if args.command == "seed":
        seed(args.venv, args.requirements, args.from_site)
    else:
        link(args.venv, args.from_site)


if __name__ == "__main__":
    sys.exit(main())
